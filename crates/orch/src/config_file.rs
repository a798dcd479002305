//! `orch.toml` read from disk: parsed and validated with `ORCH_*` overrides, errors as
//! `file:line: what`. The context reads it at start; the reloader reads it again when it changes.

use std::path::Path;

use orch_domain::config::{Config, ConfigError};

/// Reads and validates `orch.toml` with `ORCH_*` overrides; `None` when the file is absent.
/// The error names the file, the line (when the key can be found) and the section and key.
pub fn load_config(path: &Path) -> std::result::Result<Option<Config>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    parse_config(path, &text).map(Some)
}

/// Parses config `text` read from `path`; the error is `file:line: what` (see [`load_config`]).
pub fn parse_config(path: &Path, text: &str) -> std::result::Result<Config, String> {
    let config = Config::from_toml_str(text, &|k: &str| crate::secrets::var(k))
        .map_err(|e| describe_config_error(path, text, &e))?;
    // The variables holding a forge's secrets reach no child, its supervisor included.
    orch_exec::env::treat_as_secret(
        config
            .repos
            .values()
            .filter_map(|r| r.forge.as_ref())
            .flat_map(|f| {
                std::iter::once(f.token_env.as_str()).chain(f.webhook_secret_env.as_deref())
            }),
    );
    Ok(config)
}

/// `file:line: error`, with the line found for errors that do not carry one (a value that
/// parses but cannot be used is looked up by its section and key).
pub fn describe_config_error(path: &Path, text: &str, e: &ConfigError) -> String {
    let file = path.display();
    match e {
        ConfigError::Parse {
            section,
            line: Some(l),
            message,
        } => {
            let section = section
                .as_ref()
                .map_or_else(|| "top level".to_owned(), |s| format!("[{s}]"));
            format!("invalid config {file}:{l}: {section}: {message}")
        }
        ConfigError::Invalid { section, key, .. } => match find_key(text, section, key) {
            Some(l) => format!("invalid config {file}:{l}: {e}"),
            None => format!("invalid config {file}: {e}"),
        },
        _ => format!("invalid config {file}: {e}"),
    }
}

/// The line of `key` inside `[section]` (or of the section header when the key is absent).
fn find_key(text: &str, section: &str, key: &str) -> Option<usize> {
    let mut in_section = false;
    let mut header = None;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.starts_with('[') {
            let name = line
                .trim_start_matches('[')
                .split(']')
                .next()
                .unwrap_or("")
                .trim();
            in_section = name == section;
            if in_section && header.is_none() {
                header = Some(i + 1);
            }
            continue;
        }
        if in_section
            && let Some((k, _)) = line.split_once('=')
            && k.trim().trim_matches('"') == key
        {
            return Some(i + 1);
        }
    }
    header
}
