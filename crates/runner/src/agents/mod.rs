//! The executor of LLM stages (design.md §4): it runs the stage's agent backend in the work item's
//! worktree with a prompt built from the role template, the work item, the artifacts so far
//! and the repo's lessons, and reports whether the expected artifact(s) were written. The
//! engine commits and gates them; this module never touches git history or the stage.
//!
//! One attempt, in order: the stage's `[agents.<name>]` (missing → the stage fails for good);
//! the work item's token/cost budget (spent → fails for good, before anything starts); the
//! prompt; then up to [`RetryPolicy::tries`] tries, each holding one of the process-wide
//! agent slots and recorded as its own `agent_runs` row, with exponential backoff between
//! tries that failed transiently (rate limits, overload, 5xx, connection refused), with
//! jitter. A permanent failure (the program is missing, authentication, a bad request, the
//! turn limit, a denied write or command, bad configuration) fails the stage at once with the
//! CLI's own message (`StageEffect::Failed`: no retry at full cost). Any other failure ends
//! the attempt with an `Err` (the job is retried as a new attempt). A try whose agent
//! succeeded but left an expected artifact missing (or untouched since before it ran) fails
//! the attempt with a reason naming the file.
//!
//! Usage: tokens and cost as the tool reported them; tokens priced by the agent's `price`
//! (from `[prices]`) when the tool reports no cost; a run whose tokens or cost are unknown
//! is marked so in its row (`data.usage_unknown`, `data.cost_unknown`), never recorded as
//! zero, and the budget check counts it as `unknown_run_cost_usd` / `unknown_run_tokens`
//! (unset: the whole budget, so no further run starts). Every permission denial a CLI
//! reports is kept in the run's row and appended as an `agent.permission_denied` event.
//!
//! Invariants: every `agent_runs` row that is started is finished (also on errors, timeouts,
//! cancellation, and when the attempt's future is dropped); a hung agent is killed with its
//! whole process group at the timeout; API keys are read from the environment at the moment
//! of use and never logged, stored or put in an error.

mod command;
mod files;
mod openai;
mod prompt;
mod resume;
pub mod transcript;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::anyhow;
use orch_domain::config::{AgentConfig, Backend, Settings};
use orch_domain::gate::ArtifactPattern;
use orch_domain::ids::{AgentName, ArtifactName};
use orch_store::{AgentRunFinish, NewAgentRun, Store, StoreError};
use tokio::sync::Semaphore;

use crate::engine::{StageEffect, StageExecutor, StageRun};
use prompt::{Delivery, PromptInput};

/// Transient-failure retries within one attempt: `tries` in all, waiting `base`, `2·base`,
/// `4·base`, … (at most `max`, or longer when the backend asked for it) between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Tries per attempt, at least 1.
    pub tries: u32,
    /// The wait after the first failed try.
    pub base: Duration,
    /// The longest wait.
    pub max: Duration,
}

