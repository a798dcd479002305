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
    Logs(IdArg),
    /// Let a work item waiting at an `approval = true` stage go on.
    Approve(IdArg),
    /// Put a failed work item back at the stage it failed in.
    Retry(IdArg),
    /// Cancel a work item (its running job is stopped).
    Cancel(IdArg),
    /// Check git, the database, agents and repo commands; say what is missing and how to fix it.
    Doctor,
    /// Run the whole pipeline on a sample service in a directory, in about a minute.
    Demo(DemoArgs),
    /// The demo's scripted agent (run by the demo's `command` backend, not by people).
    #[command(hide = true)]
    DemoAgent {
        /// Arguments a Claude Code style preset passes (`-p --output-format json …`); ignored.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        rest: Vec<String>,
    },
    /// Benchmarks that print figures (never pass/fail).
    #[command(subcommand)]
    Bench(BenchCommand),
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
pub struct IdArg {
    /// A work item id like APP-12.
    pub id: String,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Where to build the demo (kept afterwards); default: a new temp dir.
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
    /// Only create the directory, repo, config and database; run nothing (for tests).
    #[arg(long, hide = true)]
    pub setup_only: bool,
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
    /// This machine's node name (jobs pinned to a node run only there).
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

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Queue throughput and pickup latency of the built-in no-op job.
    Queue(BenchQueueArgs),
    /// Median latency of `GET /queue` over a large store (100,000 jobs, 10,000 tasks).
    QueueApi(BenchQueueApiArgs),
    /// Start-up time and idle resident memory of `orch serve` (embedded SQLite).
    Serve {
        /// Start-ups to measure.
        #[arg(long, default_value_t = 5)]
        runs: usize,
    },
}

#[derive(Debug, Args)]
pub struct BenchQueueArgs {
    /// Which backends to measure.
    #[arg(long, value_enum, default_value = "all")]
    pub backend: BenchBackend,
    /// PostgreSQL server for the run; a fresh schema in its `orch_test` database is used.
    #[arg(
        long,
        env = "ORCH_TEST_PG_URL",
        default_value = "postgres://root@127.0.0.1:5432/test"
    )]
    pub pg_url: String,
    /// Jobs per throughput run.
    #[arg(long, default_value_t = 20_000)]
    pub jobs: usize,
    /// Jobs for the latency run (enqueued one at a time into an idle queue).
    #[arg(long, default_value_t = 300)]
    pub latency_jobs: usize,
    /// Jobs claimed per statement in the batched runs (the peers' local queues hold 100).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(2..=1000))]
    pub claim_batch: u32,
    /// Seconds of each pgbench baseline run on PostgreSQL (0: skip the baseline).
    #[arg(long, default_value_t = 10)]
    pub baseline_s: u32,
}

#[derive(Debug, Args)]
pub struct BenchQueueApiArgs {
    /// Which backends to measure.
    #[arg(long, value_enum, default_value = "all")]
    pub backend: BenchBackend,
    /// PostgreSQL server for the run; a fresh schema in its `orch_test` database is used.
    #[arg(
        long,
        env = "ORCH_TEST_PG_URL",
        default_value = "postgres://root@127.0.0.1:5432/test"
    )]
    pub pg_url: String,
    /// Jobs in the store.
    #[arg(long, default_value_t = 100_000)]
    pub jobs: usize,
    /// Tasks in the store.
    #[arg(long, default_value_t = 10_000)]
    pub tasks: usize,
    /// `GET /queue` requests measured.
    #[arg(long, default_value_t = 50)]
    pub requests: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchBackend {
    Sqlite,
    Postgres,
    All,
}
