//! What the task page draws from a task's events and artifacts: the stage timeline (one bar per
//! stage visit, loop-backs and waits marked) and the post-deploy watch's series read back from
//! `16-post-deploy-log.md` once the watch has ended (its sentinel files are gone by then).

use orch_domain::control::events;

use crate::ops::SeriesPoint;

/// Event kinds that move a task into the event's stage.
const ENTRY_KINDS: &[&str] = &[
    events::TASK_SUBMITTED,
    events::STAGE_ADVANCED,
    events::STAGE_LOOP_BACK,
    events::STAGE_APPROVED,
    events::TASK_RETRIED,
    events::TASK_DONE,
    events::TASK_FAILED,
    events::TASK_CANCELLED,
];

/// Event kinds that mean "waited inside the stage" (a requeue with a delay, a defer, a wait
/// for the repo's release track).
const WAIT_KINDS: &[&str] = &[
    events::STAGE_REQUEUED,
    events::DEPLOY_DEFERRED,
    events::RELEASE_WAITING,
];

fn is_wait(kind: &str) -> bool {
    WAIT_KINDS.contains(&kind)
}

/// One visit of a stage.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Visit {
    pub stage: String,
    pub start_ms: i64,
    pub end_ms: i64,
    /// Entered by a loop back (review or a gate sent the task back here).
    pub loop_back: bool,
    /// Waits recorded during the visit.
    pub waits: usize,
    /// The visit the task is in now (in flight).
    pub current: bool,
    /// A terminal stage (drawn as a marker, not a bar).
    pub terminal: bool,
}

/// The visits of a task, oldest first; the last visit of a task in flight ends `now_ms`.
pub(crate) fn visits(events: &[orch_store::Event], now_ms: i64) -> Vec<Visit> {
    let mut out: Vec<Visit> = Vec::new();
    for e in events {
        let Some(stage) = e.stage.as_deref() else {
            continue;
        };
        if ENTRY_KINDS.contains(&e.kind.as_str()) {
            if let Some(last) = out.last_mut() {
                last.end_ms = e.created_at;
                last.current = false;
            }
            let terminal = orch_domain::control::is_terminal_stage(stage);
            out.push(Visit {
                stage: stage.to_owned(),
                start_ms: e.created_at,
                end_ms: e.created_at,
                loop_back: e.kind == events::STAGE_LOOP_BACK,
                waits: 0,
                current: !terminal,
                terminal,
            });
        } else if is_wait(&e.kind)
            && let Some(last) = out.last_mut()
        {
            last.waits += 1;
        }
    }
    if let Some(last) = out.last_mut()
        && last.current
    {
        last.end_ms = now_ms.max(last.start_ms);
    }
    out
}

/// The series of a finished watch, from the `## Series` table of `16-post-deploy-log.md`
/// (`| tick | at | poll | check | outcome | status | latency | detail |`): one point per tick,
/// the poll's status and its slowest check's latency. Rows that do not parse are skipped.
pub(crate) fn series_from_log(text: &str) -> Vec<SeriesPoint> {
    let Some(at) = text.find("\n## Series") else {
        return Vec::new();
    };
    let mut out: Vec<(String, SeriesPoint)> = Vec::new();
    for line in text[at + 1..].lines().skip(1) {
        let line = line.trim();
        if line.starts_with("## ") {
            break;
        }
        if !line.starts_with('|') {
            continue;
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        if cells.len() < 7 || cells[0].parse::<u64>().is_err() {
            continue;
        }
        let Some(at_ms) = parse_rfc3339_ms(cells[1]) else {
            continue;
        };
        let latency = cells[6]
            .strip_suffix(" ms")
            .and_then(|v| v.trim().parse::<f64>().ok());
        match out.last_mut() {
            Some((tick, p)) if tick == cells[0] => {
                p.value = match (p.value, latency) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                };
            }
            _ => out.push((
                cells[0].to_owned(),
                SeriesPoint {
                    at_ms,
                    status: cells[2].to_owned(),
                    value: latency,
                },
            )),
        }
    }
    out.into_iter().map(|(_, p)| p).collect()
}

