//! Wiring: the engine with every stage executor, the worker registry, the operator
//! operations, and the HTTP API's view of them. Which executor runs which stage is each
//! stage's descriptor's word (`StageDef::executor`); the built-in executors are
//! `orch_runner::catalogue`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use orch_domain::config::Config;
use orch_runner::builtin;
use orch_runner::counters::Counters;
use orch_runner::engine::{Engine, EngineConfig};
use orch_runner::live_config::LiveConfig;
use orch_runner::ops::Ops;
use orch_runner::worker::Registry;
use orch_store::Store;

use crate::places::{Places, node_name};

/// Everything a process that runs the pipeline holds.
pub struct Runtime {
    pub engine: Arc<Engine>,
    pub ops: Ops,
    pub counters: Arc<Counters>,
    pub config: Arc<Config>,
    /// The config in use, swapped by a reload (`crate::reload`).
    pub live: LiveConfig,
    /// Where this process keeps its files.
    pub places: Places,
}

impl Runtime {
    /// The runtime of a command that runs no workers (`orch submit`, the demo), on this
    /// machine's node.
    pub fn new(places: &Places, config: &Config, store: &Store) -> Result<Runtime> {
        Runtime::new_on_node(places, config, store, &node_name(config))
    }

    /// [`Runtime::new`] for the node `node`: the node the engine pins deploy and watch jobs
    /// to must be the one the worker claims as (`WorkerConfig::node`).
    pub fn new_on_node(
        places: &Places,
        config: &Config,
        store: &Store,
        node: &str,
    ) -> Result<Runtime> {
        let pipeline = config.pipeline().context("invalid pipeline in orch.toml")?;
        orch_runner::contain::protect(places.protected(config));
        let counters = Arc::new(Counters::new());
        let config = Arc::new(config.clone());
        let live = LiveConfig::new(config.clone(), store.now_ms());
        let mut engine = Engine::new(
            store.clone(),
            EngineConfig {
                config: config.clone(),
                live: live.clone(),
                pipeline: Arc::new(pipeline),
                root: places.root.clone(),
                repos_dir: places.repos_dir.clone(),
                node: node.to_owned(),
            },
            counters.clone(),
        );
        // Each stage gets the executor its descriptor names, from the built-in ones.
        let executors = orch_runner::catalogue::builtin(&counters, &live);
        engine
            .install(&executors)
            .context("cannot wire the pipeline's stages")?;
        let engine = Arc::new(engine);
        let ops = Ops::new(store.clone(), engine.clone());
        Ok(Runtime {
            engine,
            ops,
            counters,
            config,
            live,
            places: places.clone(),
        })
    }

    /// Maintenance passes of a process that runs the pipeline: the queue's own, plus the
    /// post-deploy watch recovery sweep for this node's state files.
    pub fn passes(
        &self,
        lease: Duration,
        retention: Option<Duration>,
    ) -> Vec<Arc<dyn orch_runner::maintenance::Pass>> {
        let mut passes = orch_runner::maintenance::default_passes(lease, retention);
        passes.push(Arc::new(orch_runner::maintenance::WatchRecoveryPass {
            every: Duration::from_secs(30),
            repos_dir: self.places.repos_dir.clone(),
            node: self.engine.config().node.clone(),
        }));
        // The forges' labeled issues (issue 31): a no-op for repos without `[repos.<name>.forge]`,
        // read from the live config, so a reload can add or remove one.
        passes.push(Arc::new(orch_runner::forge::ForgePass::new(
            self.live.clone(),
            self.engine.config().pipeline.clone(),
            self.counters.clone(),
        )));
        // Their items' pull requests, statuses, reviews and outcomes (issue 31, second part).
        passes.push(Arc::new(orch_runner::forge_sync::ForgeSyncPass::new(
            self.live.clone(),
        )));
        passes.push(Arc::new(orch_runner::maintenance::SupervisedPass {
            every: lease.max(Duration::from_secs(1)),
            children_dir: self.places.children_dir(),
        }));
        passes
    }

    /// The job kinds this process runs: the built-in ones and every stage's.
    pub fn registry(&self) -> Registry {
        let mut r = Registry::new();
        builtin::register(&mut r);
        let timeout = Duration::from_secs(self.config.settings.agent_timeout_s.max(60) + 300);
        self.engine.register(&mut r, timeout);
        // The forge sync's jobs (task-less; they need the operations for an approving review).
        r.register(
            orch_runner::forge_sync::FORGE_SYNC,
            Duration::from_secs(120),
            Arc::new(orch_runner::forge_sync::ForgeSyncHandler::new(
                self.ops.clone(),
                self.engine.clone(),
            )),
        );
        r
    }
}
