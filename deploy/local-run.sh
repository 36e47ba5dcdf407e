#!/usr/bin/env bash
# `make run`: the tiny model, two engines and a router on localhost, then a streamed answer.
# Keeps serving until Ctrl-C; RUN_ONCE=1 stops everything after the answer (CI smoke test).
set -euo pipefail
BIN=${BIN:-.venv/bin}
RUN_DIR=${RUN_DIR:-.run}
ROUTER_PORT=${ROUTER_PORT:-50050}
HTTP_PORT=${HTTP_PORT:-8000}  # the router's OpenAI API
ENGINE_PORTS=(${ENGINE_PORTS:-50061 50062})
PROMPT=${PROMPT:-"Tell me about the paged KV cache."}
mkdir -p "$RUN_DIR"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

# A second `make run` while the first serves must fail here, not report the first run's
# servers as its own once its own engines died on the bind.
for port in "$ROUTER_PORT" "$HTTP_PORT" "${ENGINE_PORTS[@]}"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "error: port $port on 127.0.0.1 is taken (is another \`make run\` serving?); stop it" \
      "or choose other ports with ROUTER_PORT=... HTTP_PORT=... ENGINE_PORTS='...'" >&2
    exit 1
  fi
done

[ -f "$RUN_DIR/tiny/config.json" ] || "$BIN/nanoserve" tiny-model "$RUN_DIR/tiny"

# Each engine's torch gets its share of the cores: pools sized to the whole host would
# fight over every core and stall both engines under load. OMP_NUM_THREADS overrides.
cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
share=$(( cores / ${#ENGINE_PORTS[@]} ))
threads=${OMP_NUM_THREADS:-$(( share > 0 ? share : 1 ))}
engines=()
for port in "${ENGINE_PORTS[@]}"; do
  OMP_NUM_THREADS=$threads "$BIN/nanoserve" engine --model "$RUN_DIR/tiny" --port "$port" \
    --num-kv-blocks 1024 --max-model-len 1024 >"$RUN_DIR/engine-$port.log" 2>&1 &
  pids+=($!)
  engines+=(--engine "127.0.0.1:$port")
done
"$BIN/nanoserve" router "${engines[@]}" --port "$ROUTER_PORT" --http-port "$HTTP_PORT" >"$RUN_DIR/router.log" 2>&1 &
pids+=($!)

echo "waiting for engines ${ENGINE_PORTS[*]} and the router on :$ROUTER_PORT (logs in $RUN_DIR/)"
PIDS="${pids[*]}" "$BIN/python" - "$ROUTER_PORT" "${ENGINE_PORTS[@]}" <<'PY'
import os, sys, time
from clients import Client
targets = [f"127.0.0.1:{p}" for p in sys.argv[1:]]
deadline = time.monotonic() + 180
for t in targets[1:] + targets[:1]:  # engines first, then the router
    while True:
        for pid in os.environ["PIDS"].split():  # ours, so no other server answers for them
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                sys.exit("a server of this run exited; see the logs")
        try:
            if Client(t).health(timeout=1) == "SERVING":
                break
        except Exception:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"{t} did not become healthy; see the logs")
        time.sleep(0.3)
PY

echo "streaming through the router (127.0.0.1:$ROUTER_PORT; the tiny model has random weights, so the text is noise):"
echo "> $PROMPT"
"$BIN/nanoserve" generate --target "127.0.0.1:$ROUTER_PORT" --stream --max-tokens 48 \
  --temperature 0.7 --seed 1 "$PROMPT"
echo
cat <<MSG
Call it yourself (router on 127.0.0.1:$ROUTER_PORT; engines on ${ENGINE_PORTS[*]}):
  Python:  $BIN/python -c "from clients import Client; print(Client('127.0.0.1:$ROUTER_PORT').generate('Hello', max_tokens=16).text)"
  Node:    (cd clients/node && NANOSERVE_TARGET=127.0.0.1:$ROUTER_PORT node -e "const {Client}=require('.');new Client(process.env.NANOSERVE_TARGET).generate('Hello',{max_tokens:16}).then(r=>console.log(r.text))")
  OpenAI:  curl -s http://127.0.0.1:$HTTP_PORT/v1/completions -H 'Content-Type: application/json' -d '{"model":"tiny","prompt":"Hello","max_tokens":16}'
  grpcurl: grpcurl -plaintext -d '{"text":"Hello","sampling":{"max_tokens":16}}' 127.0.0.1:$ROUTER_PORT nanoserve.v1.Generation/Stream   (server reflection is on)
MSG
if [ "${RUN_ONCE:-0}" = "1" ]; then exit 0; fi
echo "serving until Ctrl-C"
wait
