//! `orch-bench`: orch's benchmarks, kept out of the `orch` binary so that it carries no test
//! support (the store's `testing` feature) and spawns no process outside `crates/exec`.
//! Figures are printed (stderr, or JSON on stdout with `--json`), never asserted; see
//! docs/benchmarks.md for the method and recorded figures.
//!
//! The workers and servers measured are real `orch` processes: the binary next to this one
//! (`target/release/orch` beside `target/release/orch-bench`), or `--orch PATH`.

mod cli;
mod history;
mod items;
mod peers;
mod pgbench;
mod queue;
mod report;
mod sandbox;
mod scale;
mod supervise;
mod watches;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser as _;

use crate::cli::{Cli, Command};

/// What every benchmark needs to know besides its own arguments.
pub struct Context {
    /// Print the figures as JSON on stdout.
    pub json: bool,
    /// The `orch` binary to run as workers and servers.
    pub orch: PathBuf,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("orch-bench: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("orch-bench: {e:#}");
            ExitCode::from(1)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let orch = match cli.orch {
        Some(path) => path,
        None => std::env::current_exe()
            .context("cannot find this executable to find orch beside it")?
            .with_file_name("orch"),
    };
    anyhow::ensure!(
        orch.is_file(),
        "no orch binary at {} (build it with `cargo build --release -p orch`, or pass --orch PATH)",
        orch.display()
    );
    let cx = Context {
        json: cli.json,
        orch,
    };
    match cli.command {
        Command::Queue(args) => queue::queue(&cx, args).await,
        Command::QueueApi(args) => queue::queue_api(&cx, args).await,
        Command::History(args) => history::history(&cx, args).await,
        Command::Serve {
            runs,
            project,
            idle_s,
        } => queue::serve(&cx, runs, project, idle_s).await,
        Command::Workers(args) => scale::workers(&cx, args).await,
        Command::Watches(args) => watches::watches(&cx, args).await,
        Command::Items(args) => items::items(&cx, args).await,
        Command::Peers(args) => peers::peers(&cx, args).await,
        Command::Report(args) => report::report(&cx, args).await,
        Command::Sandbox { runs } => sandbox::sandbox(&cx, runs)
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Supervise { runs } => supervise::supervise(&cx, runs)
            .await
            .map(|()| ExitCode::SUCCESS),
    }
}

/// Prints `v` as pretty JSON on stdout.
pub fn print_json(v: &serde_json::Value) {
    match serde_json::to_string_pretty(v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("orch-bench: cannot render JSON: {e}"),
    }
}
