//! Resolves where things are (project root, config, database) and opens the store with errors
//! that tell the user what to do.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result};
use orch_domain::config::Config;
use orch_runner::worker::{WorkerConfig, default_worker_id};
use orch_store::{ConnectOptions, Store};

use crate::cli::{Global, WorkerArgs};
use crate::exit::{Kind, fail};
use crate::places::Places;

/// What `orch serve` and `orch worker` start from, resolved from the context in one pass
/// ([`Context::startup`]) and handed down: nothing the start-up builds asks the context again.
pub struct Startup {
    /// The config and where its files are, when there is a config.
    pub project: Option<Project>,
    /// The worker's settings: the flags over `[settings]`.
    pub worker: WorkerConfig,
    /// The open store, its schema checked.
    pub store: Store,
}

/// A valid `orch.toml` and the places it resolves to.
pub struct Project {
    pub config: Config,
    pub places: Places,
}

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
        let (config, config_error) = match crate::config_file::load_config(&config_path) {
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

    /// Resolves what a process running workers starts from (see [`Startup`]); `need_config`:
    /// fail (exit 78) without a valid config, as `orch serve` does.
    pub async fn startup(&self, args: &WorkerArgs, need_config: bool) -> Result<Startup> {
        if need_config {
            self.require_config()?;
        }
        let project = self.config.as_ref().map(|config| Project {
            config: config.clone(),
            places: self.places(config),
        });
        let worker = worker_config(args, project.as_ref().map(|p| &p.config))?;
        let opts = ConnectOptions {
            max_connections: u32::try_from(worker.concurrency + 6).unwrap_or(16),
            ..ConnectOptions::default()
        };
        let store = self.open_store_with(opts, true).await?;
        Ok(Startup {
            project,
            worker,
            store,
        })
    }

    /// Where a process running `config` keeps its files, resolved once
    /// ([`crate::places::Places`]).
    pub fn places(&self, config: &Config) -> Places {
        let p = Path::new(&config.settings.repos_dir);
        Places {
            root: self.root.clone(),
            config_path: self.config_path.clone(),
            state_dir: self.state_dir(),
            repos_dir: if p.is_absolute() {
                p.to_path_buf()
            } else {
                self.root.join(p)
            },
            database_dir: self
                .sqlite_file()
                .and_then(|f| Path::new(f).parent())
                .map(Path::to_path_buf),
        }
    }

    /// `settings.repos_dir`, resolved against the project root.
    pub fn repos_dir(&self, config: &Config) -> PathBuf {
        self.places(config).repos_dir
    }

    pub fn state_dir(&self) -> PathBuf {
        self.root.join(".orch")
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

/// The worker's settings: `orch worker`/`orch serve` flags over `[settings]` (the defaults
/// without a config). The node is `--node`, else `settings.node`, else the host name.
fn worker_config(args: &WorkerArgs, config: Option<&Config>) -> Result<WorkerConfig> {
    let settings = config.map(|c| c.settings.clone()).unwrap_or_default();
    let mut w = WorkerConfig::new(args.worker_id.clone().unwrap_or_else(default_worker_id));
    w.concurrency = args.concurrency.unwrap_or(settings.workers as usize).max(1);
    w.claim_batch = args.claim_batch.max(1);
    w.lease = Duration::from_secs(settings.lease_s.max(1));
    if let Some(ms) = args.lease_ms {
        anyhow::ensure!(ms >= 200, "--lease-ms must be at least 200 (got {ms})");
        // The config's own `lease_s` was checked against `node_grace_s` when it was read
        // (`Config::validate`); only this flag can pass it.
        anyhow::ensure!(
            settings.node_grace_s.saturating_mul(1000) >= ms,
            "--lease-ms ({ms}) must be at most [settings] node_grace_s ({} s): a node is judged gone only after its leases could have expired",
            settings.node_grace_s
        );
        w.lease = Duration::from_millis(ms);
    }
    w.poll_interval = Duration::from_millis(settings.poll_interval_ms.clamp(10, 60_000));
    w.fetch_cooldown = Duration::from_millis(settings.fetch_cooldown_ms);
    w.shutdown_grace = Duration::from_secs(args.grace_s);
    w.node = Some(args.node.clone().unwrap_or_else(|| {
        config.map_or_else(|| "localhost".to_owned(), crate::places::node_name)
    }));
    w.node_grace = Some(Duration::from_secs(settings.node_grace_s));
    Ok(w)
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
