//! The fetch loop's decisions (`worker::Fetcher::run`): whether a turn claims, how many jobs
//! it asks for, when finished jobs are flushed, when it looks next and how it backs off after
//! a store error. A state type over `Instant`s with no I/O: the loop does the I/O and tells it
//! what happened, so the rules are unit-tested here rather than kept in comments.

use std::time::{Duration, Instant};

/// The first wait after a store error; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// The longest wait after store errors in a row.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// How many jobs one loop runs and holds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Capacity {
    /// Jobs it runs at once.
    pub slots: usize,
    /// Claimed jobs it may hold beyond them, ready to start.
    pub prefetch: usize,
    /// The most jobs one claim asks for, and the most finished jobs one flush marks.
    pub batch: usize,
}

/// The loop's pacing state.
#[derive(Debug)]
pub(crate) struct Pacing {
    cooldown: Duration,
    poll_interval: Duration,
    /// Whether this turn claims: after a job ended (unless the queue was drained), the poll
    /// timer, a wake-up for a job due now, an error or a full claim; not after a wake-up for a
    /// job due later (a watch's next tick), which only moves the timer up (a claim then would
    /// find nothing).
    look: bool,
    /// The last claim came back with fewer jobs than it asked for (nothing more was due), and
    /// no wake-up for a job due now and no poll has come since: a finished job is no reason
    /// to claim. Never set without a cooldown.
    drained: bool,
    /// The `Wake::now_seq` seen: a change is a job due now, even when a later announcement for
    /// a delayed job came before the loop read the first.
    seen_now: u64,
    last_claim: Option<Instant>,
    next_poll: Instant,
    /// When the finished jobs waiting to be marked done are flushed at the latest.
    flush_at: Option<Instant>,
    backoff: Duration,
}

/// What a turn does after a claim that went through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterClaim {
    /// The claim came back full: the queue may hold more; claim again at once.
    Again,
    /// It asked for fewer than it could have had, or only flushed: ask the store when the next
    /// job comes due ([`Pacing::idle`]) when `asked`, then wait.
    Wait { asked: bool },
}

impl Pacing {
    /// A loop that claims at once; `seen_now` is the wake-up source's current `now_seq`.
    pub(crate) fn new(
        cooldown: Duration,
        poll_interval: Duration,
        seen_now: u64,
        now: Instant,
    ) -> Pacing {
        Pacing {
            cooldown,
            poll_interval,
            look: true,
            drained: false,
            seen_now,
            last_claim: None,
            next_poll: now,
            flush_at: None,
            backoff: FIRST_BACKOFF,
        }
    }

    /// A job ended: a reason to claim, unless the queue was found drained.
    pub(crate) fn job_finished(&mut self) {
        self.look |= !self.drained;
    }

    /// `pending` finished jobs wait to be marked done: the first starts the flush deadline (a
    /// cooldown from now), none clears it.
    pub(crate) fn pending(&mut self, pending: usize, now: Instant) {
        if pending == 0 {
            self.flush_at = None;
        } else if self.flush_at.is_none() {
            self.flush_at = Some(now + self.cooldown);
        }
    }

    /// How many jobs this turn claims: none when stopping, without kinds or without a reason
    /// to look; else up to the capacity left (running and buffered count), at most a batch,
    /// and with prefetch only once the buffer is down to half the slots.
    pub(crate) fn want(
        &self,
        stopping: bool,
        has_kinds: bool,
        running: usize,
        buffered: usize,
        cap: Capacity,
    ) -> usize {
        if stopping || !has_kinds || !self.look {
            return 0;
        }
        let low = buffered < cap.slots.max(1).div_ceil(2);
        if low || cap.prefetch == 0 {
            (cap.slots + cap.prefetch)
                .saturating_sub(running + buffered)
                .min(cap.batch)
        } else {
            0
        }
    }

    /// Whether the finished jobs go now: they ride with a claim, or go when a batch is full,
    /// when the cooldown since the first of them has passed (a follow-up, a watch's next tick,
    /// is due at its own time: held back no longer), or at a stop.
    pub(crate) fn flush(
        &self,
        pending: usize,
        want: usize,
        stopping: bool,
        batch: usize,
        now: Instant,
    ) -> bool {
        pending > 0
            && (want > 0
                || stopping
                || pending >= batch.max(1)
                || self.flush_at.is_some_and(|at| at <= now))
    }

    /// A claim (or a flush alone, `want` 0) went through at `started` and got `got` jobs.
    pub(crate) fn claimed(&mut self, want: usize, got: usize, started: Instant) -> AfterClaim {
        self.backoff = FIRST_BACKOFF;
        self.flush_at = None;
        if want == 0 {
            return AfterClaim::Wait { asked: false };
        }
        self.last_claim = Some(started);
        self.drained = got < want && !self.cooldown.is_zero();
        if got == want {
            self.next_poll = started;
            return AfterClaim::Again;
        }
        AfterClaim::Wait { asked: true }
    }

