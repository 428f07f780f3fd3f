"""4-bit weight-only GEMMs (AWQ, GPTQ v1) on IPEX's weight-only-quantization (WOQ) linear.

The XPU plugin registers these for ``xpu`` and, like the IPEX attention backend, for
``cpu``: IPEX's CPU build implements the same API with the same packed inputs. The API is
``ipex.llm.quantization.IPEXWeightOnlyQuantizedLinear.from_weight(qweight, scales, qzeros,
in_features, out_features, qconfig, group_size=, g_idx=, quant_method=AWQ_GEMM|GPTQ_GEMM)``,
which takes the checkpoints' packed int32 tensors as they are and repacks them once into
IPEX's blocked layout. ``prepare_weight`` does that once per layer at load; the object it
returns (``IpexWoqWeight``) then takes ``qweight``'s place in every call.

What IPEX 2.8 (CPU) does with those inputs, measured, and what this module does about it:

- ``qconfig``: ``from_weight``'s default computes in bfloat16 even for float32 inputs
  (vLLM picks INT8, which quantizes the activations). We ask for ``lowp_mode=NONE``: the
  GEMM runs in the activation dtype, so results match the torch reference to that
  dtype's rounding (relative error ~1e-7 fp32, ~1e-3 fp16, ~1e-2 bf16).
- A weight with more than one group and N not a multiple of 32 gives wrong numbers (or
  a RuntimeError), and a per-channel one aborts the process on AMX machines ("N must be
  multiple of block_n", 2026-11-22): N is padded with zero columns to a multiple of 32 and
  the output is sliced back.
- ``group_size == K`` (one group) raises IndexError inside IPEX: passed as -1 instead.
- GPTQ v1 stores ``zero - 1``; IPEX adds the 1 back but wraps a stored 15 (zero 16) to
  zero 0, where the op (and AutoGPTQ's kernels) read 16. Such zeros are repacked as 8
  (stored 7, read the same by everyone) and the difference is subtracted after the GEMM:
  ``W = (q - 16) s = (q - 8) s - 8 s``, so ``out -= xsum @ (8 s [zero == 16])`` where
  ``xsum [M, K/G]`` sums x over each group (a [M, K/G] x [K/G, N] matmul, cheap).
- IPEX validates little: a wrong N or group size silently gives wrong numbers. Every
  shape, dtype and device is therefore checked here first, and a mistake is a
  ``ValueError`` naming the bad value.

IPEX is imported only inside ``prepare_weight`` (never at plugin discovery).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from halserve.kernels import packing
from halserve.kernels.base import Kernel

_FLOATS = ("float32", "float16", "bfloat16")
_N_ALIGN = 32  # grouped weights need N % 32 == 0 (measured, see above)
_GPTQ_WRAPPED_STORED_ZERO = 15  # stored zero - 1 = 15: zero 16, read by IPEX as 0
_GPTQ_SAFE_STORED_ZERO = 7  # zero 8
_GPTQ_ZERO_SHIFT = 8  # 16 - 8: what the correction subtracts, times the group's scale


def ipex_unavailable_reason() -> str | None:
    """Why IPEX cannot be used in this process, or None. Cheap: imports nothing.

    IPEX refuses to import (AttributeError from ``os.exit``) unless torch's major.minor
    equals its own, so a mismatch is a reason here rather than a failure at load.
    """
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        return "intel_extension_for_pytorch is not installed (pip install 'halserve[xpu]' with the XPU build of torch)"
    try:
        ipex_version = importlib.metadata.version("intel_extension_for_pytorch")
    except importlib.metadata.PackageNotFoundError:
        return None  # importable without metadata (a source checkout): let the import decide
    want, have = re.match(r"\d+\.\d+", ipex_version), re.match(r"\d+\.\d+", torch.__version__)
    if want and have and want.group() != have.group():
        return (
            f"intel_extension_for_pytorch {ipex_version} needs torch {want.group()}.*, "
            f"but this is torch {torch.__version__}"
        )
    return None


@dataclass(frozen=True, slots=True)
class IpexWoqWeight:
    """A 4-bit weight repacked by IPEX (what ``prepare_weight`` returns)."""

    linear: Any  # ipex.llm.quantization.IPEXWeightOnlyQuantizedLinear, out [M, n_padded]
    k: int  # input features
    n: int  # output features
    n_padded: int  # n rounded up for IPEX (== n unless padded)
    device: torch.device
    # GPTQ zero-16 correction (None when no zero is 16): out -= xsum @ correction
    correction: torch.Tensor | None  # [K/G, N] float32 = 8 * scales where zero == 16
    g_idx: torch.Tensor | None  # [K] int64, the group of each input row (act-order); None: k // G
    group_rows: int  # G (K when per-channel)


def _what(t: Any) -> str:
    return f"{t.dtype} tensor of shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_int32(name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D torch.int32 tensor of packed nibbles, got {_what(t)}")


def _check_shape(name: str, t: torch.Tensor, want: tuple[int, ...], layout: str) -> None:
    if tuple(t.shape) != want:
        raise ValueError(f"{name} has shape {list(t.shape)}, expected {list(want)} ({layout})")


def _check_scales(scales: Any) -> None:
    if not isinstance(scales, torch.Tensor) or not scales.dtype.is_floating_point or scales.dim() != 2:
        raise ValueError(f"scales must be a 2-D floating-point tensor [K/G, N], got {_what(scales)}")


def _check_devices(device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but qweight is on {device}; move the whole weight to one device")


def _pad_columns(t: torch.Tensor, extra: int) -> torch.Tensor:
    return F.pad(t, (0, extra)) if extra else t


class _IpexWo4Gemm(Kernel):
    name = "ipex"
    platforms = ("xpu", "cpu")
    priority = 10  # above the torch references (0)
    dtypes = _FLOATS
    quant_method: ClassVar[str]  # "AWQ_GEMM" | "GPTQ_GEMM" (ipex.llm.quantization.QuantMethod)

    def __init__(self) -> None:
        # Unprepared calls (conformance, tests) repack once per distinct weight, not per call.
        self._last: tuple[tuple[Any, ...], tuple[int, ...], IpexWoqWeight] | None = None

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {
            "bits": 4,
            "group_sizes": "-1 or any divisor of K",
            "compute_dtype": "the activation dtype (IPEX lowp_mode NONE)",
            "prepare_weight": "IPEXWeightOnlyQuantizedLinear.from_weight, once per layer",
        }

    @classmethod
    def _supports(cls, **problem: Any) -> str | None:
        reason = ipex_unavailable_reason()
        if reason is not None:
            return reason
        g, n, k = problem.get("group_size"), problem.get("n"), problem.get("k")
        if g is not None and g != -1 and g <= 0:
            return f"group size {g} is not supported (-1 for per channel, or a positive divisor of K)"
        if n is not None and n % 8:
            return f"N={n} is not a multiple of 8 (8 nibbles per int32)"
        if k is not None and g not in (None, -1) and k % g:
            return f"K={k} is not a multiple of group size {g}"
        return None

    # -- load time --------------------------------------------------------------------
    def _from_weight(self, qweight, qzeros, scales, g_idx, k: int, n: int, group_size: int) -> Any:
        """Pads N where IPEX needs it and builds IPEX's module. Inputs already validated."""
        import intel_extension_for_pytorch as ipex
        from intel_extension_for_pytorch.llm.quantization import IPEXWeightOnlyQuantizedLinear, QuantMethod

        device_type = qweight.device.type
        supported = getattr(IPEXWeightOnlyQuantizedLinear, "module_mapping", {device_type: None})
        if device_type not in supported:
            raise ValueError(
                f"this IPEX build ({ipex.__version__}) has weight-only int4 GEMMs for {', '.join(supported)} "
                f"tensors, not {device_type}"
            )
        g = packing.group_rows(k, group_size)
        ipex_group = -1 if g == k else g  # IPEX raises IndexError for one group of size K
        n_padded = n
        if n % _N_ALIGN:
            n_padded = -(-n // _N_ALIGN) * _N_ALIGN
        extra = n_padded - n
        if self.quant_method == "AWQ_GEMM":  # qweight [K, N/8], qzeros [K/G, N/8]
            qweight, qzeros = _pad_columns(qweight, extra // 8), _pad_columns(qzeros, extra // 8)
        else:  # GPTQ: qweight [K/8, N], qzeros [K/G, N/8]
            qweight, qzeros = _pad_columns(qweight, extra), _pad_columns(qzeros, extra // 8)
        scales = _pad_columns(scales, extra)  # [K/G, N]
        qconfig = ipex.quantization.get_weight_only_quant_qconfig_mapping(
            weight_dtype=ipex.quantization.WoqWeightDtype.INT4,
            lowp_mode=ipex.quantization.WoqLowpMode.NONE,  # compute in the activation dtype
        )
        # Copies: IPEX's GPTQ conversion transposes ``scales`` in place (``t_()``), which
        # would reshape the caller's tensor.
        linear = IPEXWeightOnlyQuantizedLinear.from_weight(
            qweight.contiguous(), scales.clone(memory_format=torch.contiguous_format), qzeros.clone(), k, n_padded,
            qconfig=qconfig, group_size=ipex_group, g_idx=g_idx,
            quant_method=getattr(QuantMethod, self.quant_method),
        )
        return linear, n_padded

    # -- per call ---------------------------------------------------------------------
    def _cached(self, args: tuple[Any, ...]) -> IpexWoqWeight:
        """The prepared form of unprepared weight ``args``; rebuilt when any of them changes.

        The cache keeps ``args`` alive, so identity checks cannot be fooled by a reused id.
        """
        versions = tuple(a._version if isinstance(a, torch.Tensor) else 0 for a in args)
        last = self._last
        if last is None or versions != last[1] or not all(
            a is b if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else a == b
            for a, b in zip(args, last[0])
        ):
            self._last = last = (args, versions, self.prepare_weight(args))
        return last[2]

    @staticmethod
    def _run(x: torch.Tensor, w: IpexWoqWeight) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != w.k:
            raise ValueError(f"x is a {_what(x)}; expected [M, K] with K={w.k} (the weight's input features)")
        if str(x.dtype).replace("torch.", "") not in _FLOATS:
            raise ValueError(f"x has dtype {x.dtype}; the IPEX 4-bit GEMM takes {', '.join(_FLOATS)} activations")
        if x.device != w.device:
            raise ValueError(f"x is on {x.device} but the prepared weight is on {w.device}")
        x2 = x.reshape(-1, w.k)  # [M, K]
        out = w.linear(x2)  # [M, n_padded]
        if w.n_padded != w.n:
            out = out[:, : w.n].contiguous()
        if w.correction is not None:
            xf = x2.float()
            if w.g_idx is None:
                xsum = xf.reshape(xf.shape[0], -1, w.group_rows).sum(dim=-1)  # [M, K/G]
            else:
                xsum = xf.new_zeros(xf.shape[0], w.correction.shape[0]).index_add_(1, w.g_idx, xf)
            out = (out.float() - xsum @ w.correction).to(x.dtype)
        return out.reshape(*x.shape[:-1], w.n)


class IpexAwqGemm(_IpexWo4Gemm):
    op = "awq_gemm"
    quant_method = "AWQ_GEMM"
    description = (
        "IPEX weight-only int4 linear (IPEXWeightOnlyQuantizedLinear.from_weight, AWQ_GEMM), "
        "repacked once at load, computed in the activation dtype"
    )

    def prepare_weight(self, weight: tuple) -> IpexWoqWeight:
        """``weight = (qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N], group_size)``,
        the op's weight arguments in call order; the result goes where ``qweight`` went."""
        if isinstance(weight, IpexWoqWeight):
            return weight
        qweight, qzeros, scales, group_size = weight
        _check_int32("qweight", qweight)
        _check_int32("qzeros", qzeros)
        _check_scales(scales)
        k, n = qweight.shape[0], qweight.shape[1] * 8
        g = packing.group_rows(k, group_size)
        layout = f"AutoAWQ packing for K={k}, N={n}, group_size={group_size}"
        _check_shape("qzeros", qzeros, (k // g, n // 8), layout)
        _check_shape("scales", scales, (k // g, n), layout)
        _check_devices(qweight.device, qzeros=qzeros, scales=scales)
        linear, n_padded = self._from_weight(qweight, qzeros, scales, None, k, n, group_size)
        return IpexWoqWeight(linear, k, n, n_padded, qweight.device, None, None, g)

    def __call__(self, x, qweight, qzeros=None, scales=None, group_size=None) -> torch.Tensor:
        if isinstance(qweight, IpexWoqWeight):
            return self._run(x, qweight)
        return self._run(x, self._cached((qweight, qzeros, scales, group_size)))


class IpexGptqGemm(_IpexWo4Gemm):
    op = "gptq_gemm"
    quant_method = "GPTQ_GEMM"
    description = (
        "IPEX weight-only int4 linear (IPEXWeightOnlyQuantizedLinear.from_weight, GPTQ_GEMM), "
        "act-order g_idx supported, repacked once at load, computed in the activation dtype"
    )

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {**super().capabilities(), "act_order_g_idx": True, "zero_convention": "v1 (stored zero - 1)"}

    def prepare_weight(self, weight: tuple) -> IpexWoqWeight:
        """``weight = (qweight [K/8, N], qzeros [K/G, N/8], scales [K/G, N], g_idx [K] | None,
        group_size)``, the op's weight arguments in call order; the result goes where
        ``qweight`` went."""
        if isinstance(weight, IpexWoqWeight):
            return weight
        qweight, qzeros, scales, g_idx, group_size = weight
        _check_int32("qweight", qweight)
        _check_int32("qzeros", qzeros)
        _check_scales(scales)
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        if n % 8:
            raise ValueError(f"qweight has N={n} columns; GPTQ packs zeros 8 per int32, so N must be a multiple of 8")
        g = packing.group_rows(k, group_size)
        num_groups = k // g
        layout = f"GPTQ v1 packing for K={k}, N={n}, group_size={group_size}"
        _check_shape("qzeros", qzeros, (num_groups, n // 8), layout)
        _check_shape("scales", scales, (num_groups, n), layout)
        _check_devices(qweight.device, qzeros=qzeros, scales=scales, g_idx=g_idx)
        if g_idx is not None:
            if g_idx.dim() != 1 or g_idx.shape[0] != k or g_idx.dtype.is_floating_point:
                raise ValueError(f"g_idx must be an integer tensor [K={k}], got {g_idx.dtype} {list(g_idx.shape)}")
            g_idx = g_idx.long()
            if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups):
                raise ValueError(f"g_idx values must lie in [0, {num_groups}) (K/G groups), "
                                 f"got [{int(g_idx.min())}, {int(g_idx.max())}]")
            if torch.equal(g_idx, torch.arange(k, device=g_idx.device) // g):
                g_idx = None  # the identity: IPEX's faster GPTQ layout, no act-order gather
        # zero 16 (stored 15) -> zero 8 (stored 7) plus a correction after the GEMM
        stored = packing._unpack_nibbles(qzeros, 1)  # [K/G, N]
        wrapped = stored == _GPTQ_WRAPPED_STORED_ZERO
        correction = None
        if bool(wrapped.any()):
            qzeros = packing._pack_nibbles(torch.where(wrapped, _GPTQ_SAFE_STORED_ZERO, stored), 1)
            correction = (_GPTQ_ZERO_SHIFT * scales.float() * wrapped).contiguous()  # [K/G, N]
        linear, n_padded = self._from_weight(
            qweight, qzeros, scales, None if g_idx is None else g_idx.to(torch.int32), k, n, group_size
        )
        return IpexWoqWeight(linear, k, n, n_padded, qweight.device, correction,
                             g_idx if correction is not None else None, g)

    def __call__(self, x, qweight, qzeros=None, scales=None, g_idx=None, group_size=None) -> torch.Tensor:
        if isinstance(qweight, IpexWoqWeight):
            return self._run(x, qweight)
        return self._run(x, self._cached((qweight, qzeros, scales, g_idx, group_size)))
