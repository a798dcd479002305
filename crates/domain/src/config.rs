//! The `orch.toml` configuration model: settings, managed repos with their commands, agent
//! backends and pipeline overrides (design.md §9).
//!
//! The text and the environment are passed in, so loading is pure and testable; the CLI reads
//! the file and hands over `std::env::var`. Unknown keys are errors (a typo must not silently
//! fall back to a default), every `[settings]` key can be overridden by an `ORCH_<KEY>`
//! variable, and every error names the section and key (or variable) at fault. Secrets are
//! never stored: agents name the environment variable that holds their API key.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Deserialize;

use crate::ids::{AgentName, Prefix, RepoName, StageName, WorkItemId};
use crate::pipeline::{Pipeline, StageKind};

/// A value that must not appear in logs: `Debug` prints `***`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The secret itself, for the one place that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[settings]`: process-wide settings.
    #[serde(default)]
    pub settings: Settings,
    /// `[repos.<name>]`: the managed repos.
    #[serde(default)]
    pub repos: BTreeMap<RepoName, RepoConfig>,
    /// `[agents.<name>]`: the LLM agent backends.
    #[serde(default)]
    pub agents: BTreeMap<AgentName, AgentConfig>,
    /// `[pipeline]`: overrides of the default pipeline.
    #[serde(default)]
    pub pipeline: PipelineConfig,
    /// `[prices."<model>"]`: US dollars per million tokens, for agents whose tool reports
    /// tokens but no cost; merged over [`default_prices`].
    #[serde(default)]
    pub prices: BTreeMap<String, Price>,
}

/// What a model costs, in US dollars per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Per million input tokens (cached input counts as input: an upper bound).
    pub input_per_mtok: f64,
    /// Per million output tokens.
    pub output_per_mtok: f64,
}

impl Price {
    /// The cost of `input` and `output` tokens.
    pub fn cost(&self, input: i64, output: i64) -> f64 {
        (input.max(0) as f64 * self.input_per_mtok + output.max(0) as f64 * self.output_per_mtok)
            / 1e6
    }
}

/// The prices orch knows without configuration (list prices, USD per million tokens, as of
/// the tested CLI versions). `[prices]` in orch.toml overrides and extends them.
pub fn default_prices() -> BTreeMap<String, Price> {
    let p = |input_per_mtok, output_per_mtok| Price {
        input_per_mtok,
        output_per_mtok,
    };
    [
        ("claude-opus-4-1", p(15.0, 75.0)),
        ("claude-opus-4", p(15.0, 75.0)),
        ("claude-sonnet-4-5", p(3.0, 15.0)),
        ("claude-sonnet-4", p(3.0, 15.0)),
        ("claude-haiku-4-5", p(1.0, 5.0)),
        ("claude-3-5-haiku", p(0.8, 4.0)),
        ("gpt-5-codex", p(1.25, 10.0)),
        ("gpt-5", p(1.25, 10.0)),
        ("gpt-5-mini", p(0.25, 2.0)),
        ("gpt-5-nano", p(0.05, 0.4)),
        ("gpt-4.1", p(2.0, 8.0)),
        ("gpt-4.1-mini", p(0.4, 1.6)),
        ("gpt-4o", p(2.5, 10.0)),
        ("gpt-4o-mini", p(0.15, 0.6)),
        ("o3", p(2.0, 8.0)),
        ("o4-mini", p(1.1, 4.4)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// The price of `model` in `table`: an exact entry, else the longest entry the model name
/// starts with followed by `-` (a dated version such as `claude-sonnet-4-5-20250929`); a
/// provider prefix (`openai/gpt-4.1`) is ignored.
pub fn price_in(table: &BTreeMap<String, Price>, model: &str) -> Option<Price> {
    let model = model.rsplit('/').next().unwrap_or(model).trim();
    if let Some(p) = table.get(model) {
        return Some(*p);
    }
    table
        .iter()
        .filter(|(k, _)| {
            model
                .strip_prefix(k.as_str())
                .is_some_and(|rest| rest.starts_with('-'))
        })
        .max_by_key(|(k, _)| k.len())
        .map(|(_, p)| *p)
}

/// `[settings]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// Where repos are cloned and kept (`<repos_dir>/<repo>`). Default `.orch/repos`.
    pub repos_dir: String,
    /// `postgres://…` to share one queue between machines; unset means embedded SQLite.
    pub database_url: Option<String>,
    /// Address of the HTTP API and dashboard. Default `127.0.0.1:7878`.
    pub bind: String,
    /// Bearer token required by mutating API calls.
    pub token: Option<Secret>,
    /// Concurrent jobs per process. Default 4.
    pub workers: u32,
    /// Job lease length in seconds. Default 60.
    pub lease_s: u64,
    /// Queue polling interval in milliseconds, the fallback to notifications. Default 1000.
    pub poll_interval_ms: u64,
    /// Once the queue is drained, how long a worker gathers jobs that come due on their own
    /// (a watch's ticks) and finished jobs before its next statement, in milliseconds: jobs due
    /// a few milliseconds apart then share one claim. A job submitted to run now is claimed at
    /// once. 0: a statement per due job. Default 10; at most `poll_interval_ms` and a tenth of
    /// `lease_s`.
    pub fetch_cooldown_ms: u64,
    /// Loops back to implementation allowed per work item. Default 3.
    pub max_loops: u32,
    /// Agent runs at once, across all work items. Default 2.
    pub agent_concurrency: u32,
    /// Token budget per work item; a run that would exceed it is not started.
    pub max_tokens_per_item: Option<u64>,
    /// Cost budget per work item in US dollars.
    pub max_cost_usd_per_item: Option<f64>,
    /// What an agent run of unknown cost counts as toward `max_cost_usd_per_item`. Unset:
    /// the whole budget (one run of unknown cost stops further runs of the work item).
    pub unknown_run_cost_usd: Option<f64>,
    /// What an agent run of unknown token usage counts as toward `max_tokens_per_item`.
    /// Unset: the whole budget.
    pub unknown_run_tokens: Option<u64>,
    /// Default wall-clock timeout of an agent run, in seconds. Default 1800.
    pub agent_timeout_s: u64,
    /// This machine's node name, for job affinity; unset means the host name.
    pub node: Option<String>,
    /// The dashboard's address as people reach it (`https://orch.example.com`), for the links
    /// in notifications. Unset: `http://<bind>`.
    pub public_url: Option<String>,
    /// Seconds a node may go unseen (no worker heartbeat from it) before the jobs pinned to it
    /// (deploys, watches) may be taken over by another node (design.md §10). At least
    /// `lease_s`. Default 300.
    pub node_grace_s: u64,
    /// The most changed paths one stage's commit may hold; a stage that leaves more is
    /// refused before anything is committed ([`crate::protect`]). 1 to
    /// [`crate::protect::MAX_CHANGED_FILES_LIMIT`]; default
    /// [`crate::protect::DEFAULT_MAX_CHANGED_FILES`].
    pub max_changed_files: u32,
    /// How long finished jobs of finished tasks are kept: `"3d"` (the default), `"12h"`,
    /// `"90m"`, `"30s"`, or `"off"` (kept forever). Events, agent runs and the tasks
    /// themselves are always kept; only job rows are pruned, in small batches, by every
    /// `orch serve`/`orch worker` and by `orch gc`.
    pub retention: Retention,
}

/// `[settings] retention`: how long a finished job of a finished task is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum Retention {
    /// Jobs are never pruned.
    Off,
    /// Jobs are pruned this long after their task ended and they finished.
    After {
        /// The period, in seconds.
        secs: u64,
    },
}

/// The default of `[settings] retention`: three days.
pub const DEFAULT_RETENTION: Retention = Retention::After {
    secs: 3 * 24 * 3600,
};

impl Retention {
    /// The period, `None` when pruning is off.
    pub fn period(self) -> Option<std::time::Duration> {
        match self {
            Retention::Off => None,
            Retention::After { secs } => Some(std::time::Duration::from_secs(secs)),
        }
    }

    /// Parses `off` or a whole number followed by `s`, `m`, `h` or `d` (more than zero).
    pub fn parse(text: &str) -> Result<Retention, String> {
        let t = text.trim();
        if t.eq_ignore_ascii_case("off") {
            return Ok(Retention::Off);
        }
        let expected = || {
            format!(
                "{text:?}: expected \"off\" or a duration such as \"3d\", \"12h\", \"90m\" or \"30s\""
            )
        };
        let split = t.find(|c: char| !c.is_ascii_digit()).ok_or_else(expected)?;
        let (digits, unit) = t.split_at(split);
        let n: u64 = digits.parse().map_err(|_| expected())?;
        let unit_s: u64 = match unit {
            "s" => 1,
            "m" => 60,
            "h" => 3600,
            "d" => 24 * 3600,
            _ => return Err(expected()),
        };
        if n == 0 {
            return Err(format!(
                "{text:?}: must be more than zero (\"off\" keeps every job)"
            ));
        }
        let secs = n
            .checked_mul(unit_s)
            .filter(|s| *s <= i64::MAX as u64 / 1000)
            .ok_or_else(|| format!("{text:?}: too long"))?;
        Ok(Retention::After { secs })
    }
}

impl TryFrom<String> for Retention {
    type Error = String;
    fn try_from(s: String) -> Result<Retention, String> {
        Retention::parse(&s)
    }
}

impl std::fmt::Display for Retention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Retention::Off => f.write_str("off"),
            Retention::After { secs } if secs % (24 * 3600) == 0 => {
                write!(f, "{}d", secs / (24 * 3600))
            }
            Retention::After { secs } if secs % 3600 == 0 => write!(f, "{}h", secs / 3600),
            Retention::After { secs } if secs % 60 == 0 => write!(f, "{}m", secs / 60),
            Retention::After { secs } => write!(f, "{secs}s"),
        }
    }
}

impl Settings {
    /// The dashboard's base address for links: `public_url` without a trailing `/`, else
    /// `http://<bind>`.
    pub fn link_base(&self) -> String {
        match &self.public_url {
            Some(u) => u.trim_end_matches('/').to_owned(),
            None => format!("http://{}", self.bind),
        }
    }
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            repos_dir: ".orch/repos".to_owned(),
            database_url: None,
            bind: "127.0.0.1:7878".to_owned(),
            token: None,
            workers: 4,
            lease_s: 60,
            poll_interval_ms: 1000,
            fetch_cooldown_ms: DEFAULT_FETCH_COOLDOWN_MS,
            max_loops: crate::pipeline::DEFAULT_MAX_LOOPS,
            agent_concurrency: 2,
            max_tokens_per_item: None,
            max_cost_usd_per_item: None,
            unknown_run_cost_usd: None,
            unknown_run_tokens: None,
            agent_timeout_s: 1800,
            node: None,
            public_url: None,
            node_grace_s: DEFAULT_NODE_GRACE_S,
            max_changed_files: crate::protect::DEFAULT_MAX_CHANGED_FILES,
            retention: DEFAULT_RETENTION,
        }
    }
}

