column agent_runs.id bigint null=NO default=serial
column agent_runs.task_id bigint null=NO default=
column agent_runs.job_id bigint null=YES default=
column agent_runs.stage text null=NO default=
column agent_runs.agent text null=NO default=
column agent_runs.backend text null=NO default=
column agent_runs.model text null=YES default=
column agent_runs.attempt bigint null=NO default=1
column agent_runs.started_at bigint null=NO default=
column agent_runs.finished_at bigint null=YES default=
column agent_runs.outcome text null=NO default='running'::text
column agent_runs.exit_code bigint null=YES default=
column agent_runs.input_tokens bigint null=YES default=
column agent_runs.output_tokens bigint null=YES default=
column agent_runs.cost_usd double precision null=YES default=
column agent_runs.error text null=YES default=
column agent_runs.data text null=NO default='{}'::text
column events.id bigint null=NO default=serial
column events.task_id bigint null=YES default=
column events.job_id bigint null=YES default=
column events.kind text null=NO default=
column events.stage text null=YES default=
column events.message text null=NO default=''::text
column events.data text null=NO default='{}'::text
column events.created_at bigint null=NO default=
column jobs.id bigint null=NO default=serial
column jobs.task_id bigint null=YES default=
column jobs.agent text null=NO default=
column jobs.task_content text null=NO default=''::text
column jobs.state text null=NO default='queued'::text
column jobs.priority bigint null=NO default=0
column jobs.attempt bigint null=NO default=0
column jobs.max_attempts bigint null=NO default=3
column jobs.available_at bigint null=NO default=
column jobs.lease_expires_at bigint null=YES default=
column jobs.locked_by text null=YES default=
column jobs.dedupe_key text null=YES default=
column jobs.node text null=YES default=
column jobs.last_error text null=YES default=
column jobs.created_at bigint null=NO default=
column jobs.started_at bigint null=YES default=
column jobs.finished_at bigint null=YES default=
column tasks.id bigint null=NO default=serial
column tasks.work_item_id text null=NO default=
column tasks.repo text null=NO default=
column tasks.title text null=NO default=
column tasks.body text null=NO default=''::text
column tasks.stage text null=NO default=
column tasks.stage_seq bigint null=NO default=0
column tasks.branch text null=NO default=
column tasks.created_at bigint null=NO default=
column tasks.updated_at bigint null=NO default=
CREATE UNIQUE INDEX agent_runs_pkey ON agent_runs USING btree (id)
CREATE INDEX agent_runs_task ON agent_runs USING btree (task_id, id)
CREATE INDEX events_kind ON events USING btree (kind, id)
CREATE UNIQUE INDEX events_pkey ON events USING btree (id)
CREATE INDEX events_task ON events USING btree (task_id, id)
CREATE INDEX jobs_active ON jobs USING btree (state, agent) WHERE (state = ANY (ARRAY['queued'::text, 'running'::text]))
CREATE UNIQUE INDEX jobs_dedupe ON jobs USING btree (dedupe_key) WHERE (dedupe_key IS NOT NULL)
CREATE INDEX jobs_finished ON jobs USING btree (finished_at) WHERE (state = ANY (ARRAY['done'::text, 'failed'::text, 'cancelled'::text]))
CREATE INDEX jobs_leases ON jobs USING btree (lease_expires_at) WHERE (state = 'running'::text)
CREATE UNIQUE INDEX jobs_pkey ON jobs USING btree (id)
CREATE INDEX jobs_queued_at ON jobs USING btree (available_at) WHERE (state = 'queued'::text)
CREATE INDEX jobs_ready ON jobs USING btree (priority DESC, available_at, id) WHERE (state = 'queued'::text)
CREATE INDEX jobs_state_agent ON jobs USING btree (state, agent)
CREATE INDEX jobs_task ON jobs USING btree (task_id, agent)
CREATE INDEX tasks_ended ON tasks USING btree (updated_at, id) WHERE (stage = ANY (ARRAY['done'::text, 'failed'::text, 'cancelled'::text]))
CREATE INDEX tasks_live ON tasks USING btree (stage, repo) WHERE (stage <> ALL (ARRAY['done'::text, 'failed'::text, 'cancelled'::text]))
CREATE UNIQUE INDEX tasks_pkey ON tasks USING btree (id)
CREATE INDEX tasks_repo ON tasks USING btree (repo, stage, id)
CREATE INDEX tasks_stage ON tasks USING btree (stage, id)
CREATE UNIQUE INDEX tasks_work_item_id_key ON tasks USING btree (work_item_id)