impl Default for RetryPolicy {
    /// 3 tries, waiting 1 s then 2 s, never more than 60 s.
    fn default() -> RetryPolicy {
        RetryPolicy {
            tries: 3,
            base: Duration::from_secs(1),
            max: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// The wait after failed try `try_no` (1-based), honouring a backend's `retry_after`
    /// up to `max`.
    fn backoff(&self, try_no: u32, retry_after: Option<Duration>) -> Duration {
        let exp = self
            .base
            .saturating_mul(1u32 << try_no.saturating_sub(1).min(20));
        exp.max(retry_after.unwrap_or_default()).min(self.max)
    }
}

/// Why an agent attempt failed (the message names the agent and what to look at).
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The agent succeeded but an expected artifact is not there.
    #[error("agent {agent} {finished} without writing {}", paths.join(", "))]
    MissingArtifact {
        /// The agent.
        agent: AgentName,
        /// `exited 0` or `replied`.
        finished: &'static str,
        /// The missing files, relative to the worktree root.
        paths: Vec<String>,
    },
    /// The agent succeeded but left an expected artifact exactly as an earlier visit wrote it.
    #[error("agent {agent} exited 0 without updating {} (unchanged since before the run)", paths.join(", "))]
    UnchangedArtifact {
        /// The agent.
        agent: AgentName,
        /// The untouched files, relative to the worktree root.
        paths: Vec<String>,
    },
    /// The run hit its wall-clock timeout; its process group was killed.
    #[error("agent {agent} timed out after {secs}s; its whole process group was killed")]
    TimedOut {
        /// The agent.
        agent: AgentName,
        /// The timeout.
        secs: u64,
    },
    /// The job's lease was lost or orch is stopping.
    #[error("agent {agent} was cancelled (the job's lease was lost or orch is stopping)")]
    Cancelled {
        /// The agent.
        agent: AgentName,
    },
    /// The backend failed in a way retrying within the attempt will not fix.
    #[error("agent {agent} ({backend}): {message}")]
    Backend {
        /// The agent.
        agent: AgentName,
        /// The backend kind.
        backend: &'static str,
        /// What went wrong, with the output's tail when there is one.
        message: String,
    },
    /// The CLI refused a write, an edit or a command the agent needed.
    #[error(
        "agent {agent} was denied {denied}; allow it with `allowed_tools` in [agents.{agent}] if the role needs it"
    )]
    PermissionDenied {
        /// The agent.
        agent: AgentName,
        /// The denied actions.
        denied: String,
    },
    /// Every try failed transiently.
    #[error("agent {agent} ({backend}): still failing after {tries} tries; last error: {last}")]
    Transient {
        /// The agent.
        agent: AgentName,
        /// The backend kind.
        backend: &'static str,
        /// Tries made.
        tries: u32,
        /// The last try's error.
        last: String,
    },
    /// The store could not record or check the run.
    #[error("agent {agent}: {what}: {source}")]
    Store {
        /// The agent.
        agent: AgentName,
        /// What was being done.
        what: &'static str,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// A file or directory the run needs could not be prepared.
    #[error("agent {agent}: {}: {source}", path.display())]
    Io {
        /// The agent.
        agent: AgentName,
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Runs the LLM stages (`analysis`, `architecture`, `implementation`, `review`, or any stage
/// of kind LLM) through their configured agent backends. Clones share one set of agent slots
/// (`settings.agent_concurrency` runs at once in this process).
#[derive(Clone)]
pub struct AgentExecutor {
    inner: Arc<Inner>,
}

struct Inner {
    agents: BTreeMap<AgentName, AgentConfig>,
    settings: Settings,
    slots: Arc<Semaphore>,
    retry: RetryPolicy,
    http: OnceLock<Result<reqwest::Client, String>>,
}

impl AgentExecutor {
    /// An executor for the `[agents]` of the configuration. Budgets, the default timeout and
    /// the concurrency limit come from `settings` (not from each run's copy).
    pub fn new(agents: BTreeMap<AgentName, AgentConfig>, settings: &Settings) -> AgentExecutor {
        let permits = usize::try_from(settings.agent_concurrency.max(1)).unwrap_or(1);
        AgentExecutor {
            inner: Arc::new(Inner {
                agents,
                settings: settings.clone(),
                slots: Arc::new(Semaphore::new(permits)),
                retry: RetryPolicy::default(),
                http: OnceLock::new(),
            }),
        }
    }

    /// The same executor with another retry policy (tests use millisecond waits).
    pub fn with_retry(self, retry: RetryPolicy) -> AgentExecutor {
        let inner = Inner {
            agents: self.inner.agents.clone(),
            settings: self.inner.settings.clone(),
            slots: self.inner.slots.clone(),
            retry,
            http: OnceLock::new(),
        };
        AgentExecutor {
            inner: Arc::new(inner),
        }
    }

    /// The HTTP client of the `openai` backend, built on first use.
    fn http(&self) -> Result<&reqwest::Client, String> {
        self.inner
            .http
            .get_or_init(|| {
                // reqwest is built without a crypto provider; pick ring unless the process
                // already chose one (a no-op then).
                if rustls::crypto::CryptoProvider::get_default().is_none() {
                    let _ = rustls::crypto::ring::default_provider().install_default();
                }
                reqwest::Client::builder()
                    .build()
                    .map_err(|e| format!("cannot build the HTTP client: {e}"))
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

#[async_trait::async_trait]
impl StageExecutor for AgentExecutor {
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect> {
        let stage = &run.stage.name;
        let Some(agent) = run.stage.agent.as_ref() else {
            return Ok(StageEffect::Failed {
                reason: format!("stage `{stage}` is an LLM stage but names no agent"),
            });
        };
        let Some(config) = self.inner.agents.get(agent) else {
            return Ok(StageEffect::Failed {
                reason: format!(
                    "stage `{stage}` uses agent `{agent}`, but orch.toml has no [agents.{agent}] \
                     section; add one (e.g. `backend = \"claude\"`) and retry the work item"
                ),
            });
        };
        if let Some(reason) = self.over_budget(run, agent).await? {
            return Ok(StageEffect::Failed { reason });
        }
        let default_timeout_s = self.inner.settings.agent_timeout_s;
        let prepared = Prepared::new(run, agent, config, default_timeout_s).await?;
        let policy = self.inner.retry;
        let tries = policy.tries.max(1);
        let backend = backend_name(config.backend);
        for try_no in 1..=tries {
            if try_no > 1
                && let Some(reason) = self.over_budget(run, agent).await?
            {
                return Ok(StageEffect::Failed { reason });
            }
            let permit = tokio::select! {
                p = self.inner.slots.clone().acquire_owned() => {
                    p.map_err(|_| anyhow!("agent {agent}: the agent slots are closed"))?
                }
                () = run.cancel.cancelled() => {
                    return Err(AgentError::Cancelled { agent: agent.clone() }.into());
                }
            };
            let result = self.one_try(run, &prepared, try_no, tries).await?;
            drop(permit);
            match result.end {
                TryEnd::Ok => return Ok(StageEffect::Produced { outcome: None }),
                TryEnd::Permanent(e) => {
                    return Ok(StageEffect::Failed {
                        reason: format!("{e} (a permanent error: not retried)"),
                    });
                }
                TryEnd::Transient(message) if try_no < tries => {
                    let wait = jittered(policy.backoff(try_no, result.retry_after));
                    tracing::warn!(
                        %agent, work_item = %run.work_item, try_no, wait_ms = wait.as_millis() as u64,
                        error = %message, "transient agent failure; retrying"
                    );
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = run.cancel.cancelled() => {
                            return Err(AgentError::Cancelled { agent: agent.clone() }.into());
                        }
                    }
                }
                TryEnd::Transient(last) => {
                    return Err(AgentError::Transient {
                        agent: agent.clone(),
                        backend,
                        tries,
                        last,
                    }
                    .into());
                }
                TryEnd::Failed(e) => return Err(e.into()),
            }
        }
        // The loop returns on its last try.
        Err(anyhow!("agent {agent}: no try was made"))
    }
}

impl AgentExecutor {
    /// `Some(reason)` when the work item has spent its token or cost budget. A run whose
    /// tokens or cost are unknown counts as `unknown_run_tokens` / `unknown_run_cost_usd`,
    /// or, when those are unset, as the whole budget.
    async fn over_budget(
        &self,
        run: &StageRun,
        agent: &AgentName,
    ) -> Result<Option<String>, AgentError> {
        let s = &self.inner.settings;
        if s.max_tokens_per_item.is_none() && s.max_cost_usd_per_item.is_none() {
            return Ok(None);
        }
        let runs = run
            .store
            .task_agent_runs(run.task.id)
            .await
            .map_err(|source| AgentError::Store {
                agent: agent.clone(),
                what: "cannot read the work item's usage for the budget check",
                source,
            })?;
        let spent = Spent::of(&runs);
        let id = &run.work_item;
        if let Some(max) = s.max_tokens_per_item {
            let assumed = s.unknown_run_tokens.unwrap_or(max);
            let counted = spent
                .tokens
                .saturating_add(assumed.saturating_mul(spent.unknown_tokens));
            if counted >= max {
                let unknown = if spent.unknown_tokens > 0 {
                    format!(
                        " + {} run(s) of unknown usage counted as {assumed} tokens each \
                         (unknown_run_tokens{})",
                        spent.unknown_tokens,
                        if s.unknown_run_tokens.is_none() {
                            " unset: the whole budget"
                        } else {
                            ""
                        }
                    )
                } else {
                    String::new()
                };
                return Ok(Some(format!(
                    "work item {id} has used its token budget: {} tokens ({} in, {} out, over {} \
                     agent runs){unknown} of max_tokens_per_item = {max}; agent {agent} was not \
                     started",
                    spent.tokens, spent.input, spent.output, spent.runs
                )));
            }
        }
        if let Some(max) = s.max_cost_usd_per_item {
            let assumed = s.unknown_run_cost_usd.unwrap_or(max);
            let counted = spent.cost_usd + assumed * spent.unknown_cost as f64;
            if counted >= max {
                let unknown = if spent.unknown_cost > 0 {
                    format!(
                        " + {} run(s) of unknown cost counted as ${assumed} each \
                         (unknown_run_cost_usd{}; add the model to [prices] to price its tokens)",
                        spent.unknown_cost,
                        if s.unknown_run_cost_usd.is_none() {
                            " unset: the whole budget"
                        } else {
                            ""
                        }
                    )
                } else {
                    String::new()
                };
                return Ok(Some(format!(
                    "work item {id} has used its cost budget: ${:.4} (over {} agent runs){unknown} \
                     of max_cost_usd_per_item = ${max}; agent {agent} was not started",
                    spent.cost_usd, spent.runs
                )));
            }
        }
        Ok(None)
    }

    /// One try: a row, the backend, the artifact check, the row finished.
    async fn one_try(
        &self,
        run: &StageRun,
        p: &Prepared,
        try_no: u32,
        tries: u32,
    ) -> Result<TryResult, AgentError> {
        let agent = &p.agent;
        let row = RunRow::start(
            &run.store,
            NewAgentRun {
                task_id: run.task.id,
                job_id: Some(run.job.id),
                stage: run.stage.name.to_string(),
                agent: agent.to_string(),
                backend: backend_name(p.config.backend).to_owned(),
                model: p.config.model.clone(),
                attempt: run.lease.attempt,
            },
            try_no,
        )
        .await
        .map_err(|source| AgentError::Store {
            agent: agent.clone(),
            what: "cannot record the agent run",
            source,
        })?;
        // The first execution's view when this job adopts an agent run an earlier orch
        // started: its files were written before this process could look at them.
        let before = files::snapshot_once(
            run.job.id,
            try_no,
            files::snapshot(&p.artifact_dir, &p.expected),
        );
        let secrets = self.secrets(run);
        let backend = backend_name(p.config.backend);
        let transcript = match transcript::Transcript::create(
            &run.repos_dir,
            run.work_item.as_str(),
            row.id,
            &secrets,
        ) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(%agent, error = %e, "cannot create the run's transcript file; the run keeps none");
                None
            }
        };
        let inv = Invocation {
            agent,
            config: &p.config,
            run,
            prompt: &p.prompt,
            system: &p.role,
            worktree: &p.worktree,
            artifact_dir: &p.artifact_dir,
            primary: p.primary.as_deref(),
            expected: &p.expected,
            timeout: p.timeout,
            transcript: transcript.as_ref(),
        };
        let mut result = match p.config.backend {
            Backend::Openai => match self.http() {
                Ok(client) => openai::run(&inv, client).await,
                Err(e) => TryResult::failed(AgentError::Backend {
                    agent: agent.clone(),
                    backend: "openai",
                    message: e,
                }),
            },
            _ => command::run(&inv).await,
        };
        if let Some(t) = &transcript {
            let mut meta = t.finish(backend);
            if result.started
                && let Some(diff) = run_diff(run, &p.worktree, &secrets).await
            {
                let rel = transcript::diff_relative_path(run.work_item.as_str(), row.id);
                let written = transcript::create_private(&run.repos_dir.join(&rel))
                    .and_then(|mut f| std::io::Write::write_all(&mut f, diff.as_bytes()));
                match written {
                    Ok(()) => meta["diff"] = rel.into(),
                    Err(e) => tracing::warn!(%agent, error = %e, "cannot keep the run's diff"),
                }
            }
            result.data.insert("transcript".into(), meta);
        }
        result.data.insert("try".into(), try_no.into());
        result.data.insert("tries".into(), tries.into());
        result
            .data
            .insert("role".into(), p.role_source.clone().into());
        result.end = match result.end {
            TryEnd::Ok => self.check_written(run, p, files::unwritten(&p.artifact_dir, &before)),
            other => other,
        };
        self.account(p, &mut result);
        if !result.denials.is_empty() {
            self.record_denials(run, p, &mut result).await;
        }
        let outcome = result.outcome();
        let error = match &result.end {
            TryEnd::Ok => None,
            TryEnd::Transient(m) => Some(m.clone()),
            TryEnd::Failed(e) | TryEnd::Permanent(e) => Some(e.to_string()),
        };
        tracing::info!(
            %agent, work_item = %run.work_item, stage = %run.stage.name, try_no, outcome,
            input_tokens = ?result.usage.input, output_tokens = ?result.usage.output,
            cost_usd = ?result.usage.cost_usd, "agent run finished"
        );
        row.finish(AgentRunFinish {
            outcome: outcome.to_owned(),
            exit_code: result.exit_code,
            input_tokens: result.usage.input,
            output_tokens: result.usage.output,
            cost_usd: result.usage.cost_usd,
            error: error.map(|e| bound_text(&e, MAX_ERROR_BYTES)),
            data: serde_json::Value::Object(result.data.clone()).to_string(),
        })
        .await;
        Ok(result)
    }

    /// Every secret value orch knows, for redaction: each agent's key (the variables their
    /// `api_key_env` name), orch's API token and database URL, and orch's secret variables.
    fn secrets(&self, run: &StageRun) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for c in self.inner.agents.values() {
            if let Some(var) = &c.api_key_env
                && let Ok(v) = std::env::var(var)
            {
                out.push(v);
            }
        }
        for s in [&self.inner.settings, &run.settings] {
            if let Some(t) = &s.token {
                out.push(t.expose().to_owned());
            }
            if let Some(u) = &s.database_url {
                out.push(u.clone());
            }
        }
        for var in orch_domain::net::SECRET_VARS {
            if let Ok(v) = std::env::var(var) {
                out.push(v);
            }
        }
        out.retain(|s| !s.trim().is_empty());
        out
    }

    /// Prices reported tokens when the tool reported no cost, and marks what is unknown.
    fn account(&self, p: &Prepared, result: &mut TryResult) {
        let u = &mut result.usage;
        if !result.started && *u == TokenUsage::default() && !result.usage_unknown {
            // Nothing ran, nothing was spent: zero is known here.
            *u = TokenUsage {
                input: Some(0),
                output: Some(0),
                cost_usd: Some(0.0),
            };
            result
                .data
                .insert("cost_source".into(), "not_started".into());
            return;
        }
        if u.cost_usd.is_some() {
            result.data.insert("cost_source".into(), "reported".into());
        } else if let (Some(input), Some(output), Some(price)) = (u.input, u.output, p.config.price)
        {
            u.cost_usd = Some(price.cost(input, output));
            result
                .data
                .insert("cost_source".into(), "price_table".into());
        }
        if result.usage_unknown {
            result.data.insert("usage_unknown".into(), true.into());
        }
        let ran = result.usage_unknown || u.input.is_some() || u.output.is_some();
        if ran && u.cost_usd.is_none() && p.config.backend != Backend::Command {
            result.data.insert("cost_unknown".into(), true.into());
        }
    }

    /// Keeps the denials in the run's row, appends an `agent.permission_denied` event, and
    /// fails the try for good when a write, an edit or a command was denied.
    async fn record_denials(&self, run: &StageRun, p: &Prepared, result: &mut TryResult) {
        let list: Vec<serde_json::Value> = result
            .denials
            .iter()
            .map(|d| serde_json::json!({"tool": d.tool, "input": d.detail, "required": d.required}))
            .collect();
        result.data.insert(
            "permission_denials".into(),
            serde_json::Value::Array(list.clone()),
        );
        let text = result
            .denials
            .iter()
            .map(|d| format!("{} `{}`", d.tool, d.detail))
            .collect::<Vec<_>>()
            .join(", ");
        let mut event = orch_store::NewEvent::new(
            orch_domain::control::events::AGENT_PERMISSION_DENIED,
            bound_text(
                &format!("agent {} was denied: {text}", p.agent),
                MAX_ERROR_BYTES,
            ),
        );
        event.task_id = Some(run.task.id);
        event.job_id = Some(run.job.id);
        event.stage = Some(run.stage.name.to_string());
        event.data = serde_json::json!({"agent": p.agent.as_str(), "denials": list}).to_string();
        if let Err(e) = run.store.append_event(event).await {
            tracing::warn!(error = %e, "cannot record the agent's permission denials");
        }
        let required: Vec<String> = result
            .denials
            .iter()
            .filter(|d| d.required)
            .map(|d| format!("{} `{}`", d.tool, d.detail))
            .collect();
        let needs_failing = matches!(
            result.end,
            TryEnd::Ok
                | TryEnd::Failed(
                    AgentError::MissingArtifact { .. } | AgentError::UnchangedArtifact { .. }
                )
        );
        if !required.is_empty() && needs_failing {
            result.end = TryEnd::Permanent(AgentError::PermissionDenied {
                agent: p.agent.clone(),
                denied: bound_text(&required.join(", "), MAX_ERROR_BYTES - 200),
            });
        }
    }

    /// `Ok` when every expected artifact was written by this try, else the failure.
    fn check_written(&self, run: &StageRun, p: &Prepared, left: files::Unwritten) -> TryEnd {
        let paths = |names: &[ArtifactName]| -> Vec<String> {
            names
                .iter()
                .map(|n| prompt::rel(&run.work_item, n.as_str()))
                .collect()
        };
        if !left.missing.is_empty() {
            return TryEnd::Failed(AgentError::MissingArtifact {
                agent: p.agent.clone(),
                finished: match p.config.backend {
                    Backend::Openai => "replied",
                    _ => "exited 0",
                },
                paths: paths(&left.missing),
            });
        }
        if !left.unchanged.is_empty() {
            return TryEnd::Failed(AgentError::UnchangedArtifact {
                agent: p.agent.clone(),
                paths: paths(&left.unchanged),
            });
        }
        TryEnd::Ok
    }
}

/// What every try of one attempt shares.
struct Prepared {
    agent: AgentName,
    config: AgentConfig,
    /// The full prompt (CLI backends), or the user message (chat backends).
    prompt: String,
    /// The role template (the system message of chat backends).
    role: String,
    role_source: String,
    worktree: PathBuf,
    artifact_dir: PathBuf,
    /// The stage's first required artifact (`ORCH_ARTIFACT`).
    primary: Option<PathBuf>,
    /// The required artifacts of the stage.
    expected: Vec<ArtifactName>,
    timeout: Duration,
}

impl Prepared {
    async fn new(
        run: &StageRun,
        agent: &AgentName,
        config: &AgentConfig,
        default_timeout_s: u64,
    ) -> Result<Prepared, AgentError> {
        let worktree = prompt::absolute(&run.worktree);
        let artifact_dir = prompt::absolute(&run.artifact_dir);
        tokio::fs::create_dir_all(&artifact_dir)
            .await
            .map_err(|source| AgentError::Io {
                agent: agent.clone(),
                path: artifact_dir.clone(),
                source,
            })?;
        let loaded = {
            let (wt, dir) = (worktree.clone(), artifact_dir.clone());
            let lessons_file = run.repo.lessons_file.clone();
            let (stage, who) = (run.stage.name.clone(), agent.clone());
            tokio::task::spawn_blocking(move || prompt::load(&wt, &dir, &lessons_file, &stage, &who))
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "reading the prompt inputs failed; using the shipped role only");
                prompt::Loaded {
                    role: prompt::shipped_role(&run.stage.name, agent),
                    role_source: "shipped".to_owned(),
                    ..prompt::Loaded::default()
                }
            })
        };
        let changed_files = match run
            .git
            .changed_files_between(&worktree, &run.repo.default_branch, "HEAD")
            .await
        {
            Ok(files) => files,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the branch's changed files; the prompt has none");
                Vec::new()
            }
        };
        let expected: Vec<ArtifactName> = run
            .stage
            .artifacts
            .iter()
            .filter(|s| !s.optional)
            .filter_map(|s| match &s.name {
                ArtifactPattern::Exact(n) => Some(n.clone()),
                ArtifactPattern::Family(_) => None,
            })
            .collect();
        let primary = expected.first().map(|n| artifact_dir.join(n.as_str()));
        let delivery = match config.backend {
            Backend::Openai => Delivery::Reply,
            _ => Delivery::WriteFiles,
        };
        let now = orch_domain::staging::rfc3339_utc(run.store.now_ms());
        let feedback = run.feedback.as_ref().map(|(n, t)| (n, t.as_str()));
        let input = PromptInput {
            role: (delivery == Delivery::WriteFiles).then_some(loaded.role.as_str()),
            agent,
            stage: &run.stage,
            work_item: &run.work_item,
            title: &run.task.title,
            body: &run.task.body,
            branch: &run.task.branch,
            artifact_dir: &artifact_dir,
            artifacts: &loaded.artifacts,
            lessons: loaded
                .lessons
                .as_deref()
                .map(|l| (l, run.repo.lessons_file.as_str())),
            feedback,
            loops: run.loops,
            changed_files: &changed_files,
            default_branch: &run.repo.default_branch,
            model: config.model.as_deref(),
            now: &now,
            attempt: run.lease.attempt,
            delivery,
        };
        let prompt = prompt::render(&input);
        let timeout = Duration::from_secs(config.timeout_s.unwrap_or(default_timeout_s).max(1));
        Ok(Prepared {
            agent: agent.clone(),
            config: config.clone(),
            prompt,
            role: loaded.role,
            role_source: loaded.role_source,
            worktree,
            artifact_dir,
            primary,
            expected,
            timeout,
        })
    }
}

