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
