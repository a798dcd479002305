CREATE TABLE agent_runs (
    id            INTEGER PRIMARY KEY,
    task_id       INTEGER NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    job_id        INTEGER,
    stage         TEXT    NOT NULL,
    agent         TEXT    NOT NULL,
    backend       TEXT    NOT NULL,
    model         TEXT,
    attempt       INTEGER NOT NULL DEFAULT 1,
    started_at    INTEGER NOT NULL,
    finished_at   INTEGER,
    outcome       TEXT    NOT NULL DEFAULT 'running',
    exit_code     INTEGER,
    input_tokens  INTEGER,
    output_tokens INTEGER,
    cost_usd      REAL,
    error         TEXT,
    data          TEXT    NOT NULL DEFAULT '{}'
);
CREATE TABLE events (
    id         INTEGER PRIMARY KEY,
    task_id    INTEGER REFERENCES tasks (id) ON DELETE CASCADE,
    job_id     INTEGER,
    kind       TEXT    NOT NULL,
    stage      TEXT,
    message    TEXT    NOT NULL DEFAULT '',
    data       TEXT    NOT NULL DEFAULT '{}',
    created_at INTEGER NOT NULL
);
CREATE TABLE jobs (
    id               INTEGER PRIMARY KEY,
    task_id          INTEGER REFERENCES tasks (id) ON DELETE CASCADE,
    agent            TEXT    NOT NULL,
    task_content     TEXT    NOT NULL DEFAULT '',
    state            TEXT    NOT NULL DEFAULT 'queued'
                     CHECK (state IN ('queued', 'running', 'done', 'failed', 'cancelled')),
    priority         INTEGER NOT NULL DEFAULT 0,
    attempt          INTEGER NOT NULL DEFAULT 0,
    max_attempts     INTEGER NOT NULL DEFAULT 3 CHECK (max_attempts >= 1),
    available_at     INTEGER NOT NULL,
    lease_expires_at INTEGER,
    locked_by        TEXT,
    dedupe_key       TEXT,
    node             TEXT,
    last_error       TEXT,
    created_at       INTEGER NOT NULL,
    started_at       INTEGER,
    finished_at      INTEGER
);
CREATE TABLE tasks (
    id           INTEGER PRIMARY KEY,
    work_item_id TEXT    NOT NULL UNIQUE,
    repo         TEXT    NOT NULL,
    title        TEXT    NOT NULL,
    body         TEXT    NOT NULL DEFAULT '',
    -- The stage is the status; 'done', 'failed', 'cancelled' are terminal.
    stage        TEXT    NOT NULL,
    -- Bumped by every stage change (advance_stage): identifies a stage visit.
    stage_seq    INTEGER NOT NULL DEFAULT 0,
    branch       TEXT    NOT NULL,
    created_at   INTEGER NOT NULL,
    updated_at   INTEGER NOT NULL
);
CREATE INDEX agent_runs_task ON agent_runs (task_id, id);
CREATE INDEX events_kind ON events (kind, id);
CREATE INDEX events_task ON events (task_id, id);
CREATE INDEX jobs_active ON jobs (state, agent) WHERE state IN ('queued', 'running');
CREATE UNIQUE INDEX jobs_dedupe ON jobs (dedupe_key) WHERE dedupe_key IS NOT NULL;
CREATE INDEX jobs_finished ON jobs (finished_at) WHERE state IN ('done', 'failed', 'cancelled');
CREATE INDEX jobs_leases ON jobs (lease_expires_at) WHERE state = 'running';
CREATE INDEX jobs_queued_at ON jobs (available_at) WHERE state = 'queued';
CREATE INDEX jobs_ready ON jobs (priority DESC, available_at, id) WHERE state = 'queued';
CREATE INDEX jobs_state_agent ON jobs (state, agent);
CREATE INDEX jobs_task ON jobs (task_id, agent);
CREATE INDEX tasks_ended ON tasks (updated_at, id) WHERE stage IN ('done', 'failed', 'cancelled');
CREATE INDEX tasks_live ON tasks (stage, repo) WHERE stage NOT IN ('done', 'failed', 'cancelled');
CREATE INDEX tasks_repo ON tasks (repo, stage, id);
CREATE INDEX tasks_stage ON tasks (stage, id);
