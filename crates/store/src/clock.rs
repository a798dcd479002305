//! Where the store's time comes from: the system clock in production, a manual clock in tests,
//! so lease expiry and delays are tested by moving time, never by sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use crate::model::Millis;

pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now_ms(&self) -> Millis;
}

/// Wall-clock time. Several machines sharing one PostgreSQL must keep their clocks in sync
/// (NTP): leases are compared across machines.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> Millis {
        match std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
            // A clock before 1970 is a broken host; 0 keeps every comparison well-defined.
            Err(_) => 0,
        }
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicI64,
}

impl ManualClock {
    pub fn new(start: Millis) -> Arc<ManualClock> {
        Arc::new(ManualClock {
            now: AtomicI64::new(start),
        })
    }

    pub fn advance_ms(&self, ms: i64) {
        self.now.fetch_add(ms, Ordering::SeqCst);
    }

    pub fn set(&self, now: Millis) {
        self.now.store(now, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> Millis {
        self.now.load(Ordering::SeqCst)
    }
}
