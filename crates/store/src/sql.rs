//! SQL text that is the same on both backends (both accept `$N` parameters). Statements that
//! differ are a driver's constants (`driver.rs`) or live in the driver's module.

use std::sync::LazyLock;

pub const JOB_COLUMNS: &str = "id, task_id, agent, task_content, state, priority, attempt, \
     max_attempts, available_at, lease_expires_at, locked_by, dedupe_key, node, last_error, \
     created_at, started_at, finished_at";

pub const TASK_COLUMNS: &str =
    "id, work_item_id, repo, title, body, stage, stage_seq, branch, created_at, updated_at";

pub const EVENT_COLUMNS: &str = "id, task_id, job_id, kind, stage, message, data, created_at";

pub const AGENT_RUN_COLUMNS: &str = "id, task_id, job_id, stage, agent, backend, model, attempt, \
     started_at, finished_at, outcome, exit_code, input_tokens, output_tokens, cost_usd, error, data";

/// `$1 task_id, $2 agent, $3 task_content, $4 priority, $5 max_attempts, $6 available_at,
/// $7 dedupe_key, $8 node, $9 created_at` → `id` (no row when the dedupe key exists).
pub const INSERT_JOB: &str = "INSERT INTO jobs (task_id, agent, task_content, state, priority, \
     attempt, max_attempts, available_at, dedupe_key, node, created_at) \
     VALUES ($1, $2, $3, 'queued', $4, 0, $5, $6, $7, $8, $9) \
     ON CONFLICT (dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING \
     RETURNING id";

/// The job kind of a node's beacon: one `done` row per node, task-less, whose `finished_at` is
/// when a worker on the node was last seen and `created_at` when first seen. Its dedupe key is
/// [`NODE_BEACON_PREFIX`] + the node. It is never queued, so it is never claimed; cleanup
/// deletes it only once the node has been gone longer than the retention.
pub const NODE_BEACON_KIND: &str = "node-beacon";
/// The dedupe key of node `n`'s beacon is `node-beacon:<n>`.
pub const NODE_BEACON_PREFIX: &str = "node-beacon:";

/// `$1 node, $2 now`: inserts or refreshes the node's beacon (last seen = now, never backwards).
pub const NODE_SEEN: &str = "INSERT INTO jobs (task_id, agent, task_content, state, priority, \
     attempt, max_attempts, available_at, dedupe_key, node, created_at, finished_at) \
     VALUES (NULL, 'node-beacon', '', 'done', 0, 0, 1, $2, 'node-beacon:' || CAST($1 AS TEXT), \
     $1, $2, $2) \
     ON CONFLICT (dedupe_key) WHERE dedupe_key IS NOT NULL DO UPDATE \
     SET finished_at = CASE WHEN jobs.finished_at > excluded.finished_at \
         THEN jobs.finished_at ELSE excluded.finished_at END";

/// Every node's beacon: `node, first seen, last seen`, by node.
pub const NODES: &str = "SELECT node, created_at, finished_at FROM jobs \
     WHERE state = 'done' AND agent = 'node-beacon' AND node IS NOT NULL \
     AND finished_at IS NOT NULL ORDER BY node";

/// `$1 id, $2 attempt, $3 node`: re-pins a running job to the node that took it over (fenced).
pub const TAKE_OVER_JOB: &str =
    "UPDATE jobs SET node = $3 WHERE id = $1 AND attempt = $2 AND state = 'running'";

/// The condition under which a queued job `q` pinned to another node may be claimed by a
/// worker whose node grace is `{grace}` (a parameter, NULL: never): the job has been ready for
/// longer than the grace, and its node has not been seen (its beacon) for longer than the grace
/// before `{now}`, or never. The cheap test on `available_at` comes first, so the beacon is
/// looked up only for jobs that have waited that long (docs/benchmarks-history.md: 10,000 ready jobs
/// pinned to a live node ahead in the claim order cost a lookup each, 1.4 → 13 ms per claim,
/// without the test). The beacon is read as a scalar subquery (one `jobs_dedupe` lookup):
/// written as `NOT EXISTS`, PostgreSQL's generic plan hashed a sequential scan of `jobs`.
pub fn node_gone(now: &str, grace: &str) -> String {
    format!(
        "({grace} IS NOT NULL AND q.available_at < {now} - {grace} \
         AND coalesce((SELECT b.finished_at FROM jobs b \
         WHERE b.dedupe_key = 'node-beacon:' || q.node), q.available_at) < {now} - {grace})"
    )
}

