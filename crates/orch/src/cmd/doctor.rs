//! `orch doctor`: checks what orch needs on this machine and says plainly what is missing, how
//! to fix it, and what orch will do to each declared repository. Exit 0 when nothing required is
//! missing, 1 when something is (the report is printed either way; `--json` prints it as JSON).

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use orch_domain::config::{Backend, Config};
use orch_exec::Git;
use orch_runner::repos::{self, Setup};

use crate::context::Context;

/// How a check ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Ok,
    /// Works, but the user should know (not a failure).
    Note,
    /// May not work: the user should act (not counted as a failure).
    Warn,
    Fail,
}

struct Check {
    status: Status,
    what: String,
    fix: String,
}

#[derive(Default)]
struct Report {
    checks: Vec<Check>,
}

impl Report {
    fn check(&mut self, ok: bool, what: impl Into<String>, fix: impl Into<String>) {
        if ok {
            self.push(Status::Ok, what, "");
        } else {
            self.push(Status::Fail, what, fix);
        }
    }

    fn push(&mut self, status: Status, what: impl Into<String>, fix: impl Into<String>) {
        self.checks.push(Check {
            status,
            what: what.into(),
            fix: fix.into(),
        });
    }
}

/// A program given as a path must be an executable file; a bare name must be one in `PATH`.
fn executable(program: &str) -> Result<PathBuf, String> {
    let is_exec = |p: &Path| {
        p.metadata()
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    };
    if program.contains('/') {
        let p = PathBuf::from(program);
        if !p.exists() {
            return Err(format!("{program} does not exist"));
        }
        if !is_exec(&p) {
            return Err(format!("{program} is not executable (chmod +x {program})"));
        }
        return Ok(p);
    }
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join(program))
                .find(|p| is_exec(p))
        })
        .ok_or_else(|| format!("`{program}` is not on PATH"))
}

pub async fn run(cx: &Context) -> Result<ExitCode> {
    let mut r = Report::default();
    r.check(
        executable("git").is_ok(),
        "git is installed",
        "install git (e.g. `apt-get install git`)",
    );
    r.check(
        executable("sh").is_ok(),
        "sh is installed",
        "repo commands run with `sh -c`",
    );
    match (&cx.config, &cx.config_error) {
        (_, Some(e)) => r.check(false, e.clone(), "fix the line named above"),
        (Some(_), None) => r.check(true, format!("config {}", cx.config_path.display()), ""),
        (None, None) => r.check(
            false,
            format!("config {} does not exist", cx.config_path.display()),
            "run `orch init`",
        ),
    }
    if cx.config_error.is_none() {
        match cx.open_store().await {
            Ok(store) => {
                r.check(
                    true,
                    format!("database {}", orch_store::redact_url(&store.target())),
                    "",
                );
                store.close().await;
            }
            Err(e) => r.check(
                false,
                format!("database: {e:#}"),
                "fix the URL, start the server, or run `orch init` / `orch migrate`",
            ),
        }
    }
    if orch_runner::failpoint::any_active() {
        r.check(
            false,
            "ORCH_FAILPOINTS is set: this process will abort on purpose",
            "unset ORCH_FAILPOINTS (it is for crash tests)",
        );
    }
    if let Some(config) = &cx.config {
        agents(&mut r, config).await;
        repos(&mut r, cx, config).await;
    }
    let failed = r.checks.iter().filter(|c| c.status == Status::Fail).count();
    if cx.json {
        let doc = orch_api::dto::DoctorReport {
            ok: failed == 0,
            problems: failed,
            checks: r
                .checks
                .iter()
                .map(|c| orch_api::dto::DoctorCheck {
                    status: match c.status {
                        Status::Ok => "ok",
                        Status::Note => "note",
                        Status::Warn => "warn",
                        Status::Fail => "fail",
                    },
                    what: c.what.clone(),
                    fix: (!c.fix.is_empty()).then(|| c.fix.clone()),
                })
                .collect(),
        };
        crate::output::print_json(&orch_api::dto::to_json(&doc));
    } else {
        for c in &r.checks {
            let label = match c.status {
                Status::Ok => "ok  ",
                Status::Note => "note",
                Status::Warn => "WARN",
                Status::Fail => "FAIL",
            };
            crate::output::outln(&format!("{label}  {}", c.what));
            if !c.fix.is_empty() {
                if matches!(c.status, Status::Fail | Status::Warn) {
                    crate::output::outln(&format!("      fix: {}", c.fix));
                } else {
                    crate::output::outln(&format!("      {}", c.fix));
                }
            }
        }
        if failed == 0 {
            crate::output::outln("\neverything orch needs is here");
        } else {
            crate::output::outln(&format!("\n{failed} problem(s) found"));
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(crate::exit::Kind::Failed.exit_code())
    })
}

