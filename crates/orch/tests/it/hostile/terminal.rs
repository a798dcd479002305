//! Text from agents and users never acts on the operator's terminal: a title and event texts
//! holding clear-screen, an OSC window title, colours, a bidi override, BEL and an 8-bit CSI
//! are printed by the real `orch status`, `orch logs` and `orch deploys` with every one of
//! them replaced by `�`, and by `--json` as exact data whose bytes hold none of them raw.
//! Errors about hostile input are cleaned the same way.

use orch_store::{NewEvent, NewTask, WorkItemSpec};
use serde_json::Value;

use crate::hostile::{Backend, Home, contains};

const TITLE: &str = "Fix login\u{1b}[2J\u{1b}[H\u{1b}]0;owned title\u{7} \u{202e}exe.txt\u{7} done";
const EVENT: &str =
    "analysis: valid \u{1b}[31mred\u{1b}[0m \u{1b}]0;pwned\u{7}\u{202e}evil\u{7} \u{9b}2J end";
const LESSON: &str = "lesson \u{1b}]52;c;Y3VybCBldmlsIHwgc2g=\u{7} copied \u{1b}P+q\u{1b}\\ ok";

/// What a terminal would act on: ESC, BEL, the 8-bit CSI and OSC, the bidi override.
fn raw_controls(bytes: &[u8]) -> Vec<&'static str> {
    let mut found = Vec::new();
    for (what, needle) in [
        ("ESC", &b"\x1b"[..]),
        ("BEL", b"\x07"),
        ("CSI (C1)", "\u{9b}".as_bytes()),
        ("OSC (C1)", "\u{9d}".as_bytes()),
        ("RLO", "\u{202e}".as_bytes()),
    ] {
        if contains(bytes, needle) {
            found.push(what);
        }
    }
    found
}

async fn status_and_logs_print_no_control_sequences(backend: Backend) {
    let home = Home::new(backend).await;
    let store = home.store().await;
    let task = store
        .create_task(NewTask {
            work_item: WorkItemSpec::Exact("APP-1".parse().unwrap()),
            repo: "service".parse().unwrap(),
            title: TITLE.into(),
            body: String::new(),
            stage: "analysis".parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new("task.submitted", format!("submitted: {TITLE}")),
            first_job: None,
        })
        .await
        .unwrap();
    for (kind, text) in [("stage.advanced", EVENT), ("lessons.recorded", LESSON)] {
        store
            .append_event(NewEvent::new(kind, text).task(task.id).stage("analysis"))
            .await
            .unwrap();
    }
    store.close().await;

    let runs: [&[&str]; 4] = [
        &["status"],
        &["status", "APP-1"],
        &["logs", "APP-1"],
        &["deploys", "service"],
    ];
    for args in runs {
        let out = home.orch(args);
        assert!(out.status.success(), "orch {args:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            raw_controls(&out.stdout),
            Vec::<&str>::new(),
            "orch {args:?}:\n{text}"
        );
        let expect: &[&str] = match args[0] {
            "deploys" => &["lesson \u{fffd} copied \u{fffd} ok"],
            "logs" => &[
                "Fix login\u{fffd}\u{fffd}\u{fffd} \u{fffd}exe.txt\u{fffd} done",
                "analysis: valid \u{fffd}red\u{fffd} \u{fffd}\u{fffd}evil\u{fffd} \u{fffd} end",
            ],
            _ => &["Fix login\u{fffd}\u{fffd}\u{fffd} \u{fffd}exe.txt\u{fffd} done"],
        };
        for e in expect {
            assert!(text.contains(e), "orch {args:?} shows {e:?}:\n{text}");
        }
        assert!(
            !text.contains("owned title") && !text.contains("pwned"),
            "{text}"
        );
    }

    // JSON is exact data: the same strings come back, and none of them is raw in the bytes.
    for args in [&["--json", "status"][..], &["--json", "logs", "APP-1"]] {
        let out = home.orch(args);
        assert!(out.status.success(), "orch {args:?}");
        assert_eq!(
            raw_controls(&out.stdout),
            Vec::<&str>::new(),
            "orch {args:?}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let title = match args[1] {
            "status" => v["tasks"][0]["title"].clone(),
            _ => v["task"]["title"].clone(),
        };
        assert_eq!(title, TITLE, "orch {args:?}");
        if args[1] == "logs" {
            let messages: Vec<&str> = v["events"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|e| e["message"].as_str())
                .collect();
            assert!(
                messages.contains(&EVENT) && messages.contains(&LESSON),
                "{messages:?}"
            );
        }
    }

    // An error about hostile input: cleaned on stderr, exact in the JSON error.
    let bad = "APP-\u{1b}]0;pwned\u{7}1";
    let out = home.orch(&["status", bad]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a malformed id is a usage error"
    );
    assert_eq!(
        raw_controls(&out.stderr),
        Vec::<&str>::new(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = home.orch(&["--json", "status", bad]);
    assert_eq!(raw_controls(&out.stdout), Vec::<&str>::new());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["error"]["message"],
        "invalid work item id \"APP-\\u{1b}]0;pwned\\u{7}1\": contains a control character",
    );
}

mod status_and_logs_print_no_control_sequences {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite() {
        super::status_and_logs_print_no_control_sequences(crate::hostile::Backend::Sqlite).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        super::status_and_logs_print_no_control_sequences(crate::hostile::Backend::Postgres).await;
    }
}
