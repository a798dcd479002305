//! `GET /metrics` in the OpenMetrics text format, encoded by the `prometheus-client` crate
//! (the Prometheus project's Rust client): types, `_total` suffixes, units and escaping are
//! the crate's, not hand-written.
//!
//! Each scrape reads the store and this process once ([`Scrape`]) and encodes that reading as
//! one [`Collector`]. Conventions held here:
//! - one metric per meaning, labels only from bounded sets (job state, agent kind, stage,
//!   outcome, repo, token direction); no generic `name` label;
//! - figures that must survive a restart come from the store (jobs, tasks by stage and by
//!   outcome, agent runs, tokens, cost); the per-process ones (runner counters, histograms,
//!   `process_*`) say "this process" in their help text and reset on restart;
//! - when the store does not answer, the scrape still succeeds with `orch_up 0` and the
//!   per-process families, so an alert can fire.

use std::collections::BTreeMap;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::ops::{Histogram, RunnerCounters, WorkerTimings};
use crate::snapshot::QueueSnapshot;

/// The content type of the OpenMetrics text format.
pub(crate) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of the Prometheus text format (0.0.4), what a scraper gets unless it asks
/// for OpenMetrics.
pub(crate) const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The exposition formats `/metrics` speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    OpenMetrics,
    /// The Prometheus text format 0.0.4.
    Text,
}

impl Format {
    /// The format an `Accept` header asks for: OpenMetrics when it names
    /// `application/openmetrics-text` with a non-zero quality (as Prometheus's scraper does),
    /// else the Prometheus text format (also without the header, as the convention is).
    pub(crate) fn negotiate(accept: Option<&str>) -> Format {
        let asks_openmetrics = accept.is_some_and(|a| {
            a.split(',').any(|range| {
                let mut parts = range.split(';').map(str::trim);
                let media = parts.next().unwrap_or_default();
                let zero_q = parts.any(|p| {
                    p.strip_prefix("q=")
                        .and_then(|q| q.trim().parse::<f64>().ok())
                        .is_some_and(|q| q <= 0.0)
                });
                media.eq_ignore_ascii_case("application/openmetrics-text") && !zero_q
            })
        });
        if asks_openmetrics {
            Format::OpenMetrics
        } else {
            Format::Text
        }
    }

    pub(crate) fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => CONTENT_TYPE,
            Format::Text => TEXT_CONTENT_TYPE,
        }
    }
}