async fn agents(r: &mut Report, config: &Config) {
    // Stages whose agent must change the repository's code (`writes_code`), not only write
    // documents.
    let code_stages: Vec<(String, String)> = config
        .pipeline()
        .map(|p| {
            p.stages
                .iter()
                .filter(|s| s.writes_code)
                .filter_map(|s| Some((s.name.to_string(), s.agent.as_ref()?.to_string())))
                .collect()
        })
        .unwrap_or_default();
    for (name, a) in &config.agents {
        if a.backend == Backend::Openai {
            if let Some((stage, _)) = code_stages.iter().find(|(_, agent)| agent == name.as_str()) {
                r.check(
                    false,
                    format!(
                        "agent {name}: the `openai` backend only writes documents, but stage `{stage}` must change code"
                    ),
                    format!(
                        "give stage `{stage}` a coding agent (backend = \"claude\", \"codex\", \"aider\" or \"command\")"
                    ),
                );
            }
            let Some(endpoint) = &a.endpoint else {
                r.check(
                    false,
                    format!("agent {name}: openai backend without `endpoint`"),
                    format!("set [agents.{name}] endpoint"),
                );
                continue;
            };
            let url = format!("{}/models", endpoint.trim_end_matches('/'));
            let reachable = match reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
            {
                Ok(c) => c.get(&url).send().await.is_ok(),
                Err(_) => false,
            };
            r.check(
                reachable,
                format!("agent {name}: endpoint {endpoint}"),
                "start the server or fix `endpoint`",
            );
            if let Some(var) = &a.api_key_env {
                r.check(
                    std::env::var_os(var).is_some(),
                    format!("agent {name}: API key variable {var}"),
                    format!("export {var}=…"),
                );
            }
            continue;
        }
        let preset = orch_runner::agents::preset_name(a.backend);
        if preset.is_some() {
            preset_key(r, name.as_str(), a);
            if let Some(endpoint) = &a.endpoint {
                check_endpoint(r, name.as_str(), endpoint).await;
            }
        } else if let Some(var) = &a.api_key_env {
            r.check(
                std::env::var(var).is_ok_and(|v| !v.trim().is_empty()),
                format!("agent {name}: API key variable {var}"),
                orch_runner::agents::missing_key_message(name.as_str(), var),
            );
        }
        match a.command.clone().or(preset.map(str::to_owned)) {
            Some(p) => match executable(&p) {
                Ok(found) => {
                    r.check(
                        true,
                        format!("agent {name}: program {}", found.display()),
                        "",
                    );
                    if let Some(tool) = preset {
                        check_version(r, name.as_str(), tool, &found).await;
                    }
                }
                Err(why) => r.check(
                    false,
                    format!("agent {name}: {why}"),
                    format!("install `{p}`, make it executable, or set [agents.{name}] command"),
                ),
            },
            None => r.check(
                false,
                format!("agent {name}: no command"),
                format!("set [agents.{name}] command"),
            ),
        }
    }
}

