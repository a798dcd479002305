//! The forge integration (issue 31), GitHub first: labeled open issues become work items, by
//! polling with conditional requests ([`ForgePass`]) and by signed webhook deliveries
//! ([`receive_webhook`], whose job [`ForgeIssueHandler`] runs). The REST calls of the way back
//! (pull requests, statuses, reviews, comments) are their own section below; what to send and
//! when is [`crate::forge_sync`]'s.
//!
//! Invariants:
//! - Once per issue: an issue's item is `<prefix>-<number>` ([`orch_domain::forge::work_item_id`])
//!   whichever way orch learns of it, created with `WorkItemSpec::Exact`, so the store's unique
//!   work item id makes a second creation (another process polling the same PostgreSQL, a
//!   webhook racing the poll, a redelivery) a no-op. No leader is needed.
//! - The item is made as a submit makes one ([`crate::ops::new_task`]: its title and body
//!   rules, stage `intake` with its first job, `task.submitted`; then the `intake` stage writes
//!   `01-request.md`); the issue's text is bounded and only ever the request's body
//!   ([`orch_domain::forge::request_of`]).
//! - The token is read from the environment variable the config names when a request is made;
//!   it is sent only in the `Authorization` header to the configured API and never written to
//!   a log line, an event or an error (errors name the status, never the request).
//! - A good API citizen: `If-None-Match` with the ETag of each page (an unchanged listing is a
//!   304, which GitHub does not count against the rate limit), `Link` pagination, and the pause
//!   [`orch_domain::forge::pause_after`] decides after every answer (rate limits waited out,
//!   outages backed off with jitter). A forge that does not answer makes polling wait,
//!   visibly (`forge.waiting`, then `forge.resumed`), and fails nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hmac::{KeyInit as _, Mac as _};
use orch_domain::config::{Config, RepoConfig};
use orch_domain::control::actor::Actor;
use orch_domain::control::{dedupe, events, jobs};
use orch_domain::forge::{self, Answer, ForgeConfig, Issue};
use orch_domain::ids::RepoName;
use orch_domain::pipeline::Pipeline;
use orch_store::{NewEvent, NewJob, Store, StoreError, WorkItemSpec};
use serde::Deserialize;
use serde_json::json;

use crate::live_config::LiveConfig;
use crate::worker::{JobContext, JobHandler, Outcome};

/// Publishing a release through the API when the default branch refuses orch's push.
pub mod release;

/// The kind of the job a webhook delivery enqueues.
pub const FORGE_ISSUE: &str = jobs::FORGE_ISSUE;
/// GitHub's REST API version orch speaks.
pub const API_VERSION: &str = "2022-11-28";
/// Longest one request to the forge may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The most pages of one listing read in one poll (100 issues a page).
pub const MAX_PAGES: usize = 50;
/// The largest webhook delivery accepted (GitHub caps its payloads at 25 MB; an issue's
/// fields are far smaller, and orch keeps at most [`forge::MAX_ISSUE_BODY_BYTES`] of its body).
pub const MAX_WEBHOOK_BYTES: usize = 1024 * 1024;

/// How orch learned of an issue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Poll,
    Webhook,
}

impl Via {
    fn as_str(self) -> &'static str {
        match self {
            Via::Poll => "poll",
            Via::Webhook => "webhook",
        }
    }
}

/// Whether [`create_item`] made the item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Created {
    New(String),
    Existed(String),
}

/// Creates the work item of `issue` of `repo`'s forge, or finds it: the submit path with the
/// issue's id (`<prefix>-<number>`), so a second call, from any process, creates nothing.
pub async fn create_item(
    store: &Store,
    pipeline: &Pipeline,
    repo: &RepoName,
    forge_cfg: &ForgeConfig,
    issue: &Issue,
    via: Via,
) -> Result<Created, StoreError> {
    let id = forge::work_item_id(&forge_cfg.prefix, issue.number);
    if store.get_task_by_work_item(&id).await?.is_some() {
        return Ok(Created::Existed(id));
    }
    let (title, body) = forge::request_of(&forge_cfg.repo, issue);
    let by = Actor::Orch {
        what: format!(
            "GitHub issue {}#{}, by {}",
            forge_cfg.repo,
            issue.number,
            via.as_str()
        ),
    };
    let mut extra = serde_json::Map::new();
    // The item's origin, typed (`forge::Origin`): what the forge sync reads back to open the
    // pull request, follow reviews and say the outcome on the issue.
    let origin = forge::Origin {
        kind: "github".to_owned(),
        repo: forge_cfg.repo.clone(),
        issue: issue.number,
        url: issue.html_url.clone(),
        via: Some(via.as_str().to_owned()),
    };
    extra.insert(
        forge::Origin::KEY.to_owned(),
        serde_json::to_value(&origin)
            .map_err(|e| StoreError::Invalid(format!("issue #{}: {e}", issue.number)))?,
    );
    // The submit's own rules and shape; `request_of` keeps within them, so a refusal here
    // is a bug, reported as the store's kind of refusal.
    let task = crate::ops::new_task(
        pipeline,
        repo,
        WorkItemSpec::Exact(
            id.parse()
                .map_err(|e| StoreError::Invalid(format!("issue #{}: {e}", issue.number)))?,
        ),
        &title,
        &body,
        &by,
        extra,
    )
    .map_err(|e| StoreError::Invalid(format!("issue #{} as a request: {e}", issue.number)))?;
    let created = store.create_task(task).await;
    match created {
        Ok(_) => {
            tracing::info!(work_item = %id, forge = %forge_cfg.repo, issue = issue.number, via = via.as_str(),
                "a labeled issue became a work item");
            Ok(Created::New(id))
        }
        Err(StoreError::WorkItemTaken(_)) => Ok(Created::Existed(id)),
        Err(e) => Err(e),
    }
}

/// The value of environment variable `var`, when set and not blank.
fn secret_from_env(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|v| !v.trim().is_empty())
}

/// One issue as GitHub's REST API and webhooks give it (the fields orch reads).
#[derive(Debug, Clone, Deserialize)]
pub struct ApiIssue {
    pub number: u64,
    pub title: String,
    #[serde(default)]
    pub body: Option<String>,
    pub html_url: String,
    #[serde(default)]
    pub state: Option<String>,
    #[serde(default)]
    pub labels: Vec<ApiLabel>,
    /// Present on pull requests, which the issues listing includes.
    #[serde(default)]
    pub pull_request: Option<serde_json::Value>,
}

/// A label (GitHub's REST API gives objects; orch reads the name).
#[derive(Debug, Clone, Deserialize)]
pub struct ApiLabel {
    #[serde(default)]
    pub name: Option<String>,
}

impl ApiIssue {
    fn issue(&self) -> Issue {
        Issue {
            number: self.number,
            title: self.title.clone(),
            body: self.body.clone(),
            html_url: self.html_url.clone(),
        }
    }
}

/// A number in `[0, 1)` that differs between processes and tries (the clock's nanoseconds):
/// enough to keep several orch processes from retrying an outage in step.
pub(crate) fn jitter() -> f64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    f64::from(nanos) / 1e9
}

/// The shared HTTP client of forge requests.
fn client() -> Result<reqwest::Client, String> {
    crate::deploy::probe::client(REQUEST_TIMEOUT)
}

/// The headers every request to GitHub carries (the token aside).
fn github_request(client: &reqwest::Client, url: &str, token: &str) -> reqwest::RequestBuilder {
    github_method(client, reqwest::Method::GET, url, token)
}

