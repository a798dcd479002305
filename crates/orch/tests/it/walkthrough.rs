//! The README's walkthrough "Run orch on your repository with Claude Code", step by step, with
//! the real `orch` binary: `orch init` in a fresh directory, the user's repository declared in
//! `orch.toml`, `orch doctor`, `orch serve`, `orch submit`, and the change merged, deployed and
//! watched, ending in the user's own checkout. Run for the three repository setups (an ordinary
//! checkout, a bare repository, a `file://` remote) on both backends (SQLite, PostgreSQL).
//!
//! The agents: [`Agents::start`] is the one place that picks them: the real Claude Code (the
//! `claude` preset, given only its program and endpoint) against `orch demo-model-server`, a
//! scripted Anthropic-API server on 127.0.0.1 that answers with the file writes the demo's
//! scripted agent would make — when `scripts/install-agent-clis` installed it. Where it could
//! not be installed, the demo's scripted stand-in (`orch demo-agent`, which speaks Claude Code's
//! JSON output) runs instead and the skip reason is printed (`ORCH_REQUIRE_AGENT_CLIS=1`
//! refuses that).

use crate::common;

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::{ORCH, agent_cli, become_subreaper, python_available, reap_orphans};

/// The variable holding the agents' API key in `orch serve`'s environment.
const KEY_VAR: &str = "WALKTHROUGH_ANTHROPIC_KEY";

/// Who runs the four LLM stages, and the model server the real Claude Code talks to.
struct Agents {
    /// The `[agents.*]` lines that point the `claude` preset at them.
    lines: String,
    server: Option<std::process::Child>,
}

impl Agents {
    fn start(home: &Path) -> Agents {
        use std::io::BufRead as _;
        use std::os::unix::fs::PermissionsExt as _;
        let script = |name: &str, body: String| {
            let path = home.join(name);
            std::fs::write(&path, body).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            path.display().to_string()
        };
        let Some(claude) = agent_cli("claude") else {
            eprintln!("walkthrough: running the scripted stand-in in place of Claude Code");
            let stand_in = script(
                "stand-in-claude.sh",
                format!("#!/bin/sh\nexec '{ORCH}' demo-agent \"$@\"\n"),
            );
            return Agents {
                lines: format!("command = \"{stand_in}\"\n"),
                server: None,
            };
        };
        let mut server = std::process::Command::new(ORCH)
            .arg("demo-model-server")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut url = String::new();
        std::io::BufReader::new(server.stdout.take().unwrap())
            .read_line(&mut url)
            .unwrap();
        assert!(
            url.starts_with("http://127.0.0.1:"),
            "model server: {url:?}"
        );
        // The key Claude Code sends (the local server takes any), given the way the README
        // says: `api_key_env` names a variable of `orch serve`'s environment.
        Agents {
            lines: format!(
                "command = \"{}\"\nendpoint = \"{}\"\nmodel = \"claude-sonnet-4-5\"\napi_key_env = \"{KEY_VAR}\"\ntimeout_s = 180\n",
                claude.display(),
                url.trim()
            ),
            server: Some(server),
        }
    }
}

impl Agents {
    /// Stops the model server (it ends at the end of its stdin) and returns how many requests
    /// it served, or `None` for the stand-in.
    fn finish(mut self) -> Option<usize> {
        let mut server = self.server.take()?;
        drop(server.stdin.take());
        let mut said = String::new();
        server.stderr.take()?.read_to_string(&mut said).unwrap();
        server.wait().unwrap();
        let n = said.lines().find_map(|l| {
            l.strip_prefix("served ")?
                .strip_suffix(" model requests")?
                .parse()
                .ok()
        });
        assert!(n.is_some(), "the model server said: {said}");
        n
    }
}