pub const JOB_ID_BY_DEDUPE: &str = "SELECT id FROM jobs WHERE dedupe_key = $1";

/// `$1 task_id, $2 job_id, $3 kind, $4 stage, $5 message, $6 data, $7 created_at` → `id`.
pub const INSERT_EVENT: &str = "INSERT INTO events (task_id, job_id, kind, stage, message, data, \
     created_at) VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id";

/// `$1 id, $2 attempt, $3 now` → the job's `task_id` when the fence held.
pub const MARK_DONE: &str = "UPDATE jobs SET state = 'done', finished_at = $3, \
     lease_expires_at = NULL WHERE id = $1 AND attempt = $2 AND state = 'running' \
     RETURNING task_id";

/// `$1 id, $2 attempt, $3 now, $4 error` → `task_id`.
pub const MARK_FAILED: &str = "UPDATE jobs SET state = 'failed', finished_at = $3, \
     lease_expires_at = NULL, last_error = $4 \
     WHERE id = $1 AND attempt = $2 AND state = 'running' RETURNING task_id";

/// `$1 id, $2 attempt, $3 available_at, $4 error` → `task_id`.
pub const MARK_RETRY: &str = "UPDATE jobs SET state = 'queued', available_at = $3, \
     lease_expires_at = NULL, locked_by = NULL, last_error = $4 \
     WHERE id = $1 AND attempt = $2 AND state = 'running' RETURNING task_id";

/// `$1 id, $2 attempt, $3 now`: back to the queue without spending an attempt.
pub const RELEASE: &str = "UPDATE jobs SET state = 'queued', available_at = $3, \
     lease_expires_at = NULL, locked_by = NULL, max_attempts = max_attempts + 1, \
     last_error = 'released at shutdown' \
     WHERE id = $1 AND attempt = $2 AND state = 'running'";

/// `$1 id, $2 now`.
pub const CANCEL_JOB: &str = "UPDATE jobs SET state = 'cancelled', finished_at = $2, \
     lease_expires_at = NULL WHERE id = $1 AND state IN ('queued', 'running')";

/// `$1 task_id, $2 keep (job id or NULL → -1), $3 now`.
pub const CANCEL_TASK_JOBS: &str = "UPDATE jobs SET state = 'cancelled', finished_at = $3, \
     lease_expires_at = NULL \
     WHERE task_id = $1 AND id <> $2 AND state IN ('queued', 'running')";

/// `$1 task_id`: live jobs of a task.
pub const LIVE_JOBS_OF_TASK: &str =
    "SELECT count(*) FROM jobs WHERE task_id = $1 AND state IN ('queued', 'running')";

/// `$1 finished before, $2 limit` → `(task id, stage_seq, job id, last_error)`: tasks in a
/// stage that is not terminal with no live job at all, whose latest job that failed for good
/// failed in the current stage visit (after the task's last stage change) and before `$1`.
/// Nothing will ever move such a task: its failure did not end it because another job was
/// live then, and that job later ended without moving it on. (A task waiting at an approval
/// stage has no job either, but no job of its visit failed.)
pub const STRANDED_TASKS: &str = "SELECT t.id, t.stage_seq, f.id, f.last_error FROM tasks t \
     JOIN jobs f ON f.id = (SELECT j.id FROM jobs j WHERE j.task_id = t.id AND j.state = 'failed' \
     ORDER BY j.finished_at DESC, j.id DESC LIMIT 1) \
     WHERE t.stage NOT IN ('done', 'failed', 'cancelled') AND f.finished_at < $1 \
     AND f.finished_at >= t.updated_at \
     AND NOT EXISTS (SELECT 1 FROM jobs l WHERE l.task_id = t.id AND l.state IN ('queued', 'running')) \
     ORDER BY t.id LIMIT $2";

