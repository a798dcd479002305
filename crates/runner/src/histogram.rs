//! Lock-free latency histograms for the worker's hot path (job durations, claim wait, claim
//! round trips), read by `/metrics` as Prometheus histograms. In-process and reset on restart,
//! like every Prometheus client's: the scraper sums them across processes and restarts.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// Upper bounds (seconds) for things measured in milliseconds: claim wait and round trips.
pub const FAST_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Upper bounds (seconds) for job run times: a no-op to an hour-long agent session.
pub const JOB_BOUNDS: &[f64] = &[
    0.005, 0.025, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 1800.0, 3600.0,
];

/// One histogram: a count per bucket (not cumulative), the sum and the count.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// `bounds.len() + 1` buckets; the last one is +Inf.
    buckets: Box<[AtomicU64]>,
    sum_micros: AtomicU64,
}

/// A histogram read at one moment, with cumulative bucket counts as Prometheus wants them.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// `(upper bound in seconds, observations ≤ bound)`, ascending; +Inf is `count`.
    pub buckets: Vec<(f64, u64)>,
    pub sum_seconds: f64,
    pub count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self.bounds.partition_point(|b| *b < secs);
        if let Some(b) = self.buckets.get(i) {
            b.fetch_add(1, Ordering::Relaxed);
        }
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    /// Cumulative counts, read without a lock; the count is the bucket total, so the +Inf
    /// bucket always equals `count` and the snapshot is a valid histogram.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut cumulative = 0;
        let mut buckets = Vec::with_capacity(self.bounds.len());
        for (bound, n) in self.bounds.iter().zip(self.buckets.iter()) {
            cumulative += n.load(Ordering::Relaxed);
            buckets.push((*bound, cumulative));
        }
        let total = cumulative + self.buckets.last().map_or(0, |b| b.load(Ordering::Relaxed));
        HistogramSnapshot {
            buckets,
            sum_seconds: self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6,
            count: total,
        }
    }
}

/// One histogram per label value (the job kind), created on first use.
#[derive(Debug)]
pub struct LabeledHistograms {
    bounds: &'static [f64],
    by_label: RwLock<HashMap<String, Arc<Histogram>>>,
}

impl LabeledHistograms {
    pub fn new(bounds: &'static [f64]) -> Self {
        LabeledHistograms {
            bounds,
            by_label: RwLock::new(HashMap::new()),
        }
    }

    pub fn observe(&self, label: &str, d: Duration) {
        let found = self
            .by_label
            .read()
            .ok()
            .and_then(|m| m.get(label).cloned());
        let h = match found {
            Some(h) => h,
            None => match self.by_label.write() {
                Ok(mut m) => m
                    .entry(label.to_owned())
                    .or_insert_with(|| Arc::new(Histogram::new(self.bounds)))
                    .clone(),
                Err(_) => return,
            },
        };
        h.observe(d);
    }

    /// Every label's snapshot, sorted by label.
    pub fn snapshot(&self) -> Vec<(String, HistogramSnapshot)> {
        let mut out: Vec<(String, HistogramSnapshot)> = self
            .by_label
            .read()
            .map(|m| m.iter().map(|(k, h)| (k.clone(), h.snapshot())).collect())
            .unwrap_or_default();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_cumulative_buckets() {
        let h = Histogram::new(&[0.01, 0.1, 1.0]);
        for ms in [5, 10, 50, 2_000] {
            h.observe(Duration::from_millis(ms));
        }
        let s = h.snapshot();
        // 10 ms is on the 0.01 bound: `le` buckets include their bound.
        assert_eq!(s.buckets, vec![(0.01, 2), (0.1, 3), (1.0, 3)]);
        assert_eq!(s.count, 4);
        assert!((s.sum_seconds - 2.065).abs() < 1e-9, "{}", s.sum_seconds);
    }

    #[test]
    fn labels_get_their_own_histogram() {
        let h = LabeledHistograms::new(JOB_BOUNDS);
        h.observe("b", Duration::from_millis(1));
        h.observe("a", Duration::from_secs(7_200));
        h.observe("b", Duration::from_secs(2));
        let s = h.snapshot();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].0, "a");
        assert_eq!(s[0].1.count, 1);
        assert_eq!(
            s[0].1.buckets.last(),
            Some(&(3600.0, 0)),
            "over the top bound: +Inf only"
        );
        assert_eq!(s[1].0, "b");
        assert_eq!(s[1].1.count, 2);
        assert_eq!(s[1].1.buckets[0], (0.005, 1));
    }
}
