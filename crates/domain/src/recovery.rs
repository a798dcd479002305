//! What orch does about production after something went wrong in deploy or observe, as one
//! pure rule (design.md §11): production ends **verified healthy at a known revision** (the
//! previous one after a rollback), or an operator is **alerted** with what is live, what was
//! tried and what to do. Never a third, silent state.
//!
//! The runner looks at production ([`Sight`]: the health check and the revision the service
//! names), asks [`next`] what to do, runs the rollback when told to, looks again and asks
//! again with `rollback_ran` set: the answer is then [`Next::Settled`] or [`Next::Alert`].
//!
//! When a rollback is the remedy:
//! - a deploy that failed (non-zero exit, timeout, killed, could not start) or was never
//!   confirmed, while production does not answer healthy at a revision other than the one
//!   deployed: orch's own command was the last thing that touched production (one release at a
//!   time per repo), so rolling back is safe unless another revision, neither the deployed one
//!   nor the one before it, is live (then someone else deployed: alert);
//! - a deploy whose command succeeded but that production reports as the *previous* revision:
//!   the deploy did not take effect or the revision endpoint is wrong; either way what runs is
//!   not known, and the rollback makes it the previous release for certain;
//! - a FAILED watch while the watched revision is live, or while the service does not answer at
//!   all (its revision endpoint silent too): nothing newer replaced it (a newer orch deploy
//!   supersedes the watch first).
//!
//! Anything else alerts: a watch without a health URL, a DEGRADED watch (the change is live and
//! not proven healthy), a monitor that cannot observe, no rollback command, a rollback that
//! did not bring production back healthy at another revision.

use crate::monitor::{Verdict, reaction};

/// What went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trouble {
    /// The deploy command failed: non-zero exit, timeout, a signal, or it could not start.
    DeployFailed,
    /// The deploy command ended well but production never confirmed the revision.
    DeployUnconfirmed,
    /// The post-deploy watch decided FAILED.
    WatchFailed,
    /// The post-deploy watch decided DEGRADED (not enough evidence of health).
    WatchDegraded,
    /// Nothing could be watched (no health URL, or the watch's state is lost).
    Unwatched,
}

impl Trouble {
    /// One word for messages and payloads.
    pub fn as_str(self) -> &'static str {
        match self {
            Trouble::DeployFailed => "deploy_failed",
            Trouble::DeployUnconfirmed => "deploy_unconfirmed",
            Trouble::WatchFailed => "watch_failed",
            Trouble::WatchDegraded => "watch_degraded",
            Trouble::Unwatched => "unwatched",
        }
    }

    fn is_deploy(self) -> bool {
        matches!(self, Trouble::DeployFailed | Trouble::DeployUnconfirmed)
    }
}

/// What the health check said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// A 2xx answer.
    Pass,
    /// A bad answer or none (refused, reset, timed out).
    Fail,
    /// orch could not observe (a URL it cannot use, a control check that failed).
    Blind,
    /// No health URL is configured: orch cannot see production's health at all.
    Unwatched,
}

impl Health {
    /// `PASS`, `FAIL`, `BLIND` or `UNWATCHED`.
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Pass => "PASS",
            Health::Fail => "FAIL",
            Health::Blind => "BLIND",
            Health::Unwatched => "UNWATCHED",
        }
    }
}

/// What orch saw of production at one look.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sight {
    /// The health check.
    pub health: Health,
    /// The health check's detail (`HTTP 503: …`, `connection refused`).
    pub health_detail: String,
    /// The revision the service names, when it named one.
    pub live: Option<String>,
    /// Whether a revision endpoint is configured (without one `live` is always unknown).
    pub reads_revision: bool,
}