impl Drop for Agents {
    fn drop(&mut self) {
        if let Some(mut server) = self.server.take() {
            let _ = server.kill();
            let _ = server.wait();
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum RepoSetup {
    Checkout,
    Bare,
    FileUrl,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Backend {
    Sqlite,
    Postgres,
}

fn run(dir: &Path, program: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = std::process::Command::new(program);
    cmd.current_dir(dir)
        .args(args)
        .env_remove("ORCH_CONFIG")
        .env_remove("ORCH_DATABASE_URL")
        .env("ORCH_LOG", "warn")
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output()
        .unwrap_or_else(|e| panic!("{program} {args:?}: {e}"))
}

#[track_caller]
fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn git(dir: &Path, args: &[&str]) -> String {
    ok(run(dir, "git", args, &[])).trim().to_owned()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// Step 0: the user's repository. A small sample service (the demo's) committed on `main` in an
/// ordinary checkout `app/`; for the bare and remote setups the checkout is a clone of a bare
/// `upstream.git`. Returns (the checkout, what orch.toml names).
fn sample_repo(root: &Path, setup: RepoSetup) -> (PathBuf, String) {
    let service = Path::new(env!("CARGO_MANIFEST_DIR")).join("demo/service");
    let seed = root.join("seed");
    std::fs::create_dir_all(&seed).unwrap();
    for entry in std::fs::read_dir(&service).unwrap().flatten() {
        std::fs::copy(entry.path(), seed.join(entry.file_name())).unwrap();
    }
    git(&seed, &["init", "-q", "-b", "main"]);
    git(
        &seed,
        &[
            "-c",
            "user.name=you",
            "-c",
            "user.email=you@example.com",
            "add",
            "-A",
        ],
    );
    git(
        &seed,
        &[
            "-c",
            "user.name=you",
            "-c",
            "user.email=you@example.com",
            "commit",
            "-q",
            "-m",
            "sample service",
        ],
    );
    let app = root.join("app");
    match setup {
        RepoSetup::Checkout => {
            std::fs::rename(&seed, &app).unwrap();
            (app, "path = \"../app\"".to_owned())
        }
        RepoSetup::Bare | RepoSetup::FileUrl => {
            let bare = root.join("upstream.git");
            git(root, &["clone", "-q", "--bare", "seed", "upstream.git"]);
            git(root, &["clone", "-q", "upstream.git", "app"]);
            let line = if setup == RepoSetup::Bare {
                "path = \"../upstream.git\"".to_owned()
            } else {
                format!("url = \"file://{}\"", bare.display())
            };
            (app, line)
        }
    }
}

/// The `[repos.app]` section the README shows (ports and state dir of this run filled in).
fn repo_section(source: &str, prod: u16, staging: u16, state: &Path) -> String {
    let st = state.display();
    format!(
        "\n[repos.app]\n{source}\nprefix = \"APP\"\ndefault_branch = \"main\"\n\
         test = \"python3 -m unittest -q\"\n\
         deploy = \"sh deploy.sh production {prod} {st}\"\n\
         rollback = \"sh rollback.sh production {prod} {st}\"\n\
         health_url = \"http://127.0.0.1:{prod}/health\"\n\
         revision_url = \"http://127.0.0.1:{prod}/revision\"\n\n\
         [[repos.app.staging]]\nname = \"deploy-staging\"\nrun = \"sh deploy.sh staging {staging} {st}\"\n\
         sandbox = false\n\n\
         [[repos.app.staging_smoke]]\nname = \"health\"\nrun = \"sh smoke.sh {staging}\"\n\n\
         [repos.app.sandbox]\nnetwork = [\"127.0.0.1:{staging}\"]\n\n\
         [repos.app.post_deploy]\nwindow_s = 3\ninterval_s = 1\ninitial_delay_s = 1\npoll_timeout_s = 2\n"
    )
}

fn processes_in(dir: &Path) -> Vec<i32> {
    let Ok(dir) = dir.canonicalize() else {
        return Vec::new();
    };
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd.starts_with(&dir))
        })
        .collect()
}

async fn walkthrough(setup: RepoSetup, backend: Backend) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let (app, source) = sample_repo(root, setup);

    // Step 1: `orch init` in a fresh directory beside the repository.
    let home = root.join("orch-home");
    std::fs::create_dir(&home).unwrap();
    let db_url = match backend {
        Backend::Sqlite => None,
        Backend::Postgres => Some(orch_store::testing::fresh_pg_schema().await),
    };
    let mut env: Vec<(&str, &str)> = vec![
        ("ORCH_DEMO_AGENT_SLEEP_MS", "10"),
        (KEY_VAR, "walkthrough-local-key"),
    ];
    if let Some(url) = &db_url {
        env.push(("ORCH_DATABASE_URL", url));
    }
    let init = ok(run(&home, ORCH, &["init"], &env));
    assert!(init.contains("wrote"), "{init}");

    // Step 2: declare the repository and point the agents at Claude Code.
    let (prod, staging, api) = (free_port(), free_port(), free_port());
    let state = home.join("service-state");
    let mut config = std::fs::read_to_string(home.join("orch.toml")).unwrap();
    config = config.replace(
        "bind = \"127.0.0.1:7878\"",
        &format!("bind = \"127.0.0.1:{api}\""),
    );
    config = config.replace("poll_interval_ms = 1000", "poll_interval_ms = 200");
    let agents = Agents::start(&home);
    for agent in ["analyst", "architect", "developer", "reviewer"] {
        let section = format!("[agents.{agent}]\nbackend = \"claude\"\n");
        assert!(config.contains(&section), "the template has {section:?}");
        config = config.replace(&section, &format!("{section}{}", agents.lines));
    }
    config.push_str(&repo_section(&source, prod, staging, &state));
    std::fs::write(home.join("orch.toml"), config).unwrap();

    // Step 3: `orch doctor` passes and says what orch will do to the repository.
    let doctor = ok(run(&home, ORCH, &["doctor"], &env));
    let expect = match setup {
        RepoSetup::Checkout => "orch never pushes into it",
        RepoSetup::Bare => "bare repository",
        RepoSetup::FileUrl => "remote file://",
    };
    assert!(doctor.contains(expect), "{doctor}");

    // Step 4: `orch serve` (workers, maintenance, API and dashboard in one process).
    let mut serve = tokio::process::Command::new(ORCH);
    serve
        .current_dir(&home)
        .arg("serve")
        .env_remove("ORCH_CONFIG")
        .env("ORCH_LOG", "warn")
        .env("ORCH_LEASE_S", "10")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    for (k, v) in &env {
        serve.env(k, v);
    }
    let serve = serve.spawn().unwrap();

    // Step 5: submit a work item.
    let submitted = ok(run(
        &home,
        ORCH,
        &[
            "submit",
            "--repo",
            "app",
            "--title",
            "Add a /version endpoint",
            "--body",
            "Clients need to know which API version they talk to. Add `GET /version`.",
        ],
        &env,
    ));
    assert!(submitted.contains("APP-1 submitted"), "{submitted}");

    // Step 6: `orch status APP-1` until it is done.
    let deadline = Instant::now() + Duration::from_secs(240);
    let stage = loop {
        let out = run(&home, ORCH, &["--json", "status", "APP-1"], &env);
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
        let stage = v["task"]["stage"].as_str().unwrap_or("").to_owned();
        if matches!(stage.as_str(), "done" | "failed" | "cancelled") {
            break stage;
        }
        assert!(
            Instant::now() < deadline,
            "APP-1 did not finish (at {stage:?}): {}",
            ok(run(&home, ORCH, &["logs", "APP-1"], &env))
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let version = http_get(prod, "/version");
    if let Some(requests) = agents.finish() {
        // Four LLM stages, each at least one turn of the real Claude Code.
        assert!(
            requests >= 4,
            "Claude Code asked the model {requests} times"
        );
    }
    common::terminate(serve).await;
    for env_name in ["production", "staging"] {
        let _ = std::process::Command::new("sh")
            .arg(app.join("stop.sh"))
            .arg(env_name)
            .arg(&state)
            .status();
    }
    let _ = std::process::Command::new("sh")
        .arg(home.join(".orch/repos/app/stop.sh"))
        .args(["production"])
        .arg(&state)
        .status();
    reap_orphans();
    let logs = ok(run(&home, ORCH, &["logs", "APP-1"], &env));
    assert_eq!(stage, "done", "{logs}");
    assert!(
        logs.contains("post_deploy.verdict") && logs.contains("HEALTHY"),
        "deployed and watched: {logs}"
    );
    assert!(
        version.as_deref().is_some_and(|v| v.contains(" 200 ")),
        "production serves /version: {version:?}"
    );

    // Step 7: the change is in the user's repository.
    match setup {
        RepoSetup::Checkout => {
            // The checkout itself was fast-forwarded (it was clean, on `main`).
            let merged = git(&home.join(".orch/repos/app"), &["rev-parse", "main"]);
            let head = git(&app, &["rev-parse", "HEAD"]);
            let app_main = git(&app, &["rev-parse", "main"]);
            assert_eq!(app_main, head);
            assert!(
                git(&app, &["merge-base", "--is-ancestor", &merged, "HEAD"]).is_empty(),
                "the merge is in the checkout"
            );
            let branches = git(&app, &["branch", "--format=%(refname:short)"]);
            assert_eq!(
                branches, "main",
                "no orch/* branches in the user's checkout"
            );
            assert_eq!(
                git(&app, &["status", "--porcelain", "--untracked-files=no"]),
                ""
            );
        }
        RepoSetup::Bare | RepoSetup::FileUrl => {
            git(&app, &["pull", "-q", "--ff-only"]);
        }
    }
    let code = std::fs::read_to_string(app.join("app.py")).unwrap();
    assert!(code.contains("/version"), "the change reached the checkout");
    assert!(
        app.join("docs/work-items/APP-1/10-implementation.md")
            .exists(),
        "the artifact trail came with it"
    );
    let left = processes_in(&state.join("releases"));
    assert!(left.is_empty(), "service processes left: {left:?}");
}

fn skip() -> bool {
    if python_available() {
        become_subreaper();
        false
    } else {
        eprintln!("python3 is not installed: the sample service cannot run; skipping");
        true
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walkthrough_ordinary_checkout_sqlite() {
    if !skip() {
        walkthrough(RepoSetup::Checkout, Backend::Sqlite).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walkthrough_bare_repository_sqlite() {
    if !skip() {
        walkthrough(RepoSetup::Bare, Backend::Sqlite).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walkthrough_file_url_remote_sqlite() {
    if !skip() {
        walkthrough(RepoSetup::FileUrl, Backend::Sqlite).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walkthrough_ordinary_checkout_postgres() {
    if !skip() {
        walkthrough(RepoSetup::Checkout, Backend::Postgres).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walkthrough_bare_repository_postgres() {
    if !skip() {
        walkthrough(RepoSetup::Bare, Backend::Postgres).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walkthrough_file_url_remote_postgres() {
    if !skip() {
        walkthrough(RepoSetup::FileUrl, Backend::Postgres).await;
    }
}
