#!/bin/sh
# Property-based API test: schemathesis generates requests from docs/openapi.yaml against a real
# `orch serve` on a throw-away demo project (SQLite, bearer token) and fails on any 5xx.
#
#   scripts/schemathesis.sh [extra schemathesis args]
#
# Needs python3 (with venv) and network access to PyPI the first time; the venv lives in
# ${CARGO_TARGET_DIR:-target}/schemathesis-venv. MAX_EXAMPLES (default 50) bounds each operation.
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
VENV=$TARGET/schemathesis-venv
MAX_EXAMPLES=${MAX_EXAMPLES:-50}

if [ ! -x "$VENV/bin/schemathesis" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q schemathesis
fi

cargo build -q -p orch --manifest-path "$ROOT/Cargo.toml"
ORCH=$TARGET/debug/orch

WORK=$(mktemp -d)
SERVE_PID=
cleanup() {
    if [ -n "$SERVE_PID" ]; then
        kill -TERM "$SERVE_PID" 2>/dev/null || true
        wait "$SERVE_PID" 2>/dev/null || true
    fi
    for env in production staging; do
        [ -f "$WORK/demo/service/stop.sh" ] && sh "$WORK/demo/service/stop.sh" "$env" "$WORK/demo/service-state" >/dev/null 2>&1 || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

ORCH_LOG=warn "$ORCH" demo --setup-only --dir "$WORK/demo" >/dev/null
CONFIG=$WORK/demo/orch.toml
TOKEN=$(sed -n 's/^token = "\(.*\)"$/\1/p' "$CONFIG" | head -n 1)
# A few real tasks so the id routes find something.
for t in one two three; do
    ORCH_LOG=warn "$ORCH" --config "$CONFIG" submit --repo service --title "schemathesis $t" >/dev/null
done

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
ORCH_LOG=warn ORCH_DEMO_AGENT_SLEEP_MS=600000 \
    "$ORCH" --config "$CONFIG" serve --bind "127.0.0.1:$PORT" --grace-s 1 >"$WORK/serve.log" 2>&1 &
SERVE_PID=$!
i=0
until curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1; do
    i=$((i + 1))
    if [ "$i" -gt 100 ]; then
        echo "orch serve did not answer on port $PORT:" >&2
        cat "$WORK/serve.log" >&2
        exit 1
    fi
    sleep 0.2
done

# schemathesis 4 takes --url; 3.x took --base-url.
if "$VENV/bin/schemathesis" run --help | grep -q -- '--url'; then
    URL_FLAG=--url
else
    URL_FLAG=--base-url
fi
status=0
# Run from the temp dir: schemathesis keeps a .schemathesis/ cache in its working directory.
cd "$WORK"
"$VENV/bin/schemathesis" run "$ROOT/docs/openapi.yaml" \
    "$URL_FLAG" "http://127.0.0.1:$PORT" \
    --checks not_a_server_error \
    --header "Authorization: Bearer $TOKEN" \
    --max-examples "$MAX_EXAMPLES" \
    "$@" || status=$?
if grep -q 'panicked' "$WORK/serve.log"; then
    echo "orch serve panicked:" >&2
    grep -A5 'panicked' "$WORK/serve.log" >&2
    status=1
fi
exit "$status"
