"""Compile every Triton kernel for a GPU without one, on the kernels' GPU code paths.

The ``TRITON_INTERPRET=1`` tests run each kernel's code in numpy; they cannot show that the
GPU path (fp16/bf16 tensor-core dots, fp8 dots, GPU tile sizes, software pipelining)
compiles, nor that it fits the GPU (shared memory / LDS, registers, spills). Here a
compile-only Triton driver stands in for a named GPU, the real launchers run with CPU
tensors of the problem's shapes, and Triton compiles every launch through its whole pipeline
(TTIR -> TTGIR -> LLVM IR -> PTX -> cubin with ptxas, or AMDGCN -> hsaco); the launch itself
is a no-op that records the grid. Triton's own resource checks run (shared memory over the
device's limit raises ``OutOfResources`` as on the GPU); registers and spills are read from
the binary (``cuobjdump --dump-resource-usage`` / the AMDGCN metadata).

    python -m halserve.platforms.triton_kernels.compile_check --target sm_90 [--json]

Needs triton (``pip install 'halserve[cuda]'``) and must run without ``TRITON_INTERPRET``
(kernels decorated under the interpreter cannot be compiled), so tests run it in a
subprocess. What it does not check: numerics on the GPU (the ``gpu`` tests do that).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU to compile for; limits are the per-block figures the CUDA/HIP driver reports."""

    name: str  # e.g. "sm_90"
    gpu: str  # an example part, for reports
    backend: str  # "cuda" | "hip"
    arch: int | str  # 90 (compute capability 9.0) | "gfx942"
    warp_size: int
    max_shared_bytes: int  # dynamic shared memory / LDS one block may use
    fp8_dtype: str | None  # the KV-cache / GEMM fp8 flavour the platform uses; None: no fp8 dots
    shared_per_sm: int  # shared memory of one SM / LDS of one CU (occupancy)
    max_threads_per_sm: int = 2048  # NVIDIA only (AMD: the compiler reports waves per SIMD)
    max_blocks_per_sm: int = 32  # NVIDIA only

    @property
    def has_fp8_dot(self) -> bool:
        from halserve.platforms.triton_kernels.fp8_gemm import fp8_dot_supported

        return fp8_dot_supported(self.arch)


TARGETS: dict[str, GpuTarget] = {
    t.name: t
    for t in (
        GpuTarget("sm_90", "H100", "cuda", 90, 32, 232448, "float8_e4m3fn", 233472),
        GpuTarget("sm_89", "L40S / RTX 4090", "cuda", 89, 32, 101376, "float8_e4m3fn", 102400, 1536, 24),
        GpuTarget("sm_80", "A100", "cuda", 80, 32, 166912, None, 167936),
        GpuTarget("gfx942", "MI300X", "hip", "gfx942", 64, 65536, "float8_e4m3fnuz", 65536),
        GpuTarget("gfx950", "MI355X", "hip", "gfx950", 64, 163840, "float8_e4m3fn", 163840),
    )
}


@dataclasses.dataclass
class KernelBuild:
    """One compiled specialisation of one kernel, as launched by a case."""

    case: str
    kernel: str
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int  # per thread (CUDA REG / AMD VGPRs)
    spill_bytes: int  # CUDA local memory / AMD scratch; > 0 means registers spilled
    matrix_instructions: int  # tensor-core (mma / wgmma) or MFMA instructions in the binary
    matrix_operands: list[str]  # their operand types: "bf16", "f16", "fp8", "i8", "tf32", "f32"
    programs_per_sm: int  # resident programs (blocks) per SM / CU by registers, shared memory, threads
    async_copy_depth: int | None  # CUDA: most cp.async groups left in flight at a wait (0: single-buffered); AMD: None
    grid: tuple[int, int, int] | None


# -- the compile-only driver ----------------------------------------------------------------


_OPERAND_NAMES = {"bf16": "bf16", "f16": "f16", "e4m3": "fp8", "e5m2": "fp8", "fp8": "fp8", "bf8": "fp8",
                  "f8f6f4": "fp8",  # gfx950's MFMA for 8/6/4-bit floats; only fp8 operands are fed here
                  "s8": "i8", "i8": "i8", "tf32": "tf32", "xf32": "tf32", "f32": "f32"}


