"""Write weight-less model folders for ``--load-format dummy`` benchmarks: the real architecture's
config.json, a generation_config.json and a tokenizer that covers every id of its vocabulary.

    python benchmarks/gpu/make_configs.py DIR             # llama-3.1-8b, qwen2.5-0.5b, qwen3-30b-a3b
    python benchmarks/gpu/make_configs.py DIR --tiny      # the same architectures, tiny (CPU dry run)

The tokenizer is a word-level one with a token per id (``t0``, ``t1``, ...) and the model's own
special tokens at their ids: the device has no network to fetch the real ones, and decode speed
does not depend on the tokenizer, only on ``vocab_size`` (the LM head and the sampler read it).
"""
from __future__ import annotations

import argparse
import json
import os

LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001, "initializer_range": 0.02,
    "pretraining_tp": 1,
}
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643,
    "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21, "initializer_range": 0.02,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643,
    "eos_token_id": 151645, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48,
    "initializer_range": 0.02,
}
MODELS = {"llama-3.1-8b": LLAMA_3_1_8B, "qwen2.5-0.5b": QWEN2_5_0_5B, "qwen3-30b-a3b": QWEN3_30B_A3B}
# --tiny: the same architectures at sizes a CPU runs in seconds (head size 64: triton_paged's smallest)
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 16384,
        "bos_token_id": 1, "eos_token_id": 2, "moe_intermediate_size": 64, "num_experts": 4,
        "num_experts_per_tok": 2, "max_window_layers": 2}


# the special tokens' real names (transformers' tokenizer class for a model type adds its own
# special tokens by name when they are missing, which would grow the vocabulary past vocab_size)
SPECIAL_NAMES = {"llama": ("<|begin_of_text|>", "<|end_of_text|>"), "qwen2": ("<|endoftext|>", "<|endoftext|>"),
                 "qwen3_moe": ("<|endoftext|>", "<|im_end|>")}


def write_tokenizer(path: str, vocab_size: int, bos_id: int, eos_id: int, model_type: str = "") -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bos_name, eos_name = SPECIAL_NAMES.get(model_type, ("<|bos|>", "<|eos|>"))
    names = {bos_id: bos_name, eos_id: eos_name}
    vocab = {names.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0" if 0 not in names else names[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=names[bos_id], eos_token=names[eos_id],
                                   pad_token=names[eos_id])
    fast.model_max_length = 1 << 20
    fast.save_pretrained(path)
    # the model type's own tokenizer class (Qwen2Tokenizer) would add its special tokens on top
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        tokenizer_config = json.load(f)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(tokenizer_config, f, indent=2)


def write_model(root: str, name: str, tiny: bool) -> str:
    config = dict(MODELS[name])
    if tiny:
        same = config["bos_token_id"] == config["eos_token_id"]
        config.update({k: v for k, v in TINY.items() if k in config or k in ("head_dim",)})
        if same:
            config["bos_token_id"] = config["eos_token_id"]
    path = os.path.join(root, name + ("-tiny" if tiny else ""))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, f)
    write_tokenizer(path, config["vocab_size"], config["bos_token_id"], config["eos_token_id"], config["model_type"])
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root")
    p.add_argument("--tiny", action="store_true", help="tiny sizes of the same architectures (CPU dry run)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = p.parse_args()
    for name in args.models:
        print(write_model(args.root, name, args.tiny))


if __name__ == "__main__":
    main()
