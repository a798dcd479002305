//! The dashboard in a real browser: the whole demo (APP-1 shipped, APP-2 rolled back by its
//! post-deploy watch, APP-3 cancelled), then the real `orch serve` on its data with slow demo
//! agents, and headless Chromium driven over the DevTools protocol (`--remote-debugging-pipe`:
//! JSON messages on file descriptors 3 and 4, no extra crate). It checks that:
//! - a task page updates in place while a worker moves the task on (a JS variable set on the
//!   page survives, so the page was not reloaded), and the queue page shows a new submission;
//! - the rolled-back APP-2 shows its outcome and reason at the top, and its watch chart is
//!   drawn from `16-post-deploy-log.md` after the watch ended;
//! - the Cancel button fails without the token (401 shown) and works with it;
//! - a finished page stops polling, and a phone-width page does not scroll sideways.
//!
//! With `ORCH_UPDATE_SCREENSHOT=1` it also writes `docs/dashboard.png` (queue),
//! `docs/dashboard-task.png` (APP-2), `docs/dashboard-repo.png` (the repo page) and
//! `docs/dashboard-report.png` (the delivery report).
//! Also checks `orch status` (outcome column) and `orch deploys` (the API's document) on the
//! same data. Skips (with a note) without `python3`, and skips the browser part without
//! `/usr/bin/chromium`; CI installs chromium.

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{ORCH, become_subreaper, python_available, reap_orphans, stop_service};
use serde_json::{Value, json};

const CHROMIUM: &str = "/usr/bin/chromium";
const TOKEN: &str = "demo-token";

fn orch(config: &Path, args: &[&str]) -> Output {
    let out = Command::new(ORCH)
        .arg("--config")
        .arg(config)
        .args(args)
        .env("ORCH_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("run orch");
    assert!(
        out.status.success(),
        "orch {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A port nobody listens on right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One plain HTTP/1.0 GET; `None` until the server answers.
fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::Read;
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// Polls `check` every 100 ms until it returns `Some`, or panics with `what` after `secs`.
fn wait_for<T>(secs: u64, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `orch serve`, stopped with SIGTERM when dropped; the demo service is stopped too.
struct Served {
    child: Child,
    dir: PathBuf,
}

impl Drop for Served {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        stop_service(&self.dir);
        reap_orphans();
    }
}

// ----- a minimal DevTools protocol client over --remote-debugging-pipe -----------------------

/// Headless Chromium driven through the DevTools protocol on fds 3 (commands in) and 4
/// (answers and events out), each message JSON ended by a NUL byte.
struct Browser {
    child: Child,
    to_browser: std::fs::File,
    from_browser: mpsc::Receiver<Value>,
    next_id: u64,
    _profile: tempfile::TempDir,
}

/// A pipe whose two ends are close-on-exec and numbered 10 or above (so the child's `dup2`
/// onto 3 and 4 never meets them).
fn high_pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: fds has room for two descriptors.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    let high = |fd: i32| {
        // SAFETY: duplicating a descriptor we own, then closing the original.
        let h = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10) };
        assert!(h >= 10, "fcntl F_DUPFD_CLOEXEC failed");
        unsafe { libc::close(fd) };
        // SAFETY: h is a fresh descriptor owned by nobody else.
        unsafe { OwnedFd::from_raw_fd(h) }
    };
    (high(fds[0]), high(fds[1]))
}