/// The most bytes of a run's diff kept.
const DIFF_LIMIT: usize = 1024 * 1024;

/// The worktree's changes against its `HEAD` after a run, untracked files included (read
/// through a temporary index and a temporary object directory, so neither the worktree's index
/// nor the repository's objects change), redacted and bounded; `None` when there are none or
/// git cannot say.
async fn run_diff(
    run: &StageRun,
    worktree: &std::path::Path,
    secrets: &[String],
) -> Option<String> {
    let tmp = tempfile::tempdir().ok()?;
    let index = tmp.path().join("index");
    let objects = tmp.path().join("objects");
    std::fs::create_dir_all(&objects).ok()?;
    // The repository's own objects, read-only: what `git add` hashes goes to the temporary
    // directory, so nothing the run left (a file no stage may commit) enters orch's clone.
    let common = orch_exec::process::run(&run.git.command(worktree).args([
        "rev-parse",
        "--path-format=absolute",
        "--git-common-dir",
    ]))
    .await
    .ok()
    .filter(|o| o.success())?;
    let repo_objects = std::path::PathBuf::from(common.stdout_lossy().trim()).join("objects");
    let git = |args: &[&str]| {
        run.git
            .command(worktree)
            .args(args.iter().copied())
            .env("GIT_INDEX_FILE", &index)
            .env("GIT_OBJECT_DIRECTORY", &objects)
            .env("GIT_ALTERNATE_OBJECT_DIRECTORIES", &repo_objects)
            .output_limit(DIFF_LIMIT)
    };
    for step in [&["read-tree", "HEAD"][..], &["add", "-A"][..]] {
        match orch_exec::process::run(&git(step)).await {
            Ok(o) if o.success() => {}
            Ok(o) => {
                tracing::debug!(output = %o.tail_text(3), "cannot read the run's diff");
                return None;
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the run's diff");
                return None;
            }
        }
    }
    let out = orch_exec::process::run(&git(&["diff", "--cached", "--no-color", "--no-ext-diff"]))
        .await
        .ok()
        .filter(|o| o.success())?;
    let text = out.stdout_lossy();
    if text.trim().is_empty() {
        return None;
    }
    let mut text = transcript::redact_text(&text, secrets);
    if out.stdout_truncated() {
        text = format!("(orch kept only the last {DIFF_LIMIT} bytes of the diff)\n{text}");
    }
    Some(text)
}

