//! `GET /metrics`: the queue snapshot in the Prometheus text exposition format 0.0.4, written by
//! hand (a few gauges do not justify a metrics registry). When the store cannot answer, the
//! scrape still succeeds with `orch_up 0` and the in-process families, so an alert can fire.

use std::fmt::Write as _;

use crate::ops::{Histogram, WorkerTimings};
use crate::snapshot::QueueSnapshot;

/// The content type of the text exposition format.
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What `/metrics` shows beyond the queue snapshot.
pub(crate) struct Extra<'a> {
    /// Agent-run totals by agent from the store; `None` when the store did not answer.
    pub usage: Option<&'a [(String, orch_store::Usage)]>,
    /// This process's worker timings.
    pub timings: &'a WorkerTimings,
}

/// Renders the exposition. `up` is false when the store did not answer; the snapshot's store
/// fields are then empty and their families are left out.
pub(crate) fn render(snap: &QueueSnapshot, up: bool, extra: &Extra<'_>) -> String {
    let mut x = Exposition::default();
    x.family(
        "orch_up",
        "1 when the store answered this scrape, else 0.",
        "gauge",
    );
    x.sample("orch_up", &[], if up { 1.0 } else { 0.0 });
    x.family(
        "orch_build_info",
        "Build information; the value is always 1.",
        "gauge",
    );
    x.sample("orch_build_info", &[("version", &snap.version)], 1.0);
    x.family(
        "orch_uptime_seconds",
        "Seconds since the API server started.",
        "gauge",
    );
    x.sample("orch_uptime_seconds", &[], snap.uptime_ms as f64 / 1000.0);

    if up {
        x.family("orch_jobs", "Jobs by state.", "gauge");
        for st in orch_store::JobState::ALL {
            x.sample(
                "orch_jobs",
                &[("state", st.as_str())],
                snap.jobs_in(st) as f64,
            );
        }
        x.family(
            "orch_jobs_by_agent",
            "Jobs by agent (job kind) and state.",
            "gauge",
        );
        for c in &snap.stats.counts {
            x.sample(
                "orch_jobs_by_agent",
                &[("agent", &c.agent), ("state", c.state.as_str())],
                c.count as f64,
            );
        }
        x.family(
            "orch_oldest_queued_age_seconds",
            "Age of the oldest job that is ready to run but not claimed; 0 when none waits.",
            "gauge",
        );
        let age = snap.oldest_queued_age_ms().unwrap_or(0);
        x.sample("orch_oldest_queued_age_seconds", &[], age as f64 / 1000.0);
        x.family("orch_live_leases", "Running jobs holding a lease.", "gauge");
        x.sample("orch_live_leases", &[], snap.stats.leases.len() as f64);
        x.family(
            "orch_live_leases_by_agent",
            "Running jobs holding a lease, by agent (job kind).",
            "gauge",
        );
        let mut by_agent: std::collections::BTreeMap<&str, u64> = Default::default();
        for l in &snap.stats.leases {
            *by_agent.entry(l.agent.as_str()).or_default() += 1;
        }
        for (agent, n) in by_agent {
            x.sample("orch_live_leases_by_agent", &[("agent", agent)], n as f64);
        }
        x.family("orch_tasks", "Tasks by stage.", "gauge");
        for (stage, n) in &snap.tasks_by_stage {
            x.sample("orch_tasks", &[("stage", stage)], *n as f64);
        }
    }

    x.family(
        "orch_runner_counter",
        "In-process counters of deterministic runners and workers (reset on restart).",
        "untyped",
    );
    for r in &snap.runners {
        for (name, value) in &r.counters {
            x.sample(
                "orch_runner_counter",
                &[("runner", &r.runner), ("name", name)],
                *value as f64,
            );
        }
    }
    x.family(
        "orch_active_observations",
        "Armed post-deploy watches on this machine.",
        "gauge",
    );
    x.sample(
        "orch_active_observations",
        &[],
        snap.observations.len() as f64,
    );
    x.family(
        "orch_observation_polls",
        "Polls recorded so far by each armed post-deploy watch.",
        "gauge",
    );
    for o in &snap.observations {
        x.sample(
            "orch_observation_polls",
            &[("work_item_id", &o.work_item_id), ("repo", &o.repo)],
            o.polls as f64,
        );
    }
    if let Some(usage) = extra.usage {
        x.family(
            "orch_agent_runs_total",
            "Agent runs started, by agent (all processes, from the store).",
            "counter",
        );
        for (agent, u) in usage {
            x.sample("orch_agent_runs_total", &[("agent", agent)], u.runs as f64);
        }
        x.family(
            "orch_agent_tokens_total",
            "Tokens reported by agent runs, by agent and direction (input, output).",
            "counter",
        );
        for (agent, u) in usage {
            x.sample(
                "orch_agent_tokens_total",
                &[("agent", agent), ("direction", "input")],
                u.input_tokens as f64,
            );
            x.sample(
                "orch_agent_tokens_total",
                &[("agent", agent), ("direction", "output")],
                u.output_tokens as f64,
            );
        }
        x.family(
            "orch_agent_cost_usd_total",
            "Cost reported by agent runs in US dollars, by agent.",
            "counter",
        );
        for (agent, u) in usage {
            x.sample("orch_agent_cost_usd_total", &[("agent", agent)], u.cost_usd);
        }
    }
    let t = extra.timings;
    x.family(
        "orch_job_duration_seconds",
        "Handler run time of jobs run by this process, by agent (job kind).",
        "histogram",
    );
    for (agent, h) in &t.job_seconds {
        x.histogram("orch_job_duration_seconds", &[("agent", agent)], h);
    }
    x.family(
        "orch_job_claim_wait_seconds",
        "How long jobs claimed by this process had been ready before their claim.",
        "histogram",
    );
    x.histogram("orch_job_claim_wait_seconds", &[], &t.claim_wait);
    x.family(
        "orch_claim_query_seconds",
        "Round trip of one claim statement of this process (with the completions it carries).",
        "histogram",
    );
    x.histogram("orch_claim_query_seconds", &[], &t.claim_query);

    // The store's clock is in the snapshot only when the store answered.
    if up {
        x.family(
            "orch_observation_remaining_seconds",
            "Seconds until each armed watch's deadline; negative when it is overdue.",
            "gauge",
        );
        let now = snap.stats.now;
        for o in &snap.observations {
            x.sample(
                "orch_observation_remaining_seconds",
                &[("work_item_id", &o.work_item_id), ("repo", &o.repo)],
                o.deadline_ms.saturating_sub(now) as f64 / 1000.0,
            );
        }
    }
    x.out
}