/// [`github_request`] with another method.
fn github_method(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    token: &str,
) -> reqwest::RequestBuilder {
    client
        .request(method, url)
        .header("accept", "application/vnd.github+json")
        .header("x-github-api-version", API_VERSION)
        .header("user-agent", concat!("orch/", env!("CARGO_PKG_VERSION")))
        .bearer_auth(token)
}

/// What pacing reads of an answer's headers.
fn answer_of(status: u16, headers: &reqwest::header::HeaderMap) -> Answer {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    Answer {
        status,
        retry_after: text("retry-after"),
        remaining: text("x-ratelimit-remaining").and_then(|v| v.trim().parse().ok()),
        reset: text("x-ratelimit-reset").and_then(|v| v.trim().parse().ok()),
        checks_pending: false,
    }
}

/// A page seen before: its ETag and where its `next` link pointed.
#[derive(Debug, Clone, Default)]
struct CachedPage {
    etag: String,
    next: Option<String>,
}

/// What one poll of a repo's listing did, counted also when it stopped early.
#[derive(Debug, Default)]
struct Tally {
    /// Requests sent.
    requests: u32,
    /// Of those, answered 304 (not counted by GitHub's rate limit).
    not_modified: u32,
    /// Items created.
    created: u32,
}

/// What one poll of a repo's listing found.
#[derive(Debug, Default)]
pub struct PollResult {
    /// Items created.
    pub created: Vec<String>,
    /// The pause the last answer asked for (a used-up quota), if any.
    pub pause: Option<forge::Pause>,
}

/// Why a poll stopped early: the answer that stopped it (its status, or 0 for none) and what
/// was wrong, without the request (which holds no secret, but the rule is simpler so).
#[derive(Debug)]
pub struct PollError {
    pub answer: Answer,
    pub message: String,
}

/// The per-repo state of polling: when the next poll is due, the failures in a row, the
/// pages' ETags, and since when polling has been waiting (for `forge.waiting`/`forge.resumed`).
#[derive(Debug, Default)]
struct RepoPoll {
    next_at_ms: i64,
    failures: u32,
    waiting_since_ms: Option<i64>,
    pages: HashMap<String, CachedPage>,
}

/// The counter group of the forge in `GET /queue` and `/metrics` (`orch_forge_*`): requests
/// sent, of them answered 304 (free of rate limit), items created by polling, times polling
/// started waiting (`forge.waiting`) and resumed (`forge.resumed`): waiting now is
/// `waits - resumed`.
pub const COUNTERS: (&str, &[&str]) = (
    "forge",
    &[
        "requests",
        "not_modified",
        "items_created",
        "waits",
        "resumed",
    ],
);

/// What a pass keeps between its turns per configured forge repo (`state_key`), in memory: a
/// turn takes a repo's state out, works on it, and puts it back.
pub(crate) struct RepoStates<T>(Mutex<HashMap<String, T>>);

impl<T: Default> RepoStates<T> {
    pub(crate) fn new() -> RepoStates<T> {
        RepoStates(Mutex::new(HashMap::new()))
    }

    /// The state of `key` (a fresh one when there is none, or the lock is poisoned).
    pub(crate) fn take(&self, key: &str) -> T {
        match self.0.lock() {
            Ok(mut m) => m.remove(key).unwrap_or_default(),
            Err(_) => T::default(),
        }
    }

    pub(crate) fn put(&self, key: String, state: T) {
        if let Ok(mut m) = self.0.lock() {
            m.insert(key, state);
        }
    }
}

/// The key of a repo's forge state: a config change to the forge's repo or API starts afresh.
pub(crate) fn state_key(name: &RepoName, forge_cfg: &ForgeConfig) -> String {
    format!("{name}\n{}\n{}", forge_cfg.repo, forge_cfg.api_url)
}

/// Polls each configured repo's forge for labeled open issues, every `poll_interval_s`, as a
/// maintenance pass (every process runs it; creation is idempotent, so no leader is needed).
pub struct ForgePass {
    pub live: LiveConfig,
    pub pipeline: Arc<Pipeline>,
    /// How often the pass looks whether a repo's poll is due.
    pub tick: Duration,
    counters: Arc<crate::counters::Counters>,
    state: RepoStates<RepoPoll>,
}

impl ForgePass {
    pub fn new(
        live: LiveConfig,
        pipeline: Arc<Pipeline>,
        counters: Arc<crate::counters::Counters>,
    ) -> ForgePass {
        counters.declare(COUNTERS.0, COUNTERS.1);
        ForgePass {
            live,
            pipeline,
            tick: Duration::from_secs(1),
            counters,
            state: crate::forge::RepoStates::new(),
        }
    }

    async fn poll_one(
        &self,
        store: &Store,
        name: &RepoName,
        forge_cfg: &ForgeConfig,
    ) -> anyhow::Result<()> {
        let key = state_key(name, forge_cfg);
        let now = store.now_ms();
        let mut st = self.state.take(&key);
        if now < st.next_at_ms {
            self.state.put(key, st);
            return Ok(());
        }
        let interval_ms =
            i64::try_from(forge_cfg.poll_interval_s.saturating_mul(1000)).unwrap_or(i64::MAX);
        let mut tally = Tally::default();
        let result = poll(
            store,
            &self.pipeline,
            name,
            forge_cfg,
            &mut st.pages,
            &mut tally,
        )
        .await;
        let group = COUNTERS.0;
        self.counters
            .add(group, "requests", u64::from(tally.requests));
        self.counters
            .add(group, "not_modified", u64::from(tally.not_modified));
        self.counters
            .add(group, "items_created", u64::from(tally.created));
        let now = store.now_ms();
        let (pause, note) = match &result {
            Ok(r) => (r.pause.clone(), None),
            Err(e) => {
                st.failures = st.failures.saturating_add(1);
                let pause = forge::pause_after(
                    &e.answer,
                    now / 1000,
                    st.failures,
                    forge_cfg.poll_interval_s,
                    forge_cfg.max_backoff_s,
                    jitter(),
                );
                (pause, Some(e.message.clone()))
            }
        };
        if result.is_ok() {
            st.failures = 0;
        }
        match pause {
            Some(p) => {
                st.next_at_ms = now.saturating_add(
                    i64::try_from(p.secs.saturating_mul(1000)).unwrap_or(i64::MAX / 2),
                );
                let why = match &note {
                    Some(m) => format!("{}: {m}", p.why),
                    None => p.why.clone(),
                };
                tracing::warn!(repo = %name, forge = %forge_cfg.repo, wait_s = p.secs, failures = st.failures, "forge: {why}");
                if st.waiting_since_ms.is_none() {
                    st.waiting_since_ms = Some(now);
                    self.counters.incr(group, "waits");
                    let event = NewEvent::new(
                        events::FORGE_WAITING,
                        format!(
                            "polling GitHub {} for repo {name} waits {} s: {why}; no item fails, polling resumes by itself",
                            forge_cfg.repo, p.secs
                        ),
                    )
                    .data(
                        json!({"repo": name.as_str(), "forge": forge_cfg.repo, "why": why,
                               "wait_s": p.secs, "failures": st.failures})
                        .to_string(),
                    );
                    if let Err(e) = store.append_event(event).await {
                        tracing::warn!(error = %e, "forge: cannot record forge.waiting");
                    }
                }
            }
            None => {
                st.next_at_ms = now.saturating_add(interval_ms.max(1));
                if let Some(since) = st.waiting_since_ms.take() {
                    self.counters.incr(group, "resumed");
                    let waited_s = (now - since) / 1000;
                    let event = NewEvent::new(
                        events::FORGE_RESUMED,
                        format!(
                            "GitHub {} answers again; polling for repo {name} resumed after {waited_s} s",
                            forge_cfg.repo
                        ),
                    )
                    .data(
                        json!({"repo": name.as_str(), "forge": forge_cfg.repo, "waited_s": waited_s})
                            .to_string(),
                    );
                    if let Err(e) = store.append_event(event).await {
                        tracing::warn!(error = %e, "forge: cannot record forge.resumed");
                    }
                }
            }
        }
        self.state.put(key, st);
        Ok(())
    }
}