    /// After a claim that did not come back full: the next job comes due in `idle` (at most
    /// the poll interval); `due_before`: it was already due when the claim looked, so another
    /// loop took or had locked it: not drained, look again at once. Else the next claim when
    /// it comes due, but not within the cooldown of the claim (what comes due meanwhile waits).
    pub(crate) fn idle(
        &mut self,
        idle: Duration,
        due_before: bool,
        started: Instant,
        now: Instant,
    ) {
        if due_before {
            self.drained = false;
            self.next_poll = now;
        } else {
            self.next_poll = (now + idle).max(started + self.cooldown);
        }
    }

    /// A store error: how long to wait before the loop tries again (doubling, at most
    /// [`MAX_BACKOFF`]).
    pub(crate) fn failed(&mut self) -> Duration {
        let wait = self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        wait
    }

    /// The turn is over and the loop waits: until what instant at the latest (the poll or the
    /// flush deadline, whichever is first).
    pub(crate) fn wait_until(&mut self) -> Instant {
        self.look = false;
        self.flush_at
            .map_or(self.next_poll, |at| at.min(self.next_poll))
    }

    /// A wake-up: `now_seq` from the source, and its earliest due job `wait_ms` from now. A
    /// job due now claims; one due later only moves the poll up to it (not within the
    /// cooldown of the last claim).
    pub(crate) fn woken(&mut self, now_seq: u64, wait_ms: i64, now: Instant) {
        if now_seq != self.seen_now || wait_ms <= 0 {
            self.seen_now = now_seq;
            (self.look, self.drained) = (true, false);
        } else {
            let due = now + Duration::from_millis(u64::try_from(wait_ms).unwrap_or(0));
            let not_before = self.last_claim.map_or(due, |at| at + self.cooldown);
            self.next_poll = self.next_poll.min(due.max(not_before));
        }
    }

    /// The wake-up source was replaced (its sender went away): look now, from its `now_seq`.
    pub(crate) fn resubscribed(&mut self, now_seq: u64) {
        self.seen_now = now_seq;
        (self.look, self.drained) = (true, false);
    }

    /// The wait's timer fired at `now`: when the poll is due, claim and set the next poll.
    pub(crate) fn timer(&mut self, now: Instant) {
        if now >= self.next_poll {
            self.next_poll = now + self.poll_interval;
            (self.look, self.drained) = (true, false);
        }
    }

