"""DeepSeek-V2/V3 (models/deepseek.py) over the MLA latent cache, against transformers on tiny random fp32
checkpoints: a V2-Lite-shaped model (no q LoRA, greedy routing) and a V3-shaped one (q LoRA, sigmoid
grouped routing with the score-correction bias), both with YaRN, shared experts and a dense first layer.
The MLA paths of the torch backend (absorbed decode, naive prefill) against plain attention over the
expanded K/V; the engine with chunked prefill, preemption, prefix-cache hits and two tensor-parallel
ranks; the pool sized by the latent's bytes (a hand count)."""
from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import generate_ids, greedy_params, hf_greedy
from model_factory import _randomize, make_tokenizer
from paged_harness import PagedHarness
from test_llama_family import hf_model, load

from halserve.attention_backends.base import AttentionMetadata
from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.kv_cache.spec import MLASpec

VOCAB, HIDDEN, LAYERS = 512, 64, 3
RANK, NOPE, ROPE, V_DIM, HEADS = 32, 16, 8, 16, 4
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
        "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
SHAPES = {  # name -> (transformers classes, config overrides)
    "v2_lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0)),
    "v2_group_limited": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                         dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              routed_scaling_factor=1.5)),
    "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
           dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(shape)`` -> a directory written by transformers' save_pretrained (and a tokenizer)."""
    import transformers

    tokenizer = make_tokenizer(VOCAB)
    made: dict[str, str] = {}

    def make(shape: str) -> str:
        if shape in made:
            return made[shape]
        config_name, arch, overrides = SHAPES[shape]
        config = getattr(transformers, config_name)(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            num_key_value_heads=HEADS, kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
            v_head_dim=V_DIM, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1, max_position_embeddings=256,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_parameters=dict(YARN),
            **overrides)
        config.architectures = [arch]
        torch.manual_seed(0)
        model = getattr(transformers, arch)(config).to(torch.float32)
        _randomize(model, HIDDEN, 0)  # router rows too: tokens spread over the experts
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # (zeros from init: give the bias a say)
                    buffer.copy_(0.3 * torch.randn(buffer.shape, generator=torch.Generator().manual_seed(1)))
        path = str(tmp_path_factory.mktemp(shape))
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        made[shape] = path
        return path

    return make


def mla_harness(model, num_blocks: int = 128, block_size: int = 4) -> PagedHarness:
    harness = PagedHarness(model, TorchAttentionBackend, num_blocks=num_blocks, block_size=block_size)
    for layer in model.attention_layers:  # the latent pages instead of per-head K/V
        layer.kv_cache = torch.zeros(layer.kv_cache_spec.cache_shape(num_blocks, block_size))
    return harness


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefill_logits_and_greedy_decode_match_transformers(checkpoint, shape):
    path = checkpoint(shape)
    model, info = load(path)
    assert [layer.kv_cache_spec for layer in model.attention_layers] == [MLASpec(RANK, ROPE)] * LAYERS
    hf = hf_model(path)
    prompts = [[1, 5, 9, 33, 70, 200, 7, 8, 9, 10, 11, 12, 13], [1, 300, 301, 7], [1, 44]]
    harness = mla_harness(model)
    logits = harness.step([(f"r{i}", p) for i, p in enumerate(prompts)])  # one flattened prefill
    offset, generated = 0, []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            want = hf(torch.tensor([prompt])).logits[0]
            got = logits[offset : offset + len(prompt)]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"prompt {i}: {m}")
            generated.append([int(got[-1].argmax())])
            offset += len(prompt)
        for _ in range(5):  # batched decodes: the absorbed path over the latent pages
            logits = harness.step([(f"r{i}", [g[-1]]) for i, g in enumerate(generated)])
            for i, g in enumerate(generated):
                g.append(int(logits[i].argmax()))
        for i, prompt in enumerate(prompts):
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
            assert generated[i] == want, f"prompt {i}: halserve {generated[i]} vs transformers {want}"


def _metadata(query_lens: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int):
    slots, starts = [], [0]
    for q, s, table in zip(query_lens, seq_lens, tables):
        for pos in range(s - q, s):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + q)
    width = max(len(t) for t in tables)
    qsl, sl = torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    common = AttentionMetadata(
        num_actual_tokens=starts[-1], num_reqs=len(query_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=qsl, seq_lens=sl,
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl, seq_lens_cpu=sl)
    return TorchAttentionBackend.build_metadata(common)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "bfloat16", "float16"])
