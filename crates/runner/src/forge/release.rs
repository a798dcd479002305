//! The forge's side of a release into a protected default branch (issue 31): when the default
//! branch refuses orch's push, the release train ([`crate::release`]) publishes through
//! GitHub's REST API. This module is only the API calls; what is published, the intent written
//! before each call, and the check that the forge's commit has exactly the staged tree are the
//! release train's.
//!
//! - [`Api::update_branch`]: `PATCH /repos/{owner}/{repo}/git/refs/heads/{branch}` with
//!   `force: false` (the `fast-forward` method: the branch moves to exactly the staged commit).
//! - [`Api::find_or_open_release_pull`]: the release branch's pull request, found by
//!   `GET …/pulls?head=<owner>:<branch>&state=all` or opened by `POST …/pulls`. Kept apart
//!   from the pull requests the rest of the forge integration opens, so both can be unified.
//! - [`Api::pull`] and [`Api::merge_pull`]: a pull request's state, and
//!   `PUT …/pulls/{n}/merge` with its head pinned (`sha`) and the configured `merge_method`.
//!
//! Every answer is classified ([`Failure`]): an outage or a rate limit (no answer, a 5xx, a
//! 429, a 403 with `Retry-After` or a used-up quota) is something to wait out; any other
//! refusal is an error. The token is sent only in the `Authorization` header and never put in
//! an error (errors name the operation and the status, and GitHub's `message`, escaped).

use orch_domain::forge::{Answer, ForgeConfig};
use serde_json::{Value, json};

/// Why a call did not succeed.
#[derive(Debug, Clone)]
pub enum Failure {
    /// The forge did not answer, is failing or is rate limiting: wait and try again.
    Outage { answer: Answer, message: String },
    /// The forge refused (a permission, a protection rule, a conflict): trying again as is
    /// will not help.
    Refused { status: u16, message: String },
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Outage { message, .. } | Failure::Refused { message, .. } => {
                f.write_str(message)
            }
        }
    }
}

/// A pull request as far as a release reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pull {
    pub number: u64,
    /// `open` or `closed`.
    pub state: String,
    /// Merged (a closed pull request may be merged or not).
    pub merged: bool,
    /// The commit the merge made on the base branch, once merged (a rebase's last commit:
    /// where GitHub moved the base branch to).
    pub merge_commit_sha: Option<String>,
    pub head_sha: Option<String>,
}

impl Pull {
    fn of(v: &Value) -> Option<Pull> {
        Some(Pull {
            number: v["number"].as_u64()?,
            state: v["state"].as_str()?.to_owned(),
            // `merged` is in the single pull request; a listing's items say `merged_at`.
            merged: v["merged"]
                .as_bool()
                .unwrap_or_else(|| v["merged_at"].is_string()),
            merge_commit_sha: v["merge_commit_sha"].as_str().map(str::to_owned),
            head_sha: v["head"]["sha"].as_str().map(str::to_owned),
        })
    }
}

/// A repository's REST API with its token (read from the configured variable when made).
pub struct Api {
    client: reqwest::Client,
    base: String,
    owner: String,
    repo: String,
    token: String,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api")
            .field("base", &self.base)
            .field("repo", &format_args!("{}/{}", self.owner, self.repo))
            .finish_non_exhaustive()
    }
}

/// The most of GitHub's `message` a failure carries (it goes into events and the log).
const MAX_REFUSAL_CHARS: usize = 500;

impl Api {
    /// The API of `cfg`'s repository. A token variable that is not set is an outage to wait
    /// out (the operator sets it; nothing is lost meanwhile).
    pub fn new(cfg: &ForgeConfig) -> Result<Api, Failure> {
        let Some((owner, repo)) = cfg.owner_and_name() else {
            return Err(Failure::Refused {
                status: 0,
                message: format!("forge repo `{}` is not owner/name", cfg.repo),
            });
        };
        let Some(token) = super::secret_from_env(&cfg.token_env) else {
            return Err(Failure::Outage {
                answer: Answer::default(),
                message: format!("the forge token's variable {} is not set", cfg.token_env),
            });
        };
        let client = super::client().map_err(|e| Failure::Outage {
            answer: Answer::default(),
            message: format!("no HTTP client: {e}"),
        })?;
        Ok(Api {
            client,
            base: cfg.api_url.trim_end_matches('/').to_owned(),
            owner: owner.to_owned(),
            repo: repo.to_owned(),
            token,
        })
    }

    fn url(&self, rest: &str) -> String {
        format!("{}/repos/{}/{}{rest}", self.base, self.owner, self.repo)
    }

