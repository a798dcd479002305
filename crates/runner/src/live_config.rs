//! The configuration a running process uses, swappable while it runs: the engine reads
//! [`LiveConfig::current`] once at the start of each job, so a reloaded `orch.toml` (repo
//! commands, agents, budgets) takes effect for the next job, never in the middle of one.
//!
//! Who reloads is outside this module (the binary polls the file); this is the swap point and
//! the record of what the process runs: the generation, and, when the file on disk could not be
//! used, why — the process then keeps its older config and says so ([`ConfigState::stale`]).
//! Settings that shape the process itself (the pipeline, bind address, database, worker count,
//! …) are not re-applied: a change to them is listed in [`ConfigState::restart_needed`].

use std::sync::{Arc, Mutex, PoisonError, RwLock};

use orch_domain::config::Config;

use crate::engine::{StageEffect, StageExecutor, StageRun};

/// What a process runs, for `/healthz` and `orch status`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConfigState {
    /// 0 for the config the process started with, +1 per reload.
    pub generation: u64,
    /// When the config in use was loaded (epoch ms; 0 when unknown).
    pub loaded_at_ms: i64,
    /// Why the file on disk is not the config in use (it is invalid), if so.
    pub stale: Option<String>,
    /// Changed keys that only a restart applies (`pipeline`, `settings.bind`, …).
    pub restart_needed: Vec<String>,
}

/// A shared, swappable `Arc<Config>`. Cheap to clone.
#[derive(Debug, Clone)]
pub struct LiveConfig {
    config: Arc<RwLock<Arc<Config>>>,
    /// The config the process started with: what `restart_needed` compares against.
    started: Arc<Config>,
    state: Arc<Mutex<ConfigState>>,
}

impl LiveConfig {
    /// A holder of `config`, generation 0.
    pub fn new(config: Arc<Config>, loaded_at_ms: i64) -> LiveConfig {
        LiveConfig {
            config: Arc::new(RwLock::new(config.clone())),
            started: config,
            state: Arc::new(Mutex::new(ConfigState {
                loaded_at_ms,
                ..ConfigState::default()
            })),
        }
    }

    /// The config in use now.
    pub fn current(&self) -> Arc<Config> {
        self.config
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// What the process runs.
    pub fn state(&self) -> ConfigState {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Uses `config` from the next job on; returns the changed keys that need a restart.
    pub fn replace(&self, config: Config, loaded_at_ms: i64) -> Vec<String> {
        let restart = restart_needed(&self.started, &config);
        *self.config.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(config);
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.generation += 1;
        st.loaded_at_ms = loaded_at_ms;
        st.stale = None;
        st.restart_needed = restart.clone();
        restart
    }

    /// Records that the file on disk cannot be used (`why`); the config in use is kept.
    pub fn mark_stale(&self, why: String) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .stale = Some(why);
    }
}

/// The keys whose change a running process cannot apply.
fn restart_needed(old: &Config, new: &Config) -> Vec<String> {
    let (a, b) = (&old.settings, &new.settings);
    let mut keys = Vec::new();
    let mut check = |changed: bool, key: &str| {
        if changed {
            keys.push(key.to_owned());
        }
    };
    check(a.repos_dir != b.repos_dir, "settings.repos_dir");
    check(a.database_url != b.database_url, "settings.database_url");
    check(a.bind != b.bind, "settings.bind");
    check(a.token != b.token, "settings.token");
    check(a.workers != b.workers, "settings.workers");
    check(a.lease_s != b.lease_s, "settings.lease_s");
    check(
        a.poll_interval_ms != b.poll_interval_ms,
        "settings.poll_interval_ms",
    );
    check(
        a.fetch_cooldown_ms != b.fetch_cooldown_ms,
        "settings.fetch_cooldown_ms",
    );
    check(a.node != b.node, "settings.node");
    check(a.node_grace_s != b.node_grace_s, "settings.node_grace_s");
    check(a.retention != b.retention, "settings.retention");
    check(old.pipeline != new.pipeline, "pipeline");
    keys
}

/// A stage executor built from the config, rebuilt when the config was reloaded (the agent
/// executor: commands, models, timeouts and budgets are the config's). A job keeps the
/// executor it started with.
pub struct Reloading<E> {
    live: LiveConfig,
    build: Box<dyn Fn(&Config) -> E + Send + Sync>,
    current: Mutex<(u64, Arc<E>)>,
}

impl<E> Reloading<E> {
    /// An executor built by `build` from the config in use now.
    pub fn new(live: LiveConfig, build: impl Fn(&Config) -> E + Send + Sync + 'static) -> Self {
        let first = Arc::new(build(&live.current()));
        let generation = live.state().generation;
        Reloading {
            live,
            build: Box::new(build),
            current: Mutex::new((generation, first)),
        }
    }

    /// The executor for the config in use now.
    pub fn get(&self) -> Arc<E> {
        let generation = self.live.state().generation;
        let mut cur = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if cur.0 != generation {
            *cur = (generation, Arc::new((self.build)(&self.live.current())));
        }
        cur.1.clone()
    }
}

#[async_trait::async_trait]
impl<E: StageExecutor + 'static> StageExecutor for Reloading<E> {
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect> {
        self.get().execute(run).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> Config {
        Config::from_toml_str(text, &|_: &str| None).unwrap()
    }

    const AGENTS: &str = "[agents.analyst]\nbackend = \"claude\"\n[agents.architect]\nbackend = \"claude\"\n\
                          [agents.developer]\nbackend = \"claude\"\n[agents.reviewer]\nbackend = \"claude\"\n";

    #[test]
    fn a_replaced_config_is_current_and_process_settings_need_a_restart() {
        let live = LiveConfig::new(Arc::new(config(AGENTS)), 1);
        let built = std::sync::atomic::AtomicU32::new(0);
        let built = Arc::new(built);
        let counter = built.clone();
        let r = Reloading::new(live.clone(), move |c: &Config| {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            c.settings.agent_timeout_s
        });
        assert_eq!(*r.get(), 1800);
        assert_eq!(*r.get(), 1800);
        live.mark_stale("orch.toml:3: bad".into());
        assert_eq!(live.state().stale.as_deref(), Some("orch.toml:3: bad"));
        let restart = live.replace(
            config(&format!(
                "[settings]\nagent_timeout_s = 60\nworkers = 9\n{AGENTS}"
            )),
            2,
        );
        assert_eq!(restart, vec!["settings.workers".to_owned()]);
        let st = live.state();
        assert_eq!((st.generation, st.loaded_at_ms, st.stale), (1, 2, None));
        assert_eq!(live.current().settings.agent_timeout_s, 60);
        assert_eq!(*r.get(), 60, "rebuilt from the new config");
        assert_eq!(built.load(std::sync::atomic::Ordering::SeqCst), 2);
    }
}
