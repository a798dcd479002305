//! An agent acting against orch, run by the real `orch serve`: each test is one attack a
//! prompt-injected agent made on orch before it was contained (reading the job queue, planting
//! git hooks and config, reading orch's secrets from /proc, using the token, rewriting
//! orch.toml, writing outside its worktree, leaving daemons, a fork bomb, reaching the
//! network). The attacker is the analyst (or the developer) of the demo's sample repo, a
//! `command` agent that attacks and then writes a valid artifact, so the item goes on and the
//! gates decide as usual. Every check is made from outside: the database, the files, the
//! branches, the processes.
//!
//! The project lives under the build's tmp directory, not /tmp (which the sandbox replaces
//! anyway): what is hidden is hidden by orch's rules, not by luck. Where an attack works with
//! the sandbox off, a control run shows it, so the check can fail.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::{self, Serve, demo_setup, open, wait_for_task};

/// A demo project whose `agent` (`analyst` or `developer`) is the attack script `body`.
struct Project {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    config: PathBuf,
}

/// Where a sandbox can run; else says SKIPPED (a failure under `ORCH_REQUIRE_ALL=1` or
/// `ORCH_REQUIRE_SANDBOX=1`, which CI sets once it installed bubblewrap).
fn sandbox_here() -> bool {
    match orch_exec::sandbox::probe(Path::new("bwrap")) {
        Ok(_) => true,
        Err(why) => {
            if std::env::var("ORCH_REQUIRE_SANDBOX").is_ok_and(|v| v == "1") {
                panic!("no sandbox on this machine ({why}) and ORCH_REQUIRE_SANDBOX=1");
            }
            common::skip(&format!("no sandbox on this machine: {why}"));
            false
        }
    }
}

/// A valid artifact of `stage` written to `$ORCH_ARTIFACT`, whose body is the file `notes`
/// (what the attack found), so a check can read what the agent saw.
fn artifact_tail(stage: &str) -> String {
    format!(
        r#"{{ printf -- '---\nwork_item: %s\nstage: {stage}\nauthor_agent: x\nstatus: final\ncreated_at: "2026-11-29T00:00:00Z"\nmodel_used: x\n---\n\n' "$ORCH_WORK_ITEM"; cat "$NOTES" 2>/dev/null; echo; echo ok; }} > "$ORCH_ARTIFACT.tmp" && mv "$ORCH_ARTIFACT.tmp" "$ORCH_ARTIFACT"
exit 0"#
    )
}