/// What a backend gets for one try.
pub(crate) struct Invocation<'a> {
    pub agent: &'a AgentName,
    pub config: &'a AgentConfig,
    pub run: &'a StageRun,
    /// The prompt (CLIs) or the user message (chat endpoints).
    pub prompt: &'a str,
    /// The role template, sent as the system message by chat backends.
    pub system: &'a str,
    /// Absolute paths.
    pub worktree: &'a std::path::Path,
    pub artifact_dir: &'a std::path::Path,
    pub primary: Option<&'a std::path::Path>,
    /// Every document the stage requires, by name (in `artifact_dir`).
    pub expected: &'a [ArtifactName],
    pub timeout: Duration,
    /// Where the CLI's structured output goes while it runs.
    pub transcript: Option<&'a transcript::Transcript>,
}

impl Invocation<'_> {
    /// An error of this invocation's backend.
    pub(crate) fn error(&self, message: impl Into<String>) -> AgentError {
        AgentError::Backend {
            agent: self.agent.clone(),
            backend: backend_name(self.config.backend),
            message: message.into(),
        }
    }
}

/// How one try ended.
#[derive(Debug)]
pub(crate) enum TryEnd {
    Ok,
    /// Worth another try after a wait.
    Transient(String),
    /// The attempt fails with this error (the job may be retried as a new attempt).
    Failed(AgentError),
    /// Retrying will not help: the stage fails for good with this error.
    Permanent(AgentError),
}

