//! Shutdown on signals: the first SIGTERM/SIGINT asks for a graceful stop (running jobs get
//! their grace period), the second cuts the grace short (leases are released), the third exits
//! at once.

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Returns (stop, hard_stop) tokens driven by SIGTERM and SIGINT.
pub fn shutdown_tokens() -> anyhow::Result<(CancellationToken, CancellationToken)> {
    let stop = CancellationToken::new();
    let hard = CancellationToken::new();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let (s, h) = (stop.clone(), hard.clone());
    tokio::spawn(async move {
        let mut count = 0;
        loop {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            count += 1;
            match count {
                // Act first, then say so: logging must never stand between a signal and
                // its effect.
                1 => {
                    s.cancel();
                    tracing::info!(
                        "shutting down: finishing running jobs (signal again to stop now)"
                    );
                }
                2 => {
                    h.cancel();
                    tracing::warn!("stopping now: releasing leases of unfinished jobs");
                }
                _ => std::process::exit(130),
            }
        }
    });
    Ok((stop, hard))
}
