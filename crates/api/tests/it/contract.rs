//! Every answer the HTTP tests get is held to `docs/openapi.yaml`: the path and method are
//! documented, the status is one of the operation's responses, the content type one of that
//! response's, and a JSON body validates against its schema. The validator knows the subset of
//! OpenAPI 3.0 schemas the document uses (`type`, `nullable`, `enum`, `properties`,
//! `required`, `additionalProperties`, `items`, `allOf`, `$ref`, `minLength`, `maxLength`,
//! and the annotations); a keyword it does not know is an error, so a document that outgrows it
//! fails the tests instead of passing unchecked.

use std::sync::OnceLock;

use serde_json::Value;

const DOC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.yaml");

/// Words a schema may carry that say nothing about what is valid.
const ANNOTATIONS: &[&str] = &["description", "example", "default", "title", "format"];

/// The document, parsed once per test process.
pub fn document() -> &'static Value {
    static DOCUMENT: OnceLock<Value> = OnceLock::new();
    DOCUMENT.get_or_init(|| {
        let text = std::fs::read_to_string(DOC).unwrap_or_else(|e| panic!("read {DOC}: {e}"));
        serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("parse {DOC}: {e}"))
    })
}

/// Panics unless the answer (`uri` may carry a query; `headers` the answer's) keeps to
/// docs/openapi.yaml: the one call every API test makes on what it got back.
pub fn assert_answer(
    method: &str,
    uri: &str,
    status: u16,
    headers: &axum::http::HeaderMap,
    body: &str,
) {
    let path = uri.split('?').next().unwrap_or(uri);
    let content_type = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if let Err(e) = check(document(), method, path, status, content_type, body) {
        panic!("the answer breaks docs/openapi.yaml: {e}\n{body}");
    }
}

/// Checks one answer of the API against `doc`. `path` is the request's path (no query);
/// `content_type` the answer's header (parameters allowed). Paths the document does not
/// describe (the dashboard's pages, the router's fallback) are not the API's: `Ok`.
pub fn check(
    doc: &Value,
    method: &str,
    path: &str,
    status: u16,
    content_type: &str,
    body: &str,
) -> Result<(), String> {
    let what = format!("{method} {path} → {status}");
    let Some((template, item)) = path_item(doc, path) else {
        return Ok(());
    };
    let method = method.to_ascii_lowercase();
    let Some(op) = item.get(&method) else {
        // The router answers undocumented methods of a documented path by itself.
        return match (method.as_str(), status) {
            ("head" | "options", _) | (_, 405) => Ok(()),
            _ => Err(format!("{what}: {method} is not documented for {template}")),
        };
    };
    let responses = &op["responses"];
    let response = responses
        .get(status.to_string())
        .or_else(|| responses.get("default"))
        .ok_or_else(|| format!("{what}: status {status} is not documented for {template}"))?;
    let response = resolve(doc, response)?;
    let media = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let Some(content) = response.get("content") else {
        return if body.is_empty() {
            Ok(())
        } else {
            Err(format!("{what}: a body where the document has none"))
        };
    };
    let Some(entry) = content.get(&media) else {
        return Err(format!(
            "{what}: content type {media:?} is not documented (documented: {})",
            content
                .as_object()
                .map(|m| m.keys().cloned().collect::<Vec<_>>().join(", "))
                .unwrap_or_default()
        ));
    };
    if media != "application/json" {
        return Ok(());
    }
    let value: Value =
        serde_json::from_str(body).map_err(|e| format!("{what}: body is not JSON ({e})"))?;
    let mut errors = Vec::new();
    validate(doc, &entry["schema"], &value, "$", &mut errors);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(format!("{what} ({template}):\n  {}", errors.join("\n  ")))
    }
}

