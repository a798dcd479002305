//! `orch doctor`: checks what orch needs on this machine and says plainly what is missing and
//! how to fix it. Exit 1 when anything required is missing.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use orch_domain::config::{Backend, Config};

use crate::context::Context;

struct Report {
    lines: Vec<(bool, String, String)>,
}

impl Report {
    fn check(&mut self, ok: bool, what: impl Into<String>, fix: impl Into<String>) {
        self.lines.push((ok, what.into(), fix.into()));
    }
}

fn on_path(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        let p = PathBuf::from(program);
        return p.is_file().then_some(p);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(program))
            .find(|p| p.is_file())
    })
}

pub async fn run(cx: &Context) -> Result<ExitCode> {
    let mut r = Report { lines: Vec::new() };
    r.check(
        on_path("git").is_some(),
        "git is installed",
        "install git (e.g. `apt-get install git`)",
    );
    r.check(
        on_path("sh").is_some(),
        "sh is installed",
        "repo commands run with `sh -c`",
    );
    match &cx.config {
        Some(_) => r.check(true, format!("config {}", cx.config_path.display()), ""),
        None => r.check(
            false,
            format!("config {}", cx.config_path.display()),
            "run `orch init`",
        ),
    }
    match cx.open_store().await {
        Ok(store) => {
            r.check(true, format!("database {}", store.target()), "");
            store.close().await;
        }
        Err(e) => r.check(
            false,
            format!("database: {e:#}"),
            "fix the URL, start the server, or run `orch init` / `orch migrate`",
        ),
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
        repos(&mut r, cx, config);
    }
    let mut failed = 0;
    for (ok, what, fix) in &r.lines {
        if *ok {
            println!("ok    {what}");
        } else {
            failed += 1;
            println!("FAIL  {what}");
            if !fix.is_empty() {
                println!("      fix: {fix}");
            }
        }
    }
    if failed == 0 {
        println!("\neverything orch needs is here");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("\n{failed} problem(s) found");
        Ok(ExitCode::from(1))
    }
}

async fn agents(r: &mut Report, config: &Config) {
    for (name, a) in &config.agents {
        let preset = match a.backend {
            Backend::Claude => Some("claude"),
            Backend::Codex => Some("codex"),
            Backend::Aider => Some("aider"),
            Backend::Command | Backend::Openai => None,
        };
        if a.backend == Backend::Openai {
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
        let program = a.command.clone().or(preset.map(str::to_owned));
        match program {
            Some(p) => r.check(
                on_path(&p).is_some(),
                format!("agent {name}: program `{p}`"),
                format!("install `{p}` or set [agents.{name}] command"),
            ),
            None => r.check(
                false,
                format!("agent {name}: no command"),
                format!("set [agents.{name}] command"),
            ),
        }
    }
}

fn repos(r: &mut Report, cx: &Context, config: &Config) {
    let repos_dir = cx.repos_dir(config);
    for (name, repo) in &config.repos {
        let clone = repos_dir.join(name.as_str());
        let source_ok = match (&repo.url, &repo.path) {
            (Some(_), _) => true,
            (None, Some(p)) => {
                let p = if Path::new(p).is_absolute() {
                    PathBuf::from(p)
                } else {
                    cx.root.join(p)
                };
                p.join(".git").exists()
            }
            (None, None) => false,
        };
        r.check(
            source_ok || clone.join(".git").exists(),
            format!("repo {name}: source"),
            format!("set [repos.{name}] path to a git checkout or url to a clone URL"),
        );
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
            r.check(
                on_path(program).is_some(),
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
    }
}
