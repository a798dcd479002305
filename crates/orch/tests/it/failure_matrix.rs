//! Production is never left broken in silence: the failure-mode matrix, on the real binary
//! (`orch serve`), on SQLite and on PostgreSQL.
//!
//! One small service per row (its own repo, ports and release store), whose deploy and
//! rollback scripts are told how to fail by a file in the release store: a deploy that exits 1
//! after stopping the old process, one that hangs past `deploy_timeout_s`, one that exits 0
//! with the service down, a release whose health endpoint never answers, one whose revision
//! endpoint reports the old revision, a release that turns unhealthy under the watch with a
//! rollback that exits 0 without restoring (then an operator fixes production and approves),
//! a rollback that fails, one that hangs, a repo with no rollback command, a watch whose
//! rollback works, and a clean release. Three more rows fail staging the ways infrastructure
//! does: a Python smoke check against a closed port, an ssh-like step exiting 255 against a down
//! host, and no staging steps at all.
//!
//! What is checked comes from the service itself where it can (which process answers on the
//! port and the revision it really runs, asked through `/whoami`, a route orch never reads):
//! - production ends healthy at a known revision (the one orch recorded), or the `alert`
//!   command and the webhook were both delivered for the item, naming what is live;
//! - the outcome in `orch status --json`, `orch status ID --json`, `GET /tasks/{id}`, the task
//!   page, the repo page and `/metrics` agree with each other and with what happened;
//! - the deploy history names the true previous revision (the one that ran before);
//! - every item's documents are on the default branch;
//! - a webhook receiver on loopback that verifies every signature was down at first (orch kept
//!   going), then lost two answers (orch retried): it saw each notification once per id.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{ORCH, Serve, become_subreaper, python_available, reap_orphans};
use hmac::{KeyInit as _, Mac as _};
use orch_domain::control::events;
use orch_store::{ConnectOptions, JobState, Store};

const SECRET: &str = "matrix-secret";

/// The sample service: `/health` (a mode may make it hang or fail after a while),
/// `/revision` (a mode may make it report another one), `/whoami` (the truth, for the test).
const APP: &str = r#"import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REVISION = os.environ.get("APP_REVISION", "dev")
REPORTED = os.environ.get("APP_REPORT_REVISION") or REVISION
HEALTH = os.environ.get("APP_HEALTH", "ok")
FIRST_HEALTH = []


def health():
    if HEALTH == "hang":
        time.sleep(3600)
    # Counted from the first health request (the deploy's own check), not from start-up: on a
    # loaded machine that check can come seconds after the process started, and a release that
    # fails it never went live healthy: it is a failed deploy, not one the watch catches.
    if HEALTH.startswith("fail-after:"):
        if not FIRST_HEALTH:
            FIRST_HEALTH.append(time.time())
        if time.time() - FIRST_HEALTH[0] > float(HEALTH.split(":")[1]):
            return 503, {"status": "failing"}
    return 200, {"status": "ok"}


ROUTES = {
    "/health": health,
    "/revision": lambda: (200, {"revision": REPORTED}),
    "/whoami": lambda: (200, {"revision": REVISION, "pid": os.getpid()}),
}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        route = ROUTES.get(self.path)
        code, body = route() if route else (404, {})
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"#;

const TEST_APP: &str = "import unittest\n\nimport app\n\n\nclass AppTest(unittest.TestCase):\n    def test_health(self):\n        self.assertEqual(app.health()[0], 200)\n\n\nif __name__ == \"__main__\":\n    unittest.main()\n";

/// deploy.sh ENV PORT STATE: the production deploy reads `STATE/deploy-mode`.
const DEPLOY: &str = r#"#!/bin/sh
set -eu
env="$1"; port="$2"; state="$3"
rev="${ORCH_REVISION:-$(git rev-parse HEAD)}"
mode=ok
if [ "$env" = production ] && [ -f "$state/deploy-mode" ]; then mode="$(cat "$state/deploy-mode")"; fi
echo "deploy $env $rev $mode" >> "$state/log"
mkdir -p "$state/releases/$rev" "$state/run"
git archive "$rev" | tar -x -C "$state/releases/$rev"
if [ -f "$state/run/$env.rev" ] && [ "$(cat "$state/run/$env.rev")" != "$rev" ]; then
    cp "$state/run/$env.rev" "$state/run/$env.prev"
fi
sh "$(dirname "$0")/stop.sh" "$env" "$state"
case "$mode" in
    fail-after-stop) echo "deploy failed after stopping the old release" >&2; exit 1 ;;
    hang-after-stop) sleep 3600 ;;
    ok-but-down) echo "$rev" > "$state/run/$env.rev"; echo "deployed"; exit 0 ;;
