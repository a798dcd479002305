//! Control words: the strings orch writes into its database and reads back to decide what to
//! do. They are contracts (old rows keep them), so each is spelled exactly once, here, and every
//! crate uses these names instead of the literals:
//!
//! - the terminal stages ([`DONE`], [`FAILED`], [`CANCELLED`], [`TERMINAL_STAGES`]);
//! - [`events`]: every event kind (`events.kind`);
//! - [`markers`]: the marker lines of a job's `task_content`, whose counts are the restart-safe
//!   counters (design.md §2), with their parser;
//! - [`dedupe`]: the formats of the jobs' dedupe keys, with their parser;
//! - [`loops_used`]: the loop count of a task, rebuilt from its events;
//! - [`actor`]: who made an operator call (the API with the token, the CLI, orch itself), as
//!   stored in the `by` key of the event's data and said in its text.
//!
//! `crates/tidy` fails when a known event kind is spelled as a literal in shipped code outside
//! this file.

/// The stage a task reaches when it went through the whole pipeline.
pub const DONE: &str = "done";
/// The stage a task reaches when it could not be completed.
pub const FAILED: &str = "failed";
/// The stage a task reaches when a person cancelled it.
pub const CANCELLED: &str = "cancelled";

/// The stages that end a task (design.md §1): no job runs for a task in one of them.
pub const TERMINAL_STAGES: [&str; 3] = [DONE, FAILED, CANCELLED];

/// True when `stage` ends a task.
pub fn is_terminal_stage(stage: &str) -> bool {
    TERMINAL_STAGES.contains(&stage)
}

/// The event kind that ends a task in terminal stage `stage` (`task.done`, `task.failed`,
/// `task.cancelled`); `None` for a stage that is not terminal.
pub fn terminal_event(stage: &str) -> Option<&'static str> {
    match stage {
        DONE => Some(events::TASK_DONE),
        FAILED => Some(events::TASK_FAILED),
        CANCELLED => Some(events::TASK_CANCELLED),
        _ => None,
    }
}

/// Event kinds (`events.kind`). Each event's `data` is a JSON object; what it holds is said
/// beside its kind. The data other crates read is typed in [`crate::payload`]: every stage
/// change (the task's life, an advance, a loop back) is a [`crate::payload::StageChange`].
pub mod events {
    // The task's life.
    /// A task was created (stage `intake`): `{by}` (see [`super::actor`]).
    pub const TASK_SUBMITTED: &str = "task.submitted";
    /// A task reached `done`: `{from, to, outcome, …}`.
    pub const TASK_DONE: &str = "task.done";
    /// A task reached `failed`: `{from, to, outcome, stage, reason}`.
    pub const TASK_FAILED: &str = "task.failed";
    /// A task reached `cancelled` (an operator, or `decide`): `{from, to, outcome, reason, by}`.
    pub const TASK_CANCELLED: &str = "task.cancelled";
    /// An operator retried a failed task: `{from, to, by}`.
    pub const TASK_RETRIED: &str = "task.retried";

    // Stage visits.
    /// A stage job began its work.
    pub const STAGE_STARTED: &str = "stage.started";
    /// A stage job came back later (a defer, a tick, a wait): `{delay_ms, marker, priority}`
    /// ([`crate::payload::StageRequeued`]).
    pub const STAGE_REQUEUED: &str = "stage.requeued";
    /// The task moved forward to its next stage: `{from, to}`.
    pub const STAGE_ADVANCED: &str = "stage.advanced";
    /// The task went back (review or a gate sent it to an earlier stage): `{from, to}`. Their
    /// number is the task's loop count ([`super::loops_used`]).
    pub const STAGE_LOOP_BACK: &str = "stage.loop_back";
    /// An operator approved a stage that requires approval: `{by}`.
    pub const STAGE_APPROVED: &str = "stage.approved";

    // Jobs and runs.
    /// A stage left something it may not commit, refused before anything was committed: a
    /// path it may not touch, a link, a special file, a hostile name, too many files
    /// (`{stage, attempt, rules: [{path, rule, reason}], count}`, see `crate::protect`), or a
    /// bad artifact (a file too big, a gate that did not pass).
    pub const ARTIFACT_REJECTED: &str = "artifact.rejected";
    /// A runner stage (tests, staging) left files it does not write, by-products of the
    /// repository's own code: they were removed, not committed (`{stage, rules, count}`).
    pub const COMMIT_DISCARDED: &str = "commit.discarded";
    /// An agent CLI reported a permission denial.
    pub const AGENT_PERMISSION_DENIED: &str = "agent.permission_denied";
    /// An agent run whose process was lost (no result, supervisor gone) continues its CLI
    /// session instead of starting again: `{cli, session_id, key, why}`.
    pub const AGENT_SESSION_RESUMED: &str = "agent.session_resumed";
    /// An agent run whose process was lost could not continue its session (its files are
    /// gone, or no session was recorded) and starts afresh: `{cli, session_id, key, why}`.
    pub const AGENT_SESSION_LOST: &str = "agent.session_lost";
    /// An attempt lost to a dead worker (a crash rescue, not counted as a failure). Their count
    /// per job is the restart-safe crash counter (no column).
    pub const JOB_RESCUED: &str = "job.rescued";
    /// A handler failed an attempt ("attempt N failed: …").
    pub const JOB_ATTEMPT_FAILED: &str = "job.attempt_failed";
    /// A stage's command started by an earlier orch process was adopted instead of run again:
    /// `{label, key, state}` (`state`: `running` — waited for — or `finished` — ended while
    /// orch was away, its result read).
    pub const COMMAND_ADOPTED: &str = "command.adopted";
    /// A stage's command started by an earlier orch process lost its supervisor without a
    /// result (the machine restarted): it ran again. `{label, key}`.
    pub const COMMAND_RERUN: &str = "command.rerun";
    /// A schema version was applied (there is no migrations table).
    pub const SCHEMA_MIGRATED: &str = "schema.migrated";
    /// Retention removed a batch of finished jobs of finished tasks, in the transaction that
    /// deleted them: `{jobs, total, finished_before, first_id, last_id}` (`total`: every job
    /// pruned so far, this batch included; the latest such event is `/metrics`'
    /// `orch_jobs_pruned_total`). Task-less (the batch spans tasks).
    pub const JOBS_PRUNED: &str = "jobs.pruned";

