"""The throughput workloads of BENCHMARKS.md: random-weight Llama checkpoints, vocab 8192.

    W1: hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2048 (~88M params);
        64 prompts x 128 random tokens, 128 output tokens each.
    W2: hidden 256, 4 layers, 4 heads, 2 KV heads, intermediate 512 (~6.5M params);
        256 prompts x 32 tokens, 64 output tokens each.

``python benchmarks/workloads.py DIR`` writes both checkpoints (with a WordLevel
tokenizer of the same vocabulary, so every server can load them) under DIR.
"""
from __future__ import annotations

import os
import sys

WORKLOADS = {
    "W1": dict(
        model=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                   intermediate_size=2048),
        num_prompts=64, input_len=128, output_len=128,
    ),
    "W2": dict(
        model=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=512),
        num_prompts=256, input_len=32, output_len=64,
    ),
}
VOCAB = 8192


def ensure_checkpoint(name: str, root: str) -> str:
    path = os.path.join(root, name)
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False, dtype="float32", **WORKLOADS[name]["model"])
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return path


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else "bench_out/models"
    for name in WORKLOADS:
        print(name, ensure_checkpoint(name, root))
