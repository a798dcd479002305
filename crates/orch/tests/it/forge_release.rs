//! Releasing into a protected default branch through GitHub's API (issue 31), end to end: the
//! real `orch serve`, on SQLite and on PostgreSQL, a repository whose bare remote refuses every
//! direct push to `main` with a pre-receive hook (as branch protection does), and the GitHub
//! stand-in of `forge.rs`, whose pull request and ref endpoints act on that same bare
//! repository with real git (a real merge, squash, rebase or ref move). Every exchange is held
//! to GitHub's OpenAPI description afterwards.
//!
//! The story, per backend (squash):
//! 1. orch is killed -9 (a failpoint) right after GitHub merged the item's pull request and
//!    before orch recorded it; the restarted orch finds the pull request merged, checks the
//!    tree, and deploys — one merge in all; `main` gained exactly one commit (the squash),
//!    whose tree is exactly the staged tree, and the deploy record names it and the staged
//!    commit.
//! 2. The stand-in's next merge puts an extra file in the tree: orch sees a tree that is not
//!    the staged tree, deploys nothing of it, and sends the item back to the merge gate; the
//!    item is then staged again and released.
//!    That item breaks production after its deploy (the demo's greeting change): rolled back,
//!    its revert reaches the protected `main` through the API as well.
//!    Each item's audit trail (its last documents, its lessons) reaches `main` the same way.
//! 3. `orch doctor` says releases go through the API (squash).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use orch_store::{ConnectOptions, Store};
use serde_json::{Value, json};

use crate::common::{self, ORCH, demo_setup, skip};
use crate::forge::{
    OWNER_REPO, TOKEN, TOKEN_VAR, check_exchanges, free_port, openapi_path, specs_available,
    start_hub, wait_until,
};

/// The stand-in's release side: pull requests and the default branch of a real bare repo.
#[derive(Default)]
pub(crate) struct Releases {
    pub bare: Option<PathBuf>,
    pub pulls: Vec<PullState>,
    /// Each merge the stand-in made: (pull request, method, commit).
    pub merges: Vec<(u64, String, String)>,
    /// Each `PATCH …/git/refs/…` that moved the branch.
    pub ref_updates: u64,
    /// Each `POST …/pulls`' head, also the refused ones.
    pub posts: Vec<String>,
    /// Each `PATCH …/pulls/{n}`: (pull request, request body).
    pub patches: Vec<(u64, Value)>,
    /// Pull requests are numbered from this + 1 (past the issues' numbers, which share the
    /// number space on GitHub).
    pub number_base: u64,
    /// The next merge adds a file the pull request does not have.
    pub tamper_next: bool,
    /// Before the next rebase someone else puts a commit on `main` that changes no file: the
    /// rebase lands on it, its last tree still the staged one.
    pub move_main_next: bool,
    /// Refuse this many merges with 405: a required status check has not reported yet.
    pub checks_pending: u32,
    /// Answer 503 to a `PATCH …/git/refs` that would put an audit commit (`Stage: audit`) on
    /// `main`: GitHub down just when an item's trail is published.
    pub down_for_audit: bool,
    /// The description's examples the answers are made from.
    pub pull_example: Value,
    pub pull_simple_example: Value,
    pub git_ref_example: Value,
}

pub(crate) struct PullState {
    pub number: u64,
    title: String,
    pub body: String,
    pub head: String,
    base: String,
    pub state: String,
    pub draft: bool,
    pub merge_commit_sha: Option<String>,
}