/// An action a CLI refused the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Denial {
    /// The tool (`Bash`, `Write`, …; `sandbox` for a command the sandbox refused).
    pub tool: String,
    /// What it was asked to do (a command, a path).
    pub detail: String,
    /// Whether the agent needed it to do its work (a write, an edit, a command).
    pub required: bool,
}

/// What a work item's agent runs spent, as the budgets count it.
#[derive(Debug, Default, PartialEq)]
struct Spent {
    runs: usize,
    input: i64,
    output: i64,
    tokens: u64,
    cost_usd: f64,
    /// Runs whose tokens are unknown.
    unknown_tokens: u64,
    /// Runs whose cost is unknown.
    unknown_cost: u64,
}

impl Spent {
    fn of(runs: &[orch_store::AgentRun]) -> Spent {
        let mut s = Spent {
            runs: runs.len(),
            ..Spent::default()
        };
        for r in runs {
            let data: serde_json::Value = serde_json::from_str(&r.data).unwrap_or_default();
            let flag = |k: &str| data.get(k).and_then(serde_json::Value::as_bool) == Some(true);
            s.input += r.input_tokens.unwrap_or(0).max(0);
            s.output += r.output_tokens.unwrap_or(0).max(0);
            s.cost_usd += r.cost_usd.unwrap_or(0.0).max(0.0);
            if flag("usage_unknown") {
                s.unknown_tokens += 1;
            }
            if r.cost_usd.is_none() && (flag("cost_unknown") || flag("usage_unknown")) {
                s.unknown_cost += 1;
            }
        }
        s.tokens = u64::try_from(s.input.saturating_add(s.output)).unwrap_or(0);
        s
    }
}