def test_absorbed_decode_and_naive_prefill_equal_attention_over_expanded_kv(kv_cache_dtype):
    """One step mixing decodes and a chunked prefill after cached context, against softmax(q k^T) v
    over per-head keys/values expanded from the latents the cache holds (so fp8 or bfloat16 rounding is
    shared; float32 q and arithmetic)."""
    gen = torch.Generator().manual_seed(0)
    heads, block_size, num_blocks = 3, 4, 16
    scale = (NOPE + ROPE) ** -0.5
    backend = TorchAttentionBackend(heads, NOPE + ROPE, scale, 1, kv_cache_dtype=kv_cache_dtype)
    w_uk = torch.randn(heads, NOPE, RANK, generator=gen) / math.sqrt(RANK)
    w_uv = torch.randn(heads, V_DIM, RANK, generator=gen) / math.sqrt(RANK)
    cache_dtype = {"auto": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(kv_cache_dtype,
                                                                                          torch.float8_e4m3fn)
    cache = torch.zeros(MLASpec(RANK, ROPE).cache_shape(num_blocks, block_size), dtype=cache_dtype)
    tables = [[3, 9, 1], [7, 2], [12, 5, 14, 0]]
    seq_lens, query_lens = [9, 6, 13], [1, 1, 5]  # two decodes, a 5-token chunk after 8 cached positions
    # the context before this step, written by an earlier "step" of the same backend
    before = _metadata([s - q for s, q in zip(seq_lens, query_lens)], [s - q for s, q in zip(seq_lens, query_lens)],
                       tables, block_size)
    n_before = before.num_actual_tokens
    backend._write_mla(cache, torch.randn(n_before, RANK + ROPE, generator=gen), before.slot_mapping.long(), 1.0)
    meta = _metadata(query_lens, seq_lens, tables, block_size)
    t = meta.num_actual_tokens
    q_nope, q_pe = torch.randn(t, heads, NOPE, generator=gen), torch.randn(t, heads, ROPE, generator=gen)
    kv_c, k_pe = torch.randn(t, RANK, generator=gen), torch.randn(t, ROPE, generator=gen)
    out = backend.forward_mla(q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv)

    start = 0
    for r, (q_len, s_len, table) in enumerate(zip(query_lens, seq_lens, tables)):
        rows = backend._read_mla(cache, torch.tensor(table).long(), 1.0, torch.float32)[:s_len]  # [S, r + dr]
        keys = torch.cat([torch.einsum("sr,hdr->hsd", rows[:, :RANK], w_uk),
                          rows[:, RANK:].expand(heads, -1, -1)], dim=-1)  # [H, S, dn + dr]
        values = torch.einsum("sr,hvr->hsv", rows[:, :RANK], w_uv)  # [H, S, dv]
        q = torch.cat([q_nope, q_pe], dim=-1)[start : start + q_len].transpose(0, 1)  # [H, Lq, D]
        scores = q @ keys.transpose(1, 2) * scale
        q_pos = torch.arange(s_len - q_len, s_len).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(s_len).unsqueeze(0) > q_pos, float("-inf"))
        want = (scores.softmax(-1) @ values).transpose(0, 1)  # [Lq, H, dv]
        torch.testing.assert_close(out[start : start + q_len], want, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"request {r} ({'decode' if q_len == 1 else 'prefill'}): {m}")
        start += q_len


def test_backend_selection_serves_the_mla_kind(checkpoint):
    """cpu_native serves MLA layers (tests/models/test_deepseek_cpu_native.py), so the CPU platform picks it
    first; fp8 latent pages, which it does not declare, take the torch backend."""
    from halserve.attention_backends.cpu_native import CpuNativeAttentionBackend
    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info
    from halserve.platforms.cpu import CpuPlatform
    from halserve.worker.backend_selection import select_attention_backend

    path = checkpoint("v2_lite")
    platform = CpuPlatform()
    auto = EngineConfig(model=path, dtype="float32")
    info = get_model_info(auto, platform)
    assert select_attention_backend(auto, platform, info) is CpuNativeAttentionBackend
    fp8 = EngineConfig(model=path, dtype="float32", kv_cache_dtype="fp8")
    assert select_attention_backend(fp8, platform, info) is TorchAttentionBackend
    # the latent and the rotary key of 3 layers, float32 (per-head K/V would be 2 x 3 x 4 x 8 x 4 bytes)
    assert info.kv_cache_bytes_per_token == 3 * (RANK + ROPE) * 4 == 480


