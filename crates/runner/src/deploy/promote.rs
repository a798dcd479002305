//! The `deploy` stage's executor: the release train's promotion of the staged commit
//! ([`crate::release::promote`]), then the deployer of exactly that commit. When the default
//! branch moved since the candidate was built, the task goes back to `merge` to rebuild and
//! restage it (the outcome [`RESTAGE`]).

use std::sync::Arc;

use orch_domain::config::RepoConfig;
use orch_domain::control::markers;
use orch_domain::gate::GateOutcome;
use orch_domain::pipeline::RESTAGE;
use orch_store::Task;

use crate::engine::{StageEffect, StageExecutor, StageRun};
use crate::release::{self, Promotion};

/// Promotes, then runs `inner` (the deployer).
pub struct Promote {
    pub inner: Arc<dyn StageExecutor>,
}

#[async_trait::async_trait]
impl StageExecutor for Promote {
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect> {
        let seq = super::visit_seq(run);
        let promotion = match release::promote(run, seq).await {
            Ok(p) => p,
            // The release waited for the forge as long as one job may: the stage comes back
            // as a new job after the pause (its attempts untouched), the wait on record.
            Err(e) => match e.downcast_ref::<release::StepAside>() {
                Some(aside) => {
                    return Ok(StageEffect::Requeue {
                        delay_ms: aside.delay_s.saturating_mul(1000),
                        marker: markers::forge_wait(seq),
                        reason: format!("{aside}; the deploy comes back then"),
                    });
                }
                None => return Err(e),
            },
        };
        match promotion {
            Promotion::Promoted { .. } => self.inner.execute(run).await,
            Promotion::Moved { main, staged } => Ok(StageEffect::Produced {
                outcome: Some(GateOutcome::pass(
                    RESTAGE.to_owned(),
                    format!(
                        "`{}` moved to `{main}` outside orch since `{staged}` was staged: rebuilding the candidate and staging it again",
                        run.repo.default_branch
                    ),
                )),
            }),
        }
    }

    fn defers_worktree(&self) -> bool {
        self.inner.defers_worktree()
    }

    fn first_delay_s(&self, repo: &RepoConfig) -> u64 {
        self.inner.first_delay_s(repo)
    }

    fn task_failed(&self, repos_dir: &std::path::Path, task: &Task, reason: &str) {
        self.inner.task_failed(repos_dir, task, reason);
    }
}