/// The same exposition in the Prometheus text format 0.0.4: no `# UNIT` or `# EOF` lines, no
/// `_created` samples, a counter family named by its `_total` samples (a 0.0.4 parser would
/// otherwise read the family and its samples as two metrics), an info family as a gauge named
/// `_info`, and HELP text without the OpenMetrics-only `\"` escape. Samples are unchanged.
pub(crate) fn openmetrics_to_text(openmetrics: &str) -> String {
    let mut types: BTreeMap<&str, &str> = BTreeMap::new();
    for line in openmetrics.lines() {
        if let Some((name, kind)) = line
            .strip_prefix("# TYPE ")
            .and_then(|rest| rest.split_once(' '))
        {
            types.insert(name, kind.trim());
        }
    }
    // The family name a 0.0.4 reader sees, and the type it is declared with.
    let renamed = |name: &str| -> (String, &'static str) {
        match types.get(name).copied() {
            Some("counter") => (format!("{name}_total"), "counter"),
            Some("info") => (format!("{name}_info"), "gauge"),
            Some("gauge") => (name.to_owned(), "gauge"),
            Some("histogram") => (name.to_owned(), "histogram"),
            Some("summary") => (name.to_owned(), "summary"),
            _ => (name.to_owned(), "untyped"),
        }
    };
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some((name, help)) = line
            .strip_prefix("# HELP ")
            .and_then(|rest| rest.split_once(' '))
        {
            let help = help.replace("\\\"", "\"");
            out.push_str(&format!("# HELP {} {help}\n", renamed(name).0));
            continue;
        }
        if let Some(name) = line
            .strip_prefix("# TYPE ")
            .and_then(|rest| rest.split_once(' '))
            .map(|(n, _)| n)
        {
            let (name, kind) = renamed(name);
            out.push_str(&format!("# TYPE {name} {kind}\n"));
            continue;
        }
        let sample = line.split(['{', ' ']).next().unwrap_or_default();
        if let Some(family) = sample.strip_suffix("_created")
            && matches!(
                types.get(family).copied(),
                Some("counter" | "histogram" | "summary")
            )
        {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// What the store said in one scrape (absent when it did not answer).
#[derive(Debug, Default)]
pub(crate) struct StoreFacts {
    /// `(agent, state, count)` of jobs.
    pub jobs: Vec<(String, &'static str, i64)>,
    pub oldest_queued_age_s: f64,
    /// Live leases by agent.
    pub leases_by_agent: BTreeMap<String, u64>,
    /// Seconds since each node was last seen (its beacon), by node.
    pub node_ages: Vec<(String, f64)>,
    pub tasks_by_stage: Vec<(String, i64)>,
    /// Finished tasks by outcome (every outcome, zeros included).
    pub tasks_by_outcome: Vec<(&'static str, i64)>,
    /// Agent-run totals by agent.
    pub usage: Vec<(String, orch_store::Usage)>,
    /// `(agent, outcome, runs)`.
    pub runs_by_outcome: Vec<(String, String, i64)>,
    /// Every job retention has pruned (the latest `jobs.pruned` event's total).
    pub jobs_pruned_total: i64,
    /// `(repo, production deploys, of them rolled back or reverted)` that ended in the last
    /// 24 h (the delivery report over that window).
    pub deploys_by_repo: Vec<(String, u64, u64)>,
}

/// One reading of everything `/metrics` shows.
#[derive(Debug, Default)]
pub(crate) struct Scrape {
    pub version: String,
    pub store: Option<StoreFacts>,
    pub runners: Vec<RunnerCounters>,
    /// Armed post-deploy watches on this machine, by repo.
    pub watches_by_repo: BTreeMap<String, u64>,
    pub timings: WorkerTimings,
    pub process: ProcessStats,
}

impl Scrape {
    /// Builds the store part from a queue snapshot and the usage reads.
    pub(crate) fn store_facts(
        snap: &QueueSnapshot,
        outcomes: &BTreeMap<orch_domain::outcome::Outcome, i64>,
        usage: Vec<(String, orch_store::Usage)>,
        runs_by_outcome: Vec<(String, String, i64)>,
        jobs_pruned_total: i64,
    ) -> StoreFacts {
        let mut leases_by_agent = BTreeMap::new();
        for l in &snap.stats.leases {
            *leases_by_agent.entry(l.agent.clone()).or_default() += 1;
        }
        StoreFacts {
            jobs: snap
                .stats
                .counts
                .iter()
                .map(|c| (c.agent.clone(), c.state.as_str(), c.count))
                .collect(),
            oldest_queued_age_s: snap.oldest_queued_age_ms().unwrap_or(0) as f64 / 1000.0,
            leases_by_agent,
            node_ages: snap
                .nodes
                .iter()
                .map(|n| (n.node.clone(), snap.node_age_ms(n) as f64 / 1000.0))
                .collect(),
            tasks_by_stage: snap.tasks_by_stage.clone(),
            tasks_by_outcome: orch_domain::outcome::Outcome::ALL
                .iter()
                .map(|o| (o.as_str(), outcomes.get(o).copied().unwrap_or(0)))
                .collect(),
            usage,
            runs_by_outcome,
            jobs_pruned_total,
            deploys_by_repo: Vec::new(),
        }
    }
}

/// Renders one scrape in `format` (OpenMetrics ends with `# EOF`).
pub(crate) fn render(scrape: Scrape, format: Format) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(scrape));
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registry) {
        tracing::error!(error = %e, "metrics: encoding failed");
    }
    match format {
        Format::OpenMetrics => out,
        Format::Text => openmetrics_to_text(&out),
    }
}

/// A metric family being written: one descriptor, then its samples.
struct Family<'a>(MetricEncoder<'a>);