/// `wait` with full jitter in its upper half: between `wait/2` and `wait`, so that agents
/// failing together do not retry together.
fn jittered(wait: Duration) -> Duration {
    use std::hash::{BuildHasher as _, Hasher as _};
    let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
    if ms < 2 {
        return wait;
    }
    // RandomState is seeded randomly: enough randomness for a jitter.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(ms);
    let half = ms / 2;
    Duration::from_millis(half + h.finish() % (ms - half + 1))
}

/// Tokens and cost a backend reported.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct TokenUsage {
    pub input: Option<i64>,
    pub output: Option<i64>,
    pub cost_usd: Option<f64>,
}

/// The result of one try, as recorded in its `agent_runs` row.
#[derive(Debug)]
pub(crate) struct TryResult {
    pub end: TryEnd,
    pub exit_code: Option<i64>,
    pub usage: TokenUsage,
    /// Extra facts for the row's `data` (durations, byte counts, session ids).
    pub data: serde_json::Map<String, serde_json::Value>,
    /// How long the backend asked to wait before the next try.
    pub retry_after: Option<Duration>,
    /// Actions the CLI refused the agent.
    pub denials: Vec<Denial>,
    /// The agent ran but its usage could not be read: unknown, not zero.
    pub usage_unknown: bool,
    /// The program was started (or the request sent): it may have spent something. A try
    /// that never started (a missing program, bad configuration, a missing key) cost
    /// nothing, and is recorded so: a known zero, not an unknown cost.
    pub started: bool,
}