/// `$1 job_id` → how many times the job was rescued after its worker died (its
/// `orch_domain::control::events::JOB_RESCUED` events, spelled in the statement so that it
/// stays one prepared text; a unit test holds the two equal): the restart-safe crash counter.
pub const CRASHES_OF_JOB: &str =
    "SELECT count(*) FROM events WHERE kind = 'job.rescued' AND job_id = $1";

/// `$1 worker_id, $2 an instant just past`: the leases of a worker known to be dead end now.
pub const EXPIRE_LEASES_OF: &str = "UPDATE jobs SET lease_expires_at = $2 \
     WHERE state = 'running' AND locked_by = $1 AND lease_expires_at > $2";

/// `$1 id, $2 attempt, $3 available_at, $4 error`: back to the queue after a crash rescue,
/// without spending an attempt (the limit moves with the attempt, as in `RELEASE`).
pub const RESCUE_REQUEUE: &str = "UPDATE jobs SET state = 'queued', available_at = $3, \
     lease_expires_at = NULL, locked_by = NULL, max_attempts = max_attempts + 1, \
     last_error = $4 WHERE id = $1 AND attempt = $2 AND state = 'running'";

/// Queued and running jobs by state and agent, exactly: a scan of the partial index
/// `jobs_active` (schema 2), so it costs the jobs in flight, not the table. Grouped in the
/// index's order (no hash table, no sort); callers sort the few rows by agent.
pub const ACTIVE_JOB_COUNTS: &str = "SELECT agent, state, count(*) AS count FROM jobs \
     WHERE state IN ('queued', 'running') GROUP BY state, agent ORDER BY state, agent";

/// `$1 since` → finished jobs by agent and state, of those that finished at or after `$1` (a
/// range of the partial index `jobs_finished`; `{hint}` is the driver's index hint): the
/// views count the recent window, never the whole history.
pub fn recent_finished_job_counts(hint: &str) -> String {
    format!(
        "SELECT agent, state, count(*) AS count FROM jobs{hint} \
         WHERE state IN ('done', 'failed', 'cancelled') AND finished_at >= $1 \
         GROUP BY state, agent ORDER BY state, agent"
    )
}

/// Every job row, exactly (a scan of the table: for `orch gc` and tests, not for the views).
pub const COUNT_ALL_JOBS: &str = "SELECT count(*) FROM jobs";

/// Whether any job is queued or running.
pub const HAS_LIVE_JOBS: &str =
    "SELECT EXISTS (SELECT 1 FROM jobs WHERE state IN ('queued', 'running'))";

/// `$1 now` → `available_at` of the oldest ready job (no row: none is ready): the first entry
/// of the partial index `jobs_queued_at` (`{hint}`: the driver's index hint), one probe.
pub fn oldest_ready(hint: &str) -> String {
    format!(
        "SELECT available_at FROM jobs{hint} WHERE state = 'queued' AND available_at <= $1 \
         ORDER BY available_at LIMIT 1"
    )
}

/// Running jobs with their task's work item (one read: the dashboard's lease table needs no
/// read per lease; a key lookup per lease, whatever the size of `tasks`), soonest expiry first.
pub const LIVE_LEASES: &str = "SELECT j.id, j.task_id, j.agent, j.locked_by, j.attempt, \
     j.lease_expires_at, (SELECT t.work_item_id FROM tasks t WHERE t.id = j.task_id) \
     FROM jobs j WHERE j.state = 'running' ORDER BY j.lease_expires_at, j.id LIMIT 500";

/// `$1 task_id, $2 job_id, $3 stage, $4 agent, $5 backend, $6 model, $7 attempt, $8 started_at`.
pub const INSERT_AGENT_RUN: &str = "INSERT INTO agent_runs (task_id, job_id, stage, agent, \
     backend, model, attempt, started_at, outcome) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'running') RETURNING id";

