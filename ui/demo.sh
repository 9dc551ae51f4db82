#!/usr/bin/env bash
# `make demo`: the API (tiny model) and the Chainlit UI together, both URLs printed once the
# model is ready. Ctrl-C (or either process exiting) stops both.
# Environment (the Makefile passes its variables): PY (API venv python), UI_PY (ui/.venv
# python), MODEL, HOST, PORT (API), UI_PORT.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
UI_PY=${UI_PY:-ui/.venv/bin/python}
MODEL=${MODEL:-models/phi-3-vision-tiny}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
UI_PORT=${UI_PORT:-8080}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-600}

"$PY" -m serve --model "$MODEL" --host "$HOST" --port "$PORT" &
api_pid=$!
"$UI_PY" -m ui --host "$HOST" --port "$UI_PORT" --api-base-url "http://$HOST:$PORT" &
ui_pid=$!

# Background jobs of a non-interactive shell ignore SIGINT, so they get SIGTERM (both servers
# shut down cleanly on it).
stop() {
  trap - EXIT INT TERM
  kill -TERM "$api_pid" "$ui_pid" 2>/dev/null || true
  wait "$api_pid" "$ui_pid" 2>/dev/null || true
}
trap stop EXIT INT TERM

# The UI starts in seconds; the API answers /ready once the engine is up (~35 s on CPU).
for ((i = 0; i < READY_TIMEOUT_S; i++)); do
  if [[ "$("$PY" -c "import httpx,sys; print(httpx.get(sys.argv[1], timeout=2).status_code)" \
        "http://$HOST:$PORT/ready" 2>/dev/null)" == 200 ]]; then
    echo
    echo "  API: http://$HOST:$PORT/v1   (OpenAI-compatible; GET /limits, /ready, /metrics)"
    echo "  UI:  http://$HOST:$UI_PORT   (login: ${PHI3V_UI_DEMO_USER:-demo} / ${PHI3V_UI_DEMO_PASSWORD:-demo})"
    echo
    break
  fi
  kill -0 "$api_pid" 2>/dev/null && kill -0 "$ui_pid" 2>/dev/null || break
  sleep 1
done

wait -n "$api_pid" "$ui_pid"
