//! The dashboard in a real browser: a demo project with three submitted work items (one
//! cancelled, so stages differ), the real `orch serve`, and headless Chromium rendering `/`.
//! Asserts the rendered DOM shows every work item with its stage and pipeline row; with
//! `ORCH_UPDATE_SCREENSHOT=1` it also rewrites `docs/dashboard.png`.
//!
//! Skips (with a note) when `/usr/bin/chromium` is missing; CI installs it with
//! `apt-get install -y chromium`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const ORCH: &str = env!("CARGO_BIN_EXE_orch");
const CHROMIUM: &str = "/usr/bin/chromium";

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
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One plain HTTP/1.0 GET; `None` until the server answers.
fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
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
        for env in ["production", "staging"] {
            let _ = Command::new("sh")
                .arg(self.dir.join("service/stop.sh"))
                .arg(env)
                .arg(self.dir.join("service-state"))
                .status();
        }
    }
}

fn chromium(args: &[&str]) -> Output {
    Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
        ])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run chromium")
}

#[test]
fn chromium_renders_the_dashboard_with_every_task_and_its_stage() {
    if !Path::new(CHROMIUM).exists() {
        eprintln!("{CHROMIUM} is missing: skipping the browser test (apt-get install -y chromium)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let out = Command::new(ORCH)
        .args(["demo", "--setup-only", "--dir"])
        .arg(&dir)
        .env("ORCH_LOG", "warn")
        .output()
        .expect("run orch demo");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config = dir.join("orch.toml");
    for title in [
        "Add a health endpoint",
        "Rate-limit the API",
        "Drop the legacy flag",
    ] {
        orch(
            &config,
            &[
                "submit",
                "--repo",
                "service",
                "--title",
                title,
                "--body",
                "from the browser test",
            ],
        );
    }
    orch(&config, &["cancel", "APP-3"]);

    let port = free_port();
    let bind = format!("127.0.0.1:{port}");
    let child = Command::new(ORCH)
        .arg("--config")
        .arg(&config)
        .args(["serve", "--bind", &bind, "--grace-s", "1"])
        .env("ORCH_LOG", "warn")
        // The agents move slowly so the stages seen are the ones submitted.
        .env("ORCH_DEMO_AGENT_SLEEP_MS", "60000")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn orch serve");
    let _served = Served {
        child,
        dir: dir.clone(),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !http_get(port, "/healthz").is_some_and(|r| r.contains(" 200 ")) {
        assert!(
            Instant::now() < deadline,
            "orch serve did not answer on {bind}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    let url = format!("http://{bind}/");
    let out = chromium(&["--dump-dom", &url]);
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        dom.contains("<h1>Queue</h1>"),
        "no dashboard in the DOM:\n{dom}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for id in ["APP-1", "APP-2", "APP-3"] {
        let row = dom
            .find(&format!("id=\"task-{id}\""))
            .map(|at| &dom[at..at + dom[at..].find("</tr>").unwrap_or(dom.len() - at)])
            .unwrap_or_else(|| panic!("{id} is not in the DOM:\n{dom}"));
        assert!(row.contains(&format!("href=\"/ui/tasks/{id}\"")), "{row}");
        assert!(
            row.contains("class=\"pipe\""),
            "{id} has no pipeline row: {row}"
        );
        if id == "APP-3" {
            assert!(
                row.contains("<span class=\"stage cancelled\">cancelled</span>"),
                "{row}"
            );
            assert!(
                row.contains("class=\"box current\" title=\"cancelled\""),
                "{row}"
            );
        } else {
            assert!(!row.contains("cancelled"), "{row}");
            assert!(row.contains("class=\"box current\""), "{row}");
        }
    }

    // The task page of the cancelled item, rendered by the browser too.
    let out = chromium(&["--dump-dom", &format!("http://{bind}/ui/tasks/APP-3")]);
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(page.contains("task.cancelled"), "{page}");
    assert!(page.contains("Drop the legacy flag"), "{page}");

    if std::env::var("ORCH_UPDATE_SCREENSHOT").as_deref() == Ok("1") {
        let shot = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/dashboard.png");
        let arg = format!("--screenshot={}", shot.display());
        let out = chromium(&[&arg, "--window-size=1280,900", "--hide-scrollbars", &url]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let png = std::fs::read(&shot).expect("the screenshot was written");
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
        eprintln!("wrote {}", shot.display());
    }
}