/// `[repos.<name>]`: one managed repo and its commands.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RepoConfig {
    /// A local checkout to work from.
    pub path: Option<String>,
    /// A remote to clone from and push to.
    pub url: Option<String>,
    /// The branch work is merged into. Default `main`.
    #[serde(default = "default_branch")]
    pub default_branch: String,
    /// The work item id prefix of this repo (`ORCH` for `ORCH-115`).
    pub prefix: Prefix,
    /// The verification command (stage `verification`, and the merge gate).
    pub test: Option<String>,
    /// Timeout of the test command, in seconds. Default 1800.
    #[serde(default = "default_test_timeout_s")]
    pub test_timeout_s: u64,
    /// Staging steps, run in order (build, deploy to staging, ...).
    #[serde(default)]
    pub staging: Vec<StepConfig>,
    /// Smoke checks run after the staging steps.
    #[serde(default)]
    pub staging_smoke: Vec<StepConfig>,
    /// The production deploy command.
    pub deploy: Option<String>,
    /// Timeout of the deploy and rollback commands, in seconds. Default 900.
    #[serde(default = "default_deploy_timeout_s")]
    pub deploy_timeout_s: u64,
    /// The rollback command, run when the post-deploy watch decides FAILED. Its environment
    /// names the failed revision (`ORCH_REVISION`) and the one orch's deploy record says was
    /// live before it (`ORCH_ROLLBACK_TO`; empty when unknown).
    pub rollback: Option<String>,
    /// Health endpoint polled after a deploy.
    pub health_url: Option<String>,
    /// Endpoint answering the live revision.
    pub revision_url: Option<String>,
    /// Alert command (`sh -c`, in the repo checkout), run best-effort with a timeout whenever
    /// an operator is needed: production could not be verified healthy at a known revision
    /// after a deploy or a watch went wrong, the repo is held, or an item failed. It gets
    /// `ORCH_WORK_ITEM`, `ORCH_REPO`, `ORCH_EVENT`, `ORCH_VERDICT`, `ORCH_ACTION`,
    /// `ORCH_REASON`, `ORCH_REVISION`, `ORCH_LIVE` (what is live, in words) and `ORCH_TODO`
    /// (what to do) in its environment and the notification document (the webhook's JSON) on
    /// stdin. Default none.
    #[serde(default)]
    pub alert: Option<String>,
    /// The notification webhook: every terminal outcome, every hold that waits for an
    /// operator and every alert is POSTed to it as a versioned JSON document (README "When
    /// things go wrong"), signed when `alert_webhook_secret` is set, retried with backoff by a
    /// job of its own (the pipeline never waits for it). Default none.
    #[serde(default)]
    pub alert_webhook: Option<String>,
    /// The HMAC-SHA256 key that signs every webhook delivery (`X-Orch-Signature: t=<unix
    /// seconds>,v1=<hex of HMAC(key, "<t>.<body>")>`). Default none: deliveries are unsigned
    /// (`orch doctor` warns).
    #[serde(default)]
    pub alert_webhook_secret: Option<Secret>,
    /// The webhook's body: `orch` (the versioned document, default) or `slack` (a Slack
    /// incoming-webhook message `{"text": …}` carrying the same facts).
    #[serde(default)]
    pub alert_webhook_format: WebhookFormat,
    /// The staging environment's health endpoint. When set, the staging runner looks at it
    /// before the smoke checks and again after a step that failed: connection refused, DNS
    /// failure or no answer within the step's timeout is TOOL_ERROR `unreachable` (the
    /// infrastructure, not the change). Default none.
    #[serde(default)]
    pub staging_health_url: Option<String>,
    /// How the merge gate merges. Default `ff`.
    #[serde(default)]
    pub merge_strategy: MergeStrategy,
    /// `[repos.<name>.post_deploy]`: the post-deploy watch.
    #[serde(default)]
    pub post_deploy: PostDeployConfig,
    /// Tool-error defers of the staging runner before the result is FAILED. Default 2.
    #[serde(default = "default_staging_defer_limit")]
    pub staging_defer_limit: u32,
    /// Delay before the first staging defer, in seconds; it doubles with each further defer
    /// (capped at ten times this value when set). Default none: the policy's 60 s base and
    /// 600 s cap. Tests and fast local tools set it low.
    #[serde(default)]
    pub staging_defer_delay_s: Option<u64>,
    /// The repo's lessons file, relative to its root. Default `LESSONS.md`.
    #[serde(default = "default_lessons_file")]
    pub lessons_file: String,
    /// What the release train does with a change whose post-deploy watch rolled it back:
    /// `revert` (default) removes it from the default branch with a revert commit; `hold`
    /// keeps it and holds the repo's releases until an operator acts.
    #[serde(default)]
    pub on_failure: OnFailure,
    /// A control endpoint the post-deploy monitor checks with every poll: something that must
    /// answer whenever the monitor can see at all (e.g. a stable status page on the same
    /// network). When it does not answer, the poll's failures are the monitor's blindness
    /// (ERROR), never the service's (FAIL). Default none.
    #[serde(default)]
    pub control_url: Option<String>,
    /// How the repo's agents and its own code (tests, verification, staging steps) are
    /// contained: `"on"` (the default: a sandbox per run), `"off"` (unsandboxed, said loudly
    /// everywhere), or a `[repos.<name>.sandbox]` table ([`SandboxConfig`]).
    #[serde(default)]
    pub sandbox: SandboxConfig,
    /// Variables of orch's environment the repo's commands (test, staging steps, deploy,
    /// rollback, alert) inherit besides the basic ones (`PATH`, `HOME`, the locale, the
    /// toolchains' own). orch's token and database URL are never passed. Default none.
    #[serde(default)]
    pub env: Vec<String>,
    /// `[repos.<name>.forge]`: the forge the repo lives on; its labeled issues become work
    /// items (issue 31). Default none.
    #[serde(default)]
    pub forge: Option<crate::forge::ForgeConfig>,
}

/// `[repos.<name>.sandbox]`: the sandbox of the repo's agents and of its own code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxConfig {
    /// Whether runs are sandboxed (`sandbox = "off"` clears it).
    pub enabled: bool,
    /// What the repo's tests and sandboxed staging steps may reach. Default none.
    pub network: SandboxNetwork,
    /// Paths shown read-only inside the sandbox besides the system (e.g. a toolchain outside
    /// the usual places).
    pub read_only: Vec<String>,
    /// Paths writable inside the sandbox besides the work item's worktree (e.g. a build cache).
    pub writable: Vec<String>,
    /// Processes alive at once in one run. Default 1024.
    pub max_processes: u64,
    /// Memory of one run, MiB. Default 8192.
    pub max_memory_mb: u64,
    /// CPU seconds of each process of a run. Default 14400.
    pub max_cpu_s: u64,
    /// The largest file a run may write, MiB. Default 4096.
    pub max_file_mb: u64,
}

impl Default for SandboxConfig {
    fn default() -> SandboxConfig {
        SandboxConfig {
            enabled: true,
            network: SandboxNetwork::None,
            read_only: Vec::new(),
            writable: Vec::new(),
            max_processes: 1024,
            max_memory_mb: 8192,
            max_cpu_s: 4 * 3600,
            max_file_mb: 4096,
        }
    }
}

/// What sandboxed tests and staging steps may reach: `"none"`, `"host"` (the host's network,
/// unrestricted), or a list of `host:port` endpoints.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum SandboxNetwork {
    /// Nothing but the run's own loopback.
    #[default]
    None,
    /// The host's network.
    Host,
    /// Only these `host:port` endpoints.
    Allow(Vec<String>),
}

impl<'de> Deserialize<'de> for SandboxConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<SandboxConfig, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Table {
            #[serde(default = "yes")]
            enabled: bool,
            #[serde(default)]
            network: Option<NetworkValue>,
            #[serde(default)]
            read_only: Vec<String>,
            #[serde(default)]
            writable: Vec<String>,
            max_processes: Option<u64>,
            max_memory_mb: Option<u64>,
            max_cpu_s: Option<u64>,
            max_file_mb: Option<u64>,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum NetworkValue {
            Word(String),
            List(Vec<String>),
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Value {
            Word(String),
            Table(Table),
        }
        fn yes() -> bool {
            true
        }
        let defaults = SandboxConfig::default();
        match Value::deserialize(d)? {
            Value::Word(w) => match w.as_str() {
                "on" => Ok(defaults),
                "off" => Ok(SandboxConfig {
                    enabled: false,
                    ..defaults
                }),
                other => Err(serde::de::Error::custom(format!(
                    "sandbox: expected \"on\", \"off\" or a table, not {other:?}"
                ))),
            },
            Value::Table(t) => Ok(SandboxConfig {
                enabled: t.enabled,
                network: match t.network {
                    None => SandboxNetwork::None,
                    Some(NetworkValue::Word(w)) if w == "none" => SandboxNetwork::None,
                    Some(NetworkValue::Word(w)) if w == "host" => SandboxNetwork::Host,
                    Some(NetworkValue::Word(w)) => {
                        return Err(serde::de::Error::custom(format!(
                            "sandbox.network: expected \"none\", \"host\" or a list of \"host:port\", not {w:?}"
                        )));
                    }
                    Some(NetworkValue::List(l)) => SandboxNetwork::Allow(l),
                },
                read_only: t.read_only,
                writable: t.writable,
                max_processes: t.max_processes.unwrap_or(defaults.max_processes),
                max_memory_mb: t.max_memory_mb.unwrap_or(defaults.max_memory_mb),
                max_cpu_s: t.max_cpu_s.unwrap_or(defaults.max_cpu_s),
                max_file_mb: t.max_file_mb.unwrap_or(defaults.max_file_mb),
            }),
        }
    }
}

/// `alert_webhook_format`: the body of a webhook delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WebhookFormat {
    /// orch's versioned notification document.
    #[default]
    Orch,
    /// A Slack incoming-webhook message (`{"text": …}`).
    Slack,
}

/// `on_failure`: what happens to a change that was rolled back in production.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnFailure {
    /// Revert it on the default branch (through the release track) so no later deploy
    /// ships it again.
    #[default]
    Revert,
    /// Keep it and hold the repo's releases until an operator approves or cancels the item.
    Hold,
}

fn default_branch() -> String {
    "main".to_owned()
}

fn default_test_timeout_s() -> u64 {
    1800
}

fn default_deploy_timeout_s() -> u64 {
    900
}

fn default_staging_defer_limit() -> u32 {
    2
}

fn default_lessons_file() -> String {
    "LESSONS.md".to_owned()
}

fn default_step_timeout_s() -> u64 {
    600
}

/// One staging step or smoke check.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepConfig {
    /// The step's name, shown in the staging log.
    pub name: String,
    /// The shell command.
    pub run: String,
    /// Timeout in seconds. Default 600.
    #[serde(default = "default_step_timeout_s")]
    pub timeout_s: u64,
    /// Whether the step runs in the repo's sandbox. Default true. A step that starts a
    /// service meant to outlive it (a deploy to staging) sets `false`: it then runs on the
    /// host like the production deploy, trusted as the configuration that names it.
    #[serde(default = "default_true")]
    pub sandbox: bool,
}

fn default_true() -> bool {
    true
}

/// How the merge gate merges a branch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MergeStrategy {
    /// Fast-forward only, after bringing the branch up to date.
    #[default]
    Ff,
    /// A merge commit.
    Merge,
}

/// `[repos.<name>.post_deploy]`: the post-deploy watch (seed 002).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PostDeployConfig {
    /// Length of the watch, in seconds. Default 600.
    pub window_s: u64,
    /// Time between polls, in seconds. Default 30.
    pub interval_s: u64,
    /// Wait before the first poll, in seconds. Default 30.
    pub initial_delay_s: u64,
    /// Timeout of one poll's requests, in seconds. Default 10.
    pub poll_timeout_s: u64,
}