/// Starts a family; `unit` is appended to the name by the encoder (and declared in `# UNIT`).
fn family<'a>(
    enc: &'a mut DescriptorEncoder<'_>,
    name: &'a str,
    help: &str,
    unit: Option<&'a Unit>,
    kind: MetricType,
) -> Result<Family<'a>, std::fmt::Error> {
    Ok(Family(enc.encode_descriptor(name, help, unit, kind)?))
}

impl Family<'_> {
    fn gauge<V: prometheus_client::encoding::EncodeGaugeValue>(
        &mut self,
        labels: &[(&str, &str)],
        v: V,
    ) -> Result<(), std::fmt::Error> {
        if labels.is_empty() {
            self.0.encode_gauge(&v)
        } else {
            self.0.encode_family(&labels)?.encode_gauge(&v)
        }
    }

    fn counter<V: prometheus_client::encoding::EncodeCounterValue>(
        &mut self,
        labels: &[(&str, &str)],
        v: V,
    ) -> Result<(), std::fmt::Error> {
        if labels.is_empty() {
            self.0.encode_counter::<NoLabelSet, V, f64>(&v, None)
        } else {
            self.0
                .encode_family(&labels)?
                .encode_counter::<NoLabelSet, V, f64>(&v, None)
        }
    }

    fn histogram(&mut self, labels: &[(&str, &str)], h: &Histogram) -> Result<(), std::fmt::Error> {
        let buckets = per_bucket(h);
        if labels.is_empty() {
            self.0
                .encode_histogram::<NoLabelSet>(h.sum_seconds, h.count, &buckets, None)
        } else {
            self.0
                .encode_family(&labels)?
                .encode_histogram::<NoLabelSet>(h.sum_seconds, h.count, &buckets, None)
        }
    }
}

/// Cumulative `(bound, observations ≤ bound)` to the per-bucket counts the encoder sums up,
/// ending with +Inf.
fn per_bucket(h: &Histogram) -> Vec<(f64, u64)> {
    let mut out = Vec::with_capacity(h.buckets.len() + 1);
    let mut prev = 0u64;
    for (bound, cumulative) in &h.buckets {
        let c = (*cumulative).max(prev);
        out.push((*bound, c - prev));
        prev = c;
    }
    out.push((f64::INFINITY, h.count.saturating_sub(prev)));
    out
}

