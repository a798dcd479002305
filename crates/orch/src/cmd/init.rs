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
    let opts = ConnectOptions {
        create_if_missing: true,
        ..ConnectOptions::default()
    };
    let store = cx.open_store_with(opts, false).await?;
    let report = store.migrate().await?;
    store.close().await;
    if cx.json {
        crate::output::print_json(&serde_json::json!({
            "config": cx.config_path.display().to_string(),
            "config_written": config_written,
            "database": cx.database_url,
            "schema_version": report.to,
        }));
    } else {
        let verb = if config_written {
            "wrote"
        } else {
            "kept existing"
        };
        println!("{verb} {}", cx.config_path.display());
        println!(
            "database {} (schema version {})",
            redacted(&cx.database_url),
            report.to
        );
        if config_written {
            println!(
                "  it holds a fresh API token (mode 0600): keep it out of git, or set ORCH_TOKEN instead"
            );
        }
        println!("next: declare a repo in orch.toml, then `orch serve` and `orch submit`");
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