impl TryResult {
    pub(crate) fn new(end: TryEnd) -> TryResult {
        TryResult {
            end,
            exit_code: None,
            usage: TokenUsage::default(),
            data: serde_json::Map::new(),
            retry_after: None,
            denials: Vec::new(),
            usage_unknown: false,
            started: false,
        }
    }

    pub(crate) fn failed(e: AgentError) -> TryResult {
        TryResult::new(TryEnd::Failed(e))
    }

    pub(crate) fn permanent(e: AgentError) -> TryResult {
        TryResult::new(TryEnd::Permanent(e))
    }

    /// The row's `outcome`.
    fn outcome(&self) -> &'static str {
        match &self.end {
            TryEnd::Ok if self.usage_unknown => "usage_unknown",
            TryEnd::Ok => "ok",
            TryEnd::Permanent(AgentError::PermissionDenied { .. }) => "permission_denied",
            TryEnd::Transient(_) => "transient_error",
            TryEnd::Failed(AgentError::TimedOut { .. }) => "timeout",
            TryEnd::Failed(AgentError::Cancelled { .. }) => "cancelled",
            TryEnd::Failed(
                AgentError::MissingArtifact { .. } | AgentError::UnchangedArtifact { .. },
            ) => "missing_artifact",
            TryEnd::Failed(_) | TryEnd::Permanent(_) => "error",
        }
    }
}

pub use command::missing_key_message;
/// The CLI name of a preset backend (`claude`, `codex`, `aider`); `None` for `command` and `openai`.
pub fn preset_name(backend: Backend) -> Option<&'static str> {
    command::preset_name(backend)
}

/// The oldest and newest versions of a preset's CLI (`claude`, `codex`, `aider`) that orch's
/// real-CLI tests ran (see the README); `orch doctor` warns outside them.
pub fn tested_versions(tool: &str) -> (&'static str, &'static str) {
    command::preset_tested(tool)
}

/// The first `N.N[.N…]` version in `text`, as numbers (compare as a list).
pub fn version_in(text: &str) -> Option<Vec<u64>> {
    text.split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .map(|w| w.trim_matches('.'))
        .find(|w| w.contains('.') && w.split('.').all(|p| !p.is_empty()))
        .and_then(|w| w.split('.').map(|p| p.parse().ok()).collect())
}

/// The `agent_runs.backend` of a backend kind (a preset's: its CLI's name).
pub fn backend_name(backend: Backend) -> &'static str {
    match backend {
        Backend::Command => "command",
        Backend::Openai => "openai",
        preset => command::preset_name(preset).unwrap_or("command"),
    }
}

/// The longest error text kept in a row or an error message.
pub(crate) const MAX_ERROR_BYTES: usize = 2000;

/// The end of `text` within `max` bytes (where a failure's reason usually is), marked when cut.
pub(crate) fn bound_text(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut start = text.len() - max.saturating_sub(1);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &text[start..])
}

