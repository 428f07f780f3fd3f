"""The cpu platform's native GGUF kernel (platforms/cpu_kernels/gguf_gemm.cpp, native_gguf.py) for Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K and Q6_K, on both instruction paths (AVX2, AVX-512 VNNI; a path this CPU lacks is skipped, saying so).

Tolerances. Few rows (M < TWO_LEVEL_MIN_ROWS) quantize the activations to int8 per block of 32, so they are
checked against the reference that does the same (``quantize_activations_q8``, then dequantize and matmul
in float32): max error 1e-5 of max |ref| (float summation order only), and loosely against the float
reference: within the bound the 8-bit rounding gives, sum_k d_k / 2 |w[n, k]|. From TWO_LEVEL_MIN_ROWS rows the
activations and their rounding error are each int8 (x ~ d q + d2 q2, d2 = d / 255): checked against the same
two-level rounding in torch (``two_level_activations``) to 1e-4 of max |ref| (a fused multiply-add may round the residual differently at a tie), and
against the float reference within sum_k d2_k / 2 |w[n, k]|, at least 50x closer than one level. Many rows (the dequantized float
panel, where PANEL_MIN_ROWS sends them; off by default) match the float reference to 1e-5. The integer path runs on the
repacked weight (gguf_repack, gguf_gemm_packed): checked against the GGUF rows' own integer op (gguf_gemv, the
same rounding) to 1e-5 of max |out| for every type, both paths, odd M and N, one and two levels."""
from __future__ import annotations

import pytest
import torch

from halserve.kernels.gguf_blocks import dequantize, quantize_activations_q8, random_blocks, two_level_activations
from halserve.platforms.cpu_kernels.native_gguf import (
    ISA_CODES,
    K_TYPES,
    QTYPE_CODES,
    TWO_LEVEL_MIN_ROWS,
    NativeGgufGemm,
    cpu_isa,
)

REASON = NativeGgufGemm.supports(dtype="float32", qtype="Q4_0", k=32)
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"the native GGUF kernel cannot run here: {REASON}")

QTYPES = list(QTYPE_CODES)
SHAPES = [(1, 32), (7, 96), (33, 576), (129, 1536)]  # (N, K): odd row counts, K of 1 to 48 blocks
K_SHAPES = [(1, 256), (7, 512), (33, 768), (65, 1536)]  # the K types: 1 to 6 super-blocks of 256


def _shapes(qtype: str) -> list[tuple[int, int]]:
    return K_SHAPES if qtype in K_TYPES else SHAPES


def _isa_or_skip(isa: str) -> None:
    if not torch.ops.halserve_cpu_gguf.gguf_isa_supported(ISA_CODES[isa]):
        pytest.skip(f"this CPU does not run the {isa} path")


def _q8_reference(x: torch.Tensor, w: torch.Tensor, qtype: str) -> torch.Tensor:
    q, d = quantize_activations_q8(x)
    xq = (q.float().reshape(x.shape[0], -1, 32) * d[..., None]).reshape(x.shape)
    return xq @ dequantize(w, qtype, x.shape[1]).t()


@pytest.mark.parametrize("isa", list(ISA_CODES))
@pytest.mark.parametrize("qtype", QTYPES)
def test_few_rows_match_the_int8_activation_reference(qtype, isa):
    _isa_or_skip(isa)
    kernel = NativeGgufGemm(isa)
    g = torch.Generator().manual_seed(QTYPE_CODES[qtype])
    for n, k in _shapes(qtype):
        w = random_blocks(qtype, n, k, g)
        for m in (1, 2, 3, 4, 5, 9):
            x = torch.randn(m, k, generator=g)
            got = kernel(x, w, qtype)
            want = _q8_reference(x, w, qtype)
            scale = want.abs().max().item()
            assert (got - want).abs().max().item() <= 1e-5 * scale, (qtype, isa, m, n, k)
            # against the float reference: within the rounding of the activations, |x - d q| <= d / 2 per value
            dense = dequantize(w, qtype, k)
            bound = (quantize_activations_q8(x)[1].repeat_interleave(32, dim=1) / 2) @ dense.abs().t()
            assert ((got - x @ dense.t()).abs() <= bound + 1e-5 * scale).all(), (qtype, isa, m, n, k)


