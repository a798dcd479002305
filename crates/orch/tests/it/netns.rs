//! Several hosts for real: network namespaces, one per host, each running `orch worker` with
//! its own `repos_dir`, on a bridge to the test's (root) namespace, which holds what the hosts
//! share: PostgreSQL (a server the test starts with its own data directory, listening on the
//! bridge's address), the repo's remote
//! (`git daemon` serving a bare repository over `git://`) and production (the demo's sample
//! service: deployed into the root namespace with `nsenter`, its health and revision reached
//! through a relay). Staging runs inside each host's own namespace.
//!
//! The test creates the namespaces, the bridge and the links itself and removes them at the
//! end, also when it fails; where the kernel refuses (no CAP_NET_ADMIN, no netns support) it
//! is reported as skipped (`common::skip`).
//!
//! Scenarios:
//! - `a_host_dies_mid_deploy_and_the_host_that_took_over_dies_mid_watch` (issue 16 (c)): three
//!   hosts, one item; the host running its production deploy dies for good right after the
//!   deploy command (a failpoint abort, its link down); after the grace another host takes the
//!   deploy over (markers rebuilt from the events, the live revision confirmed, not deployed
//!   again) and holds the watch; that host dies too (kill -9, link down) and the last one takes
//!   the watch over. The item ends as in a clean run, its deploy applied once.
//! - `three_hosts_release_three_items_one_at_a_time_through_a_cut_link` (issue 16 (a), (b), (d)):
//!   three hosts, three items (shipped, reverted, failed); one host's link is cut while its
//!   agent runs: the host stops the agent itself once its lease has run out, while still cut
//!   off; another host finishes the job; the link comes back and the cut host's attempt is
//!   refused by its fence. No two items are ever on the release track at once (the stage
//!   changes the database accepted, from all three hosts), production deploys and staging runs
//!   never overlap, each production deploy is applied once.

use crate::common;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{ORCH, become_subreaper, demo_setup, orch_db, python_available, reap_orphans};
use orch_store::{ConnectOptions, Event, JobState, Store};

const LEASE_S: &str = "2";
const GRACE_S: &str = "4";

fn sh(args: &[&str]) -> std::process::Output {
    std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("run {args:?}: {e}"))
}

/// Runs `args`; Err names the command and its stderr (a reason a test can print as a skip).
fn try_run(args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", args[0]))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn must(args: &[&str]) {
    let out = sh(args);
    assert!(out.status.success(), "{args:?}: {out:?}");
}

/// The bridge, the namespaces and their links; removed on drop.
struct Net {
    /// `10.<a>.<b>`: this run's /24.
    prefix: String,
    bridge: String,
    hosts: Vec<String>,
}