    // The deploy tail (each `data` has `seq`).
    /// The deploy command is about to run.
    pub const DEPLOY_STARTED: &str = "deploy.started";
    /// The deploy command is run once more: its first run was interrupted by orch stopping
    /// (a crash, a kill) before it ended, and the revision is not live (recorded first: a
    /// visit re-runs it at most once).
    pub const DEPLOY_REDEPLOYED: &str = "deploy.redeployed";
    /// No deploy command is configured: `{revision, outcome, seq}`
    /// ([`crate::payload::DeploySkipped`]).
    pub const DEPLOY_SKIPPED: &str = "deploy.skipped";
    /// The deploy command failed (non-zero exit, timeout, cannot start).
    pub const DEPLOY_FAILED: &str = "deploy.failed";
    /// The finalizer could not confirm yet and deferred.
    pub const DEPLOY_DEFERRED: &str = "deploy.deferred";
    /// The finalizer gave up: the deploy was not confirmed within its bound.
    pub const DEPLOY_UNCONFIRMED: &str = "deploy.unconfirmed";
    /// The deploy is confirmed (health reachable, revision live) and the watch armed.
    pub const DEPLOY_CONFIRMED: &str = "deploy.confirmed";
    /// An unconfirmed deploy is being rolled back (recorded first: a re-run never rolls
    /// back twice).
    pub const DEPLOY_ROLLBACK_STARTED: &str = "deploy.rollback_started";
    /// An unconfirmed deploy's rollback is run again: its last run was interrupted by orch
    /// stopping before its command ended and production is not back (recorded first; a
    /// bounded number of times per visit).
    pub const DEPLOY_ROLLBACK_RERUN: &str = "deploy.rollback_rerun";
    /// An unconfirmed deploy's rollback command exited successfully (before it is verified):
    /// from then on a re-run only verifies, never runs the command again.
    pub const DEPLOY_ROLLBACK_RAN: &str = "deploy.rollback_ran";
    /// An unconfirmed deploy was rolled back and the rollback verified.
    pub const DEPLOY_ROLLED_BACK: &str = "deploy.rolled_back";
    /// An unconfirmed deploy's rollback failed, was not verified, or was not attempted
    /// because another revision is live.
    pub const DEPLOY_ROLLBACK_FAILED: &str = "deploy.rollback_failed";
    /// The monitor found its sentinel state missing or broken, or could not store a poll.
    pub const POST_DEPLOY_EVIDENCE_LOST: &str = "post_deploy.evidence_lost";
    /// The alert: a DEGRADED watch, a FAILED one that may not roll back, a failed rollback.
    pub const POST_DEPLOY_ALERT: &str = "post_deploy.alert";
    /// An alert was delivered to one channel (`command` or `webhook`, in `data.channel`).
    pub const POST_DEPLOY_ALERT_SENT: &str = "post_deploy.alert_sent";
    /// An alert could not be delivered to one channel (failed, timed out, refused).
    pub const POST_DEPLOY_ALERT_FAILED: &str = "post_deploy.alert_failed";
    /// A watch ended early because a newer deploy of the same repo armed its own watch.
    pub const POST_DEPLOY_SUPERSEDED: &str = "post_deploy.superseded";
    /// The rollback command is about to run (recorded first: a re-run never rolls back twice).
    pub const POST_DEPLOY_ROLLBACK_STARTED: &str = "post_deploy.rollback_started";
    /// The rollback command is run again: its last run was interrupted by orch stopping
    /// before it ended and production is not back (recorded first; a bounded number of times
    /// per visit).
    pub const POST_DEPLOY_ROLLBACK_RERUN: &str = "post_deploy.rollback_rerun";
    /// The rollback command exited successfully (before it is verified): from then on a
    /// re-run only verifies, never runs the command again.
    pub const POST_DEPLOY_ROLLBACK_RAN: &str = "post_deploy.rollback_ran";
    /// The rollback's result (ran, verified or not).
    pub const POST_DEPLOY_ROLLBACK: &str = "post_deploy.rollback";
    /// The watch's verdict and the action taken.
    pub const POST_DEPLOY_VERDICT: &str = "post_deploy.verdict";
    /// The recovery sweep re-enqueued a tick for a stranded watch.
    pub const POST_DEPLOY_RECOVERED: &str = "post_deploy.recovered";
    /// A retried `observe` visit watches the item's revision again (still live):
    /// `{revision, seq}`.
    pub const POST_DEPLOY_REARMED: &str = "post_deploy.rearmed";
    /// The lessons of a work item were recorded.
    pub const LESSONS_RECORDED: &str = "lessons.recorded";

