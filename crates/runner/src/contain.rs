//! How orch contains what it runs for a stage: the one place that decides, for each kind of
//! child, its sandbox and the part of orch's environment it inherits.
//!
//! - **Agents** ([`for_agent`]) and **the repository's own code** ([`for_repo_code`]: the test
//!   command, verification, sandboxed staging steps) are untrusted: they run in the repo's
//!   sandbox ([`orch_exec::sandbox`]) unless the repo says `sandbox = "off"`. The work item's
//!   worktree (or the checkout the command is about) is writable; orch's clone's git directory
//!   is shown read-only; orch's database, configuration and state ([`protect`]), every clone and
//!   worktree, the user's checkouts and `HOME` are hidden; `/tmp` is private. An agent reaches
//!   only its model endpoint (and what `[agents.<name>] network` adds); the repo's code only
//!   what `[repos.<name>.sandbox] network` opens.
//! - **Trusted commands** ([`for_trusted`]: deploy, rollback, alert, staging steps marked
//!   `sandbox = false`) run on the host: they come from orch's configuration, and what they run
//!   passed review and staging.
//! - **Every child** inherits only [`orch_exec::env::BASE`] of orch's environment plus what it
//!   needs: an agent its own key (set by the agent runner under the CLI's name) and what
//!   `[agents.<name>] env` names, the repo's commands what `[repos.<name>] env` names. orch's
//!   token and database URL never.
//!
//! Where the sandbox is wanted but cannot be set up (no bubblewrap, no namespaces), a run is
//! refused with the reason and the two ways out (install it, or `sandbox = "off"`), never
//! started unsandboxed behind the user's back.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use orch_domain::config::{AgentConfig, Backend, RepoConfig, SandboxNetwork};
use orch_domain::ids::RepoName;
use orch_exec::Cmd;
use orch_exec::sandbox::{self, Endpoint, Limits, Network, Sandbox};

use crate::engine::StageRun;

static PROTECTED: RwLock<Vec<PathBuf>> = RwLock::new(Vec::new());

/// Names orch's own files and directories (its configuration file, its database, state
/// directories, the users' checkouts) that no sandboxed run may see. Called by the binary at
/// start-up and after a configuration reload; replaces the earlier list.
pub fn protect(paths: Vec<PathBuf>) {
    match PROTECTED.write() {
        Ok(mut p) => *p = paths,
        Err(poisoned) => *poisoned.into_inner() = paths,
    }
}

fn protected() -> Vec<PathBuf> {
    match PROTECTED.read() {
        Ok(p) => p.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    }
}

/// A child's containment: apply it to its [`Cmd`] with [`Contained::apply`], and keep it until
/// the run ended (it owns the run's private home).
pub struct Contained {
    sandbox: Option<Arc<Sandbox>>,
    /// Variables set for the child (its private `HOME`, proxies).
    env: Vec<(String, String)>,
    /// Names of orch's variables the child inherits besides the basic ones.
    allow: Vec<String>,
    _home: Option<tempfile::TempDir>,
    /// How the run is contained, in words for its record: `sandboxed (…)` or `UNSANDBOXED …`.
    pub note: String,
}

impl Contained {
    /// `cmd` with this containment: the sandbox, an allowlisted environment and the variables.
    pub fn apply(&self, cmd: Cmd) -> Cmd {
        let mut cmd = cmd.env_allow(self.allow.iter().cloned());
        for (k, v) in &self.env {
            cmd = cmd.env(k, v);
        }
        match &self.sandbox {
            Some(sb) => cmd.sandbox(sb.clone()),
            None => cmd,
        }
    }

    /// Whether the run is sandboxed.
    pub fn is_sandboxed(&self) -> bool {
        self.sandbox.is_some()
    }
}

/// Why a run that should be sandboxed cannot be, with the two ways out.
fn unavailable(repo: &RepoName, why: &str) -> String {
    format!(
        "the sandbox cannot be set up on this machine: {why}. Install bubblewrap (Debian/Ubuntu: \
         `apt-get install bubblewrap`), or set `sandbox = \"off\"` in [repos.{repo}] to run its \
         agents and tests unsandboxed"
    )
}