impl Browser {
    fn start() -> Browser {
        use std::os::fd::AsRawFd;
        let profile = tempfile::tempdir().unwrap();
        let (cmd_read, cmd_write) = high_pipe();
        let (out_read, out_write) = high_pipe();
        let (cr, ow) = (cmd_read.as_raw_fd(), out_write.as_raw_fd());
        let mut command = Command::new(CHROMIUM);
        command
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--remote-debugging-pipe",
                "--no-first-run",
                "--hide-scrollbars",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: only async-signal-safe calls (dup2) between fork and exec.
        unsafe {
            command.pre_exec(move || {
                if libc::dup2(cr, 3) < 0 || libc::dup2(ow, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("spawn chromium");
        drop(cmd_read);
        drop(out_write);
        let (tx, rx) = mpsc::channel();
        let reader = std::fs::File::from(out_read);
        std::thread::spawn(move || {
            let mut r = BufReader::new(reader);
            loop {
                let mut buf = Vec::new();
                match r.read_until(0, &mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        buf.pop();
                        if let Ok(v) = serde_json::from_slice::<Value>(&buf)
                            && tx.send(v).is_err()
                        {
                            break;
                        }
                    }
                }
            }
        });
        Browser {
            child,
            to_browser: std::fs::File::from(cmd_write),
            from_browser: rx,
            next_id: 0,
            _profile: profile,
        }
    }

    /// Sends one command (to a page session when given) and waits for its answer.
    fn call(&mut self, session: Option<&str>, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        let mut bytes = serde_json::to_vec(&msg).unwrap();
        bytes.push(0);
        self.to_browser
            .write_all(&bytes)
            .expect("write to chromium");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = self
                .from_browser
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("chromium did not answer {method}"));
            if v["id"] == json!(id) {
                assert!(v.get("error").is_none(), "{method} failed: {v}");
                return v["result"].clone();
            }
        }
    }

    /// Opens `url` in a new tab of `width`×`height`; returns its session.
    fn open(&mut self, url: &str, width: u32, height: u32) -> Page {
        let target = self.call(None, "Target.createTarget", json!({"url": "about:blank"}));
        let target_id = target["targetId"].as_str().unwrap().to_owned();
        let attached = self.call(
            None,
            "Target.attachToTarget",
            json!({"targetId": target_id, "flatten": true}),
        );
        let session = attached["sessionId"].as_str().unwrap().to_owned();
        let mobile = width < 600;
        self.call(
            Some(&session),
            "Emulation.setDeviceMetricsOverride",
            json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile}),
        );
        self.call(Some(&session), "Page.enable", json!({}));
        self.call(Some(&session), "Page.navigate", json!({"url": url}));
        let page = Page { session };
        wait_for(20, &format!("{url} to load"), || {
            let ready = page.eval(self, "document.readyState + ' ' + location.href");
            (ready.as_str() == Some(&format!("complete {url}"))).then_some(())
        });
        page
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        reap_orphans();
    }
}

/// One tab.
struct Page {
    session: String,
}

impl Page {
    /// Evaluates `expr` in the page and returns its value (promises awaited).
    fn eval(&self, b: &mut Browser, expr: &str) -> Value {
        let r = b.call(
            Some(&self.session),
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true, "awaitPromise": true}),
        );
        assert!(
            r.get("exceptionDetails").is_none(),
            "{expr} threw: {}",
            r["exceptionDetails"]
        );
        r["result"]["value"].clone()
    }

    fn text(&self, b: &mut Browser, selector: &str) -> String {
        let expr = format!(
            "(document.querySelector({}) || {{}}).textContent || ''",
            json!(selector)
        );
        self.eval(b, &expr).as_str().unwrap_or_default().to_owned()
    }

    /// A PNG of the whole page at the current width.
    fn screenshot(&self, b: &mut Browser, path: &Path) {
        // A tab in the background may never paint: the capture would wait for a frame.
        b.call(Some(&self.session), "Page.bringToFront", json!({}));
        let m = b.call(Some(&self.session), "Page.getLayoutMetrics", json!({}));
        let size = &m["cssContentSize"];
        let clip =
            json!({"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1});
        let shot = b.call(
            Some(&self.session),
            "Page.captureScreenshot",
            json!({"format": "png", "captureBeyondViewport": true, "clip": clip}),
        );
        let png = base64_decode(shot["data"].as_str().unwrap());
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
        std::fs::write(path, png).unwrap();
        eprintln!("wrote {}", path.display());
    }
}

/// The repo's `docs/`, where `ORCH_UPDATE_SCREENSHOT=1` writes the screenshots.
fn docs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs")
}

fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => 0,
    };
    let bytes: Vec<u8> = s.bytes().filter(|c| *c != b'=' && *c != b'\n').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let v: Vec<u32> = chunk.iter().map(|c| u32::from(val(*c))).collect();
        let n = v
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, x)| n | (x << (18 - 6 * i)));
        for i in 0..chunk.len().saturating_sub(1) {
            out.push((n >> (16 - 8 * i)) as u8);
        }
    }
    out
}

