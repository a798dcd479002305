//! The store's events fed to the domain's one outcome rule ([`orch_domain::outcome::outcome_of`]),
//! for one task (API, dashboard) or for the tasks that ended in the views' recent window
//! (`/metrics`, the dashboard).

use std::collections::BTreeMap;

use orch_domain::outcome::{Outcome, TaskOutcome};
use orch_store::{Event, Store, StoreError, Task};

/// Events whose kinds decide an outcome (see `orch_domain::outcome`).
const OUTCOME_KINDS: &[&str] = orch_domain::outcome::FACT_KINDS;

/// The outcome of one task from its events (oldest first).
pub(crate) fn of(task: &Task, events: &[Event]) -> Option<TaskOutcome> {
    if !task.is_terminal() {
        return None;
    }
    orch_store::outcome_of_events(task.stage.as_str(), events)
}

/// The outcome of one task, reading its events; `None` while it is in flight.
pub(crate) async fn read(store: &Store, task: &Task) -> Result<Option<TaskOutcome>, StoreError> {
    if !task.is_terminal() {
        return Ok(None);
    }
    let events = store.task_events(task.id).await?;
    Ok(of(task, &events))
}

/// How many of the tasks that ended in the views' recent window
/// ([`orch_store::RECENT_WINDOW_MS`], "finished in the last 24 h") ended in each outcome: those
/// tasks (the partial index of ended tasks) and only their events that decide an outcome, so
/// the count costs the window, not the history.
pub(crate) async fn counts(store: &Store) -> Result<BTreeMap<Outcome, i64>, StoreError> {
    let since = crate::snapshot::recent_since(store);
    let ended: Vec<Task> = store.tasks_ended_since(since).await?;
    let ids: Vec<i64> = ended.iter().map(|t| t.id).collect();
    let mut by_task = orch_store::group_by_task(store.events_of_tasks(&ids, OUTCOME_KINDS).await?);
    let mut out = BTreeMap::new();
    for t in &ended {
        let events = by_task.remove(&t.id).unwrap_or_default();
        if let Some(o) = of(t, &events) {
            *out.entry(o.outcome).or_default() += 1;
        }
    }
    Ok(out)
}