impl Net {
    /// Bridge `10.a.b.1/24` in the root namespace; host `i` (1-based) is namespace `ns` with
    /// `eth0` at `10.a.b.(10+i)`, its link's root end named [`Net::link`]. Err: the kernel
    /// refused (the reason, for the skip).
    fn create(count: usize) -> Result<Net, String> {
        let pid = std::process::id();
        let tag = format!("{:x}", pid % 0xfffff);
        let prefix = format!("10.{}.{}", 200 + (pid % 50), (pid / 50) % 250);
        let mut net = Net {
            prefix,
            bridge: format!("ob{tag}"),
            hosts: Vec::new(),
        };
        try_run(&["ip", "link", "add", &net.bridge, "type", "bridge"])?;
        let addr = format!("{}.1/24", net.prefix);
        try_run(&["ip", "addr", "add", &addr, "dev", &net.bridge])?;
        try_run(&["ip", "link", "set", &net.bridge, "up"])?;
        for i in 1..=count {
            let ns = format!("orch{tag}h{i}");
            try_run(&["ip", "netns", "add", &ns])?;
            net.hosts.push(ns.clone());
            let link = net.link(i);
            try_run(&[
                "ip", "link", "add", &link, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            try_run(&["ip", "link", "set", &link, "master", &net.bridge])?;
            try_run(&["ip", "link", "set", &link, "up"])?;
            let ip = format!("{}/24", net.host_ip(i));
            try_run(&["ip", "-n", &ns, "addr", "add", &ip, "dev", "eth0"])?;
            try_run(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            try_run(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    /// The bridge's address: what the hosts reach the shared services at.
    fn gateway(&self) -> Ipv4Addr {
        format!("{}.1", self.prefix).parse().unwrap()
    }

    fn host_ip(&self, i: usize) -> String {
        format!("{}.{}", self.prefix, 10 + i)
    }

    /// The root end of host `i`'s link (down = the host is cut off).
    fn link(&self, i: usize) -> String {
        format!("{}v{i}", self.bridge)
    }

    fn set_link(&self, i: usize, up: bool) {
        must(&[
            "ip",
            "link",
            "set",
            &self.link(i),
            if up { "up" } else { "down" },
        ]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in &self.hosts {
            let _ = sh(&["ip", "netns", "del", ns]);
        }
        let _ = sh(&["ip", "link", "del", &self.bridge]);
    }
}

/// Relays TCP connections from `listen` to `target` until the test ends.
async fn relay(listen: SocketAddr, target: SocketAddr) -> u16 {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .unwrap_or_else(|e| panic!("relay: bind {listen}: {e}"));
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    port
}

/// A free TCP port on `ip` (bound, then released for the child that uses it).
fn free_port(ip: Ipv4Addr) -> u16 {
    std::net::TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A PostgreSQL server of the test's own, on the host side (the root namespace), listening on
/// the bridge's address so the hosts reach it as a database across a network: its own data
/// directory (`initdb`), trust authentication for the bridge's /24, stopped on drop. It runs as
/// the `postgres` system user (PostgreSQL refuses to run as root).
struct PgServer {
    child: std::process::Child,
    bin: PathBuf,
    data: PathBuf,
    url: String,
    _dir: tempfile::TempDir,
}

impl PgServer {
    /// Err: the server cannot be started here (the reason, for the skip).
    fn start(listen: Ipv4Addr, prefix: &str) -> Result<PgServer, String> {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .map_err(|e| format!("no PostgreSQL server binaries under /usr/lib/postgresql: {e}"))?
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .find(|b| b.join("initdb").exists() && b.join("postgres").exists())
            .ok_or("no initdb/postgres under /usr/lib/postgresql/*/bin")?;
        let user = "postgres";
        if !sh(&["id", "-u", user]).status.success() {
            return Err(format!("no `{user}` system user to run PostgreSQL as"));
        }
        let dir = tempfile::Builder::new()
            .prefix("orch-netns-pg-")
            .tempdir()
            .map_err(|e| format!("cannot create the server's directory: {e}"))?;
        // The postgres user must reach its data directory and socket directory.
        let run_as = |args: &[&str]| -> Result<(), String> {
            let mut all = vec!["runuser", "-u", user, "--"];
            all.extend_from_slice(args);
            try_run(&all)
        };
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("chmod: {e}"))?;
        let data = dir.path().join("data");
        let sock = dir.path().join("sock");
        for d in [&data, &sock] {
            std::fs::create_dir(d).map_err(|e| format!("mkdir {}: {e}", d.display()))?;
            let own = sh(&["chown", &format!("{user}:"), d.to_str().unwrap()]);
            if !own.status.success() {
                return Err(format!("chown {}: {own:?}", d.display()));
            }
        }
        run_as(&[
            bin.join("initdb").to_str().unwrap(),
            "-D",
            data.to_str().unwrap(),
            "-A",
            "trust",
            "-U",
            "root",
            "--no-sync",
            "--no-instructions",
        ])?;
        let hba = data.join("pg_hba.conf");
        let mut conf = std::fs::read_to_string(&hba).map_err(|e| format!("pg_hba.conf: {e}"))?;
        conf.push_str(&format!("host all all {prefix}.0/24 trust\n"));
        std::fs::write(&hba, conf).map_err(|e| format!("pg_hba.conf: {e}"))?;
        let port = free_port(listen);
        let child = std::process::Command::new("runuser")
            .args(["-u", user, "--"])
            .arg(bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .args(["-c", &format!("listen_addresses={listen}")])
            .args(["-c", &format!("port={port}")])
            .args(["-c", &format!("unix_socket_directories={}", sock.display())])
            .args(["-c", "max_connections=300", "-c", "fsync=off"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start postgres: {e}"))?;
        let server = PgServer {
            child,
            bin,
            data,
            url: format!("postgres://root@{listen}:{port}/postgres"),
            _dir: dir,
        };
        let t0 = Instant::now();
        while !sh(&[
            server.bin.join("pg_isready").to_str().unwrap(),
            "-q",
            "-h",
            &listen.to_string(),
            "-p",
            &port.to_string(),
        ])
        .status
        .success()
        {
            if t0.elapsed() > Duration::from_secs(60) {
                return Err(format!(
                    "the test's PostgreSQL never listened on {listen}:{port}"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(server)
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = sh(&[
            "runuser",
            "-u",
            "postgres",
            "--",
            self.bin.join("pg_ctl").to_str().unwrap(),
            "stop",
            "-m",
            "immediate",
            "-D",
            self.data.to_str().unwrap(),
        ]);
        let _ = self.child.kill();
        let _ = self.child.wait();
        reap_orphans();
    }
}

/// Everything a scenario runs on.
struct Cluster {
    net: Net,
    dir: PathBuf,
    /// The database URL, the same from every host and from the test: the bridge's address.
    url: String,
    store: Store,
    git_daemon: std::process::Child,
    workers: BTreeMap<usize, tokio::process::Child>,
    pg: Option<PgServer>,
    _tmp: tempfile::TempDir,
}

impl Cluster {
    /// None: the scenario cannot run here (skipped, said why).
    async fn start(hosts: usize) -> Option<Cluster> {
        if !python_available() {
            common::skip("python3 is not installed: the demo's sample service cannot run");
            return None;
        }
        let net = match Net::create(hosts) {
            Ok(n) => n,
            Err(why) => {
                common::skip(&format!("network namespaces are not available here: {why}"));
                return None;
            }
        };
        become_subreaper();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("demo");
        demo_setup(&dir);
        let gw = net.gateway();

        // The remote: a bare copy of the service repo behind git daemon on the bridge.
        let remotes = dir.join("remotes");
        std::fs::create_dir_all(&remotes).unwrap();
        must(&[
            "git",
            "clone",
            "--quiet",
            "--bare",
            dir.join("service").to_str().unwrap(),
            remotes.join("service.git").to_str().unwrap(),
        ]);
        let git_port = free_port(gw);
        let git_daemon = std::process::Command::new("git")
            .arg("daemon")
            .args(["--reuseaddr", "--export-all", "--enable=receive-pack"])
            .arg(format!("--listen={gw}"))
            .arg(format!("--port={git_port}"))
            .arg(format!("--base-path={}", remotes.display()))
            .arg(&remotes)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn git daemon");
        let t0 = Instant::now();
        while std::net::TcpStream::connect((gw, git_port)).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "git daemon never listened"
            );
            std::thread::sleep(Duration::from_millis(50));
        }

        // orch.toml: the remote over git://, production in the root namespace.
        let toml_path = dir.join("orch.toml");
        let toml = std::fs::read_to_string(&toml_path).unwrap();
        let prod_port: u16 = toml
            .lines()
            .find_map(|l| l.strip_prefix("health_url = \"http://127.0.0.1:"))
            .and_then(|rest| rest.split('/').next())
            .and_then(|p| p.parse().ok())
            .expect("the demo's production port");
        // The test process is in the root namespace: production is deployed there.
        let nsenter = format!("nsenter --net=/proc/{}/ns/net sh ", std::process::id());
        let nsenter = nsenter.as_str();
        let toml = toml
            .replace(
                "path = \"service\"",
                &format!("url = \"git://{gw}:{git_port}/service.git\""),
            )
            .replace(
                "deploy = \"sh deploy.sh production",
                &format!("deploy = \"{nsenter}deploy.sh production"),
            )
            .replace(
                "rollback = \"sh rollback.sh production",
                &format!("rollback = \"{nsenter}rollback.sh production"),
            )
            .replace(
                &format!("http://127.0.0.1:{prod_port}/"),
                &format!("http://{gw}:{prod_port}/"),
            )
            .replace("window_s = 8", "window_s = 16");
        std::fs::write(&toml_path, &toml).unwrap();
        relay(
            SocketAddr::from((gw, prod_port)),
            SocketAddr::from(([127, 0, 0, 1], prod_port)),
        )
        .await;
        // Production runs the initial release (in the root namespace).
        let deploy = toml
            .lines()
            .find(|l| l.starts_with("deploy = ") && l.contains("deploy.sh production"))
            .unwrap()
            .trim_start_matches("deploy = ")
            .trim_matches('"')
            .replace(nsenter, "sh ");
        let out = std::process::Command::new("sh")
            .args(["-c", &deploy])
            .current_dir(dir.join("service"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");

        // The shared database: a PostgreSQL server of this test's own on the bridge.
        let pg = match PgServer::start(gw, &net.prefix) {
            Ok(pg) => pg,
            Err(why) => {
                let mut git_daemon = git_daemon;
                let _ = git_daemon.kill();
                let _ = git_daemon.wait();
                common::skip(&format!("cannot start the test's own PostgreSQL: {why}"));
                return None;
            }
        };
        let url = pg.url.clone();
        orch_db(&dir, &url, &["migrate"]);
        let store = Store::connect(&url, ConnectOptions::default())
            .await
            .unwrap();
        Some(Cluster {
            net,
            dir,
            url,
            store,
            git_daemon,
            workers: BTreeMap::new(),
            pg: Some(pg),
            _tmp: tmp,
        })
    }

    fn node(i: usize) -> String {
        format!("h{i}")
    }

    /// `orch worker --node h<i>` inside host `i`'s namespace, with its own `repos_dir`; its log
    /// (warnings) in `<dir>/h<i>.log`.
    fn start_worker(&mut self, i: usize, agent_sleep_ms: u64) {
        self.start_worker_with(i, agent_sleep_ms, "");
    }

    /// [`Cluster::start_worker`] with `failpoints` (`ORCH_FAILPOINTS`) active.
    fn start_worker_with(&mut self, i: usize, agent_sleep_ms: u64, failpoints: &str) {
        let log = std::fs::File::create(self.dir.join(format!("h{i}.log"))).unwrap();
        let child = tokio::process::Command::new("ip")
            .args(["netns", "exec", &self.net.hosts[i - 1], ORCH])
            .arg("--config")
            .arg(self.dir.join("orch.toml"))
            .args(["--database-url", &self.url])
            .args(["worker", "--node", &Self::node(i), "--worker-id"])
            .arg(format!("worker-h{i}"))
            .args(["--grace-s", "1"])
            .env("ORCH_REPOS_DIR", self.dir.join(format!("h{i}/repos")))
            .env("ORCH_LOG", "warn")
            .env("ORCH_LEASE_S", LEASE_S)
            .env("ORCH_NODE_GRACE_S", GRACE_S)
            .env("ORCH_DEMO_AGENT_SLEEP_MS", agent_sleep_ms.to_string())
            .env("ORCH_FAILPOINTS", failpoints)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn orch worker in its namespace");
        self.workers.insert(i, child);
    }

    /// kill -9 of host `i`'s orch (its process group).
    async fn kill_worker(&mut self, i: usize) {
        if let Some(mut child) = self.workers.remove(&i) {
            if let Some(pid) = child.id() {
                // SAFETY: signalling our own child's process group.
                unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
            }
            let _ = child.wait().await;
            reap_orphans();
        }
    }

    /// The pid of host `i`'s orch (`ip netns exec` execs it), while it runs.
    fn worker_pid(&self, i: usize) -> Option<i32> {
        self.workers
            .get(&i)?
            .id()
            .and_then(|p| i32::try_from(p).ok())
    }

    /// Every process in host `i`'s namespace with its command line.
    fn processes(&self, i: usize) -> Vec<(i32, String)> {
        let out = sh(&["ip", "netns", "pids", &self.net.hosts[i - 1]]);
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
            .filter_map(|pid| {
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                let cmd: Vec<String> = cmd
                    .split(|b| *b == 0)
                    .filter(|a| !a.is_empty())
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect();
                Some((pid, cmd.join(" ")))
            })
            .collect()
    }

    /// The demo agents running on host `i`: the agent itself, or the sandbox running it (the
    /// agent is in the sandbox's own network namespace, bwrap in the host's).
    fn agents(&self, i: usize) -> Vec<i32> {
        self.processes(i)
            .into_iter()
            .filter(|(_, cmd)| is_agent(cmd))
            .map(|(pid, _)| pid)
            .collect()
    }

    fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.join(format!("h{i}.log"))).unwrap_or_default()
    }

    fn submit(&self, title: &str) -> String {
        let out = orch_db(
            &self.dir,
            &self.url,
            &[
                "submit",
                "--repo",
                "service",
                "--title",
                title,
                "--body",
                "As the title says.",
                "--json",
            ],
        );
        let v: serde_json::Value = serde_json::from_str(&out).expect("submit --json");
        v["work_item_id"]
            .as_str()
            .or_else(|| v["id"].as_str())
            .expect("the work item id")
            .to_owned()
    }

    async fn stop(mut self) {
        let hosts: Vec<usize> = self.workers.keys().copied().collect();
        for i in hosts {
            if let Some(child) = self.workers.remove(&i) {
                common::terminate(child).await;
            }
        }
        common::stop_service(&self.dir);
        let _ = self.git_daemon.kill();
        let _ = self.git_daemon.wait();
        self.store.close().await;
        drop(self.pg.take());
        reap_orphans();
    }
}

fn production_deploys(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("service-state/effects.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("deploy production "))
        .map(str::to_owned)
        .collect()
}

fn data(e: &Event) -> serde_json::Value {
    serde_json::from_str(&e.data).unwrap_or_default()
}

async fn until<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = Instant::now();
    while !cond().await {
        assert!(t0.elapsed() < limit, "no {what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What a scenario's item went through, for a failure message.
async fn story(store: &Store, id: &str) -> Vec<String> {
    let t = common::task(store, id).await;
    store
        .task_events(t.id)
        .await
        .unwrap()
        .iter()
        .map(|e| format!("{} {}", e.kind, e.message))
        .collect()
}

/// The hosts that died, and what was left when they did: host 1 alone runs the item until its
/// production deploy command has run and dies right after it (a failpoint abort: the deploy
/// is live, its markers on host 1's disk say INITIATED and nothing more), its link cut for
/// good. Hosts 2 and 3 start; after the grace one of them takes the deploy over, rebuilds the
/// markers from the events, confirms the live revision without deploying it again and arms the
/// watch on its own node. Once that watch has polled twice its host dies too (kill -9, link
/// down), and the last host takes the watch over after the grace. The item ends as in a
/// one-host run: done, shipped, the production deploy applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_dies_mid_deploy_and_the_host_that_took_over_dies_mid_watch() {
    let Some(mut c) = Cluster::start(3).await else {
        return;
    };
    let before = production_deploys(&c.dir).len();
    let id = c.submit("Add a /version endpoint");
    let store = c.store.clone();

    // Host 1 alone, until it dies right after the production deploy command.
    c.start_worker_with(1, 50, "deploy.after_command");
    let mut h1 = c.workers.remove(&1).unwrap();
    match tokio::time::timeout(Duration::from_secs(300), h1.wait()).await {
        Ok(status) => assert!(!status.unwrap().success(), "host 1 died at its failpoint"),
        Err(_) => panic!(
            "host 1 never reached its deploy: {:#?}\n{}",
            story(&store, &id).await,
            c.log(1)
        ),
    }
    reap_orphans();
    c.net.set_link(1, false);
    assert!(
        c.log(1).contains("failpoint deploy.after_command hit"),
        "{}",
        c.log(1)
    );
    let deployed = production_deploys(&c.dir);
    assert_eq!(
        deployed.len(),
        before + 1,
        "host 1's deploy ran: {deployed:?}"
    );
    let t = common::task(&store, &id).await;
    assert_eq!(t.stage, "deploy", "{:#?}", story(&store, &id).await);

    // The deploy is taken over, confirmed, and watched on a surviving host.
    c.start_worker(2, 50);
    c.start_worker(3, 50);
    let t0 = Instant::now();
    let watcher = loop {
        let jobs = store.task_jobs(t.id).await.unwrap();
        let polled = jobs
            .iter()
            .filter(|j| j.agent == "post-deploy-monitor" && j.state == JobState::Done)
            .count();
        let live = jobs
            .iter()
            .rev()
            .find(|j| j.agent == "post-deploy-monitor" && j.state.is_live())
            .and_then(|j| j.node.clone());
        if polled >= 2
            && let Some(node) = live
        {
            break node;
        }
        let now = common::task(&store, &id).await;
        assert!(
            !now.is_terminal() && t0.elapsed() < Duration::from_secs(240),
            "no two polls of the watch after the deploy's takeover (at {}): {:#?}\nlogs: {:#?}",
            now.stage,
            story(&store, &id).await,
            (2..=3).map(|i| c.log(i)).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_ne!(watcher, "h1");
    let w: usize = watcher.trim_start_matches('h').parse().unwrap();
    // The host that took the deploy over and holds the watch dies for good.
    c.kill_worker(w).await;
    c.net.set_link(w, false);
    let died = Instant::now();

    let t = common::wait_terminal(&store, &id, Duration::from_secs(240)).await;
    let took = died.elapsed();
    let history = store.task_events(t.id).await.unwrap();
    let summary: Vec<String> = history
        .iter()
        .map(|e| format!("{} {}", e.kind, e.message))
        .collect();
    let deploys = production_deploys(&c.dir);
    let last = 5 - w;
    let left = c.processes(last);
    // The job that ended the item (`lessons`) is completed just after it moved the task to
    // `done` (the stage's move and the job's completion are two fenced writes): give it the
    // moment, then nothing of the item may be live.
    let t_jobs = Instant::now();
    let mut jobs = live_jobs(&store, t.id).await;
    while !jobs.is_empty() && t_jobs.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        jobs = live_jobs(&store, t.id).await;
    }
    c.stop().await;

    assert_eq!(t.stage, "done", "{summary:#?}");
    let done = history
        .iter()
        .rev()
        .find(|e| e.kind == "task.done")
        .unwrap();
    assert_eq!(data(done)["outcome"], "shipped", "{summary:#?}");
    let takeovers: Vec<serde_json::Value> = history
        .iter()
        .filter(|e| e.kind == "node.takeover")
        .map(|e| {
            let mut d = data(e);
            d["at"] = e.created_at.into();
            d
        })
        .collect();
    assert_eq!(takeovers.len(), 2, "{summary:#?}");
    // First the deploy, from host 1, by the host that then watched.
    assert_eq!(takeovers[0]["stage"], "deploy", "{takeovers:?}");
    assert_eq!(takeovers[0]["from"], "h1");
    assert_eq!(takeovers[0]["to"], watcher.as_str());
    // Then the watch, from that host, by the last one.
    assert_eq!(takeovers[1]["stage"], "observe", "{takeovers:?}");
    assert_eq!(takeovers[1]["from"], watcher.as_str());
    assert_eq!(takeovers[1]["to"], Cluster::node(last).as_str());
    for t in &takeovers {
        let waited = t["at"].as_i64().unwrap() - t["last_seen_ms"].as_i64().unwrap();
        assert!(waited > 4_000, "taken over within the grace: {t}");
    }
    assert!(
        history.iter().any(|e| e.kind == "deploy.markers_restored"),
        "{summary:#?}"
    );
    assert!(
        !history.iter().any(|e| e.kind == "deploy.redeployed"),
        "the live revision was deployed again: {summary:#?}"
    );
    assert!(
        history.iter().any(|e| e.kind == "post_deploy.taken_over"),
        "{summary:#?}"
    );
    let verdict = history
        .iter()
        .find(|e| e.kind == "post_deploy.verdict")
        .expect("a verdict");
    assert!(
        data(verdict)["evidence_lost"]
            .as_str()
            .is_some_and(|l| l.contains(&format!("node {watcher}"))),
        "{}",
        verdict.data
    );
    let revision = history
        .iter()
        .find(|e| e.kind == "deploy.confirmed")
        .map(|e| data(e)["revision"].as_str().unwrap().to_owned())
        .unwrap();
    assert_eq!(
        deploys[before..].iter().filter(|r| **r == revision).count(),
        1,
        "production deploys: {deploys:?}"
    );
    assert_eq!(deploys.len(), before + 1, "production deploys: {deploys:?}");
    // Nothing of the item left running on the last host.
    assert!(!left.iter().any(|(_, cmd)| is_agent(cmd)), "{left:?}");
    assert!(jobs.is_empty(), "live jobs left: {jobs:?}");
    eprintln!(
        "netns takeover: h1 died after its deploy command, {watcher} took the deploy over {:.1} s after h1 was last seen and died holding the watch; h{last} took the watch over {:.1} s after {watcher} was last seen; item done {:.1} s after the second death",
        (takeovers[0]["at"].as_i64().unwrap() - takeovers[0]["last_seen_ms"].as_i64().unwrap())
            as f64
            / 1000.0,
        (takeovers[1]["at"].as_i64().unwrap() - takeovers[1]["last_seen_ms"].as_i64().unwrap())
            as f64
            / 1000.0,
        took.as_secs_f64()
    );
}

/// The jobs of `task` still queued or running.
async fn live_jobs(store: &Store, task: i64) -> Vec<(i64, String, JobState)> {
    store
        .task_jobs(task)
        .await
        .unwrap()
        .into_iter()
        .filter(|j| j.state.is_live())
        .map(|j| (j.id, j.agent, j.state))
        .collect()
}

const ITEMS: [(&str, &str); 3] = [
    ("Add a /version endpoint", "shipped"),
    ("Make the greeting configurable", "reverted"),
    ("Add a banner", "failed"),
];

/// One run of deploy.sh or rollback.sh from the sample service's `deploys.log`:
/// (kind, env, revision, start ns, end ns).
type ScriptRun = (String, String, String, u128, Option<u128>);

fn script_runs(dir: &Path) -> Vec<ScriptRun> {
    let log = std::fs::read_to_string(dir.join("service-state/deploys.log")).unwrap_or_default();
    let mut open: BTreeMap<(String, String, String), Vec<usize>> = BTreeMap::new();
    let mut runs: Vec<ScriptRun> = Vec::new();
    for line in log.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [what, kind, env, rev, at, ..] = f.as_slice() else {
            continue;
        };
        let key = ((*kind).to_owned(), (*env).to_owned(), (*rev).to_owned());
        let at: u128 = at.parse().unwrap_or(0);
        if *what == "start" {
            open.entry(key.clone()).or_default().push(runs.len());
            runs.push((key.0, key.1, key.2, at, None));
        } else if let Some(i) = open.get_mut(&key).and_then(Vec::pop) {
            runs[i].4 = Some(at);
        }
    }
    runs
}

/// No two runs of `env` that ended overlap, whichever host ran them.
fn assert_serial(runs: &[ScriptRun], env: &str) {
    let mut mine: Vec<&ScriptRun> = runs
        .iter()
        .filter(|r| r.1 == env && r.4.is_some())
        .collect();
    mine.sort_by_key(|r| r.3);
    for pair in mine.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        assert!(
            b.3 >= a.4.unwrap_or(u128::MAX),
            "{env}: {} of {:.12} overlaps {} of {:.12}",
            a.0,
            a.2,
            b.0,
            b.2
        );
    }
}

/// The outcome each item's terminal event records.
async fn outcomes(store: &Store, ids: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for id in ids {
        let t = common::task(store, id).await;
        let events = store.task_events(t.id).await.unwrap();
        out.push(
            events
                .iter()
                .rev()
                .find(|e| e.kind.starts_with("task.") && e.data.contains("\"outcome\""))
                .and_then(|e| data(e)["outcome"].as_str().map(str::to_owned))
                .unwrap_or_else(|| format!("stage {}", t.stage)),
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hosts_release_three_items_one_at_a_time_through_a_cut_link() {
    let Some(mut c) = Cluster::start(3).await else {
        return;
    };
    let ids: Vec<String> = ITEMS.iter().map(|(title, _)| c.submit(title)).collect();
    // LLM stages take 6 s, so a cut link catches its host in the middle of one.
    for i in 1..=3 {
        c.start_worker(i, 6_000);
    }
    let store = c.store.clone();
    let t0 = Instant::now();
    // (b) Cut the link of a host while it runs an agent stage (its agent process is up).
    let (host, job, attempt, agents) = loop {
        let stats = store.queue_stats().await.unwrap();
        let found = stats.leases.iter().find_map(|l| {
            let host: usize = l
                .worker
                .as_deref()?
                .strip_prefix("worker-h")?
                .parse()
                .ok()?;
            ["analyst", "architect", "developer", "reviewer"]
                .contains(&l.agent.as_str())
                .then_some((host, l.job_id, l.attempt))
        });
        if let Some((host, job, attempt)) = found {
            let agents = c.agents(host);
            if !agents.is_empty() {
                break (host, job, attempt, agents);
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no agent stage ran"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    c.net.set_link(host, false);
    let cut = Instant::now();
    // Cut off, the host cannot renew its lease: once the lease has run out it stops the stage
    // on its own, its agent killed, while the link is still down (not when it comes back).
    let orch_pid = c.worker_pid(host).expect("the cut host's orch runs");
    until(
        Duration::from_secs(30),
        "the cut host's agent stopped while it is cut off",
        || {
            let left: Vec<i32> = c.agents(host);
            let gone = agents.iter().all(|a| !left.contains(a)) && left.is_empty();
            async move { gone }
        },
    )
    .await;
    let stopped_after = cut.elapsed();
    assert!(
        c.processes(host).iter().any(|(p, _)| *p == orch_pid),
        "the cut host's orch itself keeps running"
    );
    assert!(
        c.log(host).contains("lease lost here"),
        "h{host} says why it stopped:\n{}",
        c.log(host)
    );
    // Its lease expires, another host rescues the job and runs it.
    until(
        Duration::from_secs(60),
        "the cut host's job rescued and run elsewhere",
        || {
            let store = store.clone();
            async move {
                let j = store.get_job(job).await.unwrap().unwrap();
                j.attempt > attempt
                    && j.locked_by.as_deref() != Some(&format!("worker-h{host}"))
                    && j.state != JobState::Queued
            }
        },
    )
    .await;
    let moved_after = cut.elapsed();
    // The host comes back while its own run of the stage is still going.
    c.net.set_link(host, true);

    let t1 = Instant::now();
    loop {
        let mut all = true;
        for id in &ids {
            all &= common::task(&store, id).await.is_terminal();
        }
        if all {
            break;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(600),
            "not every item ended within 600 s: {:?}",
            outcomes(&store, &ids).await
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // The job that ended an item completes after its stage change (and the worktree's removal)
    // commits: nothing may stay running once that short tail is over.
    let t2 = Instant::now();
    loop {
        let mut running = Vec::new();
        for id in &ids {
            let t = common::task(&store, id).await;
            for j in store.task_jobs(t.id).await.unwrap() {
                if j.state == JobState::Running {
                    running.push(format!(
                        "{id}: job {} ({}) attempt {} on {:?}, lease until {:?}",
                        j.id, j.agent, j.attempt, j.locked_by, j.lease_expires_at
                    ));
                }
            }
        }
        if running.is_empty() {
            break;
        }
        assert!(
            t2.elapsed() < Duration::from_secs(30),
            "jobs still running 30 s after every item ended: {running:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let got = outcomes(&store, &ids).await;
    let report = common::items_report(&store, &ids, true, 40).await;
    let runs = script_runs(&c.dir);
    let cut_log = c.log(host);
    let mut chains = Vec::new();
    let mut workers = std::collections::BTreeSet::new();
    let mut merged_on = std::collections::BTreeSet::new();
    for id in &ids {
        let t = common::task(&store, id).await;
        chains.push((id.clone(), store.task_events(t.id).await.unwrap()));
        for j in store.task_jobs(t.id).await.unwrap() {
            if j.agent == "merge-gate" {
                merged_on.extend(j.locked_by.clone());
            }
            workers.extend(j.locked_by);
        }
    }
    c.stop().await;

    // (a) Every item ended as the release train decides, across three hosts.
    let want: Vec<String> = ITEMS.iter().map(|(_, o)| (*o).to_owned()).collect();
    assert_eq!(got, want, "outcomes\n{report}\nscript runs: {runs:?}");
    // (b) The cut host's own run of the job was fenced: it learnt its lease was lost and wrote
    // nothing for it; every stage change follows the previous one (no visit applied twice).
    assert!(
        cut_log.contains("lease lost") || cut_log.contains("lease was lost"),
        "the cut host h{host} saw its lease lost:\n{cut_log}"
    );
    for (id, events) in &chains {
        let changes: Vec<(String, String)> = events
            .iter()
            .filter(|e| {
                e.kind == "stage.advanced"
                    || e.kind == "stage.loop_back"
                    || e.kind.starts_with("task.") && e.kind != "task.submitted"
            })
            .map(|e| {
                let d = data(e);
                (
                    d["from"].as_str().unwrap_or("?").to_owned(),
                    d["to"].as_str().unwrap_or("?").to_owned(),
                )
            })
            .collect();
        for pair in changes.windows(2) {
            assert_eq!(pair[0].1, pair[1].0, "{id}: stage changes {changes:?}");
        }
        assert!(
            !events.iter().any(|e| e.job_id == Some(job)
                && e.kind == "stage.advanced"
                && data(e)["attempt"].as_i64() == Some(attempt)),
            "{id}: the cut host's attempt {attempt} of job {job} advanced nothing"
        );
    }
    // (d) One release at a time across the hosts: production deploys and rollbacks, and staging
    // runs, never overlapped; no production effect ran twice for one revision.
    assert_serial(&runs, "production");
    assert_serial(&runs, "staging");
    let mut counted: BTreeMap<(String, String), usize> = BTreeMap::new();
    for r in runs.iter().filter(|r| r.1 == "production" && r.4.is_some()) {
        *counted.entry((r.0.clone(), r.2.clone())).or_default() += 1;
    }
    for ((kind, rev), n) in counted {
        assert_eq!(n, 1, "production {kind} of {rev:.12} ran {n} times");
    }
    // (d) The release track itself, from the stage changes the database accepted: no two items
    // were ever on it (merge … lessons) at once, whichever host moved them. Ordered by event
    // id, not time: an entry is written after the check that saw the previous holder's exit
    // committed, so its id is the larger (times are stamped before the transaction waits).
    let track = ["merge", "staging", "deploy", "observe", "lessons"];
    let mut held: Vec<(i64, i64, String)> = Vec::new();
    for (id, events) in &chains {
        let mut entered: Option<i64> = None;
        for e in events {
            let d = data(e);
            let Some(to) = d["to"].as_str() else { continue };
            if d["from"].as_str().is_none() {
                continue;
            }
            match (entered, track.contains(&to)) {
                (None, true) => entered = Some(e.id),
                (Some(at), false) => {
                    held.push((at, e.id, id.clone()));
                    entered = None;
                }
                _ => {}
            }
        }
        assert!(entered.is_none(), "{id} ended on the release track");
    }
    held.sort();
    for pair in held.windows(2) {
        assert!(
            pair[1].0 >= pair[0].1,
            "{} entered the release track (event {}) while {} held it (until event {})",
            pair[1].2,
            pair[1].0,
            pair[0].2,
            pair[0].1
        );
    }
    assert!(
        held.len() >= ITEMS.len() - 1,
        "the items that reached the track: {held:?}"
    );
    assert_eq!(
        workers.len(),
        3,
        "the items' jobs ran on all three hosts: {workers:?}"
    );
    eprintln!(
        "netns release: h{host}'s link cut; its agent stopped {:.1} s and its job ran elsewhere {:.1} s after the cut (lease {LEASE_S} s); outcomes {got:?}; merges ran on {merged_on:?}",
        stopped_after.as_secs_f64(),
        moved_after.as_secs_f64()
    );
}

/// Whether a command line is a demo agent's, or the sandbox's that runs one.
fn is_agent(cmd: &str) -> bool {
    cmd.contains(" demo-agent") || cmd.contains("/demo-agent.sh")
}