    // Nodes (design.md §10).
    /// A node took over a job pinned to a node gone longer than the grace, and re-pinned it:
    /// `{from, to, last_seen_ms, seq, stage, job, agent}` ([`crate::payload::NodeTakeover`]).
    pub const NODE_TAKEOVER: &str = "node.takeover";
    /// The remote's `orch/<id>` held commits the lease holder had not seen (a stale attempt's
    /// push); the holder's branch replaced them by compare-and-swap.
    pub const WORK_BRANCH_REPLACED: &str = "work_branch.replaced";
    /// This node's `orch/<id>` held commits the remote lacks (an attempt that never
    /// completed); before the stage ran it was moved to the remote's branch, the old commit
    /// kept under `refs/orch/stale/`.
    pub const WORK_BRANCH_SET_ASIDE: &str = "work_branch.set_aside";
    /// The visit's deploy markers were not on this node (it took the visit over from a node
    /// that is gone): rebuilt from the events before going on: `{revision, ended_well, node}`.
    pub const DEPLOY_MARKERS_RESTORED: &str = "deploy.markers_restored";
    /// Deploy markers on this node belonged to another visit of the item (left when this node
    /// went away and that visit was taken over): cleared before this visit deploys:
    /// `{revision, node}`.
    pub const DEPLOY_STALE_MARKERS_CLEARED: &str = "deploy.stale_markers_cleared";
    /// A watch taken over from a node that is gone, re-armed here from the deploy's
    /// `deploy.confirmed`, the polls taken there marked lost: `{revision, from, armed_at_ms}`.
    pub const POST_DEPLOY_TAKEN_OVER: &str = "post_deploy.taken_over";

    // The release train.
    /// A task could not enter the release track: `{repo, holder, holder_stage}`.
    pub const RELEASE_WAITING: &str = "release.waiting";
    /// Staging passed on this exact commit: `{repo, revision, seq}`.
    pub const RELEASE_STAGED: &str = "release.staged";
    /// About to move the default branch: `{repo, old, new, seq}` (written first, so a re-run
    /// knows what the candidate was built on).
    pub const RELEASE_PROMOTING: &str = "release.promoting";
    /// The default branch now holds the staged commit: `{repo, old, new, seq}`.
    pub const RELEASE_PROMOTED: &str = "release.promoted";
    /// The default branch refused orch's push: the staged commit is about to be published
    /// through the forge's API (written before the call, so a re-run finds the merge by its
    /// pull request or the branch and never merges twice): `{repo, forge, method, pull, branch,
    /// old, staged, seq}` (`pull` is `null` for `fast-forward`).
    pub const RELEASE_FORGE_MERGING: &str = "release.forge_merging";
    /// What the forge put on the default branch does not have exactly the staged tree: nothing
    /// is deployed and the item goes back to the merge gate: `{repo, forge, method, staged,
    /// merged, staged_tree, merged_tree, seq}`.
    pub const RELEASE_FORGE_MISMATCH: &str = "release.forge_mismatch";
    /// A production deploy ended: `{repo, revision, previous_revision, confirmed, items, seq}`.
    pub const RELEASE_DEPLOYED: &str = "release.deployed";
    /// Production was rolled back from this item's deploy: `{repo, revision, live}`.
    pub const RELEASE_ROLLED_BACK: &str = "release.rolled_back";
    /// The item's change was reverted on the default branch: `{repo, work_item, revert_commit,
    /// reverted_from, reverted_to}`.
    pub const RELEASE_REVERTED: &str = "release.reverted";
    /// A release reached orch's clone but not the user's checkout (local changes there):
    /// `{repo, target}`.
    pub const RELEASE_UNPUBLISHED: &str = "release.unpublished";
    /// The repo's releases are held by this item until an operator acts: `{repo, reason}`.
    pub const RELEASE_HELD: &str = "release.held";
    /// An operator released the hold: `{repo, live, healthy}` (what production ran then, as
    /// orch saw it; `null` when it could not tell).
    pub const RELEASE_UNHELD: &str = "release.unheld";

    // Production after trouble, notifications and the trail.
    /// orch looked at production after something went wrong in deploy or observe and settled
    /// it: `{trouble, revision, previous, live, health, description, settled, settled_at,
    /// rolled, tried, todo, seq}` (`settled` is `healthy`: verified healthy at the known
    /// revision `settled_at`; or `alerted`: an operator was alerted with what is live, what was
    /// tried and what to do).
    pub const PRODUCTION_CHECKED: &str = "production.checked";
    /// A notification reached the webhook: `{id, event, attempt, status}`.
    pub const NOTIFY_DELIVERED: &str = "notify.delivered";
    /// A notification's delivery failed: `{id, event, attempt, error, retry_in_s}`
    /// (`retry_in_s` is `null` when it gave up).
    pub const NOTIFY_FAILED: &str = "notify.failed";
    /// The item's documents reached the default branch after it ended (or could not):
    /// `{branch, commit, files, published}`.
    pub const TRAIL_PUBLISHED: &str = "trail.published";

    // The forge (issue 31; task-less: the issue is no item yet).
    /// Requests to a repo's forge wait: an outage, a rate limit, a refused token. Written when
    /// the waiting starts (not per try): `{repo, forge, why, wait_s, failures}`.
    pub const FORGE_WAITING: &str = "forge.waiting";
    /// The forge answered again after [`FORGE_WAITING`]: `{repo, forge, waited_s}`.
    pub const FORGE_RESUMED: &str = "forge.resumed";
    // The forge, for an item that came from a forge's issue (issue 31's second part).
    /// The item's pull request was found or opened on the forge: `{number, url, head, base,
    /// opened}` (`opened`: false when an existing one was found by its head).
    pub const FORGE_PULL: &str = "forge.pull";
    /// The forge sync caught up with the item's events up to event `through`: `{through,
    /// pull, statuses, body, described}` (the statuses set, `[{context, state}]`; `body`: the
    /// digest of the pull request's description the forge has, `described`: whether this sync
    /// PATCHed it). The sync's cursor.
    pub const FORGE_SYNCED: &str = "forge.synced";
    /// A review of the item's pull request was taken: `{review, state, pull, action, by}`
    /// (`action`: `loop_back`, `approved` or `noted`, with `why`).
    pub const FORGE_REVIEW: &str = "forge.review";
    /// The item's outcome was said on the forge: `{outcome, issue, pull, comments, closed}`.
    pub const FORGE_OUTCOME: &str = "forge.outcome";
    /// A release stopped waiting for the protected branch's required status checks after the
    /// forge's `check_wait_s`: `{repo, forge, waited_s, check_wait_s}`; the attempt fails.
    pub const FORGE_CHECK_WAIT_OVER: &str = "forge.check_wait_over";
    /// The item's pull request was closed after its outcome was said (it is where review
    /// happened, not what was merged): `{pull, seq, closed_now}` (`closed_now`: false when it
    /// was found closed already and orch had not recorded its intent to close it).
    pub const FORGE_PULL_CLOSED: &str = "forge.pull_closed";
    /// Orch is about to close the item's pull request after its outcome (recorded before the
    /// call, fenced): `{pull, seq}`. A pull request found closed after it was closed by orch.
    pub const FORGE_PULL_CLOSING: &str = "forge.pull_closing";
    /// The pull request orch closed at an ending was reopened because the item is live again
    /// (an operator retried it): `{pull, seq, reopened}` (`reopened`: false when the forge
    /// refused, e.g. its branch is gone).
    pub const FORGE_PULL_REOPENED: &str = "forge.pull_reopened";