/// `YYYY-MM-DDTHH:MM:SS[.fff]Z` to epoch ms.
fn parse_rfc3339_ms(s: &str) -> Option<i64> {
    let s = s.strip_suffix('Z')?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|v| v.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.splitn(3, ':').map(|v| v.parse::<i64>().ok());
    let (hh, mm, ss) = (t.next()??, t.next()??, t.next()??);
    let ms = if frac.is_empty() {
        0
    } else {
        let digits: String = frac.chars().chain("000".chars()).take(3).collect();
        digits.parse::<i64>().ok()?
    };
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    // Days from civil (H. Hinnant).
    let y2 = if m <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 86_400 + hh * 3600 + mm * 60 + ss) * 1000) + ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(id: i64, kind: &str, stage: &str, at: i64) -> orch_store::Event {
        orch_store::Event {
            id,
            task_id: Some(1),
            job_id: None,
            kind: kind.into(),
            stage: Some(stage.into()),
            message: String::new(),
            data: "{}".into(),
            created_at: at,
        }
    }

    #[test]
    fn visits_mark_loop_backs_waits_and_the_current_stage() {
        let events = [
            ev(1, "task.submitted", "intake", 0),
            ev(2, "stage.advanced", "implementation", 100),
            ev(3, "stage.advanced", "review", 400),
            ev(4, "stage.loop_back", "implementation", 500),
            ev(5, "stage.requeued", "implementation", 550),
            ev(6, "stage.advanced", "review", 900),
        ];
        let v = visits(&events, 1_000);
        let got: Vec<(&str, i64, i64, bool, usize, bool)> = v
            .iter()
            .map(|v| {
                (
                    v.stage.as_str(),
                    v.start_ms,
                    v.end_ms,
                    v.loop_back,
                    v.waits,
                    v.current,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("intake", 0, 100, false, 0, false),
                ("implementation", 100, 400, false, 0, false),
                ("review", 400, 500, false, 0, false),
                ("implementation", 500, 900, true, 1, false),
                ("review", 900, 1_000, false, 0, true),
            ]
        );
        let mut done = events.to_vec();
        done.push(ev(7, "task.done", "done", 950));
        let v = visits(&done, 5_000);
        assert_eq!(
            v.last().map(|v| (v.terminal, v.current)),
            Some((true, false))
        );
        assert_eq!(v[v.len() - 2].end_ms, 950);
    }

    #[test]
    fn the_series_is_read_back_from_the_post_deploy_log() {
        let log = "---\npost_deploy_status: FAILED\n---\n# 16\n\n## Series\n\n\
| tick | at | poll | check | outcome | status | latency | detail |\n\
|---|---|---|---|---|---|---|---|\n\
| 0 | 2026-11-29T10:00:00Z | PASS | health | PASS | 200 | 12 ms | ok |\n\
| 0 | 2026-11-29T10:00:00Z | PASS | revision | PASS | 200 | 30 ms | ok |\n\
| 1 | 2026-11-29T10:00:30.500Z | FAIL | health | FAIL | 500 | 7 ms | boom \\| x |\n\
| 2 | 2026-11-29T10:01:00Z | ERROR | health | ERROR | — | — | refused |\n\
| x | bad | row |\n\
\n## Reaction\n\n| 9 | 2026-11-29T10:09:00Z | PASS | h | PASS | 200 | 1 ms | after |\n";
        let s = series_from_log(log);
        let got: Vec<(i64, &str, Option<f64>)> = s
            .iter()
            .map(|p| (p.at_ms, p.status.as_str(), p.value))
            .collect();
        let t0 = 1_795_946_400_000;
        assert_eq!(
            got,
            [
                (t0, "PASS", Some(30.0)),
                (t0 + 30_500, "FAIL", Some(7.0)),
                (t0 + 60_000, "ERROR", None),
            ]
        );
        assert!(series_from_log("no table").is_empty());
    }

    #[test]
    fn rfc3339() {
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_rfc3339_ms("2000-02-29T00:00:00.25Z"),
            Some(951_782_400_250)
        );
        assert_eq!(parse_rfc3339_ms("2000-13-01T00:00:00Z"), None);
        assert_eq!(parse_rfc3339_ms("garbage"), None);
    }
}
