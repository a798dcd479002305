//! The HTTP API's `Operations`, implemented by the runner's operator operations, counters and
//! the state files on this machine.

use std::sync::Arc;

use orch_api::{
    Actor, ArtifactFile, ConfigReport, Histogram, Observation, OpError, Operations, RunnerCounters,
    SeriesPoint, SubmitRequest, SubmitResult, WebhookDelivery, WebhookReply, WorkerTimings,
};
use orch_deploystate::{ArmedRead, WatchState};
use orch_runner::histogram::HistogramSnapshot;
use orch_runner::ops::{Ops, OpsError};
use orch_runner::worker::WorkerStats;

pub struct ApiOps {
    pub runtime: Arc<crate::runtime::Runtime>,
    pub worker_stats: Arc<WorkerStats>,
}

fn histogram(h: HistogramSnapshot) -> Histogram {
    Histogram {
        buckets: h.buckets,
        sum_seconds: h.sum_seconds,
        count: h.count,
    }
}

fn op_err(e: OpsError) -> OpError {
    match e {
        OpsError::NotFound(m) => OpError::NotFound(m),
        OpsError::Conflict(m) => OpError::Conflict(m),
        OpsError::Invalid(m) => OpError::Invalid(m),
        // A store that is down is a 503, not a 500.
        OpsError::Internal(e) => OpError::from(e),
    }
}

impl ApiOps {
    fn ops(&self) -> &Ops {
        &self.runtime.ops
    }
}

#[async_trait::async_trait]
impl Operations for ApiOps {
    async fn submit(&self, req: SubmitRequest, by: &Actor) -> Result<SubmitResult, OpError> {
        let task = self
            .ops()
            .submit(&req.repo, &req.title, &req.body, by)
            .await
            .map_err(op_err)?;
        Ok(SubmitResult {
            work_item_id: task.work_item_id.to_string(),
            task_id: task.id,
        })
    }

    async fn forge_webhook(&self, d: WebhookDelivery) -> Result<WebhookReply, OpError> {
        use orch_runner::forge::{self, Received, WebhookError};
        let config = self.runtime.live.current();
        let headers = forge::Delivery {
            event: d.event,
            delivery: d.delivery,
            signature: d.signature,
        };
        let store = self.runtime.engine.store();
        match forge::receive_webhook(store, &config, &d.repo, &headers, &d.body).await {
            Ok(Received::Queued {
                work_item,
                duplicate,
            }) => Ok(WebhookReply::Queued {
                work_item_id: work_item,
                duplicate,
            }),
            Ok(Received::Ignored(why)) => Ok(WebhookReply::Ignored(why)),
            Err(WebhookError::NotFound(m)) => Err(OpError::NotFound(m)),
            Err(WebhookError::Unauthorized(m)) => Err(OpError::Unauthorized(m)),
            Err(WebhookError::Invalid(m)) => Err(OpError::Invalid(m)),
            Err(WebhookError::Store(e)) => Err(OpError::from(anyhow::Error::new(e))),
        }
    }

    async fn approve(&self, id: &str, by: &Actor) -> Result<(), OpError> {
        self.ops().approve(id, by).await.map(|_| ()).map_err(op_err)
    }

    async fn retry(&self, id: &str, by: &Actor) -> Result<(), OpError> {
        self.ops().retry(id, by).await.map(|_| ()).map_err(op_err)
    }

    async fn cancel(&self, id: &str, by: &Actor) -> Result<(), OpError> {
        self.ops().cancel(id, by).await.map(|_| ()).map_err(op_err)
    }

    async fn runner_counters(&self) -> Vec<RunnerCounters> {
        use std::sync::atomic::Ordering::Relaxed;
        let s = &self.worker_stats;
        let mut out = vec![RunnerCounters {
            runner: "worker".into(),
            counters: vec![
                ("claimed".into(), s.claimed.load(Relaxed)),
                ("done".into(), s.done.load(Relaxed)),
                ("retried".into(), s.retried.load(Relaxed)),
                ("failed".into(), s.failed.load(Relaxed)),
                ("fenced".into(), s.fenced.load(Relaxed)),
                ("leases_lost".into(), s.leases_lost.load(Relaxed)),
                ("released".into(), s.released.load(Relaxed)),
                ("store_errors".into(), s.store_errors.load(Relaxed)),
            ],
        }];
        out.extend(
            self.runtime
                .counters
                .snapshot()
                .into_iter()
                .map(|(runner, counters)| RunnerCounters { runner, counters }),
        );
        out
    }

