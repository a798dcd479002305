//! Executor combinators: one job kind serving several stages (the `deployer` runs both
//! `staging` and `deploy`: the stage is the discriminator, seed ORCH-115 D1), and the
//! promotion of the staged commit before a deploy (the release train, [`crate::release`]; one
//! release at a time per repo is the release track's, held in the database).

use std::collections::HashMap;
use std::sync::Arc;

use super::{StageEffect, StageExecutor, StageRun};

/// Routes a job to the executor of its task's stage.
#[derive(Default)]
pub struct ByStage {
    map: HashMap<String, Arc<dyn StageExecutor>>,
}

impl ByStage {
    pub fn new() -> ByStage {
        ByStage::default()
    }

    pub fn with(mut self, stage: &str, executor: Arc<dyn StageExecutor>) -> ByStage {
        self.map.insert(stage.to_owned(), executor);
        self
    }
}

#[async_trait::async_trait]
impl StageExecutor for ByStage {
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect> {
        match self.map.get(run.stage.name.as_str()) {
            Some(e) => e.execute(run).await,
            None => Ok(StageEffect::Failed {
                reason: format!(
                    "agent {} has no executor for stage {}",
                    run.job.agent, run.stage.name
                ),
            }),
        }
    }
}

/// Wraps the deployer of stage `deploy`: first promotes the staged commit to the default
/// branch ([`crate::release::promote`]), then deploys exactly it. When the default branch moved
/// since the candidate was built, the task goes back to `merge` to rebuild and restage it.
pub struct Promote {
    pub inner: Arc<dyn StageExecutor>,
}

#[async_trait::async_trait]
impl StageExecutor for Promote {
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect> {
        let seq = crate::deploy::visit_seq(run);
        match crate::release::promote(run, seq).await? {
            crate::release::Promotion::Promoted { .. } => self.inner.execute(run).await,
            crate::release::Promotion::Moved { main, staged } => Ok(StageEffect::Produced {
                outcome: Some(orch_domain::gate::GateOutcome::pass(
                    orch_domain::pipeline::RESTAGE.to_owned(),
                    format!(
                        "`{}` moved to `{main}` outside orch since `{staged}` was staged: rebuilding the candidate and staging it again",
                        run.repo.default_branch
                    ),
                )),
            }),
        }
    }
}