    /// Sends one request; the JSON answer of a 2xx, else the failure, classified (GitHub's
    /// `message` in it on one line, at most [`MAX_REFUSAL_CHARS`]: it reaches events).
    async fn send(
        &self,
        what: &str,
        method: reqwest::Method,
        url: &str,
        body: Option<&Value>,
    ) -> Result<Value, Failure> {
        let mut req = self
            .client
            .request(method, url)
            .header("accept", "application/vnd.github+json")
            .header("x-github-api-version", super::API_VERSION)
            .header("user-agent", concat!("orch/", env!("CARGO_PKG_VERSION")))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            req = req.json(body);
        }
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                // reqwest's error names the URL (never the token): said without it anyway.
                let why = if e.is_timeout() {
                    "timed out"
                } else if e.is_connect() {
                    "could not connect"
                } else {
                    "no answer"
                };
                return Err(Failure::Outage {
                    answer: Answer::default(),
                    message: format!("{what}: {why}"),
                });
            }
        };
        let status = resp.status().as_u16();
        let answer = super::answer_of(status, resp.headers());
        let text = resp.text().await.unwrap_or_default();
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if (200..300).contains(&status) {
            return Ok(value);
        }
        let said = value["message"]
            .as_str()
            .map(|m| {
                format!(
                    ": {}",
                    orch_domain::text::escape(&orch_domain::text::one_line_max(
                        m,
                        MAX_REFUSAL_CHARS
                    ))
                )
            })
            .unwrap_or_default();
        let message = format!("{what}: HTTP {status}{said}");
        let limited = (status == 403 || status == 429)
            && (answer.retry_after.is_some() || answer.remaining == Some(0));
        if status >= 500 || status == 429 || limited {
            Err(Failure::Outage { answer, message })
        } else {
            Err(Failure::Refused { status, message })
        }
    }

    /// Moves `branch` to exactly `sha` when that is a fast-forward (`force: false`).
    pub async fn update_branch(&self, branch: &str, sha: &str) -> Result<(), Failure> {
        // `{ref}` is one path parameter (`heads/<branch>`): its slashes are encoded, as
        // GitHub's own clients expand it.
        let url = self.url(&format!("/git/refs/heads%2F{}", branch.replace('/', "%2F")));
        self.send(
            &format!("PATCH git/refs/heads/{branch}"),
            reqwest::Method::PATCH,
            &url,
            Some(&json!({"sha": sha, "force": false})),
        )
        .await
        .map(|_| ())
    }

    /// The open pull request of `head` (a branch of this repository) into `base`, or a new one.
    /// The release's own lookup: the forge integration's pull requests of work items
    /// (`find_or_open_pull`) may later take its place.
    pub async fn find_or_open_release_pull(
        &self,
        head: &str,
        base: &str,
        title: &str,
        body: &str,
    ) -> Result<Pull, Failure> {
        let url = self.url("/pulls");
        let listing = reqwest::Url::parse_with_params(
            &url,
            &[
                ("head", format!("{}:{head}", self.owner)),
                ("state", "all".to_owned()),
                ("per_page", "100".to_owned()),
            ],
        )
        .map_err(|_| Failure::Refused {
            status: 0,
            message: "cannot build the pull request listing's URL".to_owned(),
        })?;
        let found = self
            .send("GET pulls", reqwest::Method::GET, listing.as_str(), None)
            .await?;
        let open = found.as_array().and_then(|pulls| {
            pulls
                .iter()
                .filter_map(Pull::of)
                .find(|p| p.state == "open")
        });
        if let Some(pull) = open {
            return Ok(pull);
        }
        let made = self
            .send(
                "POST pulls",
                reqwest::Method::POST,
                &url,
                Some(&json!({"title": title, "head": head, "base": base, "body": body})),
            )
            .await?;
        Pull::of(&made).ok_or_else(|| Failure::Refused {
            status: 201,
            message: "POST pulls: the answer is not a pull request".to_owned(),
        })
    }

    /// Pull request `number` as it is now.
    pub async fn pull(&self, number: u64) -> Result<Pull, Failure> {
        let url = self.url(&format!("/pulls/{number}"));
        let v = self
            .send(
                &format!("GET pulls/{number}"),
                reqwest::Method::GET,
                &url,
                None,
            )
            .await?;
        Pull::of(&v).ok_or_else(|| Failure::Refused {
            status: 200,
            message: format!("GET pulls/{number}: the answer is not a pull request"),
        })
    }

    /// Merges pull request `number` by `method` only if its head is exactly `sha`; the commit
    /// the merge made (with `rebase`, the last of the commits GitHub made again, where the
    /// base branch now is). `message` is the commit's (for `merge` and `squash`; GitHub ignores
    /// it for `rebase`, whose commits keep their own messages).
    pub async fn merge_pull(
        &self,
        number: u64,
        sha: &str,
        method: &str,
        title: &str,
        message: &str,
    ) -> Result<String, Failure> {
        let url = self.url(&format!("/pulls/{number}/merge"));
        let what = format!("PUT pulls/{number}/merge");
        let v = self
            .send(
                &what,
                reqwest::Method::PUT,
                &url,
                Some(&json!({
                    "sha": sha, "merge_method": method,
                    "commit_title": title, "commit_message": message,
                })),
            )
            .await
            .map_err(|f| match f {
                // A required check that has not reported yet: the merge is waited out (with
                // GitHub's words), not refused.
                Failure::Refused { status, message }
                    if orch_domain::forge::merge_waits_for_checks(status, &message) =>
                {
                    Failure::Outage {
                        answer: Answer {
                            status,
                            checks_pending: true,
                            ..Answer::default()
                        },
                        message,
                    }
                }
                other => other,
            })?;
        match (v["merged"].as_bool(), v["sha"].as_str()) {
            (Some(true), Some(sha)) => Ok(sha.to_owned()),
            _ => Err(Failure::Refused {
                status: 200,
                message: format!("{what}: the answer says nothing was merged"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_item_and_a_pull_request_read_alike() {
        let listed = json!({"number": 3, "state": "closed", "merged_at": "2026-01-01T00:00:00Z",
            "merge_commit_sha": "abc", "head": {"sha": "def"}});
        let p = Pull::of(&listed).unwrap();
        assert!(p.merged);
        assert_eq!(p.merge_commit_sha.as_deref(), Some("abc"));
        let single = json!({"number": 3, "state": "open", "merged": false, "merged_at": null,
            "merge_commit_sha": null, "head": {"sha": "def"}});
        let p = Pull::of(&single).unwrap();
        assert!(!p.merged);
        assert_eq!(p.state, "open");
        assert_eq!(Pull::of(&json!({"state": "open"})), None);
    }
}
