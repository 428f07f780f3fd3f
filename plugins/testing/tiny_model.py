"""A tiny random-weight Llama checkpoint with a byte-level tokenizer, made offline in ~0.1 s.

The conformance kit is installed code, so it cannot use halserve's test helpers: this
module writes everything an engine needs with plain torch, safetensors and tokenizers::

    from halserve.plugins.testing.tiny_model import make_tiny_checkpoint
    path = make_tiny_checkpoint("/tmp/tiny", head_size=64)

    python -m halserve.plugins.testing.tiny_model /tmp/tiny      # the same, from a shell

Files: ``config.json`` (``LlamaForCausalLM``, float32), ``model.safetensors`` (weights at
std 1/sqrt(fan_in), norm weights around 1, so logits are spread out and greedy decoding
is decisive), ``generation_config.json`` (bos 1, eos 2) and a byte-level BPE tokenizer
without merges: ids 0..5 are special tokens, then one token per byte, then padding
tokens up to ``vocab_size``. Same arguments, same bytes.
"""
from __future__ import annotations

import argparse
import json
import math
import os

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def make_tiny_checkpoint(
    path: str | os.PathLike,
    *,
    head_size: int = 32,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    vocab_size: int = 320,
    max_position_embeddings: int = 256,
    sliding_window: int | None = None,
    seed: int = 0,
) -> str:
    """Write the checkpoint into ``path`` (created if needed) and return it as a str.

    ``head_size`` may differ from ``hidden_size // num_heads`` (it is written as
    ``head_dim``), so a backend that only takes some head sizes can still be tested.
    ``sliding_window`` makes it a Mistral checkpoint (same weights layout) with that window.
    """
    import torch
    from safetensors.torch import save_file

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer; use >= {MIN_VOCAB}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=gen)

    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    weights = {"model.embed_tokens.weight": torch.randn(vocab_size, hidden_size, generator=gen)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(hidden_size)
        weights[p + "self_attn.q_proj.weight"] = linear(q_size, hidden_size)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_size, hidden_size)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_size, hidden_size)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden_size, q_size)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden_size)
        weights[p + "mlp.gate_proj.weight"] = linear(intermediate_size, hidden_size)
        weights[p + "mlp.up_proj.weight"] = linear(intermediate_size, hidden_size)
        weights[p + "mlp.down_proj.weight"] = linear(hidden_size, intermediate_size)
    weights["model.norm.weight"] = norm(hidden_size)
    weights["lm_head.weight"] = linear(vocab_size, hidden_size) * 4.0  # decisive greedy choices
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})

    arch, model_type = ("MistralForCausalLM", "mistral") if sliding_window else ("LlamaForCausalLM", "llama")
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_size,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }
    if sliding_window:
        config["sliding_window"] = sliding_window
    _write_json(os.path.join(path, "config.json"), config)
    _write_json(os.path.join(path, "generation_config.json"), {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    _save_tokenizer(path, vocab_size)
    return path


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)


def _save_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    # every byte is a token (no merges): any text encodes, every id decodes
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for i in range(vocab_size - len(vocab)):
        vocab[f"<extra_{i}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(SPECIAL_TOKENS + [t for t in vocab if t.startswith("<extra_")])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m halserve.plugins.testing.tiny_model",
        description="Write a tiny random-weight Llama checkpoint (with tokenizer) for smoke tests.",
    )
    parser.add_argument("path", help="output directory (created if needed)")
    parser.add_argument("--head-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_tiny_checkpoint(args.path, head_size=args.head_size, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
