//! One module per subcommand; `run` dispatches.

mod deploys;
mod doctor;
mod gc;
mod init;
mod queue;
mod replay;
mod report;
mod tasks;
pub mod worker;

use std::process::ExitCode;

use anyhow::Result;
use orch_store::ConnectOptions;

use crate::cli::{Cli, Command};
use crate::context::Context;

pub async fn run(cli: Cli) -> Result<ExitCode> {
    // The long-running commands finish their work (and the demo its cleanup) whether or not
    // anyone still reads what they print; the others end when their reader has gone.
    if matches!(
        cli.command,
        Command::Serve(_) | Command::Worker(_) | Command::Demo(_) | Command::DemoModelServer
    ) {
        crate::output::keep_running_when_unread();
    }
    let command = match cli.command {
        // These two make their own context (the demo writes its config first).
        Command::Demo(args) => return crate::demo::run(&cli.global, args).await,
        Command::DemoAgent { .. } => return crate::demo::agent::run(),
        Command::DemoModelServer => return crate::demo::serve_model().await,
        other => other,
    };
    let cx = Context::new(&cli.global)?;
    match command {
        Command::Demo(_) | Command::DemoAgent { .. } | Command::DemoModelServer => {
            Ok(ExitCode::SUCCESS)
        }
        Command::Init(args) => init::run(&cx, args).await,
        Command::Migrate => migrate(&cx).await,
        Command::Serve(args) => worker::serve(&cx, args).await,
        Command::Worker(args) => worker::run(&cx, args).await,
        Command::Queue => queue::run(&cx).await,
        Command::Doctor => doctor::run(&cx).await,
        Command::Costs => queue::costs(&cx).await,
        Command::Report(args) => report::run(&cx, args).await,
        Command::Replay(args) => replay::run(&cx, args).await,
        Command::Gc(args) => gc::run(&cx, args).await,
        Command::Deploys(args) => deploys::run(&cx, &args.repo).await,
        Command::Submit(args) => tasks::submit(&cx, args).await,
        Command::Status(args) => tasks::status(&cx, args).await,
        Command::Logs(args) if args.transcript => tasks::transcripts(&cx, &args.id).await,
        Command::Logs(args) => tasks::logs(&cx, &args.id).await,
        Command::Approve(args) => tasks::operate(&cx, tasks::Op::Approve, &args.id).await,
        Command::Retry(args) => tasks::operate(&cx, tasks::Op::Retry, &args.id).await,
        Command::Cancel(args) => tasks::operate(&cx, tasks::Op::Cancel, &args.id).await,
    }
}

async fn migrate(cx: &Context) -> Result<ExitCode> {
    let store = cx.open_store_with(ConnectOptions::default(), false).await?;
    let report = store.migrate().await?;
    if cx.json {
        let doc = orch_api::dto::Migrated::of(store.target(), &report);
        crate::output::print_json(&orch_api::dto::to_json(&doc));
    } else if report.applied.is_empty() {
        crate::output::outln(&format!(
            "{}: schema is up to date (version {})",
            store.target(),
            report.to
        ));
    } else {
        crate::output::outln(&format!(
            "{}: migrated from version {} to {} ({})",
            store.target(),
            report.from,
            report.to,
            report.applied.join(", ")
        ));
    }
    store.close().await;
    Ok(ExitCode::SUCCESS)
}