/// A counter name from a runner and counter name: `[a-z0-9_]` only.
fn metric_name_part(s: &str) -> String {
    let mut out: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    while out.contains("__") {
        out = out.replace("__", "_");
    }
    out.trim_matches('_').to_owned()
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let seconds = Unit::Seconds;
        let bytes = Unit::Bytes;
        let usd = Unit::Other("usd".to_owned());

        let mut f = family(
            &mut enc,
            "orch_up",
            "1 when the store answered this scrape, else 0.",
            None,
            MetricType::Gauge,
        )?;
        f.gauge(&[], u64::from(self.store.is_some()))?;
        let mut f = family(
            &mut enc,
            "orch_build",
            "Build information.",
            None,
            MetricType::Info,
        )?;
        f.0.encode_info(&[("version", self.version.as_str())])?;

        // --- this process ------------------------------------------------------------------
        let p = &self.process;
        if let Some(v) = p.start_time_s {
            let mut f = family(
                &mut enc,
                "process_start_time",
                "Start time of this process since the Unix epoch.",
                Some(&seconds),
                MetricType::Gauge,
            )?;
            f.gauge(&[], v)?;
        }
        if let Some(v) = p.cpu_s {
            let mut f = family(
                &mut enc,
                "process_cpu",
                "User and system CPU time spent by this process.",
                Some(&seconds),
                MetricType::Counter,
            )?;
            f.counter(&[], v)?;
        }
        if let Some(v) = p.resident_bytes {
            let mut f = family(
                &mut enc,
                "process_resident_memory",
                "Resident memory of this process.",
                Some(&bytes),
                MetricType::Gauge,
            )?;
            f.gauge(&[], v)?;
        }
        if let Some(v) = p.virtual_bytes {
            let mut f = family(
                &mut enc,
                "process_virtual_memory",
                "Virtual memory of this process.",
                Some(&bytes),
                MetricType::Gauge,
            )?;
            f.gauge(&[], v)?;
        }
        if let Some(v) = p.open_fds {
            let mut f = family(
                &mut enc,
                "process_open_fds",
                "Open file descriptors of this process.",
                None,
                MetricType::Gauge,
            )?;
            f.gauge(&[], v)?;
        }
        if let Some(v) = p.max_fds {
            let mut f = family(
                &mut enc,
                "process_max_fds",
                "Limit of open file descriptors of this process.",
                None,
                MetricType::Gauge,
            )?;
            f.gauge(&[], v)?;
        }

        // --- the store (all processes, survives restarts) -----------------------------------
        if let Some(s) = &self.store {
            let mut f = family(
                &mut enc,
                "orch_jobs",
                "Jobs by agent (job kind) and state (from the store): queued and running exactly; \
                 done, failed and cancelled only those finished in the last 24 h.",
                None,
                MetricType::Gauge,
            )?;
            for (agent, state, n) in &s.jobs {
                f.gauge(&[("agent", agent), ("state", state)], *n)?;
            }
            let mut f = family(
                &mut enc,
                "orch_jobs_pruned",
                "Finished jobs of finished tasks removed by retention ([settings] retention), by \
                 every process since the store was created (from the store's jobs.pruned events).",
                None,
                MetricType::Counter,
            )?;
            f.counter(&[], u64::try_from(s.jobs_pruned_total).unwrap_or(0))?;
            let mut f = family(
                &mut enc,
                "orch_oldest_queued_job_age",
                "Age of the oldest job that is ready to run but not claimed; 0 when none waits.",
                Some(&seconds),
                MetricType::Gauge,
            )?;
            f.gauge(&[], s.oldest_queued_age_s)?;
            let mut f = family(
                &mut enc,
                "orch_live_leases",
                "Running jobs holding a lease, by agent (job kind), all processes.",
                None,
                MetricType::Gauge,
            )?;
            for (agent, n) in &s.leases_by_agent {
                f.gauge(&[("agent", agent)], *n)?;
            }
            let mut f = family(
                &mut enc,
                "orch_node_last_seen_age",
                "Time since a worker on each node was last seen (its heartbeat beacon); past \
                 node_grace_s the node's pinned jobs are taken over by another node.",
                Some(&seconds),
                MetricType::Gauge,
            )?;
            for (node, age) in &s.node_ages {
                f.gauge(&[("node", node)], *age)?;
            }
            let mut f = family(
                &mut enc,
                "orch_tasks",
                "Tasks by stage (from the store): live stages exactly; done, failed and cancelled \
                 only the tasks that ended in the last 24 h.",
                None,
                MetricType::Gauge,
            )?;
            for (stage, n) in &s.tasks_by_stage {
                f.gauge(&[("stage", stage)], *n)?;
            }
            let mut f = family(
                &mut enc,
                "orch_finished_tasks",
                "Tasks that ended in the last 24 h by outcome: shipped, rolled_back, reverted, \
                 accepted, failed, cancelled (from the store; a retried failure leaves this count).",
                None,
                MetricType::Gauge,
            )?;
            for (outcome, n) in &s.tasks_by_outcome {
                f.gauge(&[("outcome", outcome)], *n)?;
            }
            let mut f = family(
                &mut enc,
                "orch_production_deploys",
                "Production deploys whose end (confirmed, failed or unconfirmed) fell in the last \
                 24 h, by repo (from the events; `orch report` for any range).",
                None,
                MetricType::Gauge,
            )?;
            for (repo, deploys, _) in &s.deploys_by_repo {
                f.gauge(&[("repo", repo)], *deploys as i64)?;
            }
            let mut f = family(
                &mut enc,
                "orch_production_change_failures",
                "Of those deploys, the ones afterwards rolled back or reverted, by repo (the \
                 change failure rate is this over orch_production_deploys).",
                None,
                MetricType::Gauge,
            )?;
            for (repo, _, failures) in &s.deploys_by_repo {
                f.gauge(&[("repo", repo)], *failures as i64)?;
            }
            let mut f = family(
                &mut enc,
                "orch_agent_runs",
                "Agent runs by agent and outcome (running, success, failed, ...), from the store.",
                None,
                MetricType::Counter,
            )?;
            for (agent, outcome, n) in &s.runs_by_outcome {
                f.counter(
                    &[("agent", agent), ("outcome", outcome)],
                    u64::try_from(*n).unwrap_or(0),
                )?;
            }
            let mut f = family(
                &mut enc,
                "orch_agent_tokens",
                "Tokens reported by agent runs, by agent and direction (input, output), from the store.",
                None,
                MetricType::Counter,
            )?;
            for (agent, u) in &s.usage {
                let tokens = |n: i64| u64::try_from(n).unwrap_or(0);
                f.counter(
                    &[("agent", agent), ("direction", "input")],
                    tokens(u.input_tokens),
                )?;
                f.counter(
                    &[("agent", agent), ("direction", "output")],
                    tokens(u.output_tokens),
                )?;
            }
            let mut f = family(
                &mut enc,
                "orch_agent_cost",
                "Cost reported by agent runs in US dollars, by agent, from the store (runs of \
                 unknown cost add nothing: see orch_agent_unknown_cost_runs_total).",
                Some(&usd),
                MetricType::Counter,
            )?;
            for (agent, u) in &s.usage {
                f.counter(&[("agent", agent)], u.cost_usd.max(0.0))?;
            }
            let mut f = family(
                &mut enc,
                "orch_agent_unknown_cost_runs",
                "Agent runs whose cost is not known (running, or no cost reported and no price), \
                 by agent, from the store: orch_agent_cost_usd_total leaves them out, so it is a \
                 lower bound while this is not zero.",
                None,
                MetricType::Counter,
            )?;
            for (agent, u) in &s.usage {
                f.counter(
                    &[("agent", agent)],
                    u64::try_from(u.unknown_cost_runs).unwrap_or(0),
                )?;
            }
        }

        // --- in this process (reset on restart) ---------------------------------------------
        let mut f = family(
            &mut enc,
            "orch_post_deploy_watches_armed",
            "Armed post-deploy watches on this machine, by repo (from the sentinel files).",
            None,
            MetricType::Gauge,
        )?;
        for (repo, n) in &self.watches_by_repo {
            f.gauge(&[("repo", repo)], *n)?;
        }
        let mut names: Vec<(String, String, u64)> = Vec::new();
        for r in &self.runners {
            for (counter, value) in &r.counters {
                let name = format!(
                    "orch_{}_{}",
                    metric_name_part(&r.runner),
                    metric_name_part(counter)
                );
                let help = format!(
                    "Counter `{}` of the {} in this process since it started (resets on restart).",
                    counter.escape_debug(),
                    r.runner.escape_debug()
                );
                names.push((name, help, *value));
            }
        }
        names.sort();
        names.dedup_by(|a, b| a.0 == b.0);
        for (name, help, value) in &names {
            let mut f = family(&mut enc, name, help, None, MetricType::Counter)?;
            f.counter(&[], *value)?;
        }
        let t = &self.timings;
        let mut f = family(
            &mut enc,
            "orch_job_duration",
            "Handler run time of jobs run by this process, by agent (job kind).",
            Some(&seconds),
            MetricType::Histogram,
        )?;
        for (agent, h) in &t.job_seconds {
            f.histogram(&[("agent", agent)], h)?;
        }
        let mut f = family(
            &mut enc,
            "orch_job_claim_wait",
            "How long jobs claimed by this process had been ready before their claim.",
            Some(&seconds),
            MetricType::Histogram,
        )?;
        f.histogram(&[], &t.claim_wait)?;
        let mut f = family(
            &mut enc,
            "orch_claim_query",
            "Round trip of one claim statement of this process (with the completions it carries).",
            Some(&seconds),
            MetricType::Histogram,
        )?;
        f.histogram(&[], &t.claim_query)?;
        Ok(())
    }
}

