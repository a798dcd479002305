//! `orch init`: the config file, the state directory with the API token, and the embedded
//! database, migrated. Safe to re-run: existing files are kept unless `--force`.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context as _, Result};
use orch_store::ConnectOptions;

use crate::cli::InitArgs;
use crate::context::Context;

pub async fn run(cx: &Context, args: InitArgs) -> Result<ExitCode> {
    let state = cx.state_dir();
    std::fs::create_dir_all(&state)
        .with_context(|| format!("cannot create {}", state.display()))?;
    let config_written = if cx.config_path.exists() && !args.force {
        false
    } else {
        let text = orch_domain::config::Config::default_toml(&new_token()?);
        if args.force {
            let _ = std::fs::remove_file(&cx.config_path);
        }
        // The file holds the API token: readable by its owner only.
        write_private(&cx.config_path, &text)?;
        true
    };
    let gitignore = state.join(".gitignore");
    if !gitignore.exists() {
        orch_runner::fsutil::write_atomic(&gitignore, "*\n")?;
    }
    // Inside a git repository the config (it holds the API token) must not be committed.
    let ignored = match inside_git_repo(&cx.root) {
        Some(_) => Some(protect_from_git(&cx.root, &cx.config_path)?),
        None => None,
    };
    let opts = ConnectOptions {
        create_if_missing: true,
        ..ConnectOptions::default()
    };
    let store = cx.open_store_with(opts, false).await?;
    let report = store.migrate().await?;
    store.close().await;
    if cx.json {
        let doc = orch_api::dto::Initialized {
            config: cx.config_path.display().to_string(),
            config_written,
            database: cx.database_url.clone(),
            schema_version: report.to,
            gitignore: ignored.as_ref().map(|p| p.display().to_string()),
        };
        crate::output::print_json(&orch_api::dto::to_json(&doc));
    } else {
        let verb = if config_written {
            "wrote"
        } else {
            "kept existing"
        };
        crate::output::outln(&format!("{verb} {}", cx.config_path.display()));
        crate::output::outln(&format!(
            "database {} (schema version {})",
            redacted(&cx.database_url),
            report.to
        ));
        if config_written {
            crate::output::outln(
                "  it holds a fresh API token (mode 0600): keep it out of git, or set ORCH_TOKEN instead",
            );
        }
        if let Some(p) = &ignored {
            crate::output::outln(&format!(
                "  this directory is inside a git repository: {} lists the config and .orch/ so the token is never committed",
                p.display()
            ));
        }
        crate::output::outln(
            "next: declare your repository in orch.toml ([repos.<name>] path = \"../your-checkout\", prefix, test), then `orch doctor`, `orch serve` and `orch submit`",
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn redacted(url: &str) -> String {
    orch_store::redact_url(url)
}

/// 32 random bytes as hex, from the OS.
fn new_token() -> Result<String> {
    use std::io::Read as _;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("cannot read random bytes for the API token from /dev/urandom")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes a file readable only by its owner (it holds a secret).
fn write_private(path: &Path, content: &str) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(content.as_bytes())
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write {}", path.display()))
}

/// The top of the git repository `dir` is in (a `.git` directory or file in it or above).
fn inside_git_repo(dir: &Path) -> Option<std::path::PathBuf> {
    dir.ancestors()
        .find(|d| d.join(".git").exists())
        .map(Path::to_path_buf)
}

/// Makes `<root>/.gitignore` list the config file and `.orch/` (anchored to that directory),
/// adding only the lines that are missing. Returns the `.gitignore`'s path.
fn protect_from_git(root: &Path, config: &Path) -> Result<std::path::PathBuf> {
    let path = root.join(".gitignore");
    let existing = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let name = config
        .strip_prefix(root)
        .unwrap_or(config)
        .display()
        .to_string();
    let wanted = [format!("/{name}"), "/.orch/".to_owned()];
    let have: Vec<&str> = existing.lines().map(str::trim).collect();
    let missing: Vec<&String> = wanted
        .iter()
        .filter(|w| {
            let bare = w.trim_start_matches('/');
            !have.iter().any(|h| {
                *h == w.as_str()
                    || *h == bare
                    || h.trim_end_matches('/') == bare.trim_end_matches('/')
            })
        })
        .collect();
    if missing.is_empty() {
        return Ok(path);
    }
    let mut text = existing.clone();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str("# orch: the config holds the API token; .orch/ holds the database and clones\n");
    for m in missing {
        text.push_str(m);
        text.push('\n');
    }
    orch_runner::fsutil::write_atomic(&path, &text)?;
    Ok(path)
}
