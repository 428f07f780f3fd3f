"""halserve's Llama-family models against transformers on tiny random checkpoints (fp32):
one flattened multi-prompt prefill step (all-token logits), then greedy decoding through
the paged cache (token-identical to HF ``generate``)."""
from __future__ import annotations

import pytest
import torch
from model_factory import make_checkpoint
from paged_harness import PagedHarness

from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.config import EngineConfig
from halserve.models.loader import get_model_info, load_model
from halserve.platforms.cpu import CpuPlatform

TEXTS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Tell me a story",
    "What is the capital city of France? Paris is the capital.",
    "one two",
]
ATOL = 1e-4


def load(path: str, max_model_len: int | None = None):
    config = EngineConfig(model=path, dtype="float32", max_model_len=max_model_len)
    platform = CpuPlatform()
    info = get_model_info(config, platform)
    return load_model(config, info, platform, TorchAttentionBackend, progress=False), info


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts_for(path: str, texts=TEXTS) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok(t).input_ids for t in texts]


def check_against_hf(path: str, *, decode_steps: int = 4, block_size: int = 4, texts=TEXTS,
                     max_model_len: int | None = None):
    model, _ = load(path, max_model_len)
    hf = hf_model(path)
    prompts = prompts_for(path, texts)
    harness = PagedHarness(model, TorchAttentionBackend, block_size=block_size)

    logits = harness.step([(f"r{i}", p) for i, p in enumerate(prompts)])  # one flattened prefill
    offset, next_tokens = 0, []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            want = hf(torch.tensor([prompt])).logits[0]  # [len, vocab]
            got = logits[offset : offset + len(prompt)]
            torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4, msg=lambda m: f"prompt {i}: {m}")
            next_tokens.append(int(got[-1].argmax()))
            offset += len(prompt)

    generated = [[t] for t in next_tokens]
    for _ in range(decode_steps - 1):  # batched decodes through the paged cache
        logits = harness.step([(f"r{i}", [g[-1]]) for i, g in enumerate(generated)])
        for i, g in enumerate(generated):
            g.append(int(logits[i].argmax()))

    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=decode_steps, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
            assert generated[i][: len(out)] == out, f"prompt {i}: halserve {generated[i]} vs HF {out}"
    return model


def test_llama_sharded_checkpoint(tmp_path):
    path = make_checkpoint(tmp_path, "llama", max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    check_against_hf(path)


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
], ids=lambda r: r["rope_type"])
def test_llama_rope_scaling(tmp_path, rope_scaling):
    check_against_hf(make_checkpoint(tmp_path, "llama", rope_scaling=rope_scaling), decode_steps=3)


def test_llama_tied_embeddings_and_biases(tmp_path):
    path = make_checkpoint(tmp_path, "llama", tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    model = check_against_hf(path, decode_steps=3)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_qwen2_biases_and_per_layer_sliding_window(tmp_path):
    # layer 0 full attention, layer 1 window 6; prompts are longer than the window
    path = make_checkpoint(tmp_path, "qwen2", sliding_window=6, max_window_layers=1)
    model = check_against_hf(path, decode_steps=3)
    assert [layer.sliding_window for layer in model.attention_layers] == [None, 6]
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None


def test_qwen3_head_dim_and_qk_norm_tied(tmp_path):
    path = make_checkpoint(tmp_path, "qwen3", head_dim=32, tie_word_embeddings=True)  # 32 != 64 / 4
    model = check_against_hf(path, decode_steps=3)
    assert model.attention_layers[0].head_size == 32


def test_mistral_sliding_window_longer_prompt(tmp_path):
    path = make_checkpoint(tmp_path, "mistral", sliding_window=8)
    model = check_against_hf(path, decode_steps=5)
    assert all(layer.sliding_window == 8 for layer in model.attention_layers)


def test_chunked_prefill_after_prefix_matches_full_prefill(tmp_path):
    """A prompt split over two steps (the second mixed with another request's decode)
    ends with the same logits as HF over the whole prompt."""
    path = make_checkpoint(tmp_path, "llama", num_kv_heads=1)
    model, _ = load(path)
    hf = hf_model(path)
    long_prompt, other = prompts_for(path, [TEXTS[2], TEXTS[1]])
    harness = PagedHarness(model, TorchAttentionBackend, block_size=4)
    harness.step([("long", long_prompt[:6]), ("other", other)])
    other_next = int(harness.step([("other", [5])])[0].argmax())  # a decode step in between
    logits = harness.step([("other", [other_next]), ("long", long_prompt[6:])])
    with torch.no_grad():
        want = hf(torch.tensor([long_prompt])).logits[0, 6:]
        want_other = hf(torch.tensor([other + [5, other_next]])).logits[0, -1]
    torch.testing.assert_close(logits[1:], want, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[0], want_other, atol=ATOL, rtol=1e-4)
