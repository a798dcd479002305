//! Command-line grammar. Flags override `ORCH_*` environment variables, which override
//! `orch.toml`, which overrides built-in defaults.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "orch",
    version,
    about = "A restart-safe orchestrator for AI-agent delivery pipelines",
    after_help = crate::exit::HELP
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
pub struct Global {
    /// The config file (its directory is the project root: `.orch/` lives beside it).
    #[arg(long, global = true, env = "ORCH_CONFIG", default_value = "orch.toml")]
    pub config: PathBuf,
    /// Database: `sqlite:///path/orch.db` or `postgres://user@host/db`. Default: `.orch/orch.db`
    /// beside the config file.
    #[arg(long, global = true, env = "ORCH_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Machine-readable output.
    #[arg(long, global = true)]
    pub json: bool,
    /// More logging (-v, -vv). `ORCH_LOG` takes a full filter.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Only errors.
    #[arg(short, long, global = true)]
    pub quiet: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create `orch.toml` and the embedded database `.orch/orch.db` in the current directory.
    Init(InitArgs),
    /// Bring the database schema up to date (safe to run from many processes at once).
    Migrate,
    /// Run the API, workers and maintenance in one process.
    Serve(ServeArgs),
    /// Run workers and maintenance only (scale-out: many of these can share one PostgreSQL).
    Worker(WorkerArgs),
    /// Show the queue: jobs by state and by agent, oldest queued age, live leases.
    Queue,
    /// Submit a new work item.
    Submit(SubmitArgs),
    /// Show all tasks, or one work item's stage, timeline and agent runs.
    Status(StatusArgs),
    /// A work item's full event log and agent runs.
    Logs(LogsArgs),
    /// Let a work item waiting at an `approval = true` stage go on.
    Approve(IdArg),
    /// Put a failed work item back at the stage it failed in.
    Retry(IdArg),
    /// Cancel a work item (its running job is stopped).
    Cancel(IdArg),
    /// A repo's deploy history (what each deploy shipped, verdicts, rollbacks, reverts), items
    /// in flight and lessons.
    Deploys(RepoArg),
    /// Check git, the database, agents and repo commands; say what is missing and how to fix it.
    Doctor,
    /// What agent runs cost, by repo, by stage and by day (UTC), with the runs of unknown cost
    /// counted (the same report as `GET /costs`).
    Costs,
    /// Delivery metrics: the four DORA keys (deployment frequency, lead time, change failure
    /// rate, time to restore) and orch's own figures (cost, agent runs and review loops per
    /// shipped item, staging verdicts, release-track waits, by agent backend and model), per
    /// repo and overall (the same report as `GET /report`).
    Report(ReportArgs),
    /// Re-derive every decision of a work item (gates, next stages, the staging classification,
    /// the post-deploy watch's verdict) from what was recorded, with today's rules, and say
    /// which agree; `--set` asks what other thresholds would have decided. Reads only: no
    /// network, no writes. Exit 1 when a decision disagrees (without --set).
    Replay(ReplayArgs),
    /// Prune now what retention removes (finished jobs of finished tasks older than `[settings]
    /// retention`), in small batches, each recorded as a `jobs.pruned` event; safe beside
    /// running workers and safe to kill.
    Gc(GcArgs),
    /// Run the whole pipeline on a sample service in a directory, in about a minute.
    Demo(DemoArgs),
    /// The demo's scripted agent (run by the demo's `command` backend, not by people).
    #[command(hide = true)]
    DemoAgent {
        /// Arguments a Claude Code style preset passes (`-p --output-format json …`); ignored.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        rest: Vec<String>,
    },
    /// The demo's scripted model server on 127.0.0.1, for a Claude Code pointed at it (tests and
    /// the walkthrough): prints its URL, serves until SIGTERM, Ctrl-C or stdin closes.
    #[command(hide = true)]
    DemoModelServer,
}

#[derive(Debug, Args)]
pub struct SubmitArgs {
    /// The repo (a `[repos.<name>]` of orch.toml).
    #[arg(long)]
    pub repo: String,
    /// One line.
    #[arg(long)]
    pub title: String,
    /// The request's body from a file (`-` for stdin).
    #[arg(long)]
    pub body_file: Option<std::path::PathBuf>,
    /// The body as text.
    #[arg(long, conflicts_with = "body_file")]
    pub body: Option<String>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// A work item id like APP-12; without it, all tasks.
    pub id: Option<String>,
    /// Only tasks at this stage.
    #[arg(long)]
    pub stage: Option<String>,
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
}