fn off_note(repo: &RepoName) -> String {
    format!(
        "UNSANDBOXED: sandbox = \"off\" in [repos.{repo}]: this run could read and write anything orch can"
    )
}

/// The sandbox every untrusted run of `run`'s repo starts from: the repo's limits and extra
/// paths, `HOME` and orch's protected paths hidden, every clone and worktree hidden, orch's
/// clone's git directory shown read-only, `writable` writable.
fn base_sandbox(run: &StageRun, writable: &[&Path]) -> Result<Sandbox, String> {
    let cfg = &run.repo.sandbox;
    let bwrap = PathBuf::from("bwrap");
    let version = sandbox::probe(&bwrap).map_err(|why| unavailable(&run.repo_name, &why))?;
    tracing::trace!(%version, "sandbox available");
    let mut sb = Sandbox::new();
    sb.bwrap = bwrap;
    sb.hidden.extend(protected());
    sb.hidden.push(run.repos_dir.clone());
    sb.read_only.push(run.repo_dir.join(".git"));
    sb.read_only.extend(cfg.read_only.iter().map(PathBuf::from));
    sb.writable.extend(writable.iter().map(|p| p.to_path_buf()));
    sb.writable.extend(cfg.writable.iter().map(PathBuf::from));
    sb.limits = Limits {
        processes: Some(cfg.max_processes),
        memory_bytes: Some(cfg.max_memory_mb.saturating_mul(1 << 20)),
        cpu_seconds: Some(cfg.max_cpu_s),
        file_bytes: Some(cfg.max_file_mb.saturating_mul(1 << 20)),
    };
    Ok(sb)
}

/// A private home for one run, made outside every repository.
fn private_home() -> Result<tempfile::TempDir, String> {
    tempfile::Builder::new()
        .prefix("orch-home-")
        .tempdir()
        .map_err(|e| format!("cannot create the run's private home: {e}"))
}