impl Sight {
    /// What is live, in words: `` `abc1234` answering healthy (HTTP 200: ok) ``, `nothing
    /// answers at the health URL (connection refused); the revision is unknown`.
    pub fn describe(&self) -> String {
        let rev = match (&self.live, self.reads_revision) {
            (Some(r), _) => format!("`{r}`"),
            (None, true) => "an unknown revision (the revision endpoint did not answer)".to_owned(),
            (None, false) => "an unknown revision (no revision_url is configured)".to_owned(),
        };
        match self.health {
            Health::Pass => format!("{rev} answering healthy ({})", self.health_detail),
            Health::Fail => format!("{rev}, health failing ({})", self.health_detail),
            Health::Blind => format!(
                "{rev}; orch cannot observe its health ({})",
                self.health_detail
            ),
            Health::Unwatched => format!("{rev}; its health is unknown (no health_url)"),
        }
    }
}

/// The situation the rule judges.
#[derive(Debug, Clone, Copy)]
pub struct Situation<'a> {
    /// What went wrong.
    pub trouble: Trouble,
    /// The revision that went wrong (the item's deploy).
    pub bad: &'a str,
    /// The revision live before it, when known.
    pub previous: Option<&'a str>,
    /// A rollback command is configured.
    pub rollback_configured: bool,
    /// The rollback already ran in this visit (its command ended; what follows only looks).
    pub rollback_ran: bool,
}

/// What to do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Production is verified healthy at the known revision `live`: nothing more to do.
    Settled {
        /// The revision production runs.
        live: String,
    },
    /// Run the rollback command, then look again.
    RollBack,
    /// Alert an operator: production cannot be verified healthy at a known revision.
    Alert {
        /// Why, in a sentence.
        why: String,
    },
}

/// Whether two revision names are the same revision (the domain's rule: equal ignoring case
/// and space, or one a hex abbreviation of at least 7 digits of the other).
pub fn same_revision(a: &str, b: &str) -> bool {
    reaction(Verdict::Failed, a, Some(b)) == crate::monitor::Reaction::Rollback
}