def _matrix_operands(instructions: list[str], backend: str) -> list[str]:
    """Operand types of mma/wgmma (``...m16n8k16.row.col.f32.bf16.bf16.f32``: accumulator
    first, then A and B) or MFMA (``v_mfma_f32_32x32x8_bf16``: types after the shape)."""
    found = set()
    for ins in instructions:
        if backend == "cuda":
            shape = re.search(r"\.m\d+n\d+k\d+\.", ins)
            parts = [p for p in ins[shape.end():].split(".") if p in _OPERAND_NAMES]
            found.update(_OPERAND_NAMES[p] for p in parts[1:3])  # skip the accumulator
        else:
            parts = ins.split("_")
            shape = next(i for i, p in enumerate(parts) if re.fullmatch(r"\d+x\d+x\d+", p))
            found.update(_OPERAND_NAMES[p] for p in parts[shape + 1:] if p in _OPERAND_NAMES)
    return sorted(found)


def _cuda_warps_by_registers(registers: int) -> int:
    """Warps one SM's 64K registers hold: registers are allocated per warp in units of 256."""
    return 65536 // (-(-registers * 32 // 256) * 256)


def _programs_per_sm(target: GpuTarget, *, registers: int, num_warps: int, shared: int,
                     waves_per_simd: int | None) -> int:
    """How many programs of a kernel one SM (CU) holds at once: the occupancy calculator's
    arithmetic for NVIDIA (registers allocated per warp in units of 256, 1 KB of shared
    memory reserved per block); on AMD the compiler's own waves-per-SIMD figure (registers)
    over the CU's 4 SIMDs, and the CU's LDS."""
    if target.backend == "cuda":
        by_regs = _cuda_warps_by_registers(registers) // num_warps
        by_shared = target.shared_per_sm // (shared + 1024)
        by_threads = target.max_threads_per_sm // (32 * num_warps)
        return min(by_regs, by_shared, by_threads, target.max_blocks_per_sm)
    by_regs = 4 * (waves_per_simd or 0) // num_warps
    return min(by_regs, target.shared_per_sm // shared) if shared else by_regs


def _async_copy_depth(target: GpuTarget, asm: dict[str, Any]) -> int | None:
    """How far a pipelined loop's copies run ahead: the largest N of ``cp.async.wait_group N``
    (wait until at most N groups are pending). 0 means every wait drains all copies, so the
    loop is single-buffered (no copy overlaps the compute that follows its wait)."""
    if target.backend != "cuda":
        return None
    return max((int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", asm["ptx"])), default=0)


def _resource_usage(target: GpuTarget, asm: dict[str, Any], name: str) -> tuple[int, int, list[str], int | None]:
    """(registers per thread, spill bytes, matrix instruction names, AMD waves per SIMD) of a
    compiled kernel."""
    if target.backend == "cuda":
        import triton

        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(asm["cubin"])
            f.flush()
            text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                  check=True).stdout
        usage = re.search(rf"Function {re.escape(name)}:\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
        assert usage, f"no resource usage for {name} in:\n{text}"
        regs, stack, local = (int(g) for g in usage.groups())
        mma = re.findall(r"\b((?:mma\.sync|wgmma\.mma_async)\.[\w.]+)", asm["ptx"])
        return regs, stack + local, mma, None
    gcn = asm["amdgcn"]
    vgprs = int(re.search(r"\.vgpr_count:\s+(\d+)", gcn).group(1))
    scratch = int(re.search(r"; ScratchSize: (\d+)", gcn).group(1))  # VGPR spills go to scratch memory
    mfma = re.findall(r"^\s*(v_mfma\w+)", gcn, flags=re.M)
    waves = int(re.search(r"; Occupancy: (\d+)", gcn).group(1))  # per SIMD, from registers
    return vgprs, scratch, mfma, waves  # (SGPR spills go to VGPR lanes, not memory: not counted)


class _CompileOnlyDriver:
    """Enough of a Triton driver for ``kernel[grid](...)`` to compile for ``target`` and stop."""

    def __init__(self, target: GpuTarget, builds: list[KernelBuild]) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = target
        self.triton_target = GPUTarget(target.backend, target.arch, target.warp_size)
        self.builds = builds
        self.case = ""
        self.utils = self  # triton asks driver.utils for device properties and binary loading

    # driver interface
    def get_current_target(self):
        return self.triton_target

    def get_current_device(self) -> int:
        # one device id per target: Triton keeps a kernel's compiled binaries per device id
        return list(TARGETS).index(self.target.name)

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_benchmarker(self):
        raise RuntimeError("the compile-only driver cannot time kernels")

    # utils interface
    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": self.target.max_shared_bytes}  # all Triton reads before a launch

    def load_binary(self, name, kernel, shared, device):
        # (module, function, n_regs, n_spills, n_max_threads), as the real drivers return, so
        # Triton's own "threads" check sees the register file's limit on the block size
        build = next(b for b in reversed(self.builds) if b.kernel == name)
        if self.target.backend == "cuda":
            max_threads = min(1024, _cuda_warps_by_registers(build.registers) * 32)
        else:  # CDNA: 512 VGPRs per lane on each of 4 SIMDs, allocated in units of 8
            per_wave = -(-build.registers // 8) * 8
            max_threads = min(1024, 4 * (512 // per_wave) * 64)
        return None, name, build.registers, build.spill_bytes, max_threads

    def launcher_cls(self, src, metadata) -> Callable[..., None]:
        kernel_name = metadata.name

        def launch(grid_0, grid_1, grid_2, *args: Any) -> None:
            for build in reversed(self.builds):
                if build.kernel == kernel_name and build.case == self.case and build.grid is None:
                    build.grid = (grid_0, grid_1, grid_2)
                    break

        return launch


@contextlib.contextmanager
def compile_only(target: GpuTarget) -> Iterator[_CompileOnlyDriver]:
    """Make Triton compile for ``target`` and record every build; launches do nothing."""
    from triton import knobs
    from triton.runtime import driver as triton_driver

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_check needs real @triton.jit kernels: run it without TRITON_INTERPRET=1")
    builds: list[KernelBuild] = []
    fake = _CompileOnlyDriver(target, builds)

    def record(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        kernel = fn.jit_function.device_caches[compile["device"]][0][key]
        regs, spills, mma, waves = _resource_usage(target, kernel.asm, kernel.name)
        meta = kernel.metadata
        builds.append(KernelBuild(
            case=fake.case, kernel=kernel.name, num_warps=meta.num_warps, num_stages=meta.num_stages,
            shared_bytes=meta.shared, registers=regs, spill_bytes=spills, matrix_instructions=len(mma),
            matrix_operands=_matrix_operands(mma, target.backend),
            programs_per_sm=_programs_per_sm(target, registers=regs, num_warps=meta.num_warps, shared=meta.shared,
                                             waves_per_simd=waves),
            async_copy_depth=_async_copy_depth(target, kernel.asm),
            grid=None,
        ))
        return None

    saved_hook = knobs.runtime.jit_post_compile_hook
    saved_driver = triton_driver._active  # None on a machine without a GPU: nothing to restore
    triton_driver.set_active(fake)
    knobs.runtime.jit_post_compile_hook = record
    try:
        yield fake
    finally:
        knobs.runtime.jit_post_compile_hook = saved_hook
        triton_driver._active = saved_driver


# -- the cases: real launchers, GPU shapes ----------------------------------------------------


def _attention_case(target: GpuTarget, *, dtype: str, head_size: int, qpk: int, block_size: int, decode: bool,
                    fp8_cache: bool = False, sliding_window: int | None = None, soft_cap: float | None = None,
                    num_splits: int = 1) -> None:
    """One step of the triton_paged backend: the KV write, then unified attention (+ split reduce)."""
    import torch

    from halserve.attention_backends import triton_paged_kernels as K

    num_kv_heads, num_reqs = 2, 4
    q_len = 1 if decode else 48
    seq_len = 1000
    num_tokens = num_reqs * q_len
    dt = getattr(torch, dtype)
    cache_dt = getattr(torch, target.fp8_dtype) if fp8_cache else dt
    blocks_per_req = -(-seq_len // block_size)
    num_blocks = num_reqs * blocks_per_req
    q = torch.empty(num_tokens, num_kv_heads * qpk, head_size, dtype=dt)
    k = torch.empty(num_tokens, num_kv_heads, head_size, dtype=dt)
    v = torch.empty_like(k)
    cache = torch.empty(2, num_blocks, block_size, num_kv_heads, head_size, dtype=cache_dt)
    slots = torch.zeros(num_tokens, dtype=torch.int64)
    block_table = torch.arange(num_blocks, dtype=torch.int32).reshape(num_reqs, blocks_per_req)
    seq_lens = torch.full((num_reqs,), seq_len, dtype=torch.int32)
    query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32) * q_len
    K.write_kv_cache(k, v, cache[0], cache[1], slots, 0.5, 0.5)
    K.paged_attention(
        torch.empty_like(q), q, cache[0], cache[1], block_table, seq_lens, query_start_loc,
        num_reqs=num_reqs, max_query_len=q_len, scale=head_size ** -0.5, sliding_window=sliding_window,
        logits_soft_cap=soft_cap, k_scale=0.5, v_scale=0.5, num_splits=num_splits,
    )


def _gemm_case(target: GpuTarget, *, kind: str, m: int, dtype: str = "bfloat16", group: int = 128) -> None:
    """A Llama-3-8B-sized projection (N=K=4096) through the registered GEMM kernel classes
    (``group``: the 4-bit GEMMs' group size, -1 per channel)."""
    import torch

    n = k = 4096
    out_dt = getattr(torch, dtype)
    if kind in ("fp8", "int8"):
        from halserve.platforms.triton_kernels.fp8_gemm import TritonFp8ScaledGemm
        from halserve.platforms.triton_kernels.int8_gemm import TritonInt8ScaledGemm

        qdt = torch.int8 if kind == "int8" else getattr(torch, target.fp8_dtype or "float8_e4m3fn")
        gemm = TritonInt8ScaledGemm() if kind == "int8" else TritonFp8ScaledGemm(upcast=not target.has_fp8_dot)
        a, b = torch.empty(m, k, dtype=qdt), torch.empty(n, k, dtype=qdt)
        gemm(a, b, torch.ones(m, 1), torch.ones(n, 1), out_dt, bias=torch.empty(n, dtype=out_dt))
        return
    from halserve.platforms.triton_kernels.wo4_gemm import TritonAwqGemm, TritonGptqGemm

    x = torch.empty(m, k, dtype=out_dt)
    groups = 1 if group == -1 else k // group
    scales = torch.empty(groups, n, dtype=out_dt)
    qzeros = torch.empty(groups, n // 8, dtype=torch.int32)
    if kind == "awq":
        TritonAwqGemm()(x, torch.empty(k, n // 8, dtype=torch.int32), qzeros, scales, group)
    else:
        g_idx = torch.arange(k, dtype=torch.int32) // (k if group == -1 else group)
        TritonGptqGemm()(x, torch.empty(k // 8, n, dtype=torch.int32), qzeros, scales,
                         g_idx if kind == "gptq_act_order" else None, group)


def _elementwise_case(target: GpuTarget, *, kind: str, dtype: str = "bfloat16", hidden: int = 4096,
                      head: int = 128) -> None:
    """The elementwise kernels at Llama-3-8B sizes (``hidden``: model width; the MLP's
    intermediate size is 3.5x; ``head``: rotary head size)."""
    import torch

    from halserve.platforms.triton_kernels.jit import activation, quant, rms_norm, rotary

    dt = getattr(torch, dtype)
    tokens = 64
    if kind == "rms_norm":
        x = torch.empty(tokens, hidden, dtype=dt)
        rms_norm.rms_norm(x, torch.empty(hidden, dtype=dt), 1e-6)
        rms_norm.rms_norm(x, torch.empty(hidden, dtype=dt), 1e-6, residual=torch.empty_like(x))
    elif kind in ("rotary_neox", "rotary_gptj"):
        rotary.rotary_embedding(torch.zeros(tokens, dtype=torch.int64), torch.empty(tokens, 32 * head, dtype=dt),
                                torch.empty(tokens, 8 * head, dtype=dt), torch.empty(4096, head, dtype=torch.float32),
                                head, kind == "rotary_neox")
    elif kind == "silu_and_mul":
        activation.silu_and_mul(torch.empty(tokens, 2 * (hidden * 7 // 2), dtype=dt))
    elif kind == "quant":
        x = torch.empty(tokens, hidden, dtype=dt)
        for qdt in filter(None, (target.fp8_dtype, "int8")):
            quant.quantize(x, getattr(torch, qdt), None, per_token=True)
            quant.quantize(x, getattr(torch, qdt), None, per_token=False)
            quant.quantize(x, getattr(torch, qdt), torch.ones(1), per_token=False)
    else:
        raise ValueError(f"unknown elementwise case {kind!r}")


def cases(target: GpuTarget) -> dict[str, Callable[[], None]]:
    """Every kernel on the configurations the plugins declare, in GPU shapes, for ``target``."""
    out: dict[str, Callable[[], None]] = {}

    def attn(name: str, **kw: Any) -> None:
        out[f"attention/{name}"] = lambda: _attention_case(target, **kw)

    for head_size in (64, 80, 96, 128, 256):
        for decode in (True, False):
            attn(f"{'decode' if decode else 'prefill'}-bf16-h{head_size}-gqa4-bs16", dtype="bfloat16",
                 head_size=head_size, qpk=4, block_size=16, decode=decode)
    for dtype, qpk, bs in (("float16", 1, 32), ("float32", 8, 64)):
        for decode in (True, False):
            attn(f"{'decode' if decode else 'prefill'}-{dtype}-h128-gqa{qpk}-bs{bs}", dtype=dtype, head_size=128,
                 qpk=qpk, block_size=bs, decode=decode)
    for decode in (True, False):
        attn(f"{'decode' if decode else 'prefill'}-bf16-h128-gqa7-bs32", dtype="bfloat16", head_size=128, qpk=7,
             block_size=32, decode=decode)
        attn(f"{'decode' if decode else 'prefill'}-bf16-h256-gqa2-window-softcap", dtype="bfloat16", head_size=256,
             qpk=2, block_size=16, decode=decode, sliding_window=256, soft_cap=50.0)
        if target.fp8_dtype:
            attn(f"{'decode' if decode else 'prefill'}-bf16-h128-gqa4-fp8cache", dtype="bfloat16", head_size=128,
                 qpk=4, block_size=16, decode=decode, fp8_cache=True)
    attn("decode-bf16-h128-gqa4-split8", dtype="bfloat16", head_size=128, qpk=4, block_size=16, decode=True,
         num_splits=8)
    # the widest fp32 tiles (FMA dots hold their operands in registers)
    attn("decode-float32-h256-gqa8-split2", dtype="float32", head_size=256, qpk=8, block_size=16, decode=True,
         num_splits=2)
    attn("prefill-float32-h256-gqa8", dtype="float32", head_size=256, qpk=8, block_size=16, decode=False)
    for kind in ("fp8", "int8", "awq", "gptq", "gptq_act_order"):
        for m in (1, 32, 64, 512):  # every M bucket of gemm_tiles
            out[f"gemm/{kind}-m{m}"] = lambda kind=kind, m=m: _gemm_case(target, kind=kind, m=m)
    out["gemm/awq-m64-fp16"] = lambda: _gemm_case(target, kind="awq", m=64, dtype="float16")
    for kind in ("awq", "gptq_act_order"):  # fp32 activations: FMA dots, their own tiles
        out[f"gemm/{kind}-m512-float32"] = lambda kind=kind: _gemm_case(target, kind=kind, m=512, dtype="float32")
    for kind in ("rms_norm", "rotary_neox", "rotary_gptj", "silu_and_mul", "quant"):
        out[f"elementwise/{kind}"] = lambda kind=kind: _elementwise_case(target, kind=kind)
    return out


def sweep_cases(target: GpuTarget) -> dict[str, Callable[[], None]]:
    """Every configuration the kernels declare, crossed. Attention: head sizes x dtypes x GQA
    ratios (1, 4, 8, 32) x decode (single pass, split) / prefill x model-dtype / fp8 cache.
    GEMMs: every M bucket x output dtype, and the 4-bit GEMMs' group sizes (32, 128, per
    channel). RMSNorm, SiLU-and-mul and quantization at model widths 2048-16384, rotary at
    head sizes 64-256, in every dtype. About 500 cases, minutes per target: a developer's
    check (``--sweep``), not the suite's."""
    out: dict[str, Callable[[], None]] = {}
    for kind, m, dtype in itertools.product(("fp8", "int8", "awq", "gptq", "gptq_act_order"), (1, 32, 64, 512),
                                            ("float16", "bfloat16", "float32")):
        for group in (32, 128, -1) if kind in ("awq", "gptq", "gptq_act_order") else (128,):
            name = f"sweep/gemm-{kind}-m{m}-{dtype}" + (f"-g{group}" if kind not in ("fp8", "int8") else "")
            out[name] = lambda kw=dict(kind=kind, m=m, dtype=dtype, group=group): _gemm_case(target, **kw)
    fp8_choices = (False, True) if target.fp8_dtype else (False,)
    for head_size, dtype, qpk, step in itertools.product(
        (64, 80, 96, 128, 256), ("float16", "bfloat16", "float32"), (1, 4, 8, 32), ("decode", "split4", "prefill")
    ):
        for fp8 in fp8_choices if dtype != "float32" else (False,):
            kw = dict(dtype=dtype, head_size=head_size, qpk=qpk, block_size=16, decode=step != "prefill",
                      fp8_cache=fp8, num_splits=4 if step == "split4" else 1)
            name = f"sweep/attention-{step}-{dtype}-h{head_size}-gqa{qpk}{'-fp8cache' if fp8 else ''}"
            out[name] = lambda kw=kw: _attention_case(target, **kw)
    for kind, dtype, hidden in itertools.product(("rms_norm", "silu_and_mul", "quant"), ("float16", "bfloat16", "float32"),
                                                 (2048, 5120, 7168, 8192, 16384)):  # 1B .. 405B-class widths
        out[f"sweep/{kind}-{dtype}-hidden{hidden}"] = lambda kw=dict(kind=kind, dtype=dtype, hidden=hidden): \
            _elementwise_case(target, **kw)
    for kind, dtype, head in itertools.product(("rotary_neox", "rotary_gptj"), ("float16", "bfloat16", "float32"),
                                               (64, 128, 256)):
        out[f"sweep/{kind}-{dtype}-head{head}"] = lambda kw=dict(kind=kind, dtype=dtype, head=head): \
            _elementwise_case(target, **kw)
    return out


def check(target_name: str, only: str | None = None, sweep: bool = False) -> tuple[list[KernelBuild], dict[str, str]]:
    """Compile every case for the target: (builds, {case: error}) -- an empty dict means all compiled.
    ``sweep``: every configuration crossed (``sweep_cases``) instead of the cases."""
    if target_name not in TARGETS:
        raise ValueError(f"unknown target {target_name!r}; choose one of {', '.join(TARGETS)}")
    target = TARGETS[target_name]
    errors: dict[str, str] = {}
    with compile_only(target) as driver:
        for name, run in (sweep_cases(target) if sweep else cases(target)).items():
            if only and only not in name:
                continue
            driver.case = name
            try:
                run()
            except Exception as e:  # report every failing case, not just the first
                errors[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        return driver.builds, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=list(TARGETS), default="sm_90")
    parser.add_argument("--only", help="only cases whose name contains this")
    parser.add_argument("--sweep", action="store_true",
                        help="every declared configuration, crossed (~430 builds, minutes)")
    parser.add_argument("--json", action="store_true", help="print builds and errors as JSON")
    args = parser.parse_args(argv)
    builds, errors = check(args.target, args.only, args.sweep)
    if args.json:
        print(json.dumps({"target": dataclasses.asdict(TARGETS[args.target]),
                          "cases": [c for c in (sweep_cases if args.sweep else cases)(TARGETS[args.target])
                                    if not args.only or args.only in c],
                          "builds": [dataclasses.asdict(b) for b in builds], "errors": errors}))
    else:
        t = TARGETS[args.target]
        print(f"{t.name} ({t.gpu}), shared memory limit {t.max_shared_bytes} B")
        print(f"{'case':50} {'kernel':26} {'warps':>5} {'stages':>6} {'shared':>7} {'regs':>4} {'spill':>5} "
              f"{'per SM':>6} {'async':>5} {'mma':>4} operands")
        for b in builds:
            depth = "-" if b.async_copy_depth is None else b.async_copy_depth
            print(f"{b.case:50} {b.kernel:26} {b.num_warps:5} {b.num_stages:6} {b.shared_bytes:7} {b.registers:4} "
                  f"{b.spill_bytes:5} {b.programs_per_sm:6} {depth:>5} {b.matrix_instructions:4} "
                  f"{','.join(b.matrix_operands)}")
        for name, err in errors.items():
            print(f"FAILED {name}: {err}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