#[derive(Default)]
struct Exposition {
    out: String,
}

impl Exposition {
    fn family(&mut self, name: &str, help: &str, kind: &str) {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape_label(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {}", format_value(value));
    }
}

impl Exposition {
    /// One histogram series: `_bucket` per bound plus +Inf, `_sum`, `_count`.
    fn histogram(&mut self, name: &str, labels: &[(&str, &str)], h: &Histogram) {
        let bucket = format!("{name}_bucket");
        let bounds: Vec<String> = h.buckets.iter().map(|(b, _)| format_value(*b)).collect();
        let rows = h
            .buckets
            .iter()
            .zip(&bounds)
            .map(|((_, n), le)| (le.as_str(), *n))
            .chain(std::iter::once(("+Inf", h.count)));
        for (le, n) in rows {
            let mut with_le: Vec<(&str, &str)> = labels.to_vec();
            with_le.push(("le", le));
            self.sample(&bucket, &with_le, n as f64);
        }
        self.sample(&format!("{name}_sum"), labels, h.sum_seconds);
        self.sample(&format!("{name}_count"), labels, h.count as f64);
    }
}

/// Escapes a label value: backslash, double quote and line feed.
fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// A sample value as Prometheus reads it.
fn format_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else if v.fract() == 0.0 && v.abs() < 9.0e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        for (input, want) in [
            ("plain", "plain"),
            ("a\"b", "a\\\"b"),
            ("a\\b", "a\\\\b"),
            ("a\nb", "a\\nb"),
            ("}\" 1\nfake 2", "}\\\" 1\\nfake 2"),
        ] {
            assert_eq!(escape_label(input), want, "{input:?}");
        }
    }

    #[test]
    fn histograms_have_buckets_inf_sum_and_count() {
        let mut x = Exposition::default();
        let h = Histogram {
            buckets: vec![(0.005, 1), (0.1, 3)],
            sum_seconds: 0.25,
            count: 4,
        };
        x.histogram("d", &[("agent", "dev")], &h);
        assert_eq!(
            x.out,
            "d_bucket{agent=\"dev\",le=\"0.005\"} 1\n\
             d_bucket{agent=\"dev\",le=\"0.1\"} 3\n\
             d_bucket{agent=\"dev\",le=\"+Inf\"} 4\n\
             d_sum{agent=\"dev\"} 0.25\n\
             d_count{agent=\"dev\"} 4\n"
        );
    }

    #[test]
    fn values_are_formatted() {
        for (input, want) in [
            (0.0, "0"),
            (3.0, "3"),
            (-2.0, "-2"),
            (1.5, "1.5"),
            (f64::NAN, "NaN"),
            (f64::INFINITY, "+Inf"),
            (f64::NEG_INFINITY, "-Inf"),
        ] {
            assert_eq!(format_value(input), want, "{input}");
        }
    }
}
