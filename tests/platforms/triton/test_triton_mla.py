"""triton_paged's MLA path (absorbed decode kernel, latent write, expanded prefill through the unified
kernel) against the torch reference backend's ``forward_mla`` on the same latent caches.

Tiny shapes (the interpreter runs each program in Python): 4-20 heads, latent rank 32, rotary 8.
"""
from __future__ import annotations

import math

import pytest
import torch

from halserve.attention_backends.base import AttentionMetadata
from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.attention_backends.triton_paged import TritonPagedAttentionBackend
from halserve.kv_cache.spec import MLASpec

RANK, NOPE, ROPE = 32, 16, 8
# (num_cached, query_len): a chunk after a prefix hit, decodes, a fresh prefill
MIXED = [(19, 13), (40, 1), (0, 9), (7, 1)]
TOL = {torch.float32: 2e-4, torch.float16: 1e-2}


def make_step(specs, *, heads: int, v_dim: int, block_size: int, dtype, device, cache_dtype=None, seed=0,
              k_scale: float = 1.0, dims: tuple[int, int, int] = (RANK, NOPE, ROPE)):
    """(forward_mla's q_nope, q_pe, kv_c, k_pe; the cache, random rows everywhere; metadata; (w_uk, w_uv))
    for ``dims`` = (rank, nope, rope)."""
    rank, nope, rope = dims
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in specs]
    blocks = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 3  # spare blocks of garbage nobody may read
    order = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(specs), max(blocks), dtype=torch.int32)
    used = 0
    for r, nb in enumerate(blocks):
        table[r, :nb] = order[used : used + nb].to(torch.int32)
        used += nb
    rows = torch.randn(MLASpec(rank, rope).cache_shape(num_blocks, block_size), generator=g)
    t = sum(n for _, n in specs)
    q_nope = torch.randn(t, heads, nope, generator=g).to(dtype)
    q_pe = torch.randn(t, heads, rope, generator=g).to(dtype)
    kv_c, k_pe = torch.randn(t, rank, generator=g), torch.randn(t, rope, generator=g)
    if cache_dtype is not None and cache_dtype.itemsize == 1:
        # values exact in fp8 after / k_scale (a power of two): the interpreter's inexact fp32->fp8
        # casts (triton#8322) then round nothing, and both backends write the same bytes
        rows, kv_c, k_pe = (x.to(cache_dtype).float() for x in (rows, kv_c, k_pe))
        kv_c, k_pe = kv_c * k_scale, k_pe * k_scale
    cache = rows.to(cache_dtype or dtype)
    w_uk = (torch.randn(heads, nope, rank, generator=g) / math.sqrt(rank)).to(dtype)
    w_uv = (torch.randn(heads, v_dim, rank, generator=g) / math.sqrt(rank)).to(dtype)
    qsl = torch.tensor([0, *[n for _, n in specs]], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    slots = [int(table[r, p // block_size]) * block_size + p % block_size
             for r, (c, n) in enumerate(specs) for p in range(c, c + n)]
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=t, num_reqs=len(specs), max_query_len=max(n for _, n in specs), max_seq_len=max(seq_lens),
        query_start_loc=qsl.to(device), seq_lens=sl.to(device), block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device), query_start_loc_cpu=qsl, seq_lens_cpu=sl)
    inputs = [x.to(device) for x in (q_nope, q_pe, kv_c.to(dtype), k_pe.to(dtype))]
    return inputs, cache.to(device), meta, (w_uk.to(device), w_uv.to(device))


def run_both(specs, *, heads=4, v_dim=16, block_size=16, dtype=torch.float32, device="cpu", kv_cache_dtype="auto",
             cache_dtype=None, k_scale=1.0, seed=0, dims=(RANK, NOPE, ROPE), backend=None):
    """Triton and torch forward_mla on copies of one cache: (triton out, reference out, both caches)."""
    inputs, cache, meta, (w_uk, w_uv) = make_step(specs, heads=heads, v_dim=v_dim, block_size=block_size,
                                                  dtype=dtype, device=device, cache_dtype=cache_dtype, seed=seed,
                                                  k_scale=k_scale, dims=dims)
    head_size = dims[1] + dims[2]
    scale = head_size**-0.5
    triton_backend = backend or TritonPagedAttentionBackend(heads, head_size, scale, 1, kv_cache_dtype=kv_cache_dtype)
    ref = TorchAttentionBackend(heads, head_size, scale, 1, kv_cache_dtype=kv_cache_dtype)
    ref_cache = cache.cpu().clone()
    want = ref.forward_mla(*[x.cpu() for x in inputs], ref_cache, TorchAttentionBackend.build_metadata(_cpu(meta)),
                           w_uk.cpu(), w_uv.cpu(), k_scale)
    got = triton_backend.forward_mla(*inputs, cache, meta, w_uk, w_uv, k_scale)
    return got.cpu(), want, cache.cpu(), ref_cache


def _cpu(meta: AttentionMetadata) -> AttentionMetadata:
    fields = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(meta).items()}
    return AttentionMetadata(**fields)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype.itemsize == 1 else torch.equal(a, b)