    /// Every kind above (a test holds it complete; the tidy rule reads the constants' lines).
    pub const ALL: &[&str] = &[
        TASK_SUBMITTED,
        TASK_DONE,
        TASK_FAILED,
        TASK_CANCELLED,
        TASK_RETRIED,
        STAGE_STARTED,
        STAGE_REQUEUED,
        STAGE_ADVANCED,
        STAGE_LOOP_BACK,
        STAGE_APPROVED,
        ARTIFACT_REJECTED,
        COMMIT_DISCARDED,
        AGENT_PERMISSION_DENIED,
        AGENT_SESSION_RESUMED,
        AGENT_SESSION_LOST,
        COMMAND_ADOPTED,
        COMMAND_RERUN,
        JOB_RESCUED,
        JOB_ATTEMPT_FAILED,
        SCHEMA_MIGRATED,
        JOBS_PRUNED,
        DEPLOY_STARTED,
        DEPLOY_REDEPLOYED,
        DEPLOY_SKIPPED,
        DEPLOY_FAILED,
        DEPLOY_DEFERRED,
        DEPLOY_UNCONFIRMED,
        DEPLOY_CONFIRMED,
        DEPLOY_ROLLBACK_STARTED,
        DEPLOY_ROLLBACK_RERUN,
        DEPLOY_ROLLBACK_RAN,
        DEPLOY_ROLLED_BACK,
        DEPLOY_ROLLBACK_FAILED,
        POST_DEPLOY_EVIDENCE_LOST,
        POST_DEPLOY_ALERT,
        POST_DEPLOY_ALERT_SENT,
        POST_DEPLOY_ALERT_FAILED,
        POST_DEPLOY_SUPERSEDED,
        POST_DEPLOY_ROLLBACK_STARTED,
        POST_DEPLOY_ROLLBACK_RERUN,
        POST_DEPLOY_ROLLBACK_RAN,
        POST_DEPLOY_ROLLBACK,
        POST_DEPLOY_VERDICT,
        POST_DEPLOY_RECOVERED,
        POST_DEPLOY_REARMED,
        LESSONS_RECORDED,
        NODE_TAKEOVER,
        WORK_BRANCH_REPLACED,
        WORK_BRANCH_SET_ASIDE,
        DEPLOY_MARKERS_RESTORED,
        DEPLOY_STALE_MARKERS_CLEARED,
        POST_DEPLOY_TAKEN_OVER,
        RELEASE_WAITING,
        RELEASE_STAGED,
        RELEASE_PROMOTING,
        RELEASE_PROMOTED,
        RELEASE_FORGE_MERGING,
        RELEASE_FORGE_MISMATCH,
        RELEASE_DEPLOYED,
        RELEASE_ROLLED_BACK,
        RELEASE_REVERTED,
        RELEASE_UNPUBLISHED,
        RELEASE_HELD,
        RELEASE_UNHELD,
        PRODUCTION_CHECKED,
        NOTIFY_DELIVERED,
        NOTIFY_FAILED,
        TRAIL_PUBLISHED,
        FORGE_WAITING,
        FORGE_RESUMED,
        FORGE_PULL,
        FORGE_SYNCED,
        FORGE_REVIEW,
        FORGE_OUTCOME,
        FORGE_CHECK_WAIT_OVER,
        FORGE_PULL_CLOSED,
        FORGE_PULL_CLOSING,
        FORGE_PULL_REOPENED,
    ];

    /// The kinds that end a task.
    pub const TASK_ENDED: [&str; 3] = [TASK_DONE, TASK_FAILED, TASK_CANCELLED];

    /// The kinds that move a task into a stage (the stage it entered is the event's `stage`):
    /// its creation, an advance and a loop back.
    pub const STAGE_ENTERED: [&str; 3] = [TASK_SUBMITTED, STAGE_ADVANCED, STAGE_LOOP_BACK];
}

/// Markers: lines after a job's payload in `task_content` (design.md §2). The number of a
/// task's jobs of one kind whose content contains a marker's *prefix* is a restart-safe counter
/// (`count_jobs`), never a column. Every prefix is scoped to one stage visit by `seq=<stage_seq>`
/// and ends with `]`, so that `seq=1]` never matches inside `seq=12]`; a numbered marker adds
/// ` n=<n>` or ` tick=<n>` after it.
pub mod markers {
    /// Staging tool-error defers (ORCH-115 D-2), `deployer` jobs.
    pub const STAGING_DEFER: &str = "staging-tool-error-defer";
    /// Merge gate infrastructure retries, `merge-gate` jobs.
    pub const MERGE_INFRA_RETRY: &str = "merge-infra-retry";
    /// Deploy finalizer defers, `deployer` jobs (numbered ` n=`).
    pub const DEPLOY_FINALIZE: &str = "deploy-finalize";
    /// Monitor ticks (ORCH-021), `post-deploy-monitor` jobs (numbered ` tick=`).
    pub const MONITOR_TICK: &str = "monitor-tick";
    /// Monitor waits before the first poll, `post-deploy-monitor` jobs (numbered ` n=`).
    pub const MONITOR_WAIT: &str = "monitor-wait";
    /// The job that acts on a watch's final verdict (the log, a rollback, the stage change),
    /// after the tick that reached it: `post-deploy-monitor` jobs.
    pub const MONITOR_END: &str = "monitor-end";
    /// A job that waits for the repo's release track (its stage's work is done).
    pub const RELEASE_WAIT: &str = "release-wait";
    /// A lessons job that waits while the repo's releases are held.
    pub const RELEASE_HOLD: &str = "release-hold";
    /// A deploy job that stepped aside while its release waits for the forge (an outage, a
    /// rate limit, a pending required check): the stage comes back as this job.
    pub const FORGE_WAIT: &str = "forge-wait";

