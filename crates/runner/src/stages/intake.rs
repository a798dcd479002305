//! Stage `intake`: writes `01-request.md` from the submitted title and body, so the request is
//! the first artifact on the work item's branch.

use orch_domain::artifact::{Artifact, Frontmatter, MODEL_NOT_APPLICABLE, Value};

use crate::engine::{StageEffect, StageExecutor, StageRun};
use crate::time::rfc3339;

pub struct IntakeExecutor;

#[async_trait::async_trait]
impl StageExecutor for IntakeExecutor {
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect> {
        let mut fm = Frontmatter::new();
        fm.insert("work_item", Value::from(run.work_item.as_str()));
        fm.insert("stage", Value::from("intake"));
        fm.insert("author_agent", Value::from("orch"));
        fm.insert("status", Value::from("final"));
        fm.insert("created_at", Value::from(rfc3339(run.task.created_at)));
        fm.insert("model_used", Value::from(MODEL_NOT_APPLICABLE));
        fm.insert("title", Value::from(run.task.title.as_str()));
        fm.insert("repo", Value::from(run.repo_name.as_str()));
        let body = format!("# {}\n\n{}\n", run.task.title, run.task.body.trim_end());
        let text = Artifact::new(fm, body).render();
        run.write_document("01-request.md", &text)?;
        Ok(StageEffect::Produced { outcome: None })
    }
}
