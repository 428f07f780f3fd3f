"""Every Triton kernel, on its GPU code path, compiles for H100, L40S, A100, MI300 and MI355 and fits them.

No GPU needed: ``compile_check`` runs the real launchers under a compile-only Triton driver
for each target, and Triton's full pipeline (ptxas for NVIDIA, the AMDGPU backend for ROCm)
builds every launch. A subprocess per target, because this directory's kernels are
imported under ``TRITON_INTERPRET=1``, which cannot compile. Numerics on a GPU stay with
the ``gpu`` tests.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from halserve.platforms.triton_kernels.compile_check import TARGETS

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # real Triton compiler per GPU, minutes (inner loop: -m 'not slow')

# A few bytes of spill (one register on one path) is noise; a real spill is hundreds.
MAX_SPILL_BYTES = 16
DOT_KERNELS = ("unified_attention_kernel", "scaled_gemm_kernel", "wo4_gemm_kernel", "gguf_gemm_kernel")


def _compile_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    env = _compile_env()
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "halserve.platforms.triton_kernels.compile_check", "--target", name, "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for name in TARGETS
    }
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert stdout.strip(), f"compile_check --target {name} printed nothing (rc {proc.returncode}):\n{stderr}"
        out[name] = json.loads(stdout)
    return out


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_case_compiles_and_fits(reports, target):
    report = reports[target]
    assert report["errors"] == {}, f"cases that do not compile or do not fit {target}: {report['errors']}"
    builds = report["builds"]
    assert {b["case"] for b in builds} == set(report["cases"]), "a case launched no newly compiled kernel"
    limit = report["target"]["max_shared_bytes"]
    for b in builds:
        where = f"{b['case']} {b['kernel']} on {target}"
        assert b["shared_bytes"] <= limit, where
        assert b["spill_bytes"] <= MAX_SPILL_BYTES, f"{where} spills {b['spill_bytes']} bytes ({b['registers']} regs)"
        assert b["grid"] is not None and min(b["grid"]) >= 1, f"{where} was compiled but never launched"
        assert b["programs_per_sm"] >= 1, f"{where}: not one program fits an SM/CU ({b})"


@pytest.mark.parametrize("target", list(TARGETS))
def test_dots_run_on_matrix_units_in_the_expected_types(reports, target):
    t = TARGETS[target]
    for b in reports[target]["builds"]:
        if b["kernel"] not in DOT_KERNELS:
            continue
        case, ops = b["case"], set(b["matrix_operands"])
        if "float32" in case:
            # ieee fp32: FMA units on NVIDIA (no tf32 rounding), fp32 MFMA on AMD
            assert ops == (set() if t.backend == "cuda" else {"f32"}), (case, ops)
            continue
        assert b["matrix_instructions"] > 0, f"{case} on {target} has no tensor-core/MFMA instruction"
        if case.startswith("gemm/int8"):
            assert ops == {"i8"}, (case, ops)
        elif case.startswith("gemm/fp8"):
            # fp8 MMAs where the GPU has them; sm90's mma.sync path (M <= 32, below wgmma's 64
            # rows) and pre-fp8 GPUs run the exact fp16 values instead
            small_m_hopper = t.arch == 90 and case.endswith(("-m1", "-m32"))
            want = {"fp8"} if t.has_fp8_dot and not small_m_hopper else {"f16"}
            assert ops == want, (case, ops)
        elif "float16" in case or "fp16" in case:
            assert ops == {"f16"}, (case, ops)
        else:  # bf16 models, fp8 KV cache included (the cache is dequantized to the query dtype)
            assert ops == {"bf16"}, (case, ops)


def test_split_decode_launches_one_program_per_split(reports):
    builds = [b for b in reports["sm_90"]["builds"] if b["case"] == "attention/decode-bf16-h128-gqa4-split8"]
    attention = next(b for b in builds if b["kernel"] == "unified_attention_kernel")
    assert attention["grid"][2] == 8
    assert any(b["kernel"] == "reduce_splits_kernel" for b in builds)


@pytest.mark.parametrize("target", ["sm_90", "sm_80", "sm_89"])
def test_split_decode_streams_its_next_kv_tile_during_the_dots(reports, target):
    """On Hopper the split-K decode loop is double-buffered: its waits leave copies in flight
    (Triton's default depth drains them all at every tile, since the K/V loads sit behind the
    block-table load). Single-pass decode and prefill keep the default (an H200 measured the
    single pass slower double-buffered). A100 and sm_89 keep it everywhere, where a second
    buffer would halve the programs per SM."""
    attention = [b for b in reports[target]["builds"] if b["kernel"] == "unified_attention_kernel"]
    split = [b for b in attention if b["case"].startswith("attention/decode-") and "-split" in b["case"]]
    single = [b for b in attention if b not in split]
    assert split and any(b["case"].startswith("attention/decode-") for b in single)
    hopper = TARGETS[target].arch == 90
    for b in split:
        assert (b["async_copy_depth"] > 0) == hopper, (b["case"], b["num_stages"], b["async_copy_depth"])
        if hopper:
            assert b["programs_per_sm"] >= 2, f"{b['case']}: the deeper pipeline leaves one program per SM ({b})"
    for b in single:
        assert b["num_stages"] == 3, (b["case"], b["num_stages"])  # Triton's default


@pytest.mark.parametrize("target", ["sm_89", "gfx942"])
def test_widest_fp32_attention_tiles_fit_the_smallest_parts(target):
    """The crossed sweep's fp32 head-256 corner (every GQA ratio, decode, split, prefill) on
    the parts with the least shared memory: a 32 x 32 x 256 fp32 prefill tile once needed
    100 KB on sm_89 (99 KB) and spilled kilobytes of registers."""
    proc = subprocess.run(
        [sys.executable, "-m", "halserve.platforms.triton_kernels.compile_check", "--target", target, "--sweep",
         "--only", "float32-h256", "--json"],
        capture_output=True, text=True, env=_compile_env(), timeout=900,
    )
    assert proc.stdout.strip(), f"compile_check --sweep printed nothing (rc {proc.returncode}):\n{proc.stderr}"
    report = json.loads(proc.stdout)
    assert report["errors"] == {}, report["errors"]
    assert len(report["cases"]) == 12 and {b["case"] for b in report["builds"]} == set(report["cases"])
    for b in report["builds"]:
        assert b["spill_bytes"] <= MAX_SPILL_BYTES and b["programs_per_sm"] >= 1, b


# A GEMM whose tiles cannot fit: the check must report what the GPU would refuse at launch.
_OVERSIZED = """
import torch, triton, triton.language as tl
from triton.runtime.errors import OutOfResources
from halserve.platforms.triton_kernels.compile_check import compile_only, TARGETS