/// Whether an error text reads like a transient backend condition (rate limit, overload,
/// HTTP 429/503/529 as a number of its own, not inside a longer one).
pub(crate) fn mentions_transient(text: &str) -> bool {
    const WORDS: [&str; 6] = [
        "rate limit",
        "rate_limit",
        "ratelimit",
        "too many requests",
        "overloaded",
        "service unavailable",
    ];
    const CODES: [&str; 3] = ["429", "503", "529"];
    let lower = text.to_lowercase();
    let standalone = |code: &str| {
        lower.match_indices(code).any(|(i, _)| {
            let before = lower[..i].chars().next_back();
            let after = lower[i + code.len()..].chars().next();
            !before.is_some_and(|c| c.is_ascii_digit())
                && !after.is_some_and(|c| c.is_ascii_digit())
        })
    };
    WORDS.iter().any(|w| lower.contains(w)) || CODES.iter().any(|c| standalone(c))
}

/// An `agent_runs` row being written: finished exactly once, by [`RunRow::finish`] or, when
/// the attempt's future is dropped first, as `abandoned` by a background task.
struct RunRow {
    store: Store,
    id: i64,
    finished: bool,
}

impl RunRow {
    /// A new row for try `try_no`, or, when this job adopts the commands an earlier orch
    /// started (they outlived it under their supervisors), the row that orch wrote for the
    /// same try: one run, one row, its cost counted once. A row that orch already finished
    /// (it died after recording the run, before the stage's outcome) is left as it is.
    async fn start(store: &Store, run: NewAgentRun, try_no: u32) -> Result<RunRow, StoreError> {
        use orch_exec::supervise;
        let note = format!("agent-run-{try_no}");
        if let Some(job) = run.job_id
            && supervise::job_has_records(job)
            && let Some(id) = supervise::kept(job, &note)
                .and_then(|b| String::from_utf8(b).ok())
                .and_then(|s| s.trim().parse::<i64>().ok())
            && let Some(row) = store
                .task_agent_runs(run.task_id)
                .await?
                .into_iter()
                .find(|r| r.id == id && r.job_id == Some(job))
        {
            return Ok(RunRow {
                store: store.clone(),
                id: row.id,
                finished: row.finished_at.is_some(),
            });
        }
        let job = run.job_id;
        let id = store.start_agent_run(run).await?;
        if let Some(job) = job {
            supervise::keep(job, &note, id.to_string().as_bytes());
        }
        Ok(RunRow {
            store: store.clone(),
            id,
            finished: false,
        })
    }

    /// Finishes the row (unless an earlier orch already did, for the run this one adopted); a
    /// store error is logged, not returned: the run happened either way.
    async fn finish(mut self, finish: AgentRunFinish) {
        if self.finished {
            return;
        }
        self.finished = true;
        if let Err(e) = self.store.finish_agent_run(self.id, finish).await {
            tracing::warn!(run_id = self.id, error = %e, "cannot record the end of an agent run");
        }
    }
}

impl Drop for RunRow {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let (store, id) = (self.store.clone(), self.id);
        let finish = AgentRunFinish {
            outcome: "abandoned".to_owned(),
            error: Some("the attempt stopped before the agent run finished".to_owned()),
            data: "{}".to_owned(),
            ..AgentRunFinish::default()
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    if let Err(e) = store.finish_agent_run(id, finish).await {
                        tracing::warn!(run_id = id, error = %e, "cannot record an abandoned agent run");
                    }
                });
            }
            Err(_) => tracing::warn!(
                run_id = id,
                "agent run abandoned outside a runtime; its row stays open"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_is_capped() {
        let p = RetryPolicy {
            tries: 5,
            base: Duration::from_millis(100),
            max: Duration::from_millis(500),
        };
        let cases = [
            (1, None, 100),
            (2, None, 200),
            (3, None, 400),
            (4, None, 500),
            (1, Some(300), 300),
            (1, Some(9_000), 500),
        ];
        for (try_no, after, expect) in cases {
            assert_eq!(
                p.backoff(try_no, after.map(Duration::from_millis)),
                Duration::from_millis(expect),
                "{try_no} {after:?}"
            );
        }
    }

    #[test]
    fn jitter_stays_within_the_upper_half() {
        for ms in [0u64, 1, 2, 3, 100, 60_000] {
            for _ in 0..50 {
                let j = jittered(Duration::from_millis(ms)).as_millis() as u64;
                assert!(j <= ms && j >= ms / 2, "{ms} -> {j}");
            }
        }
    }

    #[test]
    fn transient_texts() {
        let cases = [
            ("Error: rate limit exceeded", true),
            ("API Error: 529 {\"type\":\"overloaded_error\"}", true),
            ("HTTP 503 Service Unavailable", true),
            ("Too Many Requests", true),
            ("invalid api key", false),
            ("HTTP/1.1 429", true),
            ("took 15034 ms", false),
            ("assertion failed at line 4290", false),
            ("syntax error near line 3", false),
        ];
        for (text, expect) in cases {
            assert_eq!(mentions_transient(text), expect, "{text}");
        }
    }

    #[test]
    fn bound_text_keeps_the_end() {
        assert_eq!(bound_text("short", 10), "short");
        let t = bound_text(&format!("{}END", "é".repeat(100)), 11);
        assert!(
            t.ends_with("END") && t.starts_with('…') && t.len() <= 13,
            "{t}"
        );
    }
}
