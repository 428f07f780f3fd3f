#!/usr/bin/env bash
# e2e.sh's serving step: bash e2e_serve.sh MODEL SERVER_LOG PID_FILE RESULT_JSON WAIT_S -- SERVE_ARGS -- BENCH_ARGS
# Starts `halserve serve MODEL SERVE_ARGS` in a new process group (its id goes to PID_FILE: the
# caller ends the group, also when this script is cut off by its time limit), waits up to WAIT_S
# seconds for /health, runs `halserve bench serve BENCH_ARGS` against it, then ends the server.
set -uo pipefail
model="$1" server_log="$2" pid_file="$3" result="$4" wait_s="$5"; shift 5
[ "$1" = -- ] && shift
serve_args=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do serve_args+=("$1"); shift; done
[ $# -gt 0 ] && shift
bench_args=("$@")
hs=(python3 -c 'import sys; from halserve.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))')
port=$((20000 + RANDOM % 20000))
setsid "${hs[@]}" serve "$model" --served-model-name bench --host 127.0.0.1 --port "$port" "${serve_args[@]}" \
    > "$server_log" 2>&1 &
server=$!
echo "$server" > "$pid_file"
up=
for _ in $(seq 1 "$wait_s"); do
    if python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
        "http://127.0.0.1:$port/health" 2>/dev/null; then up=1; break; fi
    kill -0 "$server" 2>/dev/null || break
    sleep 1
done
rc=1
if [ -n "$up" ]; then
    echo "server up on port $port after ${SECONDS}s"
    "${hs[@]}" bench serve --base-url "http://127.0.0.1:$port" --model bench --tokenizer "$model" \
        "${bench_args[@]}" --result-json "$result"
    rc=$?
else
    echo "the server did not come up in ${wait_s}s; its log ends:"; tail -30 "$server_log"
fi
kill -- -"$server" 2>/dev/null
exit $rc
