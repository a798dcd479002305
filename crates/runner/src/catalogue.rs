//! The built-in executors by name: the one place that knows which code does which kind of
//! stage work. Each is registered under its name in [`orch_domain::pipeline::executors`]; a
//! stage's descriptor names the one that runs it ([`orch_domain::pipeline::StageDef::executor`])
//! and [`crate::engine::Engine::install`] gives it to the stage. No stage or agent is named
//! here: adding a stage is its descriptor in the domain's pipeline and, for new work, one
//! executor module registered below.

use std::sync::Arc;

use orch_domain::config::Config;
use orch_domain::pipeline::executors;

use crate::agents::AgentExecutor;
use crate::counters::Counters;
use crate::deploy::{DeployerExecutor, LessonsExecutor, MonitorExecutor, Promote};
use crate::engine::Executors;
use crate::live_config::{LiveConfig, Reloading};
use crate::stages::{IntakeExecutor, MergeGateExecutor, StagingExecutor, TesterExecutor};

/// Every built-in executor, with its in-process counters declared at zero.
pub fn builtin(counters: &Arc<Counters>, live: &LiveConfig) -> Executors {
    crate::deploy::declare_counters(counters);
    // One executor (one global agent concurrency limit) for every LLM stage's agent, rebuilt
    // from the config in use when it was reloaded (agents' commands, models, …).
    let agents = Arc::new(Reloading::new(live.clone(), |c: &Config| {
        AgentExecutor::new(c.agents.clone(), &c.settings)
    }));
    Executors::new()
        .with(executors::INTAKE, Arc::new(IntakeExecutor))
        .with(executors::AGENT, agents)
        .with(
            executors::TESTER,
            Arc::new(TesterExecutor::new(counters.clone())),
        )
        .with(
            executors::MERGE_GATE,
            Arc::new(MergeGateExecutor::new(counters.clone())),
        )
        .with(
            executors::STAGING,
            Arc::new(StagingExecutor::new(counters.clone())),
        )
        // The deploy ships exactly what staging verified: promoted first (the release train).
        .with(
            executors::DEPLOY,
            Arc::new(Promote {
                inner: Arc::new(DeployerExecutor::default()),
            }),
        )
        .with(executors::MONITOR, Arc::new(MonitorExecutor::default()))
        .with(executors::LESSONS, Arc::new(LessonsExecutor))
}