/// A preset's key: the variable `api_key_env` names must be set (each run gets a fresh HOME,
/// so a CLI's login does not apply unless `config_home` keeps the user's).
fn preset_key(r: &mut Report, name: &str, a: &orch_domain::config::AgentConfig) {
    match &a.api_key_env {
        Some(var) => {
            let set = std::env::var(var).is_ok_and(|v| !v.trim().is_empty());
            r.check(
                set,
                format!(
                    "agent {name}: API key variable {var} is {}",
                    if set { "set" } else { "not set" }
                ),
                orch_runner::agents::missing_key_message(name, var),
            );
        }
        None if a.config_home.as_deref().map(str::trim) == Some("user") => r.push(
            Status::Note,
            format!("agent {name}: no api_key_env; the CLI's own login in your HOME is used (config_home = \"user\")"),
            "",
        ),
        None => r.check(
            false,
            format!("agent {name}: no api_key_env, so the CLI gets no API key (each run has a fresh HOME: a login does not apply)"),
            format!("set api_key_env = \"<VARIABLE>\" in [agents.{name}] (e.g. ANTHROPIC_API_KEY, OPENAI_API_KEY) and export that variable with the key where orch runs"),
        ),
    }
}

/// The agent's `endpoint` answers HTTP (any status: it is there); a refused or timed-out
/// connection is a failure.
async fn check_endpoint(r: &mut Report, name: &str, endpoint: &str) {
    let client = match reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            r.check(
                false,
                format!("agent {name}: cannot check endpoint {endpoint}: {e}"),
                "",
            );
            return;
        }
    };
    match client.get(endpoint).send().await {
        Ok(resp) => r.check(
            true,
            format!(
                "agent {name}: endpoint {endpoint} answers (HTTP {})",
                resp.status().as_u16()
            ),
            "",
        ),
        Err(e) => r.check(
            false,
            format!(
                "agent {name}: endpoint {endpoint} does not answer: {}",
                error_chain(&e)
            ),
            format!("start the model server, or fix [agents.{name}] endpoint (the API's base URL)"),
        ),
    }
}

/// An error with its causes, on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        text.push_str(&format!(": {c}"));
        cur = c.source();
    }
    text
}

/// The CLI starts and says its version, within the versions orch was tested with.
async fn check_version(r: &mut Report, name: &str, tool: &str, program: &Path) {
    let home = match tempfile::tempdir() {
        Ok(h) => h,
        Err(e) => {
            r.check(
                false,
                format!("agent {name}: cannot make a temporary HOME: {e}"),
                "",
            );
            return;
        }
    };
    let cmd = orch_exec::Cmd::new(program)
        .arg("--version")
        .env("HOME", home.path())
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        .timeout(Duration::from_secs(60));
    let out = match orch_exec::run(&cmd).await {
        Ok(out) => out,
        Err(e) => {
            r.check(
                false,
                format!(
                    "agent {name}: `{} --version` does not start: {e}",
                    program.display()
                ),
                format!(
                    "reinstall {tool} (scripts/install-agent-clis installs the tested versions)"
                ),
            );
            return;
        }
    };
    let text = format!("{}\n{}", out.stdout_lossy(), out.stderr_lossy());
    let (oldest, newest) = orch_runner::agents::tested_versions(tool);
    let Some(version) = orch_runner::agents::version_in(&text).filter(|_| out.success()) else {
        r.push(
            Status::Warn,
            format!(
                "agent {name}: `{} --version` did not report a version ({})",
                program.display(),
                text.trim().lines().next().unwrap_or("no output")
            ),
            format!(
                "orch was tested with {tool} {oldest} to {newest}; check that `command` is that CLI"
            ),
        );
        return;
    };
    let v = |s: &str| orch_runner::agents::version_in(s).unwrap_or_default();
    if version < v(oldest) {
        // Older than anything tested: a FAIL (its output may not be what orch reads, and the
        // fix is known); newer is a WARN (usually compatible, and checked by CI's newest run).
        r.push(
            Status::Fail,
            format!(
                "agent {name}: {tool} {} is older than the oldest tested ({oldest})",
                dotted(&version)
            ),
            format!(
                "upgrade {tool} to {oldest}..{newest} (scripts/install-agent-clis installs them)"
            ),
        );
    } else if version > v(newest) {
        r.push(
            Status::Warn,
            format!("agent {name}: {tool} {} is newer than the newest tested ({newest}); orch may misread its output", dotted(&version)),
            format!("use a tested version ({oldest}..{newest}), or check a run's transcript (`orch logs ID --transcript`)"),
        );
    } else {
        r.check(
            true,
            format!(
                "agent {name}: {tool} {} (tested: {oldest} to {newest})",
                dotted(&version)
            ),
            "",
        );
    }
}

