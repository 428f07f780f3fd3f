"""The cpu platform's ``gguf_gemm`` for Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K blocks, in C++ (``gguf_gemm.cpp``), as llama.cpp
computes them on CPUs: the activations quantized to int8 per block of 32, integer dot products against the
weight's blocks, the scales applied once per block.

The integer path runs on a repacked copy of the weight (``gguf_repack``, made at the first call and kept on
the GGUF tensor, which stays the source of truth: a new tensor or one written in place is repacked again):
groups of 16 output rows whose values sit four bytes per row side by side, so one register of weights meets
four activation bytes broadcast and gives 16 outputs' partial sums (llama.cpp's Q4_0x8 repacking, for every
type), and a tile of up to 8 (AVX-512) or 4 (AVX2) activation rows shares each weight register. Its memory,
held beside the GGUF bytes: Q4_0 4.5 bits per value, Q4_1 5, Q8_0 8.5 (the file's own sizes: float16 scales,
Q4_0's and Q8_0's offsets computed), Q4_K 4 + 2, Q5_K 8 + 2, Q6_K 8 + 4 (float32 scales and offsets); SmolLM2-135M
Q4_0: 60 MB of layers and 30 MB for its Q8_0 head. A one-row decode step reads all of it, so its size is the
step's memory traffic (float32 scales had cost 1.3x the bytes and ~1.3x the time of a forward's GEMVs).

    M < TWO_LEVEL_MIN_ROWS, or any M       gguf_gemm_packed, one int8 level: AVX-512 VNNI (_mm512_dpbusd_epi32)
    in a decode step (one token each)      or AVX2 (_mm256_maddubs_epi16)
    TWO_LEVEL_MIN_ROWS <= M < panel rows   gguf_gemm_packed, two int8 levels: x ~ d q + d2 q2 (q2 the int8
                                           blocks of x's rounding error at d2 = d / 255), twice the integer work,
                                           ~255x less error; the tile sums the levels' integer dots as 255 dot1 +
                                           dot2 and scales once (gguf_blocks.two_level_activations: the reference)
    M >= PANEL_MIN_ROWS[isa]               the blocks dequantized to a float32 panel of PANEL_BYTES at a time,
                                           then the float GEMM (torch's, oneDNN/MKL); off by default: on this
                                           2-core Zen 4 the packed two-level path beat the panel at every M up
                                           to 512 (VNNI 1.7x at 512 rows, AVX2 forced 1.1x), so prefill stays
                                           integer too. Set it per path where a float GEMM is stronger.

Accuracy: the float path is the reference's (dequantize, matmul in float32). One int8 level is llama.cpp's
scheme (its Q8_0/Q8_1 activation blocks) and as accurate: on SmolLM2-135M's real prefill activations both give
a mean relative error of 7.2e-3 per GEMM against the exact dequantized matmul (Q4_0, Q4_1 and Q8_0 alike; the
Q4_1 min term through the block's sum of q, as Q8_1's s), two levels 2.8e-5. That is enough for a near tie
to flip: SmolLM2's first answer token to "What is the capital of France?" is one (exact log-probs -1.883 "The"
vs -1.965 "L"), and prefilling its 37-token prompt with one int8 level, ours or a faithful model of
llama.cpp's, answers "L'Étoile, ..." where the float and two-level paths answer Paris. So prompts of 16
tokens or more never take one level. Decode rows always do (a decode step, every request one token, whatever
the number of requests; before, 16 or more streams took two), as a single stream's always did and llama.cpp's
do: one request's tokens then come from the same arithmetic alone or among 64, and batched decode does half
the integer work; the LM head keeps its two levels (``min_activation_levels``). The integer path is checked
against a reference that rounds the activations the same way (``gguf_blocks.quantize_activations_q8``, float
summation order apart) and loosely against the float reference (tests/platforms/test_cpu_native_gguf.py).

``gguf_gemv`` (the same integer arithmetic on the GGUF rows as stored, up to 4 activation rows per pass) is
kept as an op: the packed path's cross-check in the tests. ``HALSERVE_GGUF_ACTIVATION_LEVELS=1`` takes one level
everywhere (llama.cpp's arithmetic; ``forced_levels``). ``HALSERVE_GGUF_ISA=avx2`` (or ``avx512_vnni``)
forces an instruction path; by default the best this CPU runs. ``load_gguf_ops()`` builds ``gguf_gemm.cpp``
as its own small extension (``torch.ops.halserve_cpu_gguf``) the first time a GGUF model needs it, apart from
the platform's main one.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref

import torch
import torch.nn.functional as F

from halserve.forward_context import in_decode_step
from halserve.kernels.base import Kernel
from halserve.platforms.cpu_kernels.panel import cpu_flags

logger = logging.getLogger(__name__)

QTYPE_CODES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}  # gguf_gemm.cpp's qtype argument
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # super-blocks of 256; their panel dequantizes in torch (gguf_blocks)
ISA_CODES = {"avx2": 1, "avx512_vnni": 2}  # its isa argument
TWO_LEVEL_MIN_ROWS = 16  # from this many activation rows on, two int8 levels (prompts keep their answers), except
# in a decode step (every request one token: forward_context.in_decode_step()), whose rows take one level however
# many: each row is one request's token, as a single stream's, so a request's decode arithmetic does not depend on
# how many others share its step, and 16-64-stream decode does half the integer work
# from this many on, dequantize to a float panel and use the float GEMM, per instruction path (measured on
# SmolLM2's GEMMs, benchmarks/kernels/cpu_gguf_gemm.py: the VNNI integer path beats the panel at 512 rows)
PANEL_MIN_ROWS = {"avx2": 1 << 30, "avx512_vnni": 1 << 30}  # never by default: the packed path won at every M
_PACKED_ATTR = "_halserve_gguf_packed"  # the repacked copy's attribute on the GGUF weight tensor
_ABS_ATTR = "_halserve_gguf_abs_block_sums"  # its |w| per block of 32 (argmax_logits' bound), likewise
PANEL_BYTES = 8 << 20  # float32 panel size (output rows x K) per GEMM call
# argmax_logits' path from this many rows: below, the two-level head is one memory pass over the weight as the
# one-level one is (1 row: 0.65 ms two levels, 0.83 through the argmax path; 16 rows 5.0 -> 3.8 ms, 64: 15.8 -> 11.7;
# SmolLM2's 49152 x 576 Q8_0 head, this file's machine)
ARGMAX_MIN_ROWS = 8
ARGMAX_HEAD_ENV = "HALSERVE_GGUF_ARGMAX_HEAD"  # 0: argmax-only rows take the plain (two-level) head too

_lock = threading.Lock()
_loaded = False
_load_error: str | None = None


def load_gguf_ops() -> str | None:
    """Build gguf_gemm.cpp once per machine (cached by ``build.py``), registering ``torch.ops.halserve_cpu_gguf``;
    None when its ops are there, else why not (logged once)."""
    global _loaded, _load_error
    with _lock:
        if _loaded or _load_error is not None:
            return _load_error
        from halserve.platforms.cpu_kernels import toolchain_missing

        _load_error = toolchain_missing()
        if _load_error is None:
            try:
                from halserve.platforms.cpu_kernels.build import HERE, build_and_load

                started = time.monotonic()
                build_and_load("halserve_cpu_gguf_gemm", [os.path.join(HERE, "gguf_gemm.cpp")], is_python_module=False)
                logger.debug("gguf_gemm.cpp ready in %.1f s", time.monotonic() - started)
                _loaded = True
            except Exception as exc:  # noqa: BLE001 - the kernel declines, loudly; the torch reference serves
                _load_error = f"building gguf_gemm.cpp failed: {type(exc).__name__}: {exc}"
                logger.warning(_load_error)
    return _load_error


LEVELS_ENV = "HALSERVE_GGUF_ACTIVATION_LEVELS"


def forced_levels() -> int | None:
    """``HALSERVE_GGUF_ACTIVATION_LEVELS``: 1 runs every GEMM (prompts and the LM head too) with one int8
    level, llama.cpp's arithmetic: prompts cost half the integer work, and answers follow that arithmetic
    (SmolLM2's Paris prompt then answers "L'Étoile", as a model of llama.cpp's does); 2 runs every GEMM
    with two. Unset: the rules above (``activation_levels``)."""
    value = os.environ.get(LEVELS_ENV, "").strip()
    if not value:
        return None
    if value not in ("1", "2"):
        raise ValueError(f"{LEVELS_ENV}={value!r}: use 1 (llama.cpp's one int8 level everywhere), 2 (two levels "
                         f"everywhere) or leave it unset (two for prompts and the LM head, one for decode rows)")
    return int(value)


def cpu_isa() -> str | None:
    """The instruction path to use: ``HALSERVE_GGUF_ISA`` if set, else the best this CPU has (None: neither)."""
    forced = os.environ.get("HALSERVE_GGUF_ISA")
    if forced:
        if forced not in ISA_CODES:
            raise ValueError(f"HALSERVE_GGUF_ISA={forced!r}: use one of {', '.join(ISA_CODES)}")
        return forced
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= flags:
        return "avx512_vnni"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return None


def _kept_on(qweight: torch.Tensor, attr: str, key: tuple, make) -> torch.Tensor:
    """What ``make()`` derives from ``qweight``, kept on the tensor under ``attr`` with ``key`` (its data, shape,
    version and the derivation's settings) and made again when the key changes; the old copy goes before the new
    one is made (peak memory)."""
    cached = getattr(qweight, attr, None)
    if cached is None or cached[0] != key:
        if cached is not None:
            setattr(qweight, attr, None)
        cached = (key, make())
        setattr(qweight, attr, cached)
    return cached[1]


class NativeGgufGemm(Kernel):
    op = "gguf_gemm"
    name = "cpu_native"
    platforms = ("cpu",)
    priority = 30
    description = ("C++ Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K: int8 activations per block of 32 and integer dot products "
                   "(AVX-512 VNNI or AVX2) on weights repacked 16 rows at a time (two int8 levels from 16 rows)")

    @classmethod
    def capabilities(cls) -> dict:
        return {"qtypes": list(QTYPE_CODES), "isa": cpu_isa() or "none"}

    @classmethod
    def _supports(cls, **problem) -> str | None:
        qtype = problem.get("qtype")
        if qtype is not None and qtype not in QTYPE_CODES:
            return f"the native GGUF kernel covers {', '.join(QTYPE_CODES)}, not {qtype}"
        k = problem.get("k")
        block = 256 if qtype in K_TYPES else 32
        if k is not None and k % block:
            return f"K = {k} is not a whole number of {block}-value blocks"
        isa = cpu_isa()
        if isa is None:
            return "the native GGUF kernel needs AVX2 with FMA and F16C (this CPU's /proc/cpuinfo flags lack them)"
        error = load_gguf_ops()
        if error is not None:
            return error
        if not torch.ops.halserve_cpu_gguf.gguf_isa_supported(ISA_CODES[isa]):
            return f"HALSERVE_GGUF_ISA={isa}, which this CPU does not run"
        return None

    # (optional) at least this many int8 activation levels for few rows; the LM head sets 2 (halserve.layers.vocab):
    # its logits pick the token, and SmolLM2's first answer token to its Paris prompt is a near tie that one
    # level flips. At one decode row two levels are one pass over the weight too (0.83 -> 1.16 ms, 49152 x 576 Q8_0)
    min_activation_levels = 1
    # (optional) keep the float32 panel of the whole weight between calls for M >= PANEL_MIN_ROWS (the panel path,
    # off by default since the repacked integer path: this matters only where PANEL_MIN_ROWS is set); the LM head
    # sets it (halserve.layers.vocab). Its panel is N x K floats dequantized per call, each decode step at 32+
    # streams (SmolLM2's 49152 x 576 head: 113 MB written and read per step, which put 64-stream decode below
    # the float32 head's). Costs N x K x 4 bytes of memory from the first such call (113 MB for SmolLM2), none
    # where the head never sees 32 rows; refreshed when the blocks change (another tensor, or written in place).
    cache_panel = False

    def __init__(self, isa: str | None = None) -> None:
        reason = self._supports()
        if reason is not None:
            raise RuntimeError(f"the native GGUF kernel cannot run here: {reason}")
        self.isa = isa or cpu_isa()
        self.isa_code = ISA_CODES[self.isa]
        self.ops = torch.ops.halserve_cpu_gguf
        self.forced_levels = forced_levels()
        self.argmax_head = os.environ.get(ARGMAX_HEAD_ENV, "").strip() != "0"

    def dequantize(self, qweight: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
        """``uint8 [N, row bytes]`` -> float32 ``[N, k]`` (the panel path's first half, also for tests)."""
        if qtype in K_TYPES:
            from halserve.kernels.gguf_blocks import dequantize

            return dequantize(qweight, qtype, k)
        return self.ops.gguf_dequantize(qweight, QTYPE_CODES[qtype], k)

    def packed(self, qweight: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
        """The repacked copy of ``qweight`` for this instruction path, made once and kept on the tensor (it goes
        with it); made again when the blocks change (written in place) or another path asks."""
        key = (self.isa_code, qtype, k, qweight.data_ptr(), tuple(qweight.shape), qweight._version)
        return _kept_on(qweight, _PACKED_ATTR, key,
                        lambda: self.ops.gguf_repack(qweight, QTYPE_CODES[qtype], k, self.isa_code))

    def abs_block_sums(self, qweight: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
        """float32 ``[ceil(N / 16), k / 32, 16]``: the sum of |w| over each block of 32 of each row
        (``argmax_logits``' bound), grouped 16 rows at a time as the repacked copy is (zero past N); made once
        (dequantized a slice of rows at a time) and kept on the tensor as the repacked copy is."""
        def make() -> torch.Tensor:
            n = qweight.shape[0]
            groups = (n + 15) // 16
            sums = torch.zeros(groups * 16, k // 32, dtype=torch.float32)
            rows = max(16, PANEL_BYTES // (4 * k)) // 16 * 16
            for n0 in range(0, n, rows):
                w = self.dequantize(qweight[n0:n0 + rows], qtype, k)  # [rows, k]
                sums[n0:n0 + w.shape[0]] = w.abs_().view(w.shape[0], k // 32, 32).sum(-1)
            return sums.view(groups, 16, k // 32).transpose(1, 2).contiguous()

        key = (qtype, k, qweight.data_ptr(), tuple(qweight.shape), qweight._version)
        return _kept_on(qweight, _ABS_ATTR, key, make)

    def argmax_logits(self, x: torch.Tensor, qweight: torch.Tensor, qtype: str) -> torch.Tensor:
        """``self(x, qweight, qtype)`` for rows whose logits only feed an argmax (greedy sampling without
        logprobs, penalties or masks; ``halserve.layers.vocab``): one int8 level, and the groups of outputs that
        could hold the row's maximum recomputed at two (``gguf_gemm_packed_argmax``), so each row's first
        maximum is the two-level call's token with its exact logit; the other logits are one level's. Fewer
        than ``ARGMAX_MIN_ROWS`` rows, rows that would take the float panel, or one level anyway
        (``HALSERVE_GGUF_ACTIVATION_LEVELS=1``) take ``__call__``; so does everything under
        ``HALSERVE_GGUF_ARGMAX_HEAD=0`` (to compare; read when the kernel is made)."""
        m, k = x.shape
        if (not self.argmax_head or m < ARGMAX_MIN_ROWS or m >= PANEL_MIN_ROWS[self.isa] or x.dtype != torch.float32
                or self.activation_levels(m) == 1):
            return self(x, qweight, qtype)
        return self.ops.gguf_gemm_packed_argmax(x, self.packed(qweight, qtype, k), QTYPE_CODES[qtype],
                                                qweight.shape[0], k, self.isa_code,
                                                self.abs_block_sums(qweight, qtype, k))

    def activation_levels(self, m: int) -> int:
        """int8 levels for ``m`` activation rows on the packed path: one below ``TWO_LEVEL_MIN_ROWS`` rows or in a
        decode step, else two; at least ``min_activation_levels``; ``HALSERVE_GGUF_ACTIVATION_LEVELS`` overrides."""
        if self.forced_levels is not None:
            return self.forced_levels
        return max(self.min_activation_levels, 1 if m < TWO_LEVEL_MIN_ROWS or in_decode_step() else 2)

    def bind(self, qweight: torch.Tensor, qtype: str, bias: torch.Tensor | None = None):
        """``x -> self(x, qweight, qtype, bias)`` with the per-call bookkeeping done once, for a caller that
        multiplies by one weight step after step (the cpu flat forward, models/llama_flat.py): a float32 ``x``
        of fewer than ``PANEL_MIN_ROWS`` rows goes straight to ``gguf_gemm_packed`` while the weight's repacked
        copy is the one bound (the same tensor, not written in place since); anything else takes ``__call__``.
        The same op, arguments and numbers as ``__call__``."""
        gemm_packed, code, n, isa_code = self.ops.gguf_gemm_packed, QTYPE_CODES[qtype], qweight.shape[0], self.isa_code
        panel_min, levels_for = PANEL_MIN_ROWS[self.isa], self.activation_levels
        float32 = torch.float32
        bound: list = [None, -1, -1]  # [the repacked copy's entry on the tensor, the tensor's version, data_ptr then]

        def call(x: torch.Tensor) -> torch.Tensor:
            m, k = x.shape
            if m >= panel_min or x.dtype is not float32:
                return self(x, qweight, qtype, bias)
            entry = getattr(qweight, _PACKED_ATTR, None)
            if (entry is None or entry is not bound[0] or qweight._version != bound[1]
                    or qweight.data_ptr() != bound[2]):
                self.packed(qweight, qtype, k)  # (makes or refreshes the copy; its key checks everything)
                entry = bound[0] = getattr(qweight, _PACKED_ATTR)
                bound[1], bound[2] = qweight._version, qweight.data_ptr()
            out = gemm_packed(x, entry[1], code, n, k, isa_code, levels_for(m))  # [M, N] float32
            return out if bias is None else out + bias.float()

        return call

    def _cached_panel(self, qweight: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
        key = (qweight.data_ptr(), tuple(qweight.shape), qweight._version, qtype, k)
        cached: tuple[tuple, torch.Tensor] | None = getattr(self, "_panel", None)
        owner = getattr(self, "_panel_owner", None)  # a weak reference: a new tensor at a freed one's address
        if cached is None or cached[0] != key or owner is None or owner() is not qweight:  # is not the same
            self._panel_owner = weakref.ref(qweight)
            self._panel = cached = None  # the old panel goes before the new one is made (peak memory)
            self._panel = cached = (key, self.dequantize(qweight, qtype, k))
        return cached[1]

    def __call__(self, x: torch.Tensor, qweight: torch.Tensor, qtype: str, bias: torch.Tensor | None = None):
        m, k = x.shape
        code = QTYPE_CODES[qtype]
        if m < PANEL_MIN_ROWS[self.isa]:
            out = self.ops.gguf_gemm_packed(x, self.packed(qweight, qtype, k), code, qweight.shape[0], k,
                                            self.isa_code, self.activation_levels(m))  # [M, N] float32
        elif self.cache_panel:
            out = F.linear(x.float(), self._cached_panel(qweight, qtype, k))
        else:
            xf = x.float()
            n = qweight.shape[0]
            rows = max(1, PANEL_BYTES // (4 * k))
            if rows >= n:
                out = F.linear(xf, self.dequantize(qweight, qtype, k))
            else:
                out = torch.empty(m, n, dtype=torch.float32)
                for n0 in range(0, n, rows):
                    panel = self.dequantize(qweight[n0:n0 + rows], qtype, k)  # [rows, K]
                    out[:, n0:n0 + rows] = F.linear(xf, panel)
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)