#[async_trait::async_trait]
impl crate::maintenance::Pass for ForgePass {
    fn name(&self) -> &'static str {
        "forge"
    }

    fn every(&self) -> Duration {
        self.tick
    }

    async fn run(&self, store: &Store) -> anyhow::Result<()> {
        let config = self.live.current();
        for (name, repo) in &config.repos {
            let Some(forge_cfg) = repo.forge.as_ref().filter(|f| f.poll_interval_s > 0) else {
                continue;
            };
            self.poll_one(store, name, forge_cfg).await?;
        }
        Ok(())
    }
}

/// One page of a forge's listing of labeled open issues, asked for with the ETag orch had.
#[derive(Debug)]
pub enum Page {
    /// Unchanged since that ETag (on GitHub: free of rate limit).
    NotModified { answer: Answer },
    /// The page: its issues (pull requests left out), its ETag, where the next page is.
    Fresh {
        answer: Answer,
        issues: Vec<Issue>,
        etag: Option<String>,
        next: Option<String>,
    },
}

/// What orch asks of a forge to take its issues in: the small interface a GitLab or Forgejo
/// implementation follows ([`GitHub`] is the first). The rest is the same for every forge and
/// stays out of it: pacing ([`forge::pause_after`] on each [`Answer`]), the ETags kept per
/// page, creating items, `forge.waiting`. (Webhook deliveries are GitHub's so far:
/// [`receive_webhook`].)
#[async_trait::async_trait]
pub trait Forge: Send + Sync {
    /// The listing's first page: the open issues carrying the configured label.
    fn first_page(&self) -> Result<String, String>;
    /// One page of the listing, conditional on `etag`; an error is the answer that stopped it.
    async fn page(&self, url: &str, etag: Option<&str>) -> Result<Page, PollError>;
}

/// The forge `forge_cfg` names, with its token read from its variable now.
pub fn connect(forge_cfg: &ForgeConfig) -> Result<Box<dyn Forge>, PollError> {
    match forge_cfg.kind {
        forge::ForgeKind::Github => Ok(Box::new(GitHub::connect(forge_cfg)?)),
    }
}

/// GitHub's REST API (github.com or GitHub Enterprise Server at `api_url`).
pub struct GitHub {
    cfg: ForgeConfig,
    client: reqwest::Client,
    /// Sent only in the `Authorization` header to `api_url`; never shown (no `Debug`).
    token: String,
}

impl GitHub {
    pub fn connect(forge_cfg: &ForgeConfig) -> Result<GitHub, PollError> {
        let token = secret_from_env(&forge_cfg.token_env).ok_or_else(|| {
            poll_error(
                401,
                format!(
                    "the environment variable {} holding the token is not set",
                    forge_cfg.token_env
                ),
            )
        })?;
        Ok(GitHub {
            cfg: forge_cfg.clone(),
            client: client().map_err(|e| poll_error(0, e))?,
            token,
        })
    }
}

fn poll_error(status: u16, message: String) -> PollError {
    PollError {
        answer: Answer {
            status,
            ..Answer::default()
        },
        message,
    }
}

#[async_trait::async_trait]
impl Forge for GitHub {
    fn first_page(&self) -> Result<String, String> {
        first_page_url(&self.cfg)
    }

    async fn page(&self, url: &str, etag: Option<&str>) -> Result<Page, PollError> {
        let mut req = github_request(&self.client, url, &self.token);
        if let Some(etag) = etag {
            req = req.header("if-none-match", etag);
        }
        let resp = req.send().await.map_err(|e| {
            poll_error(
                0,
                if e.is_timeout() {
                    format!("no answer within {} s", REQUEST_TIMEOUT.as_secs())
                } else {
                    "the connection failed".to_owned()
                },
            )
        })?;
        let status = resp.status().as_u16();
        let answer = answer_of(status, resp.headers());
        if status == 304 {
            return Ok(Page::NotModified { answer });
        }
        if status != 200 {
            return Err(PollError {
                answer,
                message: format!("listing the issues answered HTTP {status}"),
            });
        }
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let etag = header("etag");
        let next = header("link")
            .as_deref()
            .and_then(forge::next_link)
            .filter(|n| listing_page(n, &self.cfg.api_url, &self.cfg.repo));
        let issues: Vec<ApiIssue> = resp.json().await.map_err(|_| PollError {
            answer: Answer {
                status: 502,
                ..answer.clone()
            },
            message: "the listing is not a JSON array of issues".to_owned(),
        })?;
        Ok(Page::Fresh {
            answer,
            issues: issues
                .iter()
                .filter(|i| i.pull_request.is_none())
                .map(ApiIssue::issue)
                .collect(),
            etag,
            next,
        })
    }
}

/// One poll of `repo`'s labeled open issues, page by page, each page asked for with its last
/// ETag; creates the item of every issue not yet one. A page's ETag is kept only once its
/// issues are all items, so a failure in between is retried by the next poll.
async fn poll(
    store: &Store,
    pipeline: &Pipeline,
    name: &RepoName,
    forge_cfg: &ForgeConfig,
    pages: &mut HashMap<String, CachedPage>,
    tally: &mut Tally,
) -> Result<PollResult, PollError> {
    let forge = connect(forge_cfg)?;
    let mut url = Some(forge.first_page().map_err(|e| poll_error(400, e))?);
    let mut out = PollResult::default();
    let mut seen = 0;
    let mut visited = std::collections::HashSet::new();
    while let Some(page_url) = url.take() {
        seen += 1;
        if !visited.insert(page_url.clone()) {
            // A `Link` back to a page this poll has read: the listing is not a list.
            tracing::warn!(forge = %forge_cfg.repo, "forge: the pages' `Link` headers go round in a circle; the rest waits for the next poll");
            break;
        }
        if seen > MAX_PAGES {
            tracing::warn!(forge = %forge_cfg.repo, "forge: more than {MAX_PAGES} pages of labeled issues; the rest waits for the next poll");
            break;
        }
        let cached = pages.get(&page_url).cloned();
        tally.requests += 1;
        let page = forge
            .page(&page_url, cached.as_ref().map(|c| c.etag.as_str()))
            .await?;
        let pause = |answer: &Answer| {
            forge::pause_after(
                answer,
                store.now_ms() / 1000,
                0,
                0,
                forge_cfg.max_backoff_s,
                0.5,
            )
        };
        let (answer, issues, etag, next) = match page {
            Page::NotModified { answer } => {
                tally.not_modified += 1;
                out.pause = pause(&answer);
                url = cached.and_then(|c| c.next);
                continue;
            }
            Page::Fresh {
                answer,
                issues,
                etag,
                next,
            } => (answer, issues, etag, next),
        };
        for issue in &issues {
            match create_item(store, pipeline, name, forge_cfg, issue, Via::Poll).await {
                Ok(Created::New(id)) => {
                    tally.created += 1;
                    out.created.push(id);
                }
                Ok(Created::Existed(_)) => {}
                Err(StoreError::Invalid(why)) => {
                    // One issue that cannot be a request must not hold up the others.
                    tracing::warn!(forge = %forge_cfg.repo, issue = issue.number, "forge: issue not taken: {why}");
                }
                Err(e) => {
                    // The store, not the forge: wait as for an outage; the page is asked for
                    // again (its ETag was not kept).
                    return Err(poll_error(
                        0,
                        format!("cannot create the item of issue #{}: {e}", issue.number),
                    ));
                }
            }
        }
        match etag {
            Some(etag) => {
                pages.insert(
                    page_url,
                    CachedPage {
                        etag,
                        next: next.clone(),
                    },
                );
            }
            None => {
                pages.remove(&page_url);
            }
        }
        out.pause = pause(&answer);
        if out.pause.is_some() {
            // The quota is used up (or the forge asked to wait): the next page would only be
            // refused.
            break;
        }
        url = next;
    }
    // Pages the listing no longer has (it shrank) are forgotten.
    pages.retain(|page, _| visited.contains(page));
    Ok(out)
}