impl Default for PostDeployConfig {
    fn default() -> PostDeployConfig {
        PostDeployConfig {
            window_s: 600,
            interval_s: 30,
            initial_delay_s: 30,
            poll_timeout_s: 10,
        }
    }
}

/// `[agents.<name>]`: an agent backend.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// Which kind of backend.
    pub backend: Backend,
    /// The program to run (`command` backend; overrides a preset's program).
    pub command: Option<String>,
    /// Extra arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// How the prompt reaches the program. Default `stdin`.
    #[serde(default)]
    pub prompt_via: PromptVia,
    /// The model to ask for.
    pub model: Option<String>,
    /// The chat endpoint (`openai` backend).
    pub endpoint: Option<String>,
    /// The name of the environment variable holding the API key (never the key itself).
    pub api_key_env: Option<String>,
    /// Wall-clock timeout of a run in seconds; default `settings.agent_timeout_s`.
    pub timeout_s: Option<u64>,
    /// Claude Code: the tools the agent may use without asking (`--allowedTools`, e.g.
    /// `"Bash(python3 -m unittest:*)"`), replacing the role's default (see the README).
    pub allowed_tools: Option<Vec<String>>,
    /// Claude Code: tools refused outright (`--disallowedTools`), replacing the default
    /// (web, scheduling and sub-agent tools).
    pub disallowed_tools: Option<Vec<String>>,
    /// Claude Code: the most turns of one run (`--max-turns`). Default 50.
    pub max_turns: Option<u32>,
    /// Claude Code: retries the CLI makes itself on API errors (`CLAUDE_CODE_MAX_RETRIES`).
    /// Default 2; orch retries transient failures with backoff on top.
    pub cli_retries: Option<u32>,
    /// The CLI's configuration home (`HOME`, and `CODEX_HOME` below it): `"run"` (default, a
    /// fresh directory per run, so the orch user's settings and hooks do not apply),
    /// `"user"` (the orch user's own), or a directory.
    pub config_home: Option<String>,
    /// US dollars per million tokens, for tools that report tokens but no cost; default
    /// the `[prices]` entry of `model`.
    pub price: Option<Price>,
    /// `host:port` endpoints the agent may reach from its sandbox besides its model endpoint
    /// (`endpoint`, or the preset's provider). Default none.
    #[serde(default)]
    pub network: Vec<String>,
    /// Variables of orch's environment the agent inherits besides the basic ones and its key
    /// (`api_key_env`). orch's token and database URL are never passed. Default none.
    #[serde(default)]
    pub env: Vec<String>,
}

/// Agent backend kinds (design.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Any CLI.
    Command,
    /// Claude Code preset (`claude -p --output-format json`).
    Claude,
    /// Codex CLI preset (`codex exec --json`).
    Codex,
    /// Aider preset.
    Aider,
    /// An OpenAI-compatible chat endpoint.
    Openai,
}

/// How a `command` backend receives its prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptVia {
    /// On standard input.
    #[default]
    Stdin,
    /// In a file whose path is in `ORCH_PROMPT_FILE`.
    File,
}

/// `[pipeline]`: overrides of the default pipeline.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PipelineConfig {
    /// Overrides `settings.max_loops` (`ORCH_MAX_LOOPS` overrides both).
    pub max_loops: Option<u32>,
    /// `[pipeline.stages.<stage>]`: per-stage overrides.
    pub stages: BTreeMap<StageName, StageOverride>,
}

/// `[pipeline.stages.<stage>]`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StageOverride {
    /// The agent of an LLM stage (must have an `[agents.<name>]` section).
    pub agent: Option<AgentName>,
    /// Whether the task waits for `orch approve` before the stage runs.
    pub approval: Option<bool>,
}

/// Why a configuration cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The TOML is malformed, has an unknown key or a value of the wrong type.
    #[error("{}{}: {message}", section_label(section), line.map(|l| format!(" (line {l})")).unwrap_or_default())]
    Parse {
        /// The `[section]` the error is in, `None` at the top level.
        section: Option<String>,
        /// The line, when known.
        line: Option<usize>,
        /// What is wrong.
        message: String,
    },
    /// An `ORCH_…` environment variable has a bad value.
    #[error("environment variable {var}={value:?}: {reason}")]
    Env {
        /// The variable.
        var: String,
        /// Its value.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// A value parses but cannot be used.
    #[error("[{section}] {key}: {reason}")]
    Invalid {
        /// The section (`settings`, `repos.app`, ...).
        section: String,
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

fn section_label(section: &Option<String>) -> String {
    match section {
        Some(s) => format!("[{s}]"),
        None => "top level".to_owned(),
    }
}

fn invalid(section: impl Into<String>, key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        section: section.into(),
        key: key.to_owned(),
        reason: reason.into(),
    }
}

/// The default of `[settings] node_grace_s`.
pub const DEFAULT_NODE_GRACE_S: u64 = 300;

/// `settings.fetch_cooldown_ms`'s default: 1,000 watches ticking each second are then about a
/// hundred claims a second of ten jobs each, rather than a thousand of one (Oban's producers
/// wait 5 ms between fetches, River's 100 ms); a tick is claimed at most this much later.
pub const DEFAULT_FETCH_COOLDOWN_MS: u64 = 10;

/// The agents of deterministic stages: built into orch, not configured in `[agents]`.
pub const BUILT_IN_AGENTS: [&str; 5] = [
    "tester",
    "merge-gate",
    "deployer",
    "post-deploy-monitor",
    "lessons",
];

impl Config {
    /// Parses `orch.toml` text, applies `ORCH_…` overrides read through `env`, and validates.
    /// An empty variable counts as unset.
    pub fn from_toml_str(
        text: &str,
        env: &impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let mut config: Config = toml::from_str(text).map_err(|e| parse_error(text, &e))?;
        config.apply_env(env)?;
        config.validate()?;
        config.resolve_prices();
        Ok(config)
    }

    /// Applies the `ORCH_<SETTING>` environment overrides to `[settings]`.
    fn apply_env(&mut self, env: &impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        let get = |var: &str| env(var).filter(|v| !v.is_empty());
        let s = &mut self.settings;
        if let Some(v) = get("ORCH_REPOS_DIR") {
            s.repos_dir = v;
        }
        if let Some(v) = get("ORCH_DATABASE_URL") {
            s.database_url = Some(v);
        }
        if let Some(v) = get("ORCH_BIND") {
            s.bind = v;
        }
        if let Some(v) = get("ORCH_TOKEN") {
            s.token = Some(Secret(v));
        }
        if let Some(v) = get("ORCH_NODE") {
            s.node = Some(v);
        }
        if let Some(v) = get("ORCH_RETENTION") {
            s.retention = Retention::parse(&v).map_err(|reason| ConfigError::Env {
                var: "ORCH_RETENTION".to_owned(),
                value: v.clone(),
                reason,
            })?;
        }
        env_number(&get, "ORCH_WORKERS", &mut s.workers)?;
        env_number(&get, "ORCH_LEASE_S", &mut s.lease_s)?;
        env_number(&get, "ORCH_NODE_GRACE_S", &mut s.node_grace_s)?;
        env_number(&get, "ORCH_POLL_INTERVAL_MS", &mut s.poll_interval_ms)?;
        env_number(&get, "ORCH_FETCH_COOLDOWN_MS", &mut s.fetch_cooldown_ms)?;
        env_number(&get, "ORCH_AGENT_CONCURRENCY", &mut s.agent_concurrency)?;
        env_number(&get, "ORCH_AGENT_TIMEOUT_S", &mut s.agent_timeout_s)?;
        env_number(&get, "ORCH_MAX_CHANGED_FILES", &mut s.max_changed_files)?;
        if env_number(&get, "ORCH_MAX_LOOPS", &mut s.max_loops)? {
            self.pipeline.max_loops = None;
        }
        let mut tokens = 0u64;
        if env_number(&get, "ORCH_MAX_TOKENS_PER_ITEM", &mut tokens)? {
            s.max_tokens_per_item = Some(tokens);
        }
        let mut cost = 0f64;
        if env_number(&get, "ORCH_MAX_COST_USD_PER_ITEM", &mut cost)? {
            s.max_cost_usd_per_item = Some(cost);
        }
        if env_number(&get, "ORCH_UNKNOWN_RUN_COST_USD", &mut cost)? {
            s.unknown_run_cost_usd = Some(cost);
        }
        if env_number(&get, "ORCH_UNKNOWN_RUN_TOKENS", &mut tokens)? {
            s.unknown_run_tokens = Some(tokens);
        }
        Ok(())
    }

    /// Gives every agent without its own `price` the price of its model from `[prices]` or
    /// [`default_prices`].
    pub fn resolve_prices(&mut self) {
        let mut table = default_prices();
        table.extend(self.prices.iter().map(|(k, v)| (k.clone(), *v)));
        for agent in self.agents.values_mut() {
            if agent.price.is_none() {
                agent.price = agent.model.as_deref().and_then(|m| price_in(&table, m));
            }
        }
    }

    /// Checks everything a parse cannot: settings in range, each repo usable, prefixes
    /// unique, agents complete, pipeline overrides naming known stages and agents.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_settings()?;
        let mut prefixes: BTreeMap<&Prefix, &RepoName> = BTreeMap::new();
        for (name, repo) in &self.repos {
            validate_repo(name, repo)?;
            if let Some(other) = prefixes.insert(&repo.prefix, name) {
                return Err(invalid(
                    format!("repos.{name}"),
                    "prefix",
                    format!(
                        "prefix `{}` is already used by [repos.{other}]",
                        repo.prefix
                    ),
                ));
            }
        }
        for (name, repo) in &self.repos {
            let Some(forge) = &repo.forge else { continue };
            let section = format!("repos.{name}.forge");
            forge
                .check()
                .map_err(|(key, reason)| invalid(section.clone(), key, reason))?;
            // `<prefix>-<issue number>` must never be a number orch allocates for a repo, nor
            // another forge's issue.
            if let Some(other) = prefixes.insert(&forge.prefix, name) {
                return Err(invalid(
                    section,
                    "prefix",
                    format!(
                        "prefix `{}` is already used by [repos.{other}] (each forge needs its own)",
                        forge.prefix
                    ),
                ));
            }
            for var in [Some(&forge.token_env), forge.webhook_secret_env.as_ref()]
                .into_iter()
                .flatten()
            {
                if let Some((agent, _)) = self.agents.iter().find(|(_, a)| a.env.contains(var)) {
                    return Err(invalid(
                        section,
                        "token_env",
                        format!(
                            "`{var}` is also in [agents.{agent}] env: the forge's secrets never reach an agent"
                        ),
                    ));
                }
                if repo.env.contains(var) {
                    return Err(invalid(
                        section,
                        "token_env",
                        format!(
                            "`{var}` is also in [repos.{name}] env: the forge's secrets never reach the repo's commands"
                        ),
                    ));
                }
            }
        }
        for (name, agent) in &self.agents {
            validate_agent(name, agent)?;
        }
        for (model, price) in &self.prices {
            validate_price(&format!("prices.\"{model}\""), price)?;
        }
        self.pipeline().map(|_| ())
    }

    fn validate_settings(&self) -> Result<(), ConfigError> {
        let s = &self.settings;
        let at_least_one = [
            ("workers", s.workers.into()),
            ("lease_s", s.lease_s),
            ("poll_interval_ms", s.poll_interval_ms),
            ("agent_concurrency", s.agent_concurrency.into()),
            ("agent_timeout_s", s.agent_timeout_s),
            ("max_changed_files", s.max_changed_files.into()),
        ];
        for (key, value) in at_least_one {
            if value == 0 {
                return Err(invalid("settings", key, "must be at least 1"));
            }
        }
        if s.fetch_cooldown_ms > s.poll_interval_ms {
            return Err(invalid(
                "settings",
                "fetch_cooldown_ms",
                format!(
                    "must be at most poll_interval_ms ({}): the cooldown only gathers what a poll would find",
                    s.poll_interval_ms
                ),
            ));
        }
        if s.fetch_cooldown_ms.saturating_mul(10) > s.lease_s.saturating_mul(1000) {
            return Err(invalid(
                "settings",
                "fetch_cooldown_ms",
                format!(
                    "must be at most a tenth of lease_s ({} s): finished jobs wait up to this long to be marked done, well within their lease",
                    s.lease_s
                ),
            ));
        }
        let files_limit = crate::protect::MAX_CHANGED_FILES_LIMIT;
        if s.max_changed_files > files_limit {
            return Err(invalid(
                "settings",
                "max_changed_files",
                format!(
                    "must be at most {files_limit}: git's listing of more changes than that is more than orch reads from one git command"
                ),
            ));
        }
        if s.node_grace_s < s.lease_s {
            return Err(invalid(
                "settings",
                "node_grace_s",
                format!(
                    "must be at least lease_s ({}): a node is judged gone only after its leases could have expired",
                    s.lease_s
                ),
            ));
        }
        if s.repos_dir.trim().is_empty() {
            return Err(invalid("settings", "repos_dir", "must not be empty"));
        }
        check_bind(&s.bind).map_err(|reason| invalid("settings", "bind", reason))?;
        if let Some(url) = &s.public_url
            && !is_http_url(url)
        {
            return Err(invalid(
                "settings",
                "public_url",
                "expected an http:// or https:// URL",
            ));
        }
        if let Some(url) = &s.database_url
            && !(url.starts_with("postgres://")
                || url.starts_with("postgresql://")
                || url.starts_with("sqlite:"))
        {
            return Err(invalid(
                "settings",
                "database_url",
                "expected a `postgres://…`, `postgresql://…` or `sqlite:…` URL",
            ));
        }
        if let Some(token) = &s.token
            && token.expose().trim().is_empty()
        {
            return Err(invalid("settings", "token", "must not be blank"));
        }
        if let Some(cost) = s.max_cost_usd_per_item
            && !(cost.is_finite() && cost >= 0.0)
        {
            return Err(invalid(
                "settings",
                "max_cost_usd_per_item",
                "must be a non-negative number",
            ));
        }
        if let Some(cost) = s.unknown_run_cost_usd
            && !(cost.is_finite() && cost >= 0.0)
        {
            return Err(invalid(
                "settings",
                "unknown_run_cost_usd",
                "must be a non-negative number",
            ));
        }
        if let Some(node) = &s.node
            && !is_node_name(node)
        {
            return Err(invalid(
                "settings",
                "node",
                "expected 1 to 64 characters of A-Z, a-z, 0-9, `.`, `_`, `-`",
            ));
        }
        Ok(())
    }

    /// The default pipeline with the `[pipeline]` overrides applied, validated.
    pub fn pipeline(&self) -> Result<Pipeline, ConfigError> {
        let mut pipeline = Pipeline::default_pipeline();
        pipeline.max_loops = self.pipeline.max_loops.unwrap_or(self.settings.max_loops);
        for (stage, over) in &self.pipeline.stages {
            let section = format!("pipeline.stages.{stage}");
            let names: Vec<String> = pipeline.stages.iter().map(|d| d.name.to_string()).collect();
            let Some(def) = pipeline.stage_mut(stage) else {
                return Err(invalid(
                    section,
                    stage.as_str(),
                    format!("unknown stage; the stages are {}", names.join(", ")),
                ));
            };
            if let Some(agent) = &over.agent {
                if def.kind == StageKind::Deterministic {
                    let built_in = def.agent.as_ref().map_or("-", |a| a.as_str());
                    return Err(invalid(
                        section,
                        "agent",
                        format!(
                            "stage `{stage}` is run by built-in `{built_in}`; its agent cannot be changed"
                        ),
                    ));
                }
                def.agent = Some(agent.clone());
            }
            if let Some(approval) = over.approval {
                def.approval = approval;
            }
        }
        for def in &pipeline.stages {
            let Some(agent) = &def.agent else { continue };
            if def.kind == StageKind::Llm && !self.agents.contains_key(agent) {
                let (section, key) = if self.pipeline.stages.contains_key(&def.name) {
                    (format!("pipeline.stages.{}", def.name), "agent")
                } else {
                    ("agents".to_owned(), agent.as_str())
                };
                return Err(invalid(
                    section,
                    key,
                    format!(
                        "stage `{}` uses agent `{agent}`, which has no [agents.{agent}] section",
                        def.name
                    ),
                ));
            }
        }
        pipeline
            .validate()
            .map_err(|e| invalid("pipeline", "stages", e.to_string()))?;
        Ok(pipeline)
    }

    /// The repo whose prefix is the work item's.
    pub fn repo_for(&self, work_item: &WorkItemId) -> Option<(&RepoName, &RepoConfig)> {
        let prefix = work_item.prefix();
        self.repos.iter().find(|(_, r)| r.prefix == prefix)
    }

    /// The timeout of an agent's runs: its own, or `settings.agent_timeout_s`.
    pub fn agent_timeout_s(&self, agent: &AgentName) -> u64 {
        self.agents
            .get(agent)
            .and_then(|a| a.timeout_s)
            .unwrap_or(self.settings.agent_timeout_s)
    }

    /// The commented `orch.toml` that `orch init` writes, with `token` as the API token.
    /// It parses back to a valid configuration.
    pub fn default_toml(token: &str) -> String {
        DEFAULT_TOML.replace("@TOKEN@", &toml_quote(token))
    }
}