@pytest.mark.slow  # the engine, twice per shape
@pytest.mark.parametrize("shape", ["v2_lite", "v3"])
def test_engine_greedy_with_chunks_preemption_prefix_hits(checkpoint, shape):
    from halserve import LLM

    path = checkpoint(shape)
    shared = [1, 45, 74, 299, 17, 273, 5, 88, 410, 9, 33, 61, 7, 190, 222, 3, 48, 91]
    prompts = [shared + [100 + i for i in range(15)], shared + [300, 301, 302], [1] + [200 + 3 * i for i in range(30)]]
    max_tokens = 12
    want = hf_greedy(path, prompts, max_tokens)
    block_size, layers, elem = 4, LAYERS, 4
    page = block_size * (RANK + ROPE) * elem  # one block of one layer: the latent and the rotary key
    num_blocks = 24  # fewer than the three requests' 2 x 12 + 10 blocks: someone is preempted
    llm = LLM(path, platform="cpu", dtype="float32", block_size=block_size, max_num_batched_tokens=16,
              max_model_len=128, kv_cache_memory=num_blocks * layers * page + page)  # (+ a partial block)
    try:
        runner = llm.llm_engine.core.executor.worker.model_runner
        assert runner.bytes_per_block() == layers * page == 3 * 4 * 40 * 4  # hand count: no per-head K/V
        assert runner.kv_caches[0].shape == (num_blocks, block_size, RANK + ROPE)
        manager = llm.llm_engine.core.scheduler.kv_cache_manager
        assert manager.num_groups == 1 and manager.specs == [MLASpec(RANK, ROPE)]
        assert manager.num_usable_blocks == num_blocks - 1  # (block 0: the null block)
        got = generate_ids(llm, prompts, greedy_params(max_tokens))
        assert got == want
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0, "the tiny cache should have forced preemption"
        assert stats.prefix_cache_hits > 0, "the shared prefix should hit the prefix cache"
        hits = stats.prefix_cache_hits
        assert generate_ids(llm, prompts, greedy_params(max_tokens)) == want  # now from the prefix cache
        assert llm.llm_engine.get_stats().prefix_cache_hits > hits
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow  # the engine
def test_engine_fp8_latent_pages(checkpoint):
    """An fp8 cache holds the latents in one byte each (the page a quarter of float32's); greedy decoding
    runs through them (tokens may differ from transformers' float32, so only lengths are checked)."""
    from halserve import LLM

    llm = LLM(checkpoint("v3"), platform="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16,
              max_model_len=64, kv_cache_dtype="fp8", num_kv_blocks=32)
    try:
        runner = llm.llm_engine.core.executor.worker.model_runner
        assert runner.kv_caches[0].dtype == torch.float8_e4m3fn
        assert runner.bytes_per_block() == LAYERS * 4 * (RANK + ROPE) * 1
        got = generate_ids(llm, [[1, 45, 74, 299, 17, 273, 5, 88, 410, 9], [1, 300]], greedy_params(6))
        assert [len(g) for g in got] == [6, 6]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow  # two spawned ranks
def test_two_tensor_parallel_ranks_match_transformers(checkpoint):
    from halserve import LLM

    path = checkpoint("v3")
    prompts = [[1, 45, 74, 299, 17, 273, 5, 88, 410, 9, 33, 61, 7, 190, 222, 3, 48, 91, 120], [1, 300, 301]]
    want = hf_greedy(path, prompts, 8)
    llm = LLM(path, platform="cpu", dtype="float32", tensor_parallel_size=2, block_size=4,
              max_num_batched_tokens=16, max_model_len=64)
    try:
        assert llm.llm_engine.core.executor.world_size == 2  # (two processes, the heads split between them)
        assert generate_ids(llm, prompts, greedy_params(8)) == want
    finally:
        llm.llm_engine.shutdown()