    /// Every marker name above.
    pub const ALL: [&str; 9] = [
        STAGING_DEFER,
        MERGE_INFRA_RETRY,
        DEPLOY_FINALIZE,
        MONITOR_TICK,
        MONITOR_WAIT,
        MONITOR_END,
        RELEASE_WAIT,
        RELEASE_HOLD,
        FORGE_WAIT,
    ];

    /// `text` (written by someone else: a reviewer, an agent) with every spelling of orch's
    /// markers defused: `orch` in any case, then any whitespace, then `:` (what `[orch:` and
    /// `<!-- orch:` hold, however spaced or cased) gets a zero-width space after `orch`, so
    /// no reader of orch's takes it for one of its own. Strip the invisible characters first
    /// (or a zero-width character inside `orch` hides it).
    pub fn defuse(text: &str) -> String {
        let chars: Vec<char> = text.chars().collect();
        let mut out = String::with_capacity(text.len() + 8);
        let mut i = 0;
        while i < chars.len() {
            let word = chars
                .get(i..i + 4)
                .is_some_and(|w| w.iter().map(|c| c.to_ascii_lowercase()).eq("orch".chars()));
            if word {
                let mut j = i + 4;
                while chars.get(j).is_some_and(|c| c.is_whitespace()) {
                    j += 1;
                }
                if chars.get(j) == Some(&':') {
                    out.extend(&chars[i..i + 4]);
                    out.push('\u{200B}');
                    i += 4;
                    continue;
                }
            }
            out.push(chars[i]);
            i += 1;
        }
        out
    }

    /// `[orch:<name>`: what every marker `name` starts with, whatever its visit.
    pub fn start(name: &str) -> String {
        format!("[orch:{name}")
    }

    /// `[orch:<name> seq=<seq>]`: the substring counted for marker `name` in visit `seq`.
    pub fn prefix(name: &str, seq: i64) -> String {
        format!("[orch:{name} seq={seq}]")
    }

    /// `[orch:staging-tool-error-defer seq=<seq>]` (the whole marker and its counted prefix).
    pub fn staging_defer(seq: i64) -> String {
        prefix(STAGING_DEFER, seq)
    }

    /// `[orch:merge-infra-retry seq=<seq>]`.
    pub fn merge_infra_retry(seq: i64) -> String {
        prefix(MERGE_INFRA_RETRY, seq)
    }

    /// `[orch:deploy-finalize seq=<seq>]`: the finalizer's defers are counted with it.
    pub fn deploy_finalize_prefix(seq: i64) -> String {
        prefix(DEPLOY_FINALIZE, seq)
    }

    /// The marker of finalizer defer `n` (1-based) of visit `seq`.
    pub fn deploy_finalize(seq: i64, n: u32) -> String {
        format!("{} n={n}", deploy_finalize_prefix(seq))
    }

    /// `[orch:monitor-tick seq=<seq>]`: the monitor's ticks are counted with it.
    pub fn monitor_tick_prefix(seq: i64) -> String {
        prefix(MONITOR_TICK, seq)
    }

    /// The marker of the monitor job for tick `tick` of visit `seq`.
    pub fn monitor_tick(seq: i64, tick: u32) -> String {
        format!("{} tick={tick}", monitor_tick_prefix(seq))
    }

    /// `[orch:monitor-wait seq=<seq>]`: jobs that only wait for the first poll slot.
    pub fn monitor_wait_prefix(seq: i64) -> String {
        prefix(MONITOR_WAIT, seq)
    }

    /// The marker of the `n`-th (1-based) wait before the first poll slot.
    pub fn monitor_wait(seq: i64, n: u32) -> String {
        format!("{} n={n}", monitor_wait_prefix(seq))
    }

    /// `[orch:monitor-end seq=<seq>]`: the job that ends visit `seq`'s watch.
    pub fn monitor_end(seq: i64) -> String {
        prefix(MONITOR_END, seq)
    }

    /// `[orch:release-wait seq=<seq>]`.
    pub fn release_wait(seq: i64) -> String {
        prefix(RELEASE_WAIT, seq)
    }

    /// `[orch:release-hold seq=<seq>]`.
    pub fn release_hold(seq: i64) -> String {
        prefix(RELEASE_HOLD, seq)
    }

    /// `[orch:forge-wait seq=<seq>]`.
    pub fn forge_wait(seq: i64) -> String {
        prefix(FORGE_WAIT, seq)
    }

    /// True when a job's content carries a release-track wait marker (of any visit).
    pub fn is_release_wait(task_content: &str) -> bool {
        parse(task_content).iter().any(|m| m.name == RELEASE_WAIT)
    }

