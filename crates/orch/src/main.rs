//! The `orch` binary: argument parsing, wiring and exit codes. Every command's work lives in a
//! library crate; this crate only connects them (see ARCHITECTURE.md).

mod api_ops;
mod cli;
mod cmd;
mod config_file;
mod context;
mod demo;
mod exit;
mod output;
mod places;
mod reload;
mod runtime;
mod secrets;
mod signals;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Inside a sandbox whose network is an allowlist, orch's binary is the relay that runs
    // first (`orch_exec::sandbox::init_main`): nothing else of orch runs there.
    // A stage's command outlives orch under orch's binary as its supervisor
    // (`orch_exec::supervise::main`): nothing else of orch runs there either.
    let mut args = std::env::args_os();
    let first = args.nth(1);
    let inner: Option<fn(&[std::ffi::OsString]) -> i32> = match first {
        Some(a) if a == orch_exec::sandbox::INIT_ARG => Some(orch_exec::sandbox::init_main),
        Some(a) if a == orch_exec::supervise::ARG => Some(orch_exec::supervise::main),
        _ => None,
    };
    if let Some(inner) = inner {
        let rest: Vec<std::ffi::OsString> = args.collect();
        let code = inner(&rest);
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(&e),
    };
    // Once the command line has read them, before any thread exists: orch's own secrets leave
    // its environment (and the memory `/proc/<pid>/environ` shows), so no child and no other
    // process of its user finds them there.
    secrets::take();
    let json = cli.global.json;
    // The demo and the scripted agent talk to people through stdout; keep logs to warnings.
    let quiet_default = matches!(
        cli.command,
        cli::Command::Demo(_) | cli::Command::DemoAgent { .. } | cli::Command::DemoModelServer
    );
    init_tracing(cli.global.verbose, cli.global.quiet, quiet_default, json);
    // reqwest is built without a default crypto provider (no cmake here): pick ring once.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("orch")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            return exit::report_kind(
                exit::Kind::Failed,
                &format!("cannot start the async runtime: {e}"),
                json,
            );
        }
    };
    let result = runtime.block_on(cmd::run(cli));
    // Do not wait for stray blocking tasks (e.g. a hung stdin reader) on the way out.
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(code) => code,
        Err(e) => exit::report(&e, json),
    }
}

/// A command line clap refused: help and version are printed as asked (exit 0); anything else
/// is a usage error (exit 2), in the JSON error shape when `--json` is among the arguments.
fn usage_error(e: &clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        _ => {}
    }
    if std::env::args_os().any(|a| a == "--json") {
        let text = e.to_string();
        let message = text
            .lines()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("invalid arguments")
            .trim_start_matches("error: ")
            .to_owned();
        return exit::report_kind(exit::Kind::Usage, &message, true);
    }
    let _ = e.print();
    ExitCode::from(exit::Kind::Usage.exit_code())
}

/// A line on stderr: [`output::say`].
pub fn say(line: &str) {
    output::say(line);
}

/// Logs go to stderr: text for people, or one JSON object per line under `--json` (so `orch
/// --json serve` and `worker` speak JSON on every stream).
fn init_tracing(verbose: u8, quiet: bool, quiet_default: bool, json: bool) {
    use tracing_subscriber::EnvFilter;
    let default = match (quiet, verbose) {
        (true, _) => "error",
        (false, 0) if quiet_default => "warn",
        (false, 0) => "warn,orch=info,orch_runner=info",
        (false, 1) => "info",
        (false, _) => "debug,sqlx=warn,hyper=info",
    };
    let filter = EnvFilter::try_from_env("ORCH_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| LossyStderr)
        .with_target(false)
        // Its report of a failed write is an `eprintln!`, which panics on a closed stderr.
        .log_internal_errors(false);
    let _ = if json {
        logs.json().flatten_event(true).try_init()
    } else {
        logs.with_ansi(output::colour(&std::io::stderr()))
            .try_init()
    };
}

/// stderr for logs: a write that fails (a closed pipe, a full disk) is dropped, never an error
/// and never a panic, so a dead log reader cannot take down the task that logged (e.g. the
/// signal handler, which then no longer stopped the process on SIGTERM).
struct LossyStderr;

impl std::io::Write for LossyStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}