@pytest.mark.parametrize("isa", list(ISA_CODES))
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_two_levels_at_the_integer_extremes(qtype, isa):
    """The packed tile sums a row's two levels as 255 dot1 + dot2 (plus Q4_0's and Q8_0's offset times sum q) in
    int32 per block: with every weight value at its extreme and the activations at +-127 with the largest
    residuals, the result still matches the two-level reference (no wrap-around)."""
    _isa_or_skip(isa)
    kernel = NativeGgufGemm(isa)
    n, k = 16, 576
    w = random_blocks(qtype, n, k, torch.Generator().manual_seed(3))
    size = 34 if qtype == "Q8_0" else 18
    blocks = w.view(n, k // 32, size)
    blocks[..., 2:] = 127 if qtype == "Q8_0" else 0xFF  # q8 = 127 / q4 = 15 (w = 7 d) everywhere
    blocks[1::2, :, 2:] = 128 if qtype == "Q8_0" else 0x00  # every other row q8 = -128 / q4 = 0 (w = -8 d)
    g = torch.Generator().manual_seed(4)
    sign = torch.where(torch.rand(8, k, generator=g) < 0.5, -1.0, 1.0)
    x = sign * (1.0 - torch.rand(8, k, generator=g) * (0.5 / 127))  # x / d within half a step of 127: large residuals
    x[::2] = x[::2].abs()  # rows whose every product has one sign
    got = kernel.ops.gguf_gemm_packed(x, kernel.packed(w, qtype, k), QTYPE_CODES[qtype], n, k, ISA_CODES[isa], 2)
    x1, x2, _ = two_level_activations(x)
    want = (x1 + x2) @ dequantize(w, qtype, k).t()
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("isa", list(ISA_CODES))
@pytest.mark.parametrize("qtype", QTYPES)
def test_two_int8_levels_match_their_reference_and_are_near_exact(qtype, isa):
    _isa_or_skip(isa)
    kernel = NativeGgufGemm(isa)
    g = torch.Generator().manual_seed(20 + QTYPE_CODES[qtype])
    for n, k in _shapes(qtype)[1:]:
        w = random_blocks(qtype, n, k, g)
        dense = dequantize(w, qtype, k)
        for m in (1, 5, TWO_LEVEL_MIN_ROWS):
            x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4  # uneven block scales
            got = kernel.ops.gguf_gemv(x, w, QTYPE_CODES[qtype], ISA_CODES[isa], 2)
            if m == TWO_LEVEL_MIN_ROWS:  # the kernel's own choice at this many rows: two levels, packed
                packed = kernel.ops.gguf_gemm_packed(x, kernel.packed(w, qtype, k), QTYPE_CODES[qtype], n, k,
                                                     ISA_CODES[isa], 2)
                assert torch.equal(kernel(x, w, qtype), packed)
                assert (packed - got).abs().max().item() <= 1e-5 * got.abs().max().item()
            x1, x2, d2 = two_level_activations(x)
            want = (x1 + x2) @ dense.t()
            scale = want.abs().max().item()
            assert (got - want).abs().max().item() <= 1e-4 * scale, (qtype, isa, m, n, k)
            exact = x @ dense.t()
            bound = (d2 / 2) @ dense.abs().t()
            assert ((got - exact).abs() <= bound + 1e-4 * scale).all(), (qtype, isa, m, n, k)
            one = kernel.ops.gguf_gemv(x, w, QTYPE_CODES[qtype], ISA_CODES[isa], 1)
            assert (got - exact).norm() * 50 < (one - exact).norm(), (qtype, isa, m, n, k)


def test_levels_other_than_one_or_two_are_refused():
    with pytest.raises(RuntimeError, match="levels must be 1 or 2 int8 levels, got 3"):
        NativeGgufGemm().ops.gguf_gemv(torch.randn(1, 32), random_blocks("Q8_0", 2, 32), 2, 1, 3)


@pytest.mark.parametrize("qtype", QTYPES)
def test_both_paths_agree(qtype):
    for isa in ISA_CODES:
        _isa_or_skip(isa)
    g = torch.Generator().manual_seed(7)
    k = 768 if qtype in K_TYPES else 576
    w = random_blocks(qtype, 65, k, g)
    x = torch.randn(3, k, generator=g)
    a, b = NativeGgufGemm("avx2")(x, w, qtype), NativeGgufGemm("avx512_vnni")(x, w, qtype)
    assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()


@pytest.mark.parametrize("qtype", QTYPES)
def test_many_rows_take_the_float_panel_and_match_the_float_reference(qtype, monkeypatch):
    import halserve.platforms.cpu_kernels.native_gguf as native

    monkeypatch.setitem(native.PANEL_MIN_ROWS, "avx2", 32)  # as many rows as the AVX2 default, at less cost
    g = torch.Generator().manual_seed(11)
    kernel = NativeGgufGemm("avx2")
    shapes = _shapes(qtype)
    for m, (n, k) in ((32, shapes[2]), (64, shapes[3]), (64, shapes[0])):
        w = random_blocks(qtype, n, k, g)
        x = torch.randn(m, k, generator=g)
        bias = torch.randn(n, generator=g)
        want = x @ dequantize(w, qtype, k).t() + bias
        got = kernel(x, w, qtype, bias)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), (qtype, m, n, k)
        assert torch.equal(kernel.dequantize(w, qtype, k), dequantize(w, qtype, k)) or torch.allclose(
            kernel.dequantize(w, qtype, k), dequantize(w, qtype, k), rtol=1e-6, atol=0)