/// Reads a numeric override; returns whether the variable was set.
fn env_number<T: EnvNumber>(
    get: &impl Fn(&str) -> Option<String>,
    var: &str,
    target: &mut T,
) -> Result<bool, ConfigError> {
    let expected = T::EXPECTED;
    let Some(value) = get(var) else {
        return Ok(false);
    };
    match value.trim().parse::<T>() {
        Ok(v) => {
            *target = v;
            Ok(true)
        }
        Err(_) => Err(ConfigError::Env {
            var: var.to_owned(),
            reason: format!("expected {expected}"),
            value,
        }),
    }
}

/// A number type an `ORCH_…` variable can hold, with how to describe it in an error.
trait EnvNumber: std::str::FromStr {
    const EXPECTED: &'static str;
}

impl EnvNumber for u32 {
    const EXPECTED: &'static str = "a whole number";
}

impl EnvNumber for u64 {
    const EXPECTED: &'static str = "a whole number";
}

impl EnvNumber for f64 {
    const EXPECTED: &'static str = "a number";
}

fn check_bind(bind: &str) -> Result<(), String> {
    let Some((host, port)) = bind.rsplit_once(':') else {
        return Err(format!("{bind:?} is not `host:port`"));
    };
    if host.is_empty() {
        return Err(format!("{bind:?} has no host"));
    }
    if port.parse::<u16>().is_err() {
        return Err(format!(
            "{bind:?}: port {port:?} is not a number from 0 to 65535"
        ));
    }
    Ok(())
}