/// The document's path template that matches `path`, literal segments before parameters.
fn path_item<'a>(doc: &'a Value, path: &str) -> Option<(&'a str, &'a Value)> {
    let segments: Vec<&str> = path.trim_end_matches('/').split('/').collect();
    let mut best: Option<(usize, &str, &Value)> = None;
    for (template, item) in doc["paths"].as_object()? {
        let parts: Vec<&str> = template.split('/').collect();
        if parts.len() != segments.len() {
            continue;
        }
        let mut literal = 0;
        let fits = parts.iter().zip(&segments).all(|(p, s)| {
            if p.starts_with('{') && p.ends_with('}') {
                !s.is_empty()
            } else {
                literal += 1;
                p == s
            }
        });
        if fits && best.is_none_or(|(n, _, _)| literal > n) {
            best = Some((literal, template, item));
        }
    }
    best.map(|(_, t, i)| (t, i))
}

/// Follows a local `$ref` (`#/a/b`), once or more.
fn resolve<'a>(doc: &'a Value, node: &'a Value) -> Result<&'a Value, String> {
    let mut node = node;
    for _ in 0..16 {
        let Some(r) = node.get("$ref").and_then(Value::as_str) else {
            return Ok(node);
        };
        let pointer = r
            .strip_prefix('#')
            .ok_or_else(|| format!("only local references are known: {r}"))?;
        node = doc
            .pointer(pointer)
            .ok_or_else(|| format!("dangling reference {r}"))?;
    }
    Err("a reference loop".into())
}

fn type_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Appends to `errors` every way `value` (at `at`) breaks `schema`.
pub fn validate(doc: &Value, schema: &Value, value: &Value, at: &str, errors: &mut Vec<String>) {
    let schema = match resolve(doc, schema) {
        Ok(s) => s,
        Err(e) => return errors.push(format!("{at}: {e}")),
    };
    let Some(rules) = schema.as_object() else {
        return errors.push(format!("{at}: a schema that is not an object: {schema}"));
    };
    for key in rules.keys() {
        let known = matches!(
            key.as_str(),
            "type"
                | "nullable"
                | "enum"
                | "properties"
                | "required"
                | "additionalProperties"
                | "items"
                | "allOf"
                | "minLength"
                | "maxLength"
        ) || ANNOTATIONS.contains(&key.as_str());
        if !known {
            errors.push(format!(
                "{at}: the contract check does not know the keyword {key:?}; teach it before using it"
            ));
        }
    }
    if value.is_null() && rules.get("nullable") == Some(&Value::Bool(true)) {
        return;
    }
    if let Some(all) = rules.get("allOf").and_then(Value::as_array) {
        for s in all {
            validate(doc, s, value, at, errors);
        }
    }
    if let Some(want) = rules.get("type").and_then(Value::as_str) {
        let got = type_of(value);
        let fits = got == want || (want == "number" && got == "integer");
        if !fits {
            return errors.push(format!("{at}: {want} expected, {got} found: {value}"));
        }
    }
    if let Some(options) = rules.get("enum").and_then(Value::as_array)
        && !options.contains(value)
    {
        errors.push(format!("{at}: {value} is not one of {options:?}"));
    }
    if let Some(s) = value.as_str() {
        let n = s.chars().count() as u64;
        if let Some(min) = rules.get("minLength").and_then(Value::as_u64)
            && n < min
        {
            errors.push(format!("{at}: shorter than {min}"));
        }
        if let Some(max) = rules.get("maxLength").and_then(Value::as_u64)
            && n > max
        {
            errors.push(format!("{at}: longer than {max}"));
        }
    }
    if let Some(object) = value.as_object() {
        let properties = rules.get("properties").and_then(Value::as_object);
        for name in rules
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            if !object.contains_key(name) {
                errors.push(format!("{at}: required field {name:?} is missing"));
            }
        }
        for (key, v) in object {
            let here = format!("{at}.{key}");
            match properties.and_then(|p| p.get(key)) {
                Some(s) => validate(doc, s, v, &here, errors),
                None => match rules.get("additionalProperties") {
                    Some(Value::Bool(false)) => {
                        errors.push(format!("{here}: not a documented field"))
                    }
                    Some(s @ Value::Object(_)) => validate(doc, s, v, &here, errors),
                    _ => {}
                },
            }
        }
    }
    if let (Some(items), Some(list)) = (rules.get("items"), value.as_array()) {
        for (i, v) in list.iter().enumerate() {
            validate(doc, items, v, &format!("{at}[{i}]"), errors);
        }
    }
}