#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// A work item id like APP-12; or `--repo` for every item of a repo in a range.
    #[arg(required_unless_present = "repo", conflicts_with = "repo")]
    pub id: Option<String>,
    /// Every item of this repo alive in the range (`--since`, `--until`).
    #[arg(long)]
    pub repo: Option<String>,
    /// The range's start, as `orch report` reads it. Default: 30 days before `--until`.
    #[arg(long, requires = "repo")]
    pub since: Option<String>,
    /// The range's end (excluded). Default: now.
    #[arg(long, requires = "repo")]
    pub until: Option<String>,
    /// Replay with a threshold changed, `key=value` (repeatable): post_deploy.failure_limit,
    /// post_deploy.consecutive_fail_limit, post_deploy.healthy_max_fails,
    /// post_deploy.healthy_last_valid_pass, staging.defer_limit.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Only this repo's items.
    #[arg(long)]
    pub repo: Option<String>,
    /// The range's start: an RFC 3339 time (2026-12-01T08:00:00Z), a date (2026-12-01, UTC),
    /// epoch milliseconds, or a duration before now (90m, 36h, 7d, 2w). Default: 30 days before
    /// `--until`.
    #[arg(long)]
    pub since: Option<String>,
    /// The range's end (excluded), in the same forms. Default: now.
    #[arg(long)]
    pub until: Option<String>,
}

#[derive(Debug, Args)]
pub struct GcArgs {
    /// The retention to apply instead of `[settings] retention` (`3d`, `12h`, `90m`, `30s`).
    #[arg(long)]
    pub retention: Option<String>,
}

#[derive(Debug, Args)]
pub struct IdArg {
    /// A work item id like APP-12.
    pub id: String,
}

#[derive(Debug, Args)]
pub struct LogsArgs {
    /// A work item id like APP-12.
    pub id: String,
    /// Print each agent run's transcript (its messages, tool calls and results, commands and
    /// exit codes, as kept on this machine) and the diff it left, instead of the event log.
    #[arg(long)]
    pub transcript: bool,
}

#[derive(Debug, Args)]
pub struct RepoArg {
    /// A repo name (a `[repos.<name>]` of orch.toml).
    pub repo: String,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Where to build the demo (kept afterwards); default: a new temp dir.
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
    /// Only create the directory, repo, config and database; run nothing (for tests).
    #[arg(long, hide = true)]
    pub setup_only: bool,
    /// Who runs the LLM stages: the scripted stand-in, or the real Claude Code (the `claude`
    /// preset) against the demo's scripted model server on 127.0.0.1.
    #[arg(long, value_enum, default_value_t = DemoAgent::Scripted)]
    pub agent: DemoAgent,
}

/// `orch demo --agent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoAgent {
    /// The demo's scripted stand-in (`orch demo-agent`).
    Scripted,
    /// The real Claude Code, driven by the demo's scripted model server.
    Claude,
}

#[derive(Debug, Args)]
pub struct InitArgs {
    /// Overwrite an existing orch.toml.
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Args, Clone)]
pub struct WorkerArgs {
    /// Jobs running at once in this process.
    #[arg(long, env = "ORCH_WORKERS")]
    pub concurrency: Option<usize>,
    /// Claim up to this many jobs per statement (1 = one claim per job).
    #[arg(long, default_value_t = 4)]
    pub claim_batch: u32,
    /// Lease length in milliseconds (a dead worker's jobs are rescued after this).
    #[arg(long, env = "ORCH_LEASE_MS")]
    pub lease_ms: Option<u64>,
    /// Seconds running jobs get to finish on shutdown before their leases are released.
    #[arg(long, default_value_t = 30)]
    pub grace_s: u64,
    /// This machine's node name: deploy and watch jobs are pinned to the node that runs them,
    /// and move to another node only once it has not been seen for `node_grace_s`.
    #[arg(long, env = "ORCH_NODE")]
    pub node: Option<String>,
    /// Worker id recorded on claimed jobs (default: host-pid-random).
    #[arg(long)]
    pub worker_id: Option<String>,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub worker: WorkerArgs,
    /// Address of the HTTP API and dashboard.
    #[arg(long, env = "ORCH_BIND")]
    pub bind: Option<String>,
}
