//! `orch_exec::sandbox` against real bubblewrap: what a sandboxed run can see, write and reach,
//! and that nothing it starts outlives it. Each test is an escape that works without the
//! sandbox. Skipped (and said so) where bwrap cannot run; `ORCH_REQUIRE_ALL=1` or
//! `ORCH_REQUIRE_SANDBOX=1` (CI, once bubblewrap is installed) makes that a failure.

use std::io::{Read as _, Write as _};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use orch_exec::process::{Cmd, ExitKind, Output, run};
use orch_exec::sandbox::{self, Endpoint, Init, Limits, Network, Sandbox};

/// The sandbox when this machine can run one; `None` (after saying why) otherwise.
fn available() -> bool {
    match sandbox::probe(Path::new("bwrap")) {
        Ok(_) => true,
        Err(why) => {
            let required = |v: &str| std::env::var_os(v).is_some_and(|v| v == "1");
            if required("ORCH_REQUIRE_ALL") || required("ORCH_REQUIRE_SANDBOX") {
                panic!("the sandbox cannot run here: {why}");
            }
            eprintln!("SKIPPED: the sandbox cannot run here: {why}");
            false
        }
    }
}

fn base(work: &Path) -> Sandbox {
    let mut sb = Sandbox::new();
    sb.writable = vec![work.to_owned()];
    sb.init = Some(Init {
        program: PathBuf::from(env!("CARGO_BIN_EXE_orch-sandbox-relay")),
        args: Vec::new(),
    });
    sb
}

fn sh(sb: Sandbox, dir: &Path, script: &str) -> Cmd {
    Cmd::new("sh")
        .arg("-c")
        .arg(script)
        .cwd(dir)
        .env_allow(Vec::<String>::new())
        .timeout(Duration::from_secs(60))
        .sandbox(Arc::new(sb))
}

async fn ok(cmd: Cmd) -> Output {
    let out = run(&cmd).await.unwrap();
    assert_eq!(out.status, ExitKind::Exited(0), "{}", out.tail_text(40));
    out
}

#[tokio::test]
async fn the_worktree_is_writable_and_everything_else_read_only_or_hidden() {
    if !available() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let work = root.path().join("work");
    let secret_dir = root.path().join("state");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::create_dir_all(&secret_dir).unwrap();
    std::fs::write(secret_dir.join("orch.db"), "the queue").unwrap();
    let config = root.path().join("orch.toml");
    std::fs::write(&config, "token = \"s3cret\"").unwrap();
    let mut sb = base(&work);
    sb.hidden.push(secret_dir.clone());
    sb.hidden.push(config.clone());
    // What HOME holds besides the toolchains the run's PATH needs (shown read-only): it must
    // not be visible.
    let home = PathBuf::from(std::env::var("HOME").unwrap_or_default());
    let path = std::env::var_os("PATH").unwrap_or_default();
    let shown: Vec<PathBuf> = std::env::split_paths(&path)
        .filter_map(|d| {
            d.strip_prefix(&home)
                .ok()
                .and_then(|r| r.components().next())
                .map(|c| home.join(c))
        })
        .collect();
    let private: Vec<PathBuf> = std::fs::read_dir(&home)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| !shown.contains(p))
                .collect()
        })
        .unwrap_or_default();
    let mut script = format!(
        "echo made > made.txt; \
         if cat {db} 2>/dev/null; then echo SAW-DB; fi; \
         if grep -q s3cret {cfg} 2>/dev/null; then echo SAW-CONFIG; fi; \
         touch /etc/orch-escape 2>/dev/null; touch {outside} 2>/dev/null; ",
        db = secret_dir.join("orch.db").display(),
        cfg = config.display(),
        outside = root.path().join("escape").display(),
    );
    for p in &private {
        script.push_str(&format!(
            "if [ -e '{}' ]; then echo 'SAW {}'; fi; ",
            p.display(),
            p.display()
        ));
    }
    script.push_str("echo done");
    let out = ok(sh(sb, &work, &script)).await;
    let text = out.stdout_lossy();
    assert_eq!(text.trim(), "done", "{text}");
    // Checked on the host: the worktree got the file, nothing else changed.
    assert_eq!(
        std::fs::read_to_string(work.join("made.txt")).unwrap(),
        "made\n"
    );
    assert!(!root.path().join("escape").exists());
    assert!(!Path::new("/etc/orch-escape").exists());
}

