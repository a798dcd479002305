//! `orch demo --agent claude`: the demo's LLM stages run by the real Claude Code (the
//! `claude` preset) against a scripted model server on 127.0.0.1. The demo's scripted agent
//! (`agent.rs`) still decides what each stage writes: the model server runs it on a scratch
//! copy of the worktree, and answers Claude Code with one `Write` tool call per file that
//! changed, which Claude Code executes in the real worktree. Nothing leaves this machine.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use orch_modelserver::{Action, Ask, ModelServer, Reply, Turn};

use super::agent::{Env, Scenario, produce};

/// The demo's model server and the Claude Code it drives.
pub(crate) struct ClaudeDemo {
    server: ModelServer,
    wrapper: PathBuf,
    pub(crate) program: PathBuf,
}

/// Where Claude Code is: `ORCH_DEMO_CLAUDE`, `claude` on `PATH`, or the cache that
/// `scripts/install-agent-clis` fills.
fn find_claude() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ORCH_DEMO_CLAUDE") {
        return Some(PathBuf::from(p));
    }
    if let Some(p) = super::which("claude") {
        return Some(p);
    }
    let cache = std::env::var_os("ORCH_AGENT_CLI_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/orch-agent-clis"))
        })?;
    let bin = cache.join("bin/claude");
    bin.exists().then_some(bin)
}

impl ClaudeDemo {
    /// Finds Claude Code, starts the model server, and writes the wrapper that gives Claude
    /// Code the server's (made-up) API key.
    pub(crate) async fn start(dir: &Path) -> Result<ClaudeDemo> {
        let program = find_claude().context(
            "`--agent claude` needs Claude Code: put `claude` on PATH, set ORCH_DEMO_CLAUDE, or \
             run scripts/install-agent-clis",
        )?;
        let server = ModelServer::start(demo_brain)
            .await
            .context("cannot start the demo's model server")?;
        // Beside the scripted agent's: a sandboxed run is shown the wrapper's directory.
        let bin = dir.join("agent");
        std::fs::create_dir_all(&bin)
            .with_context(|| format!("cannot create {}", bin.display()))?;
        let wrapper = bin.join("claude-agent.sh");
        let quoted = format!("'{}'", program.display().to_string().replace('\'', "'\\''"));
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\n# Claude Code with the demo model server's key (the server is local).\n\
                 export ANTHROPIC_API_KEY=orch-demo-local-key\nexec {quoted} \"$@\"\n"
            ),
        )
        .with_context(|| format!("cannot write {}", wrapper.display()))?;
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
        Ok(ClaudeDemo {
            server,
            wrapper,
            program,
        })
    }

    /// `toml` with its `[agents.*]` sections replaced by the `claude` preset at the server, and
    /// Claude Code's install directory shown to the sandbox (the wrapper runs it).
    pub(crate) fn configure(&self, toml: &str) -> String {
        let cut = toml.find("[agents.").unwrap_or(toml.len());
        let shown: Vec<String> = orch_exec::sandbox::install_dirs(&self.program)
            .iter()
            .map(|d| format!("{:?}", d.display().to_string()))
            .collect();
        let mut s = toml[..cut].replace(
            "[repos.service.sandbox]\n",
            &format!(
                "[repos.service.sandbox]\n# The wrapper runs Claude Code from here.\nread_only = [{}]\n",
                shown.join(", ")
            ),
        );
        for name in ["analyst", "architect", "developer", "reviewer"] {
            s.push_str(&format!(
                "[agents.{name}]\nbackend = \"claude\"\ncommand = {}\nendpoint = {}\n\
                 model = \"claude-sonnet-4-5\"\ncli_retries = 1\ntimeout_s = 120\n\n",
                super::toml_str(&self.wrapper.display().to_string()),
                super::toml_str(&self.server.url()),
            ));
        }
        s
    }
}

/// `orch demo-model-server`: the demo model alone, for a Claude Code configured by hand (the
/// README's walkthrough test). Prints the URL on stdout, then serves until SIGTERM, Ctrl-C or
/// the end of stdin.
pub(crate) async fn serve_model() -> Result<std::process::ExitCode> {
    use std::io::Write as _;
    let server = ModelServer::start(demo_brain)
        .await
        .context("cannot start the demo's model server")?;
    let mut out = std::io::stdout();
    writeln!(out, "{}", server.url()).context("cannot print the model server's URL")?;
    out.flush().context("cannot print the model server's URL")?;
    let (stop, _hard) = crate::signals::shutdown_tokens()?;
    // A plain thread (not a blocking task, which the runtime would wait for at exit).
    let (closed, stdin_closed) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        let _ = closed.send(());
    });
    tokio::select! {
        () = stop.cancelled() => {}
        _ = stdin_closed => {}
    }
    crate::output::say(&format!(
        "served {} model requests",
        server.requests().len()
    ));
    drop(server);
    Ok(std::process::ExitCode::SUCCESS)
}

