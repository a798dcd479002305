//! The command line of `orch-bench`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// orch's benchmarks: print figures, never pass/fail.
#[derive(Debug, Parser)]
#[command(name = "orch-bench", version)]
pub struct Cli {
    /// Print the figures as JSON on stdout as well.
    #[arg(long, global = true)]
    pub json: bool,
    /// The orch binary to measure (default: `orch` beside this executable).
    #[arg(long, global = true, env = "ORCH_BENCH_ORCH")]
    pub orch: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Queue throughput and pickup latency of the built-in no-op job.
    Queue(BenchQueueArgs),
    /// Latency of `GET /queue` and the dashboard's `GET /` over a store of a year's history
    /// (100,000 jobs, 10,000 tasks by default) around a fixed amount of work in flight.
    QueueApi(BenchQueueApiArgs),
    /// The store's size after N demo-shaped work items written through the store, retention
    /// on (the default 3 days, pruned as maintenance does) and off.
    History(BenchHistoryArgs),
    /// Start-up time and idle resident memory of `orch serve` (embedded SQLite).
    Serve {
        /// Start-ups to measure.
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// The project served: the demo's (`orch demo --setup-only`: its repo, pipeline and
        /// in-process workers) or an empty `orch init` one.
        #[arg(long, value_enum, default_value = "demo")]
        project: ServeProject,
        /// Seconds idle before the resident memory is read.
        #[arg(long, default_value_t = 3)]
        idle_s: u64,
    },
    /// Queue throughput with 1, 2, 4… real `orch worker` processes on one PostgreSQL, each
    /// count's ratio to one process taken in the same round.
    Workers(BenchWorkersArgs),
    /// Many concurrent post-deploy watches against one loopback service: CPU, memory and poll
    /// lateness of the monitor (in-process worker running the real `observe` executor).
    Watches(BenchWatchesArgs),
    /// Many work items in flight at once on one repo through a real `orch serve` of the demo:
    /// orch's own time per stage visit (agent and test time excluded), `GET /queue`, dashboard
    /// and task page latency meanwhile, memory, CPU and worktree disk.
    Items(BenchItemsArgs),
    /// What the sandbox costs one run (start to teardown) against a direct run, same run.
    Sandbox {
        /// Rounds (each runs every mode once).
        #[arg(long, default_value_t = 200)]
        runs: usize,
    },
    /// What running a stage's command under orch's supervisor costs (start to collected
    /// result), and adopting a finished one, against a direct run, same run.
    Supervise {
        /// Rounds (each runs every mode once).
        #[arg(long, default_value_t = 200)]
        runs: usize,
    },
    /// orch's queue and peer job queues (graphile-worker, Node and Rust) in the same run:
    /// interleaved rounds of drains and pickup latency, with orch/peer ratios per round.
    /// `scripts/bench-peers` installs the peers and runs this.
    Peers(BenchPeersArgs),
    /// `orch report` over a store of N finished work items (10,000) seeded through the store:
    /// the binary's wall time and the store read plus computation, median of several runs.
    Report(BenchReportArgs),
}

#[derive(Debug, Args)]
pub struct BenchReportArgs {
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
    /// Finished work items seeded.
    #[arg(long, default_value_t = 10_000)]
    pub items: usize,
    /// Simulated minutes between two items' submissions.
    #[arg(long, default_value_t = 30.0)]
    pub minutes_apart: f64,
    /// Reports timed (the median and the slowest are printed).
    #[arg(long, default_value_t = 7)]
    pub runs: usize,
}

#[derive(Debug, Args)]
pub struct BenchItemsArgs {
    /// Work items submitted (all to the demo's one repo, each a "note" change that merges
    /// without conflicts).
    #[arg(long, default_value_t = 200)]
    pub items: usize,
    /// Jobs `orch serve` runs at once (`ORCH_WORKERS`). Default: one per item (at most 80 on
    /// PostgreSQL, whose stock server takes 100 connections).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Agent runs at once (`ORCH_AGENT_CONCURRENCY`). Default: the workers, so no stage waits
    /// for an agent slot.
    #[arg(long)]
    pub agent_concurrency: Option<u32>,
    /// Think time of the scripted agent per run, milliseconds (`ORCH_DEMO_AGENT_SLEEP_MS`).
    #[arg(long, default_value_t = 0)]
    pub think_ms: u64,
    /// Up to this many milliseconds more per agent run, drawn per run
    /// (`ORCH_DEMO_AGENT_SLEEP_JITTER_MS`): real agents never take the same time, so items
    /// submitted together drift apart instead of reaching every stage in the same second.
    #[arg(long, default_value_t = 0)]
    pub think_jitter_ms: u64,
    /// Spread the submissions evenly over this many seconds (0: one right after the other,
    /// so all items arrive in a burst).
    #[arg(long, default_value_t = 0.0)]
    pub submit_over_s: f64,
    /// Period of the samples (`GET /queue`, `GET /`, a task page, /proc), milliseconds.
    #[arg(long, default_value_t = 250)]
    pub sample_ms: u64,
    /// Run until every item has ended (the whole release track, one item at a time: about
    /// 15 s per item in the demo) instead of until every item has passed verification.
    #[arg(long)]
    pub to_end: bool,
    /// Stop measuring after this many seconds even if the items are not there yet (the
    /// figures then say how far they got).
    #[arg(long, default_value_t = 1800)]
    pub limit_s: u64,
    /// Run on a fresh database `orch_bench_<pid>_1` on this PostgreSQL server (dropped
    /// afterwards) instead of the demo's embedded SQLite.
    #[arg(long)]
    pub pg_url: Option<String>,
    /// Keep the demo project (its repo, worktrees, database and `orch serve`'s log) and print
    /// where it is, instead of removing it.
    #[arg(long)]
    pub keep: bool,
    /// Time every git command orch runs (a bash wrapper first on `orch serve`'s PATH logs
    /// start, end and arguments) and report where git's time goes. The wrapper costs a bash
    /// start per git command, so the other figures of such a run are not the plain ones.
    #[arg(long)]
    pub trace_git: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ServeProject {
    Demo,
    Init,
}

#[derive(Debug, Args)]
pub struct BenchWorkersArgs {
    /// PostgreSQL server (any database on it: it is the admin connection); every run gets a
    /// fresh database `orch_bench_<pid>_<n>` on it, dropped afterwards.
    #[arg(
        long,
        env = "ORCH_TEST_PG_URL",
        default_value = "postgres://root@127.0.0.1:5432/postgres"
    )]
    pub pg_url: String,
    /// Worker process counts to compare (the first is the reference of the ratio).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub processes: Vec<usize>,
    /// Concurrency of each worker process.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Jobs claimed per statement (1 = per-job: one claim and one completion per job).
    #[arg(long, value_delimiter = ',', default_value = "1,100")]
    pub claim_batch: Vec<u32>,
    /// Jobs per drain.
    #[arg(long, default_value_t = 20_000)]
    pub jobs: usize,
    /// Rounds; each round measures every process count once, and the figures are medians.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
}