def test_panel_chunks_over_output_rows(monkeypatch):
    import halserve.platforms.cpu_kernels.native_gguf as native

    monkeypatch.setattr(native, "PANEL_BYTES", 4 * 96 * 5)  # 5 output rows per panel
    monkeypatch.setitem(native.PANEL_MIN_ROWS, "avx2", 32)
    g = torch.Generator().manual_seed(3)
    w = random_blocks("Q4_1", 23, 96, g)
    x = torch.randn(40, 96, generator=g)
    want = x @ dequantize(w, "Q4_1", 96).t()
    assert torch.allclose(NativeGgufGemm("avx2")(x, w, "Q4_1"), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q6_K"])
def test_cached_panel_matches_the_float_reference_and_follows_the_weight(qtype, monkeypatch):
    # cache_panel (the LM head's): M >= PANEL_MIN_ROWS keeps the whole dequantized weight between calls; few
    # rows still take the integer path; new blocks (another tensor, or the same one written in place) refresh it
    import halserve.platforms.cpu_kernels.native_gguf as native

    monkeypatch.setitem(native.PANEL_MIN_ROWS, "avx2", 32)
    g = torch.Generator().manual_seed(13)
    n, k = _shapes(qtype)[3]
    kernel = NativeGgufGemm("avx2")
    kernel.cache_panel = True
    w = random_blocks(qtype, n, k, g)
    x = torch.randn(32 + 5, k, generator=g)

    def check(weight: torch.Tensor) -> None:
        want = x @ dequantize(weight, qtype, k).t()
        got = kernel(x, weight, qtype)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), qtype

    check(w)
    panel = kernel._panel[1]
    check(w)
    assert kernel._panel[1] is panel  # reused, not dequantized again
    few = kernel(x[:3], w, qtype)  # few rows: the integer path, as without the cache
    assert torch.equal(few, NativeGgufGemm("avx2")(x[:3], w, qtype))
    w2 = random_blocks(qtype, n, k, g)
    check(w2)
    assert kernel._panel[1] is not panel
    w2.copy_(w)  # in place: same storage, new contents
    check(w2)
    assert torch.equal(kernel._panel[1], dequantize(w, qtype, k)) or torch.allclose(
        kernel._panel[1], dequantize(w, qtype, k), rtol=1e-6, atol=0)


