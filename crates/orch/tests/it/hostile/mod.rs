//! The hostile-agent suite (issue 27): agents that misbehave as a prompt-injected model would,
//! run by the real `orch serve`, and operators' calls made with a stolen token. Each test
//! performs one attack through an agent of the `command` backend (a shell script that
//! attacks, then writes a valid artifact) or through the API and the CLI, and checks that the
//! attack is refused or has no effect, that the item's events say why, and that nothing of it
//! reaches a branch (`git log -p --all`, and every object, in orch's clone and in the user's
//! checkout).
//!
//! - `paths`: what a stage may commit (protected paths, links, special files, hostile names,
//!   too many files);
//! - `attribution`: who made an operator call;
//! - `terminal`: what `orch status`/`orch logs` print from agents and users;
//! - `sandbox`: what an agent can reach (the job queue, git hooks and config, orch's secrets,
//!   the token, orch.toml, other paths, daemons, a fork bomb, the network).
//!
//! Every test runs on SQLite; the `_postgres` variants run the same test on the local
//! PostgreSQL (`ORCH_TEST_PG_URL`), each in a fresh schema.

use crate::common;

mod attribution;
mod paths;
mod sandbox;
mod terminal;

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use orch_store::{ConnectOptions, Store};

pub use common::ORCH;

/// Which database the test's orch runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// The token of every hostile home's `orch.toml`: unique, so a test can tell that it never
/// reached a branch.
pub const TOKEN: &str = "hostile-suite-token-5f0c1d";

/// An orch home made by `orch demo --setup-only` (the sample service as the user's checkout,
/// the demo's scripted agents), on `backend`, with agents replaced by attack scripts.
pub struct Home {
    _tmp: tempfile::TempDir,
    pub dir: PathBuf,
    pub config: PathBuf,
    pub db_url: String,
    pub bind: String,
}

impl Home {
    pub async fn new(backend: Backend) -> Home {
        common::become_subreaper();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("home");
        common::demo_setup(&dir);
        let config = dir.join("orch.toml");
        let port = free_port();
        let text = std::fs::read_to_string(&config).unwrap();
        let text = text.replace("token = \"demo-token\"", &format!("token = \"{TOKEN}\""));
        let text = regex_free_bind(&text, port);
        std::fs::write(&config, text).unwrap();
        let db_url = match backend {
            Backend::Sqlite => format!("sqlite://{}", dir.join(".orch/orch.db").display()),
            Backend::Postgres => orch_store::testing::fresh_pg_schema().await,
        };
        let home = Home {
            _tmp: tmp,
            dir,
            config,
            db_url,
            bind: format!("127.0.0.1:{port}"),
        };
        home.ok(&["migrate"]);
        home
    }

    /// Runs the repo's agents unsandboxed (`sandbox = "off"`): for an attack on what orch
    /// commits that needs paths outside the worktree, which the sandbox alone would stop. The
    /// commit guard holds either way.
    pub fn unsandboxed(&self) {
        let text = std::fs::read_to_string(&self.config).unwrap();
        std::fs::write(&self.config, common::sandbox_off(&text)).unwrap();
    }

    /// Replaces `[agents.<agent>]` by a `command` agent running `body` (after the prompt is
    /// read from stdin) as `sh`.
    pub fn agent(&self, agent: &str, body: &str) {
        self.agent_reading_prompt(agent, Path::new("/dev/null"), body);
    }