/// The demo model: the scripted agent's work as `Write` calls (after `Read` calls for the
/// existing files it changes, as Claude Code requires); then done.
fn demo_brain(turn: &Turn) -> Reply {
    let wrote = turn.last_result.contains("File created successfully")
        || turn.last_result.contains("has been updated");
    if turn.index > 1 || wrote {
        return Reply::Text("Done: the files are written.".into());
    }
    let writes = match writes_for(&turn.prompt) {
        Ok(w) if w.is_empty() => return Reply::Text("Nothing to change.".into()),
        Ok(w) => w,
        Err(e) => return Reply::Text(format!("The scripted agent could not run: {e:#}")),
    };
    let existing: Vec<Action> = writes
        .iter()
        .filter_map(|a| match a {
            Action::Write { path, .. } if Path::new(path).exists() => {
                Some(Action::Read(path.clone()))
            }
            _ => None,
        })
        .collect();
    if turn.index == 0 && !existing.is_empty() {
        Reply::Tools(existing)
    } else {
        Reply::Tools(writes)
    }
}

/// Runs the scripted agent on a scratch copy of the worktree the prompt names and returns a
/// write of every file it changed, at its path in the real worktree.
fn writes_for(prompt: &str) -> Result<Vec<Action>> {
    let ask = Ask::of(prompt);
    let first = ask.files.first().context("the prompt asks for no file")?;
    let rel_dir = ask
        .work_item
        .parse::<orch_domain::ids::WorkItemId>()
        .context("the prompt names no valid work item")?
        .artifact_dir();
    let artifact_dir = Path::new(first)
        .parent()
        .context("an artifact path without a folder")?;
    let worktree = artifact_dir
        .to_str()
        .and_then(|d| d.strip_suffix(&rel_dir))
        .map(|d| PathBuf::from(d.trim_end_matches('/')))
        .context("the artifact is not in the worktree's docs/work-items")?;
    let scratch = tempfile::Builder::new()
        .prefix("orch-demo-model-")
        .tempdir()?;
    copy_tree(&worktree, scratch.path())?;
    let env = Env {
        work_item: ask.work_item.clone(),
        stage: ask.stage.clone(),
        worktree: scratch.path().to_path_buf(),
        artifact_dir: scratch.path().join(&rel_dir),
    };
    std::fs::create_dir_all(&env.artifact_dir)?;
    let request =
        std::fs::read_to_string(env.artifact_dir.join("01-request.md")).unwrap_or_default();
    produce(&env, &request, prompt, Scenario::of(&request))?;
    let mut writes = Vec::new();
    changed_files(scratch.path(), scratch.path(), &worktree, &mut writes)?;
    Ok(writes)
}

/// Copies `from` into `to`, without `.git`.
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    for entry in
        std::fs::read_dir(from).with_context(|| format!("cannot read {}", from.display()))?
    {
        let entry = entry?;
        if entry.file_name() == ".git" {
            continue;
        }
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        if entry.file_type()?.is_dir() {
            std::fs::create_dir_all(&dst)?;
            copy_tree(&src, &dst)?;
        } else if entry.file_type()?.is_file() {
            std::fs::copy(&src, &dst)?;
        }
    }
    Ok(())
}

/// Every file under `dir` (within the scratch `root`) whose content differs from the same
/// path under `real`, as a write to the real path.
fn changed_files(root: &Path, dir: &Path, real: &Path, out: &mut Vec<Action>) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            changed_files(root, &path, real, out)?;
            continue;
        }
        let rel = path.strip_prefix(root)?;
        let new = std::fs::read_to_string(&path)?;
        let target = real.join(rel);
        if std::fs::read_to_string(&target).ok().as_deref() != Some(new.as_str()) {
            out.push(Action::Write {
                path: target.display().to_string(),
                content: new,
            });
        }
    }
    Ok(())
}