fn dotted(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(".")
}

async fn repos(r: &mut Report, cx: &Context, config: &Config) {
    let git = Git {
        timeout: Duration::from_secs(20),
        ..Git::new()
    };
    for (name, repo) in &config.repos {
        let branch = repo.default_branch.as_str();
        match repos::inspect(&git, &cx.root, repo).await {
            Err(e) => r.check(
                false,
                format!("repo {name}: {e:#}"),
                format!(
                    "set [repos.{name}] path to a git checkout or a bare repository, or url to a remote"
                ),
            ),
            Ok(setup) => repo_setup(r, &git, name.as_str(), branch, repo, setup).await,
        }
        let mut commands: Vec<(&str, &str)> = Vec::new();
        if let Some(t) = &repo.test {
            commands.push(("test", t));
        } else {
            r.check(
                false,
                format!("repo {name}: no `test` command"),
                "verification and the merge gate need one",
            );
        }
        for s in repo.staging.iter().chain(repo.staging_smoke.iter()) {
            commands.push((s.name.as_str(), s.run.as_str()));
        }
        if let Some(d) = &repo.deploy {
            commands.push(("deploy", d));
        }
        if let Some(d) = &repo.rollback {
            commands.push(("rollback", d));
        }
        for (what, cmd) in commands {
            let program = cmd.split_whitespace().next().unwrap_or_default();
            // A relative path runs inside the repo's checkout, which doctor does not look into.
            if program.starts_with("./") {
                continue;
            }
            r.check(
                executable(program).is_ok(),
                format!("repo {name}: {what} runs `{program}`"),
                format!("install `{program}` on this machine"),
            );
        }
        if repo.deploy.is_some() && repo.health_url.is_none() {
            r.check(
                false,
                format!("repo {name}: deploy without health_url"),
                "set health_url so deploys are confirmed and watched",
            );
        }
        if repo.staging.is_empty() && repo.staging_smoke.is_empty() {
            r.check(
                false,
                format!("repo {name}: no staging steps"),
                format!("every item would end at staging (TOOL_ERROR no_steps: nothing verified the change); add [[repos.{name}.staging]] steps, or one step that says so (`run = \"true\"`) if the repo has no staging"),
            );
        }
        if repo.deploy.is_some() && repo.rollback.is_none() {
            r.push(
                Status::Note,
                format!("repo {name}: deploy without rollback"),
                "set rollback: a deploy that fails or is not confirmed can then be undone; without it orch can only alert",
            );
        }
        if repo.deploy.is_some() && repo.alert.is_none() && repo.alert_webhook.is_none() {
            r.push(
                Status::Note,
                format!("repo {name}: deploys with nobody to alert"),
                "set alert (a command) or alert_webhook, so a production orch cannot verify reaches a person",
            );
        }
        if repo.alert_webhook.is_some() && repo.alert_webhook_secret.is_none() {
            r.push(
                Status::Note,
                format!("repo {name}: alert_webhook without alert_webhook_secret"),
                "set alert_webhook_secret so the receiver can verify X-Orch-Signature",
            );
        }
        sandbox(r, name.as_str(), repo);
        if let Some(forge_cfg) = &repo.forge {
            use orch_runner::forge::{Finding, inspect};
            for f in inspect(name.as_str(), forge_cfg, branch).await {
                match f {
                    Finding::Ok(what) => r.push(Status::Ok, what, ""),
                    Finding::Note(what, fix) => r.push(Status::Note, what, fix),
                    Finding::Warn(what, fix) => r.push(Status::Warn, what, fix),
                    Finding::Fail(what, fix) => r.push(Status::Fail, what, fix),
                }
            }
        }
    }
}

