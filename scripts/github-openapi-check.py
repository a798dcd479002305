#!/usr/bin/env python3
"""Holds recorded HTTP exchanges with a GitHub stand-in to GitHub's own OpenAPI description
(npm @octokit/openapi, generated/api.github.com.json; scripts/install-forge-specs installs it).

    github-openapi-check.py <api.github.com.json> <exchanges.jsonl>

Each line of the exchanges file is one request and its answer:
    {"method", "path", "query": [[k, v], ...], "request_headers": {lower-case: value},
     "request_body": <JSON or null>, "status", "response_headers": {...}, "body": <JSON or null>}

Checked against the description, per exchange:
- the method and path are an operation of the description;
- every query parameter is one the operation declares, its value valid for the parameter's
  schema (integers, enums, ...), and every required parameter is present; path parameters too;
- a JSON request body (POST, PATCH) valid for the operation's `requestBody` schema;
- GitHub's request rule: a User-Agent header;
- the status is one the operation documents and the JSON body valid for its schema (OpenAPI
  3.0 `nullable` honoured, `$ref`s resolved in the description), except three statuses the
  description leaves to GitHub's general rules: 304 (only for a request with If-None-Match,
  empty body), 403/429 rate limits (only with X-RateLimit-Remaining: 0 or Retry-After, body a
  `basic-error`) and 5xx (body a `basic-error`).

Prints one line per violation and a summary; exit 0 when there is none, 1 otherwise, 2 on bad
input. Formats (`date-time`, `uri`) are not checked: jsonschema checks them only with optional
packages.
"""

import json
import re
import sys

import jsonschema
import referencing
import referencing.jsonschema

BASE = "urn:github-openapi"


def fix_nullable(node):
    """OpenAPI 3.0's `nullable: true` as JSON Schema: anyOf [schema, null]."""
    if isinstance(node, list):
        return [fix_nullable(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        # `example(s)` hold data, not schemas.
        out[k] = v if k in ("example", "examples") else fix_nullable(v)
    # Every reference absolute, so a schema taken out of the description still reaches it.
    if isinstance(out.get("$ref"), str) and out["$ref"].startswith("#/"):
        out["$ref"] = BASE + out["$ref"]
    if out.get("nullable") is True:
        del out["nullable"]
        return {"anyOf": [out, {"type": "null"}]}
    if out.get("nullable") is False:
        del out["nullable"]
    return out


def deref(spec, node):
    while isinstance(node, dict) and "$ref" in node:
        ref = node["$ref"]
        if ref.startswith(BASE):
            ref = ref[len(BASE):]
        assert ref.startswith("#/"), ref
        cur = spec
        for part in ref[2:].split("/"):
            cur = cur[part.replace("~1", "/").replace("~0", "~")]
        node = cur
    return node


def template_regex(path):
    return re.compile("^" + re.sub(r"\\{[^/]+?\\}", "([^/]+)", re.escape(path)) + "$")


def coerce(value, schema):
    t = schema.get("type")
    try:
        if t == "integer":
            return int(value)
        if t == "number":
            return float(value)
        if t == "boolean":
            return {"true": True, "false": False}[value]
    except (ValueError, KeyError):
        return value
    return value


class Checker:
    def __init__(self, spec_path):
        with open(spec_path, encoding="utf-8") as f:
            raw = json.load(f)
        self.spec = fix_nullable(raw)
        resource = referencing.jsonschema.DRAFT4.create_resource(self.spec)
        self.registry = referencing.Registry().with_resource(BASE, resource)
        self.ops = []
        for path, item in self.spec["paths"].items():
            names = re.findall(r"\{([^/]+?)\}", path)
            for method, op in item.items():
                if method in ("get", "post", "put", "patch", "delete", "head"):
                    self.ops.append((method.upper(), path, template_regex(path), names, op, item))

    def schema_errors(self, schema, value, where):
        # `$ref`s are absolute (see fix_nullable): the registry resolves them in the description.
        validator = jsonschema.Draft4Validator(schema, registry=self.registry)
        return [
            f"{where}: {e.message[:300]} at {'/'.join(str(p) for p in e.absolute_path) or '(root)'}"
            for e in validator.iter_errors(value)
        ]

    def check(self, ex):
        errors = []
        method, path = ex["method"], ex["path"]
        found = None
        for m, template, regex, names, op, item in self.ops:
            if m != method:
                continue
            match = regex.match(path)
            if match:
                found = (template, names, match.groups(), op, item)
                break
        if not found:
            return [f"{method} {path}: no such operation in the description"]
        template, names, values, op, item = found
        where = f"{method} {template}"
        params = [deref(self.spec, p) for p in item.get("parameters", []) + op.get("parameters", [])]
        query = {p["name"]: p for p in params if p.get("in") == "query"}
        paths = {p["name"]: p for p in params if p.get("in") == "path"}
        for name, value in zip(names, values):
            p = paths.get(name)
            if p is None:
                errors.append(f"{where}: path parameter {name} is not declared")
            else:
                errors += self.schema_errors(p.get("schema", {}), coerce(value, p.get("schema", {})),
                                             f"{where}: path parameter {name}={value!r}")
        seen = set()
        for key, value in ex.get("query", []):
            seen.add(key)
            p = query.get(key)
            if p is None:
                errors.append(f"{where}: query parameter {key!r} is not one the operation takes")
                continue
            schema = p.get("schema", {})
            errors += self.schema_errors(schema, coerce(value, schema), f"{where}: query {key}={value!r}")
        for name, p in query.items():
            if p.get("required") and name not in seen:
                errors.append(f"{where}: required query parameter {name} is missing")
        if ex.get("request_body") is not None:
            content = (deref(self.spec, op.get("requestBody", {})).get("content") or {})
            schema = (content.get("application/json") or {}).get("schema")
            if schema is None:
                errors.append(f"{where}: the operation takes no JSON request body")
            else:
                errors += self.schema_errors(schema, ex["request_body"], f"{where}: request body")
        req_headers = ex.get("request_headers", {})
        if not req_headers.get("user-agent"):
            errors.append(f"{where}: no User-Agent (GitHub refuses such requests)")
        status = str(ex["status"])
        body = ex.get("body")
        responses = op.get("responses", {})
        error_schema = {"$ref": BASE + "#/components/schemas/basic-error"}
        headers = ex.get("response_headers", {})
        if status == "304":
            if "if-none-match" not in req_headers:
                errors.append(f"{where}: 304 to a request without If-None-Match")
            if body not in (None, ""):
                errors.append(f"{where}: 304 with a body")
            return errors
        if status in responses:
            response = deref(self.spec, responses[status])
            content = response.get("content", {})
            schema = (content.get("application/json") or {}).get("schema")
            if schema is not None:
                errors += self.schema_errors(schema, body, f"{where}: {status} body")
            return errors
        if status in ("403", "429"):
            limited = headers.get("x-ratelimit-remaining") == "0" or "retry-after" in headers
            if not limited:
                errors.append(f"{where}: {status} is not documented and is no rate limit")
            errors += self.schema_errors(error_schema, body, f"{where}: {status} body")
            return errors
        if status.startswith("5"):
            errors += self.schema_errors(error_schema, body, f"{where}: {status} body")
            return errors
        return [f"{where}: status {status} is not documented (documented: {sorted(responses)})"]


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    checker = Checker(sys.argv[1])
    violations = 0
    checked = 0
    with open(sys.argv[2], encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            ex = json.loads(line)
            checked += 1
            for e in checker.check(ex):
                violations += 1
                print(f"VIOLATION exchange {n}: {e}")
    print(f"checked {checked} exchanges against the description: {violations} violation(s)")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