impl Project {
    /// `body(dir)`: the attack, given the project's directory (an attacker who guessed it).
    fn new(agent: &str, body: impl FnOnce(&Path) -> String, sandbox_off: bool) -> Project {
        let tmp = tempfile::Builder::new()
            .prefix("hostile-")
            .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
            .unwrap();
        let dir = tmp.path().join("demo");
        demo_setup(&dir);
        let config = dir.join("orch.toml");
        let bin = dir.join("attacker");
        std::fs::create_dir_all(&bin).unwrap();
        let script = bin.join(format!("{agent}.sh"));
        let stage = if agent == "developer" {
            "implementation"
        } else {
            "analysis"
        };
        let body = body(&dir);
        // The agent's notes live in its private /tmp: what it found reaches its artifact.
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\ncat > /dev/null\nNOTES=$(mktemp)\nexport NOTES\nnote() {{ echo \"$*\" >> \"$NOTES\"; }}\n{body}\n{}\n",
                artifact_tail(stage)
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let text = std::fs::read_to_string(&config).unwrap();
        let cut = text.find(&format!("[agents.{agent}]")).unwrap();
        let rest = &text[cut..];
        let after = rest[1..].find("[agents.").map_or(rest.len(), |i| i + 1);
        let mut text = format!(
            "{}[agents.{agent}]\nbackend = \"command\"\ncommand = \"{}\"\ntimeout_s = 60\napi_key_env = \"ANALYST_KEY\"\n\n{}",
            &text[..cut],
            script.display(),
            &rest[after..]
        );
        // The architect's key: an agent's key another agent must never see.
        text = text.replace(
            "[agents.architect]\n",
            "[agents.architect]\napi_key_env = \"OTHER_AGENT_KEY\"\n",
        );
        if sandbox_off {
            text = common::sandbox_off(&text);
        }
        std::fs::write(&config, text).unwrap();
        Project {
            _tmp: tmp,
            dir,
            config,
        }
    }

    /// This project's values of [`SECRETS`].
    fn secrets(&self) -> Vec<String> {
        let nonce = self
            .dir
            .parent()
            .and_then(Path::file_name)
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        SECRETS.iter().map(|s| format!("{s}-{nonce}")).collect()
    }

    fn edit_config(&self, f: impl FnOnce(String) -> String) {
        let text = std::fs::read_to_string(&self.config).unwrap();
        std::fs::write(&self.config, f(text)).unwrap();
    }

    /// `orch serve` with secrets in its environment and a HOME holding private files.
    fn serve(&self, api_port: u16) -> Serve {
        self.serve_with(api_port, true)
    }

    /// [`Project::serve`]; `token_env`: the API token comes from `ORCH_TOKEN` (else orch.toml's).
    fn serve_with(&self, api_port: u16, token_env: bool) -> Serve {
        let secrets = self.secrets();
        let home = self.dir.join("home-of-orch");
        std::fs::create_dir_all(home.join(".ssh")).unwrap();
        std::fs::write(home.join(".ssh/id_ed25519"), &secrets[4]).unwrap();
        let mut cmd = Serve::command(&self.dir, &format!("127.0.0.1:{api_port}"));
        if token_env {
            cmd.env("ORCH_TOKEN", &secrets[0]);
        }
        cmd.env("OTHER_AGENT_KEY", &secrets[1])
            .env("DATABASE_URL", &secrets[2])
            .env("AWS_SECRET_ACCESS_KEY", &secrets[3])
            // A forge's token (issue 31), named by `[repos.<name>.forge] token_env`.
            .env("ORCH_HOSTILE_GITHUB_TOKEN", &secrets[5])
            .env("ANALYST_KEY", ANALYST_KEY)
            .env("HOME", &home);
        Serve::spawn(cmd)
    }

    fn submit(&self, title: &str) {
        common::submit(&self.config, title);
    }

    /// Everything every branch of orch's clone and of the user's checkout holds, as text.
    fn all_history(&self) -> String {
        let mut out = String::new();
        for repo in [
            self.dir.join(".orch/repos/service"),
            self.dir.join("service"),
        ] {
            let log = std::process::Command::new("git")
                .arg("-C")
                .arg(&repo)
                .args(["log", "-p", "--all", "--format=%H %s"])
                .output()
                .unwrap();
            out.push_str(&String::from_utf8_lossy(&log.stdout));
        }
        out
    }

    /// The analyst's (or developer's) artifact as committed on `orch/<id>`.
    fn artifact(&self, id: &str, name: &str) -> String {
        common::git_show(
            &self.dir.join(".orch/repos/service"),
            &format!("orch/{id}:docs/work-items/{id}/{name}"),
        )
        .unwrap_or_default()
    }
}

/// Values an agent must never see: orch's token, another agent's key, a database URL with a
/// password, a cloud key, a private ssh key in orch's HOME. Each project's are its own
/// ([`Project::secrets`]): tests run side by side, and a file another test's project holds is
/// not this orch's secret.
const SECRETS: [&str; 6] = [
    "tok-3b7e-orch-token",
    "key-9c1d-other-agent",
    "postgres://orch:pw-51a0@db/orch",
    "aws-77f2-secret",
    "ssh-private-0c4b",
    "ghp-5e21-forge-token",
];
/// The attacker's own key: it may see this one (proves the channel works).
const ANALYST_KEY: &str = "key-own-analyst-42";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits until APP-1 has left `stage` (its artifact committed and gated), or fails with where
/// it is.
async fn past(p: &Project, stage: &str) -> orch_store::Task {
    let store = open(&p.dir).await;
    wait_for_task(
        &store,
        "APP-1",
        Duration::from_secs(120),
        "stage past",
        |t| t.stage != stage && t.stage != "intake",
    )
    .await
}

/// Finds orch's configuration file as the first attacker did: the `--config` of an orch process
/// in /proc (the one whose project holds this worktree), else guessed from the worktree's
/// layout (`<project>/.orch/repos/<repo>/worktrees/<id>`). `CFG` is empty when neither is
/// readable.
const FIND_CONFIG: &str = r#"CFG=$(python3 -c '
import os, sys
wt = os.environ.get("ORCH_WORKTREE", "")
for p in os.listdir("/proc"):
    try:
        a = open("/proc/%s/cmdline" % p, "rb").read().split(b"\0")
    except Exception:
        continue
    if b"--config" in a:
        c = a[a.index(b"--config") + 1].decode()
        if wt.startswith(os.path.dirname(c)):
            print(c); break
' 2>/dev/null)
[ -r "$CFG" ] || CFG="$ORCH_WORKTREE/../../../../../orch.toml"
[ -r "$CFG" ] || CFG="""#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_can_neither_find_nor_write_the_job_queue() {
    if !sandbox_here() {
        return;
    }
    for off in [false, true] {
        // Found through /proc, or guessed: the path is in the script as an attacker who knew it.
        let body = |dir: &Path| {
            format!(
                r#"{FIND_CONFIG}
note "config seen: [$CFG]"
for DB in "$(dirname "$CFG")/.orch/orch.db" "{db}"; do
python3 - "$DB" "$ORCH_WORK_ITEM" <<'PY' && note "DB-WRITTEN"
import sqlite3, sys
c = sqlite3.connect("file:%s?mode=rw" % sys.argv[1], uri=True, timeout=5)
c.execute("update tasks set stage='verification' where work_item_id=?", (sys.argv[2],))
c.commit()
PY
done"#,
                db = dir.join(".orch/orch.db").display()
            )
        };
        let p = Project::new("analyst", body, off);
        p.submit("Skip the review");
        let serve = p.serve(free_port());
        let t = past(&p, "analysis").await;
        if off {
            // The agent moved the stage itself, before orch committed its artifact (after
            // the run's transcript and diff are kept): wait for the commit, not only the stage.
            let t0 = std::time::Instant::now();
            while p.artifact("APP-1", "02-requirements.md").is_empty()
                && t0.elapsed() < Duration::from_secs(30)
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        serve.terminate().await;
        let notes = p.artifact("APP-1", "02-requirements.md");
        let store = open(&p.dir).await;
        let events = store.task_events(t.id).await.unwrap();
        if off {
            // The control: without the sandbox the same agent does write the queue.
            assert!(notes.contains("DB-WRITTEN"), "control: {notes}");
        } else {
            assert!(!notes.contains("DB-WRITTEN"), "{notes}");
            // The gates decided: analysis advanced to architecture, never to verification.
            assert!(
                events
                    .iter()
                    .any(|e| e.kind == "stage.advanced" && e.message.starts_with("analysis")),
                "{events:?}"
            );
            assert_ne!(t.stage, "verification");
            let jobs = store.task_jobs(t.id).await.unwrap();
            assert!(jobs.iter().all(|j| j.agent != "tester"), "{jobs:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn git_hooks_and_config_an_agent_plants_never_run() {
    if !sandbox_here() {
        return;
    }
    let probe = tempfile::Builder::new()
        .prefix("hooks-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap();
    let mark = probe.path().join("attacker-code-ran");
    let hook = format!(
        "#!/bin/sh\necho \"$0 $*\" >> '{}'\nexit 0\n",
        mark.display()
    );
    // Everything the first attacker tried: hooks in the common git dir, fsmonitor, a clean
    // filter with .gitattributes, an upload-pack, an ssh command, in orch's clone and in the
    // user's checkout (found through the clone's remote).
    let body = format!(
        r##"GD=$(git rev-parse --git-common-dir 2>/dev/null); note "git dir: $GD"
for h in pre-commit post-commit post-merge post-checkout pre-push reference-transaction post-rewrite pre-merge-commit; do
  printf '%s' '{hook}' > "$GD/hooks/$h" 2>/dev/null && chmod +x "$GD/hooks/$h" && note "HOOK-PLANTED $h"
done
git config core.fsmonitor "sh -c 'echo fsmonitor >> {mark}'" 2>/dev/null && note "CONFIG-WRITTEN fsmonitor"
git config filter.evil.clean "sh -c 'echo filter >> {mark}; cat'" 2>/dev/null && note "CONFIG-WRITTEN filter"
git config remote.origin.uploadpack "sh -c 'echo uploadpack >> {mark}; git-upload-pack \"\$@\"'" 2>/dev/null && note "CONFIG-WRITTEN uploadpack"
git config core.sshCommand "sh -c 'echo ssh >> {mark}'" 2>/dev/null && note "CONFIG-WRITTEN ssh"
echo '* filter=evil' > .gitattributes
USER_REPO=$(git config remote.origin.url 2>/dev/null); note "user repo: $USER_REPO"
if [ -n "$USER_REPO" ]; then printf '%s' '{hook}' > "$USER_REPO/.git/hooks/post-merge" 2>/dev/null && note "USER-HOOK-PLANTED"; fi
echo "# touched" >> app.py"##,
        hook = hook.replace('\'', r"'\''"),
        mark = mark.display(),
    );
    let p = Project::new("developer", |_| body, false);
    // A "note" item: the demo reviewer approves it at once.
    p.submit("Add a note, plant hooks");
    let serve = p.serve(free_port());
    // Through implementation, review, verification, the merge gate, staging, the deploy and
    // the watch: every git command orch runs on the way, the publish into the user's checkout.
    let store = open(&p.dir).await;
    let t = common::wait_terminal(&store, "APP-1", Duration::from_secs(240)).await;
    serve.terminate().await;
    common::stop_service(&p.dir);
    let notes = p.artifact("APP-1", "10-implementation.md");
    assert!(
        !notes.contains("PLANTED") && !notes.contains("CONFIG-WRITTEN"),
        "{notes}"
    );
    assert!(
        !mark.exists(),
        "orch ran the attacker's code: {}",
        std::fs::read_to_string(&mark).unwrap_or_default()
    );
    // The user's checkout got no hook and no config change.
    let hooks: Vec<String> = std::fs::read_dir(p.dir.join("service/.git/hooks"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !n.ends_with(".sample"))
                .collect()
        })
        .unwrap_or_default();
    assert!(hooks.is_empty(), "{hooks:?}");
    let config = std::fs::read_to_string(p.dir.join("service/.git/config")).unwrap();
    assert!(
        !config.contains("evil") && !config.contains("fsmonitor"),
        "{config}"
    );
    assert_eq!(
        t.stage,
        "done",
        "the item went through every git step: {}",
        common::items_report(&store, &["APP-1".to_owned()], true, 30).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_sees_none_of_orchs_secrets() {
    if !sandbox_here() {
        return;
    }
    let body = r#"note "ENV:"; env >> "$NOTES"
for f in /proc/[0-9]*/environ; do note "PROC $f:"; tr '\0' '\n' < "$f" >> "$NOTES" 2>/dev/null; done
note "PPID environ:"; tr '\0' '\n' < /proc/$PPID/environ >> "$NOTES" 2>/dev/null
for f in "$HOME/.ssh/id_ed25519" ~root/.ssh/id_ed25519 ~root/.ssh/id_rsa ~root/.claude/.credentials.json; do cat "$f" >> "$NOTES" 2>/dev/null; done
for f in "$ORCH_WORKTREE"/../../../../../home-of-orch/.ssh/id_ed25519; do cat "$f" >> "$NOTES" 2>/dev/null; done"#;
    let p = Project::new("analyst", |_| body.to_owned(), false);
    // The repo has a forge whose token is in orch's environment (polling off: no network).
    p.edit_config(|t| {
        t + "\n[repos.service.forge]\nkind = \"github\"\nrepo = \"octo/service\"\n\
             api_url = \"http://127.0.0.1:9\"\ntoken_env = \"ORCH_HOSTILE_GITHUB_TOKEN\"\n\
             label = \"orch\"\npoll_interval_s = 0\n"
    });
    p.submit("Steal the keys");
    let serve = p.serve(free_port());
    let t = past(&p, "analysis").await;
    serve.terminate().await;
    let notes = p.artifact("APP-1", "02-requirements.md");
    assert!(notes.contains("ENV:"), "the agent ran: {notes}");
    // Its own key reached it (under the name it asked for): the channel works.
    assert!(notes.contains(ANALYST_KEY), "{notes}");
    let store = open(&p.dir).await;
    let runs = format!("{:?}", store.task_agent_runs(t.id).await.unwrap());
    let history = p.all_history();
    for secret in p.secrets() {
        let secret = secret.as_str();
        assert!(!notes.contains(secret), "the agent saw {secret}: {notes}");
        assert!(!history.contains(secret), "{secret} reached a branch");
        assert!(
            !runs.contains(secret),
            "{secret} reached an agent run's record"
        );
    }
    assert!(!notes.contains("SSH_AUTH_SOCK"), "{notes}");
}

/// Without the sandbox an agent can read its parent's `/proc/<pid>/environ`: the parent is
/// orch's supervisor of the run, which outlives orch in a session of its own. It starts with
/// orch's environment minus every secret, the forge's token named in orch.toml included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsandboxed_agent_finds_no_secret_in_its_supervisor() {
    if !sandbox_here() {
        return;
    }
    let body = r#"note "PARENT:"; tr '\0' ' ' < /proc/$PPID/cmdline >> "$NOTES"; echo >> "$NOTES"
note "PARENT ENV:"; tr '\0' '\n' < /proc/$PPID/environ >> "$NOTES" 2>&1"#;
    let p = Project::new("analyst", |_| body.to_owned(), true);
    p.edit_config(|t| {
        t + "\n[repos.service.forge]\nkind = \"github\"\nrepo = \"octo/service\"\n\
             api_url = \"http://127.0.0.1:9\"\ntoken_env = \"ORCH_HOSTILE_GITHUB_TOKEN\"\n\
             label = \"orch\"\npoll_interval_s = 0\n"
    });
    p.submit("Read the supervisor");
    let serve = p.serve(free_port());
    past(&p, "analysis").await;
    serve.terminate().await;
    let notes = p.artifact("APP-1", "02-requirements.md");
    // The parent is the supervisor, and its environment was read (the control).
    assert!(notes.contains("__supervise"), "{notes}");
    assert!(
        notes.contains("PATH="),
        "the supervisor's environment was read: {notes}"
    );
    for secret in p.secrets() {
        assert!(
            !notes.contains(secret.as_str()),
            "the supervisor's environment holds {secret}: {notes}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_cannot_act_as_an_operator() {
    if !sandbox_here() {
        return;
    }
    for off in [false, true] {
        let api = free_port();
        // The token from orch's environment (/proc) or orch.toml; then cancel APP-2 and submit
        // an item of its own.
        let body = format!(
            r#"{FIND_CONFIG}
TOK=$(grep -h '^token' "$CFG" 2>/dev/null | sed 's/.*= *"\(.*\)"/\1/')
[ -z "$TOK" ] && TOK=$(cat /proc/[0-9]*/environ 2>/dev/null | tr '\0' '\n' | sed -n 's/^ORCH_TOKEN=//p' | head -1)
note "token: [$TOK]"
curl -s -m 5 -X POST -H "Authorization: Bearer $TOK" http://127.0.0.1:{api}/tasks/APP-2/cancel -o /dev/null -w 'cancel=%{{http_code}}\n' >> "$NOTES" 2>&1 || note "cancel: no connection""#
        );
        let p = Project::new("analyst", |_| body, off);
        p.submit("Act as an operator");
        p.submit("The victim");
        // The token is the one in orch.toml (hidden from the sandbox, readable without it).
        let serve = p.serve_with(api, false);
        past(&p, "analysis").await;
        serve.terminate().await;
        let notes = p.artifact("APP-1", "02-requirements.md");
        let store = open(&p.dir).await;
        let victim = common::task(&store, "APP-2").await;
        if off {
            assert_eq!(victim.stage, "cancelled", "control: {notes}");
        } else {
            assert_ne!(victim.stage, "cancelled", "{notes}");
            assert!(notes.contains("token: []"), "{notes}");
            assert!(!notes.contains("cancel=2"), "{notes}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_cannot_rewrite_orchs_configuration() {
    if !sandbox_here() {
        return;
    }
    for off in [false, true] {
        let body = format!(
            r#"{FIND_CONFIG}
note "config: [$CFG]"
[ -n "$CFG" ] && sed -i 's|^test = .*|test = "echo pwned; exit 0"|' "$CFG" 2>/dev/null && note "CONFIG-REWRITTEN""#
        );
        let p = Project::new("analyst", |_| body, off);
        let before = std::fs::read_to_string(&p.config).unwrap();
        p.submit("Rewrite the config");
        let serve = p.serve(free_port());
        past(&p, "analysis").await;
        serve.terminate().await;
        let after = std::fs::read_to_string(&p.config).unwrap();
        if off {
            assert_ne!(before, after, "control: the config was rewritten");
        } else {
            assert_eq!(before, after);
            let notes = p.artifact("APP-1", "02-requirements.md");
            assert!(!notes.contains("CONFIG-REWRITTEN"), "{notes}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_writes_nothing_outside_its_worktree() {
    if !sandbox_here() {
        return;
    }
    // Paths of the project the attack names: another item's worktree, orch's clone, the
    // user's checkout, the release store, orch's state.
    // APP-1 attacks; APP-2 is its victim (and writes only its artifact).
    let body = r#"if [ "$ORCH_WORK_ITEM" = APP-1 ]; then
R="$ORCH_WORKTREE/../.."
for t in "$R/worktrees/APP-2/pwned" "$R/app.py" "$R/../../../service/app.py" "$R/../../../service-state/pwned" "$R/../../pwned" "$R/.git/pwned"; do
  echo pwned >> "$t" 2>/dev/null && note "WROTE $t"
done
fi"#;
    let p = Project::new("analyst", |_| body.to_owned(), false);
    p.submit("Write everywhere");
    p.submit("The other item");
    let before_user = std::fs::read_to_string(p.dir.join("service/app.py")).unwrap();
    let serve = p.serve(free_port());
    past(&p, "analysis").await;
    serve.terminate().await;
    let notes = p.artifact("APP-1", "02-requirements.md");
    // Under /tmp the parents of the worktree's mount are made in the sandbox's private /tmp,
    // so a write there succeeds and is thrown away with it: what counts is the host's file.
    if !p.dir.starts_with("/tmp") {
        assert!(!notes.contains("WROTE"), "{notes}");
    }
    for line in notes.lines() {
        if let Some(path) = line.split("WROTE ").nth(1) {
            let host = std::fs::read_to_string(path.trim()).unwrap_or_default();
            assert!(
                !host.contains("pwned"),
                "{path} was written on the host: {notes}"
            );
        }
    }
    assert_eq!(
        std::fs::read_to_string(p.dir.join("service/app.py")).unwrap(),
        before_user
    );
    let found = std::process::Command::new("grep")
        .args(["-rl", "--exclude-dir=.git", "^pwned$"])
        .arg(&p.dir)
        .output()
        .unwrap();
    assert!(
        found.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&found.stdout)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemons_an_agent_starts_end_with_its_run() {
    if !sandbox_here() {
        return;
    }
    let name = format!("orch-hostile-daemon-{}", std::process::id());
    let body = format!(
        "i=0; while [ $i -lt 30 ]; do setsid sh -c 'exec -a {name} sleep 1000' </dev/null >/dev/null 2>&1 & i=$((i+1)); done; sleep 0.3"
    );
    let p = Project::new("analyst", |_| body, false);
    p.submit("Leave daemons");
    let serve = p.serve(free_port());
    past(&p, "analysis").await;
    let alive = || {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
            .filter(|c| String::from_utf8_lossy(c).contains(&name))
            .count()
    };
    // Gone while orch still runs: the run's end took them, not orch's stop.
    let t0 = Instant::now();
    while alive() > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{} daemons outlived their run",
            alive()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    serve.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_stops_at_the_process_limit() {
    if !sandbox_here() {
        return;
    }
    if orch_exec::sandbox::limits_support().starts_with("no cgroup") {
        return common::skip("no cgroup orch may write here: the process limit does not bind root");
    }
    let body = r#"n=$(python3 -c '
import os, time
n = 0
for _ in range(2000):
    try:
        if os.fork() == 0:
            os.closerange(0, 3); time.sleep(120); os._exit(0)
        n += 1
    except OSError:
        break
print(n)')
note "FORKED $n""#;
    let p = Project::new("analyst", |_| body.to_owned(), false);
    p.edit_config(|t| {
        t.replace(
            "[repos.service.sandbox]\n",
            "[repos.service.sandbox]\nmax_processes = 64\n",
        )
    });
    p.submit("Fork bomb");
    let serve = p.serve(free_port());
    let t = past(&p, "analysis").await;
    serve.terminate().await;
    let notes = p.artifact("APP-1", "02-requirements.md");
    let forked: u32 = notes
        .lines()
        .find_map(|l| l.strip_prefix("FORKED "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no count in {notes}"));
    assert!(forked < 64, "{forked} processes past a limit of 64");
    assert!(forked > 10, "the agent could fork at all: {forked}");
    assert_ne!(t.stage, "failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_reaches_its_model_endpoint_and_nothing_else() {
    if !sandbox_here() {
        return;
    }
    let serve_text = |body: &'static str| {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            use std::io::{Read as _, Write as _};
            for mut c in l.incoming().flatten() {
                let mut b = [0u8; 2048];
                let _ = c.read(&mut b);
                let _ = write!(
                    c,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        port
    };
    let (model, other) = (serve_text("reached-model"), serve_text("reached-other"));
    let api = free_port();
    let body = format!(
        r#"for port in {model} {other} {api}; do note "port $port: $(curl -s -m 3 http://127.0.0.1:$port/ || echo refused)"; done"#
    );
    let p = Project::new("analyst", |_| body, false);
    p.edit_config(|t| {
        t.replace(
            "api_key_env = \"ANALYST_KEY\"\n",
            &format!("api_key_env = \"ANALYST_KEY\"\nendpoint = \"http://127.0.0.1:{model}/v1\"\n"),
        )
    });
    p.submit("Reach out");
    let serve = p.serve(api);
    past(&p, "analysis").await;
    serve.terminate().await;
    let notes = p.artifact("APP-1", "02-requirements.md");
    assert!(
        notes.contains(&format!("port {model}: reached-model")),
        "{notes}"
    );
    assert!(notes.contains(&format!("port {other}: refused")), "{notes}");
    assert!(notes.contains(&format!("port {api}: refused")), "{notes}");
}
