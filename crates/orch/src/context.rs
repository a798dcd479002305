//! Resolves where things are (project root, config, database) and opens the store with errors
//! that tell the user what to do.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use orch_domain::config::{Config, ConfigError};
use orch_store::{ConnectOptions, Store};

use crate::cli::Global;
use crate::exit::{Kind, fail};

/// What every command needs to find the project.
#[derive(Debug, Clone)]
pub struct Context {
    /// The directory holding `orch.toml` and `.orch/`.
    pub root: PathBuf,
    pub config_path: PathBuf,
    pub database_url: String,
    /// `orch.toml`, when it exists and is valid.
    pub config: Option<Config>,
    /// Why `orch.toml` cannot be used (`file:line: [section] key: reason`), when it exists but
    /// is invalid. Commands that need the config or the database fail with it (exit 78).
    pub config_error: Option<String>,
    pub json: bool,
}

impl Context {
    pub fn new(global: &Global) -> Result<Context> {
        let config_path = absolute(&global.config)?;
        let root = config_path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let (config, config_error) = match load_config(&config_path) {
            Ok(c) => (c, None),
            Err(e) => (None, Some(e)),
        };
        let from_config = config
            .as_ref()
            .and_then(|c| c.settings.database_url.clone());
        let database_url = match (&global.database_url, from_config) {
            (Some(url), _) if !url.trim().is_empty() => url.trim().to_owned(),
            (_, Some(url)) if !url.trim().is_empty() => url.trim().to_owned(),
            _ => format!("sqlite://{}", root.join(".orch").join("orch.db").display()),
        };
        Ok(Context {
            root,
            config_path,
            database_url,
            config,
            config_error,
            json: global.json,
        })
    }

    /// The configuration, or an error (exit 78) telling what is wrong or how to create it.
    pub fn require_config(&self) -> Result<&Config> {
        if let Some(e) = &self.config_error {
            return Err(fail(Kind::Config, e.clone()));
        }
        self.config.as_ref().ok_or_else(|| {
            fail(
                Kind::Config,
                format!(
                    "no config at {}; run `orch init` there (or pass --config)",
                    self.config_path.display()
                ),
            )
        })
    }

    /// `settings.repos_dir`, resolved against the project root.
    pub fn repos_dir(&self, config: &Config) -> PathBuf {
        let p = Path::new(&config.settings.repos_dir);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.root.join(p)
        }
    }

    pub fn state_dir(&self) -> PathBuf {
        self.root.join(".orch")
    }

    /// orch's own files and directories no sandboxed run may see: the configuration file,
    /// the state directory, the SQLite database's directory, the repos directory and every
    /// repo's local checkout or bare repository. Handed to the runner at start-up and after a
    /// reload (`orch_runner::contain::protect`).
    pub fn protected_paths(&self, config: &Config) -> Vec<PathBuf> {
        let mut paths = vec![
            self.config_path.clone(),
            self.state_dir(),
            self.repos_dir(config),
        ];
        if let Some(dir) = self.sqlite_file().and_then(|f| Path::new(f).parent()) {
            paths.push(dir.to_path_buf());
        }
        for repo in config.repos.values() {
            if let Some(p) = &repo.path {
                let p = Path::new(p);
                paths.push(if p.is_absolute() {
                    p.to_path_buf()
                } else {
                    self.root.join(p)
                });
            }
        }
        paths
    }

    /// The SQLite database file, when the database is SQLite (as the store reads the URL).
    pub fn sqlite_file(&self) -> Option<&str> {
        orch_store::sqlite_file(&self.database_url)
    }

    /// Opens the store without creating anything; checks the schema version.
    pub async fn open_store(&self) -> Result<Store> {
        self.open_store_with(ConnectOptions::default(), true).await
    }

    pub async fn open_store_with(&self, opts: ConnectOptions, check_schema: bool) -> Result<Store> {
        // The database URL may come from the broken config: do not guess another one.
        if let Some(e) = &self.config_error {
            return Err(fail(Kind::Config, e.clone()));
        }
        if let Some(path) = self.sqlite_file()
            && !opts.create_if_missing
            && !Path::new(path).exists()
        {
            return Err(fail(
                Kind::Unavailable,
                format!(
                    "no orch database at {path}; run `orch init` in {} first (or pass --database-url)",
                    self.root.display()
                ),
            ));
        }
        let store = Store::connect(&self.database_url, opts).await?;
        if check_schema {
            store.check_schema().await?;
        }
        Ok(store)
    }
}

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

fn absolute(p: &Path) -> Result<PathBuf> {
    if p.is_absolute() {
        return Ok(p.to_path_buf());
    }
    let cwd = std::env::current_dir().context("cannot read the current directory")?;
    Ok(cwd.join(p))
}

/// Who runs this CLI, for the events of the operator calls it makes (`submit`, `approve`,
/// `retry`, `cancel`): the real user id and its name from the system's user database.
pub fn cli_actor() -> orch_domain::control::actor::Actor {
    // SAFETY: getuid cannot fail and touches no memory.
    let uid = unsafe { libc::getuid() };
    orch_domain::control::actor::Actor::Cli {
        user: user_name(uid),
        uid,
    }
}

/// The login name of `uid` (`getpwuid_r`), when the user database has one.
fn user_name(uid: libc::uid_t) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: an all-zero `passwd` is a valid value to be filled in.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is to memory we own, `buf` is as long as we say; on success
    // `found` points at `pwd`, whose strings point into `buf`.
    let rc = unsafe {
        libc::getpwuid_r(
            uid,
            &mut pwd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut found,
        )
    };
    if rc != 0 || found.is_null() || pwd.pw_name.is_null() {
        return None;
    }
    // SAFETY: `pw_name` is a NUL-terminated string inside `buf`, alive here.
    let name = unsafe { std::ffi::CStr::from_ptr(pwd.pw_name) };
    Some(name.to_string_lossy().into_owned())
}
