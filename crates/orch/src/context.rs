//! Resolves where things are (project root, config, database) and opens the store with errors
//! that tell the user what to do.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use orch_domain::config::Config;
use orch_store::{ConnectOptions, Store};

use crate::cli::Global;

/// What every command needs to find the project.
#[derive(Debug, Clone)]
pub struct Context {
    /// The directory holding `orch.toml` and `.orch/`.
    pub root: PathBuf,
    pub config_path: PathBuf,
    pub database_url: String,
    /// `orch.toml`, when it exists.
    pub config: Option<Config>,
    pub json: bool,
}

impl Context {
    pub fn new(global: &Global) -> Result<Context> {
        let config_path = absolute(&global.config)?;
        let root = config_path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let config = load_config(&config_path)?;
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
            json: global.json,
        })
    }

    /// The configuration, or an error telling how to create it.
    pub fn require_config(&self) -> Result<&Config> {
        self.config.as_ref().with_context(|| {
            format!(
                "no config at {}; run `orch init` there (or pass --config)",
                self.config_path.display()
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

    /// True for the embedded default database.
    pub fn is_sqlite(&self) -> bool {
        let u = &self.database_url;
        u.starts_with("sqlite:") || !u.contains("://")
    }

    /// Opens the store without creating anything; checks the schema version.
    pub async fn open_store(&self) -> Result<Store> {
        self.open_store_with(ConnectOptions::default(), true).await
    }

    pub async fn open_store_with(&self, opts: ConnectOptions, check_schema: bool) -> Result<Store> {
        if self.is_sqlite() && !opts.create_if_missing {
            let path = sqlite_path(&self.database_url);
            if !Path::new(&path).exists() {
                anyhow::bail!(
                    "no orch database at {path}; run `orch init` in {} first (or pass --database-url)",
                    self.root.display()
                );
            }
        }
        let store = Store::connect(&self.database_url, opts).await?;
        if check_schema {
            store.check_schema().await?;
        }
        Ok(store)
    }
}

/// Reads and validates `orch.toml` with `ORCH_*` overrides; `None` when the file is absent.
fn load_config(path: &Path) -> Result<Option<Config>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let config = Config::from_toml_str(&text, &|k: &str| std::env::var(k).ok())
        .with_context(|| format!("invalid config {}", path.display()))?;
    Ok(Some(config))
}

fn sqlite_path(url: &str) -> String {
    url.strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url)
        .to_owned()
}

fn absolute(p: &Path) -> Result<PathBuf> {
    if p.is_absolute() {
        return Ok(p.to_path_buf());
    }
    let cwd = std::env::current_dir().context("cannot read the current directory")?;
    Ok(cwd.join(p))
}
