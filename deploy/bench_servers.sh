#!/usr/bin/env bash
# gunicorn vs granian in front of the same deployment: echo model, wrk (1 thread, 64 keep-alive connections,
# closed loop), SECONDS per server, WORKERS frontend workers each. Run under the shared CPU lock:
#   flock /tmp/zserve-cpu.lock deploy/bench_servers.sh [SECONDS] [WORKERS]
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-10}
WORKERS=${2:-2}
PY=${PY:-.venv/bin/python}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cat > "$TMP/post.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"x": [1, 2, 3]}'
wrk.headers["Content-Type"] = "application/json"
LUA
for server in gunicorn granian; do
  port=$($PY -c 'from zserve.transport import free_tcp_port; print(free_tcp_port())')
  cat > "$TMP/$server.toml" <<TOML
[supervisor]
run_dir = "$TMP/run-$server"
[frontends]
workers = $WORKERS
port = $port
server = "$server"
[[models]]
name = "echo"
handler = "zserve.models.echo:Echo"
max_batch_size = 64
max_wait_ms = 2
max_queue = 4096
TOML
  $PY -m zserve.cli up -c "$TMP/$server.toml" > "$TMP/$server.log" 2>&1 &
  up=$!
  until grep -q "^zserve ready" "$TMP/$server.log"; do
    kill -0 $up 2>/dev/null || { cat "$TMP/$server.log"; exit 1; }
    sleep 0.2
  done
  echo "== $server ($WORKERS workers), echo, wrk -t1 -c64 -d${SECONDS_EACH}s"
  wrk -t1 -c64 -d"${SECONDS_EACH}s" --latency -s "$TMP/post.lua" "http://127.0.0.1:$port/v1/models/echo/predict" \
    | grep -E "Requests/sec|50%|99%|Non-2xx|Socket errors"
  kill -TERM $up
  wait $up
done
