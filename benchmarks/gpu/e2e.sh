#!/usr/bin/env bash
# The "e2e" step of run_gpu_checks.sh (which installs halserve first): bash benchmarks/gpu/e2e.sh OUT PEAK_GBPS
#
# Model folders with config.json and a tokenizer only (benchmarks/gpu/make_configs.py), weights
# made on the device (--load-format dummy), bf16. Steps, each under its own time limit (seconds,
# the usual H100 time in brackets), so one hang cannot eat the budget; a failed step is reported
# and the next one runs:
#   1. tests   (80) [~60]  the engine GPU tests: greedy with graphs == with --enforce-eager and
#                          == transformers, token for token (tests/platforms/triton/test_triton_engine_gpu.py)
#   2. decode  (60) [~35]  Qwen2.5-0.5B, batch 1 and 64 at context 1024, graphs then eager, beside the roofline
#   3. decode  (110) [~70] Llama-3.1-8B, the same, then offline 200 prompts x 512 in / 128 out (graphs)
#   3b. async  (45+45)     both models' decode rows again with --async-scheduling (graphs, uni executor)
#   4. prefill (30) [~15]  the Triton prefill kernel's TFLOP/s (bench_paged_attention.py)
#   5. serve   (90) [~60]  halserve serve Llama-3.1-8B + halserve bench serve: 200 prompts 512/128 at
#                          concurrency 64: TTFT, TPOT
#   6. peer    (90+170) [>60, >140 on the H200] transformers generate (static cache; transformers compiles
#                          the decode step itself, torch.compile reduce-overhead) on the same workloads:
#                          Qwen2.5-0.5B decode, then Llama-3.1-8B decode and offline 64 prompts (one batch).
#                          (2026-11-28, H200: compiling took most of 60 / 100 s; the 8B decode rows alone
#                          took 140 s; the offline part never ran)
#   7. summary: every figure in one table, with the halserve / transformers ratios
# About 8-9 minutes in all on an H200 (on 2026-11-28 steps 1-5 took 199 s; 12 if every limit were
# reached: run it with timeout_s 600, or as run_gpu_checks.sh's "lease", which cuts what follows to a deadline). Returns to $OUT:
# e2e.log (everything), e2e_summary.json, serve_server.log. DRY_RUN=1: tiny configs on the CPU
# (graph rows then run eagerly: the CPU platform captures none), small counts, the same code paths.
set -uo pipefail
OUT="$1"
PEAK="${2:-3350}"
mkdir -p "$OUT"
WORK="${E2E_WORK:-/tmp/halserve_e2e}"
rm -rf "$WORK"; mkdir -p "$WORK/json"
LOG="$OUT/e2e.log"
: > "$LOG"
here=benchmarks/gpu
status=()

if [ -n "${DRY_RUN:-}" ]; then
    suffix=-tiny; tiny=--tiny; dtype=float32; platform=(--platform cpu); scale=dry
    decode=(--batch 1 4 --context 32 --decode-steps 4 --profile 2 --max-num-seqs 8 --max-num-batched-tokens 256 --max-model-len 256)
    offline=(--offline-prompts 8 --offline-in 16 --offline-out 8)
    hf_decode=(--batch 1 4 --context 32 --decode-steps 4)
    hf_offline=(--offline-prompts 8 --offline-batch 4 --offline-in 16 --offline-out 8)
    serve_args=(--num-prompts 8 --random-input-len 16 --random-output-len 8 --max-concurrency 4)
    serve_engine=(--platform cpu --max-model-len 256 --max-num-seqs 8)
    t_tests=300; t_small=300; t_big=300; t_prefill=300; t_serve=300; t_peer_small=300; t_peer_big=300; t_async=300
else
    suffix=; tiny=; dtype=bfloat16; platform=(); scale=full
    decode=(--batch 1 64 --context 1024 --decode-steps 32 --max-model-len 2048 --profile 3)
    offline=(--offline-prompts 200 --offline-in 512 --offline-out 128)
    hf_decode=(--batch 1 64 --context 1024 --decode-steps 32)
    hf_offline=(--offline-prompts 64 --offline-batch 64 --offline-in 512 --offline-out 128)
    serve_args=(--num-prompts 200 --random-input-len 512 --random-output-len 128 --max-concurrency 64)
    serve_engine=(--max-model-len 2048)
    t_tests=80; t_small=60; t_big=110; t_prefill=30; t_serve=90; t_peer_small=90; t_peer_big=170; t_async=45
fi

