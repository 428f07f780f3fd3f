#!/usr/bin/env bash
# Run ON THE GPU MACHINE, in the repository root, in one call (device tool: carry [".whl"]):
#
#     bash benchmarks/gpu/run_gpu_checks.sh [all|tests|bench|moe|e2e|async|lease]
#
# ("lease" is for one device call of at most DEADLINE_S seconds, 570 unless set: e2e first, then
# the Triton test directory and the async-scheduling tests in the time left, each step cut to it)
#
# ("e2e", about 6-7 minutes on one H100 or H200, is benchmarks/gpu/e2e.sh: the graph-vs-eager
# GPU tests, decode/offline/serving figures of Llama-3.1-8B and Qwen2.5-0.5B configs with dummy
# weights beside the roofline and transformers; DRY_RUN=1 runs its logic on a CPU, tiny configs)
#
# (a device command may run 10 minutes: "all" budgets about 3 for the attention benchmark and its
# sweep, 4.5 for the tests (2.5 with 8 pytest-xdist workers where the image has xdist, then 2
# for the sleep-mode test alone) and 1 for the GEMMs, under 9.5 in all; "tests" and "bench" give
# either more room; "moe" runs the fused-MoE benchmark alone at Mixtral-8x7B and Qwen1.5-MoE shapes;
# "async", about 5 minutes, runs step 5 alone)
#
# 1. installs the carried wheels (benchmarks/gpu/fetch_wheels.sh) and halserve from this tree
# 2. the decode benchmark at batch 64 x context 4096 x head 128 bf16 (acceptance: >= 70% of
#    peak HBM bandwidth) with its tuning sweep, and prefill
# 3. the Triton test directory compiled on the GPU (no TRITON_INTERPRET): the same kernel
#    tests as the interpreter suite plus the `gpu` ones (bf16, fp8 casts, torch._scaled_mm,
#    engine greedy vs transformers); then, alone on the device, sleep mode's device memory
# 4. the GEMMs (and, in "bench" mode, fused MoE at Mixtral-8x7B shapes)
# 5. ("async" mode) async scheduling on cuda: its equivalence tests (sync vs async tokens, the
#    sampled ids kept on the device), then W2 offline throughput sync / async uni / async mp, twice
# Logs go to $OUT (or ./gpu_out) so they come back. Exits non-zero if the tests failed.
set -uo pipefail
what="${1:-all}"
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
if [ -z "${DRY_RUN:-}" ]; then
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# halserve itself, from this tree (setuptools and wheel are in the image; nothing is fetched)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
    || python3 -m pip install -q --no-deps --no-build-isolation --no-index . >> "$OUT/install.log" 2>&1 || {
    echo "pip install of halserve failed, see install.log"; tail -20 "$OUT/install.log"; exit 1; }
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || rocm-smi 2>/dev/null
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} | tee "$OUT/device.txt"
else  # DRY_RUN=1 (CPU): the e2e steps on tiny configs, to check the script's logic; nothing installed
    echo "dry run on $(uname -m) CPU: tiny configs" | tee "$OUT/device.txt"
fi

peak=3350  # H100 SXM HBM3, GB/s
case "$(cat "$OUT/device.txt")" in *H200*) peak=4800 ;; *MI300X*) peak=5300 ;; esac
kernels=benchmarks/kernels
if [ "$what" = e2e ]; then
    exec bash benchmarks/gpu/e2e.sh "$OUT" "$peak"