    /// [`Home::agent`] that keeps the prompt it is given in `prompt`.
    pub fn agent_reading_prompt(&self, agent: &str, prompt: &Path, body: &str) {
        use std::os::unix::fs::PermissionsExt as _;
        let script = self.dir.join(format!("{agent}-attack.sh"));
        std::fs::write(
            &script,
            format!("#!/bin/sh\ncat > '{}'\n{body}\n", prompt.display()),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let text = std::fs::read_to_string(&self.config).unwrap();
        let head = format!("[agents.{agent}]\n");
        let start = text.find(&head).unwrap();
        let end = text[start + head.len()..]
            .find("\n[")
            .map_or(text.len(), |i| start + head.len() + i + 1);
        let text = format!(
            "{}{head}backend = \"command\"\ncommand = \"{}\"\ntimeout_s = 60\n\n{}",
            &text[..start],
            script.display(),
            &text[end..]
        );
        std::fs::write(&self.config, text).unwrap();
    }

    /// `orch --config <home>/orch.toml <args>` on the home's database.
    pub fn orch(&self, args: &[&str]) -> Output {
        std::process::Command::new(ORCH)
            .arg("--config")
            .arg(&self.config)
            .args(args)
            .env("ORCH_DATABASE_URL", &self.db_url)
            .env("ORCH_LOG", "warn")
            .env_remove("COLUMNS")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// [`Home::orch`], which must succeed; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.orch(args);
        assert!(
            out.status.success(),
            "orch {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Submits a work item through the CLI; its id.
    pub fn submit(&self, title: &str) -> String {
        let out = self.ok(&["--json", "submit", "--repo", "service", "--title", title]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["work_item_id"].as_str().unwrap().to_owned()
    }

    /// `orch serve` on the home's bind address and database: 50 ms demo agents, 10 s leases
    /// (a lease lost on a loaded machine would run an attempt twice and blur the counts).
    pub fn serve(&self) -> Serving {
        let mut cmd = common::Serve::command(&self.dir, &self.bind);
        cmd.env("ORCH_DATABASE_URL", &self.db_url)
            .env("ORCH_LEASE_S", "10");
        Serving(cmd.spawn().expect("spawn orch serve"))
    }

    pub async fn store(&self) -> Store {
        Store::connect(&self.db_url, ConnectOptions::default())
            .await
            .unwrap()
    }

    /// orch's clone of the sample service.
    pub fn clone_dir(&self) -> PathBuf {
        self.dir.join(".orch/repos/service")
    }

    /// The user's checkout of the sample service.
    pub fn checkout(&self) -> PathBuf {
        self.dir.join("service")
    }

    /// Fails when `needle` is anywhere in the history of any branch (`git log -p --all`) or
    /// in any object of orch's clone or of the user's checkout: a refused change is checked
    /// before anything is added to git.
    pub fn assert_nowhere_in_git(&self, needle: &[u8]) {
        for repo in [self.clone_dir(), self.checkout()] {
            let log = git(&repo, &["log", "-p", "--all", "--binary"]);
            assert!(
                !contains(&log, needle),
                "{}: `git log -p --all` holds {:?}",
                repo.display(),
                String::from_utf8_lossy(needle)
            );
            let objects = git(&repo, &["cat-file", "--batch-all-objects", "--batch"]);
            assert!(
                !contains(&objects, needle),
                "{}: an object holds {:?}",
                repo.display(),
                String::from_utf8_lossy(needle)
            );
        }
    }

    /// Every path of every branch's tip (and of every commit of the branches) in orch's clone,
    /// with its mode: `(mode, path bytes)`.
    pub fn committed_entries(&self) -> Vec<(String, Vec<u8>)> {
        let repo = self.clone_dir();
        let revs = git(&repo, &["rev-list", "--all"]);
        let mut out = Vec::new();
        for rev in String::from_utf8_lossy(&revs).split_whitespace() {
            let tree = git(&repo, &["ls-tree", "-r", "-z", rev]);
            for entry in tree.split(|b| *b == 0).filter(|e| !e.is_empty()) {
                let tab = entry.iter().position(|b| *b == b'\t').unwrap();
                let mode = String::from_utf8_lossy(&entry[..6]).into_owned();
                out.push((mode, entry[tab + 1..].to_vec()));
            }
        }
        out
    }
}

/// A running `orch serve`.
pub struct Serving(tokio::process::Child);

impl Serving {
    /// SIGTERM, up to 20 s to exit, then the orphans it left are reaped: only those outside
    /// this process's group, so the tests running beside it keep their children's statuses.
    pub async fn terminate(mut self) {
        if let Some(pid) = self.0.id() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
        let _ = tokio::time::timeout(Duration::from_secs(20), self.0.wait()).await;
        common::reap_adopted();
    }
}

/// The demo config's `bind` set to `127.0.0.1:<port>`.
fn regex_free_bind(text: &str, port: u16) -> String {
    text.lines()
        .map(|l| match l.starts_with("bind = ") {
            true => format!("bind = \"127.0.0.1:{port}\""),
            false => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `git -C repo args`, which must succeed; its stdout.
pub fn git(repo: &Path, args: &[&str]) -> Vec<u8> {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?} in {}: {}",
        repo.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The messages of the task's events of `kind`.
pub async fn messages(store: &Store, task_id: i64, kind: &str) -> Vec<String> {
    store
        .task_events(task_id)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == kind)
        .map(|e| e.message)
        .collect()
}

/// How long an attacked item may take to end (three attempts, backing off 1 s and 2 s).
pub const ENDS_WITHIN: Duration = Duration::from_secs(180);