    /// One marker read back from a job's content.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Marker {
        /// One of the names above (an unknown name is not a marker).
        pub name: &'static str,
        /// The stage visit.
        pub seq: i64,
        /// The number after `]` (` n=` or ` tick=`), when there is one.
        pub n: Option<u32>,
    }

    /// The markers of a job's content: its lines (after the payload) of the form
    /// `[orch:<name> seq=<seq>]` with an optional ` n=<n>`/` tick=<n>`. Anything else is
    /// skipped.
    pub fn parse(task_content: &str) -> Vec<Marker> {
        task_content.lines().filter_map(parse_line).collect()
    }

    /// How every marker line starts.
    pub const PREFIX: &str = "[orch:";

    fn parse_line(line: &str) -> Option<Marker> {
        let rest = line.trim().strip_prefix(PREFIX)?;
        let (name, rest) = rest.split_once(" seq=")?;
        let name = *ALL.iter().find(|n| **n == name)?;
        let (seq, tail) = rest.split_once(']')?;
        let seq = seq.parse().ok()?;
        let n = match tail.trim() {
            "" => None,
            t => {
                let (_, v) = t.split_once('=')?;
                Some(v.parse().ok()?)
            }
        };
        Some(Marker { name, seq, n })
    }
}

/// Job kinds orch enqueues besides the stages' own (a stage's kind is its agent's name).
pub mod jobs {
    /// The job every terminal stage change enqueues, in the same transaction: it sends the
    /// outcome's notification and publishes the item's trail on the default branch. Its
    /// content is `{"task": <id>, "seq": <stage_seq>}`.
    pub const TASK_ENDED: &str = "task-ended";
    /// One notification's delivery to the repo's webhook, retried with backoff. Its content is
    /// the notification document.
    pub const NOTIFY: &str = "notify";
    /// An issue a forge's webhook delivered: it creates the issue's work item (once; the
    /// poll may create it first). Its content is `{"repo", "via", "issue": {number, title,
    /// body, html_url}}`.
    pub const FORGE_ISSUE: &str = "forge-issue";
    /// The forge sync of an item that came from a forge's issue: its pull request, statuses
    /// and description (`{"what": "sync", "task", "through"}`), one review acted on (`{"what":
    /// "review", "task", "pull", "review": {...}}`) or its outcome said (`{"what": "outcome",
    /// "task", "seq"}`). Task-less: a forge that does not answer never fails an item.
    pub const FORGE_SYNC: &str = "forge-sync";
}

/// Dedupe keys: a key is unique forever in `jobs`, so enqueueing under the same key twice (a
/// retry after a crash between two steps) finds the first job instead of adding a second.
pub mod dedupe {
    /// The key of the job that starts visit `stage_seq` of task `task_id`'s current stage
    /// (`stage:<task>:<seq>`): the store gives it to a next job that has none.
    pub fn stage_job(task_id: i64, stage_seq: i64) -> String {
        format!("stage:{task_id}:{stage_seq}")
    }

    /// The key of the follow-up job a requeue of job `job_id` enqueues
    /// (`requeue-of:<job>`): one follow-up per job, however often the requeue is retried.
    pub fn requeue_of(job_id: i64) -> String {
        format!("requeue-of:{job_id}")
    }

    /// The key of the [`super::jobs::TASK_ENDED`] job of task `task_id` reaching a terminal
    /// stage as visit `stage_seq` (`task-ended:<task>:<seq>`).
    pub fn task_ended(task_id: i64, stage_seq: i64) -> String {
        format!("task-ended:{task_id}:{stage_seq}")
    }

    /// The key of a follow-up of a task-ended job that waits for the release track
    /// (`task-ended:<task>:<seq>:<n>`).
    pub fn task_ended_wait(task_id: i64, stage_seq: i64, n: u32) -> String {
        format!("task-ended:{task_id}:{stage_seq}:{n}")
    }

    /// The key of the [`super::jobs::NOTIFY`] job delivering the notification about event
    /// `event_id` (`notify:<event>`): one delivery job per event, however often it is asked for.
    pub fn notify(event_id: i64) -> String {
        format!("notify:{event_id}")
    }

    /// The key of the [`super::jobs::FORGE_ISSUE`] job of a webhook delivery to repo `repo`
    /// whose signed body is `delivery` (its HMAC, `forge-delivery:<repo>:<hmac>`): a delivery
    /// sent twice, or replayed under another delivery id, is taken once.
    pub fn forge_delivery(repo: &str, delivery: &str) -> String {
        format!("forge-delivery:{repo}:{delivery}")
    }

    /// The key of the [`super::jobs::FORGE_SYNC`] job that brings task `task_id`'s forge up to
    /// its event `through` (`forge-sync:<task>:<through>`): one sync per new event, whichever
    /// process notices it.
    pub fn forge_sync(task_id: i64, through: i64) -> String {
        format!("forge-sync:{task_id}:{through}")
    }

    /// The key of the [`super::jobs::FORGE_SYNC`] job that acts on review `review` of pull
    /// request `pull` of the forge repository `forge` (`forge-review:<owner/name>:<pull>:<review>`):
    /// a review is acted on once.
    pub fn forge_review(forge: &str, pull: u64, review: u64) -> String {
        format!("forge-review:{forge}:{pull}:{review}")
    }

    /// The key of the [`super::jobs::FORGE_SYNC`] job that says task `task_id`'s outcome on
    /// the forge when it ended as visit `stage_seq` (`forge-outcome:<task>:<seq>`).
    pub fn forge_outcome(task_id: i64, stage_seq: i64) -> String {
        format!("forge-outcome:{task_id}:{stage_seq}")
    }

    /// A dedupe key orch wrote, read back.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Key {
        /// [`stage_job`].
        StageJob {
            /// The task.
            task_id: i64,
            /// Its stage visit.
            stage_seq: i64,
        },
        /// [`requeue_of`].
        RequeueOf {
            /// The requeued job.
            job_id: i64,
        },
    }

    /// Reads a key of one of the formats above; `None` for any other key.
    pub fn parse(key: &str) -> Option<Key> {
        if let Some(job) = key.strip_prefix("requeue-of:") {
            return Some(Key::RequeueOf {
                job_id: job.parse().ok()?,
            });
        }
        let (task, seq) = key.strip_prefix("stage:")?.split_once(':')?;
        Some(Key::StageJob {
            task_id: task.parse().ok()?,
            stage_seq: seq.parse().ok()?,
        })
    }
}