/// `$1 id, $2 finished_at, $3 outcome, $4 exit_code, $5 input_tokens, $6 output_tokens,
/// $7 cost_usd, $8 error, $9 data`.
pub const FINISH_AGENT_RUN: &str = "UPDATE agent_runs SET finished_at = $2, outcome = $3, \
     exit_code = $4, input_tokens = $5, output_tokens = $6, cost_usd = $7, error = $8, data = $9 \
     WHERE id = $1";

/// `$1 task_id`. A run without a recorded cost is counted apart (its cost is unknown), never
/// summed as zero.
pub const TASK_USAGE: &str = "SELECT count(*), CAST(coalesce(sum(input_tokens), 0) AS BIGINT), \
     CAST(coalesce(sum(output_tokens), 0) AS BIGINT), \
     CAST(coalesce(sum(cost_usd), 0.0) AS DOUBLE PRECISION), \
     CAST(count(*) - count(cost_usd) AS BIGINT) \
     FROM agent_runs WHERE task_id = $1";

/// Totals of every agent run, by agent (for `/metrics`).
pub const USAGE_BY_AGENT: &str = "SELECT agent, count(*), \
     CAST(coalesce(sum(input_tokens), 0) AS BIGINT), \
     CAST(coalesce(sum(output_tokens), 0) AS BIGINT), \
     CAST(coalesce(sum(cost_usd), 0.0) AS DOUBLE PRECISION), \
     CAST(count(*) - count(cost_usd) AS BIGINT) \
     FROM agent_runs GROUP BY agent ORDER BY agent";

/// Agent runs by the task's repo, the stage and the UTC day the run started (days since the
/// epoch), with the same usage columns as [`USAGE_BY_AGENT`] (for `orch costs`, `GET /costs`).
pub const USAGE_BY_REPO_STAGE_DAY: &str = "SELECT t.repo, r.stage, \
     CAST(r.started_at / 86400000 AS BIGINT), count(*), \
     CAST(coalesce(sum(r.input_tokens), 0) AS BIGINT), \
     CAST(coalesce(sum(r.output_tokens), 0) AS BIGINT), \
     CAST(coalesce(sum(r.cost_usd), 0.0) AS DOUBLE PRECISION), \
     CAST(count(*) - count(r.cost_usd) AS BIGINT) \
     FROM agent_runs r JOIN tasks t ON t.id = r.task_id \
     GROUP BY t.repo, r.stage, CAST(r.started_at / 86400000 AS BIGINT) \
     ORDER BY 3, 1, 2";

/// Agent runs by agent and outcome (for `/metrics`); outcomes are few (`running`, `success`, …).
pub const RUNS_BY_AGENT_OUTCOME: &str = "SELECT agent, outcome, count(*) FROM agent_runs \
     GROUP BY agent, outcome ORDER BY agent, outcome";

pub const COUNT_TASKS_BY_STAGE: &str =
    "SELECT stage, count(*) FROM tasks GROUP BY stage ORDER BY stage";

/// Live tasks (not at a terminal stage) by stage, exactly: the partial index `tasks_live`.
pub const LIVE_TASKS_BY_STAGE: &str = "SELECT stage, count(*) FROM tasks \
     WHERE stage NOT IN ('done', 'failed', 'cancelled') GROUP BY stage ORDER BY stage";

/// `$1 since` → ended tasks by terminal stage, of those that ended (their last stage change) at
/// or after `$1`: a range of the partial index `tasks_ended` (`{hint}`: the driver's hint).
pub fn recently_ended_tasks_by_stage(hint: &str) -> String {
    format!(
        "SELECT stage, count(*) FROM tasks{hint} \
         WHERE stage IN ('done', 'failed', 'cancelled') AND updated_at >= $1 \
         GROUP BY stage ORDER BY stage"
    )
}

/// `$1 since` → the tasks that ended at or after `$1`, in the order of `tasks_ended`
/// (`{hint}`), so the read is that index's range.
pub fn tasks_ended_since(hint: &str) -> String {
    format!(
        "SELECT {TASK_COLUMNS} FROM tasks{hint} \
         WHERE stage IN ('done', 'failed', 'cancelled') AND updated_at >= $1 \
         ORDER BY updated_at, id"
    )
}