/// The listing's first page: the open issues carrying the label, 100 a page.
fn first_page_url(forge_cfg: &ForgeConfig) -> Result<String, String> {
    let (owner, repo) = forge_cfg
        .owner_and_name()
        .ok_or_else(|| format!("`{}` is not owner/name", forge_cfg.repo))?;
    let base = forge_cfg.api_url.trim_end_matches('/');
    reqwest::Url::parse_with_params(
        &format!("{base}/repos/{owner}/{repo}/issues"),
        &[
            ("labels", forge_cfg.label.as_str()),
            ("state", "open"),
            ("per_page", "100"),
        ],
    )
    .map(String::from)
    .map_err(|e| format!("cannot build the listing's URL: {e}"))
}

/// Whether `url` is on the configured API's scheme, host and port: a `Link` elsewhere is not
/// followed (the token goes only to the configured API).
fn same_origin(url: &str, api_url: &str) -> bool {
    match (reqwest::Url::parse(url), reqwest::Url::parse(api_url)) {
        (Ok(a), Ok(b)) => {
            a.scheme() == b.scheme()
                && a.host_str() == b.host_str()
                && a.port_or_known_default() == b.port_or_known_default()
        }
        _ => false,
    }
}

/// Whether `url`, a `Link` of the listing, is another page of this repository's issues on the
/// configured API: the same origin ([`same_origin`]) and the path of the listing
/// (`/repos/<owner>/<name>/issues`, or `/repositories/<id>/issues` as GitHub's own links
/// name it) under the API's base path. Anything else is not followed: its issues would be
/// taken as this repository's.
fn listing_page(url: &str, api_url: &str, repo: &str) -> bool {
    if !same_origin(url, api_url) {
        return false;
    }
    let (Ok(url), Ok(api)) = (reqwest::Url::parse(url), reqwest::Url::parse(api_url)) else {
        return false;
    };
    let base = api.path().trim_end_matches('/');
    let Some(rest) = url.path().strip_prefix(base) else {
        return false;
    };
    if rest.eq_ignore_ascii_case(&format!("/repos/{repo}/issues")) {
        return true;
    }
    rest.strip_prefix("/repositories/")
        .and_then(|r| r.strip_suffix("/issues"))
        .is_some_and(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()))
}

/// The headers of a webhook delivery orch reads.
#[derive(Debug, Clone, Default)]
pub struct Delivery {
    /// `X-GitHub-Event`.
    pub event: Option<String>,
    /// `X-GitHub-Delivery`.
    pub delivery: Option<String>,
    /// `X-Hub-Signature-256`.
    pub signature: Option<String>,
}

/// What [`receive_webhook`] did with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received {
    /// The issue's item will be created (or already is): the job was enqueued, or had been
    /// by an earlier delivery with the same id (`duplicate`).
    Queued { work_item: String, duplicate: bool },
    /// Valid, but nothing for orch (another event, an unlabeled issue, a ping).
    Ignored(String),
}

/// Why a delivery was refused.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// No such repo, or it has no forge with a webhook secret.
    #[error("{0}")]
    NotFound(String),
    /// The signature is missing or wrong.
    #[error("{0}")]
    Unauthorized(String),
    /// The delivery is malformed.
    #[error("{0}")]
    Invalid(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Whether `signature` (`sha256=<hex>`) is the HMAC-SHA256 of `body` with `secret`, compared
/// in constant time.
pub fn signature_valid(secret: &str, body: &[u8], signature: &str) -> bool {
    let Some(hex) = signature.trim().strip_prefix("sha256=") else {
        return false;
    };
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return false;
    }
    let bytes: Vec<u8> = (0..32)
        .filter_map(|i| u8::from_str_radix(&hex[i * 2..i * 2 + 2], 16).ok())
        .collect();
    let Ok(mut mac) = <hmac::Hmac<sha2::Sha256>>::new_from_slice(secret.as_bytes()) else {
        return false;
    };
    mac.update(body);
    mac.verify_slice(&bytes).is_ok()
}

/// The signature GitHub sends for `body` with `secret` (`sha256=<hex>`), for tests and tools.
pub fn sign(secret: &str, body: &[u8]) -> String {
    let Ok(mut mac) = <hmac::Hmac<sha2::Sha256>>::new_from_slice(secret.as_bytes()) else {
        return String::new();
    };
    mac.update(body);
    let hex: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256={hex}")
}

#[derive(Debug, Deserialize)]
struct IssuesPayload {
    action: String,
    issue: ApiIssue,
    #[serde(default)]
    repository: Option<PayloadRepo>,
}

#[derive(Debug, Deserialize)]
struct PayloadRepo {
    full_name: String,
}

/// The content of a [`FORGE_ISSUE`] job.
#[derive(Debug, serde::Serialize, Deserialize)]
struct IssueJob {
    repo: String,
    via: String,
    number: u64,
    title: String,
    body: Option<String>,
    html_url: String,
}