#[tokio::test]
async fn a_run_cannot_see_orch_in_proc_nor_its_environment() {
    if !available() {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let me = std::process::id();
    // SAFETY: test-only; set before the child is spawned and never read concurrently by C code.
    unsafe { std::env::set_var("ORCH_TOKEN", "tok-in-orch") };
    let script = format!(
        "if [ -e /proc/{me}/environ ] && grep -q tok-in-orch /proc/{me}/environ 2>/dev/null; then echo SAW-TOKEN; fi; \
         if [ -n \"$ORCH_TOKEN\" ]; then echo GOT-TOKEN; fi; \
         ls /proc | grep -c '^[0-9]'"
    );
    let out = ok(sh(base(work.path()), work.path(), &script)).await;
    let text = out.stdout_lossy();
    assert!(
        !text.contains("SAW-TOKEN") && !text.contains("GOT-TOKEN"),
        "{text}"
    );
    let procs: u32 = text.trim().lines().last().unwrap().parse().unwrap();
    assert!(
        procs <= 6,
        "the run sees {procs} processes: not its own pid namespace"
    );
}

#[tokio::test]
async fn a_daemon_started_with_setsid_dies_with_the_run() {
    if !available() {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let marker = format!("orch-sandbox-daemon-{}", std::process::id());
    let script = format!("setsid sh -c 'exec -a {marker} sleep 300' & sleep 0.2; echo started");
    ok(sh(base(work.path()), work.path(), &script)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let alive = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
            .any(|c| String::from_utf8_lossy(&c).contains(&marker));
        if !alive {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the setsid daemon outlived its run"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_fork_bomb_stops_at_the_process_limit() {
    if !available() {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let mut sb = base(work.path());
    sb.limits = Limits {
        processes: Some(40),
        ..Limits::default()
    };
    // 200 sleepers; the count of processes is taken with the shell's own glob (no fork).
    let script = "( i=0; while [ $i -lt 200 ]; do sleep 30 & i=$((i+1)); done ) 2>/dev/null; \
                  set -- /proc/[0-9]*; echo $#";
    let out = run(&sh(sb, work.path(), script)).await.unwrap();
    let started: u32 = out.stdout_lossy().trim().parse().unwrap_or(0);
    assert!(started > 0, "{}", out.tail_text(20));
    eprintln!("{started} processes with a limit of 40");
    if sandbox::limits_support().starts_with("no cgroup") {
        eprintln!("SKIPPED: no cgroup orch may write here; RLIMIT_NPROC does not bind root");
        return;
    }
    assert!(
        started < 40,
        "{started} processes started past a limit of 40"
    );
}

/// A loopback HTTP server answering `name` to every request, on a free port.
fn server(name: &'static str) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            let body = name;
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    port
}

#[tokio::test]
async fn the_network_is_closed_unless_allowed_and_the_allowlist_is_enforced() {
    if !available() {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let (allowed, other) = (server("allowed"), server("other"));
    let get = |port: u16| format!("curl -s -m 5 http://127.0.0.1:{port}/ || echo REFUSED-{port}");
    let script = format!("{}; echo; {}; echo", get(allowed), get(other));
    let lines = |o: &Output| -> String {
        o.stdout_lossy()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .collect::<Vec<_>>()
            .join("\n")
    };

    let closed = ok(sh(base(work.path()), work.path(), &script)).await;
    assert_eq!(
        lines(&closed),
        format!("REFUSED-{allowed}\nREFUSED-{other}")
    );

    let mut sb = base(work.path());
    sb.network = Network::Allow(vec![
        Endpoint::parse(&format!("127.0.0.1:{allowed}")).unwrap(),
    ]);
    let open = ok(sh(sb, work.path(), &script)).await;
    assert_eq!(lines(&open), format!("allowed\nREFUSED-{other}"));
}

#[tokio::test]
async fn the_proxy_tunnels_only_to_allowed_endpoints() {
    if !available() {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let (allowed, other) = (server("allowed"), server("other"));
    let mut sb = base(work.path());
    sb.network = Network::Allow(vec![
        Endpoint::parse("api.example.invalid:443").unwrap(),
        Endpoint::parse(&format!("localhost:{allowed}")).unwrap(),
    ]);
    let proxy = sb.proxy_env();
    assert!(proxy.iter().any(|(k, _)| k == "HTTPS_PROXY"), "{proxy:?}");
    // Through the proxy with CONNECT (-p): the listed endpoint answers, another is refused with
    // the proxy's 403, a host outside the list too.
    let via = |target: &str| {
        format!(
            "curl -s -m 5 -p -x http://127.0.0.1:{} http://{target}/ -o /dev/null -w '%{{http_code}}' ; echo",
            sandbox::PROXY_PORT
        )
    };
    let script = format!(
        "{}; {}; {}",
        via(&format!("localhost:{allowed}")),
        via(&format!("localhost:{other}")),
        via("example.com:80")
    );
    let out = ok(sh(sb, work.path(), &script)).await;
    let text = out.stdout_lossy();
    let codes: Vec<&str> = text.lines().map(str::trim).collect();
    // curl prints 200 for the tunnelled request; 000 when the proxy refused the tunnel (403).
    assert_eq!(codes, vec!["200", "000", "000"], "{}", out.tail_text(20));
}

/// A program under a hidden directory reached through a chain of links (an installer's
/// `bin/tool` → a package manager's `node_modules/.bin/tool` → the package's real file) runs
/// and finds its sibling package: the sandbox shows every hop, not only the first path and the
/// last, and an npm package's whole `node_modules`.
#[tokio::test]
async fn a_program_behind_a_chain_of_links_under_a_hidden_dir_runs() {
    if !available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().canonicalize().unwrap();
    let hidden = root.join("home");
    let pkg = hidden.join("cache/tool-1.0/node_modules/tool/lib");
    let dot_bin = hidden.join("cache/tool-1.0/node_modules/.bin");
    let bin = hidden.join("cache/newest/bin");
    for d in [&pkg, &dot_bin, &bin] {
        std::fs::create_dir_all(d).unwrap();
    }
    let real = pkg.join("tool.sh");
    // Like Codex's launcher, it needs a sibling package of its `node_modules`.
    let dep = hidden.join("cache/tool-1.0/node_modules/tool-linux-x64");
    std::fs::create_dir_all(&dep).unwrap();
    std::fs::write(dep.join("native.txt"), "native\n").unwrap();
    std::fs::write(
        &real,
        "#!/bin/sh\nhere=$(dirname \"$(readlink -f \"$0\")\")\ncat \"$here/../../tool-linux-x64/native.txt\" && echo tool-ran\n",
    )
    .unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("../tool/lib/tool.sh", dot_bin.join("tool")).unwrap();
    std::os::unix::fs::symlink(dot_bin.join("tool"), bin.join("tool")).unwrap();
    let work = root.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let mut sb = base(&work);
    sb.hidden.push(hidden.clone());
    let cmd = Cmd::new(bin.join("tool"))
        .cwd(&work)
        .env_allow(Vec::<String>::new())
        .timeout(Duration::from_secs(60))
        .sandbox(Arc::new(sb));
    let out = ok(cmd).await;
    assert_eq!(out.stdout_lossy().trim(), "native\ntool-ran");
}
