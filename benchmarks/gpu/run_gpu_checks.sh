#!/usr/bin/env bash
# Run ON THE GPU MACHINE, in the repository root, in one call (device tool: carry [".whl"]):
#
#     bash benchmarks/gpu/run_gpu_checks.sh [all|tests|bench|moe]
#
# (a device command may run 10 minutes: "all" budgets 5 for the tests, 2 x 1.5 for the attention
# and GEMM benchmarks and 1 for fused MoE; split into two calls, "tests" then "bench", if either
# needs more; "bench" spends its 9 minutes on the attention sweep and the GEMMs, "moe" runs the
# fused-MoE benchmark alone at Mixtral-8x7B and Qwen1.5-MoE shapes)
#
# 1. installs the carried wheels (benchmarks/gpu/fetch_wheels.sh) and halserve from this tree
# 2. the whole Triton test directory compiled on the GPU (no TRITON_INTERPRET): the same
#    kernel tests as the interpreter suite plus the `gpu` ones (bf16, fp8 casts,
#    torch._scaled_mm, engine greedy vs transformers)
# 3. the kernel benchmarks: decode bandwidth at batch 64 x context 4096 x head 128 bf16
#    (acceptance: >= 70% of peak HBM bandwidth), prefill, the GEMMs, and fused MoE at
#    Mixtral-8x7B shapes (T = 1 .. 4096 tokens: TFLOP/s and GB/s); in "bench" mode
#    also decode at pipeline depths 3 and 5 x split-K factors 1, 2, 4, 8, prefill at 3 and 5
# Logs go to $OUT (or ./gpu_out) so they come back. Exits non-zero if the tests failed.
set -uo pipefail
what="${1:-all}"
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# halserve itself, from this tree (setuptools and wheel are in the image; nothing is fetched)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 || {
    echo "pip install -e . failed, see install.log"; tail -20 "$OUT/install.log"; exit 1; }
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || rocm-smi 2>/dev/null
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} | tee "$OUT/device.txt"

tests_rc=0
if [ "$what" = all ] || [ "$what" = tests ]; then
    timeout "$([ "$what" = tests ] && echo 540 || echo 300)" \
        python3 -m pytest -q -p no:cacheprovider tests/platforms/triton tests/attention_backends 2>&1 | tee "$OUT/pytest_gpu.log"
    tests_rc=${PIPESTATUS[0]}
fi
[ "$what" = tests ] && { echo "tests exit code: $tests_rc"; exit "$tests_rc"; }

peak=3350  # H100 SXM HBM3, GB/s
case "$(cat "$OUT/device.txt")" in *H200*) peak=4800 ;; *MI300X*) peak=5300 ;; esac
cd benchmarks/kernels
if [ "$what" = moe ]; then
    timeout 200 python3 bench_fused_moe.py 2>&1 | tee "$OUT/bench_fused_moe.log"
    timeout 200 python3 bench_fused_moe.py -e 60 -k 4 --hidden 2048 --inter 1408 2>&1 \
        | tee "$OUT/bench_fused_moe_qwen.log"
    exit 0
fi
limit=$([ "$what" = bench ] && echo 270 || echo 90)
# "bench" also sweeps pipeline depth x split-K factor (decode) and depth (prefill), for tuning the defaults
sweep=$([ "$what" = bench ] && echo --sweep)
timeout "$limit" python3 bench_paged_attention.py $sweep --peak-gbps "$peak" 2>&1 | tee "$OUT/bench_paged_attention.log"
timeout "$limit" python3 bench_gemm.py 2>&1 | tee "$OUT/bench_gemm.log"
[ "$what" = all ] && timeout 60 python3 bench_fused_moe.py 2>&1 | tee "$OUT/bench_fused_moe.log"
echo "tests exit code: $tests_rc"
exit "$tests_rc"