/// `$1 repo ('' = every repo)` → the live tasks (not at a terminal stage) submitted before
/// `{until}`: a read of the partial index `tasks_live` (`{hint}`), the work in flight. The
/// bounds are written in by [`report_bounds`].
pub fn report_live_tasks(hint: &str) -> String {
    format!(
        "SELECT {TASK_COLUMNS} FROM tasks{hint} \
         WHERE stage NOT IN ('done', 'failed', 'cancelled') AND created_at < {{until}} \
         AND ($1 = '' OR repo = $1) ORDER BY id"
    )
}

/// `$1 repo ('' = every repo)` → the tasks that ended at or after `{since}` and were
/// submitted before `{until}` (the only ended tasks a report over `[since, until)` can count
/// anything of: nothing of a task happens after it ended or before it was submitted): a range
/// of the partial index `tasks_ended` (`{hint}`).
pub fn report_ended_tasks(hint: &str) -> String {
    format!(
        "SELECT {TASK_COLUMNS} FROM tasks{hint} \
         WHERE stage IN ('done', 'failed', 'cancelled') AND updated_at >= {{since}} \
         AND created_at < {{until}} AND ($1 = '' OR repo = $1) ORDER BY updated_at, id"
    )
}

/// A report statement with its range written in, as [`with_since`] does (integers: safe).
pub fn report_bounds(statement: &str, since: i64, until: i64) -> String {
    statement
        .replace("{since}", &since.to_string())
        .replace("{until}", &until.to_string())
}

/// A window statement with its `$1` (the window's start) written into the text: the planner
/// then sees how narrow the window is. PostgreSQL's connections plan prepared statements
/// generically (`plan_cache_mode = force_generic_plan`), and a generic plan guesses a third of
/// the table for `finished_at >= $1`, so it read the window through the whole-table indexes.
/// The start is an integer, so the text is safe; such statements are not kept prepared.
pub fn with_since(statement: &str, since: i64) -> String {
    statement.replace("$1", &since.to_string())
}

/// `$1 finished before, $2 limit` → ids: deletes at most `$2` finished jobs, oldest first,
/// that finished before `$1` and whose task ended before `$1` (its `updated_at`, the terminal
/// stage change). `{lock}` is the driver's row-lock suffix for the task rows (PostgreSQL: `FOR
/// SHARE OF t`): a retry that revives a task waits for the batch, or the batch re-reads the
/// task and leaves its jobs. Walks `jobs_finished` in order and each task by its key.
pub fn prune_task_jobs(lock: &str) -> String {
    format!(
        "DELETE FROM jobs WHERE id IN (SELECT j.id FROM jobs j JOIN tasks t ON t.id = j.task_id \
         WHERE j.state IN ('done', 'failed', 'cancelled') AND j.finished_at < $1 \
         AND t.stage IN ('done', 'failed', 'cancelled') AND t.updated_at < $1 \
         ORDER BY j.finished_at, j.id LIMIT $2{lock}) RETURNING id"
    )
}

/// `$1 finished before, $2 limit` → ids: as [`prune_task_jobs`], for jobs of no task
/// (`task-ended`, `notify`, a node's beacon: its `finished_at` is when the node was last seen,
/// so a beacon goes only once its node has been gone for the whole retention).
pub const PRUNE_TASKLESS_JOBS: &str = "DELETE FROM jobs WHERE id IN (SELECT j.id FROM jobs j \
     WHERE j.state IN ('done', 'failed', 'cancelled') AND j.finished_at < $1 \
     AND j.task_id IS NULL ORDER BY j.finished_at, j.id LIMIT $2) RETURNING id";

/// The `data` of the latest `jobs.pruned` event (its `total` is every job pruned so far),
/// spelled in the statement so that it stays one prepared text (a unit test holds the kind).
pub const LAST_PRUNE: &str =
    "SELECT data FROM events WHERE kind = 'jobs.pruned' ORDER BY id DESC LIMIT 1";

/// `$1 kind` → the `data` of every event of that kind (the schema version is read from them).
pub const EVENT_DATA_OF_KIND: &str = "SELECT data FROM events WHERE kind = $1";