fn network_words(network: &Network) -> String {
    match network {
        Network::None => "network: none".to_owned(),
        Network::Host => "network: the host's".to_owned(),
        Network::Allow(list) => format!(
            "network: only {}",
            list.iter()
                .map(Endpoint::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn parse_all(entries: &[String]) -> Result<Vec<Endpoint>, String> {
    entries.iter().map(|e| Endpoint::parse(e)).collect()
}

/// An allowlist the sandbox can enforce: a loopback endpoint is served inside at its own port,
/// which an unprivileged relay can only open from 1024 up.
fn enforceable(list: Vec<Endpoint>) -> Result<Vec<Endpoint>, String> {
    match list.iter().find(|e| e.is_loopback() && e.port < 1024) {
        Some(e) => Err(format!(
            "the sandbox cannot reach the loopback endpoint {e}: a port below 1024 cannot be relayed; serve it on a port from 1024 up"
        )),
        None => Ok(list),
    }
}

/// The endpoints an agent may reach: its `endpoint` (or its preset's provider) and its
/// `network` entries.
pub fn agent_endpoints(config: &AgentConfig) -> Result<Vec<Endpoint>, String> {
    let mut list = parse_all(&config.network)?;
    match &config.endpoint {
        Some(url) => list.push(Endpoint::of_url(url)?),
        None => {
            let defaults: &[&str] = match config.backend {
                Backend::Claude => &["api.anthropic.com:443"],
                Backend::Codex => &["api.openai.com:443"],
                Backend::Aider => &["api.openai.com:443", "api.anthropic.com:443"],
                Backend::Command | Backend::Openai => &[],
            };
            for d in defaults {
                list.push(Endpoint::parse(d)?);
            }
        }
    }
    list.sort();
    list.dedup();
    Ok(list)
}

/// The containment of one agent run in `run`'s worktree. `private` is the run's own directory
/// (its `HOME`, prompt file, history files) and `extra` more of the run's own paths (a
/// configured home): writable.
pub fn for_agent(
    run: &StageRun,
    config: &AgentConfig,
    private: &Path,
    extra: &[PathBuf],
) -> Result<Contained, String> {
    let allow = config.env.clone();
    if !run.repo.sandbox.enabled {
        return Ok(Contained {
            sandbox: None,
            env: Vec::new(),
            allow,
            _home: None,
            note: off_note(&run.repo_name),
        });
    }
    let mut writable: Vec<&Path> = vec![&run.worktree, private];
    writable.extend(
        extra
            .iter()
            .filter(|h| !h.starts_with(private))
            .map(PathBuf::as_path),
    );
    let mut sb = base_sandbox(run, &writable)?;
    let endpoints = enforceable(agent_endpoints(config)?)?;
    sb.network = if endpoints.is_empty() {
        Network::None
    } else {
        Network::Allow(endpoints)
    };
    let mut env = sb.proxy_env();
    env.push(("TMPDIR".into(), "/tmp".into()));
    let note = format!("sandboxed (bubblewrap; {})", network_words(&sb.network));
    Ok(Contained {
        sandbox: Some(Arc::new(sb)),
        env,
        allow,
        _home: None,
        note,
    })
}

/// The containment of the repository's own code (tests, verification, a sandboxed staging
/// step) run in `dir` (a worktree or a checkout of the revision it is about).
pub fn for_repo_code(run: &StageRun, dir: &Path) -> Result<Contained, String> {
    let repo = &run.repo;
    let allow = repo.env.clone();
    if !repo.sandbox.enabled {
        return Ok(Contained {
            sandbox: None,
            env: Vec::new(),
            allow,
            _home: None,
            note: off_note(&run.repo_name),
        });
    }
    let home = private_home()?;
    let mut sb = base_sandbox(run, &[dir, home.path()])?;
    sb.network = repo_network(repo)?;
    let mut env = sb.proxy_env();
    env.push(("HOME".into(), home.path().display().to_string()));
    env.push(("TMPDIR".into(), "/tmp".into()));
    let note = format!("sandboxed (bubblewrap; {})", network_words(&sb.network));
    Ok(Contained {
        sandbox: Some(Arc::new(sb)),
        env,
        allow,
        _home: Some(home),
        note,
    })
}

fn repo_network(repo: &RepoConfig) -> Result<Network, String> {
    Ok(match &repo.sandbox.network {
        SandboxNetwork::None => Network::None,
        SandboxNetwork::Host => Network::Host,
        SandboxNetwork::Allow(list) => Network::Allow(enforceable(parse_all(list)?)?),
    })
}

/// The containment of a trusted command (deploy, rollback, alert, a staging step marked
/// `sandbox = false`): on the host, with the allowlisted environment.
pub fn for_trusted(repo: &RepoConfig) -> Contained {
    Contained {
        sandbox: None,
        env: Vec::new(),
        allow: repo.env.clone(),
        _home: None,
        note: "trusted: runs on the host".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `text` as the analyst's section (the other three LLM agents only to make a valid config).
    fn agent(text: &str) -> AgentConfig {
        let others: String = ["architect", "developer", "reviewer"]
            .iter()
            .map(|a| format!("[agents.{a}]\nbackend = \"claude\"\n"))
            .collect();
        let config = orch_domain::config::Config::from_toml_str(
            &format!("[agents.analyst]\n{text}\n{others}"),
            &|_: &str| None,
        )
        .unwrap();
        config.agents[&"analyst".parse().unwrap()].clone()
    }

    #[test]
    fn an_agent_reaches_its_endpoint_or_its_providers_and_what_it_lists() {
        let check = |text: &str, want: &[&str]| {
            let got: Vec<String> = agent_endpoints(&agent(text))
                .unwrap()
                .iter()
                .map(Endpoint::to_string)
                .collect();
            assert_eq!(got, want, "{text}");
        };
        check("backend = \"claude\"", &["api.anthropic.com:443"]);
        check(
            "backend = \"claude\"\nendpoint = \"http://127.0.0.1:4000\"",
            &["127.0.0.1:4000"],
        );
        check("backend = \"codex\"", &["api.openai.com:443"]);
        check("backend = \"command\"\ncommand = \"x\"", &[]);
        check(
            "backend = \"command\"\ncommand = \"x\"\nnetwork = [\"pypi.org:443\", \"pypi.org:443\"]",
            &["pypi.org:443"],
        );
    }
}