step() {  # step NAME LIMIT CMD...: run under `timeout`, log, remember the outcome
    local name="$1" limit="$2"; shift 2
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local outcome="ok"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && outcome="TIMED OUT"
    [ "$rc" != 0 ] && [ "$outcome" = ok ] && outcome="FAILED (exit $rc)"
    echo "=== $name: $outcome in $((SECONDS - start))s" | tee -a "$LOG"
    status+=("$name: $outcome ($((SECONDS - start))s)")
}

python3 $here/make_configs.py "$WORK/configs" $tiny --models llama-3.1-8b qwen2.5-0.5b >> "$LOG" 2>&1 \
    || { echo "make_configs failed"; tail -20 "$LOG"; exit 1; }
small="$WORK/configs/qwen2.5-0.5b$suffix"
big="$WORK/configs/llama-3.1-8b$suffix"

# 1. correctness first: graphs vs eager vs transformers (skipped, with the reason, without a GPU)
workers=()
[ -z "${DRY_RUN:-}" ] && python3 -c "import xdist" 2>/dev/null && workers=(-n 4)
step tests "$t_tests" python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider "${workers[@]}" \
    tests/platforms/triton/test_triton_engine_gpu.py

# 2-3. halserve decode (graphs, eager) and offline
step decode-qwen2.5-0.5b "$t_small" python3 $here/e2e_halserve.py --model "$small" --label qwen2.5-0.5b \
    --dtype $dtype "${platform[@]}" --peak-gbps "$PEAK" "${decode[@]}" --json "$WORK/json/halserve_small.json"
step decode-llama-3.1-8b "$t_big" python3 $here/e2e_halserve.py --model "$big" --label llama-3.1-8b \
    --dtype $dtype "${platform[@]}" --peak-gbps "$PEAK" "${decode[@]}" "${offline[@]}" \
    --json "$WORK/json/halserve_big.json"

# 3b. async scheduling (issue 25: step N+1 scheduled while N runs; the sampled ids stay on the device),
#     graphs only, the same decode rows: what it saves of the host's share of a step
step decode-async-qwen2.5-0.5b "$t_async" python3 $here/e2e_halserve.py --model "$small" --label qwen2.5-0.5b \
    --dtype $dtype "${platform[@]}" --peak-gbps "$PEAK" "${decode[@]}" --no-eager --async-scheduling \
    --json "$WORK/json/halserve_small_async.json"
step decode-async-llama-3.1-8b "$t_async" python3 $here/e2e_halserve.py --model "$big" --label llama-3.1-8b \
    --dtype $dtype "${platform[@]}" --peak-gbps "$PEAK" "${decode[@]}" --no-eager --async-scheduling \
    --json "$WORK/json/halserve_big_async.json"

# 4. the prefill kernel
if [ -n "${DRY_RUN:-}" ]; then
    step prefill-kernel "$t_prefill" env TRITON_INTERPRET=1 python3 benchmarks/kernels/bench_paged_attention.py --tiny \
        --no-reference --iters 1
else
    step prefill-kernel "$t_prefill" python3 benchmarks/kernels/bench_paged_attention.py --no-reference --iters 10 \
        --peak-gbps "$PEAK"
fi

# 5. serving: e2e_serve.sh starts a server in its own process group (ended here, whatever happened)
step serve-llama-3.1-8b "$t_serve" bash $here/e2e_serve.sh "$big" "$OUT/serve_server.log" "$WORK/server.pid" \
    "$WORK/json/serve.json" $((t_serve - 20)) -- --load-format dummy --dtype $dtype "${serve_engine[@]}" \
    --no-enable-prefix-caching -- "${serve_args[@]}"
if [ -s "$WORK/server.pid" ]; then
    kill -- -"$(cat "$WORK/server.pid")" 2>/dev/null; sleep 2; kill -9 -- -"$(cat "$WORK/server.pid")" 2>/dev/null
fi

# 6. the transformers peer (a step per model: the 8B one is cut off alone if compiling runs long)
step peer-qwen2.5-0.5b "$t_peer_small" python3 $here/e2e_transformers.py --model "$small" --label qwen2.5-0.5b \
    --dtype $dtype "${hf_decode[@]}" --json "$WORK/json/hf_small.json"
step peer-llama-3.1-8b "$t_peer_big" python3 $here/e2e_transformers.py --model "$big" --label llama-3.1-8b \
    --dtype $dtype "${hf_decode[@]}" "${hf_offline[@]}" --json "$WORK/json/hf_big.json"

# 7. summary
python3 $here/e2e_summary.py "$WORK/json" "$OUT/e2e_summary.json" --log "$LOG" --device "$(head -2 "$OUT/device.txt" | tail -1)" \
    --scale "$scale" 2>&1 | tee -a "$LOG"
printf '%s\n' "${status[@]}" | tee -a "$LOG"
case "${status[*]}" in *FAILED*|*TIMED*) exit 1 ;; esac
exit 0
