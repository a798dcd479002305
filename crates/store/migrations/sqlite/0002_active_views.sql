-- orch schema 2 (SQLite): indexes on the active part of the tables, so that the control views
-- (GET /queue, /metrics, the dashboard's home page, orch status) cost what is queued, running,
-- recently finished or live, not the whole history. No table, no column: still four tables.
-- Each index's WHERE is written exactly as the views' queries write it (SQLite uses a partial
-- index only when the query's WHERE names its condition).

-- Queued and running jobs by state and agent (the view's exact counts).
CREATE INDEX jobs_active ON jobs (state, agent) WHERE state IN ('queued', 'running');
-- Live tasks (not at a terminal stage) by stage: the view's exact counts of live tasks.
CREATE INDEX tasks_live ON tasks (stage, repo) WHERE stage NOT IN ('done', 'failed', 'cancelled');
-- Ended tasks by when they ended (their last stage change): the view counts those of a recent
-- window, and the outcome counts read only them.
CREATE INDEX tasks_ended ON tasks (updated_at, id) WHERE stage IN ('done', 'failed', 'cancelled');
-- Queued jobs by when they become ready: the oldest ready job is the index's first entry, one
-- probe instead of a read of every queued row (jobs_ready leads with the priority).
CREATE INDEX jobs_queued_at ON jobs (available_at) WHERE state = 'queued';