fi
deadline="${DEADLINE_S:-100000}"
left_or() {  # left_or SECONDS: SECONDS, or the time left before the deadline less a margin if shorter
    local left=$((deadline - SECONDS - 15))
    [ "$left" -lt 1 ] && left=1
    [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
e2e_rc=0
if [ "$what" = lease ]; then
    deadline="${DEADLINE_S:-570}"
    bash benchmarks/gpu/e2e.sh "$OUT" "$peak"
    e2e_rc=$?
    echo "e2e exit code: $e2e_rc ($SECONDS s into the lease)"
fi
if [ "$what" = moe ]; then
    timeout 200 python3 $kernels/bench_fused_moe.py 2>&1 | tee "$OUT/bench_fused_moe.log"
    timeout 200 python3 $kernels/bench_fused_moe.py -e 60 -k 4 --hidden 2048 --inter 1408 2>&1 \
        | tee "$OUT/bench_fused_moe_qwen.log"
    exit 0
fi

# 2. the acceptance figure first (decode bandwidth at batch 64 x context 4096 x head 128, bf16),
#    with the tuning sweep (pipeline depth x split-K, keys per tile x warps) and prefill
if [ "$what" = all ] || [ "$what" = bench ]; then
    timeout "$([ "$what" = bench ] && echo 300 || echo 170)" \
        python3 $kernels/bench_paged_attention.py --sweep --peak-gbps "$peak" 2>&1 | tee "$OUT/bench_paged_attention.log"
fi

# 3. the Triton test directory compiled on the GPU, `gpu` tests included; the compile-check
#    tests (Triton's compiler for five named targets, no device involved) run in CI instead,
#    as does tests/attention_backends (CPU backends only)
tests_rc=0
if [ "$what" = all ] || [ "$what" = tests ] || { [ "$what" = lease ] && [ "$(left_or 60)" -ge 60 ]; }; then
    workers=()
    python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
    timeout "$(left_or "$([ "$what" = tests ] && echo 420 || echo 150)")" \
        python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider "${workers[@]}" --timeout 200 \
            --junitxml="$OUT/pytest_gpu.xml" tests/platforms/triton \
            --ignore=tests/platforms/triton/test_triton_gpu_compile.py \
            --ignore=tests/platforms/triton/test_triton_moe_compile.py 2>&1 | tee "$OUT/pytest_gpu.log"
    tests_rc=${PIPESTATUS[0]}
    # sleep mode (issue 30) measures the device's free memory (mem_get_info counts every process):
    # alone, after the parallel run
    [ "$(left_or 60)" -ge 60 ] && timeout "$(left_or 120)" \
        python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider --timeout 110 \
            --junitxml="$OUT/pytest_gpu_sleep.xml" -m gpu tests/worker/test_sleep_mode_device.py 2>&1 \
            | tee "$OUT/pytest_gpu_sleep.log"
    sleep_rc=${PIPESTATUS[0]}
    [ "$tests_rc" -eq 0 ] && [ "$sleep_rc" -ne 0 ] && [ -s "$OUT/pytest_gpu_sleep.log" ] && tests_rc=$sleep_rc
fi

# 4. the GEMMs (and, in "bench" mode, fused MoE)
if [ "$what" = all ] || [ "$what" = bench ]; then
    timeout "$([ "$what" = bench ] && echo 200 || echo 60)" python3 $kernels/bench_gemm.py 2>&1 | tee "$OUT/bench_gemm.log"
fi
[ "$what" = bench ] && timeout 60 python3 $kernels/bench_fused_moe.py 2>&1 | tee "$OUT/bench_fused_moe.log"
# 5. async scheduling on the device (issue 25 item 3): step N+1's placeholder inputs gathered from
#    step N's sampled ids on the GPU, step N's output read back while N+1 runs
if [ "$what" = async ] || { [ "$what" = lease ] && [ "$(left_or 60)" -ge 60 ]; }; then
    HALSERVE_ASYNC_TEST_PLATFORM=cuda timeout "$(left_or 200)" \
        python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider --timeout 180 \
            --junitxml="$OUT/pytest_async.xml" tests/engine/test_async_scheduling.py tests/worker/test_async_output.py \
            2>&1 | tee "$OUT/pytest_async.log"
    async_rc=${PIPESTATUS[0]}
    [ "$tests_rc" -eq 0 ] && tests_rc=$async_rc
fi
if [ "$what" = async ]; then
    w2=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from workloads import ensure_checkpoint; \
print(ensure_checkpoint('W2', '/tmp/halserve_models'))" 2>>"$OUT/async_w2.log")
    for run in 1 2; do
        for mode in sync "async uni" "async mp"; do
            flags=()
            case "$mode" in "async uni") flags=(--async-scheduling --distributed-executor-backend uni) ;;
                            "async mp") flags=(--async-scheduling --distributed-executor-backend mp) ;; esac
            echo "== W2 $mode (run $run)"
            timeout 60 halserve bench throughput --model "$w2" --platform cuda --dtype bfloat16 --num-prompts 256 \
                --input-len 32 --output-len 64 "${flags[@]}" 2>&1 | grep -E "^Throughput|Error|error"
        done
    done 2>&1 | tee -a "$OUT/async_w2.log"
fi
echo "tests exit code: $tests_rc"
[ "$tests_rc" -eq 0 ] && tests_rc=$e2e_rc
exit "$tests_rc"
