//! `GET /metrics`: the queue snapshot in the Prometheus text exposition format 0.0.4, written by
//! hand (a few gauges do not justify a metrics registry). When the store cannot answer, the
//! scrape still succeeds with `orch_up 0` and the in-process families, so an alert can fire.

use std::fmt::Write as _;

use crate::snapshot::QueueSnapshot;

/// The content type of the text exposition format.
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Renders the exposition. `up` is false when the store did not answer; the snapshot's store
/// fields are then empty and their families are left out.
pub(crate) fn render(snap: &QueueSnapshot, up: bool) -> String {
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
