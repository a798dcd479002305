#!/bin/sh
# deploy.sh ENV PORT STATE_DIR: run this checkout's revision as the ENV instance on PORT.
# Keeps each release in STATE_DIR/releases/<rev> and remembers the previous one for rollback.
# The release it starts appends `deploy ENV REV` to STATE_DIR/effects.log once it serves.
set -eu
env="$1"; port="$2"; state="$3"
# Every run is logged with its start and end (ns since the epoch), so overlaps can be checked.
mkdir -p "$state"
log_run() { echo "$1 deploy $env ${rev:-?} $(date +%s%N) ${2:-}" >> "$state/deploys.log"; }
trap 'log_run end $?' EXIT
rev="${ORCH_REVISION:-$(git rev-parse HEAD)}"
log_run start
mkdir -p "$state/releases/$rev" "$state/run"
git archive "$rev" | tar -x -C "$state/releases/$rev"
# The release to go back to is the one that ran before this revision: a deploy run again for
# the same revision (after an interrupted one) must not make itself its own "previous".
if [ -f "$state/run/$env.rev" ] && [ "$(cat "$state/run/$env.rev")" != "$rev" ]; then
    cp "$state/run/$env.rev" "$state/run/$env.prev"
fi
sh "$(dirname "$0")/stop.sh" "$env" "$state"
cd "$state/releases/$rev"
APP_REVISION="$rev" APP_ENV="$env" APP_EFFECT=deploy APP_EFFECT_LOG="$state/effects.log" setsid python3 app.py "$port" >"$state/run/$env.log" 2>&1 < /dev/null &
pid=$!
echo "$pid" > "$state/run/$env.pid"
echo "$rev" > "$state/run/$env.rev"
# Deployed means this revision answers on the port: a process left from an earlier run that
# still holds the port (ours then cannot bind it) must not pass for the new release.
for _ in $(seq 1 50); do
    if python3 -c "import json,sys,urllib.request; r = json.load(urllib.request.urlopen('http://127.0.0.1:$port/revision', timeout=1)); sys.exit(r.get('revision') != '$rev')" 2>/dev/null; then
        echo "deployed $rev to $env on port $port"; exit 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "the $env instance exited before it served:" >&2
        tail -n 5 "$state/run/$env.log" >&2
        exit 1
    fi
    sleep 0.1
done
echo "the $env instance did not come up on port $port with revision $rev" >&2
exit 1
