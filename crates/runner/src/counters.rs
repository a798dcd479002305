//! In-process counters of the deterministic runners (`staging_runner {runs, success, …}`,
//! `merge_gate {…}`), shown read-only in `GET /queue` and `/metrics` and never persisted
//! (seed ORCH-115 D-4).

use std::collections::BTreeMap;
use std::sync::Mutex;

/// A set of named counter groups. Cheap to share behind an `Arc`.
#[derive(Debug, Default)]
pub struct Counters {
    groups: Mutex<BTreeMap<String, BTreeMap<String, u64>>>,
}

impl Counters {
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares `names` of `group` at zero so they show up before the first increment.
    pub fn declare(&self, group: &str, names: &[&str]) {
        if let Ok(mut g) = self.groups.lock() {
            let entry = g.entry(group.to_owned()).or_default();
            for n in names {
                entry.entry((*n).to_owned()).or_insert(0);
            }
        }
    }

    /// Adds one to `group.name`.
    pub fn incr(&self, group: &str, name: &str) {
        self.add(group, name, 1);
    }

    pub fn add(&self, group: &str, name: &str, n: u64) {
        if let Ok(mut g) = self.groups.lock() {
            *g.entry(group.to_owned())
                .or_default()
                .entry(name.to_owned())
                .or_insert(0) += n;
        }
    }

    pub fn get(&self, group: &str, name: &str) -> u64 {
        self.groups
            .lock()
            .ok()
            .and_then(|g| g.get(group).and_then(|m| m.get(name)).copied())
            .unwrap_or(0)
    }

    /// Every group with its counters, sorted.
    pub fn snapshot(&self) -> Vec<(String, Vec<(String, u64)>)> {
        self.groups
            .lock()
            .map(|g| {
                g.iter()
                    .map(|(k, m)| (k.clone(), m.iter().map(|(n, v)| (n.clone(), *v)).collect()))
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_counters_start_at_zero_and_count() {
        let c = Counters::new();
        c.declare("staging_runner", &["runs", "success"]);
        c.incr("staging_runner", "runs");
        c.incr("staging_runner", "runs");
        assert_eq!(c.get("staging_runner", "runs"), 2);
        assert_eq!(
            c.snapshot(),
            vec![(
                "staging_runner".to_owned(),
                vec![("runs".to_owned(), 2), ("success".to_owned(), 0)]
            )]
        );
    }
}