#[derive(Debug, Args)]
pub struct BenchPeersArgs {
    /// PostgreSQL server (any database on it: it is the admin connection); every drain and
    /// latency run gets a fresh database `orch_bench_<pid>_<n>` on it, dropped afterwards.
    #[arg(
        long,
        env = "ORCH_TEST_PG_URL",
        default_value = "postgres://root@127.0.0.1:5432/postgres"
    )]
    pub pg_url: String,
    /// Node 22 or later, to run the graphile-worker peer program.
    #[arg(long, default_value = "node")]
    pub node: std::path::PathBuf,
    /// The graphile-worker peer program (bench/peers/graphile-worker/peer.mjs, installed beside
    /// its node_modules); without it only orch is measured.
    #[arg(long)]
    pub graphile_worker: Option<std::path::PathBuf>,
    /// The graphile-worker-rs peer binary (bench/peers/graphile-worker-rs, release build).
    #[arg(long)]
    pub graphile_worker_rs: Option<std::path::PathBuf>,
    /// Rounds; each measures every system once per mode, and the figures are medians.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Jobs per drain.
    #[arg(long, default_value_t = 20_000)]
    pub jobs: usize,
    /// Concurrency of the one worker process of each drain.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// orch's claim batch in the batched mode (the peers' local queues hold 100).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(2..=1000))]
    pub claim_batch: u32,
    /// Samples of each pickup latency run (single enqueues into an idle queue).
    #[arg(long, default_value_t = 200)]
    pub latency_jobs: usize,
}

#[derive(Debug, Args)]
pub struct BenchWatchesArgs {
    /// Watches armed at once (one task at stage `observe` each).
    #[arg(long, default_value_t = 1_000)]
    pub watches: usize,
    /// Poll interval of every watch, seconds.
    #[arg(long, default_value_t = 1)]
    pub interval_s: u64,
    /// Watch window, seconds (the run lasts about this long after the first slot).
    #[arg(long, default_value_t = 60)]
    pub window_s: u64,
    /// Jobs the worker runs at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Jobs claimed per statement.
    #[arg(long, default_value_t = 16)]
    pub claim_batch: u32,
    /// Spread the watches' arming over this many milliseconds (0: all armed at one instant,
    /// so every slot is a burst of `watches` polls).
    #[arg(long, default_value_t = 1_000)]
    pub spread_ms: u64,
    /// Prepare every tick's worktree and commit its progress, as the engine did before the
    /// monitor deferred its worktree (the same run's baseline for that change).
    #[arg(long)]
    pub eager_worktree: bool,
    /// The worker's fetch cooldown, ms (`settings.fetch_cooldown_ms`; 0: a claim per due tick,
    /// the same run's baseline for it).
    #[arg(long, default_value_t = orch_domain::config::DEFAULT_FETCH_COOLDOWN_MS)]
    pub fetch_cooldown_ms: u64,
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
pub struct BenchHistoryArgs {
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
    /// Work items written.
    #[arg(long, default_value_t = 1_000)]
    pub items: usize,
    /// Simulated hours between two items' submissions.
    #[arg(long, default_value_t = 2.4)]
    pub hours_apart: f64,
    /// PostgreSQL: give `jobs` and `tasks` the README's autovacuum settings before the run
    /// (default: the server's).
    #[arg(long)]
    pub pg_tuned_autovacuum: bool,
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
    /// Requests measured per route (`GET /queue`, then `GET /`).
    #[arg(long, default_value_t = 50)]
    pub requests: usize,
    /// PostgreSQL: `VACUUM (ANALYZE)` the tasks and jobs after the fill, as autovacuum would
    /// have (sets the visibility map the index-only counts rely on).
    #[arg(long)]
    pub vacuum: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchBackend {
    Sqlite,
    Postgres,
    All,
}
