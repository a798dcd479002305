//! `orch gc`: retention by hand. The same batches the maintenance pass of every `orch serve` and
//! `orch worker` runs (`orch_runner::maintenance::prune`), to the end of the backlog.

use std::process::ExitCode;

use anyhow::Result;
use orch_domain::config::{DEFAULT_RETENTION, Retention};
use orch_runner::maintenance::{self, PRUNE_BATCH, PRUNE_PAUSE};

use crate::cli::GcArgs;
use crate::context::Context;
use crate::exit::{Kind, fail};

pub async fn run(cx: &Context, args: GcArgs) -> Result<ExitCode> {
    let retention = match &args.retention {
        Some(text) => {
            Retention::parse(text).map_err(|e| fail(Kind::Usage, format!("--retention {e}")))?
        }
        None => cx
            .config
            .as_ref()
            .map_or(DEFAULT_RETENTION, |c| c.settings.retention),
    };
    let store = cx.open_store().await?;
    let (report, finished_before_ms) = match retention.period() {
        Some(period) => {
            let cutoff = store
                .now_ms()
                .saturating_sub(i64::try_from(period.as_millis()).unwrap_or(i64::MAX));
            let report =
                maintenance::prune(&store, period, PRUNE_BATCH, PRUNE_PAUSE, u32::MAX).await;
            (report, Some(cutoff))
        }
        None => (
            store
                .pruned_total()
                .await
                .map(|total| maintenance::PruneReport {
                    total,
                    ..Default::default()
                })
                .map_err(anyhow::Error::from),
            None,
        ),
    };
    let target = store.target();
    store.close().await;
    let report = report?;
    if cx.json {
        let doc = orch_api::dto::Gc {
            database: target,
            retention: retention.to_string(),
            finished_before_ms,
            pruned: report.jobs,
            batches: report.batches,
            pruned_total: report.total,
        };
        crate::output::print_json(&orch_api::dto::to_json(&doc));
    } else if finished_before_ms.is_none() {
        crate::output::outln(&format!(
            "{target}: retention is off; nothing pruned ({} pruned in all)",
            report.total
        ));
    } else {
        crate::output::outln(&format!(
            "{target}: pruned {} finished job(s) of tasks that ended more than {retention} ago, in {} batch(es); {} pruned in all",
            report.jobs, report.batches, report.total
        ));
    }
    Ok(ExitCode::SUCCESS)
}