/// Whether the repo's agents and tests run sandboxed, and if not, why, loudly.
fn sandbox(r: &mut Report, name: &str, repo: &orch_domain::config::RepoConfig) {
    if !repo.sandbox.enabled {
        r.push(
            Status::Note,
            format!(
                "repo {name}: UNSANDBOXED (sandbox = \"off\"): its agents and tests can read orch's database, configuration and secrets files, and write anywhere orch can"
            ),
            format!(
                "install bubblewrap and remove `sandbox = \"off\"` from [repos.{name}]"
            ),
        );
        return;
    }
    match orch_exec::sandbox::probe(Path::new("bwrap")) {
        Ok(version) => r.push(
            Status::Ok,
            format!(
                "repo {name}: agents and tests run sandboxed ({version}; limits: {})",
                orch_exec::sandbox::limits_support()
            ),
            "",
        ),
        Err(why) => r.check(
            false,
            format!("repo {name}: the sandbox cannot be set up: {why}; its agents and tests will be refused"),
            format!(
                "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap), or set sandbox = \"off\" in [repos.{name}] to run them unsandboxed"
            ),
        ),
    }
}

async fn repo_setup(
    r: &mut Report,
    git: &Git,
    name: &str,
    branch: &str,
    repo: &orch_domain::config::RepoConfig,
    setup: Setup,
) {
    let explain = setup.explain(branch);
    match &setup {
        Setup::Remote { url } => {
            // Reachable with this machine's credentials (ssh agent, credential helper)?
            let raw = repo.url.as_deref().unwrap_or_default();
            match git
                .ls_remote_branch(&std::env::temp_dir(), raw, branch)
                .await
            {
                Ok(Some(_)) => r.check(true, format!("repo {name}: {explain}"), ""),
                Ok(None) => r.push(
                    Status::Note,
                    format!("repo {name}: {explain}"),
                    format!("{url} has no branch `{branch}` yet; the first merge creates it"),
                ),
                Err(e) => r.check(
                    false,
                    format!(
                        "repo {name}: cannot reach {url}: {}",
                        redact(&e.to_string(), raw, url)
                    ),
                    "check the URL and this machine's credentials for git (ssh agent, credential helper)",
                ),
            }
        }
        Setup::Bare { path } => match git.rev_parse(path, &format!("refs/heads/{branch}")).await {
            Ok(Some(_)) => r.check(true, format!("repo {name}: {explain}"), ""),
            _ => r.check(
                false,
                format!("repo {name}: {} has no branch `{branch}`", path.display()),
                format!("push `{branch}` there first, or set default_branch"),
            ),
        },
        Setup::Checkout { path } => {
            match git.rev_parse(path, &format!("refs/heads/{branch}")).await {
                Ok(Some(_)) => {}
                _ => {
                    r.check(
                        false,
                        format!("repo {name}: {} has no branch `{branch}`", path.display()),
                        format!("commit on `{branch}` first, or set default_branch"),
                    );
                    return;
                }
            }
            let note = match git.checked_out_at(path, branch).await {
                Ok(Some(wt)) => match git.status_porcelain(&wt).await {
                    Ok(entries) if entries.iter().any(|e| e.code != "??") => format!(
                        "`{branch}` is checked out in {} and has local changes now: until they are committed or stashed, merges stay in orch's clone",
                        wt.display()
                    ),
                    _ => format!(
                        "`{branch}` is checked out in {} and clean: merges fast-forward it",
                        wt.display()
                    ),
                },
                _ => format!("`{branch}` is not checked out: merges move the branch ref only"),
            };
            r.push(Status::Ok, format!("repo {name}: {explain}"), note);
        }
    }
}

fn redact(text: &str, raw: &str, redacted: &str) -> String {
    text.replace(raw, redacted)
}
