//! Who made an operator call: a process that stole the token calls the API (submit, cancel),
//! an operator uses the CLI (submit, cancel). Each event says how the call came, from
//! which peer address and client or which OS user, in its text (what `orch logs`, `orch
//! status` and the task page show) and under `by` in its data: "cancelled by an operator" no
//! longer hides a stolen-token call.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common;
use crate::hostile::{Backend, Home, TOKEN};

/// One HTTP/1.1 request with the token and `user_agent`; the status, the body and the
/// client's own address (the peer the server sees).
fn call(
    bind: &str,
    method: &str,
    path: &str,
    body: &str,
    user_agent: &str,
) -> (u16, String, SocketAddr) {
    let mut s = TcpStream::connect(bind).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let me = s.local_addr().unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {bind}\r\nAuthorization: Bearer {TOKEN}\r\n\
         User-Agent: {user_agent}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body, me)
}

/// A GET without the token; the body once the server answers 200.
fn get(bind: &str, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(bind).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {bind}\r\nConnection: close\r\n\r\n");
    s.write_all(request.as_bytes()).ok()?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).ok()?;
    answer
        .starts_with("HTTP/1.1 200")
        .then(|| answer.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()))?
}

/// The last event of `kind` of work item `id`: its text and its data.
async fn last(home: &Home, id: &str, kind: &str) -> (String, Value) {
    let store = home.store().await;
    let task = common::task(&store, id).await;
    let event = store
        .task_events(task.id)
        .await
        .unwrap()
        .into_iter()
        .rfind(|e| e.kind == kind)
        .unwrap_or_else(|| panic!("{id} has a {kind} event"));
    store.close().await;
    (event.message, serde_json::from_str(&event.data).unwrap())
}

fn who_am_i() -> (String, u32) {
    let run = |arg: &str| {
        let out = std::process::Command::new("id").arg(arg).output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    (run("-un"), run("-u").parse().unwrap())
}

async fn api_and_cli_calls_name_who_made_them(backend: Backend) {
    if !common::python_available() {
        return common::skip("python3 is missing (the demo's sample service needs it)");
    }
    let home = Home::new(backend).await;
    let serve = home.serve();
    let t0 = Instant::now();
    while get(&home.bind, "/healthz").is_none() {
        assert!(t0.elapsed() < Duration::from_secs(30), "orch serve answers");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A process with the stolen token submits, then cancels.
    let body = json!({"repo": "service", "title": "Submitted with a stolen token", "body": ""});
    let (status, answer, submitter) = call(
        &home.bind,
        "POST",
        "/tasks",
        &body.to_string(),
        "stolen-token-client/1.0",
    );
    assert_eq!(status, 201, "{answer}");
    let id = serde_json::from_str::<Value>(&answer).unwrap()["work_item_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (status, answer, canceller) = call(
        &home.bind,
        "POST",
        &format!("/tasks/{id}/cancel"),
        "",
        "curl/8.5.0",
    );
    assert_eq!(status, 200, "{answer}");

    let (text, data) = last(&home, &id, "task.submitted").await;
    assert_eq!(
        text,
        format!(
            "submitted via the API from {submitter} with the operator token (User-Agent \"stolen-token-client/1.0\"): Submitted with a stolen token"
        )
    );
    assert_eq!(
        data["by"],
        json!({"via": "api", "peer": submitter.to_string(), "user_agent": "stolen-token-client/1.0"})
    );
    let cancelled_api = format!(
        "cancelled via the API from {canceller} with the operator token (User-Agent \"curl/8.5.0\")"
    );
    let (text, data) = last(&home, &id, "task.cancelled").await;
    assert_eq!(text, cancelled_api);
    assert_eq!(data["by"]["peer"], canceller.to_string());
    assert_eq!(data["outcome"], "cancelled");

    // The operator at the CLI.
    let (user, uid) = who_am_i();
    let by_cli = format!("via the CLI by user {user} (uid {uid})");
    let mine = home.submit("Submitted at the CLI");
    home.ok(&["cancel", &mine]);
    let (text, data) = last(&home, &mine, "task.submitted").await;
    assert_eq!(text, format!("submitted {by_cli}: Submitted at the CLI"));
    assert_eq!(data["by"], json!({"via": "cli", "user": user, "uid": uid}));
    let (text, _) = last(&home, &mine, "task.cancelled").await;
    assert_eq!(text, format!("cancelled {by_cli}"));

    // Shown where operators look: `orch logs`, `orch status`, the task page.
    let logs = home.ok(&["logs", &id]);
    assert!(logs.contains(&cancelled_api), "{logs}");
    let status = home.ok(&["status", &id]);
    assert!(
        status.contains(&format!("outcome cancelled: {cancelled_api}")),
        "{status}"
    );
    let json = home.ok(&["--json", "logs", &mine]);
    let v: Value = serde_json::from_str(&json).unwrap();
    let events = v["events"].as_array().unwrap();
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "task.cancelled" && e["data"]["by"]["via"] == "cli"),
        "{json}"
    );
    let page = get(&home.bind, &format!("/ui/tasks/{id}")).unwrap();
    assert!(
        page.contains(&format!(
            "cancelled via the API from {canceller} with the operator token"
        )),
        "the task page shows it"
    );
    serve.terminate().await;
}

mod api_and_cli_calls_name_who_made_them {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite() {
        super::api_and_cli_calls_name_who_made_them(crate::hostile::Backend::Sqlite).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        super::api_and_cli_calls_name_who_made_them(crate::hostile::Backend::Postgres).await;
    }
}
