#!/bin/sh
# rollback.sh ENV PORT STATE_DIR: bring back the release that ran before the current one.
# The release it starts appends `rollback ENV REV` to STATE_DIR/effects.log once it serves.
set -eu
env="$1"; port="$2"; state="$3"
# Every run is logged with its start and end (ns since the epoch), so overlaps can be checked.
mkdir -p "$state"
log_run() { echo "$1 rollback $env ${rev:-?} $(date +%s%N) ${2:-}" >> "$state/deploys.log"; }
trap 'log_run end $?' EXIT
# orch names the release to go back to (ORCH_ROLLBACK_TO, from its own deploy record); the
# one this script remembers is the fallback when orch does not know it.
prev="${ORCH_ROLLBACK_TO:-}"
if [ -z "$prev" ] || [ ! -d "$state/releases/$prev" ]; then
    prev="$(cat "$state/run/$env.prev")"
fi
rev="$prev"
log_run start
sh "$(dirname "$0")/stop.sh" "$env" "$state"
cd "$state/releases/$prev"
APP_REVISION="$prev" APP_ENV="$env" APP_EFFECT=rollback APP_EFFECT_LOG="$state/effects.log" setsid python3 app.py "$port" >"$state/run/$env.log" 2>&1 < /dev/null &
echo $! > "$state/run/$env.pid"
echo "$prev" > "$state/run/$env.rev"
for _ in $(seq 1 50); do
    # Healthy, and the rolled-back revision is the one answering (not a process left holding
    # the port).
    if python3 -c "import json,sys,urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=1); r = json.load(urllib.request.urlopen('http://127.0.0.1:$port/revision', timeout=1)); sys.exit(r.get('revision') != '$prev')" 2>/dev/null; then
        echo "rolled $env back to $prev"; exit 0
    fi
    sleep 0.1
done
echo "the rolled-back $env instance is not healthy" >&2
exit 1