// ----- process_* from /proc ------------------------------------------------------------------

/// This process's resource use, read from `/proc/self` (Linux); `None` where unreadable.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct ProcessStats {
    pub start_time_s: Option<f64>,
    pub cpu_s: Option<f64>,
    pub resident_bytes: Option<u64>,
    pub virtual_bytes: Option<u64>,
    pub open_fds: Option<u64>,
    pub max_fds: Option<u64>,
}

impl ProcessStats {
    /// Reads `/proc/self/{stat,fd,limits}` and `/proc/stat` (boot time).
    pub(crate) fn read() -> ProcessStats {
        // SAFETY: sysconf only reads a configuration value.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        // SAFETY: as above.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let stat = std::fs::read_to_string("/proc/self/stat").ok();
        let boot = std::fs::read_to_string("/proc/stat").ok();
        let mut out = parse_stat(
            stat.as_deref().unwrap_or(""),
            boot.as_deref().unwrap_or(""),
            ticks,
            page,
        );
        out.open_fds = std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|d| d.count() as u64);
        out.max_fds = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|l| parse_max_fds(&l));
        out
    }
}

/// `/proc/self/stat` (fields after the command's closing parenthesis) and `/proc/stat`'s
/// `btime` line to start time, CPU seconds and memory.
fn parse_stat(stat: &str, proc_stat: &str, ticks: i64, page: i64) -> ProcessStats {
    let mut out = ProcessStats::default();
    let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return out;
    };
    // Fields from the state (field 3) on; index 0 here is field 3.
    let f: Vec<&str> = after.split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    if ticks > 0 {
        let tps = ticks as f64;
        if let (Some(u), Some(s)) = (num(11), num(12)) {
            out.cpu_s = Some((u + s) as f64 / tps);
        }
        let btime = proc_stat
            .lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<u64>().ok());
        if let (Some(start), Some(btime)) = (num(19), btime) {
            out.start_time_s = Some(btime as f64 + start as f64 / tps);
        }
    }
    out.virtual_bytes = num(20);
    if page > 0 {
        out.resident_bytes = num(21).map(|pages| pages * page as u64);
    }
    out
}