fn is_node_name(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

fn is_env_var_name(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn is_http_url(s: &str) -> bool {
    let rest = s
        .strip_prefix("http://")
        .or_else(|| s.strip_prefix("https://"));
    rest.is_some_and(|r| !r.is_empty() && !r.contains(char::is_whitespace))
}

/// A branch name safe to pass to git: no whitespace, no `..`, not starting with `-`.
fn is_branch_name(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with('-')
        && !s.contains("..")
        && !s.contains(|c: char| c.is_whitespace() || c.is_control() || "~^:?*[\\".contains(c))
}

/// A path relative to the repo root that stays inside it.
fn is_relative_inside(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with('/')
        && !s.contains('\0')
        && s.split(['/', '\\']).all(|part| part != "..")
}

fn validate_repo(name: &RepoName, repo: &RepoConfig) -> Result<(), ConfigError> {
    let section = format!("repos.{name}");
    let err = |key: &str, reason: &str| invalid(section.clone(), key, reason);
    let blank = |v: &Option<String>| v.as_deref().is_some_and(|s| s.trim().is_empty());
    if repo.path.is_none() && repo.url.is_none() {
        return Err(err(
            "path",
            "set `path` (a local checkout) or `url` (a remote to clone)",
        ));
    }
    for (key, value) in [
        ("path", &repo.path),
        ("url", &repo.url),
        ("test", &repo.test),
        ("deploy", &repo.deploy),
        ("rollback", &repo.rollback),
        ("alert", &repo.alert),
    ] {
        if blank(value) {
            return Err(err(key, "must not be blank; remove the key instead"));
        }
    }
    if !is_branch_name(&repo.default_branch) {
        return Err(err("default_branch", "not a usable git branch name"));
    }
    for (key, value) in [
        ("health_url", &repo.health_url),
        ("revision_url", &repo.revision_url),
        ("alert_webhook", &repo.alert_webhook),
        ("staging_health_url", &repo.staging_health_url),
    ] {
        if let Some(url) = value
            && !is_http_url(url)
        {
            return Err(err(key, "expected an http:// or https:// URL"));
        }
    }
    for (key, value) in [
        ("test_timeout_s", repo.test_timeout_s),
        ("deploy_timeout_s", repo.deploy_timeout_s),
    ] {
        if value == 0 {
            return Err(err(key, "must be at least 1"));
        }
    }
    for (key, steps) in [
        ("staging", &repo.staging),
        ("staging_smoke", &repo.staging_smoke),
    ] {
        let mut names = BTreeSet::new();
        for (i, step) in steps.iter().enumerate() {
            let where_ = format!("step {} ({:?})", i + 1, step.name);
            if step.name.trim().is_empty() {
                return Err(err(
                    key,
                    &format!("step {}: `name` must not be blank", i + 1),
                ));
            }
            if !names.insert(step.name.as_str()) {
                return Err(err(key, &format!("{where_}: the name is used twice")));
            }
            if step.run.trim().is_empty() {
                return Err(err(key, &format!("{where_}: `run` must not be blank")));
            }
            if step.timeout_s == 0 {
                return Err(err(
                    key,
                    &format!("{where_}: `timeout_s` must be at least 1"),
                ));
            }
        }
    }
    let pd = &repo.post_deploy;
    let pd_section = format!("repos.{name}.post_deploy");
    for (key, value) in [
        ("window_s", pd.window_s),
        ("interval_s", pd.interval_s),
        ("poll_timeout_s", pd.poll_timeout_s),
    ] {
        if value == 0 {
            return Err(invalid(pd_section, key, "must be at least 1"));
        }
    }
    if pd.interval_s > pd.window_s {
        return Err(invalid(
            pd_section,
            "interval_s",
            format!(
                "{} is longer than window_s ({})",
                pd.interval_s, pd.window_s
            ),
        ));
    }
    if !is_relative_inside(&repo.lessons_file) {
        return Err(err(
            "lessons_file",
            "must be a relative path inside the repo (no leading `/`, no `..`)",
        ));
    }
    validate_env_names(&repo.env).map_err(|e| err("env", &e))?;
    validate_sandbox(&format!("repos.{name}.sandbox"), &repo.sandbox)
}

/// Names of variables a configuration passes to a child: real names, never orch's secrets.
fn validate_env_names(names: &[String]) -> Result<(), String> {
    for var in names {
        if !is_env_var_name(var) {
            return Err(format!(
                "`{var}` is not the name of an environment variable"
            ));
        }
        if crate::net::SECRET_VARS.contains(&var.as_str()) {
            return Err(format!(
                "`{var}` is orch's own secret and is never passed to a command"
            ));
        }
    }
    Ok(())
}

fn validate_sandbox(section: &str, sb: &SandboxConfig) -> Result<(), ConfigError> {
    let err = |key: &str, reason: String| invalid(section.to_owned(), key, reason);
    if let SandboxNetwork::Allow(list) = &sb.network {
        for entry in list {
            crate::net::Endpoint::parse(entry).map_err(|e| err("network", e))?;
        }
    }
    for (key, paths) in [("read_only", &sb.read_only), ("writable", &sb.writable)] {
        for p in paths {
            if !p.starts_with('/') || p.split('/').any(|c| c == "..") {
                return Err(err(
                    key,
                    format!("`{p}`: expected an absolute path without `..`"),
                ));
            }
            if p.trim_end_matches('/').is_empty() {
                return Err(err(
                    key,
                    "`/` cannot be shown whole to a sandbox".to_owned(),
                ));
            }
        }
    }
    for (key, value) in [
        ("max_processes", sb.max_processes),
        ("max_memory_mb", sb.max_memory_mb),
        ("max_cpu_s", sb.max_cpu_s),
        ("max_file_mb", sb.max_file_mb),
    ] {
        if value == 0 {
            return Err(err(key, "must be at least 1".to_owned()));
        }
    }
    Ok(())
}

fn validate_agent(name: &AgentName, agent: &AgentConfig) -> Result<(), ConfigError> {
    let section = format!("agents.{name}");
    let err = |key: &str, reason: &str| invalid(section.clone(), key, reason);
    if BUILT_IN_AGENTS.contains(&name.as_str()) {
        return Err(err(
            "backend",
            &format!("`{name}` is a built-in deterministic agent and cannot be configured"),
        ));
    }
    match agent.backend {
        Backend::Command if agent.command.as_deref().is_none_or(|c| c.trim().is_empty()) => {
            return Err(err("command", "the `command` backend needs a `command`"));
        }
        Backend::Openai => {
            let Some(endpoint) = &agent.endpoint else {
                return Err(err("endpoint", "the `openai` backend needs an `endpoint`"));
            };
            if !is_http_url(endpoint) {
                return Err(err("endpoint", "expected an http:// or https:// URL"));
            }
            if agent.model.as_deref().is_none_or(|m| m.trim().is_empty()) {
                return Err(err("model", "the `openai` backend needs a `model`"));
            }
        }
        _ => {}
    }
    if let Some(var) = &agent.api_key_env
        && !is_env_var_name(var)
    {
        return Err(err(
            "api_key_env",
            "expected the NAME of an environment variable (e.g. OPENAI_API_KEY), not the key",
        ));
    }
    if agent.timeout_s == Some(0) {
        return Err(err("timeout_s", "must be at least 1"));
    }
    for entry in &agent.network {
        if let Err(e) = crate::net::Endpoint::parse(entry) {
            return Err(err("network", &e));
        }
    }
    validate_env_names(&agent.env).map_err(|e| err("env", &e))?;
    if agent.max_turns == Some(0) {
        return Err(err("max_turns", "must be at least 1"));
    }
    if let Some(endpoint) = &agent.endpoint
        && !is_http_url(endpoint)
    {
        return Err(err("endpoint", "expected an http:// or https:// URL"));
    }
    if agent
        .config_home
        .as_deref()
        .is_some_and(|h| h.trim().is_empty())
    {
        return Err(err(
            "config_home",
            "expected \"run\", \"user\" or a directory",
        ));
    }
    if let Some(price) = &agent.price {
        validate_price(&section, price)?;
    }
    Ok(())
}

fn validate_price(section: &str, price: &Price) -> Result<(), ConfigError> {
    for (key, v) in [
        ("input_per_mtok", price.input_per_mtok),
        ("output_per_mtok", price.output_per_mtok),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(invalid(section, key, "must be a finite number >= 0"));
        }
    }
    Ok(())
}

/// Turns a TOML error into one naming the section and line.
fn parse_error(text: &str, e: &toml::de::Error) -> ConfigError {
    let mut message = e.message().trim_end().to_owned();
    if message.contains("unknown field `api_key`") {
        message.push_str(
            " (orch never stores keys: put the key in an environment variable and name it with `api_key_env`)",
        );
    }
    let Some(span) = e.span() else {
        return ConfigError::Parse {
            section: None,
            line: None,
            message,
        };
    };
    let start = span.start.min(text.len());
    let before = text.get(..start).unwrap_or("");
    let line = before.matches('\n').count() + 1;
    let error_line = text.lines().nth(line - 1).unwrap_or("");
    let section = match table_header(error_line) {
        // A missing field is reported at the header of the table that lacks it.
        Some(header) if message.starts_with("missing field") => Some(header.to_owned()),
        // Any other error at a header is about the header's name: a key of the parent table
        // (`[setings]`, `[repos.App]`).
        Some(header) => header.rsplit_once('.').map(|(parent, _)| parent.to_owned()),
        None => text
            .lines()
            .take(line)
            .filter_map(table_header)
            .last()
            .map(str::to_owned),
    };
    ConfigError::Parse {
        section,
        line: Some(line),
        message,
    }
}

/// The name of the table a line opens (`repos.app` for `[repos.app]` or `[[repos.app]]`).
fn table_header(line: &str) -> Option<&str> {
    let t = line.trim_start();
    let inner = t.strip_prefix("[[").or_else(|| t.strip_prefix('['))?;
    let end = inner.find(']')?;
    Some(inner[..end].trim())
}

/// A TOML basic string holding `s` exactly.
fn toml_quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The template behind [`Config::default_toml`]; `@TOKEN@` is replaced by the quoted token.
const DEFAULT_TOML: &str = r#"# orch.toml — configuration of the orch orchestrator (written by `orch init`).
#
# Every [settings] key can be overridden by an environment variable named ORCH_ and the key in
# upper case: ORCH_DATABASE_URL, ORCH_BIND, ORCH_TOKEN, ORCH_WORKERS, ORCH_LEASE_S, ...
# Unknown keys are errors, so a typo never silently falls back to a default.

[settings]
# Where managed repos are cloned and kept: <repos_dir>/<repo>.
repos_dir = ".orch/repos"
# Unset: embedded SQLite (one machine, zero setup). A PostgreSQL URL lets many
# `orch worker` processes on many machines share one queue.
# database_url = "postgres://orch@127.0.0.1:5432/orch"
# The HTTP API and dashboard. Mutating calls need `Authorization: Bearer <token>`.
bind = "127.0.0.1:7878"
token = @TOKEN@
# Concurrent jobs per process, job lease (s), queue polling fallback (ms).
workers = 4
lease_s = 60
poll_interval_ms = 1000
# Once the queue is drained, jobs coming due within this many ms share one claim (0: none).
fetch_cooldown_ms = 10
# Loops back to implementation allowed per work item before it fails.
max_loops = 3
# Agent runs at once, and the default timeout of one run (s).
agent_concurrency = 2
agent_timeout_s = 1800
# Budgets per work item; a run that would exceed them is not started.
# max_tokens_per_item = 2000000
# max_cost_usd_per_item = 20.0
# A run whose tool reported no usable cost (or tokens) counts as this much toward the
# budgets; unset, it counts as the whole budget (no further runs for the work item).
# unknown_run_cost_usd = 2.0
# unknown_run_tokens = 200000
# This machine's name for job affinity (default: the host name).
# node = "build-1"
# Seconds a node may go unseen before its pinned jobs (deploys, watches) move to another node.
# node_grace_s = 300
# The most changed files one stage may commit; a stage that leaves more is refused.
# max_changed_files = 2000
# The dashboard's address as people reach it, for the links in notifications.
# public_url = "https://orch.example.com"
# How long finished jobs of finished tasks are kept ("off": forever). Events, agent runs and
# tasks are always kept.
# retention = "3d"

# One section per managed repo. Work item ids are <prefix>-<n>, e.g. APP-1.
# [repos.app]
# path = "../app"                       # your checkout (relative to this file), or a bare repo.
#                                       # orch works in its own clone; a merge fast-forwards your
#                                       # default branch when it is checked out and clean, else
#                                       # only orch's clone has it (`orch doctor` explains). Or:
# url = "git@git.example.com:team/app.git"   # a remote: pushed with a lease, never forced
# default_branch = "main"
# prefix = "APP"
# test = "cargo test"
# test_timeout_s = 1800
# merge_strategy = "ff"                 # or "merge"
# deploy = "./deploy.sh production"
# deploy_timeout_s = 900
# rollback = "./deploy.sh rollback"
# health_url = "http://127.0.0.1:8080/healthz"
# revision_url = "http://127.0.0.1:8080/version"
# alert = "./notify.sh"                 # run when an operator is needed (README "When things go wrong")
# alert_webhook = "http://127.0.0.1:9000/hooks/orch"   # every outcome, hold and alert, as signed JSON
# alert_webhook_secret = "…"            # HMAC-SHA256 key of X-Orch-Signature
# alert_webhook_format = "orch"         # or "slack" (an incoming-webhook message)
# staging_health_url = "http://127.0.0.1:8081/healthz"   # unreachable staging is TOOL_ERROR, not FAILED
# staging_defer_limit = 2
# staging_defer_delay_s = 60            # first defer's delay; doubles per defer
# lessons_file = "LESSONS.md"
# env = ["AWS_PROFILE"]                 # variables of orch's the repo's commands inherit
#
# [[repos.app.staging]]
# name = "build"
# run = "cargo build --release"
# timeout_s = 900
#
# [[repos.app.staging]]
# name = "deploy-staging"
# run = "./deploy.sh staging"
# sandbox = false                       # it starts a service that outlives it: on the host
#
# [[repos.app.staging_smoke]]
# name = "health"
# run = "curl -fsS http://127.0.0.1:8081/healthz"
# timeout_s = 30
#
# [repos.app.post_deploy]
# window_s = 600
# interval_s = 30
# initial_delay_s = 30
# poll_timeout_s = 10
#
# Agents and the repo's tests and staging steps run in a sandbox (bubblewrap); without one
# orch refuses to run them unless the repo says sandbox = "off" (UNSANDBOXED, said loudly).
# [repos.app.sandbox]
# network = ["127.0.0.1:8081"]          # what tests and staging steps may reach: "none"
#                                       # (the default), "host", or host:port entries
# read_only = ["/opt/toolchain"]        # more paths they may read
# writable = ["/var/cache/app"]         # more paths they may write
# max_processes = 1024
# max_memory_mb = 8192

# LLM agents, one per LLM stage. backend: "claude", "codex", "aider" (presets),
# "command" (any CLI: command, args, prompt_via = "stdin" | "file") or
# "openai" (an OpenAI-compatible endpoint: endpoint, model, api_key_env).
# API keys are never written here: api_key_env names the variable that holds one.

[agents.analyst]
backend = "claude"

[agents.architect]
backend = "claude"

[agents.developer]
backend = "claude"
# timeout_s = 3600
# Presets also take: endpoint (the API's base URL), api_key_env, model, max_turns (Claude
# Code, default 50), cli_retries (default 2), allowed_tools and disallowed_tools (Claude Code;
# by default document stages get Read, Write and Edit, the developer also Bash), config_home
# ("run", the default: a fresh HOME per run; "user"; or a directory) and price (USD per
# million tokens, as in [prices] below).
# allowed_tools = ["Read", "Write", "Edit", "Bash(python3 -m unittest:*)"]
# max_turns = 50

[agents.reviewer]
backend = "claude"

# [agents.local-writer]
# backend = "openai"
# endpoint = "http://127.0.0.1:8000/v1"
# model = "qwen2.5-coder"
# api_key_env = "LOCAL_LLM_KEY"

# Prices (USD per million tokens) turn reported tokens into cost for tools that report
# none (Codex, Aider with unknown models). Common models are built in; add yours:
# [prices."my-model"]
# input_per_mtok = 1.0
# output_per_mtok = 4.0

# Pipeline overrides: the agent of an LLM stage, and approval = true to make a
# stage wait for `orch approve <id>` before it runs.
[pipeline]
# max_loops = 3
# [pipeline.stages.analysis]
# agent = "local-writer"
# [pipeline.stages.deploy]
# approval = true
"#;

#[cfg(test)]
mod tests {
    use super::*;

    const AGENTS: &str = "[agents.analyst]\nbackend = \"claude\"\n[agents.architect]\nbackend = \"claude\"\n\
                          [agents.developer]\nbackend = \"codex\"\n[agents.reviewer]\nbackend = \"claude\"\n";

    fn no_env(_: &str) -> Option<String> {
        None
    }

    /// Loads `text` (plus the four LLM agents) with `env` and compares with `expect`:
    /// `Ok(probe result)` or `Err(fragment of the error message)`.
    fn check(
        text: &str,
        env: &[(&str, &str)],
        probe: impl Fn(&Config) -> String,
        expect: Result<&str, &str>,
    ) {
        let full = format!("{text}\n{AGENTS}");
        let lookup = |k: &str| {
            env.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_owned())
        };
        let got = Config::from_toml_str(&full, &lookup);
        match (&got, expect) {
            (Ok(c), Ok(want)) => assert_eq!(probe(c), want, "text:\n{text}"),
            (Err(e), Err(fragment)) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(fragment),
                    "text:\n{text}\nerror {msg:?} lacks {fragment:?}"
                );
            }
            (got, expect) => panic!("text:\n{text}\ngot {got:?}, expected {expect:?}"),
        }
    }

    const REPO: &str = "[repos.app]\npath = \"/srv/app\"\nprefix = \"APP\"\n";

    #[test]
    fn defaults() {
        let c = Config::from_toml_str(AGENTS, &no_env).unwrap();
        assert_eq!(c.settings, Settings::default());
        assert_eq!(c.settings.repos_dir, ".orch/repos");
        assert_eq!(c.settings.bind, "127.0.0.1:7878");
        assert_eq!(
            (
                c.settings.workers,
                c.settings.lease_s,
                c.settings.poll_interval_ms
            ),
            (4, 60, 1000)
        );
        assert_eq!((c.settings.max_loops, c.settings.agent_concurrency), (3, 2));
        assert_eq!(c.settings.agent_timeout_s, 1800);
        let c = Config::from_toml_str(&format!("{REPO}{AGENTS}"), &no_env).unwrap();
        let repo = &c.repos[&"app".parse::<RepoName>().unwrap()];
        assert_eq!(repo.default_branch, "main");
        assert_eq!(repo.merge_strategy, MergeStrategy::Ff);
        assert_eq!(repo.post_deploy, PostDeployConfig::default());
        assert_eq!(
            (repo.post_deploy.window_s, repo.post_deploy.interval_s),
            (600, 30)
        );
        assert_eq!(
            (
                repo.post_deploy.initial_delay_s,
                repo.post_deploy.poll_timeout_s
            ),
            (30, 10)
        );
        assert_eq!(repo.staging_defer_limit, 2);
        assert_eq!(repo.staging_defer_delay_s, None);
        assert_eq!(repo.lessons_file, "LESSONS.md");
        assert_eq!(repo.alert_webhook_format, WebhookFormat::Orch);
        assert_eq!(c.settings.link_base(), "http://127.0.0.1:7878");
        assert_eq!(c.pipeline().unwrap(), Pipeline::default_pipeline());
    }

    #[test]
    fn a_forge_section_is_read_and_checked() {
        let forge = "[repos.app.forge]\nkind = \"github\"\nrepo = \"octo/app\"\ntoken_env = \"GH_TOKEN\"\nlabel = \"orch\"\n";
        let probe = |c: &Config| {
            let f = c.repos[&"app".parse::<RepoName>().unwrap()]
                .forge
                .clone()
                .unwrap();
            format!(
                "{} {} {} {}",
                f.prefix, f.api_url, f.poll_interval_s, f.max_backoff_s
            )
        };
        check(
            &format!("{REPO}{forge}"),
            &[],
            probe,
            Ok("GH https://api.github.com 60 900"),
        );
        check(
            &format!("{REPO}{forge}prefix = \"APP\"\n"),
            &[],
            probe,
            Err("[repos.app.forge] prefix: prefix `APP` is already used by [repos.app]"),
        );
        check(
            &format!("{REPO}env = [\"GH_TOKEN\"]\n{forge}"),
            &[],
            probe,
            Err("never reach the repo's commands"),
        );
        check(
            &format!("{REPO}{}", forge.replace("octo/app", "octo")),
            &[],
            probe,
            Err("[repos.app.forge] repo:"),
        );
        check(
            &format!("{REPO}{}", forge.replace("\"github\"", "\"gitlab\"")),
            &[],
            probe,
            Err("unknown variant `gitlab`"),
        );
        let waits = |c: &Config| {
            c.repos[&"app".parse::<RepoName>().unwrap()]
                .forge
                .as_ref()
                .map(|f| f.check_wait_s.to_string())
                .unwrap_or_default()
        };
        check(&format!("{REPO}{forge}"), &[], waits, Ok("10800"));
        check(
            &format!("{REPO}{forge}check_wait_s = 600\n"),
            &[],
            waits,
            Ok("600"),
        );
        check(
            &format!("{REPO}{forge}check_wait_s = 0\n"),
            &[],
            waits,
            Err("[repos.app.forge] check_wait_s: must be at least 1"),
        );
        check(
            &format!("{REPO}{forge}check_wait = 600\n"),
            &[],
            waits,
            Err("unknown field `check_wait`"),
        );
    }

    #[test]
    fn the_sandbox_is_on_off_or_a_table_and_its_entries_are_checked() {
        let sb = |c: &Config| {
            let r = &c.repos[&"app".parse::<RepoName>().unwrap()];
            format!(
                "{} {:?} {:?} {:?} {} {:?}",
                r.sandbox.enabled,
                r.sandbox.network,
                r.sandbox.read_only,
                r.sandbox.writable,
                r.sandbox.max_processes,
                r.env
            )
        };
        let repo = |extra: &str| format!("{REPO}{extra}");
        check(&repo(""), &[], sb, Ok("true None [] [] 1024 []"));
        check(
            &repo("sandbox = \"on\"\n"),
            &[],
            sb,
            Ok("true None [] [] 1024 []"),
        );
        check(
            &repo("sandbox = \"off\"\n"),
            &[],
            sb,
            Ok("false None [] [] 1024 []"),
        );
        check(
            &repo(
                "env = [\"AWS_PROFILE\"]\n[repos.app.sandbox]\nnetwork = [\"127.0.0.1:8081\", \"api.x.com:443\"]\nread_only = [\"/opt/t\"]\nwritable = [\"/var/cache/app\"]\nmax_processes = 64\n",
            ),
            &[],
            sb,
            Ok(
                "true Allow([\"127.0.0.1:8081\", \"api.x.com:443\"]) [\"/opt/t\"] [\"/var/cache/app\"] 64 [\"AWS_PROFILE\"]",
            ),
        );
        check(
            &repo("[repos.app.sandbox]\nnetwork = \"host\"\n"),
            &[],
            sb,
            Ok("true Host [] [] 1024 []"),
        );
        check(
            &repo("[repos.app.sandbox]\nnetwork = \"none\"\n"),
            &[],
            sb,
            Ok("true None [] [] 1024 []"),
        );
        check(&repo("sandbox = \"maybe\"\n"), &[], sb, Err("sandbox"));
        check(
            &repo("[repos.app.sandbox]\nnetwork = \"all\"\n"),
            &[],
            sb,
            Err("sandbox"),
        );
        check(
            &repo("[repos.app.sandbox]\nnetwork = [\"no-port\"]\n"),
            &[],
            sb,
            Err("expected host:port"),
        );
        check(
            &repo("[repos.app.sandbox]\nread_only = [\"relative\"]\n"),
            &[],
            sb,
            Err("absolute path"),
        );
        check(
            &repo("[repos.app.sandbox]\nwritable = [\"/\"]\n"),
            &[],
            sb,
            Err("cannot be shown whole"),
        );
        check(
            &repo("[repos.app.sandbox]\nmax_processes = 0\n"),
            &[],
            sb,
            Err("at least 1"),
        );
        check(
            &repo("env = [\"ORCH_TOKEN\"]\n"),
            &[],
            sb,
            Err("orch's own secret"),
        );
        check(
            &repo("env = [\"not a name\"]\n"),
            &[],
            sb,
            Err("not the name"),
        );
        check(
            &repo("[[repos.app.staging]]\nname = \"s\"\nrun = \"x\"\nsandbox = false\n"),
            &[],
            |c| {
                let r = &c.repos[&"app".parse::<RepoName>().unwrap()];
                format!("{}", r.staging[0].sandbox)
            },
            Ok("false"),
        );
    }

    #[test]
    fn full_repo_section() {
        let text = r#"
[repos.app]
url = "git@example.com:team/app.git"
prefix = "APP"
default_branch = "trunk"
test = "make test"
merge_strategy = "merge"
deploy = "./deploy.sh"
rollback = "./rollback.sh"
health_url = "http://127.0.0.1:9/healthz"
revision_url = "https://127.0.0.1:9/version"
alert = "./page-oncall.sh"
alert_webhook = "http://127.0.0.1:9/hook"
alert_webhook_secret = "s3cret"
alert_webhook_format = "slack"
staging_health_url = "http://127.0.0.1:9/staging-health"
staging_defer_limit = 5
staging_defer_delay_s = 7
lessons_file = "docs/LESSONS.md"

[[repos.app.staging]]
name = "build"
run = "make"
timeout_s = 100

[[repos.app.staging]]
name = "ship"
run = "./ship staging"

[[repos.app.staging_smoke]]
name = "health"
run = "curl -f http://127.0.0.1:9/healthz"

[repos.app.post_deploy]
window_s = 120
interval_s = 10
"#;
        let c = Config::from_toml_str(&format!("{text}{AGENTS}"), &no_env).unwrap();
        let (name, repo) = c.repo_for(&"APP-12".parse().unwrap()).unwrap();
        assert_eq!(name.as_str(), "app");
        assert_eq!(repo.merge_strategy, MergeStrategy::Merge);
        assert_eq!(repo.staging.len(), 2);
        assert_eq!(repo.staging[0].timeout_s, 100);
        assert_eq!(repo.staging[1].timeout_s, 600);
        assert_eq!(repo.staging_smoke[0].name, "health");
        assert_eq!(repo.post_deploy.window_s, 120);
        assert_eq!(repo.post_deploy.initial_delay_s, 30);
        assert_eq!(repo.alert.as_deref(), Some("./page-oncall.sh"));
        assert_eq!(
            repo.alert_webhook_secret.as_ref().map(Secret::expose),
            Some("s3cret")
        );
        assert_eq!(repo.alert_webhook_format, WebhookFormat::Slack);
        assert_eq!(
            repo.staging_health_url.as_deref(),
            Some("http://127.0.0.1:9/staging-health")
        );
        assert_eq!(
            repo.alert_webhook.as_deref(),
            Some("http://127.0.0.1:9/hook")
        );
        assert_eq!(repo.staging_defer_delay_s, Some(7));
        assert!(c.repo_for(&"ORCH-1".parse().unwrap()).is_none());
    }

    #[test]
    fn parse_errors_name_section_and_key() {
        let show = |c: &Config| format!("{:?}", c.settings.workers);
        let cases: &[(&str, Result<&str, &str>)] = &[
            ("[settings]\nworkers = 8\n", Ok("8")),
            (
                "[settings]\nworkerz = 8\n",
                Err("[settings] (line 2): unknown field `workerz`"),
            ),
            (
                "[settings]\nworkers = \"many\"\n",
                Err("[settings] (line 2): invalid type"),
            ),
            ("[settings]\nworkers = -1\n", Err("[settings] (line 2)")),
            (
                "[setings]\n",
                Err("top level (line 1): unknown field `setings`"),
            ),
            (
                &format!("{REPO}tset = \"x\"\n"),
                Err("[repos.app] (line 4): unknown field `tset`"),
            ),
            (
                &format!("{REPO}[repos.app.post_deploy]\nwindow = 5\n"),
                Err("[repos.app.post_deploy] (line 5): unknown field `window`"),
            ),
            (
                &format!("{REPO}[[repos.app.staging]]\nname = \"a\"\ncmd = \"b\"\n"),
                Err("[repos.app.staging] (line 6): unknown field `cmd`"),
            ),
            (
                &format!("{REPO}merge_strategy = \"rebase\"\n"),
                Err("[repos.app] (line 4): unknown variant `rebase`"),
            ),
            (
                "[repos.App]\npath = \"/x\"\nprefix = \"APP\"\n",
                Err("[repos] (line 1): invalid repo name \"App\": must be lower case"),
            ),
            (
                "[repos.app]\npath = \"/x\"\nprefix = \"app\"\n",
                Err("[repos.app] (line 3): invalid prefix \"app\": must be upper case"),
            ),
            (
                "[repos.app]\npath = \"/x\"\n",
                Err("[repos.app] (line 1): missing field `prefix`"),
            ),
            (
                "[agents.writer]\nbackend = \"openai\"\nendpoint = \"http://127.0.0.1:1\"\nmodel = \"m\"\napi_key = \"sk-123\"\n",
                Err("unknown field `api_key`, expected one of"),
            ),
            (
                "[agents.writer]\nbackend = \"gpt\"\n",
                Err("[agents.writer] (line 2): unknown variant `gpt`"),
            ),
            (
                "[pipeline]\nmax_loop = 2\n",
                Err("[pipeline] (line 2): unknown field `max_loop`"),
            ),
            (
                "[pipeline.stages.review]\napprove = true\n",
                Err("[pipeline.stages.review] (line 2): unknown field `approve`"),
            ),
            ("[settings\n", Err("top level (line 1)")),
        ];
        for (text, expect) in cases {
            check(text, &[], show, *expect);
        }
    }

    #[test]
    fn api_key_error_explains_where_keys_go() {
        let text = "[agents.writer]\nbackend = \"command\"\ncommand = \"x\"\napi_key = \"sk\"\n";
        let e = Config::from_toml_str(text, &no_env)
            .unwrap_err()
            .to_string();
        assert!(e.contains("api_key_env"), "{e}");
        assert!(!e.contains("sk\""), "the key must not be echoed: {e}");
    }

    #[test]
    fn retention_parses_units_and_off_and_prints_back() {
        for (text, secs) in [("30s", 30), ("90m", 5400), ("12h", 43_200), ("3d", 259_200)] {
            let r = Retention::parse(text).unwrap();
            assert_eq!(r, Retention::After { secs }, "{text}");
            assert_eq!(r.to_string(), text);
        }
        assert_eq!(Retention::parse(" OFF ").unwrap(), Retention::Off);
        assert_eq!(Retention::Off.period(), None);
        for bad in [
            "",
            "3",
            "d",
            "-1d",
            "1w",
            "1.5h",
            "0s",
            "99999999999999999999d",
        ] {
            assert!(Retention::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(Settings::default().retention, DEFAULT_RETENTION);
    }

    #[test]
    fn validation_errors_name_section_and_key() {
        let ok = |_: &Config| "ok".to_owned();
        let cases: &[(&str, Result<&str, &str>)] = &[
            (REPO, Ok("ok")),
            (
                "[settings]\nworkers = 0\n",
                Err("[settings] workers: must be at least 1"),
            ),
            (
                "[settings]\nlease_s = 0\n",
                Err("[settings] lease_s: must be at least 1"),
            ),
            (
                "[settings]\nbind = \"7878\"\n",
                Err("[settings] bind: \"7878\" is not `host:port`"),
            ),
            (
                "[settings]\nbind = \"localhost:http\"\n",
                Err("[settings] bind"),
            ),
            ("[settings]\nbind = \"[::1]:7878\"\n", Ok("ok")),
            (
                "[settings]\ndatabase_url = \"mysql://x\"\n",
                Err("[settings] database_url"),
            ),
            (
                "[settings]\ndatabase_url = \"postgres://orch@127.0.0.1/orch\"\n",
                Ok("ok"),
            ),
            (
                "[settings]\ntoken = \" \"\n",
                Err("[settings] token: must not be blank"),
            ),
            (
                "[settings]\nmax_cost_usd_per_item = -1.0\n",
                Err("[settings] max_cost_usd_per_item"),
            ),
            ("[settings]\nnode = \"a b\"\n", Err("[settings] node")),
            (
                "[settings]\nlease_s = 60\nnode_grace_s = 30\n",
                Err("[settings] node_grace_s"),
            ),
            (
                "[settings]\npoll_interval_ms = 100\nfetch_cooldown_ms = 200\n",
                Err("[settings] fetch_cooldown_ms: must be at most poll_interval_ms (100)"),
            ),
            (
                "[settings]\nlease_s = 1\npoll_interval_ms = 1000\nfetch_cooldown_ms = 101\n",
                Err("[settings] fetch_cooldown_ms: must be at most a tenth of lease_s"),
            ),
            ("[settings]\nfetch_cooldown_ms = 0\n", Ok("ok")),
            (
                "[settings]\nmax_changed_files = 0\n",
                Err("[settings] max_changed_files: must be at least 1"),
            ),
            (
                "[settings]\nmax_changed_files = 100001\n",
                Err("[settings] max_changed_files: must be at most 100000"),
            ),
            ("[settings]\nmax_changed_files = 100000\n", Ok("ok")),
            ("[settings]\nretention = \"off\"\n", Ok("ok")),
            ("[settings]\nretention = \"12h\"\n", Ok("ok")),
            (
                "[settings]\nretention = \"0d\"\n",
                Err("must be more than zero"),
            ),
            (
                "[settings]\nretention = \"3 days\"\n",
                Err("a duration such as"),
            ),
            (
                "[repos.app]\nprefix = \"APP\"\n",
                Err("[repos.app] path: set `path`"),
            ),
            (
                &format!("{REPO}test = \"  \"\n"),
                Err("[repos.app] test: must not be blank"),
            ),
            (
                &format!("{REPO}default_branch = \"../x\"\n"),
                Err("[repos.app] default_branch"),
            ),
            (
                &format!("{REPO}health_url = \"127.0.0.1:80\"\n"),
                Err("[repos.app] health_url"),
            ),
            (
                &format!("{REPO}alert_webhook = \"ftp://hooks.example\"\n"),
                Err("[repos.app] alert_webhook"),
            ),
            (
                &format!("{REPO}staging_health_url = \"localhost:8081\"\n"),
                Err("[repos.app] staging_health_url"),
            ),
            (
                &format!("{REPO}alert = \" \"\n"),
                Err("[repos.app] alert: must not be blank"),
            ),
            (
                &format!("{REPO}lessons_file = \"../LESSONS.md\"\n"),
                Err("[repos.app] lessons_file"),
            ),
            (
                &format!("{REPO}lessons_file = \"/etc/x\"\n"),
                Err("[repos.app] lessons_file"),
            ),
            (
                &format!("{REPO}test_timeout_s = 0\n"),
                Err("[repos.app] test_timeout_s"),
            ),
            (
                &format!(
                    "{REPO}[[repos.app.staging]]\nname = \"a\"\nrun = \"x\"\n[[repos.app.staging]]\nname = \"a\"\nrun = \"y\"\n"
                ),
                Err("[repos.app] staging: step 2 (\"a\"): the name is used twice"),
            ),
            (
                &format!("{REPO}[[repos.app.staging_smoke]]\nname = \"a\"\nrun = \"\"\n"),
                Err("[repos.app] staging_smoke: step 1 (\"a\"): `run` must not be blank"),
            ),
            (
                &format!("{REPO}[repos.app.post_deploy]\nwindow_s = 10\ninterval_s = 30\n"),
                Err("[repos.app.post_deploy] interval_s: 30 is longer than window_s (10)"),
            ),
            (
                &format!("{REPO}[repos.other]\npath = \"/o\"\nprefix = \"APP\"\n"),
                Err("[repos.other] prefix: prefix `APP` is already used by [repos.app]"),
            ),
            (
                "[agents.x]\nbackend = \"command\"\n",
                Err("[agents.x] command: the `command` backend needs a `command`"),
            ),
            (
                "[agents.x]\nbackend = \"command\"\ncommand = \"my-agent\"\nprompt_via = \"file\"\n",
                Ok("ok"),
            ),
            (
                "[agents.x]\nbackend = \"openai\"\nmodel = \"m\"\n",
                Err("[agents.x] endpoint"),
            ),
            (
                "[agents.x]\nbackend = \"openai\"\nendpoint = \"http://127.0.0.1:8000/v1\"\n",
                Err("[agents.x] model"),
            ),
            (
                "[agents.x]\nbackend = \"openai\"\nendpoint = \"http://h/v1\"\nmodel = \"m\"\napi_key_env = \"sk-abc123\"\n",
                Err("[agents.x] api_key_env: expected the NAME of an environment variable"),
            ),
            (
                "[agents.x]\nbackend = \"claude\"\ntimeout_s = 0\n",
                Err("[agents.x] timeout_s"),
            ),
            (
                "[agents.tester]\nbackend = \"claude\"\n",
                Err("[agents.tester] backend: `tester` is a built-in"),
            ),
            (
                "[pipeline.stages.reveiw]\napproval = true\n",
                Err(
                    "[pipeline.stages.reveiw] reveiw: unknown stage; the stages are intake, analysis",
                ),
            ),
            (
                "[pipeline.stages.review]\nagent = \"critic\"\n",
                Err(
                    "[pipeline.stages.review] agent: stage `review` uses agent `critic`, which has no [agents.critic] section",
                ),
            ),
            (
                "[pipeline.stages.verification]\nagent = \"developer\"\n",
                Err(
                    "[pipeline.stages.verification] agent: stage `verification` is run by built-in `tester`",
                ),
            ),
            (
                "[pipeline.stages.review]\nagent = \"Critic\"\n",
                Err("[pipeline.stages.review] (line 2): invalid agent name \"Critic\""),
            ),
        ];
        for (text, expect) in cases {
            check(text, &[], ok, *expect);
        }
    }

    #[test]
    fn missing_llm_agent_section_is_named() {
        let text = "[agents.analyst]\nbackend = \"claude\"\n";
        let e = Config::from_toml_str(text, &no_env)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "[agents] architect: stage `architecture` uses agent `architect`, which has no [agents.architect] section"
        );
    }

    #[test]
    fn pipeline_overrides() {
        let text = "[agents.critic]\nbackend = \"claude\"\n[pipeline]\nmax_loops = 5\n\
                    [pipeline.stages.review]\nagent = \"critic\"\n[pipeline.stages.deploy]\napproval = true\n";
        let c = Config::from_toml_str(&format!("{text}{AGENTS}"), &no_env).unwrap();
        let p = c.pipeline().unwrap();
        assert_eq!(p.max_loops, 5);
        let review = p.stage(&"review".parse().unwrap()).unwrap();
        assert_eq!(review.agent.as_ref().map(AgentName::as_str), Some("critic"));
        assert!(p.stage(&"deploy".parse().unwrap()).unwrap().approval);
        assert!(!p.stage(&"staging".parse().unwrap()).unwrap().approval);
    }

    #[test]
    fn environment_overrides() {
        type Probe = fn(&Config) -> String;
        type Env<'a> = &'a [(&'a str, &'a str)];
        let cases: Vec<(Env<'_>, &str, Probe, Result<&str, &str>)> = vec![
            (
                &[("ORCH_REPOS_DIR", "/var/orch")],
                "",
                |c| c.settings.repos_dir.clone(),
                Ok("/var/orch"),
            ),
            (
                &[("ORCH_DATABASE_URL", "postgres://db/orch")],
                "",
                |c| format!("{:?}", c.settings.database_url),
                Ok("Some(\"postgres://db/orch\")"),
            ),
            (
                &[("ORCH_BIND", "0.0.0.0:80")],
                "",
                |c| c.settings.bind.clone(),
                Ok("0.0.0.0:80"),
            ),
            (
                &[("ORCH_TOKEN", "t0k")],
                "[settings]\ntoken = \"file\"\n",
                |c| {
                    c.settings
                        .token
                        .as_ref()
                        .map(|t| t.expose().to_owned())
                        .unwrap_or_default()
                },
                Ok("t0k"),
            ),
            (
                &[("ORCH_TOKEN", "")],
                "[settings]\ntoken = \"file\"\n",
                |c| {
                    c.settings
                        .token
                        .as_ref()
                        .map(|t| t.expose().to_owned())
                        .unwrap_or_default()
                },
                Ok("file"),
            ),
            (
                &[("ORCH_WORKERS", "16")],
                "[settings]\nworkers = 2\n",
                |c| c.settings.workers.to_string(),
                Ok("16"),
            ),
            (
                &[("ORCH_LEASE_S", " 90 ")],
                "",
                |c| c.settings.lease_s.to_string(),
                Ok("90"),
            ),
            (
                &[("ORCH_POLL_INTERVAL_MS", "250")],
                "",
                |c| c.settings.poll_interval_ms.to_string(),
                Ok("250"),
            ),
            (
                &[("ORCH_AGENT_CONCURRENCY", "1")],
                "",
                |c| c.settings.agent_concurrency.to_string(),
                Ok("1"),
            ),
            (
                &[("ORCH_AGENT_TIMEOUT_S", "60")],
                "",
                |c| c.settings.agent_timeout_s.to_string(),
                Ok("60"),
            ),
            (
                &[("ORCH_MAX_TOKENS_PER_ITEM", "1000")],
                "",
                |c| format!("{:?}", c.settings.max_tokens_per_item),
                Ok("Some(1000)"),
            ),
            (
                &[("ORCH_MAX_COST_USD_PER_ITEM", "2.5")],
                "",
                |c| format!("{:?}", c.settings.max_cost_usd_per_item),
                Ok("Some(2.5)"),
            ),
            (
                &[("ORCH_NODE", "node-2")],
                "",
                |c| format!("{:?}", c.settings.node),
                Ok("Some(\"node-2\")"),
            ),
            (
                &[("ORCH_MAX_LOOPS", "7")],
                "[pipeline]\nmax_loops = 2\n",
                |c| {
                    c.pipeline()
                        .map(|p| p.max_loops.to_string())
                        .unwrap_or_default()
                },
                Ok("7"),
            ),
            (
                &[],
                "[settings]\nmax_loops = 4\n[pipeline]\nmax_loops = 2\n",
                |c| {
                    c.pipeline()
                        .map(|p| p.max_loops.to_string())
                        .unwrap_or_default()
                },
                Ok("2"),
            ),
            (
                &[],
                "[settings]\nmax_loops = 4\n",
                |c| {
                    c.pipeline()
                        .map(|p| p.max_loops.to_string())
                        .unwrap_or_default()
                },
                Ok("4"),
            ),
            (
                &[("ORCH_RETENTION", "2h")],
                "",
                |c| c.settings.retention.to_string(),
                Ok("2h"),
            ),
            (
                &[("ORCH_RETENTION", "soon")],
                "",
                |_| String::new(),
                Err("environment variable ORCH_RETENTION=\"soon\""),
            ),
            (
                &[("ORCH_WORKERS", "many")],
                "",
                |_| String::new(),
                Err("environment variable ORCH_WORKERS=\"many\": expected a whole number"),
            ),
            (
                &[("ORCH_LEASE_S", "-5")],
                "",
                |_| String::new(),
                Err("ORCH_LEASE_S=\"-5\": expected a whole number"),
            ),
            (
                &[("ORCH_MAX_COST_USD_PER_ITEM", "lots")],
                "",
                |_| String::new(),
                Err("ORCH_MAX_COST_USD_PER_ITEM=\"lots\": expected a number"),
            ),
            (
                &[("ORCH_WORKERS", "0")],
                "",
                |_| String::new(),
                Err("[settings] workers: must be at least 1"),
            ),
            (
                &[("ORCH_BIND", "nowhere")],
                "",
                |_| String::new(),
                Err("[settings] bind"),
            ),
        ];
        for (env, text, probe, expect) in cases {
            check(text, env, probe, expect);
        }
    }

    #[test]
    fn secrets_stay_out_of_debug_output() {
        let c = Config::from_toml_str(
            &format!("[settings]\ntoken = \"hunter2\"\n{AGENTS}"),
            &no_env,
        )
        .unwrap();
        let debug = format!("{c:?}");
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(debug.contains("Secret(***)"));
    }

    #[test]
    fn default_toml_parses_back_valid() {
        for token in ["0123456789abcdef", "we\"ird\\to\nken\t\u{1}ü"] {
            let text = Config::default_toml(token);
            let c = Config::from_toml_str(&text, &no_env).unwrap_or_else(|e| panic!("{e}\n{text}"));
            assert_eq!(c.settings.token.as_ref().map(Secret::expose), Some(token));
            let expected = Settings {
                token: Some(Secret::new(token)),
                ..Settings::default()
            };
            assert_eq!(c.settings, expected);
            assert!(c.repos.is_empty());
            assert_eq!(c.agents.len(), 4);
            assert_eq!(c.pipeline().unwrap(), Pipeline::default_pipeline());
        }
    }

    #[test]
    fn default_toml_examples_are_valid_when_uncommented() {
        // Uncommenting the example lines (all but the prose) must give a valid config too,
        // so the template never teaches a key that does not exist.
        let text = Config::default_toml("tok");
        let uncommented: String = text
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(rest)
                    if rest.starts_with('[')
                        || rest
                            .split_once(" = ")
                            .is_some_and(|(k, _)| !k.contains(' ') && !k.is_empty()) =>
                {
                    // `url` and `path` are alternatives: keep `path` only.
                    if rest.starts_with("url = ") {
                        String::new()
                    } else {
                        rest.to_owned()
                    }
                }
                _ => l.to_owned(),
            })
            .map(|l| l + "\n")
            .collect();
        let c = Config::from_toml_str(&uncommented, &no_env)
            .unwrap_or_else(|e| panic!("{e}\n{uncommented}"));
        assert_eq!(c.repos.len(), 1);
        assert_eq!(c.agents.len(), 5);
        let p = c.pipeline().unwrap();
        assert!(p.stage(&"deploy".parse().unwrap()).unwrap().approval);
        assert_eq!(c.settings.node.as_deref(), Some("build-1"));
    }

    #[test]
    fn prices_come_from_the_table_by_model_and_can_be_overridden() {
        let text = "[agents.analyst]\nbackend = \"codex\"\nmodel = \"openai/gpt-5-codex\"\n\
                    [agents.architect]\nbackend = \"claude\"\nmodel = \"claude-sonnet-4-5-20250929\"\n\
                    [agents.developer]\nbackend = \"aider\"\nmodel = \"my-model\"\n\
                    [agents.reviewer]\nbackend = \"codex\"\nmodel = \"gpt-5\"\nprice = { input_per_mtok = 9.0, output_per_mtok = 9.0 }\n\
                    [prices.\"my-model\"]\ninput_per_mtok = 1.0\noutput_per_mtok = 4.0\n";
        let c = Config::from_toml_str(text, &no_env).unwrap();
        let price = |a: &str| c.agents[&a.parse::<AgentName>().unwrap()].price;
        let p = |i, o| {
            Some(Price {
                input_per_mtok: i,
                output_per_mtok: o,
            })
        };
        assert_eq!(price("analyst"), p(1.25, 10.0));
        assert_eq!(price("architect"), p(3.0, 15.0));
        assert_eq!(price("developer"), p(1.0, 4.0));
        assert_eq!(price("reviewer"), p(9.0, 9.0));
        assert_eq!(p(1.0, 4.0).unwrap().cost(1_000_000, 500_000), 3.0);
        assert_eq!(price_in(&default_prices(), "unknown-model"), None);
        let bad = "[prices.m]\ninput_per_mtok = -1.0\noutput_per_mtok = 1.0\n";
        let e = Config::from_toml_str(&format!("{AGENTS}{bad}"), &no_env).unwrap_err();
        assert!(e.to_string().contains("input_per_mtok"), "{e}");
    }

    #[test]
    fn agent_timeout_falls_back_to_settings() {
        let mut c = Config::from_toml_str(AGENTS, &no_env).unwrap();
        let dev: AgentName = "developer".parse().unwrap();
        assert_eq!(c.agent_timeout_s(&dev), 1800);
        if let Some(a) = c.agents.get_mut(&dev) {
            a.timeout_s = Some(60);
        }
        assert_eq!(c.agent_timeout_s(&dev), 60);
    }
}