    /// A stop was asked for: this turn looks (and flushes, as a stop does).
    pub(crate) fn stop_requested(&mut self) {
        self.look = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const CAP: Capacity = Capacity {
        slots: 4,
        prefetch: 0,
        batch: 4,
    };

    fn pacing(t0: Instant) -> Pacing {
        Pacing::new(20 * MS, Duration::from_secs(1), 0, t0)
    }

    #[test]
    fn a_new_loop_claims_its_capacity_at_once() {
        let p = pacing(Instant::now());
        assert_eq!(p.want(false, true, 0, 0, CAP), 4);
        assert_eq!(p.want(false, true, 3, 0, CAP), 1);
        assert_eq!(p.want(true, true, 0, 0, CAP), 0, "stopping");
        assert_eq!(p.want(false, false, 0, 0, CAP), 0, "no kinds");
        let big = Capacity { batch: 2, ..CAP };
        assert_eq!(p.want(false, true, 0, 0, big), 2, "at most a batch");
    }

    #[test]
    fn prefetch_refills_only_when_the_buffer_is_down_to_half_the_slots() {
        let p = pacing(Instant::now());
        let cap = Capacity {
            slots: 4,
            prefetch: 4,
            batch: 8,
        };
        assert_eq!(p.want(false, true, 4, 2, cap), 0, "2 of 4 buffered: enough");
        assert_eq!(p.want(false, true, 4, 1, cap), 3);
        assert_eq!(p.want(false, true, 0, 0, cap), 8);
    }

    #[test]
    fn a_full_claim_asks_again_a_short_one_drains_until_a_wake_up_or_a_poll() {
        let t0 = Instant::now();
        let mut p = pacing(t0);
        assert_eq!(p.claimed(4, 4, t0), AfterClaim::Again);
        assert_eq!(p.claimed(4, 1, t0), AfterClaim::Wait { asked: true });
        p.idle(Duration::from_secs(1), false, t0, t0);
        assert!(p.drained);
        // Drained: a finished job is no reason to claim.
        p.wait_until();
        p.job_finished();
        assert_eq!(p.want(false, true, 0, 0, CAP), 0);
        // A wake-up for a job due now is.
        p.woken(1, 0, t0);
        assert_eq!(p.want(false, true, 0, 0, CAP), 4);
        p.wait_until();
        // So is the poll, once due.
        p.timer(t0 + 500 * MS);
        assert_eq!(p.want(false, true, 0, 0, CAP), 0, "the poll is not due yet");
        p.timer(t0 + Duration::from_secs(2));
        assert_eq!(p.want(false, true, 0, 0, CAP), 4);
    }

    #[test]
    fn without_a_cooldown_nothing_is_ever_drained() {
        let t0 = Instant::now();
        let mut p = Pacing::new(Duration::ZERO, Duration::from_secs(1), 0, t0);
        p.claimed(4, 0, t0);
        p.wait_until();
        p.job_finished();
        assert_eq!(p.want(false, true, 0, 0, CAP), 4);
    }

    #[test]
    fn a_job_due_later_moves_the_poll_up_but_not_within_the_cooldown() {
        let t0 = Instant::now();
        let mut p = pacing(t0);
        p.claimed(4, 0, t0);
        p.idle(Duration::from_secs(1), false, t0, t0);
        assert_eq!(p.wait_until(), t0 + Duration::from_secs(1));
        // Due in 5 ms, but the last claim was just now: not before the 20 ms cooldown.
        p.woken(0, 5, t0);
        assert_eq!(p.want(false, true, 0, 0, CAP), 0, "no claim now");
        assert_eq!(p.wait_until(), t0 + 20 * MS);
        // Due in 300 ms: the poll moves up to it.
        let mut p = pacing(t0);
        p.claimed(4, 0, t0);
        p.idle(Duration::from_secs(1), false, t0, t0);
        p.woken(0, 300, t0);
        assert_eq!(p.wait_until(), t0 + 300 * MS);
        // A changed now_seq is a job due now, whatever the due time says.
        p.woken(1, 300, t0);
        assert_eq!(p.want(false, true, 0, 0, CAP), 4);
    }

    #[test]
    fn a_job_due_before_the_claim_looked_is_looked_for_again_at_once() {
        let t0 = Instant::now();
        let mut p = pacing(t0);
        p.claimed(4, 1, t0);
        p.idle(Duration::from_secs(1), true, t0, t0 + MS);
        assert!(!p.drained);
        assert_eq!(p.wait_until(), t0 + MS);
    }

    #[test]
    fn finished_jobs_ride_with_a_claim_or_go_by_batch_deadline_or_stop() {
        let t0 = Instant::now();
        let mut p = pacing(t0);
        // Drained: the next poll is a second away.
        p.claimed(4, 0, t0);
        p.idle(Duration::from_secs(1), false, t0, t0);
        assert!(!p.flush(0, 4, false, 4, t0), "nothing to flush");
        p.pending(1, t0);
        assert!(p.flush(1, 2, false, 4, t0), "with a claim");
        assert!(!p.flush(1, 0, false, 4, t0), "alone, before the deadline");
        assert!(p.flush(4, 0, false, 4, t0), "a full batch");
        assert!(p.flush(1, 0, true, 4, t0), "a stop");
        assert!(p.flush(1, 0, false, 4, t0 + 20 * MS), "the deadline");
        // The deadline counts from the first pending job, and the wait ends at it.
        p.pending(2, t0 + 10 * MS);
        assert_eq!(p.wait_until(), t0 + 20 * MS);
        p.claimed(0, 0, t0);
        p.pending(0, t0);
        assert_eq!(
            p.wait_until(),
            t0 + Duration::from_secs(1),
            "no flush deadline left: the poll"
        );
    }

    #[test]
    fn store_errors_back_off_doubling_to_five_seconds_and_a_success_resets() {
        let t0 = Instant::now();
        let mut p = pacing(t0);
        let waits: Vec<Duration> = (0..9).map(|_| p.failed()).collect();
        assert_eq!(waits[0], 50 * MS);
        assert_eq!(waits[1], 100 * MS);
        assert_eq!(waits[6], Duration::from_secs(3) + 200 * MS);
        assert_eq!(waits[7], MAX_BACKOFF);
        assert_eq!(waits[8], MAX_BACKOFF);
        p.claimed(0, 0, t0);
        assert_eq!(p.failed(), FIRST_BACKOFF);
    }

    #[test]
    fn a_stop_or_a_new_wake_up_source_makes_the_turn_look() {
        let t0 = Instant::now();
        let mut p = pacing(t0);
        p.claimed(4, 0, t0);
        p.wait_until();
        p.stop_requested();
        assert_eq!(p.want(false, true, 0, 0, CAP), 4);
        p.wait_until();
        p.resubscribed(7);
        assert_eq!(p.want(false, true, 0, 0, CAP), 4);
        // The new source's now_seq is the one seen: the same number again is no news.
        p.wait_until();
        p.woken(7, 300, t0);
        assert_eq!(p.want(false, true, 0, 0, CAP), 0);
    }
}