pub(crate) fn git(dir: &Path, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_AUTHOR_NAME", "GitHub")
        .env("GIT_AUTHOR_EMAIL", "noreply@github.com")
        .env("GIT_COMMITTER_NAME", "GitHub")
        .env("GIT_COMMITTER_EMAIL", "noreply@github.com")
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn error(message: &str) -> Value {
    json!({"message": message, "documentation_url": "https://docs.github.com/rest/pulls/pulls"})
}

/// Whether `path` is one of the release endpoints.
pub(crate) fn is_release_path(path: &str) -> bool {
    path.strip_prefix(&format!("/repos/{OWNER_REPO}"))
        .is_some_and(|rest| rest.starts_with("/pulls") || rest.starts_with("/git/refs/"))
}

impl Releases {
    fn pull_json(&self, p: &PullState, bare: &Path, simple: bool) -> Value {
        let mut v = if simple {
            self.pull_simple_example.clone()
        } else {
            self.pull_example.clone()
        };
        let api = format!(
            "https://api.github.com/repos/{OWNER_REPO}/pulls/{}",
            p.number
        );
        let head_sha = git(bare, &["rev-parse", &format!("refs/heads/{}", p.head)])
            .unwrap_or_else(|_| "0".repeat(40));
        let base_sha =
            git(bare, &["rev-parse", &format!("refs/heads/{}", p.base)]).unwrap_or_default();
        let merged = p.merge_commit_sha.is_some();
        v["number"] = json!(p.number);
        v["id"] = json!(5000 + p.number);
        v["url"] = json!(api);
        v["html_url"] = json!(format!("https://github.com/{OWNER_REPO}/pull/{}", p.number));
        v["title"] = json!(p.title);
        v["body"] = json!(p.body);
        v["state"] = json!(p.state);
        v["draft"] = json!(p.draft);
        v["merge_commit_sha"] = json!(p.merge_commit_sha);
        let at = if merged {
            json!("2026-12-07T03:00:00Z")
        } else {
            Value::Null
        };
        v["merged_at"] = at.clone();
        v["closed_at"] = at;
        v["head"]["ref"] = json!(p.head);
        v["head"]["sha"] = json!(head_sha);
        v["head"]["label"] = json!(format!("Codertocat:{}", p.head));
        // The description's own example lists a requested team without the `type` its schema
        // requires (the check found it); a pull request orch opens requests no team.
        v["requested_teams"] = json!([]);
        v["base"]["ref"] = json!(p.base);
        v["base"]["sha"] = json!(base_sha);
        if !simple {
            v["merged"] = json!(merged);
            if !merged {
                v["merged_by"] = Value::Null;
            }
        }
        v
    }

    /// A merge, squash or rebase of `head` onto `main`, made with git in the bare repository.
    fn merge(&mut self, bare: &Path, n: u64, req: &Value) -> (u16, Value) {
        let Some(i) = self.pulls.iter().position(|p| p.number == n) else {
            return (404, error("Not Found"));
        };
        if self.pulls[i].state != "open" {
            return (405, error("Pull Request is not mergeable"));
        }
        let head = match git(
            bare,
            &["rev-parse", &format!("refs/heads/{}", self.pulls[i].head)],
        ) {
            Ok(h) => h,
            Err(_) => return (422, error("Head branch does not exist")),
        };
        if req["sha"].as_str() != Some(head.as_str()) {
            return (
                409,
                error("Head branch was modified. Review and try the merge again."),
            );
        }
        if self.checks_pending > 0 {
            self.checks_pending -= 1;
            return (405, error("Required status check \"ci\" is expected."));
        }
        let mut main = git(bare, &["rev-parse", "refs/heads/main"]).unwrap();
        if req["merge_method"] == "rebase" && std::mem::take(&mut self.move_main_next) {
            let moved = git(
                bare,
                &[
                    "commit-tree",
                    &format!("{main}^{{tree}}"),
                    "-p",
                    &main,
                    "-m",
                    "someone else's commit, straight onto main",
                ],
            )
            .unwrap();
            git(bare, &["update-ref", "refs/heads/main", &moved, &main]).unwrap();
            main = moved;
        }
        let Ok(tree) = git(bare, &["merge-tree", "--write-tree", &main, &head]) else {
            return (405, error("Pull Request is not mergeable"));
        };
        let merged_tree = tree.lines().next().unwrap_or_default().to_owned();
        let tamper = std::mem::take(&mut self.tamper_next);
        let tree = if tamper {
            with_extra_file(bare, &merged_tree)
        } else {
            merged_tree.clone()
        };
        let message = format!(
            "{}\n\n{}",
            req["commit_title"].as_str().unwrap_or("Merge"),
            req["commit_message"].as_str().unwrap_or("")
        );
        let method = req["merge_method"].as_str().unwrap_or("merge").to_owned();
        let commit = match method.as_str() {
            "merge" => git(
                bare,
                &[
                    "commit-tree",
                    &tree,
                    "-p",
                    &main,
                    "-p",
                    &head,
                    "-m",
                    &message,
                ],
            ),
            "squash" => git(bare, &["commit-tree", &tree, "-p", &main, "-m", &message]),
            "rebase" => match rebase(bare, &main, &head, &merged_tree, tamper) {
                Ok(last) => Ok(last),
                Err(refused) => return refused,
            },
            _ => return (422, error("Validation Failed")),
        }
        .unwrap();
        git(bare, &["update-ref", "refs/heads/main", &commit, &main]).unwrap();
        self.pulls[i].state = "closed".into();
        self.pulls[i].merge_commit_sha = Some(commit.clone());
        self.merges.push((n, method, commit.clone()));
        (
            200,
            json!({"sha": commit, "merged": true, "message": "Pull Request successfully merged"}),
        )
    }
}

/// GitHub's rebase merge of `head` onto `main`, with git in the bare repository: the pull
/// request's commits (reachable from `head` and not from `main`), oldest first, each replayed
/// onto the last as a new commit: its author, author date and message kept, the committer
/// GitHub, so every one gets a new id even where `main` could have been fast-forwarded
/// (GitHub's documented difference from `git rebase`). As on GitHub, merge commits are left out
/// (`git rebase` linearizes) and so are commits that were empty to begin with; a commit that
/// becomes empty on the new base is dropped too, as `git rebase` drops it. A replay that
/// conflicts, a result that is not the tree a merge would make (`merged_tree`: GitHub calls
/// such a rebase unsafe) or nothing left to replay is GitHub's 405. The last new commit, which
/// the caller moves `main` to; `tamper` gives it an extra file (after the checks, as a forge
/// that misbehaves would).
fn rebase(
    bare: &Path,
    main: &str,
    head: &str,
    merged_tree: &str,
    tamper: bool,
) -> Result<String, (u16, Value)> {
    let cannot = || (405, error("This branch can't be rebased"));
    let tree_of = |rev: &str| git(bare, &["rev-parse", &format!("{rev}^{{tree}}")]).unwrap();
    let commits = git(
        bare,
        &[
            "rev-list",
            "--reverse",
            "--topo-order",
            "--no-merges",
            &format!("{main}..{head}"),
        ],
    )
    .unwrap();
    let mut tip = main.to_owned();
    let mut last_original = None;
    for c in commits.lines() {
        let Ok(parent) = git(bare, &["rev-parse", &format!("{c}^")]) else {
            return Err(cannot());
        };
        if tree_of(c) == tree_of(&parent) {
            continue;
        }
        let Ok(out) = git(
            bare,
            &[
                "merge-tree",
                "--write-tree",
                &format!("--merge-base={parent}"),
                &tip,
                c,
            ],
        ) else {
            return Err(cannot());
        };
        let tree = out.lines().next().unwrap_or_default().to_owned();
        if tree == tree_of(&tip) {
            continue;
        }
        tip = recommit(bare, c, &tree, &tip);
        last_original = Some(c.to_owned());
    }
    let Some(last_original) = last_original else {
        return Err(cannot());
    };
    if tree_of(&tip) != merged_tree {
        return Err(cannot());
    }
    if tamper {
        let parent = git(bare, &["rev-parse", &format!("{tip}^")]).unwrap();
        tip = recommit(
            bare,
            &last_original,
            &with_extra_file(bare, &tree_of(&tip)),
            &parent,
        );
    }
    Ok(tip)
}

/// A new commit of `tree` on `parent` made from `original`: its author, author date and
/// message (byte for byte), GitHub's committer and the current time.
fn recommit(bare: &Path, original: &str, tree: &str, parent: &str) -> String {
    let who = git(
        bare,
        &[
            "log",
            "-1",
            "--date=raw",
            "--format=%an%n%ae%n%ad",
            original,
        ],
    )
    .unwrap();
    let mut who = who.lines();
    let (name, email, date) = (
        who.next().unwrap_or_default(),
        who.next().unwrap_or_default(),
        who.next().unwrap_or_default(),
    );
    let raw = std::process::Command::new("git")
        .arg("-C")
        .arg(bare)
        .args(["cat-file", "commit", original])
        .output()
        .unwrap();
    assert!(raw.status.success());
    let raw = String::from_utf8_lossy(&raw.stdout).into_owned();
    let message = raw.split_once("\n\n").map(|(_, m)| m).unwrap_or_default();
    let mut child = std::process::Command::new("git")
        .arg("-C")
        .arg(bare)
        .args(["commit-tree", tree, "-p", parent, "-F", "-"])
        .env("GIT_AUTHOR_NAME", name)
        .env("GIT_AUTHOR_EMAIL", email)
        .env("GIT_AUTHOR_DATE", date)
        .env("GIT_COMMITTER_NAME", "GitHub")
        .env("GIT_COMMITTER_EMAIL", "noreply@github.com")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(message.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The stand-in's rebase refuses what GitHub refuses: a pull request whose replay conflicts
/// although a merge would not (its first commit conflicts with `main`, its second takes the
/// change back), and one whose merge commit holds a change of its own (left out by the replay,
/// so the result is not the merge's tree: "unsafe"); a pull request that replays cleanly gets
/// a new commit for each of its commits, on `main`, by their authors.
#[test]
fn the_stand_ins_rebase_refuses_a_conflict_and_an_unsafe_rebase() {
    let tmp = tempfile::tempdir().unwrap();
    let bare = tmp.path();
    git(bare, &["init", "-q", "--bare"]).unwrap();
    // The tree `base` (none: empty) with `name` holding `text`.
    let file = |base: Option<&str>, name: &str, text: &str| -> String {
        let index = bare.join("test.index");
        let run = |args: &[&str]| {
            let out = std::process::Command::new("git")
                .arg("-C")
                .arg(bare)
                .args(args)
                .env("GIT_INDEX_FILE", &index)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        };
        match base {
            Some(b) => run(&["read-tree", b]),
            None => run(&["read-tree", "--empty"]),
        };
        std::fs::write(bare.join("blob"), text).unwrap();
        let blob = run(&["hash-object", "-w", "blob"]);
        run(&[
            "update-index",
            "--add",
            "--cacheinfo",
            &format!("100644,{blob},{name}"),
        ]);
        run(&["write-tree"])
    };
    let commit = |tree: &str, parents: &[&str], message: &str| -> String {
        let mut args = vec!["commit-tree", tree];
        for p in parents {
            args.extend(["-p", p]);
        }
        args.extend(["-m", message]);
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(bare)
            .args(&args)
            .env("GIT_AUTHOR_NAME", "dev")
            .env("GIT_AUTHOR_EMAIL", "dev@example.com")
            .env("GIT_COMMITTER_NAME", "dev")
            .env("GIT_COMMITTER_EMAIL", "dev@example.com")
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let merged = |main: &str, head: &str| -> String {
        let out = git(bare, &["merge-tree", "--write-tree", main, head]).unwrap();
        out.lines().next().unwrap().to_owned()
    };
    let base = commit(&file(None, "f", "a\n"), &[], "base");
    let main = commit(&file(None, "f", "c\n"), &[&base], "main's change");

    // b, then a again: a merge changes nothing of `main`, a replay conflicts at the first.
    let there = commit(&file(None, "f", "b\n"), &[&base], "there");
    let back = commit(&file(None, "f", "a\n"), &[&there], "and back");
    let (status, body) = rebase(bare, &main, &back, &merged(&main, &back), false).unwrap_err();
    assert_eq!(
        (status, body["message"].as_str()),
        (405, Some("This branch can't be rebased"))
    );

    // `main` merged into the pull request by a merge commit that adds a file of its own: the
    // replay leaves the merge commit out, so its result is not the merge's tree.
    let own = file(Some(&format!("{main}^{{tree}}")), "g", "1\n");
    let own = file(Some(&own), "h", "only in the merge commit\n");
    let adds = commit(
        &file(Some(&format!("{base}^{{tree}}")), "g", "1\n"),
        &[&base],
        "adds g",
    );
    let evil = commit(&own, &[&adds, &main], "merge main, and more");
    let (status, _) = rebase(bare, &main, &evil, &merged(&main, &evil), false).unwrap_err();
    assert_eq!(status, 405);
    // Without the file of its own the same pull request rebases.
    let clean = commit(
        &file(Some(&format!("{main}^{{tree}}")), "g", "1\n"),
        &[&adds, &main],
        "merge main",
    );
    assert!(rebase(bare, &main, &clean, &merged(&main, &clean), false).is_ok());

    // A clean one on `main` itself (a fast-forward was possible): new commits all the same.
    let one = commit(&file(None, "f", "e\n"), &[&main], "one");
    let two = commit(&file(None, "f", "f\n"), &[&one], "two");
    let last = rebase(bare, &main, &two, &merged(&main, &two), false).unwrap();
    let made = git(bare, &["rev-list", "--reverse", &format!("{main}..{last}")]).unwrap();
    let made: Vec<&str> = made.lines().collect();
    assert_eq!(made.len(), 2);
    assert!(made.iter().all(|c| *c != one && *c != two));
    assert_eq!(
        git(bare, &["rev-parse", &format!("{}^", made[0])]).unwrap(),
        main
    );
    assert_eq!(
        git(bare, &["log", "-1", "--format=%an %cn %s", made[1]]).unwrap(),
        "dev GitHub two"
    );
    assert_eq!(
        git(bare, &["rev-parse", &format!("{last}^{{tree}}")]).unwrap(),
        git(bare, &["rev-parse", &format!("{two}^{{tree}}")]).unwrap()
    );
}

/// `tree` with a file `EXTRA.txt` added: a merge that is not what was staged.
fn with_extra_file(bare: &Path, tree: &str) -> String {
    let index = bare.join("tamper.index");
    let blob = {
        let mut child = std::process::Command::new("git")
            .arg("-C")
            .arg(bare)
            .args(["hash-object", "-w", "--stdin"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write as _;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b"not what staging verified\n")
            .unwrap();
        let out = child.wait_with_output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let run = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(bare)
            .args(args)
            .env("GIT_INDEX_FILE", &index)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    run(&["read-tree", tree]);
    run(&[
        "update-index",
        "--add",
        "--cacheinfo",
        &format!("100644,{blob},EXTRA.txt"),
    ]);
    let out = run(&["write-tree"]);
    let _ = std::fs::remove_file(&index);
    out
}

/// The stand-in's release endpoints: `None` when `path` is not one of them.
pub(crate) fn route(
    r: &mut Releases,
    method: &str,
    path: &str,
    query: &[(String, String)],
    body: &[u8],
) -> Option<(u16, Value)> {
    if !is_release_path(path) {
        return None;
    }
    let rest = path.strip_prefix(&format!("/repos/{OWNER_REPO}"))?;
    let bare = r.bare.clone()?;
    let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let q = |k: &str| query.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    Some(match (method, rest) {
        ("GET", "/pulls") => {
            let head = q("head").unwrap_or_default();
            let state = q("state").unwrap_or_else(|| "open".into());
            let list: Vec<Value> = r
                .pulls
                .iter()
                .filter(|p| head.is_empty() || head == format!("Codertocat:{}", p.head))
                .filter(|p| state == "all" || p.state == state)
                .map(|p| r.pull_json(p, &bare, true))
                .collect();
            (200, Value::Array(list))
        }
        ("POST", "/pulls") => {
            let head = req["head"].as_str().unwrap_or_default().to_owned();
            r.posts.push(head.clone());
            if git(&bare, &["rev-parse", &format!("refs/heads/{head}")]).is_err() {
                return Some((422, error("Validation Failed")));
            }
            if r.pulls.iter().any(|p| p.head == head && p.state == "open") {
                return Some((
                    422,
                    json!({"message": "Validation Failed", "documentation_url": "https://docs.github.com/rest",
                           "errors": [{"resource": "PullRequest", "code": "custom",
                                       "message": format!("A pull request already exists for Codertocat:{head}.")}]}),
                ));
            }
            let number = r.number_base + r.pulls.len() as u64 + 1;
            r.pulls.push(PullState {
                number,
                title: req["title"].as_str().unwrap_or_default().to_owned(),
                body: req["body"].as_str().unwrap_or_default().to_owned(),
                head,
                base: req["base"].as_str().unwrap_or("main").to_owned(),
                state: "open".into(),
                draft: req["draft"].as_bool().unwrap_or(false),
                merge_commit_sha: None,
            });
            let p = r.pulls.last().unwrap();
            (201, r.pull_json(p, &bare, false))
        }
        ("PATCH", "/git/refs/heads%2Fmain") => {
            let sha = req["sha"].as_str().unwrap_or_default();
            if r.down_for_audit
                && git(&bare, &["log", "-1", "--format=%B", sha])
                    .is_ok_and(|m| m.contains("Stage: audit"))
            {
                return Some((503, json!({"message": "Service Unavailable"})));
            }
            let main = git(&bare, &["rev-parse", "refs/heads/main"]).unwrap();
            let ff = git(&bare, &["merge-base", "--is-ancestor", &main, sha]).is_ok();
            if !ff || req["force"] != json!(false) {
                return Some((422, error("Update is not a fast forward")));
            }
            git(&bare, &["update-ref", "refs/heads/main", sha, &main]).unwrap();
            r.ref_updates += 1;
            let mut v = r.git_ref_example.clone();
            v["ref"] = json!("refs/heads/main");
            v["object"]["sha"] = json!(sha);
            (200, v)
        }
        _ => {
            let n = rest.strip_prefix("/pulls/")?;
            if let Some(n) = n.strip_suffix("/merge") {
                let n: u64 = n.parse().ok()?;
                if method != "PUT" {
                    return None;
                }
                r.merge(&bare, n, &req)
            } else {
                let n: u64 = n.parse().ok()?;
                if method == "PATCH"
                    && let Some(i) = r.pulls.iter().position(|p| p.number == n)
                {
                    r.patches.push((n, req.clone()));
                    let p = &mut r.pulls[i];
                    if let Some(b) = req["body"].as_str() {
                        p.body = b.to_owned();
                    }
                    if let Some(t) = req["title"].as_str() {
                        p.title = t.to_owned();
                    }
                    // A merged pull request stays closed, as on GitHub.
                    if req["state"] == "closed" {
                        p.state = "closed".into();
                    } else if req["state"] == "open" && p.merge_commit_sha.is_none() {
                        p.state = "open".into();
                    }
                    return Some((200, r.pull_json(&r.pulls[i], &bare, false)));
                }
                match r.pulls.iter().find(|p| p.number == n) {
                    Some(p) if method == "GET" => (200, r.pull_json(p, &bare, false)),
                    _ => (404, error("Not Found")),
                }
            }
        }
    })
}

/// The demo's repository behind a bare remote that refuses direct pushes to `main` (a
/// pre-receive hook, as branch protection; each refusal is appended to `refused.log` in the
/// bare repository), which `orch.toml` then names as the repo's path.
pub(crate) fn protect_remote(dir: &Path) -> PathBuf {
    let bare = dir.join("service.git");
    let out = std::process::Command::new("git")
        .args(["clone", "--quiet", "--bare"])
        .arg(dir.join("service"))
        .arg(&bare)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let hook = bare.join("hooks/pre-receive");
    std::fs::write(
        &hook,
        "#!/bin/sh\nwhile read old new ref; do\n  if [ \"$ref\" = refs/heads/main ]; then\n    echo \"$old $new\" >> refused.log\n    echo \"remote: error: GH006: Protected branch update failed for refs/heads/main.\" >&2\n    exit 1\n  fi\ndone\nexit 0\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.join("orch.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("path = \"service\"\n"), "{text}");
    let text = text.replace("path = \"service\"\n", "path = \"service.git\"\n");
    std::fs::write(&path, text).unwrap();
    bare
}

/// The direct pushes to `main` the hook of [`protect_remote`] refused so far.
pub(crate) fn refused_pushes(bare: &Path) -> usize {
    std::fs::read_to_string(bare.join("refused.log"))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

/// The stand-in's release side acting on `bare`, its answers made from the description's
/// examples.
pub(crate) fn serve_releases(hub: &crate::forge::Shared, bare: &Path) {
    let spec: Value =
        serde_json::from_str(&std::fs::read_to_string(openapi_path()).unwrap()).unwrap();
    let ex = &spec["components"]["examples"];
    let mut h = hub.lock().unwrap();
    h.release.bare = Some(bare.to_owned());
    h.release.pull_example = ex["pull-request"]["value"].clone();
    h.release.pull_simple_example = ex["pull-request-simple-items"]["value"][0].clone();
    h.release.git_ref_example = ex["git-ref"]["value"].clone();
    assert!(h.release.pull_example.is_object() && h.release.git_ref_example.is_object());
}

/// [`protect_remote`] and the forge section (no polling).
fn protect(dir: &Path, api: &str, method: &str) -> PathBuf {
    let bare = protect_remote(dir);
    let path = dir.join("orch.toml");
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push_str(&format!(
        "\n[repos.service.forge]\nkind = \"github\"\nrepo = \"{OWNER_REPO}\"\napi_url = \"{api}\"\n\
         token_env = \"{TOKEN_VAR}\"\nlabel = \"orch\"\npoll_interval_s = 0\nmax_backoff_s = 2\n\
         merge_method = \"{method}\"\n"
    ));
    std::fs::write(&path, text).unwrap();
    bare
}

/// `orch serve` of the demo in `dir` with the forge's token, fast demo agents, short leases
/// and the failpoints `failpoints` (empty: none), logging to `<dir>/serve.log` (appended).
fn serve(dir: &Path, url: Option<&str>, failpoints: &str) -> common::Serve {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("serve.log"))
        .unwrap();
    let mut cmd = common::Serve::command(dir, &format!("127.0.0.1:{}", free_port()));
    if let Some(url) = url {
        cmd.args(["--database-url", url]);
    }
    cmd.env("ORCH_LOG", "info")
        .env(TOKEN_VAR, TOKEN)
        .stderr(Stdio::from(log));
    if !failpoints.is_empty() {
        cmd.env("ORCH_FAILPOINTS", failpoints);
    }
    common::Serve::spawn(cmd)
}

fn submit(dir: &Path, url: Option<&str>, title: &str) {
    let mut cmd = std::process::Command::new(ORCH);
    cmd.arg("--config").arg(dir.join("orch.toml"));
    if let Some(url) = url {
        cmd.args(["--database-url", url]);
    }
    let out = cmd
        .args([
            "submit", "--repo", "service", "--title", title, "--body", title,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn events_of(store: &Store, id: &str) -> Vec<orch_store::Event> {
    let t = common::task(store, id).await;
    store.task_events(t.id).await.unwrap()
}

fn data(e: &orch_store::Event) -> Value {
    serde_json::from_str(&e.data).unwrap_or(Value::Null)
}

async fn wait_ended(dir: &Path, store: &Store, id: &str) -> orch_store::Task {
    let s = store.clone();
    let id2 = id.to_owned();
    wait_until(
        dir,
        Duration::from_secs(300),
        &format!("{id} ended"),
        || {
            let s = s.clone();
            let id = id2.clone();
            async move {
                s.get_task_by_work_item(&id)
                    .await
                    .unwrap()
                    .is_some_and(|t| t.is_terminal())
            }
        },
    )
    .await;
    common::task(store, id).await
}

async fn story(backend: &str) {
    if !specs_available() {
        return;
    }
    if !common::python_available() {
        return skip(
            "python3 is not installed: the demo's service and the description check need it",
        );
    }
    common::become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    let (hub, api) = start_hub().await;
    let bare = protect(&dir, &api, "squash");
    serve_releases(&hub, &bare);
    // The hook refuses a direct push, as GitHub refuses one to a protected branch.
    let probe = git(
        &bare,
        &[
            "commit-tree",
            "main^{tree}",
            "-p",
            "main",
            "-m",
            "a direct push",
        ],
    )
    .unwrap();
    let refused = git(
        &bare,
        &["push", "--quiet", ".", &format!("{probe}:refs/heads/main")],
    );
    assert!(
        refused.as_ref().is_err_and(|e| e.contains("GH006")),
        "the hook let a push to main in: {refused:?}"
    );
    let url = match backend {
        "postgres" => {
            let url = orch_store::testing::fresh_pg_schema().await;
            common::orch_db(&dir, &url, &["migrate"]);
            Some(url)
        }
        _ => None,
    };
    let store = match &url {
        Some(u) => Store::connect(u, ConnectOptions::default()).await.unwrap(),
        None => common::open(&dir).await,
    };
    let main_before = git(&bare, &["rev-parse", "main"]).unwrap();

    // 1. Killed -9 between GitHub's merge and orch's record of it.
    let first = serve(&dir, url.as_deref(), "release.after_forge_merge");
    submit(&dir, url.as_deref(), "Add a /version endpoint");
    let status = first.wait_exit(Duration::from_secs(300)).await;
    assert!(
        status.is_some(),
        "orch did not stop at the failpoint; log:\n{}",
        std::fs::read_to_string(dir.join("serve.log")).unwrap_or_default()
    );
    {
        let h = hub.lock().unwrap();
        assert_eq!(h.release.merges.len(), 1, "one merge before the kill");
        assert_eq!(h.release.merges[0].1, "squash");
    }
    let before = events_of(&store, "APP-1").await;
    assert!(before.iter().any(|e| e.kind == "release.forge_merging"));
    assert!(!before.iter().any(|e| e.kind == "release.promoted"));
    assert!(!before.iter().any(|e| e.kind == "deploy.started"));

    let second = serve(&dir, url.as_deref(), "");
    let t1 = wait_ended(&dir, &store, "APP-1").await;
    assert_eq!(t1.stage, "done", "APP-1");
    // The release's pull request merged once across the kill; then the audit trail's (the
    // item's last documents), through the API as well.
    let squash = {
        let h = hub.lock().unwrap();
        let merges = &h.release.merges;
        assert_eq!(merges.len(), 2, "{merges:?}");
        assert_eq!(
            merges[1].0, 2,
            "the release's pull request merged once: {merges:?}"
        );
        assert!(
            git(&bare, &["log", "-1", "--format=%B", &merges[1].2])
                .unwrap()
                .contains("Stage: audit")
        );
        assert_eq!(git(&bare, &["rev-parse", "main"]).unwrap(), merges[1].2);
        merges[0].2.clone()
    };
    let evs = events_of(&store, "APP-1").await;
    let staged = evs
        .iter()
        .rev()
        .find(|e| e.kind == "release.staged")
        .map(|e| data(e)["revision"].as_str().unwrap().to_owned())
        .unwrap();
    // `main` gained exactly one commit, the squash, with exactly the staged tree.
    let added = git(&bare, &["rev-list", &format!("{main_before}..{squash}")]).unwrap();
    assert_eq!(added.lines().collect::<Vec<_>>(), [squash.as_str()]);
    assert!(
        git(&bare, &["merge-base", "--is-ancestor", &squash, "main"]).is_ok(),
        "the squash is on main"
    );
    assert_eq!(
        git(&bare, &["rev-parse", &format!("{squash}^{{tree}}")]).unwrap(),
        git(&bare, &["rev-parse", &format!("{staged}^{{tree}}")]).unwrap()
    );
    let promoted = evs.iter().find(|e| e.kind == "release.promoted").unwrap();
    assert_eq!(data(promoted)["new"], json!(squash));
    assert_eq!(data(promoted)["staged"], json!(staged));
    let deployed = evs.iter().find(|e| e.kind == "release.deployed").unwrap();
    assert_eq!(data(deployed)["revision"], json!(squash), "{deployed:?}");
    assert_eq!(data(deployed)["staged"], json!(staged), "{deployed:?}");
    assert!(deployed.message.contains(&staged), "{}", deployed.message);

    // 2. GitHub's merge is not the staged tree: nothing of it is deployed, back to the merge gate.
    hub.lock().unwrap().release.tamper_next = true;
    submit(&dir, url.as_deref(), "Make the greeting configurable");
    let t2 = wait_ended(&dir, &store, "APP-2").await;
    second.terminate().await;
    let evs = events_of(&store, "APP-2").await;
    let mismatch = evs
        .iter()
        .find(|e| e.kind == "release.forge_mismatch")
        .unwrap_or_else(|| panic!("no release.forge_mismatch: {evs:#?}"));
    let tampered = data(mismatch)["merged"].as_str().unwrap().to_owned();
    let all_deploys: Vec<String> = [events_of(&store, "APP-1").await, evs.clone()]
        .concat()
        .iter()
        .filter(|e| matches!(e.kind.as_str(), "deploy.started" | "release.deployed"))
        .filter_map(|e| data(e)["revision"].as_str().map(str::to_owned))
        .collect();
    assert!(!all_deploys.is_empty());
    assert!(
        !all_deploys.contains(&tampered),
        "the tampered merge was deployed: {all_deploys:?}"
    );
    let at = evs
        .iter()
        .position(|e| e.kind == "release.forge_mismatch")
        .unwrap();
    assert!(
        evs[at..].iter().any(|e| e.kind == "release.staged"),
        "the item was not staged again after the mismatch"
    );
    assert_eq!(t2.stage, "done", "APP-2 after the mismatch");
    // The demo's greeting change breaks production after its deploy: rolled back, and its
    // revert reaches the protected `main` through the API too. APP-2's merges: the tampered
    // one, the release, the revert, the audit trail.
    let merges = hub.lock().unwrap().release.merges.clone();
    assert_eq!(merges.len(), 6, "{merges:?}");
    assert_eq!(merges[2].2, tampered);
    let deployed = evs
        .iter()
        .rev()
        .find(|e| e.kind == "release.deployed")
        .unwrap();
    assert_eq!(data(deployed)["revision"], json!(merges[3].2));
    let reverted = evs
        .iter()
        .find(|e| e.kind == "release.reverted")
        .unwrap_or_else(|| panic!("no release.reverted: {evs:#?}"));
    assert_eq!(data(reverted)["revert_commit"], json!(merges[4].2));
    assert!(
        git(&bare, &["log", "-1", "--format=%B", &merges[4].2])
            .unwrap()
            .contains("Orch-Revert: APP-2")
    );
    assert!(
        git(
            &bare,
            &["merge-base", "--is-ancestor", &merges[4].2, "main"]
        )
        .is_ok()
    );

    // 3. `orch doctor` says how releases reach the protected branch.
    let mut doctor = std::process::Command::new(ORCH);
    doctor.arg("--config").arg(dir.join("orch.toml"));
    if let Some(url) = &url {
        doctor.args(["--database-url", url]);
    }
    let out = doctor.arg("doctor").env(TOKEN_VAR, TOKEN).output().unwrap();
    let report =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        report.contains("branch main is protected: releases go through the API (squash)"),
        "{report}"
    );
    assert!(!report.contains(TOKEN));

    let log = std::fs::read_to_string(dir.join("serve.log")).unwrap();
    assert!(!log.contains(TOKEN), "the token is in the log");
    for e in [events_of(&store, "APP-1").await, evs].concat() {
        assert!(
            !e.message.contains(TOKEN) && !e.data.contains(TOKEN),
            "{e:?}"
        );
    }
    let exchanges = hub.lock().unwrap().exchanges.clone();
    assert!(exchanges.iter().any(|e| e["method"] == "PUT"));
    let (ok, text) = check_exchanges(&dir, "exchanges.jsonl", &exchanges);
    eprintln!("{backend}: {text}");
    assert!(
        ok,
        "the release's exchanges break GitHub's description:\n{text}"
    );
    assert_eq!(hub.lock().unwrap().unauthenticated, 0);
    common::stop_service(&dir);
    common::reap_orphans();
    store.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protected_main_is_released_through_the_api_on_sqlite() {
    story("sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protected_main_is_released_through_the_api_on_postgres() {
    story("postgres").await;
}

/// `merge_method = "fast-forward"`, with GitHub down when the release reaches it: the release
/// waits visibly (`forge.waiting` on the item, retrying with backoff), fails nothing, and once
/// GitHub answers `main` is moved (`PATCH …/git/refs`, no force) to exactly the staged commit,
/// which is what is deployed.
async fn fast_forward_through_an_outage(backend: &str) {
    if !specs_available() {
        return;
    }
    if !common::python_available() {
        return skip(
            "python3 is not installed: the demo's service and the description check need it",
        );
    }
    common::become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    let (hub, api) = start_hub().await;
    let bare = protect(&dir, &api, "fast-forward");
    // One deploy job waits at most a second: the outage outlasts many jobs, each stepping
    // aside for the next, as a long outage outlasts a job's timeout.
    let config = dir.join("orch.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.contains("merge_method = \"fast-forward\"\n"), "{text}");
    std::fs::write(
        &config,
        text.replace(
            "merge_method = \"fast-forward\"\n",
            "merge_method = \"fast-forward\"\nwait_step_s = 1\n",
        ),
    )
    .unwrap();
    serve_releases(&hub, &bare);
    hub.lock().unwrap().down_for_release = true;
    let url = match backend {
        "postgres" => {
            let url = orch_store::testing::fresh_pg_schema().await;
            common::orch_db(&dir, &url, &["migrate"]);
            Some(url)
        }
        _ => None,
    };
    let store = match &url {
        Some(u) => Store::connect(u, ConnectOptions::default()).await.unwrap(),
        None => common::open(&dir).await,
    };
    let serve = serve(&dir, url.as_deref(), "");
    submit(&dir, url.as_deref(), "Add a /version endpoint");
    let s = store.clone();
    wait_until(
        &dir,
        Duration::from_secs(300),
        "the release waiting for GitHub",
        || {
            let s = s.clone();
            async move {
                match s.get_task_by_work_item("APP-1").await.unwrap() {
                    Some(t) => s
                        .task_events(t.id)
                        .await
                        .unwrap()
                        .iter()
                        .any(|e| e.kind == "forge.waiting"),
                    None => false,
                }
            }
        },
    )
    .await;
    // Down a while longer: retried with backoff, nothing fails, nothing is deployed.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let t = common::task(&store, "APP-1").await;
    assert_eq!(t.stage, "deploy");
    let evs = events_of(&store, "APP-1").await;
    assert!(!evs.iter().any(|e| e.kind == "deploy.started"));
    assert_eq!(
        evs.iter().filter(|e| e.kind == "forge.waiting").count(),
        1,
        "one forge.waiting per waiting, not per try: {evs:#?}"
    );
    let tries = hub
        .lock()
        .unwrap()
        .exchanges
        .iter()
        .filter(|e| e["method"] == "PATCH")
        .count();
    assert!(tries >= 2, "{tries} tries in 5 s of outage");
    // The deploy stepped aside and came back as new jobs (its attempts untouched), the wait
    // said once.
    let asides = evs
        .iter()
        .filter(|e| e.kind == "stage.requeued" && e.data.contains("[orch:forge-wait seq="))
        .count();
    assert!(
        asides >= 2,
        "{asides} steps aside in 5 s of outage: {evs:#?}"
    );
    // GitHub comes back for the release, but is down again just when the item's trail (the
    // audit commit) goes onto `main`: the lessons stage steps aside too, and never fails.
    hub.lock().unwrap().release.down_for_audit = true;
    hub.lock().unwrap().down_for_release = false;
    let s = store.clone();
    wait_until(
        &dir,
        Duration::from_secs(300),
        "APP-1's audit commit stepping aside twice",
        || {
            let s = s.clone();
            async move {
                let t = s.get_task_by_work_item("APP-1").await.unwrap().unwrap();
                s.task_events(t.id)
                    .await
                    .unwrap()
                    .iter()
                    .filter(|e| {
                        e.kind == "stage.requeued"
                            && e.stage.as_deref() == Some("lessons")
                            && e.data.contains("[orch:forge-wait seq=")
                    })
                    .count()
                    >= 2
            }
        },
    )
    .await;
    assert_eq!(common::task(&store, "APP-1").await.stage, "lessons");
    hub.lock().unwrap().release.down_for_audit = false;

    let t = wait_ended(&dir, &store, "APP-1").await;
    assert_eq!(t.stage, "done");

    // A second item breaks production: the watch rolls it back, and GitHub goes down right
    // after its release, so its revert meets the outage. The watch's ending steps aside (as
    // new ending jobs, the wait said once), never holds the repo for it, and reverts when
    // GitHub answers.
    submit(&dir, url.as_deref(), "Make the greeting configurable");
    let s = store.clone();
    wait_until(&dir, Duration::from_secs(300), "APP-2 deployed", || {
        let s = s.clone();
        async move {
            match s.get_task_by_work_item("APP-2").await.unwrap() {
                Some(t) => s
                    .task_events(t.id)
                    .await
                    .unwrap()
                    .iter()
                    .any(|e| e.kind == "release.deployed"),
                None => false,
            }
        }
    })
    .await;
    hub.lock().unwrap().down_for_release = true;
    let s = store.clone();
    wait_until(
        &dir,
        Duration::from_secs(300),
        "APP-2's revert stepping aside twice",
        || {
            let s = s.clone();
            async move {
                // An ending job comes back with its completion (a routine follow-up, no
                // `stage.requeued`): counted in the queue. The first is the tick's hand-over.
                let t = s.get_task_by_work_item("APP-2").await.unwrap().unwrap();
                s.task_jobs(t.id)
                    .await
                    .unwrap()
                    .iter()
                    .filter(|j| j.task_content.contains("[orch:monitor-end seq="))
                    .count()
                    >= 3
            }
        },
    )
    .await;
    let evs2 = events_of(&store, "APP-2").await;
    assert!(
        evs2.iter().any(|e| e.kind == "release.rolled_back"),
        "rolled back before the revert waits: {evs2:#?}"
    );
    assert!(!evs2.iter().any(|e| e.kind == "release.reverted"));
    assert!(
        !evs2.iter().any(|e| e.kind == "release.held"),
        "an outage held the repo: {evs2:#?}"
    );
    assert_eq!(common::task(&store, "APP-2").await.stage, "observe");
    hub.lock().unwrap().down_for_release = false;
    let t2 = wait_ended(&dir, &store, "APP-2").await;
    serve.terminate().await;
    assert_eq!(t2.stage, "done", "APP-2 rolled back and reverted");
    let evs2 = events_of(&store, "APP-2").await;
    let reverted = evs2
        .iter()
        .find(|e| e.kind == "release.reverted")
        .unwrap_or_else(|| panic!("no release.reverted: {evs2:#?}"));
    let revert_commit = data(reverted)["revert_commit"].as_str().unwrap().to_owned();
    assert!(
        git(&bare, &["log", "-1", "--format=%B", &revert_commit])
            .unwrap()
            .contains("Orch-Revert: APP-2")
    );
    assert!(
        git(
            &bare,
            &["merge-base", "--is-ancestor", &revert_commit, "main"]
        )
        .is_ok()
    );
    assert_eq!(
        evs2.iter().filter(|e| e.kind == "forge.waiting").count(),
        1,
        "one forge.waiting for the revert's whole wait: {evs2:#?}"
    );
    assert_eq!(
        evs2.iter().filter(|e| e.kind == "forge.resumed").count(),
        1,
        "{evs2:#?}"
    );
    assert!(!evs2.iter().any(|e| e.kind == "release.held"));
    // However often the watch's ending and the lessons stage came back, each lesson is on
    // `main` once, and APP-1's record counts the lessons its audit commit put there.
    let lessons = git(&bare, &["show", "main:LESSONS.md"]).unwrap();
    let ids: Vec<&str> = lessons
        .lines()
        .filter_map(|l| l.split("orch-lesson:").nth(1))
        .filter_map(|rest| rest.split("-->").next())
        .map(str::trim)
        .collect();
    let unique: std::collections::HashSet<&&str> = ids.iter().collect();
    assert_eq!(unique.len(), ids.len(), "{lessons}");
    assert!(
        !ids.iter().any(|id| id.ends_with("#2")),
        "a lesson read twice from a come-back: {lessons}"
    );
    assert!(ids.iter().any(|id| id.starts_with("APP-2/")), "{lessons}");
    let app1 = ids.iter().filter(|id| id.starts_with("APP-1/")).count();
    let recorded = events_of(&store, "APP-1")
        .await
        .into_iter()
        .find(|e| e.kind == "lessons.recorded")
        .unwrap();
    assert!(app1 > 0, "{lessons}");
    assert_eq!(data(&recorded)["appended"], json!(app1), "{recorded:?}");

    let evs = events_of(&store, "APP-1").await;
    // Two waits, the release's and the audit's, each said once and ended once.
    let in_stage = |kind: &str, stage: &str| -> Vec<&orch_store::Event> {
        evs.iter()
            .filter(|e| e.kind == kind && e.stage.as_deref() == Some(stage))
            .collect()
    };
    let resumed = in_stage("forge.resumed", "deploy");
    assert_eq!(resumed.len(), 1, "{resumed:#?}");
    // The wait is counted from its start, across the jobs that stepped aside.
    assert!(
        data(resumed[0])["waited_s"].as_i64().unwrap() >= 5,
        "{resumed:#?}"
    );
    assert_eq!(
        in_stage("forge.waiting", "deploy").len(),
        1,
        "one forge.waiting for the whole wait"
    );
    assert_eq!(in_stage("forge.waiting", "lessons").len(), 1, "{evs:#?}");
    assert_eq!(in_stage("forge.resumed", "lessons").len(), 1, "{evs:#?}");
    assert_eq!(evs.iter().filter(|e| e.kind == "forge.waiting").count(), 2);
    let staged = evs
        .iter()
        .rev()
        .find(|e| e.kind == "release.staged")
        .map(|e| data(e)["revision"].as_str().unwrap().to_owned())
        .unwrap();
    // Ref moves: APP-1's release (to exactly the staged commit) with its audit trail on it,
    // then APP-2's release, its revert and its audit trail.
    assert_eq!(hub.lock().unwrap().release.ref_updates, 5);
    assert!(hub.lock().unwrap().release.merges.is_empty());
    assert!(git(&bare, &["merge-base", "--is-ancestor", &staged, "main"]).is_ok());
    let audits = git(&bare, &["log", "--format=%B", "main"])
        .unwrap()
        .matches("Stage: audit")
        .count();
    assert_eq!(audits, 2, "each item's trail on main");
    let deployed = evs.iter().find(|e| e.kind == "release.deployed").unwrap();
    assert_eq!(data(deployed)["revision"], json!(staged));
    let exchanges = hub.lock().unwrap().exchanges.clone();
    let (ok, text) = check_exchanges(&dir, "exchanges.jsonl", &exchanges);
    eprintln!("{backend}: {text}");
    assert!(ok, "{text}");
    common::stop_service(&dir);
    common::reap_orphans();
    store.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_forward_waits_out_an_outage_on_sqlite() {
    fast_forward_through_an_outage("sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_forward_waits_out_an_outage_on_postgres() {
    fast_forward_through_an_outage("postgres").await;
}

/// `merge_method = "merge"`: GitHub's merge commit sits on the `main` the release was built on
/// with the staged commit as its second parent; it has the staged tree and is what ships.
async fn merge_commit(backend: &str) {
    if !specs_available() {
        return;
    }
    if !common::python_available() {
        return skip(
            "python3 is not installed: the demo's service and the description check need it",
        );
    }
    common::become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    let (hub, api) = start_hub().await;
    let bare = protect(&dir, &api, "merge");
    serve_releases(&hub, &bare);
    // The first two merges are refused: the branch's required check has not reported yet.
    hub.lock().unwrap().release.checks_pending = 2;
    let url = match backend {
        "postgres" => {
            let url = orch_store::testing::fresh_pg_schema().await;
            common::orch_db(&dir, &url, &["migrate"]);
            Some(url)
        }
        _ => None,
    };
    let store = match &url {
        Some(u) => Store::connect(u, ConnectOptions::default()).await.unwrap(),
        None => common::open(&dir).await,
    };
    let main_before = git(&bare, &["rev-parse", "main"]).unwrap();
    let serve = serve(&dir, url.as_deref(), "");
    submit(&dir, url.as_deref(), "Add a /version endpoint");
    let t = wait_ended(&dir, &store, "APP-1").await;
    serve.terminate().await;
    assert_eq!(t.stage, "done");
    let evs = events_of(&store, "APP-1").await;
    let staged = evs
        .iter()
        .rev()
        .find(|e| e.kind == "release.staged")
        .map(|e| data(e)["revision"].as_str().unwrap().to_owned())
        .unwrap();
    // The merge waited for the check, visibly, with GitHub's words, and went on.
    let waiting = evs
        .iter()
        .position(|e| e.kind == "forge.waiting")
        .unwrap_or_else(|| panic!("no forge.waiting: {evs:#?}"));
    assert!(
        evs[waiting]
            .message
            .contains("Required status check \"ci\" is expected"),
        "{}",
        evs[waiting].message
    );
    assert!(evs[waiting..].iter().any(|e| e.kind == "forge.resumed"));
    assert_eq!(hub.lock().unwrap().release.checks_pending, 0);
    let merges = hub.lock().unwrap().release.merges.clone();
    assert!(merges.iter().all(|m| m.1 == "merge"), "{merges:?}");
    let merged = &merges[0].2;
    let parents = git(&bare, &["rev-list", "--parents", "-n", "1", merged]).unwrap();
    assert_eq!(
        parents.split(' ').skip(1).collect::<Vec<_>>(),
        [main_before.as_str(), staged.as_str()]
    );
    assert_eq!(
        git(&bare, &["rev-parse", &format!("{merged}^{{tree}}")]).unwrap(),
        git(&bare, &["rev-parse", &format!("{staged}^{{tree}}")]).unwrap()
    );
    let deployed = evs.iter().find(|e| e.kind == "release.deployed").unwrap();
    assert_eq!(data(deployed)["revision"], json!(merged));
    assert_eq!(data(deployed)["staged"], json!(staged));
    // The item's change is listed as shipped (its trailers come with the merged history).
    assert!(
        data(deployed)["items"]
            .as_array()
            .is_some_and(|a| a.iter().any(|i| i["work_item"] == "APP-1")),
        "{deployed:?}"
    );
    let exchanges = hub.lock().unwrap().exchanges.clone();
    let (ok, text) = check_exchanges(&dir, "exchanges.jsonl", &exchanges);
    eprintln!("{backend}: {text}");
    assert!(ok, "{text}");
    common::stop_service(&dir);
    common::reap_orphans();
    store.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merge_commit_ships_the_staged_tree_on_sqlite() {
    merge_commit("sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merge_commit_ships_the_staged_tree_on_postgres() {
    merge_commit("postgres").await;
}

/// `merge_method = "rebase"`: the hook refuses orch's push, and GitHub replays the release pull
/// request's commits onto `main` one by one as new commits (new ids and committer; author,
/// date, message and change kept); the last has exactly the staged tree, and it alone is
/// deployed. Then a rebase whose last commit carries a file staging never saw, and one onto a
/// `main` that someone else moved (the last tree still the staged one): nothing of either is
/// deployed, each item goes back to the merge gate, is staged again and released.
async fn rebase_merge(backend: &str) {
    if !specs_available() {
        return;
    }
    if !common::python_available() {
        return skip(
            "python3 is not installed: the demo's service and the description check need it",
        );
    }
    common::become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    let (hub, api) = start_hub().await;
    let bare = protect(&dir, &api, "rebase");
    serve_releases(&hub, &bare);
    let url = match backend {
        "postgres" => {
            let url = orch_store::testing::fresh_pg_schema().await;
            common::orch_db(&dir, &url, &["migrate"]);
            Some(url)
        }
        _ => None,
    };
    let store = match &url {
        Some(u) => Store::connect(u, ConnectOptions::default()).await.unwrap(),
        None => common::open(&dir).await,
    };
    let main_before = git(&bare, &["rev-parse", "main"]).unwrap();
    let serve = serve(&dir, url.as_deref(), "");
    submit(&dir, url.as_deref(), "Add a /version endpoint");
    let t = wait_ended(&dir, &store, "APP-1").await;
    assert_eq!(t.stage, "done");
    let evs = events_of(&store, "APP-1").await;
    let staged = evs
        .iter()
        .rev()
        .find(|e| e.kind == "release.staged")
        .map(|e| data(e)["revision"].as_str().unwrap().to_owned())
        .unwrap();
    // The hook refused orch's direct push of exactly the staged commit first.
    let refused = std::fs::read_to_string(bare.join("refused.log")).unwrap_or_default();
    assert_eq!(
        refused.lines().next(),
        Some(format!("{main_before} {staged}").as_str()),
        "{refused}"
    );
    let merges = hub.lock().unwrap().release.merges.clone();
    assert!(merges.iter().all(|m| m.1 == "rebase"), "{merges:?}");
    let last = merges[0].2.clone();
    // `main`'s new commits: one per commit of the pull request that is not a merge and was not
    // empty, oldest first, each made again (a new id, GitHub the committer; author, date and
    // message kept), in a line on the `main` the release was built on.
    let list = |range: String, extra: &[&str]| -> Vec<String> {
        let mut args = vec!["rev-list", "--reverse", "--topo-order"];
        args.extend(extra);
        args.push(&range);
        git(&bare, &args)
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect()
    };
    let tree = |rev: &str| git(&bare, &["rev-parse", &format!("{rev}^{{tree}}")]).unwrap();
    let pulled = list(format!("{main_before}..{staged}"), &[]);
    let replayed: Vec<String> = list(format!("{main_before}..{staged}"), &["--no-merges"])
        .into_iter()
        .filter(|c| tree(c) != tree(&format!("{c}^")))
        .collect();
    let rewritten = list(format!("{main_before}..{last}"), &[]);
    assert!(
        replayed.len() >= 2,
        "too few commits to show a rebase: {replayed:?}"
    );
    assert_eq!(
        rewritten.len(),
        replayed.len(),
        "{rewritten:?} of {replayed:?}"
    );
    assert!(
        rewritten.iter().all(|c| !pulled.contains(c)),
        "a commit of the pull request reached main as it was: {rewritten:?} {pulled:?}"
    );
    assert!(list(format!("{main_before}..{last}"), &["--merges"]).is_empty());
    assert_eq!(
        git(&bare, &["rev-parse", &format!("{}^", rewritten[0])]).unwrap(),
        main_before
    );
    let kept = |c: &str| {
        git(
            &bare,
            &["log", "-1", "--date=raw", "--format=%an <%ae> %ad%n%B", c],
        )
        .unwrap()
    };
    for (new, original) in rewritten.iter().zip(&replayed) {
        assert_eq!(kept(new), kept(original));
        assert_eq!(
            git(&bare, &["log", "-1", "--format=%cn <%ce>", new]).unwrap(),
            "GitHub <noreply@github.com>"
        );
    }
    assert_eq!(tree(&last), tree(&staged));
    eprintln!(
        "{backend}: the pull request had {} commits, {} replayed; main gained {} new ones",
        pulled.len(),
        replayed.len(),
        rewritten.len()
    );
    // Only the last commit was deployed, and its record names it and the staged commit.
    let deploys: Vec<String> = evs
        .iter()
        .filter(|e| matches!(e.kind.as_str(), "deploy.started" | "release.deployed"))
        .filter_map(|e| data(e)["revision"].as_str().map(str::to_owned))
        .collect();
    assert!(
        !deploys.is_empty() && deploys.iter().all(|r| *r == last),
        "{deploys:?} {last}"
    );
    let promoted = evs.iter().find(|e| e.kind == "release.promoted").unwrap();
    assert_eq!(data(promoted)["new"], json!(last));
    assert_eq!(data(promoted)["staged"], json!(staged));
    let deployed = evs.iter().find(|e| e.kind == "release.deployed").unwrap();
    assert_eq!(data(deployed)["revision"], json!(last));
    assert_eq!(data(deployed)["staged"], json!(staged));
    assert!(
        data(deployed)["items"]
            .as_array()
            .is_some_and(|a| a.iter().any(|i| i["work_item"] == "APP-1")),
        "{deployed:?}"
    );
    // The audit trail came after, rebased as well.
    assert!(merges.len() >= 2, "{merges:?}");
    assert_eq!(
        git(&bare, &["rev-parse", "main"]).unwrap(),
        merges.last().unwrap().2
    );

    // A rebase whose last commit is not the staged tree: never deployed.
    hub.lock().unwrap().release.tamper_next = true;
    let before = merges.len();
    submit(&dir, url.as_deref(), "Write a note");
    let t2 = wait_ended(&dir, &store, "APP-2").await;
    let evs = events_of(&store, "APP-2").await;
    let mismatch = evs
        .iter()
        .find(|e| e.kind == "release.forge_mismatch")
        .unwrap_or_else(|| panic!("no release.forge_mismatch: {evs:#?}"));
    let tampered = data(mismatch)["merged"].as_str().unwrap().to_owned();
    assert_eq!(hub.lock().unwrap().release.merges[before].2, tampered);
    assert_eq!(data(mismatch)["method"], json!("rebase"));
    let deploys: Vec<String> = evs
        .iter()
        .filter(|e| matches!(e.kind.as_str(), "deploy.started" | "release.deployed"))
        .filter_map(|e| data(e)["revision"].as_str().map(str::to_owned))
        .collect();
    assert!(
        !deploys.contains(&tampered),
        "the tampered rebase was deployed: {deploys:?}"
    );
    let at = evs
        .iter()
        .position(|e| e.kind == "release.forge_mismatch")
        .unwrap();
    assert!(
        evs[at..].iter().any(|e| e.kind == "release.staged"),
        "the item was not staged again after the mismatch"
    );
    assert_eq!(t2.stage, "done", "APP-2 after the mismatch: {evs:#?}");

    // `main` moved before the rebase (a commit that changes no file): the last commit has the
    // staged tree, but something staging never saw sits under it. Never deployed either.
    hub.lock().unwrap().release.move_main_next = true;
    let before = hub.lock().unwrap().release.merges.len();
    submit(&dir, url.as_deref(), "Write another note");
    let t3 = wait_ended(&dir, &store, "APP-3").await;
    serve.terminate().await;
    let evs3 = events_of(&store, "APP-3").await;
    let mismatch = evs3
        .iter()
        .find(|e| e.kind == "release.forge_mismatch")
        .unwrap_or_else(|| panic!("no release.forge_mismatch: {evs3:#?}"));
    let landed = data(mismatch)["merged"].as_str().unwrap().to_owned();
    assert_eq!(hub.lock().unwrap().release.merges[before].2, landed);
    assert_eq!(data(mismatch)["staged_tree"], data(mismatch)["merged_tree"]);
    assert!(
        mismatch.message.contains("moved before the rebase"),
        "{}",
        mismatch.message
    );
    let deploys: Vec<String> = evs3
        .iter()
        .filter(|e| matches!(e.kind.as_str(), "deploy.started" | "release.deployed"))
        .filter_map(|e| data(e)["revision"].as_str().map(str::to_owned))
        .collect();
    assert!(!deploys.contains(&landed), "{deploys:?}");
    assert_eq!(t3.stage, "done", "APP-3 after the mismatch: {evs3:#?}");
    let exchanges = hub.lock().unwrap().exchanges.clone();
    let (ok, text) = check_exchanges(&dir, "exchanges.jsonl", &exchanges);
    eprintln!("{backend}: {text}");
    assert!(ok, "{text}");
    common::stop_service(&dir);
    common::reap_orphans();
    store.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebase_ships_the_staged_tree_on_sqlite() {
    rebase_merge("sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebase_ships_the_staged_tree_on_postgres() {
    rebase_merge("postgres").await;
}

/// A required check that never reports: the merge waits at most `check_wait_s` from GitHub's
/// first such answer, then the release attempt stops waiting (`forge.check_wait_over`) and
/// fails like a refusal, nothing merged, instead of waiting forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_required_check_that_never_reports_is_waited_for_at_most_check_wait_s() {
    if !specs_available() {
        return;
    }
    if !common::python_available() {
        return skip(
            "python3 is not installed: the demo's service and the description check need it",
        );
    }
    common::become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    let (hub, api) = start_hub().await;
    let bare = protect(&dir, &api, "merge");
    // The forge section is the file's last: the bound goes into it.
    let path = dir.join("orch.toml");
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push_str("check_wait_s = 1\n");
    std::fs::write(&path, text).unwrap();
    serve_releases(&hub, &bare);
    hub.lock().unwrap().release.checks_pending = u32::MAX;
    let store = common::open(&dir).await;
    let serve = serve(&dir, None, "");
    submit(&dir, None, "Add a /version endpoint");
    let s = store.clone();
    wait_until(
        &dir,
        Duration::from_secs(300),
        "APP-1's release stops waiting for its checks",
        || {
            let s = s.clone();
            async move {
                events_of(&s, "APP-1")
                    .await
                    .iter()
                    .any(|e| e.kind == "forge.check_wait_over")
            }
        },
    )
    .await;
    serve.terminate().await;
    let evs = events_of(&store, "APP-1").await;
    let over = evs
        .iter()
        .find(|e| e.kind == "forge.check_wait_over")
        .unwrap();
    assert_eq!(data(over)["check_wait_s"], json!(1), "{over:?}");
    assert!(
        over.message
            .contains("Required status check \"ci\" is expected"),
        "{}",
        over.message
    );
    assert!(
        evs.iter().any(|e| e.kind == "forge.waiting"),
        "it waited first: {evs:#?}"
    );
    assert!(hub.lock().unwrap().release.merges.is_empty());
    assert!(!evs.iter().any(|e| e.kind == "release.promoted"));
    common::stop_service(&dir);
    common::reap_orphans();
    store.close().await;
}