/// The rule (see the module's comment).
pub fn next(s: &Situation<'_>, sight: &Sight) -> Next {
    let is_bad = |r: &str| same_revision(s.bad, r);
    let is_prev = |r: &str| s.previous.is_some_and(|p| same_revision(p, r));
    let bad = s.bad;
    let roll_back = |why: &str| {
        if s.rollback_ran {
            Next::Alert {
                why: format!("the rollback ran, but {why}"),
            }
        } else if s.rollback_configured {
            Next::RollBack
        } else {
            Next::Alert {
                why: format!("{why}, and no rollback command is configured"),
            }
        }
    };
    let alert = |why: String| Next::Alert { why };
    match sight.health {
        Health::Blind => alert(format!(
            "orch cannot observe production ({})",
            sight.health_detail
        )),
        Health::Unwatched if s.trouble.is_deploy() && !s.rollback_ran => {
            roll_back("there is no health_url to tell whether production is up")
        }
        Health::Unwatched => alert(if s.rollback_ran {
            "the rollback ran, but there is no health_url to verify it by".to_owned()
        } else {
            "there is no health_url: orch cannot see whether production is healthy".to_owned()
        }),
        Health::Pass => match (&sight.live, sight.reads_revision) {
            (Some(live), _) if is_bad(live) => match s.trouble {
                Trouble::WatchDegraded | Trouble::Unwatched => alert(format!(
                    "`{bad}` is live and answers healthy now, but the watch could not confirm its health"
                )),
                _ => roll_back(&format!("`{bad}` is still live")),
            },
            (Some(live), _)
                if s.trouble == Trouble::DeployUnconfirmed && is_prev(live) && !s.rollback_ran =>
            {
                roll_back(&format!(
                    "the deploy of `{bad}` ended well while production reports the previous `{live}`: \
                     either the deploy did not take effect or the revision endpoint is wrong"
                ))
            }
            (Some(live), _)
                if s.trouble.is_deploy() && !s.rollback_ran && !is_prev(live)
                    && s.previous.is_some() =>
            {
                alert(format!(
                    "production reports `{live}`, neither the deployed `{bad}` nor the previous revision: \
                     another release is live"
                ))
            }
            (Some(live), _) => Next::Settled { live: live.clone() },
            (None, false) if s.rollback_ran => match s.previous {
                Some(p) => Next::Settled { live: p.to_owned() },
                None => alert(
                    "the rollback ran and production answers healthy, but neither a revision_url nor \
                     the record names the revision it went back to"
                        .to_owned(),
                ),
            },
            (None, false) => alert(
                "production answers healthy, but without a revision_url orch cannot tell which release runs"
                    .to_owned(),
            ),
            (None, true) => alert(
                "production answers healthy, but its revision endpoint did not say which release runs"
                    .to_owned(),
            ),
        },
        Health::Fail => match s.trouble {
            Trouble::WatchDegraded | Trouble::Unwatched => {
                alert("production's health check fails".to_owned())
            }
            _ if s.rollback_ran => alert("production is still not healthy".to_owned()),
            Trouble::DeployFailed | Trouble::DeployUnconfirmed => match &sight.live {
                Some(live) if !is_bad(live) && !is_prev(live) && s.previous.is_some() => {
                    alert(format!(
                        "production reports `{live}`, neither the deployed `{bad}` nor the previous \
                         revision, and is not healthy: another release is live"
                    ))
                }
                _ => roll_back("production is not healthy"),
            },
            Trouble::WatchFailed => match (&sight.live, sight.reads_revision) {
                (Some(live), _) if is_bad(live) => roll_back(&format!("`{bad}` is live")),
                (Some(live), _) => alert(format!(
                    "the watched `{bad}` is no longer live (live: `{live}`) and production is not healthy: \
                     not rolling back another release"
                )),
                (None, true) => roll_back("the service does not answer at all"),
                (None, false) => alert(format!(
                    "without a revision_url orch cannot tell whether `{bad}` is still live: not rolling back blind"
                )),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(trouble, health, live, reads_revision, rollback configured, ran)` → `settled:<rev>`,
    /// `rollback` or `alert`.
    #[allow(clippy::too_many_arguments)]
    fn check(
        trouble: Trouble,
        health: Health,
        live: Option<&str>,
        reads_revision: bool,
        configured: bool,
        ran: bool,
        want: &str,
    ) {
        let s = Situation {
            trouble,
            bad: "bbbbbbb1",
            previous: Some("aaaaaaa1"),
            rollback_configured: configured,
            rollback_ran: ran,
        };
        let sight = Sight {
            health,
            health_detail: "detail".into(),
            live: live.map(str::to_owned),
            reads_revision,
        };
        let got = match next(&s, &sight) {
            Next::Settled { live } => format!("settled:{live}"),
            Next::RollBack => "rollback".to_owned(),
            Next::Alert { .. } => "alert".to_owned(),
        };
        assert_eq!(
            got, want,
            "{trouble:?} {health:?} {live:?} {reads_revision} {configured} {ran}"
        );
    }

    use Health::{Blind, Fail, Pass};
    use Trouble::{DeployFailed, DeployUnconfirmed, WatchDegraded, WatchFailed};

    const BAD: Option<&str> = Some("bbbbbbb1");
    const PREV: Option<&str> = Some("aaaaaaa1");
    const OTHER: Option<&str> = Some("ccccccc1");

    #[test]
    fn a_failed_deploy_rolls_back_unless_production_is_fine() {
        // Stopped the old process, then failed: nothing answers.
        check(DeployFailed, Fail, None, true, true, false, "rollback");
        // Failed before touching anything: the old release still answers.
        check(
            DeployFailed,
            Pass,
            PREV,
            true,
            true,
            false,
            "settled:aaaaaaa1",
        );
        // Failed, but the new revision is live (and answers): it leaves with the revert.
        check(DeployFailed, Pass, BAD, true, true, false, "rollback");
        // Someone else's release answers: not rolled back.
        check(DeployFailed, Fail, OTHER, true, true, false, "alert");
        check(DeployFailed, Pass, OTHER, true, true, false, "alert");
        // No rollback command: alert.
        check(DeployFailed, Fail, None, true, false, false, "alert");
        // Healthy but no revision_url: cannot tell which release runs.
        check(DeployFailed, Pass, None, false, true, false, "alert");
        // No health_url at all: the rollback is still the remedy, then an alert.
        check(
            DeployFailed,
            Health::Unwatched,
            None,
            false,
            true,
            false,
            "rollback",
        );
        check(
            DeployFailed,
            Health::Unwatched,
            None,
            false,
            true,
            true,
            "alert",
        );
    }

    #[test]
    fn after_the_rollback_it_is_settled_or_alerted() {
        check(
            DeployFailed,
            Pass,
            PREV,
            true,
            true,
            true,
            "settled:aaaaaaa1",
        );
        check(DeployFailed, Pass, BAD, true, true, true, "alert");
        check(DeployFailed, Fail, None, true, true, true, "alert");
        check(DeployFailed, Fail, PREV, true, true, true, "alert");
        // Verified by health alone: the record names the revision it went back to.
        check(
            DeployFailed,
            Pass,
            None,
            false,
            true,
            true,
            "settled:aaaaaaa1",
        );
        check(
            WatchFailed,
            Pass,
            PREV,
            true,
            true,
            true,
            "settled:aaaaaaa1",
        );
        check(WatchFailed, Fail, BAD, true, true, true, "alert");
    }

    #[test]
    fn an_unconfirmed_deploy_that_reports_the_old_revision_is_rolled_back() {
        check(DeployUnconfirmed, Pass, PREV, true, true, false, "rollback");
        check(DeployUnconfirmed, Fail, None, true, true, false, "rollback");
        check(DeployUnconfirmed, Fail, BAD, true, true, false, "rollback");
        check(DeployUnconfirmed, Pass, PREV, true, false, false, "alert");
        // After the rollback the previous revision answering healthy is the goal reached.
        check(
            DeployUnconfirmed,
            Pass,
            PREV,
            true,
            true,
            true,
            "settled:aaaaaaa1",
        );
    }

    #[test]
    fn a_failed_watch_rolls_back_only_what_it_watched() {
        check(WatchFailed, Fail, BAD, true, true, false, "rollback");
        check(WatchFailed, Pass, BAD, true, true, false, "rollback");
        // The service is down entirely: nothing newer replaced it.
        check(WatchFailed, Fail, None, true, true, false, "rollback");
        // Another release is live: its business, not this watch's.
        check(WatchFailed, Fail, OTHER, true, true, false, "alert");
        check(
            WatchFailed,
            Pass,
            OTHER,
            true,
            true,
            false,
            "settled:ccccccc1",
        );
        // Without a revision_url the watch never rolls back blind.
        check(WatchFailed, Fail, None, false, true, false, "alert");
        check(WatchFailed, Blind, BAD, true, true, false, "alert");
        check(WatchFailed, Fail, BAD, true, false, false, "alert");
    }

    #[test]
    fn degraded_and_unwatched_always_alert_while_the_change_is_live() {
        check(WatchDegraded, Pass, BAD, true, true, false, "alert");
        check(WatchDegraded, Fail, BAD, true, true, false, "alert");
        check(
            Trouble::Unwatched,
            Health::Unwatched,
            None,
            false,
            true,
            false,
            "alert",
        );
        check(
            WatchDegraded,
            Pass,
            OTHER,
            true,
            true,
            false,
            "settled:ccccccc1",
        );
    }

    #[test]
    fn sights_describe_what_is_live() {
        let sight = Sight {
            health: Fail,
            health_detail: "connection refused".into(),
            live: None,
            reads_revision: true,
        };
        assert_eq!(
            sight.describe(),
            "an unknown revision (the revision endpoint did not answer), health failing (connection refused)"
        );
        let sight = Sight {
            health: Pass,
            health_detail: "HTTP 200".into(),
            live: Some("abc1234".into()),
            reads_revision: true,
        };
        assert_eq!(sight.describe(), "`abc1234` answering healthy (HTTP 200)");
    }
}