pub static JOB_BY_ID: LazyLock<String> = LazyLock::new(|| select_jobs("WHERE id = $1"));
pub static TASK_JOBS: LazyLock<String> =
    LazyLock::new(|| select_jobs("WHERE task_id = $1 ORDER BY id"));
pub static TASK_BY_ID: LazyLock<String> = LazyLock::new(|| select_tasks("WHERE id = $1"));
pub static TASK_BY_WORK_ITEM: LazyLock<String> =
    LazyLock::new(|| select_tasks("WHERE work_item_id = $1"));

/// `$1 work_item_id, $2 repo, $3 title, $4 body, $5 stage, $6 branch, $7 now` → the task; no
/// row when the work item id is taken.
pub static INSERT_TASK: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO tasks (work_item_id, repo, title, body, stage, stage_seq, branch, \
         created_at, updated_at) VALUES ($1, $2, $3, $4, $5, 0, $6, $7, $7) \
         ON CONFLICT (work_item_id) DO NOTHING RETURNING {TASK_COLUMNS}"
    )
});

/// `$1 id, $2 new stage, $3 now, $4 expected stage, $5 expected stage_seq` → the task.
pub static ADVANCE_TASK: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE tasks SET stage = $2, stage_seq = stage_seq + 1, updated_at = $3 \
         WHERE id = $1 AND stage = $4 AND stage_seq = $5 RETURNING {TASK_COLUMNS}"
    )
});

pub static TASK_EVENTS: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {EVENT_COLUMNS} FROM events WHERE task_id = $1 ORDER BY id"));

/// `$1 kind, $2 after id, $3 limit`.
pub static EVENTS_BY_KIND: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {EVENT_COLUMNS} FROM events WHERE kind = $1 AND id > $2 ORDER BY id LIMIT $3")
});

/// [`EVENTS_BY_KIND`] with its values written into the text, when the kind is a plain event
/// kind (`a-z`, `0-9`, `.`, `_`, `-`: every kind orch writes), else `None`. PostgreSQL's
/// generic plan of the bound statement guesses a common kind and walks the primary key through
/// every event (43 ms at 1,000,000 jobs for the rare `node.takeover` the queue views read);
/// with the kind in the text it reads `events_kind` (0.08 ms).
pub fn events_by_kind_literal(kind: &str, after_id: i64, limit: i64) -> Option<String> {
    let plain = !kind.is_empty()
        && kind
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    plain.then(|| {
        format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE kind = '{kind}' AND id > {after_id} \
             ORDER BY id LIMIT {limit}"
        )
    })
}

pub static TASK_AGENT_RUNS: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {AGENT_RUN_COLUMNS} FROM agent_runs WHERE task_id = $1 ORDER BY id")
});

pub fn select_jobs(where_clause: &str) -> String {
    format!("SELECT {JOB_COLUMNS} FROM jobs {where_clause}")
}

pub fn select_tasks(where_clause: &str) -> String {
    format!("SELECT {TASK_COLUMNS} FROM tasks {where_clause}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_prune_total_reads_the_prune_event_kind() {
        let kind = orch_domain::control::events::JOBS_PRUNED;
        assert!(super::LAST_PRUNE.contains(&format!("kind = '{kind}'")));
    }

    #[test]
    fn only_plain_event_kinds_are_written_into_a_statement() {
        let q = super::events_by_kind_literal("node.takeover", 7, 500).unwrap();
        assert!(q.contains("kind = 'node.takeover' AND id > 7"), "{q}");
        assert_eq!(super::events_by_kind_literal("x' OR 1=1 --", 0, 1), None);
        assert_eq!(super::events_by_kind_literal("", 0, 1), None);
        assert_eq!(super::events_by_kind_literal("Stage.Advanced", 0, 1), None);
    }

    #[test]
    fn the_crash_count_reads_the_rescue_event_kind() {
        let kind = orch_domain::control::events::JOB_RESCUED;
        assert!(super::CRASHES_OF_JOB.contains(&format!("kind = '{kind}'")));
    }
}
