//! Executor combinators: one job kind serving several stages (the `deployer` runs both
//! `staging` and `deploy`: the stage is the discriminator, seed ORCH-115 D1), and one deploy at
//! a time per repo (a deploy waits while another work item's post-deploy watch on the same
//! repo is running, so each watch observes only its own change).

use std::collections::HashMap;
use std::sync::Arc;

use orch_deploystate::ArmedRead;
use orch_store::JobCount;

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

/// How often a waiting deploy looks again, and how many times it waits before giving up.
const WAIT_S: u64 = 2;
const MAX_WAITS: i64 = 900;

/// Wraps the deployer: waits while another work item's watch on the same repo is armed.
pub struct OneDeployAtATime {
    pub inner: Arc<dyn StageExecutor>,
}

fn wait_marker(seq: i64) -> String {
    format!("[orch:deploy-wait seq={seq}]")
}

#[async_trait::async_trait]
impl StageExecutor for OneDeployAtATime {
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect> {
        let repos_dir = run.repos_dir.clone();
        let active = tokio::task::spawn_blocking(move || orch_deploystate::list_active(&repos_dir))
            .await
            .unwrap_or_default();
        let other = active.into_iter().find(|w| {
            w.repo == run.repo_name.as_str()
                && w.work_item_id != run.work_item.as_str()
                && matches!(w.armed, ArmedRead::Present(_))
        });
        let Some(other) = other else {
            return self.inner.execute(run).await;
        };
        let waited = run
            .store
            .count_jobs(&JobCount {
                task_id: run.task.id,
                agent: run.job.agent.clone(),
                content_contains: Some(wait_marker(run.task.stage_seq)),
            })
            .await?;
        if waited >= MAX_WAITS {
            return Ok(StageEffect::Failed {
                reason: format!(
                    "gave up waiting for {}'s post-deploy watch on repo {} to end",
                    other.work_item_id, run.repo_name
                ),
            });
        }
        Ok(StageEffect::Requeue {
            delay_s: WAIT_S,
            marker: wait_marker(run.task.stage_seq),
            reason: format!(
                "waiting: {}'s post-deploy watch on repo {} is still running (one deploy at a time)",
                other.work_item_id, run.repo_name
            ),
        })
    }
}