/// Takes one webhook delivery for repo `repo`: verifies its signature with the secret the
/// repo's forge names (before reading anything else of it), then for an `issues` event about
/// an open issue carrying the label enqueues a [`FORGE_ISSUE`] job keyed by the body's
/// signature (dedupe `forge-delivery:<repo>:<hmac>`): the same delivery twice, or its body
/// replayed under another delivery id, is one job, and the job's creation is idempotent like
/// the poll's. A refused delivery changes nothing.
pub async fn receive_webhook(
    store: &Store,
    config: &Config,
    repo: &str,
    delivery: &Delivery,
    body: &[u8],
) -> Result<Received, WebhookError> {
    let not_found = || WebhookError::NotFound(format!("no repo {repo} with a forge webhook"));
    let name: RepoName = repo.parse().map_err(|_| not_found())?;
    let repo_cfg: &RepoConfig = config.repos.get(&name).ok_or_else(not_found)?;
    let forge_cfg = repo_cfg.forge.as_ref().ok_or_else(not_found)?;
    let secret = forge_cfg
        .webhook_secret_env
        .as_deref()
        .and_then(secret_from_env)
        .ok_or_else(|| {
            WebhookError::NotFound(format!(
                "repo {repo} has no webhook secret configured (webhook_secret_env): deliveries are refused"
            ))
        })?;
    if body.len() > MAX_WEBHOOK_BYTES {
        return Err(WebhookError::Invalid(format!(
            "the delivery is over {MAX_WEBHOOK_BYTES} bytes"
        )));
    }
    let signed = delivery
        .signature
        .as_deref()
        .is_some_and(|s| signature_valid(&secret, body, s));
    if !signed {
        return Err(WebhookError::Unauthorized(
            "the delivery's X-Hub-Signature-256 is missing or does not match the webhook secret"
                .into(),
        ));
    }
    // Required and well-formed, as GitHub always sends it (the dedupe key is the signature).
    delivery
        .delivery
        .as_deref()
        .filter(|d| {
            !d.is_empty()
                && d.len() <= 100
                && d.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
        .ok_or_else(|| WebhookError::Invalid("X-GitHub-Delivery is missing or malformed".into()))?;
    match delivery.event.as_deref() {
        Some("issues") => {}
        Some(other) => {
            return Ok(Received::Ignored(format!(
                "event {} is not taken",
                orch_domain::text::escape(other)
            )));
        }
        None => return Err(WebhookError::Invalid("X-GitHub-Event is missing".into())),
    }
    let payload: IssuesPayload = serde_json::from_slice(body)
        .map_err(|e| WebhookError::Invalid(format!("not an issues event payload: {e}")))?;
    if let Some(r) = &payload.repository
        && !r.full_name.eq_ignore_ascii_case(&forge_cfg.repo)
    {
        return Ok(Received::Ignored(format!(
            "the delivery is about {}, not {}",
            orch_domain::text::escape(&r.full_name),
            forge_cfg.repo
        )));
    }
    let labels: Vec<&str> = payload
        .issue
        .labels
        .iter()
        .filter_map(|l| l.name.as_deref())
        .collect();
    let state = payload.issue.state.as_deref().unwrap_or("open");
    if payload.issue.pull_request.is_some()
        || !forge::webhook_wants_item(&payload.action, state, &labels, &forge_cfg.label)
    {
        return Ok(Received::Ignored(format!(
            "issue #{} ({}) is not an open issue labeled {}",
            payload.issue.number,
            orch_domain::text::escape(&payload.action),
            forge_cfg.label
        )));
    }
    let work_item = forge::work_item_id(&forge_cfg.prefix, payload.issue.number);
    let content = IssueJob {
        repo: name.as_str().to_owned(),
        via: Via::Webhook.as_str().to_owned(),
        number: payload.issue.number,
        title: payload.issue.title.clone(),
        body: payload.issue.body.clone(),
        html_url: payload.issue.html_url.clone(),
    };
    let text = serde_json::to_string(&content)
        .map_err(|e| WebhookError::Invalid(format!("cannot keep the issue: {e}")))?;
    // Keyed by the body's signature, not by `X-GitHub-Delivery` alone: the id is not signed,
    // so a signed body replayed under new ids would be a new job each time. A redelivery is
    // the same body, hence the same key.
    let signature = delivery
        .signature
        .as_deref()
        .and_then(|s| s.trim().strip_prefix("sha256="))
        .unwrap_or_default()
        .to_ascii_lowercase();
    let job =
        NewJob::new(FORGE_ISSUE, text).dedupe(dedupe::forge_delivery(name.as_str(), &signature));
    let queued = store.enqueue(job).await?;
    Ok(Received::Queued {
        work_item,
        duplicate: queued.duplicate,
    })
}

/// Runs the [`FORGE_ISSUE`] jobs: creates the issue's item (nothing when it exists).
pub struct ForgeIssueHandler {
    pub store: Store,
    pub live: LiveConfig,
    pub pipeline: Arc<Pipeline>,
}

#[async_trait::async_trait]
impl JobHandler for ForgeIssueHandler {
    async fn run(&self, cx: JobContext) -> anyhow::Result<Outcome> {
        let job: IssueJob = match serde_json::from_str(&cx.job.task_content) {
            Ok(j) => j,
            Err(e) => {
                tracing::warn!(job = cx.job.id, error = %e, "forge: the job holds no issue; dropped");
                return Ok(Outcome::Done);
            }
        };
        let config = self.live.current();
        let Some((name, forge_cfg)) = job.repo.parse::<RepoName>().ok().and_then(|n| {
            let f = config.repos.get(&n)?.forge.clone()?;
            Some((n, f))
        }) else {
            tracing::warn!(repo = %job.repo, "forge: the repo no longer has a forge; the delivered issue is not taken");
            return Ok(Outcome::Done);
        };
        let issue = Issue {
            number: job.number,
            title: job.title,
            body: job.body,
            html_url: job.html_url,
        };
        create_item(
            &self.store,
            &self.pipeline,
            &name,
            &forge_cfg,
            &issue,
            Via::Webhook,
        )
        .await?;
        Ok(Outcome::Done)
    }
}

/// What `orch doctor` found about a repo's forge: how it ended, what, and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    Ok(String),
    Note(String, String),
    Warn(String, String),
    Fail(String, String),
}

/// `orch doctor`'s look at a repo's forge: the token's variable, the repository reachable with
/// it, what the token may do (`X-OAuth-Scopes` of a classic token, the repository's
/// `permissions` for any), the default branch's protection, and the rate limit left. Never
/// names the token, only its variable.
pub async fn inspect(name: &str, forge_cfg: &ForgeConfig, default_branch: &str) -> Vec<Finding> {
    let mut out = Vec::new();
    let what = format!("repo {name}: forge GitHub {}", forge_cfg.repo);
    let Some(token) = secret_from_env(&forge_cfg.token_env) else {
        out.push(Finding::Fail(
            format!("{what}: the token's variable {} is not set", forge_cfg.token_env),
            format!(
                "export {} with a fine-grained token (README \"Working with GitHub\"); until then polling waits (forge.waiting) and no issue becomes an item",
                forge_cfg.token_env
            ),
        ));
        return out;
    };
    let client = match client() {
        Ok(c) => c,
        Err(e) => {
            out.push(Finding::Fail(
                format!("{what}: no HTTP client: {e}"),
                String::new(),
            ));
            return out;
        }
    };
    let Some((owner, repo)) = forge_cfg.owner_and_name() else {
        out.push(Finding::Fail(
            format!("{what}: not owner/name"),
            String::new(),
        ));
        return out;
    };
    let base = forge_cfg.api_url.trim_end_matches('/');
    let url = format!("{base}/repos/{owner}/{repo}");
    let resp = match github_request(&client, &url, &token).send().await {
        Ok(r) => r,
        Err(_) => {
            out.push(Finding::Fail(
                format!("{what}: {base} does not answer"),
                "check api_url and this machine's network; polling waits (forge.waiting) while it does not answer".into(),
            ));
            return out;
        }
    };
    let status = resp.status().as_u16();
    let header = |n: &str| {
        resp.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let scopes = header("x-oauth-scopes");
    let remaining = header("x-ratelimit-remaining");
    let limit = header("x-ratelimit-limit");
    if status != 200 {
        out.push(Finding::Fail(
            format!("{what}: GET /repos/{owner}/{repo} answered HTTP {status}"),
            format!(
                "check that the token in {} can read {} (fine-grained: Metadata read, Issues read/write on it)",
                forge_cfg.token_env, forge_cfg.repo
            ),
        ));
        return out;
    }
    let body: serde_json::Value = resp.json().await.unwrap_or_default();
    out.push(Finding::Ok(format!(
        "{what}: reachable with the token in {}; issues labeled `{}` become {}-<number>{}",
        forge_cfg.token_env,
        forge_cfg.label,
        forge_cfg.prefix,
        match forge_cfg.poll_interval_s {
            0 => " (webhook only: polling is off)".to_owned(),
            s => format!(" (polled every {s} s)"),
        }
    )));
    if let Some(scopes) = scopes.filter(|s| !s.trim().is_empty()) {
        let has = |s: &str| scopes.split(',').any(|x| x.trim() == s);
        if has("repo") {
            out.push(Finding::Ok(format!(
                "{what}: classic token scopes: {scopes}"
            )));
        } else {
            out.push(Finding::Warn(
                format!("{what}: classic token scopes: {scopes} (no `repo`)"),
                "orch needs to read and write issues, pull requests, contents and statuses: use a fine-grained token (README) or add the `repo` scope".into(),
            ));
        }
    }
    let perms = &body["permissions"];
    if perms.is_object() {
        let can = |p: &str| perms[p].as_bool().unwrap_or(false);
        if can("push") {
            out.push(Finding::Ok(format!(
                "{what}: the token may write to the repository"
            )));
        } else {
            out.push(Finding::Warn(
                format!("{what}: the token may only read the repository"),
                "issues still become items, but their pull requests, statuses and outcome comments need write access: Issues, Pull requests, Contents, Commit statuses read/write".into(),
            ));
        }
    }
    let branch_url = format!("{base}/repos/{owner}/{repo}/branches/{default_branch}");
    match github_request(&client, &branch_url, &token).send().await {
        Ok(r) if r.status().as_u16() == 200 => {
            let b: serde_json::Value = r.json().await.unwrap_or_default();
            if b["protected"].as_bool().unwrap_or(false) {
                let how = match forge_cfg.merge_method {
                    forge::MergeMethod::FastForward => "the branch's ref is moved to exactly the staged commit (PATCH git/refs, no force): the token must be allowed past the protection".to_owned(),
                    m => format!("the item's pull request is merged with its head pinned to the staged commit, merge_method {}", m.as_str()),
                };
                out.push(Finding::Note(
                    format!(
                        "{what}: branch {default_branch} is protected: releases go through the API ({})",
                        forge_cfg.merge_method.as_str()
                    ),
                    format!(
                        "when a direct push to {default_branch} is refused, {how}; orch deploys only a commit whose tree is exactly the staged tree (else the item goes back to the merge gate). The token needs Contents and Pull requests read/write"
                    ),
                ));
            } else {
                out.push(Finding::Note(
                    format!("{what}: branch {default_branch} is not protected"),
                    "anyone with write access can push to it beside orch; consider a branch protection rule that lets orch's token push".into(),
                ));
            }
        }
        Ok(r) => out.push(Finding::Warn(
            format!(
                "{what}: branch {default_branch} could not be read (HTTP {})",
                r.status().as_u16()
            ),
            "check default_branch; the token needs Contents read".to_owned(),
        )),
        Err(_) => out.push(Finding::Warn(
            format!("{what}: branch {default_branch} could not be read (no answer)"),
            String::new(),
        )),
    }
    if let (Some(rem), Some(lim)) = (remaining, limit) {
        out.push(Finding::Ok(format!(
            "{what}: rate limit: {rem} of {lim} requests left this hour (an idle poll answered 304 costs none)"
        )));
    }
    if forge_cfg.webhook_secret_env.is_some()
        && forge_cfg
            .webhook_secret_env
            .as_deref()
            .and_then(secret_from_env)
            .is_none()
    {
        out.push(Finding::Warn(
            format!("{what}: webhook_secret_env names a variable that is not set"),
            "every webhook delivery is refused until it is; polling still works".into(),
        ));
    }
    out
}

// =========================================================================================
// Pull requests out, statuses, reviews in, outcomes back (issue 31, second part): the REST
// calls, one method each. What to send and when is `crate::forge_sync`'s; the texts are
// `orch_domain::forge`'s. Every answer that is not the documented success is a `PollError`
// carrying the answer, so the caller paces itself with `forge::pause_after` as polling does.
// =========================================================================================

/// A pull request, as orch reads it.
#[derive(Debug, Clone, Deserialize)]
pub struct ApiPull {
    pub number: u64,
    pub html_url: String,
    pub state: String,
    pub head: ApiRef,
    /// When it was merged (`null` while it was not).
    #[serde(default)]
    pub merged_at: Option<String>,
}

/// A pull request's head or base.
#[derive(Debug, Clone, Deserialize)]
pub struct ApiRef {
    #[serde(rename = "ref")]
    pub name: String,
    pub sha: String,
}

#[derive(Debug, Clone, Deserialize)]
struct ApiUser {
    #[serde(default)]
    login: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
struct ApiReview {
    id: u64,
    #[serde(default)]
    user: Option<ApiUser>,
    #[serde(default)]
    body: Option<String>,
    state: String,
    #[serde(default)]
    commit_id: Option<String>,
    #[serde(default)]
    html_url: Option<String>,
    #[serde(default)]
    author_association: Option<String>,
}

impl ApiReview {
    fn into_review(self) -> forge::Review {
        forge::Review {
            id: self.id,
            state: self.state,
            user: self.user.and_then(|u| u.login).unwrap_or_default(),
            body: self.body.unwrap_or_default(),
            commit: self.commit_id,
            url: self.html_url,
            association: self.author_association,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
struct ApiPermission {
    #[serde(default)]
    permission: Option<String>,
    #[serde(default)]
    role_name: Option<String>,
}

/// Whether `login` can be a GitHub login (letters, digits, hyphens; an app's `[bot]`), so it
/// goes into a URL's path as it is.
fn is_login(login: &str) -> bool {
    let name = login.strip_suffix("[bot]").unwrap_or(login);
    !name.is_empty()
        && name.len() <= 100
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

#[derive(Debug, Clone, Deserialize)]
struct ApiReviewComment {
    path: String,
    #[serde(default)]
    line: Option<u64>,
    #[serde(default)]
    original_line: Option<u64>,
    body: String,
}

#[derive(Debug, Clone, Deserialize)]
struct ApiComment {
    id: u64,
    #[serde(default)]
    body: Option<String>,
    #[serde(default)]
    user: Option<ApiUser>,
}

/// The reviews of a pull request, asked for with the ETag of the last answer.
#[derive(Debug)]
pub enum ReviewsPage {
    NotModified,
    Fresh {
        reviews: Vec<forge::Review>,
        etag: Option<String>,
    },
}

/// The most pages of a pull request's reviews or an issue's comments read (100 a page).
const MAX_LIST_PAGES: usize = 10;

impl GitHub {
    /// `<api>/repos/<owner>/<name><tail>`.
    fn repo_api(&self, tail: &str) -> Result<String, PollError> {
        let (owner, name) = self
            .cfg
            .owner_and_name()
            .ok_or_else(|| poll_error(400, format!("`{}` is not owner/name", self.cfg.repo)))?;
        Ok(format!(
            "{}/repos/{owner}/{name}{tail}",
            self.cfg.api_url.trim_end_matches('/')
        ))
    }

    /// Sends one request (JSON body optional); the answer when its status is in `ok`, else a
    /// `PollError` with the answer (the request is never in it).
    /// `GET url` answered with one of `ok`, its JSON read as `T`; `None` for a 404 (when `ok`
    /// holds it). A body that is not `T` is an error naming `what`.
    async fn get<T: serde::de::DeserializeOwned>(
        &self,
        url: &str,
        ok: &[u16],
        what: &str,
    ) -> Result<Option<T>, PollError> {
        let (status, _, value) = self
            .call(reqwest::Method::GET, url, None, None, ok, what)
            .await?;
        if status == 404 {
            return Ok(None);
        }
        serde_json::from_value(value).map(Some).map_err(|_| {
            poll_error(
                502,
                format!("{what}: GitHub's answer is not the documented shape"),
            )
        })
    }

    async fn call(
        &self,
        method: reqwest::Method,
        url: &str,
        body: Option<&serde_json::Value>,
        etag: Option<&str>,
        ok: &[u16],
        what: &str,
    ) -> Result<(u16, reqwest::header::HeaderMap, serde_json::Value), PollError> {
        let mut req = github_method(&self.client, method, url, &self.token);
        if let Some(etag) = etag {
            req = req.header("if-none-match", etag);
        }
        if let Some(body) = body {
            req = req.json(body);
        }
        let resp = req.send().await.map_err(|e| {
            poll_error(
                0,
                if e.is_timeout() {
                    format!("{what}: no answer within {} s", REQUEST_TIMEOUT.as_secs())
                } else {
                    format!("{what}: the connection failed")
                },
            )
        })?;
        let status = resp.status().as_u16();
        let answer = answer_of(status, resp.headers());
        if !ok.contains(&status) {
            return Err(PollError {
                answer,
                message: format!("{what} answered HTTP {status}"),
            });
        }
        let headers = resp.headers().clone();
        if status == 304 || status == 204 {
            return Ok((status, headers, serde_json::Value::Null));
        }
        let value = resp.json().await.map_err(|_| PollError {
            answer: Answer {
                status: 502,
                ..answer.clone()
            },
            message: format!("{what}: the answer is not JSON"),
        })?;
        Ok((status, headers, value))
    }

    /// The pull request whose head is `branch` of this repository, open or not (the newest).
    pub async fn find_pull(&self, branch: &str) -> Result<Option<ApiPull>, PollError> {
        let (owner, _) = self
            .cfg
            .owner_and_name()
            .ok_or_else(|| poll_error(400, format!("`{}` is not owner/name", self.cfg.repo)))?;
        let url = reqwest::Url::parse_with_params(
            &self.repo_api("/pulls")?,
            &[
                ("head", format!("{owner}:{branch}").as_str()),
                ("state", "all"),
                ("per_page", "100"),
            ],
        )
        .map_err(|e| poll_error(400, format!("cannot build the pulls URL: {e}")))?;
        let (_, _, value) = self
            .call(
                reqwest::Method::GET,
                url.as_str(),
                None,
                None,
                &[200],
                "listing the pull requests",
            )
            .await?;
        let pulls: Vec<ApiPull> = serde_json::from_value(value)
            .map_err(|_| poll_error(502, "the pull requests are not a JSON array".into()))?;
        // The open one first, else the newest (the listing is newest first).
        Ok(pulls
            .iter()
            .find(|p| p.state == "open" && p.head.name == branch)
            .or_else(|| pulls.iter().find(|p| p.head.name == branch))
            .cloned())
    }

    /// Opens a draft pull request of `branch` onto `base`; `None` when GitHub refuses it as
    /// invalid (422: one exists already, or the branch is not on GitHub).
    pub async fn open_pull(
        &self,
        title: &str,
        branch: &str,
        base: &str,
        body: &str,
    ) -> Result<Option<ApiPull>, PollError> {
        let req = json!({"title": title, "head": branch, "base": base, "body": body,
                         "draft": true, "maintainer_can_modify": false});
        let (status, _, value) = self
            .call(
                reqwest::Method::POST,
                &self.repo_api("/pulls")?,
                Some(&req),
                None,
                &[201, 422],
                "opening the pull request",
            )
            .await?;
        if status == 422 {
            return Ok(None);
        }
        serde_json::from_value(value)
            .map(Some)
            .map_err(|_| poll_error(502, "the new pull request is not one".into()))
    }

    /// Pull request `number`.
    pub async fn pull(&self, number: u64) -> Result<ApiPull, PollError> {
        let (_, _, value) = self
            .call(
                reqwest::Method::GET,
                &self.repo_api(&format!("/pulls/{number}"))?,
                None,
                None,
                &[200],
                "reading the pull request",
            )
            .await?;
        serde_json::from_value(value)
            .map_err(|_| poll_error(502, "the pull request is not one".into()))
    }

    /// Sets pull request `number`'s description.
    pub async fn set_pull_body(&self, number: u64, body: &str) -> Result<ApiPull, PollError> {
        let (_, _, value) = self
            .call(
                reqwest::Method::PATCH,
                &self.repo_api(&format!("/pulls/{number}"))?,
                Some(&json!({ "body": body })),
                None,
                &[200],
                "updating the pull request",
            )
            .await?;
        serde_json::from_value(value)
            .map_err(|_| poll_error(502, "the updated pull request is not one".into()))
    }

    /// Closes pull request `number` (`state: closed`); closing a closed one changes nothing.
    pub async fn close_pull(&self, number: u64) -> Result<ApiPull, PollError> {
        let (_, _, value) = self
            .call(
                reqwest::Method::PATCH,
                &self.repo_api(&format!("/pulls/{number}"))?,
                Some(&json!({ "state": "closed" })),
                None,
                &[200],
                "closing the pull request",
            )
            .await?;
        serde_json::from_value(value)
            .map_err(|_| poll_error(502, "the closed pull request is not one".into()))
    }

    /// Reopens pull request `number` (`state: open`); `false` when GitHub refuses (422: its
    /// branch is gone, or another pull request of that branch is open).
    pub async fn reopen_pull(&self, number: u64) -> Result<bool, PollError> {
        let (status, _, _) = self
            .call(
                reqwest::Method::PATCH,
                &self.repo_api(&format!("/pulls/{number}"))?,
                Some(&json!({ "state": "open" })),
                None,
                &[200, 422],
                "reopening the pull request",
            )
            .await?;
        Ok(status == 200)
    }

    /// Sets the commit status `context` of commit `sha`; `false` when GitHub does not know
    /// the commit (422: the branch is not on GitHub), which waits for nothing.
    pub async fn set_status(
        &self,
        sha: &str,
        state: forge::StatusState,
        context: &str,
        description: &str,
        target_url: &str,
    ) -> Result<bool, PollError> {
        if sha.len() != 40 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(poll_error(400, format!("`{sha}` is not a commit id")));
        }
        let mut req = json!({"state": state.as_str(), "context": context,
                             "description": forge::status_description(description)});
        if target_url.starts_with("https://") || target_url.starts_with("http://") {
            req["target_url"] = json!(target_url);
        }
        let (status, _, _) = self
            .call(
                reqwest::Method::POST,
                &self.repo_api(&format!("/statuses/{sha}"))?,
                Some(&req),
                None,
                &[201, 422],
                "setting a commit status",
            )
            .await?;
        Ok(status == 201)
    }

    /// The reviews of pull request `number`, conditional on `etag` (the first page's).
    pub async fn reviews(&self, number: u64, etag: Option<&str>) -> Result<ReviewsPage, PollError> {
        let mut out = Vec::new();
        let mut first_etag = None;
        for page in 1..=MAX_LIST_PAGES {
            let url =
                self.repo_api(&format!("/pulls/{number}/reviews?per_page=100&page={page}"))?;
            let (status, headers, value) = self
                .call(
                    reqwest::Method::GET,
                    &url,
                    None,
                    if page == 1 { etag } else { None },
                    &[200, 304],
                    "listing the reviews",
                )
                .await?;
            if status == 304 {
                return Ok(ReviewsPage::NotModified);
            }
            if page == 1 {
                first_etag = headers
                    .get("etag")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
            }
            let reviews: Vec<ApiReview> = serde_json::from_value(value)
                .map_err(|_| poll_error(502, "the reviews are not a JSON array".into()))?;
            let n = reviews.len();
            out.extend(reviews.into_iter().map(ApiReview::into_review));
            if n < 100 {
                break;
            }
        }
        Ok(ReviewsPage::Fresh {
            reviews: out,
            etag: first_etag,
        })
    }

    /// Review `id` of pull request `number` as GitHub has it now; `None` when it has it no
    /// longer.
    pub async fn review(&self, number: u64, id: u64) -> Result<Option<forge::Review>, PollError> {
        let url = self.repo_api(&format!("/pulls/{number}/reviews/{id}"))?;
        let review: Option<ApiReview> = self.get(&url, &[200, 404], "reading a review").await?;
        Ok(review.map(ApiReview::into_review))
    }

    /// The permission `login` has on the repository: GitHub's `role_name` (`admin`,
    /// `maintain`, `write`, `triage`, `read`, or a custom role's name), else its `permission`;
    /// `none` for a login GitHub does not know or that cannot be one.
    pub async fn permission(&self, login: &str) -> Result<String, PollError> {
        if !is_login(login) {
            return Ok("none".to_owned());
        }
        let url = self.repo_api(&format!("/collaborators/{login}/permission"))?;
        let p: Option<ApiPermission> = self
            .get(&url, &[200, 404], "reading a reviewer's permission")
            .await?;
        let Some(p) = p else {
            return Ok("none".to_owned());
        };
        Ok(p.role_name
            .or(p.permission)
            .unwrap_or_else(|| "none".to_owned()))
    }

    /// The login the token acts as (`GET /user`).
    pub async fn own_login(&self) -> Result<String, PollError> {
        let url = format!("{}/user", self.cfg.api_url.trim_end_matches('/'));
        let user: Option<ApiUser> = self.get(&url, &[200], "reading the token's user").await?;
        user.and_then(|u| u.login)
            .filter(|l| !l.is_empty())
            .ok_or_else(|| poll_error(502, "the token's user has no login".into()))
    }

    /// The line comments of review `review` of pull request `number` (the first 100).
    pub async fn review_comments(
        &self,
        number: u64,
        review: u64,
    ) -> Result<Vec<forge::LineComment>, PollError> {
        let url = self.repo_api(&format!(
            "/pulls/{number}/reviews/{review}/comments?per_page=100"
        ))?;
        let comments: Option<Vec<ApiReviewComment>> = self
            .get(&url, &[200], "listing a review's comments")
            .await?;
        Ok(comments
            .unwrap_or_default()
            .into_iter()
            .map(|c| forge::LineComment {
                path: c.path,
                line: c.line.or(c.original_line),
                body: c.body,
            })
            .collect())
    }

    /// The id of a comment on issue (or pull request) `number` that `author` (orch's own
    /// login, [`GitHub::own_login`]) wrote and that starts with `marker`. Anyone can comment,
    /// and the marker is predictable: a stranger's comment with it is no comment of orch's.
    pub async fn own_comment(
        &self,
        number: u64,
        marker: &str,
        author: &str,
    ) -> Result<Option<u64>, PollError> {
        for page in 1..=MAX_LIST_PAGES {
            let url = self.repo_api(&format!(
                "/issues/{number}/comments?per_page=100&page={page}"
            ))?;
            let (_, _, value) = self
                .call(
                    reqwest::Method::GET,
                    &url,
                    None,
                    None,
                    &[200],
                    "listing the comments",
                )
                .await?;
            let comments: Vec<ApiComment> = serde_json::from_value(value)
                .map_err(|_| poll_error(502, "the comments are not a JSON array".into()))?;
            if let Some(c) = comments.iter().find(|c| {
                c.body.as_deref().is_some_and(|b| b.starts_with(marker))
                    && c.user
                        .as_ref()
                        .and_then(|u| u.login.as_deref())
                        .is_some_and(|l| l.eq_ignore_ascii_case(author))
            }) {
                return Ok(Some(c.id));
            }
            if comments.len() < 100 {
                break;
            }
        }
        Ok(None)
    }

    /// Comments on issue (or pull request) `number`: the new comment's id.
    pub async fn comment(&self, number: u64, body: &str) -> Result<u64, PollError> {
        let (_, _, value) = self
            .call(
                reqwest::Method::POST,
                &self.repo_api(&format!("/issues/{number}/comments"))?,
                Some(&json!({ "body": body })),
                None,
                &[201],
                "commenting",
            )
            .await?;
        let c: ApiComment = serde_json::from_value(value)
            .map_err(|_| poll_error(502, "the new comment is not one".into()))?;
        Ok(c.id)
    }

    /// Closes issue `number` as completed.
    pub async fn close_issue(&self, number: u64) -> Result<(), PollError> {
        self.call(
            reqwest::Method::PATCH,
            &self.repo_api(&format!("/issues/{number}"))?,
            Some(&json!({"state": "closed", "state_reason": "completed"})),
            None,
            &[200],
            "closing the issue",
        )
        .await?;
        Ok(())
    }
}

/// The item's pull request, once per item: the one whose head is `branch` if there is one
/// (found by its head, so a crash between opening it and recording its number opens no
/// second one), else a new draft. `Ok(None)`: GitHub refuses to open one (the branch is not
/// on GitHub).
pub async fn find_or_open_pull(
    gh: &GitHub,
    title: &str,
    branch: &str,
    base: &str,
    body: &str,
) -> Result<Option<(ApiPull, bool)>, PollError> {
    if let Some(p) = gh.find_pull(branch).await? {
        return Ok(Some((p, false)));
    }
    match gh.open_pull(title, branch, base, body).await? {
        Some(p) => Ok(Some((p, true))),
        // Refused: perhaps another process opened it a moment ago.
        None => Ok(gh.find_pull(branch).await?.map(|p| (p, false))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_are_checked_in_full() {
        let body = br#"{"zen":"x"}"#;
        let good = sign("It's a Secret to Everybody", body);
        assert!(signature_valid("It's a Secret to Everybody", body, &good));
        assert!(!signature_valid("another", body, &good));
        assert!(!signature_valid("It's a Secret to Everybody", b"{}", &good));
        assert!(!signature_valid(
            "It's a Secret to Everybody",
            body,
            "sha256=00"
        ));
        assert!(!signature_valid(
            "It's a Secret to Everybody",
            body,
            &good.replace("sha256=", "sha1=")
        ));
        // GitHub's documented example.
        assert_eq!(
            sign("It's a Secret to Everybody", b"Hello, World!"),
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
        );
    }

    #[test]
    fn links_elsewhere_are_not_followed() {
        assert!(same_origin(
            "https://api.github.com/x?page=2",
            "https://api.github.com"
        ));
        assert!(!same_origin(
            "https://evil.example/x",
            "https://api.github.com"
        ));
        assert!(!same_origin(
            "http://api.github.com/x",
            "https://api.github.com"
        ));
        // The same API, but not this repository's listing.
        let api = "https://api.github.com";
        assert!(listing_page(
            "https://api.github.com/repos/octo/app/issues?labels=orch&page=2",
            api,
            "octo/app"
        ));
        assert!(listing_page(
            "https://api.github.com/repositories/1300192/issues?page=3",
            api,
            "octo/app"
        ));
        assert!(!listing_page(
            "https://api.github.com/repos/other/repo/issues?page=2",
            api,
            "octo/app"
        ));
        assert!(!listing_page(
            "https://api.github.com/user/repos?page=2",
            api,
            "octo/app"
        ));
        assert!(!listing_page(
            "https://api.github.com/repositories/12x/issues",
            api,
            "octo/app"
        ));
        // GitHub Enterprise Server: under the API's base path.
        let ghe = "https://ghe.example.com/api/v3";
        assert!(listing_page(
            "https://ghe.example.com/api/v3/repos/octo/app/issues?page=2",
            ghe,
            "octo/app"
        ));
        assert!(!listing_page(
            "https://ghe.example.com/repos/octo/app/issues?page=2",
            ghe,
            "octo/app"
        ));
    }
}