/// The soft limit of `Max open files` in `/proc/self/limits`.
fn parse_max_fds(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cumulative_buckets_become_per_bucket_counts_ending_in_inf() {
        let h = Histogram {
            buckets: vec![(0.005, 1), (0.1, 3)],
            sum_seconds: 0.25,
            count: 4,
        };
        assert_eq!(
            per_bucket(&h),
            vec![(0.005, 1), (0.1, 2), (f64::INFINITY, 1)]
        );
        assert_eq!(per_bucket(&Histogram::default()), vec![(f64::INFINITY, 0)]);
    }

    #[test]
    fn names_are_sanitized() {
        for (input, want) in [
            ("staging_runner", "staging_runner"),
            ("we\"ird\\run\nner", "we_ird_run_ner"),
            ("Tool-Error", "tool_error"),
        ] {
            assert_eq!(metric_name_part(input), want, "{input:?}");
        }
    }

    #[test]
    fn proc_stat_is_parsed() {
        // pid (comm with ) spaces) state ppid ... utime=14th stime=15th starttime=22nd vsize rss
        let stat = "42 (orch (x) y) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 8 0 1000 123456789 300 18446744073709551615";
        let got = parse_stat(stat, "cpu 1 2 3\nbtime 1700000000\n", 100, 4096);
        assert_eq!(got.cpu_s, Some(3.0));
        assert_eq!(got.start_time_s, Some(1_700_000_010.0));
        assert_eq!(got.virtual_bytes, Some(123_456_789));
        assert_eq!(got.resident_bytes, Some(300 * 4096));
        assert_eq!(
            parse_stat("garbage", "", 100, 4096),
            ProcessStats::default()
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 524288               files\n";
        assert_eq!(parse_max_fds(limits), Some(1024));
    }

    #[test]
    fn the_real_process_is_readable() {
        let p = ProcessStats::read();
        assert!(p.start_time_s.is_some_and(|s| s > 1.0e9), "{p:?}");
        assert!(p.resident_bytes.is_some_and(|b| b > 0), "{p:?}");
        assert!(p.open_fds.is_some_and(|n| n > 0), "{p:?}");
        assert!(p.cpu_s.is_some(), "{p:?}");
    }
}