    async fn worker_timings(&self) -> WorkerTimings {
        let s = &self.worker_stats;
        WorkerTimings {
            job_seconds: s
                .job_seconds
                .snapshot()
                .into_iter()
                .map(|(agent, h)| (agent, histogram(h)))
                .collect(),
            claim_wait: histogram(s.claim_wait.snapshot()),
            claim_query: histogram(s.claim_query.snapshot()),
        }
    }

    fn config_state(&self) -> Option<ConfigReport> {
        let st = self.runtime.live.state();
        Some(ConfigReport {
            generation: st.generation,
            loaded_at_ms: st.loaded_at_ms,
            stale: st.stale,
            restart_needed: st.restart_needed,
        })
    }

    async fn release_tracks(&self) -> Vec<orch_api::ReleaseTrack> {
        let engine = &self.runtime.engine;
        release_tracks(engine.store(), &engine.config().pipeline).await
    }

    async fn active_observations(&self) -> Vec<Observation> {
        active_observations(self.runtime.places.repos_dir.clone()).await
    }

    async fn observation_series(&self, work_item_id: &str) -> Vec<SeriesPoint> {
        let repos_dir = self.runtime.places.repos_dir.clone();
        let id = work_item_id.to_owned();
        let Ok(task) = self.ops().task(&id).await else {
            return Vec::new();
        };
        tokio::task::spawn_blocking(move || {
            WatchState::new(&repos_dir, task.repo.as_str(), &id)
                .series()
                .polls
                .iter()
                .map(|p| SeriesPoint {
                    at_ms: p.at_ms,
                    status: p.status().as_str().to_owned(),
                    value: p
                        .checks
                        .iter()
                        .filter_map(|c| c.latency_ms)
                        .max()
                        .map(|ms| ms as f64),
                })
                .collect()
        })
        .await
        .unwrap_or_default()
    }

    fn unsandboxed_repos(&self) -> Vec<String> {
        self.runtime
            .live
            .current()
            .repos
            .iter()
            .filter(|(_, r)| !r.sandbox.enabled)
            .map(|(name, _)| name.to_string())
            .collect()
    }

    async fn repo_lessons(&self, repo: &str) -> Option<String> {
        let name: orch_domain::ids::RepoName = repo.parse().ok()?;
        let rc = self.runtime.config.repos.get(&name)?;
        let rel = rc.lessons_file.trim();
        // Only a path inside the repo, read from the default branch where lessons commits it.
        let inside = !rel.is_empty()
            && std::path::Path::new(rel)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !inside {
            return None;
        }
        let repo_dir = self.runtime.places.repos_dir.join(repo);
        if !repo_dir.join(".git").exists() {
            return None;
        }
        match self
            .runtime
            .engine
            .git()
            .show_file(&repo_dir, &rc.default_branch, rel)
            .await
        {
            Ok(text) => text,
            Err(e) => {
                tracing::warn!(repo, error = %e, "cannot read the repo's lessons file");
                None
            }
        }
    }

    async fn run_transcript(&self, id: &str, run_id: i64) -> Option<orch_api::RunTranscript> {
        read_transcript(&self.runtime.places.repos_dir, id, run_id).await
    }