esac
health=ok; report=""
case "$mode" in
    health-hangs) health=hang ;;
    lie-revision) report="$(cat "$state/run/$env.prev")" ;;
    unhealthy-later) health="fail-after:2" ;;
esac
cd "$state/releases/$rev"
APP_REVISION="$rev" APP_HEALTH="$health" APP_REPORT_REVISION="$report" setsid python3 app.py "$port" >"$state/run/$env.log" 2>&1 </dev/null &
echo $! > "$state/run/$env.pid"
echo "$rev" > "$state/run/$env.rev"
for _ in $(seq 1 100); do
    if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/revision', timeout=1)" 2>/dev/null; then
        echo "deployed $rev"; exit 0
    fi
    sleep 0.1
done
echo "the $env instance did not come up" >&2
exit 1
"#;

/// rollback.sh ENV PORT STATE: reads `STATE/rollback-mode`.
const ROLLBACK: &str = r#"#!/bin/sh
set -eu
env="$1"; port="$2"; state="$3"
mode=ok
if [ -f "$state/rollback-mode" ]; then mode="$(cat "$state/rollback-mode")"; fi
prev="$(cat "$state/run/$env.prev")"
echo "rollback $env $prev $mode" >> "$state/log"
case "$mode" in
    noop) echo "rolled back"; exit 0 ;;
    fail) echo "rollback failed: the release store is unreachable" >&2; exit 1 ;;
    hang) sleep 3600 ;;
esac
sh "$(dirname "$0")/stop.sh" "$env" "$state"
cd "$state/releases/$prev"
APP_REVISION="$prev" setsid python3 app.py "$port" >"$state/run/$env.log" 2>&1 </dev/null &
echo $! > "$state/run/$env.pid"
echo "$prev" > "$state/run/$env.rev"
for _ in $(seq 1 100); do
    if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null; then
        echo "rolled back to $prev"; exit 0
    fi
    sleep 0.1
done
exit 1
"#;

const STOP: &str = r#"#!/bin/sh
env="$1"; state="$2"
if [ -f "$state/run/$env.pid" ]; then
    pid="$(cat "$state/run/$env.pid")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$state/run/$env.pid"
fi
exit 0
"#;

const SMOKE: &str = "#!/bin/sh\npython3 -c \"import urllib.request; r = urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=2); assert r.status == 200\"\n";

/// How production must end, from the service's own state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Live {
    /// The release that ran before the item (R0), answering healthy.
    Previous,
    /// The item's own release, answering healthy.
    Item,
    /// Nothing answers on the port.
    Down,
    /// The item's release answers, unhealthy (until the operator fixes it).
    ItemUnhealthy,
}

/// One row of the matrix.
struct Row {
    name: &'static str,
    deploy_mode: &'static str,
    rollback_mode: Option<&'static str>,
    deploy_timeout_s: u64,
    /// `None`: the usual staging (deploy to staging + a smoke check).
    staging: Option<Staging>,
    /// The outcome the item must end with.
    outcome: &'static str,
    /// Where production is when the item has ended (before any operator action).
    live: Live,
    /// An operator fixes production by hand and approves (the hold after a failed rollback).
    operator: bool,
}

#[derive(Clone, Copy)]
enum Staging {
    PythonClosedPort,
    SshDownHost,
    NoSteps,
}

const fn row(
    name: &'static str,
    deploy_mode: &'static str,
    outcome: &'static str,
    live: Live,
) -> Row {
    Row {
        name,
        deploy_mode,
        rollback_mode: Some("ok"),
        deploy_timeout_s: 60,
        staging: None,
        outcome,
        live,
        operator: false,
    }
}

