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

    python -m halserve.platforms.triton_kernels.compile_check --target sm_90 [--json] [--sweep]

The cases (which launchers, which shapes) are in ``compile_cases.py``.

Needs triton (``pip install 'halserve[cuda]'``) and must run without ``TRITON_INTERPRET``
(kernels decorated under the interpreter cannot be compiled), so tests run it in a
subprocess. What it does not check: numerics on the GPU (the ``gpu`` tests do that).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from halserve.platforms.triton_kernels.compile_cases import cases, sweep_cases


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


FAKE_DEVICE_BASE = 1 << 20
"""Device ids of the compile-only targets start here, far above any real device index."""


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
        # One device id per target: Triton keeps a kernel's compiled binaries (and its target)
        # per device id, so these ids must never be a real GPU's. Under id 0, a process with
        # an H100 would afterwards launch the sm_90 stand-ins (which launch nothing) on its real
        # device 0, and the check would find the real device's binaries instead of compiling.
        return FAKE_DEVICE_BASE + list(TARGETS).index(self.target.name)

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