@pytest.mark.parametrize("m", [1, 64])
def test_bfloat16_activations(m):
    g = torch.Generator().manual_seed(5)
    w = random_blocks("Q8_0", 48, 576, g)
    x = torch.randn(m, 576, generator=g).to(torch.bfloat16)
    got = NativeGgufGemm()(x, w, "Q8_0")
    want = x.float() @ dequantize(w, "Q8_0", 576).t()
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max().item() <= 3e-2 * want.abs().max().item()


def test_isa_is_forced_by_the_environment(monkeypatch):
    monkeypatch.setenv("HALSERVE_GGUF_ISA", "avx2")
    assert cpu_isa() == "avx2" and NativeGgufGemm().isa == "avx2"
    monkeypatch.setenv("HALSERVE_GGUF_ISA", "sse2")
    with pytest.raises(ValueError, match="HALSERVE_GGUF_ISA='sse2'.*avx2, avx512_vnni"):
        cpu_isa()


def test_declines_what_it_does_not_cover():
    assert "Q5_0" in NativeGgufGemm.supports(dtype="float32", qtype="Q5_0", k=256)
    assert "not a whole number of 32" in NativeGgufGemm.supports(dtype="float32", qtype="Q4_0", k=48)
    assert "not a whole number of 256" in NativeGgufGemm.supports(dtype="float32", qtype="Q6_K", k=288)


def test_bad_weight_is_a_clear_error():
    kernel = NativeGgufGemm()
    with pytest.raises(RuntimeError, match="weight rows have 18 bytes, a row of 32 values of this type has 20"):
        kernel(torch.randn(1, 32), torch.zeros(3, 18, dtype=torch.uint8), "Q4_1")