    async fn artifacts(&self, id: &str) -> Result<Vec<ArtifactFile>, OpError> {
        let task = self.ops().task(id).await.map_err(op_err)?;
        let repo_dir = self.runtime.places.repos_dir.join(task.repo.as_str());
        if !repo_dir.join(".git").exists() {
            return Ok(Vec::new());
        }
        let git = self.runtime.engine.git();
        let dir = task.work_item_id.artifact_dir();
        let files = match git.files_at(&repo_dir, &task.branch, &dir).await {
            Ok(files) => files,
            // All at once failed (more than git's output limit in all, an object missing):
            // file by file, skipping what cannot be read, as the page always did.
            Err(e) => {
                tracing::warn!(work_item = %task.work_item_id, error = %e, "cannot read the artifacts at once; reading them one by one");
                let mut files = Vec::new();
                let paths = git
                    .log_files(&repo_dir, &task.branch, &dir)
                    .await
                    .map_err(|e| OpError::Internal(e.to_string()))?;
                for path in paths {
                    if let Ok(Some(content)) = git.show_file(&repo_dir, &task.branch, &path).await {
                        files.push((path, content));
                    }
                }
                files
            }
        };
        let mut out: Vec<ArtifactFile> = files
            .into_iter()
            .map(|(path, content)| {
                let name = path.rsplit('/').next().unwrap_or(&path).to_owned();
                ArtifactFile { name, content }
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }
}

/// Each repo's release track (holder, hold, waiting items), read from the store; empty (with a
/// warning) when it cannot be read.
pub async fn release_tracks(
    store: &orch_store::Store,
    pipeline: &orch_domain::pipeline::Pipeline,
) -> Vec<orch_api::ReleaseTrack> {
    match orch_runner::release::tracks(store, pipeline).await {
        Ok(tracks) => tracks
            .into_iter()
            .map(|(repo, holder, held, waiting)| orch_api::ReleaseTrack {
                repo,
                holder,
                held,
                waiting,
            })
            .collect(),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "cannot read the release tracks");
            Vec::new()
        }
    }
}

/// The post-deploy watches armed on this machine (their sentinel files under `repos_dir`).
pub async fn active_observations(repos_dir: std::path::PathBuf) -> Vec<Observation> {
    tokio::task::spawn_blocking(move || {
        orch_deploystate::list_active(&repos_dir)
            .into_iter()
            .map(|w| {
                let series = WatchState::new(&repos_dir, &w.repo, &w.work_item_id).series();
                let polls = series.polls.len() as u64;
                match w.armed {
                    ArmedRead::Present(r) => Observation {
                        work_item_id: w.work_item_id,
                        repo: w.repo,
                        armed_at_ms: Some(r.armed_at_ms),
                        deadline_ms: Some(r.deadline_ms),
                        revision: r.revision,
                        polls,
                        problem: series.lost,
                    },
                    // Listed anyway: a stale or corrupt watch is exactly what an operator must
                    // see; its times are unknown, never made up.
                    ArmedRead::Corrupt(why) => Observation {
                        work_item_id: w.work_item_id,
                        repo: w.repo,
                        armed_at_ms: None,
                        deadline_ms: None,
                        revision: "unknown (state unreadable)".into(),
                        polls,
                        problem: Some(format!("armed unusable: {why}")),
                    },
                    ArmedRead::Absent => Observation {
                        work_item_id: w.work_item_id,
                        repo: w.repo,
                        armed_at_ms: None,
                        deadline_ms: None,
                        revision: "unknown (state unreadable)".into(),
                        polls,
                        problem: Some("armed vanished while listing".into()),
                    },
                }
            })
            .collect()
    })
    .await
    .unwrap_or_default()
}

/// Agent run `run_id`'s transcript and diff under `repos_dir` (`None` when this machine keeps
/// no transcript of it). `work_item` is a validated id.
pub async fn read_transcript(
    repos_dir: &std::path::Path,
    work_item: &str,
    run_id: i64,
) -> Option<orch_api::RunTranscript> {
    use orch_runner::agents::transcript::{diff_relative_path, relative_path};
    let text = tokio::fs::read(repos_dir.join(relative_path(work_item, run_id)))
        .await
        .ok()?;
    let diff = tokio::fs::read(repos_dir.join(diff_relative_path(work_item, run_id)))
        .await
        .ok()
        .map(|d| String::from_utf8_lossy(&d).into_owned());
    Some(orch_api::RunTranscript {
        text: String::from_utf8_lossy(&text).into_owned(),
        diff,
    })
}
