#!/bin/sh
# stop.sh ENV STATE_DIR: stop the ENV instance if one runs.
env="$1"; state="$2"
if [ -f "$state/run/$env.pid" ]; then
    pid="$(cat "$state/run/$env.pid")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$state/run/$env.pid"
fi
exit 0