@triton.jit
def matmul(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        acc += tl.dot(tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :]),
                      tl.load(b_ptr + (k + rk)[:, None] * BN + rn[None, :]))
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)

a, b = torch.empty(256, 1024, dtype=torch.float16), torch.empty(1024, 256, dtype=torch.float16)
c = torch.empty(256, 256)
with compile_only(TARGETS["gfx942"]):
    try:  # 4 stages of 256x64 + 64x256 fp16 tiles: 192 KB of LDS, MI300 has 64 KB
        matmul[(1,)](a, b, c, 1024, BM=256, BN=256, BK=64, num_stages=4)
    except OutOfResources as e:
        print("refused:", e)
with compile_only(TARGETS["sm_80"]) as driver:  # a 128x128 fp32 accumulator in one warp: 512 values per thread
    matmul[(1,)](a, b, c, 1024, BM=128, BN=128, BK=32, num_warps=1, num_stages=2)
    print("spill_bytes:", driver.builds[-1].spill_bytes)
"""


def test_the_check_reports_what_a_gpu_would_refuse_or_spill(tmp_path):
    script = tmp_path / "oversized.py"  # @triton.jit needs its source in a file
    script.write_text(_OVERSIZED)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_compile_env(),
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "refused: out of resource: shared memory, Required: 196608, Hardware limit: 65536" in proc.stdout
    spill = int(proc.stdout.split("spill_bytes:")[1])
    assert spill > 1000, proc.stdout


# Triton keeps compiled kernels per device id: the check's builds must never land under a
# real GPU's id, nor reuse what a real GPU compiled there.
_REAL_DEVICE_CACHE = """
import triton
from halserve.attention_backends import triton_paged_kernels as K
from halserve.platforms.triton_kernels.compile_cases import cases
from halserve.platforms.triton_kernels.compile_check import compile_only, TARGETS