@pytest.mark.parametrize("isa", list(ISA_CODES))
@pytest.mark.parametrize("qtype", QTYPES)
def test_packed_weights_match_the_gguf_rows_integer_op(qtype, isa):
    # the repacked path (groups of 16 output rows, tiles of 8 or 4 activation rows) against gguf_gemv on the
    # file's rows, the same int8 rounding: odd N (padding of the last group), M across tile edges, both levels
    _isa_or_skip(isa)
    kernel = NativeGgufGemm(isa)
    code, isa_code = QTYPE_CODES[qtype], ISA_CODES[isa]
    g = torch.Generator().manual_seed(40 + code)
    for n, k in _shapes(qtype):
        w = random_blocks(qtype, n, k, g)
        packed = kernel.packed(w, qtype, k)
        # values, then the scales: float16 s for Q4_0/Q8_0 (their GGUF bits per value, 4.5 and 8.5), s and o for
        # Q4_1 (5), float32 s and o for the K types (Q6_K per half block)
        scale_bytes = {"Q4_0": 32, "Q8_0": 32, "Q4_1": 64, "Q6_K": 256}.get(qtype, 128)
        group_bytes = (256 if qtype in ("Q4_0", "Q4_1", "Q4_K") else 512) + scale_bytes
        assert packed.numel() == -(-n // 16) * (k // 32) * group_bytes
        if qtype in ("Q4_0", "Q4_1", "Q8_0"):  # as small as the file's blocks, padding rows apart
            assert packed.numel() == -(-n // 16) * 16 * w.shape[1]
        for m in (1, 3, 4, 7, 8, 9, 17, 33):
            x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4
            for levels in (1, 2):
                want = kernel.ops.gguf_gemv(x, w, code, isa_code, levels)
                got = kernel.ops.gguf_gemm_packed(x, packed, code, n, k, isa_code, levels)
                assert got.shape == (m, n)
                assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), (qtype, isa, n, k, m, levels)


@pytest.mark.parametrize("isa", list(ISA_CODES))
def test_prefill_rows_stay_integer_on_vnni_and_match_two_levels(isa):
    # 200 rows (prefill): both paths keep the packed two-level integer path by default (no float panel), within
    # the two-level bound of the exact float product
    _isa_or_skip(isa)
    g = torch.Generator().manual_seed(17)
    w = random_blocks("Q4_0", 70, 576, g)
    x = torch.randn(200, 576, generator=g)
    dense = dequantize(w, "Q4_0", 576)
    got = NativeGgufGemm(isa)(x, w, "Q4_0")
    exact = x @ dense.t()
    _, _, d2 = two_level_activations(x)
    scale = exact.abs().max().item()
    assert ((got - exact).abs() <= (d2 / 2) @ dense.abs().t() + 1e-4 * scale).all()
    kernel = NativeGgufGemm(isa)
    packed = kernel.ops.gguf_gemm_packed(x, kernel.packed(w, "Q4_0", 576), 0, 70, 576, ISA_CODES[isa], 2)
    assert torch.equal(got, packed)


def test_decode_step_rows_take_one_level_however_many():
    """Inside a decode step's forward context (every request one token) 40 rows take one int8 level, as one row
    does, through ``__call__`` and ``bind``; outside it two; the LM head's minimum of two holds in both."""
    from halserve.forward_context import set_forward_context

    kernel, head = NativeGgufGemm(), NativeGgufGemm()
    head.min_activation_levels = 2
    g = torch.Generator().manual_seed(23)
    w = random_blocks("Q4_0", 48, 576, g)
    x = torch.randn(40, 576, generator=g)
    packed = kernel.packed(w, "Q4_0", 576)

    def at(levels):
        return kernel.ops.gguf_gemm_packed(x, packed, 0, 48, 576, kernel.isa_code, levels)

    one, two = at(1), at(2)
    assert not torch.equal(one, two)
    bound = kernel.bind(w, "Q4_0")
    assert torch.equal(kernel(x, w, "Q4_0"), two) and torch.equal(bound(x), two)
    with set_forward_context(None, decode_only=True):
        assert torch.equal(kernel(x, w, "Q4_0"), one) and torch.equal(bound(x), one)
        assert torch.equal(head(x, w, "Q4_0"), two)
        assert torch.equal(kernel(x[:1], w, "Q4_0"), one[:1])  # (a row's output is the same alone)
    with set_forward_context(None):  # a mixed step
        assert torch.equal(kernel(x, w, "Q4_0"), two)


def test_packed_copy_is_kept_on_the_weight_and_follows_it():
    kernel = NativeGgufGemm()
    g = torch.Generator().manual_seed(19)
    w = random_blocks("Q4_1", 33, 576, g)
    first = kernel.packed(w, "Q4_1", 576)
    assert kernel.packed(w, "Q4_1", 576) is first  # made once
    assert NativeGgufGemm()(torch.randn(2, 576, generator=g), w, "Q4_1").shape == (2, 33)
    assert kernel.packed(w, "Q4_1", 576) is first  # the call reused it
    w.copy_(random_blocks("Q4_1", 33, 576, g))  # written in place: repacked
    x = torch.randn(5, 576, generator=g)
    again = kernel.packed(w, "Q4_1", 576)
    assert again is not first
    assert torch.allclose(NativeGgufGemm()(x, w, "Q4_1"), _q8_reference(x, w, "Q4_1"), rtol=1e-5, atol=1e-4)


def test_bad_packed_weight_is_a_clear_error():
    kernel = NativeGgufGemm()
    with pytest.raises(RuntimeError, match="packed must be gguf_repack's uint8"):
        kernel.ops.gguf_gemm_packed(torch.randn(1, 32), torch.zeros(10, dtype=torch.uint8), 0, 3, 32,
                                    kernel.isa_code, 1)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q6_K"])
def test_bound_call_equals_the_kernel_call_and_follows_the_weight(qtype):
    """``bind`` (the flat forward's call) gives exactly ``__call__``'s numbers: one and two int8 levels, a
    bias, a head's two-level minimum, bfloat16 through ``__call__``; and it repacks after an in-place write."""
    g = torch.Generator().manual_seed(23)
    n, k = _shapes(qtype)[2]
    w = random_blocks(qtype, n, k, g)
    bias = torch.randn(n, generator=g)
    kernel, head = NativeGgufGemm(), NativeGgufGemm()
    head.min_activation_levels = 2
    for kern, b in ((kernel, None), (kernel, bias), (head, None)):
        call = kern.bind(w, qtype, b)
        for m in (1, 3, TWO_LEVEL_MIN_ROWS + 1):
            x = torch.randn(m, k, generator=g)
            assert torch.equal(call(x), kern(x, w, qtype, b)), (m, b is not None, kern.min_activation_levels)
        xb = torch.randn(2, k, generator=g).to(torch.bfloat16)
        assert torch.equal(call(xb), kern(xb, w, qtype, b))
    call = kernel.bind(w, qtype)
    x = torch.randn(2, k, generator=g)
    before = call(x)
    w.copy_(random_blocks(qtype, n, k, g))  # written in place: the bound call must not keep the old copy
    after = call(x)
    assert not torch.equal(after, before) and torch.equal(after, kernel(x, w, qtype))


def test_activation_levels_can_be_forced_for_every_gemm(monkeypatch):
    """``HALSERVE_GGUF_ACTIVATION_LEVELS=1`` (llama.cpp's arithmetic) takes one level for prompts and the LM
    head too; ``=2`` two even for one row; anything else is refused, naming the variable."""
    from halserve.platforms.cpu_kernels.native_gguf import LEVELS_ENV

    g = torch.Generator().manual_seed(29)
    w = random_blocks("Q8_0", 48, 576, g)
    x = torch.randn(40, 576, generator=g)
    plain = NativeGgufGemm()
    packed = plain.packed(w, "Q8_0", 576)

    def at(rows, levels):
        return plain.ops.gguf_gemm_packed(x[:rows], packed, 2, 48, 576, plain.isa_code, levels)

    assert torch.equal(plain(x, w, "Q8_0"), at(40, 2)) and torch.equal(plain(x[:1], w, "Q8_0"), at(1, 1))
    monkeypatch.setenv(LEVELS_ENV, "1")
    kernel, head = NativeGgufGemm(), NativeGgufGemm()
    head.min_activation_levels = 2
    assert torch.equal(kernel(x, w, "Q8_0"), at(40, 1)) and torch.equal(kernel.bind(w, "Q8_0")(x), at(40, 1))
    assert torch.equal(head(x, w, "Q8_0"), at(40, 1))
    monkeypatch.setenv(LEVELS_ENV, "2")
    assert torch.equal(NativeGgufGemm()(x[:1], w, "Q8_0"), at(1, 2))
    monkeypatch.setenv(LEVELS_ENV, "3")
    with pytest.raises(ValueError, match="HALSERVE_GGUF_ACTIVATION_LEVELS='3'"):
        NativeGgufGemm()


# -- logits that only feed an argmax (argmax_logits, gguf_gemm_packed_argmax) --------------------------------------
def _near_tie_case(qtype: str, n: int, k: int, m: int, g: torch.Generator):
    """Weights whose rows 3 and n - 5 (other groups) are one value apart, and rows that point at row 3 with a
    little noise: each row's top two logits are a near tie, the case one int8 level gets wrong."""
    w = random_blocks(qtype, n, k, g)
    w[n - 5] = w[3]
    w[n - 5, -1] ^= 1  # (the last byte: a value or a scale's low bit)
    target = dequantize(w[3:4], qtype, k)
    x = target + 0.3 * target.abs().mean() * torch.randn(m, k, generator=g)
    return w, x


@pytest.mark.parametrize("isa", list(ISA_CODES))
@pytest.mark.parametrize("qtype", QTYPES)
def test_argmax_logits_keep_the_two_level_argmax_and_its_logit(qtype, isa):
    """Each row's first maximum is the two-level call's token with its bit-identical logit; every logit is either
    the two-level value (the groups recomputed) or the one-level one; few groups are recomputed. Random rows and
    constructed near ties, N not a multiple of 16 (a partial last group), M across the row tiles."""
    _isa_or_skip(isa)
    kernel = NativeGgufGemm(isa)
    kernel.min_activation_levels = 2  # (as the LM head sets it)
    code, isa_code = QTYPE_CODES[qtype], ISA_CODES[isa]
    g = torch.Generator().manual_seed(70 + code)
    k = 512 if qtype in K_TYPES else 576
    for case in ("random", "near tie"):
        for n, m in ((1000, 8), (3001, 13), (4099, 33)):
            if case == "random":
                w = random_blocks(qtype, n, k, g)
                x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4
            else:
                w, x = _near_tie_case(qtype, n, k, m, g)
            two = kernel(x, w, qtype)
            one = kernel.ops.gguf_gemm_packed(x, kernel.packed(w, qtype, k), code, n, k, isa_code, 1)
            got = kernel.argmax_logits(x, w, qtype)
            assert got.shape == (m, n)
            best_two, at_two = two.max(-1)
            best_got, at_got = got.max(-1)
            assert torch.equal(at_got, at_two), (qtype, isa, case, n, m)
            assert torch.equal(best_got, best_two)
            assert bool(((got == two) | (got == one)).all())
            recomputed = (got != one).float().mean().item()
            assert recomputed < 0.25, recomputed  # (a few groups of 16 per row)
            if case == "near tie" and qtype not in K_TYPES:  # the constructed pair is the top two (a K type's
                # super-block rows are not dominated by one row's match)
                assert set(two.topk(2, -1).indices[0].tolist()) == {3, n - 5}


def test_argmax_logits_take_the_plain_call_for_few_rows():
    from halserve.platforms.cpu_kernels.native_gguf import ARGMAX_MIN_ROWS

    kernel = NativeGgufGemm()
    kernel.min_activation_levels = 2
    w = random_blocks("Q8_0", 300, 64, torch.Generator().manual_seed(3))
    x = torch.randn(ARGMAX_MIN_ROWS - 1, 64)
    assert torch.equal(kernel.argmax_logits(x, w, "Q8_0"), kernel(x, w, "Q8_0"))  # (below it: the two-level call)


def test_abs_block_sums_are_grouped_and_follow_the_weight():
    kernel = NativeGgufGemm()
    w = random_blocks("Q4_1", 37, 96, torch.Generator().manual_seed(5))
    sums = kernel.abs_block_sums(w, "Q4_1", 96)
    assert sums.shape == (3, 3, 16)  # [ceil(37 / 16), 96 / 32, 16]
    want = dequantize(w, "Q4_1", 96).abs().view(37, 3, 32).sum(-1)  # [37, 3]
    flat = sums.transpose(1, 2).reshape(48, 3)
    assert torch.allclose(flat[:37], want) and not flat[37:].any()
    assert kernel.abs_block_sums(w, "Q4_1", 96) is sums  # kept
    w[0, 1] ^= 0x04  # (block 0's scale d, in place): made again
    assert not torch.equal(kernel.abs_block_sums(w, "Q4_1", 96), sums)


def test_bad_abs_block_sums_are_a_clear_error():
    kernel = NativeGgufGemm()
    w = random_blocks("Q8_0", 40, 64, torch.Generator().manual_seed(6))
    x = torch.randn(9, 64)
    with pytest.raises(RuntimeError, match=r"absw must be float32 \[ceil\(N / 16\) = 3, K / 32 = 2, 16\]"):
        kernel.ops.gguf_gemm_packed_argmax(x, kernel.packed(w, "Q8_0", 64), 2, 40, 64, kernel.isa_code,
                                           torch.zeros(2, 40))