#[test]
fn chromium_sees_live_updates_outcomes_the_watch_chart_and_token_actions() {
    if !python_available() {
        eprintln!("python3 is not installed: the demo's sample service cannot run; skipping");
        return;
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    // The whole demo: APP-2's watch fails and rolls back; the watch's state files are gone
    // afterwards, so its chart can only come from 16-post-deploy-log.md.
    let out = Command::new(ORCH)
        .args(["demo", "--dir"])
        .arg(&dir)
        .env("ORCH_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("run orch demo");
    reap_orphans();
    assert!(
        out.status.success(),
        "demo failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    stop_service(&dir);
    let config = dir.join("orch.toml");
    orch(
        &config,
        &[
            "submit",
            "--repo",
            "service",
            "--title",
            "Log every request",
            "--body",
            "from the browser test",
        ],
    );

    let port = free_port();
    let bind = format!("127.0.0.1:{port}");
    let child = Command::new(ORCH)
        .arg("--config")
        .arg(&config)
        .args(["serve", "--bind", &bind, "--grace-s", "1"])
        .env("ORCH_LOG", "warn")
        // Each agent stage takes 4 s: long enough to watch APP-4 move, short enough to see it.
        .env("ORCH_DEMO_AGENT_SLEEP_MS", "4000")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn orch serve");
    let _served = Served {
        child,
        dir: dir.clone(),
    };
    wait_for(30, "orch serve to answer", || {
        http_get(port, "/healthz")
            .filter(|r| r.contains(" 200 "))
            .map(|_| ())
    });
    let base = format!("http://{bind}");

    // The CLI tells the same story: `orch status` has the outcome column, and `orch deploys
    // --json` prints the API's document.
    let status = String::from_utf8_lossy(&orch(&config, &["status"]).stdout).into_owned();
    let app2 = status
        .lines()
        .find(|l| l.starts_with("APP-2 "))
        .unwrap_or_else(|| panic!("no APP-2 in\n{status}"));
    // The release train rolled it back and reverted it on main.
    assert!(app2.contains("reverted"), "{status}");
    let one = String::from_utf8_lossy(&orch(&config, &["status", "APP-2"]).stdout).into_owned();
    assert!(
        one.contains("outcome reverted at observe: 3 consecutive FAIL"),
        "{one}"
    );
    let cli: Value =
        serde_json::from_slice(&orch(&config, &["--json", "deploys", "service"]).stdout).unwrap();
    let api = http_get(port, "/repos/service/deploys").unwrap();
    let api: Value = serde_json::from_str(api.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(cli["deploys"], api["deploys"]);
    let deploys = cli["deploys"].as_array().unwrap();
    assert!(
        deploys.iter().any(|d| d["deployed_by"] == "APP-2"
            && d["rolled_back"] == true
            && d["verdict"] == "FAILED"),
        "{cli}"
    );
    let human =
        String::from_utf8_lossy(&orch(&config, &["deploys", "service"]).stdout).into_owned();
    assert!(human.contains("rolled back"), "{human}");

    if !Path::new(CHROMIUM).exists() {
        eprintln!("{CHROMIUM} is missing: skipping the browser part (apt-get install -y chromium)");
        return;
    }
    let mut b = Browser::start();

    // 1. APP-4's page follows the worker without reloading.
    let live = b.open(&format!("{base}/ui/tasks/APP-4"), 1280, 900);
    live.eval(&mut b, "window.__notReloaded = 42");
    let first = wait_for(30, "APP-4 to leave intake", || {
        let s = live.text(&mut b, ".story .headline");
        (!s.contains("intake")).then_some(s)
    });
    let later = wait_for(40, "APP-4's page to show a later stage in place", || {
        let s = live.text(&mut b, ".story .headline");
        (s != first).then_some(s)
    });
    assert_eq!(
        live.eval(&mut b, "window.__notReloaded"),
        json!(42),
        "the page was reloaded (headline went from {first:?} to {later:?})"
    );
    assert_eq!(live.eval(&mut b, "document.body.dataset.live"), json!("1"));

    // 2. Cancel without the token is refused and says so; with the token it works, and the
    //    page shows the cancelled story in place, then stops polling.
    live.eval(
        &mut b,
        "sessionStorage.clear(); document.getElementById('token').value = ''; \
         document.querySelector('button[data-action=cancel]').click()",
    );
    let refused = wait_for(10, "the refusal to show", || {
        let t = live.text(&mut b, "#action-result");
        t.contains("refused").then_some(t)
    });
    assert!(refused.contains("401"), "{refused}");
    let stage = orch(&config, &["--json", "status", "APP-4"]);
    let v: Value = serde_json::from_slice(&stage.stdout).unwrap();
    assert_ne!(v["task"]["stage"], "cancelled", "cancelled without a token");
    live.eval(
        &mut b,
        &format!(
            "document.getElementById('token').value = {}; \
             document.querySelector('button[data-action=cancel]').click()",
            json!(TOKEN)
        ),
    );
    let done = wait_for(10, "the cancel to succeed", || {
        let t = live.text(&mut b, "#action-result");
        t.contains("done").then_some(t)
    });
    assert!(done.contains("cancelled"), "{done}");
    wait_for(10, "the story to say cancelled", || {
        live.text(&mut b, ".story .headline")
            .contains("cancelled")
            .then_some(())
    });
    wait_for(10, "the finished page to stop polling", || {
        (live.eval(&mut b, "document.body.dataset.live") == json!("0")).then_some(())
    });
    assert_eq!(live.eval(&mut b, "window.__notReloaded"), json!(42));

    // 3. The queue page: a new submission appears in place; APP-2 is not a green `done`.
    let queue = b.open(&format!("{base}/"), 1280, 900);
    queue.eval(&mut b, "window.__notReloaded = 7");
    orch(
        &config,
        &[
            "submit",
            "--repo",
            "service",
            "--title",
            "Appears live",
            "--body",
            "x",
        ],
    );
    wait_for(20, "APP-5 to appear on the queue page", || {
        (queue.eval(&mut b, "!!document.getElementById('task-APP-5')") == json!(true)).then_some(())
    });
    assert_eq!(queue.eval(&mut b, "window.__notReloaded"), json!(7));
    let app2_outcome = queue.eval(
        &mut b,
        "document.querySelector('#task-APP-2 [data-outcome]').dataset.outcome",
    );
    assert_eq!(app2_outcome, json!("reverted"));
    let app1_outcome = queue.eval(
        &mut b,
        "document.querySelector('#task-APP-1 [data-outcome]').dataset.outcome",
    );
    assert_eq!(app1_outcome, json!("shipped"));
    let chip_colour = queue.eval(
        &mut b,
        "getComputedStyle(document.querySelector('#task-APP-2 .chip')).backgroundColor",
    );
    let shipped_colour = queue.eval(
        &mut b,
        "getComputedStyle(document.querySelector('#task-APP-1 .chip')).backgroundColor",
    );
    assert_ne!(
        chip_colour, shipped_colour,
        "rolled back looks like shipped"
    );
    orch(&config, &["cancel", "APP-5"]);

    // 4. APP-2's page: outcome and reason first, the chart drawn after the watch ended.
    let task = b.open(&format!("{base}/ui/tasks/APP-2"), 1280, 900);
    let headline = task.text(&mut b, ".story .headline");
    assert!(headline.contains("rolled back"), "{headline}");
    assert!(headline.contains("observe"), "{headline}");
    let reason = task.text(&mut b, "#reason");
    assert!(reason.contains("FAIL"), "{reason}");
    let story_top = task.eval(
        &mut b,
        "document.querySelector('.story').getBoundingClientRect().top",
    );
    assert!(
        story_top.as_f64().is_some_and(|t| t < 200.0),
        "the story is not at the top: {story_top}"
    );
    let bars = task.eval(
        &mut b,
        "document.querySelectorAll('#watch-chart rect').length",
    );
    assert!(bars.as_u64().is_some_and(|n| n >= 3), "chart bars: {bars}");
    let red = task.eval(
        &mut b,
        "document.querySelectorAll('#watch-chart rect[fill=\"#c0392b\"]').length",
    );
    assert!(red.as_u64().is_some_and(|n| n >= 3), "FAIL bars: {red}");
    let caption = task.text(&mut b, "#watch-chart figcaption");
    assert!(caption.contains("16-post-deploy-log.md"), "{caption}");
    assert!(caption.contains("FAILED"), "{caption}");
    let rendered = task.eval(
        &mut b,
        "document.querySelectorAll('#live-artifacts .md h1, #live-artifacts .md table').length",
    );
    assert!(
        rendered.as_u64().is_some_and(|n| n > 0),
        "no rendered Markdown"
    );
    assert_eq!(task.eval(&mut b, "document.body.dataset.live"), json!("0"));

    // 5. A phone's width: nothing scrolls sideways.
    let phone = b.open(&format!("{base}/ui/tasks/APP-2"), 390, 844);
    let overflow = phone.eval(
        &mut b,
        "document.documentElement.scrollWidth - document.documentElement.clientWidth",
    );
    assert!(
        overflow.as_f64().is_some_and(|o| o <= 1.0),
        "the task page is wider than a phone by {overflow} px"
    );
    let queue_phone = b.open(&format!("{base}/"), 390, 844);
    let overflow = queue_phone.eval(
        &mut b,
        "document.documentElement.scrollWidth - document.documentElement.clientWidth",
    );
    assert!(
        overflow.as_f64().is_some_and(|o| o <= 1.0),
        "the queue page is wider than a phone by {overflow} px"
    );

    // 6. The repo page lists the deploys with APP-2's rollback.
    let repo = b.open(&format!("{base}/ui/repos/service"), 1280, 900);
    let history = repo.text(&mut b, "#live-repo");
    assert!(history.contains("APP-1"), "{history}");
    assert!(history.contains("rolled back"), "{history}");

    // 7. The delivery report over the demo: APP-1 shipped, APP-2 deployed and rolled back; a
    // trend bar for this week, where the time went stage by stage, and nothing sideways on a
    // phone.
    let report = b.open(&format!("{base}/ui/report"), 1280, 900);
    let cards = report.text(&mut b, "#report-cards");
    assert!(cards.contains("deploys"), "{cards}");
    let deploys = report.eval(
        &mut b,
        "document.querySelector('#report-cards [data-key=deploys] .n').textContent",
    );
    assert_eq!(
        deploys,
        json!("2"),
        "APP-1 and APP-2 were deployed: {cards}"
    );
    let rate = report.eval(
        &mut b,
        "document.querySelector('#report-cards [data-key=cfr] .n').textContent",
    );
    assert_eq!(rate, json!("50%"), "APP-2 was rolled back: {cards}");
    let bars = report.eval(
        &mut b,
        "Array.from(document.querySelectorAll('#report-trend rect')).filter(r => r.getBBox().height > 0).length",
    );
    assert!(
        bars.as_u64().is_some_and(|n| n >= 2),
        "a deploy bar and a failure bar: {bars}"
    );
    let stages = report.eval(
        &mut b,
        "Array.from(document.querySelectorAll('#report-stages .row')).map(r => r.dataset.stage)",
    );
    for stage in ["implementation", "staging", "deploy"] {
        assert!(
            stages
                .as_array()
                .is_some_and(|s| s.iter().any(|x| x == stage)),
            "{stage} in {stages}"
        );
    }
    let report_phone = b.open(&format!("{base}/ui/report"), 390, 844);
    let overflow = report_phone.eval(
        &mut b,
        "document.documentElement.scrollWidth - document.documentElement.clientWidth",
    );
    assert!(
        overflow.as_f64().is_some_and(|o| o <= 1.0),
        "the report page is wider than a phone by {overflow} px"
    );

    if std::env::var("ORCH_UPDATE_SCREENSHOT").as_deref() == Ok("1") {
        report.screenshot(&mut b, &docs_dir().join("dashboard-report.png"));
        let docs = docs_dir();
        queue.screenshot(&mut b, &docs.join("dashboard.png"));
        task.eval(
            &mut b,
            "document.getElementById('art-16-post-deploy-log').open = true",
        );
        task.screenshot(&mut b, &docs.join("dashboard-task.png"));
        repo.screenshot(&mut b, &docs.join("dashboard-repo.png"));
        phone.screenshot(&mut b, &docs.join("dashboard-phone.png"));
    }
}