@pytest.mark.parametrize("dtype,block_size,heads,v_dim", [
    (torch.float32, 16, 4, 16),
    (torch.float16, 32, 3, 24),  # odd head count; values wider than dn + dr (the expanded heads pad)
])
def test_mixed_step_matches_the_torch_reference(dtype, block_size, heads, v_dim, device):
    got, want, cache, ref_cache = run_both(MIXED, heads=heads, v_dim=v_dim, block_size=block_size, dtype=dtype,
                                           device=device)
    assert _same_bytes(cache, ref_cache)  # the latent write: the same rows, bit for bit, nothing else moved
    assert got.shape == want.shape == (sum(n for _, n in MIXED), heads, v_dim) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_only_split_kv_and_a_partial_head_tile(device, monkeypatch):
    """20 heads: a full 16-head tile and a partial one; the split-K partials merged by the reduce."""
    monkeypatch.setenv("HALSERVE_TRITON_ATTN_SPLITS", "4")
    got, want, cache, ref_cache = run_both([(70, 1), (5, 1), (33, 1)], heads=20, device=device, seed=1)
    assert _same_bytes(cache, ref_cache)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("name,cache_dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_latent_cache(name, cache_dtype, device):
    """fp8 latent pages with k_scale: the write quantizes (x / k_scale), decode and the expanded
    prefill dequantize; the same rows as the reference's, and outputs close to its."""
    got, want, cache, ref_cache = run_both(MIXED, device=device, kv_cache_dtype=name, cache_dtype=cache_dtype,
                                           k_scale=0.5, seed=2)
    assert _same_bytes(cache, ref_cache)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_padded_tokens_are_zero_and_write_nothing(device):
    inputs, cache, meta, (w_uk, w_uv) = make_step([(5, 1), (9, 1)], heads=4, v_dim=16, block_size=16,
                                                  dtype=torch.float32, device=device)
    before = cache.clone()
    pad = [torch.cat([x, torch.ones_like(x[:2])]) for x in inputs]  # two padding rows past num_actual_tokens
    backend = TritonPagedAttentionBackend(4, NOPE + ROPE, 0.2, 1)
    out = backend.forward_mla(*pad, cache, meta, w_uk, w_uv)
    assert out.shape[0] == 4 and torch.all(out[2:] == 0) and torch.all(out[:2] != 0)
    changed = (cache != before).flatten(0, 1).any(-1).nonzero().flatten().tolist()  # slots written
    assert changed == sorted(meta.slot_mapping.tolist())


def test_the_backend_claims_the_mla_kind():
    assert "mla" in TritonPagedAttentionBackend.kv_cache_spec_kinds()
    assert hasattr(TritonPagedAttentionBackend, "forward_mla")


@pytest.mark.gpu
@pytest.mark.parametrize("specs", [[(2047, 1)] * 4, [(300, 40), (2047, 1)]])
def test_bf16_deepseek_v3_shapes_gpu(specs, device):
    """DeepSeek-V3 on 8 ranks (16 heads, rank 512, nope 128, rope 64, v 128), long contexts: a decode-only
    step (the platform's split-K choice) and a chunked prefill beside a decode."""
    dims = (512, 128, 64)
    backend = TritonPagedAttentionBackend(16, 192, 192**-0.5, 1)
    got, want, cache, ref_cache = run_both(specs, heads=16, v_dim=128, dtype=torch.bfloat16, device=device,
                                           dims=dims, backend=backend)
    assert _same_bytes(cache, ref_cache)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.slow  # a whole engine through the Triton interpreter (MoE, norms, rotary and MLA kernels)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the interpreted stack is for CPU-only hosts")
def test_deepseek_v2_engine_interpreted_matches_transformers(monkeypatch, tmp_path):
    """A DeepSeek-V2-Lite-shaped model (rotary head 64, the smallest head size triton_paged takes) on the
    cuda platform's whole stack in the interpreter (test_triton_engine_interpreted.py's patching): chunked
    prefills, decodes, a second pass of prefix-cache hits, greedy-identical to transformers."""
    import transformers
    from engine_helpers import hf_greedy
    from model_factory import _randomize, make_tokenizer
    from test_triton_engine_interpreted import _interpret_on_cpu

    from halserve import LLM, SamplingParams
    from halserve.platforms.cuda import CudaPlatform

    _interpret_on_cpu(monkeypatch, CudaPlatform, capability=lambda self, index=0: (9, 0))
    config = transformers.DeepseekV2Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16,
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, topk_method="greedy", max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)
    config.architectures = ["DeepseekV2ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(config).to(torch.float32)
    _randomize(model, 64, 0)
    path = str(tmp_path)
    model.save_pretrained(path)
    make_tokenizer(512).save_pretrained(path)
    prompts = [[5, 9, 33, 70, 200, 7, 8, 9, 10, 11, 12, 13] * 4, [300, 301, 7], [44, 45, 46, 47, 48, 49, 50, 51, 52]]
    expected = hf_greedy(path, prompts, 6)

    llm = LLM(path, platform="cuda", dtype="float32", max_num_batched_tokens=32, block_size=16,
              attention_backend="triton_paged")
    runner = llm.llm_engine.core.executor.worker.model_runner
    assert runner.attn_backend_cls.name == "triton_paged"
    assert type(runner.model.attention_layers[0].backend) is TritonPagedAttentionBackend
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for attempt in ("first", "prefix hits"):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for i, (o, e) in enumerate(zip(outs, expected)):
            assert o.outputs[0].token_ids == e, f"{attempt}: prompt {i} differs"
    assert outs[0].num_cached_tokens >= 16