fn rows() -> Vec<Row> {
    vec![
        row("failstop", "fail-after-stop", "reverted", Live::Previous),
        Row {
            deploy_timeout_s: 5,
            ..row("hang", "hang-after-stop", "reverted", Live::Previous)
        },
        row("down", "ok-but-down", "reverted", Live::Previous),
        row("healthhang", "health-hangs", "reverted", Live::Previous),
        row("lie", "lie-revision", "reverted", Live::Previous),
        Row {
            rollback_mode: Some("noop"),
            operator: true,
            ..row(
                "watchnoop",
                "unhealthy-later",
                "accepted",
                Live::ItemUnhealthy,
            )
        },
        Row {
            rollback_mode: Some("fail"),
            ..row("rbfail", "fail-after-stop", "failed", Live::Down)
        },
        Row {
            rollback_mode: Some("hang"),
            deploy_timeout_s: 5,
            ..row("rbhang", "fail-after-stop", "failed", Live::Down)
        },
        Row {
            rollback_mode: None,
            ..row("norollback", "fail-after-stop", "failed", Live::Down)
        },
        row("watchok", "unhealthy-later", "reverted", Live::Previous),
        row("clean", "ok", "shipped", Live::Item),
        Row {
            staging: Some(Staging::PythonClosedPort),
            ..row("stpython", "ok", "failed", Live::Previous)
        },
        Row {
            staging: Some(Staging::SshDownHost),
            ..row("stssh", "ok", "failed", Live::Previous)
        },
        Row {
            staging: Some(Staging::NoSteps),
            ..row("stnone", "ok", "failed", Live::Previous)
        },
    ]
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One plain HTTP/1.0 exchange: `(status, body)`, or `None` when nothing answered in time.
fn http(port: u16, path: &str, timeout: Duration) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

fn git(dir: &Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .unwrap()
}

fn git_ok(dir: &Path, args: &[&str]) -> String {
    let out = git(dir, args);
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// One row's service on this machine.
struct Service {
    repo: PathBuf,
    state: PathBuf,
    prod: u16,
    staging: u16,
    /// The revision production ran before the item (deployed by the test, as a user would).
    r0: String,
}

impl Service {
    fn create(home: &Path, row: &Row) -> Service {
        use std::os::unix::fs::PermissionsExt as _;
        let repo = home.join(row.name);
        let state = home.join(format!("{}-state", row.name));
        std::fs::create_dir_all(&repo).unwrap();
        std::fs::create_dir_all(&state).unwrap();
        for (name, text) in [
            ("app.py", APP),
            ("test_app.py", TEST_APP),
            ("deploy.sh", DEPLOY),
            ("rollback.sh", ROLLBACK),
            ("stop.sh", STOP),
            ("smoke.sh", SMOKE),
        ] {
            let path = repo.join(name);
            std::fs::write(&path, text).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        git_ok(&repo, &["init", "-q", "-b", "main"]);
        git_ok(&repo, &["add", "-A"]);
        git_ok(
            &repo,
            &[
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@t",
                "commit",
                "-qm",
                "the service",
            ],
        );
        let r0 = git_ok(&repo, &["rev-parse", "HEAD"]);
        let (prod, staging) = (free_port(), free_port());
        // Production runs the first release before orch deploys anything.
        let first = std::process::Command::new("sh")
            .arg("deploy.sh")
            .arg("production")
            .arg(prod.to_string())
            .arg(&state)
            .current_dir(&repo)
            .output()
            .unwrap();
        assert!(first.status.success(), "{}: {first:?}", row.name);
        std::fs::write(state.join("deploy-mode"), row.deploy_mode).unwrap();
        if let Some(m) = row.rollback_mode {
            std::fs::write(state.join("rollback-mode"), m).unwrap();
        }
        Service {
            repo,
            state,
            prod,
            staging,
            r0,
        }
    }

    /// `[repos.<name>]` for this row.
    fn config(&self, row: &Row, prefix: &str, hook: &str, dead_port: u16) -> String {
        let (st, p, s) = (self.state.display(), self.prod, self.staging);
        let mut c = format!(
            "\n[repos.{name}]\npath = \"{repo}\"\nprefix = \"{prefix}\"\ntest = \"python3 -m unittest -q\"\n\
             test_timeout_s = 60\ndeploy = \"sh deploy.sh production {p} {st}\"\ndeploy_timeout_s = {t}\n\
             health_url = \"http://127.0.0.1:{p}/health\"\nrevision_url = \"http://127.0.0.1:{p}/revision\"\n\
             alert = \"printf '%s\\\\t%s\\\\n' \\\"$ORCH_EVENT\\\" \\\"$ORCH_LIVE\\\" >> {st}/alert-env; cat >> {st}/alerts.jsonl; echo >> {st}/alerts.jsonl\"\n\
             alert_webhook = \"{hook}\"\nalert_webhook_secret = \"{SECRET}\"\n\
             staging_defer_delay_s = 1\n",
            name = row.name,
            repo = self.repo.display(),
            t = row.deploy_timeout_s,
        );
        if row.rollback_mode.is_some() {
            c.push_str(&format!(
                "rollback = \"sh rollback.sh production {p} {st}\"\n"
            ));
        }
        match row.staging {
            None => c.push_str(&format!(
                "staging_health_url = \"http://127.0.0.1:{s}/health\"\n\n\
                 [repos.{n}.sandbox]\nnetwork = [\"127.0.0.1:{s}\"]\n\n\
                 [[repos.{n}.staging]]\nname = \"deploy-staging\"\nrun = \"sh deploy.sh staging {s} {st}\"\ntimeout_s = 30\nsandbox = false\n\n\
                 [[repos.{n}.staging_smoke]]\nname = \"health\"\nrun = \"sh smoke.sh {s}\"\ntimeout_s = 10\n",
                n = row.name
            )),
            Some(Staging::PythonClosedPort) => c.push_str(&format!(
                "staging_health_url = \"http://127.0.0.1:{dead_port}/health\"\n\n\
                 [[repos.{n}.staging_smoke]]\nname = \"health\"\n\
                 run = \"python3 -c \\\"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{dead_port}/health', timeout=2)\\\"\"\ntimeout_s = 10\n",
                n = row.name
            )),
            Some(Staging::SshDownHost) => c.push_str(&format!(
                "staging_health_url = \"http://127.0.0.1:{dead_port}/health\"\n\n\
                 [[repos.{n}.staging]]\nname = \"deploy-staging\"\n\
                 run = \"echo 'ssh: connect to host staging.internal port 22: Connection refused' >&2; exit 255\"\ntimeout_s = 10\n",
                n = row.name
            )),
            Some(Staging::NoSteps) => {}
        }
        // The watch is long enough in absolute time for a FAILED verdict on a loaded machine:
        // a release that turns unhealthy gives at least 4 FAIL polls before the deadline even
        // when late ticks skip slots. With 6 s of 1 s slots, a CI run under load polled twice
        // before the deadline and ended DEGRADED (alert only, no rollback) instead.
        c.push_str(&format!(
            "\n[repos.{n}.post_deploy]\nwindow_s = 16\ninterval_s = 2\ninitial_delay_s = 1\npoll_timeout_s = 2\n",
            n = row.name
        ));
        c
    }

    /// What answers on the production port: `(revision it really runs, healthy)`.
    fn truth(&self) -> Option<(String, bool)> {
        // Asked up to five times, a second apart: on a loaded machine one answer can take
        // longer than the timeout, and "nothing answers" must mean nothing does.
        let (_, body) = (0..5).find_map(|i| {
            if i > 0 {
                std::thread::sleep(Duration::from_secs(1));
            }
            http(self.prod, "/whoami", Duration::from_secs(3))
        })?;
        let rev = json(&body)["revision"].as_str()?.to_owned();
        let healthy =
            http(self.prod, "/health", Duration::from_secs(3)).is_some_and(|(s, _)| s == 200);
        Some((rev, healthy))
    }

    /// The notices the `alert` command got on stdin.
    fn alerts(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.state.join("alerts.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(json)
            .collect()
    }
}

/// What the webhook receiver saw.
#[derive(Default)]
struct Received {
    /// Every delivery, in order: (id, body).
    all: Vec<(String, serde_json::Value)>,
    /// Refuse everything (the receiver is "down").
    down: bool,
    /// Take the next N deliveries, then answer 500 as if the answer was lost.
    lose_answers: u32,
    bad_signatures: u32,
}

/// The webhook receiver: verifies `X-Orch-Signature` over `<t>.<body>` with [`SECRET`].
async fn receiver(state: Arc<Mutex<Received>>) -> String {
    use axum::http::{HeaderMap, StatusCode};
    async fn hook(
        axum::extract::State(state): axum::extract::State<Arc<Mutex<Received>>>,
        headers: HeaderMap,
        body: String,
    ) -> StatusCode {
        let mut r = state.lock().unwrap();
        if r.down {
            return StatusCode::SERVICE_UNAVAILABLE;
        }
        let header = |k: &str| {
            headers
                .get(k)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        let sig = header("x-orch-signature");
        let t = sig
            .split(',')
            .find_map(|p| p.strip_prefix("t="))
            .unwrap_or_default()
            .to_owned();
        let v1 = sig
            .split(',')
            .find_map(|p| p.strip_prefix("v1="))
            .unwrap_or_default()
            .to_owned();
        let mut mac = <hmac::Hmac<sha2::Sha256>>::new_from_slice(SECRET.as_bytes()).unwrap();
        mac.update(format!("{t}.{body}").as_bytes());
        let want: String = mac
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        if t.is_empty() || v1 != want {
            r.bad_signatures += 1;
            return StatusCode::UNAUTHORIZED;
        }
        let doc = json(&body);
        assert_eq!(header("x-orch-delivery"), doc["id"].as_str().unwrap());
        r.all.push((header("x-orch-delivery"), doc));
        if r.lose_answers > 0 {
            r.lose_answers -= 1;
            return StatusCode::INTERNAL_SERVER_ERROR;
        }
        StatusCode::NO_CONTENT
    }
    let app = axum::Router::new()
        .route("/hook", axum::routing::post(hook))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}/hook")
}

fn orch(home: &Path, url: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(ORCH)
        .arg("--config")
        .arg(home.join("orch.toml"))
        .args(["--database-url", url])
        .args(args)
        .env("ORCH_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "orch {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `[settings]` and agents of the matrix: the demo's scripted agent, eight workers.
fn base_config(home: &Path, api: u16) -> String {
    use std::os::unix::fs::PermissionsExt as _;
    let agent = home.join("agent.sh");
    std::fs::write(
        &agent,
        format!("#!/bin/sh\nexec '{ORCH}' demo-agent \"$@\"\n"),
    )
    .unwrap();
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut c = format!(
        "[settings]\nrepos_dir = \".orch/repos\"\nbind = \"127.0.0.1:{api}\"\ntoken = \"matrix-token\"\n\
         workers = 8\nlease_s = 30\npoll_interval_ms = 200\nagent_concurrency = 4\nagent_timeout_s = 60\n\n"
    );
    for name in ["analyst", "architect", "developer", "reviewer"] {
        c.push_str(&format!(
            "[agents.{name}]\nbackend = \"claude\"\ncommand = \"{}\"\nmodel = \"demo-scripted-1\"\n\n",
            agent.display()
        ));
    }
    c
}

async fn store_events(store: &Store, id: &str) -> Vec<orch_store::Event> {
    let t = common::task(store, id).await;
    store.task_events(t.id).await.unwrap()
}

/// Polls `check` every 200 ms until it gives `Some`, failing after `limit` with `what`.
async fn until<T>(limit: Duration, what: &str, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(t0.elapsed() < limit, "no {what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Stops every row's service (production and staging) however the test ends.
struct Cleanup(Vec<(PathBuf, PathBuf)>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for (repo, state) in &self.0 {
            for env in ["production", "staging"] {
                let _ = std::process::Command::new("sh")
                    .arg(repo.join("stop.sh"))
                    .arg(env)
                    .arg(state)
                    .status();
            }
        }
        reap_orphans();
    }
}

async fn matrix(pg: bool) {
    if !python_available() {
        return common::skip("python3 is not installed: the matrix's services cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().to_path_buf();
    let api = free_port();
    let dead = free_port();
    let received = Arc::new(Mutex::new(Received {
        down: true,
        ..Received::default()
    }));
    let hook = receiver(received.clone()).await;
    let rows = rows();
    let mut config = base_config(&home, api);
    let mut services = Vec::new();
    let mut cleanup = Cleanup(Vec::new());
    for (i, row) in rows.iter().enumerate() {
        let svc = Service::create(&home, row);
        cleanup.0.push((svc.repo.clone(), svc.state.clone()));
        let prefix = format!("M{}", char::from(b'A' + u8::try_from(i).unwrap()));
        config.push_str(&svc.config(row, &prefix, &hook, dead));
        services.push(svc);
    }
    std::fs::write(home.join("orch.toml"), &config).unwrap();
    let url = if pg {
        orch_store::testing::fresh_pg_schema().await
    } else {
        std::fs::create_dir_all(home.join(".orch")).unwrap();
        format!("sqlite://{}", home.join(".orch/orch.db").display())
    };
    let store = Store::connect(
        &url,
        ConnectOptions {
            create_if_missing: true,
            ..ConnectOptions::default()
        },
    )
    .await
    .unwrap();
    store.migrate().await.unwrap();
    let mut cmd = Serve::command(&home, &format!("127.0.0.1:{api}"));
    cmd.args(["--database-url", &url]);
    let serve = Serve::spawn(cmd);
    let mut ids = Vec::new();
    for row in &rows {
        let out = orch(
            &home,
            &url,
            &[
                "submit",
                "--repo",
                row.name,
                "--title",
                &format!("Add a note: {}", row.name),
                "--json",
            ],
        );
        ids.push(json(&out)["work_item_id"].as_str().unwrap().to_owned());
    }
    let m = Matrix {
        home: &home,
        url: &url,
        api,
        store: &store,
        rows: &rows,
        services: &services,
        ids: &ids,
        received: &received,
    };
    let checked = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(m.check())).await;
    if let Err(panic) = checked {
        eprintln!(
            "how the items got where they are:\n{}",
            common::items_report(&store, &ids, true, 40).await
        );
        serve.terminate().await;
        drop(cleanup);
        std::panic::resume_unwind(panic);
    }
    serve.terminate().await;
    drop(cleanup);
}

struct Matrix<'a> {
    home: &'a Path,
    url: &'a str,
    api: u16,
    store: &'a Store,
    rows: &'a [Row],
    services: &'a [Service],
    ids: &'a [String],
    received: &'a Arc<Mutex<Received>>,
}

impl Matrix<'_> {
    async fn check(&self) {
        // The receiver is down at first: orch records the refused deliveries and goes on.
        until(
            Duration::from_secs(600),
            "a refused webhook delivery",
            async || {
                let n = self
                    .store
                    .events_by_kind(events::NOTIFY_FAILED, 0, 10)
                    .await
                    .unwrap()
                    .len();
                (n >= 2).then_some(())
            },
        )
        .await;
        {
            let mut r = self.received.lock().unwrap();
            r.down = false;
            // The next two deliveries are taken, but their answers are lost: retried.
            r.lose_answers = 2;
        }
        // Every item ends, except the one whose operator must act first.
        for (row, id) in self.rows.iter().zip(self.ids) {
            let store = self.store;
            until(
                Duration::from_secs(900),
                &format!("{} ({id}) ending", row.name),
                async || {
                    let t = common::task(store, id).await;
                    if t.is_terminal() {
                        return Some(());
                    }
                    let held = store_events(store, id)
                        .await
                        .iter()
                        .any(|e| e.kind == events::RELEASE_HELD);
                    (row.operator && held).then_some(())
                },
            )
            .await;
        }
        for (i, row) in self.rows.iter().enumerate() {
            if row.operator {
                self.operator_fixes(i).await;
            }
        }
        let mut tally: BTreeMap<&str, u32> = BTreeMap::new();
        for (i, row) in self.rows.iter().enumerate() {
            *tally.entry(row.outcome).or_default() += 1;
            self.check_row(i).await;
        }
        self.check_webhook().await;
        let (_, metrics) = http(self.api, "/metrics", Duration::from_secs(10)).unwrap();
        for (outcome, n) in tally {
            let line = format!("orch_finished_tasks{{outcome=\"{outcome}\"}} {n}\n");
            assert!(metrics.contains(&line), "{line} in\n{metrics}");
        }
    }

    /// The item's deployed revision, as its deploy recorded it.
    async fn item_revision(&self, id: &str) -> Option<String> {
        store_events(self.store, id)
            .await
            .iter()
            .rev()
            .find(|e| e.kind == events::RELEASE_DEPLOYED)
            .and_then(|e| json(&e.data)["revision"].as_str().map(str::to_owned))
    }

    /// The watch failed and the rollback did nothing: production runs the item's release,
    /// unhealthy; an operator was told so. They bring the old release back by hand and approve.
    async fn operator_fixes(&self, i: usize) {
        let (row, id, svc) = (&self.rows[i], &self.ids[i], &self.services[i]);
        let item = self.item_revision(id).await.expect("the item was deployed");
        let truth = svc.truth();
        assert_eq!(
            truth,
            Some((item.clone(), false)),
            "{}: before the fix",
            row.name
        );
        self.alerted(i, Some(&item)).await;
        std::fs::write(svc.state.join("rollback-mode"), "ok").unwrap();
        let fixed = std::process::Command::new("sh")
            .arg("rollback.sh")
            .arg("production")
            .arg(svc.prod.to_string())
            .arg(&svc.state)
            .current_dir(&svc.repo)
            .output()
            .unwrap();
        assert!(fixed.status.success(), "{fixed:?}");
        orch(self.home, self.url, &["approve", id]);
        common::wait_terminal(self.store, id, Duration::from_secs(300)).await;
    }

    /// The `alert` command and the webhook were both told about item `i`, naming what is live
    /// (`live`: the revision that answers, `None` when nothing does).
    async fn alerted(&self, i: usize, live: Option<&str>) {
        let (row, id, svc) = (&self.rows[i], &self.ids[i], &self.services[i]);
        let by_command: Vec<serde_json::Value> = svc
            .alerts()
            .into_iter()
            .filter(|n| n["event"] == "alert" && n["work_item"] == id.as_str())
            .collect();
        assert!(
            !by_command.is_empty(),
            "{}: the alert command ran",
            row.name
        );
        let env = std::fs::read_to_string(svc.state.join("alert-env")).unwrap_or_default();
        assert!(
            env.lines()
                .any(|l| l.starts_with("alert\t") && l.len() > "alert\t".len()),
            "{}: ORCH_LIVE: {env}",
            row.name
        );
        let by_hook = until(
            Duration::from_secs(300),
            "the alert's webhook delivery",
            async || {
                let r = self.received.lock().unwrap();
                let got: Vec<serde_json::Value> = r
                    .all
                    .iter()
                    .filter(|(_, n)| n["event"] == "alert" && n["work_item"] == id.as_str())
                    .map(|(_, n)| n.clone())
                    .collect();
                (!got.is_empty()).then_some(got)
            },
        )
        .await;
        for n in by_command.iter().chain(&by_hook) {
            let what = &n["live"];
            assert!(
                what["description"].as_str().is_some_and(|d| !d.is_empty()),
                "{}: names what is live: {n}",
                row.name
            );
            assert_eq!(what["health"], "FAIL", "{}: {n}", row.name);
            match live {
                Some(rev) => assert_eq!(what["revision"], rev, "{}: {n}", row.name),
                None => assert_eq!(
                    what["revision"],
                    serde_json::Value::Null,
                    "{}: {n}",
                    row.name
                ),
            }
            assert!(
                n["tried"].as_array().is_some_and(|t| !t.is_empty()),
                "{}: what was tried: {n}",
                row.name
            );
            assert!(
                n["todo"].as_str().is_some_and(|t| !t.is_empty()),
                "{}: {n}",
                row.name
            );
        }
    }

    async fn check_row(&self, i: usize) {
        let (row, id, svc) = (&self.rows[i], &self.ids[i], &self.services[i]);
        let name = row.name;
        let item = self.item_revision(id).await;
        // 1. Production, from the service's own state.
        let truth = svc.truth();
        let want = match row.live {
            Live::Previous | Live::ItemUnhealthy => Some((svc.r0.clone(), true)),
            Live::Item => Some((item.clone().expect("deployed"), true)),
            Live::Down => None,
        };
        assert_eq!(truth, want, "{name}: what answers on the production port");
        match row.live {
            Live::Down => self.alerted(i, None).await,
            Live::Previous if item.is_some() => {
                // orch's own conclusion agrees: settled healthy at the revision that answers.
                let checked = store_events(self.store, id)
                    .await
                    .into_iter()
                    .rev()
                    .find(|e| e.kind == events::PRODUCTION_CHECKED)
                    .unwrap_or_else(|| panic!("{name}: production.checked"));
                let d = json(&checked.data);
                assert_eq!(d["settled"], "healthy", "{name}: {d}");
                assert_eq!(d["settled_at"], svc.r0.as_str(), "{name}: {d}");
            }
            _ => {}
        }
        // 2. One outcome everywhere.
        let list = json(&orch(self.home, self.url, &["status", "--json"]));
        let in_list = list["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["work_item_id"] == id.as_str())
            .map(|t| t["outcome"]["outcome"].clone());
        let one = json(&orch(self.home, self.url, &["status", id, "--json"]));
        let (_, api) = http(self.api, &format!("/tasks/{id}"), Duration::from_secs(10)).unwrap();
        let api = json(&api);
        let (_, page) = http(
            self.api,
            &format!("/ui/tasks/{id}"),
            Duration::from_secs(10),
        )
        .unwrap();
        let (_, repo_page) = http(
            self.api,
            &format!("/ui/repos/{name}"),
            Duration::from_secs(10),
        )
        .unwrap();
        let repo_row = repo_page
            .split(&format!("<tr id=\"task-{id}\">"))
            .nth(1)
            .and_then(|r| r.split("</tr>").next())
            .unwrap_or_default();
        let want = row.outcome;
        assert_eq!(
            in_list,
            Some(serde_json::json!(want)),
            "{name}: orch status --json"
        );
        assert_eq!(
            one["task"]["outcome"]["outcome"], want,
            "{name}: orch status {id}"
        );
        assert_eq!(
            api["task"]["outcome"]["outcome"], want,
            "{name}: GET /tasks/{id}"
        );
        assert!(
            page.contains(&format!("data-outcome=\"{want}\"")),
            "{name}: the task page says {want}"
        );
        assert!(
            repo_row.contains(&format!("chip {want}")),
            "{name}: the repo page says {want}: {repo_row}"
        );
        if want != "shipped" {
            assert!(!page.contains("data-outcome=\"shipped\""), "{name}");
        }
        // 3. The deploy history names the revision that ran before.
        if let Some(item) = &item {
            let history = json(&orch(self.home, self.url, &["deploys", name, "--json"]));
            let deploy = history["deploys"]
                .as_array()
                .unwrap()
                .iter()
                .find(|d| d["revision"] == item.as_str())
                .unwrap_or_else(|| panic!("{name}: the deploy of {item} in {history}"))
                .clone();
            assert_eq!(
                deploy["previous_revision"],
                svc.r0.as_str(),
                "{name}: {deploy}"
            );
        } else {
            assert!(
                row.staging.is_some(),
                "{name}: only staging rows deploy nothing"
            );
            self.staging_was_the_infrastructure(i).await;
        }
        // 4. The item's documents are on the default branch.
        let clone = self.home.join(".orch/repos").join(name);
        let docs = format!("docs/work-items/{id}");
        until(
            Duration::from_secs(120),
            &format!("{name}'s trail on main"),
            async || {
                let on_main = git(
                    &clone,
                    &["ls-tree", "-r", "--name-only", "main", "--", &docs],
                );
                let same = git(
                    &clone,
                    &[
                        "diff",
                        "--quiet",
                        "main",
                        &format!("orch/{id}"),
                        "--",
                        &docs,
                    ],
                );
                (same.status.success() && !on_main.stdout.is_empty()).then_some(())
            },
        )
        .await;
    }

    /// A staging row failed at staging as the infrastructure: deferred twice as TOOL_ERROR,
    /// then FAILED `tool_error_exhausted`, never the change's fault.
    async fn staging_was_the_infrastructure(&self, i: usize) {
        let (row, id) = (&self.rows[i], &self.ids[i]);
        let evs = store_events(self.store, id).await;
        let defers: Vec<&str> = evs
            .iter()
            .filter(|e| e.kind == events::STAGE_REQUEUED && e.message.contains("TOOL_ERROR"))
            .map(|e| e.message.as_str())
            .collect();
        assert_eq!(defers.len(), 2, "{}: {defers:?}", row.name);
        let kind = match row.staging {
            Some(Staging::NoSteps) => "no_steps",
            _ => "unreachable",
        };
        assert!(
            defers.iter().all(|m| m.contains(kind)),
            "{}: {defers:?}",
            row.name
        );
        assert!(
            !evs.iter().any(|e| e.kind == events::STAGE_LOOP_BACK),
            "{}: never sent back to implementation",
            row.name
        );
        let clone = self.home.join(".orch/repos").join(row.name);
        let log = git_ok(
            &clone,
            &[
                "show",
                &format!("main:docs/work-items/{id}/15-staging-log.md"),
            ],
        );
        assert!(log.contains("staging_status: FAILED"), "{log}");
        assert!(log.contains("failure_kind: tool_error_exhausted"), "{log}");
        assert!(log.contains(kind), "{log}");
        assert!(
            !log.contains("smoke_failed") && !log.contains("step_failed"),
            "{log}"
        );
    }

    /// The receiver verified every signature and, retries aside, saw each notification once
    /// per id; every item's outcome reached it.
    async fn check_webhook(&self) {
        let store = self.store;
        until(
            Duration::from_secs(300),
            "every webhook delivery done",
            async || {
                let stats = store.queue_stats().await.unwrap();
                let open = stats
                    .counts
                    .iter()
                    .filter(|c| {
                        c.agent == orch_domain::control::jobs::NOTIFY
                            && matches!(c.state, JobState::Queued | JobState::Running)
                    })
                    .map(|c| c.count)
                    .sum::<i64>();
                (open == 0).then_some(())
            },
        )
        .await;
        let delivered: BTreeSet<String> = store
            .events_by_kind(events::NOTIFY_DELIVERED, 0, 1000)
            .await
            .unwrap()
            .iter()
            .filter_map(|e| json(&e.data)["id"].as_str().map(str::to_owned))
            .collect();
        let r = self.received.lock().unwrap();
        assert_eq!(r.bad_signatures, 0);
        let mut by_id: BTreeMap<&str, Vec<&serde_json::Value>> = BTreeMap::new();
        for (id, doc) in &r.all {
            by_id.entry(id.as_str()).or_default().push(doc);
        }
        assert!(
            by_id.values().any(|v| v.len() > 1),
            "a lost answer was retried with the same id"
        );
        for (id, docs) in &by_id {
            assert!(
                docs.iter().all(|d| *d == docs[0]),
                "{id}: one document per id"
            );
            assert_eq!(docs[0]["version"], 1);
        }
        for (row, id) in self.rows.iter().zip(self.ids) {
            let outcomes: BTreeSet<&str> = by_id
                .values()
                .map(|d| d[0])
                .filter(|d| d["event"] == "outcome" && d["work_item"] == id.as_str())
                .filter_map(|d| d["outcome"].as_str())
                .collect();
            assert_eq!(
                outcomes,
                BTreeSet::from([row.outcome]),
                "{}: the outcome's notification",
                row.name
            );
        }
        let seen: BTreeSet<String> = by_id.keys().map(|k| (*k).to_owned()).collect();
        assert_eq!(
            delivered, seen,
            "what orch recorded as delivered is what arrived"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn production_is_never_left_broken_in_silence_on_sqlite() {
    matrix(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn production_is_never_left_broken_in_silence_on_postgres() {
    matrix(true).await;
}