real = object()  # what a GPU process would hold under its device 0
K.unified_attention_kernel.device_caches[0] = real
case = next(c for name, c in cases(TARGETS["sm_90"]).items() if name.startswith("attention/decode"))
with compile_only(TARGETS["sm_90"]) as driver:
    case()
assert K.unified_attention_kernel.device_caches[0] is real, "device 0's kernel cache was replaced"
ids = sorted(set(K.unified_attention_kernel.device_caches) | set(K.write_kv_cache_kernel.device_caches))
print("builds:", len(driver.builds), "device ids:", ids)
"""


def test_builds_stay_off_real_device_ids(tmp_path):
    script = tmp_path / "device_ids.py"
    script.write_text(_REAL_DEVICE_CACHE)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_compile_env(),
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    builds, ids = proc.stdout.split("builds:")[1].split("device ids:")
    assert int(builds) >= 2  # the KV write and the attention kernel were compiled for sm_90
    assert [i for i in json.loads(ids) if i < 1 << 16] == [0], ids  # only the "real" entry sits below


def test_unknown_target_is_a_clear_error():
    from halserve.platforms.triton_kernels.compile_check import check

    with pytest.raises(ValueError, match="unknown target 'sm_75'.*sm_90"):
        check("sm_75")


def test_programs_per_sm_arithmetic():
    """The occupancy figures follow the CUDA occupancy calculator's rules and AMD's CU layout."""
    from halserve.platforms.triton_kernels.compile_check import _programs_per_sm

    sm90, sm89, mi300 = TARGETS["sm_90"], TARGETS["sm_89"], TARGETS["gfx942"]
    # 256 threads: 32 registers fill the 2048 threads of an SM, 64 registers halve that
    assert _programs_per_sm(sm90, registers=32, num_warps=8, shared=0, waves_per_simd=None) == 8
    assert _programs_per_sm(sm90, registers=64, num_warps=8, shared=0, waves_per_simd=None) == 4
    # registers are allocated per warp in units of 256: 120 and 121..128 differ
    assert _programs_per_sm(sm90, registers=120, num_warps=4, shared=0, waves_per_simd=None) == 4
    assert _programs_per_sm(sm90, registers=168, num_warps=4, shared=0, waves_per_simd=None) == 3
    # shared memory: 1 KB reserved per block; sm_89 has 100 KB per SM and 1536 threads
    assert _programs_per_sm(sm90, registers=32, num_warps=4, shared=56 * 1024, waves_per_simd=None) == 4
    assert _programs_per_sm(sm89, registers=32, num_warps=4, shared=48 * 1024, waves_per_simd=None) == 2
    assert _programs_per_sm(sm89, registers=16, num_warps=4, shared=0, waves_per_simd=None) == 12
    # MI300: the compiler's waves per SIMD x 4 SIMDs, then the CU's 64 KB of LDS
    assert _programs_per_sm(mi300, registers=165, num_warps=4, shared=0, waves_per_simd=3) == 3
    assert _programs_per_sm(mi300, registers=64, num_warps=4, shared=40 * 1024, waves_per_simd=8) == 1