/// The validator itself, against planted breaches: a check that cannot fail is no check.
mod planted {
    use super::*;
    use serde_json::json;

    fn task() -> Value {
        json!({
            "id": 1, "work_item_id": "ORCH-1", "repo": "svc", "title": "t", "body": "",
            "stage": "intake", "stage_seq": 0, "terminal": false, "branch": "orch/ORCH-1",
            "created_at_ms": 1, "updated_at_ms": 2, "outcome": null
        })
    }

    fn answer(path: &str, status: u16, body: &Value) -> Result<(), String> {
        check(
            document(),
            "GET",
            path,
            status,
            "application/json",
            &body.to_string(),
        )
    }

    #[test]
    fn a_valid_answer_passes() {
        let list = json!({"count": 1, "tasks": [task()]});
        answer("/tasks", 200, &list).unwrap();
        let error = json!({"error": {"code": "not_found", "message": "no task"}});
        answer("/tasks/ORCH-9", 404, &error).unwrap();
        // Not the API's: the dashboard's pages and the fallback.
        check(
            document(),
            "GET",
            "/ui/tasks/ORCH-1",
            200,
            "text/html",
            "<p>",
        )
        .unwrap();
        check(document(), "GET", "/nowhere/at/all", 404, "text/plain", "").unwrap();
    }

    #[test]
    fn every_kind_of_breach_is_caught() {
        let mut missing = task();
        missing.as_object_mut().unwrap().remove("branch");
        let mut wrong_type = task();
        wrong_type["stage_seq"] = json!("0");
        let mut bad_null = task();
        bad_null["title"] = Value::Null;
        let mut bad_enum = task();
        bad_enum["outcome"] = json!({"outcome": "exploded", "stage": null, "reason": null,
            "live": null, "recorded": true});
        for (task, want) in [
            (missing, "required field \"branch\""),
            (wrong_type, "integer expected, string found"),
            (bad_null, "string expected, null found"),
            (bad_enum, "\"exploded\" is not one of"),
        ] {
            let err = answer("/tasks", 200, &json!({"count": 1, "tasks": [task]})).expect_err(want);
            assert!(err.contains(want), "{want}: {err}");
            assert!(err.contains("$.tasks[0]"), "the place is named: {err}");
        }
        let err = answer("/tasks", 418, &json!({})).unwrap_err();
        assert!(err.contains("status 418 is not documented"), "{err}");
        let err = check(document(), "GET", "/tasks", 200, "text/html", "<p>").unwrap_err();
        assert!(err.contains("content type \"text/html\""), "{err}");
        let err = check(document(), "DELETE", "/tasks", 200, "", "").unwrap_err();
        assert!(err.contains("delete is not documented"), "{err}");
        let err = check(
            document(),
            "GET",
            "/tasks",
            200,
            "application/json",
            "{not json",
        )
        .unwrap_err();
        assert!(err.contains("not JSON"), "{err}");
    }

    #[test]
    fn closed_objects_and_unknown_keywords_are_refused() {
        let doc = json!({"components": {"schemas": {
            "Closed": {"type": "object", "additionalProperties": false,
                       "properties": {"a": {"type": "integer"}}},
            "Odd": {"type": "string", "pattern": "^x$"}
        }}});
        let mut errors = Vec::new();
        let closed = json!({"$ref": "#/components/schemas/Closed"});
        validate(&doc, &closed, &json!({"a": 1, "b": 2}), "$", &mut errors);
        assert_eq!(errors, ["$.b: not a documented field"]);
        errors.clear();
        let odd = json!({"$ref": "#/components/schemas/Odd"});
        validate(&doc, &odd, &json!("x"), "$", &mut errors);
        assert!(
            errors[0].contains("does not know the keyword \"pattern\""),
            "{errors:?}"
        );
        errors.clear();
        let dangling = json!({"$ref": "#/components/schemas/Gone"});
        validate(&doc, &dangling, &json!(1), "$", &mut errors);
        assert!(errors[0].contains("dangling reference"), "{errors:?}");
    }
}
