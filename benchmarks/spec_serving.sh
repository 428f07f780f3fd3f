#!/usr/bin/env bash
# One request at a time against halserve serve on W1, without and with ngram speculation (BENCHMARKS.md).
set -e
cd "$(dirname "$0")/.."
for mode in plain spec; do
  port=$((18000 + RANDOM % 1000))
  extra=()
  [ $mode = spec ] && extra=(--speculative-config '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":3,"prompt_lookup_min":1}')
  python -m halserve.entrypoints.cli serve bench_out/models/W1 --platform cpu --dtype float32 --no-enable-prefix-caching --port $port --log-level warning "${extra[@]}" > bench_out/serve_$mode.log 2>&1 &
  pid=$!
  for i in $(seq 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 0.5; done
  echo "== $mode"
  python -m halserve.entrypoints.cli bench serve --base-url http://127.0.0.1:$port --model bench_out/models/W1 --num-prompts 16 --random-input-len 128 --random-output-len 128 --max-concurrency 1 2>&1 | grep -E "throughput|TTFT|TPOT|ITL" | grep -iE "median|output token throughput|Request throughput"
  kill $pid; wait $pid 2>/dev/null || true
done
