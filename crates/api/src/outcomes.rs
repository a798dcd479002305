//! The store's events fed to the domain's one outcome rule ([`orch_domain::outcome::outcome_of`]),
//! for one task (API, dashboard) or for every finished task (`/metrics`, the queue page).

use std::collections::{BTreeMap, HashMap};

use orch_domain::control::TERMINAL_STAGES;
use orch_domain::outcome::{Outcome, TaskOutcome};
use orch_store::{Event, Store, StoreError, Task, TaskFilter};

/// Events whose kinds decide an outcome (see `orch_domain::outcome`).
const OUTCOME_KINDS: &[&str] = orch_domain::outcome::FACT_KINDS;

/// Rows read per store call when counting every finished task.
const PAGE: u32 = 1000;

/// The outcome of one task from its events (oldest first).
pub(crate) fn of(task: &Task, events: &[Event]) -> Option<TaskOutcome> {
    if !task.is_terminal() {
        return None;
    }
    orch_store::outcome_of_events(&task.stage, events)
}

/// The outcome of one task, reading its events; `None` while it is in flight.
pub(crate) async fn read(store: &Store, task: &Task) -> Result<Option<TaskOutcome>, StoreError> {
    if !task.is_terminal() {
        return Ok(None);
    }
    let events = store.task_events(task.id).await?;
    Ok(of(task, &events))
}

/// How many finished tasks ended in each outcome, over the whole store: the finished tasks by
/// terminal stage, and only the events that decide an outcome.
pub(crate) async fn counts(store: &Store) -> Result<BTreeMap<Outcome, i64>, StoreError> {
    let mut stage_of: HashMap<i64, &'static str> = HashMap::new();
    for stage in TERMINAL_STAGES {
        let mut offset = 0;
        loop {
            let page = store
                .list_tasks(&TaskFilter {
                    stage: Some(stage.to_owned()),
                    repo: None,
                    limit: PAGE,
                    offset,
                })
                .await?;
            for t in &page {
                stage_of.insert(t.id, stage);
            }
            if page.len() < PAGE as usize {
                break;
            }
            offset += PAGE;
        }
    }
    let mut by_task: HashMap<i64, Vec<Event>> = HashMap::new();
    for kind in OUTCOME_KINDS {
        let mut after = 0;
        loop {
            let page = store.events_by_kind(kind, after, PAGE).await?;
            let full = page.len() == PAGE as usize;
            for e in page {
                after = after.max(e.id);
                if let Some(t) = e.task_id.filter(|t| stage_of.contains_key(t)) {
                    by_task.entry(t).or_default().push(e);
                }
            }
            if !full {
                break;
            }
        }
    }
    let mut out = BTreeMap::new();
    for (task_id, stage) in stage_of {
        let mut events = by_task.remove(&task_id).unwrap_or_default();
        events.sort_by_key(|e| e.id);
        if let Some(o) = orch_store::outcome_of_events(stage, &events) {
            *out.entry(o.outcome).or_default() += 1;
        }
    }
    Ok(out)
}