/// Who made an operator call (submit, approve, retry, cancel, a hold's release). The event of
/// the call says it in its text ([`Actor::describe`]) and keeps it in its data under [`KEY`]
/// ([`Actor::data`]), so "cancelled by an operator" cannot hide a call made with a stolen
/// token from another process.
pub mod actor {
    use serde_json::{Value, json};

    /// The event data key that holds the caller.
    pub const KEY: &str = "by";
    /// `via` of a call through the HTTP API (with the bearer token).
    pub const VIA_API: &str = "api";
    /// `via` of a call of the CLI on this machine (which works on the database directly).
    pub const VIA_CLI: &str = "cli";
    /// `via` of a call orch made itself (the demo's scripted requests).
    pub const VIA_ORCH: &str = "orch";
    /// The most characters of a client-supplied value (User-Agent) kept.
    pub const MAX_CLIENT_TEXT: usize = 200;

    /// Who made a call.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Actor {
        /// An HTTP client that presented the operator token.
        Api {
            /// The TCP peer (`127.0.0.1:40112`); `None` when the server could not tell.
            peer: Option<String>,
            /// The `User-Agent` header as the client sent it (escaped, bounded).
            user_agent: Option<String>,
        },
        /// `orch <command>` run by a user of this machine.
        Cli {
            /// The OS user name, when it could be looked up.
            user: Option<String>,
            /// The OS user id.
            uid: u32,
        },
        /// orch itself, for `what` (`the demo`).
        Orch {
            /// What made the call.
            what: String,
        },
    }

    impl Actor {
        /// An API caller; the client-supplied text is escaped ([`crate::text::escape`]) and
        /// cut to [`MAX_CLIENT_TEXT`] characters, so it reads as sent and cannot act on a
        /// terminal or a page.
        pub fn api(peer: Option<String>, user_agent: Option<&str>) -> Actor {
            let user_agent = user_agent.map(|ua| {
                let shown = crate::text::escape(ua);
                match shown.chars().count() > MAX_CLIENT_TEXT {
                    true => shown.chars().take(MAX_CLIENT_TEXT).chain(['…']).collect(),
                    false => shown,
                }
            });
            Actor::Api { peer, user_agent }
        }

        /// Who, in words that follow a verb: `via the API from 127.0.0.1:40112 with the
        /// operator token (User-Agent "curl/8.5.0")`, `via the CLI by user alice (uid 1000)`,
        /// `by orch (the demo)`.
        pub fn describe(&self) -> String {
            match self {
                Actor::Api { peer, user_agent } => {
                    let from = peer.as_deref().unwrap_or("an unknown address");
                    let ua = match user_agent {
                        Some(ua) => format!("User-Agent \"{ua}\""),
                        None => "no User-Agent".to_owned(),
                    };
                    format!("via the API from {from} with the operator token ({ua})")
                }
                Actor::Cli {
                    user: Some(user),
                    uid,
                } => format!(
                    "via the CLI by user {} (uid {uid})",
                    crate::text::escape(user)
                ),
                Actor::Cli { user: None, uid } => format!("via the CLI by uid {uid}"),
                Actor::Orch { what } => format!("by orch ({what})"),
            }
        }

        /// The caller as the event data's [`KEY`] value: `{via, peer, user_agent}`,
        /// `{via, user, uid}` or `{via, what}`.
        pub fn data(&self) -> Value {
            match self {
                Actor::Api { peer, user_agent } => {
                    json!({"via": VIA_API, "peer": peer, "user_agent": user_agent})
                }
                Actor::Cli { user, uid } => json!({"via": VIA_CLI, "user": user, "uid": uid}),
                Actor::Orch { what } => json!({"via": VIA_ORCH, "what": what}),
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn each_caller_is_named_in_words_and_data() {
            let cases = [
                (
                    Actor::api(Some("127.0.0.1:4011".into()), Some("curl/8.5")),
                    "via the API from 127.0.0.1:4011 with the operator token (User-Agent \"curl/8.5\")",
                    json!({"via": "api", "peer": "127.0.0.1:4011", "user_agent": "curl/8.5"}),
                ),
                (
                    Actor::api(None, Some("x\u{1b}]0;title\u{7}")),
                    "via the API from an unknown address with the operator token (User-Agent \"x\\u{1b}]0;title\\u{7}\")",
                    json!({"via": "api", "peer": null, "user_agent": "x\\u{1b}]0;title\\u{7}"}),
                ),
                (
                    Actor::Cli {
                        user: Some("alice".into()),
                        uid: 1000,
                    },
                    "via the CLI by user alice (uid 1000)",
                    json!({"via": "cli", "user": "alice", "uid": 1000}),
                ),
                (
                    Actor::Cli { user: None, uid: 7 },
                    "via the CLI by uid 7",
                    json!({"via": "cli", "user": null, "uid": 7}),
                ),
                (
                    Actor::Orch {
                        what: "the demo".into(),
                    },
                    "by orch (the demo)",
                    json!({"via": "orch", "what": "the demo"}),
                ),
            ];
            for (actor, words, data) in cases {
                assert_eq!(actor.describe(), words);
                assert_eq!(actor.data(), data);
            }
            let long = "u".repeat(500);
            let Actor::Api {
                user_agent: Some(ua),
                ..
            } = Actor::api(None, Some(&long))
            else {
                panic!("an API actor");
            };
            assert_eq!(ua.chars().count(), MAX_CLIENT_TEXT + 1);
        }
    }
}

/// How many times a task was sent back (its loop count, what `decide` bounds by `max_loops`):
/// the number of its `stage.loop_back` events among `kinds` (its events' kinds, any order).
/// The engine and the dashboard both count with this.
pub fn loops_used<'a>(kinds: impl IntoIterator<Item = &'a str>) -> u32 {
    let n = kinds
        .into_iter()
        .filter(|k| *k == events::STAGE_LOOP_BACK)
        .count();
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_stages_and_their_events() {
        assert!(TERMINAL_STAGES.iter().all(|s| is_terminal_stage(s)));
        assert!(!is_terminal_stage("review"));
        assert!(!is_terminal_stage("Done"), "stages are exact words");
        assert_eq!(terminal_event(DONE), Some("task.done"));
        assert_eq!(terminal_event(FAILED), Some("task.failed"));
        assert_eq!(terminal_event(CANCELLED), Some("task.cancelled"));
        assert_eq!(terminal_event("review"), None);
    }

    #[test]
    fn event_kinds_are_distinct_and_shaped_as_stored() {
        let mut seen = std::collections::HashSet::new();
        for k in events::ALL {
            assert!(seen.insert(*k), "{k} twice");
            let (group, name) = k.split_once('.').unwrap();
            assert!(
                !group.is_empty()
                    && !name.is_empty()
                    && k.chars()
                        .all(|c| c.is_ascii_lowercase() || c == '_' || c == '.'),
                "{k}"
            );
        }
        // Complete: every dotted constant of this file (what crates/tidy reads as the known
        // kinds) is listed.
        let source = include_str!("control.rs");
        let defined: Vec<&str> = source
            .lines()
            .filter_map(|l| {
                l.trim()
                    .strip_prefix("pub const ")?
                    .split_once(": &str = \"")
            })
            .filter_map(|(_, v)| v.strip_suffix("\";"))
            .filter(|v| v.contains('.'))
            .collect();
        assert_eq!(defined.len(), events::ALL.len(), "{defined:?}");
        assert!(defined.iter().all(|k| events::ALL.contains(k)));
        // A few contracts spelled out: rows in existing databases carry these.
        assert_eq!(events::JOB_RESCUED, "job.rescued");
        assert_eq!(events::RELEASE_WAITING, "release.waiting");
        assert_eq!(events::DEPLOY_REDEPLOYED, "deploy.redeployed");
        assert_eq!(events::POST_DEPLOY_VERDICT, "post_deploy.verdict");
    }

    #[test]
    fn markers_keep_their_formats_and_parse_back() {
        assert_eq!(
            markers::staging_defer(7),
            "[orch:staging-tool-error-defer seq=7]"
        );
        assert_eq!(
            markers::merge_infra_retry(7),
            "[orch:merge-infra-retry seq=7]"
        );
        assert_eq!(
            markers::deploy_finalize(3, 2),
            "[orch:deploy-finalize seq=3] n=2"
        );
        assert_eq!(
            markers::monitor_tick(3, 5),
            "[orch:monitor-tick seq=3] tick=5"
        );
        assert_eq!(markers::monitor_wait(3, 1), "[orch:monitor-wait seq=3] n=1");
        assert_eq!(markers::release_wait(9), "[orch:release-wait seq=9]");
        assert_eq!(markers::release_hold(9), "[orch:release-hold seq=9]");
        assert_eq!(
            markers::start(markers::STAGING_DEFER),
            "[orch:staging-tool-error-defer"
        );
        // A visit's prefix never matches inside another visit's.
        assert!(!markers::monitor_tick(12, 1).contains(&markers::monitor_tick_prefix(1)));

        let content = format!(
            "{{\"stage\":\"observe\",\"seq\":3}}\n{}\n{}\nnot a marker\n[orch:unknown seq=1]",
            markers::monitor_tick(3, 5),
            markers::release_wait(3)
        );
        let got = markers::parse(&content);
        assert_eq!(
            got,
            [
                markers::Marker {
                    name: markers::MONITOR_TICK,
                    seq: 3,
                    n: Some(5)
                },
                markers::Marker {
                    name: markers::RELEASE_WAIT,
                    seq: 3,
                    n: None
                },
            ]
        );
        for name in markers::ALL {
            let m = &markers::parse(&markers::prefix(name, 4))[0];
            assert_eq!((m.name, m.seq, m.n), (name, 4, None));
        }
        assert!(markers::is_release_wait(&content));
        assert!(!markers::is_release_wait(&markers::release_hold(3)));
        assert!(markers::parse("[orch:release-wait seq=x]").is_empty());
    }

    #[test]
    fn dedupe_keys_keep_their_formats_and_parse_back() {
        assert_eq!(dedupe::stage_job(7, 3), "stage:7:3");
        assert_eq!(dedupe::requeue_of(42), "requeue-of:42");
        assert_eq!(
            dedupe::parse(&dedupe::stage_job(7, 3)),
            Some(dedupe::Key::StageJob {
                task_id: 7,
                stage_seq: 3
            })
        );
        assert_eq!(
            dedupe::parse(&dedupe::requeue_of(42)),
            Some(dedupe::Key::RequeueOf { job_id: 42 })
        );
        for other in ["stage:7", "stage:a:1", "requeue-of:", "bench-1", ""] {
            assert_eq!(dedupe::parse(other), None, "{other}");
        }
    }

    #[test]
    fn the_loop_count_is_the_number_of_loop_backs() {
        assert_eq!(loops_used([]), 0);
        let kinds = [
            events::TASK_SUBMITTED,
            events::STAGE_ADVANCED,
            events::STAGE_LOOP_BACK,
            events::STAGE_REQUEUED,
            events::STAGE_ADVANCED,
            events::STAGE_LOOP_BACK,
            events::TASK_FAILED,
        ];
        assert_eq!(loops_used(kinds), 2);
    }
}
