"""Tiny random-weight HF checkpoints for tests, fully offline.

    from model_factory import make_checkpoint
    path = make_checkpoint(tmp_path, "qwen3", num_layers=2)
    AutoTokenizer.from_pretrained(path); AutoModelForCausalLM.from_pretrained(path)

``make_checkpoint(tmp_dir, arch="llama"|"mistral"|"qwen2"|"qwen3", *, vocab_size=512,
hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=None,
intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=False,
rope_scaling=None, sliding_window=None, max_shard_size=None, seed=0, added_tokens=(), layer_scale=1.0, **overrides) -> str``

writes into ``tmp_dir`` (created if needed; returned as a str):
- ``config.json`` + ``model.safetensors`` (or shards + index when ``max_shard_size``,
  e.g. ``"40KB"``), float32, from ``XForCausalLM(config)`` seeded with ``seed``;
  weights are re-drawn at unit-preserving scale (std 1/sqrt(hidden)), biases and norm
  weights randomised too, so logits are spread out and every tensor matters;
- ``generation_config.json`` with bos=1, eos=2, pad=0;
- a byte-level BPE tokenizer trained in-process on generated English text, padded with
  ``<extra_N>`` tokens so ``len(tokenizer) == vocab_size``; special tokens ``<pad>`` (0),
  ``<s>`` (1, prepended on encode), ``</s>`` (2), ``<|system|>``, ``<|user|>``,
  ``<|assistant|>``; ``added_tokens`` (e.g. ``("<think>", "</think>")``) as ordinary
  added tokens; and a Jinja chat template using them.

``layer_scale`` < 1 shrinks the decoder layers' weights: the next token then depends mostly on
the current one, so greedy text soon repeats itself (what prompt-lookup speculative decoding
needs to accept drafts), while attention still moves the logits.

``rope_scaling`` is a dict like ``{"rope_type": "llama3", "factor": 8.0, ...}``;
``sliding_window`` turns the window on (Qwen2/3: for layers >= ``max_window_layers``,
default 0 = every layer). ``overrides`` go to the HF config (``attention_bias=True``,
``mlp_bias=True``, ``rope_theta=...``, ``max_window_layers=1``, ...).

``with_sentence_transformers_config(path, tmp_dir, pooling_mode, normalize)`` copies a checkpoint
and adds sentence-transformers' ``modules.json`` and ``1_Pooling/config.json`` (embedding defaults).

``with_vocab_size(path, tmp_dir, vocab_size)`` copies a checkpoint whose model then knows only its
first ``vocab_size`` tokens (e.g. 3: ``<pad>``, ``<s>``, ``</s>``), small enough for exhaustive
searches; the tokenizer stays whole.
"""
from __future__ import annotations

import json
import math
import os
import random

import torch

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = [PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_WORDS = (
    "the a an of to and in is it that for on with as was he she they we you I his her their this "
    "be at by from or have had not but what all were when there can said which do how each if will "
    "up out many then them these so some would make like time look two more write go see number no "
    "way could people my than first water been call who oil its now find long down day did get come "
    "made may part hello world model token server request cache block attention layer weight "
    "quick brown fox jumps over lazy dog once upon story tell me about paris france capital city "
    "question answer small large fast slow red green blue one three four five six seven eight nine ten"
).split()


def _corpus(seed: int, num_sentences: int = 400) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        words[0] = words[0].capitalize()
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2024)))
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ",", ":"]))
    return lines


def make_tokenizer(vocab_size: int, seed: int = 0, added_tokens: tuple[str, ...] = ()):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with exactly ``vocab_size`` tokens, ``added_tokens``
    (e.g. ``("<think>", "</think>")``) among them as ordinary added tokens, one id each."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer; use >= {min_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added_tokens), special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.add_tokens(list(added_tokens))
    extra = [f"<extra_{i}>" for i in range(vocab_size - tok.get_vocab_size())]
    if extra:  # a small corpus may not yield enough merges: pad so ids cover the vocab
        tok.add_special_tokens(extra)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) == vocab_size, (len(fast), vocab_size)
    return fast


def _hf_config(arch: str, *, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
               intermediate_size, max_position_embeddings, tie_word_embeddings, rope_scaling, sliding_window,
               overrides):
    import transformers

    config_cls = getattr(transformers, ARCHS[arch][0])
    rope_theta = overrides.pop("rope_theta", 10000.0)
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=1.0 / math.sqrt(hidden_size),
        rope_parameters={"rope_theta": rope_theta, **({"rope_type": "default"} | dict(rope_scaling or {}))},
    )
    if arch == "qwen3" or head_dim is not None:
        kwargs["head_dim"] = head_dim or hidden_size // num_heads
    if arch == "mistral":
        kwargs["sliding_window"] = sliding_window
    elif arch in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = sliding_window is not None
        kwargs["sliding_window"] = sliding_window
        kwargs["max_window_layers"] = overrides.pop("max_window_layers", 0)
    elif sliding_window is not None:
        raise ValueError(f"sliding_window is not a {arch} option; use mistral, qwen2 or qwen3")
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config.architectures = [ARCHS[arch][1]]
    config.dtype = "float32"
    return config


def _randomize(model: torch.nn.Module, hidden_size: int, seed: int, layer_scale: float = 1.0) -> None:
    """Weights at std 1/sqrt(hidden), biases ~0.1, norm weights around 1: spread-out logits.
    ``layer_scale`` multiplies the decoder layers' weights (not the embeddings nor the LM head)."""
    gen = torch.Generator().manual_seed(seed)
    std = 1.0 / math.sqrt(hidden_size)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(std * noise * (layer_scale if ".layers." in name else 1.0))


def make_checkpoint(tmp_dir, arch: str = "llama", *, vocab_size: int = 512, hidden_size: int = 64,
                    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                    intermediate_size: int = 128, max_position_embeddings: int = 512,
                    tie_word_embeddings: bool = False, rope_scaling: dict | None = None,
                    sliding_window: int | None = None, max_shard_size: str | int | None = None, seed: int = 0,
                    added_tokens: tuple[str, ...] = (), layer_scale: float = 1.0, **overrides) -> str:
    """Write a tiny random checkpoint + tokenizer into ``tmp_dir``; see the module docstring."""
    import transformers
    from transformers import GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {', '.join(ARCHS)}")
    path = os.fspath(tmp_dir)
    os.makedirs(path, exist_ok=True)
    config = _hf_config(
        arch, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling, sliding_window=sliding_window, overrides=dict(overrides),
    )
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHS[arch][1])(config).to(torch.float32)
    _randomize(model, hidden_size, seed, layer_scale)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    make_tokenizer(vocab_size, seed, added_tokens).save_pretrained(path)
    return path


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def with_sentence_transformers_config(path: str, tmp_dir, pooling_mode: str, normalize: bool) -> str:
    """A copy of checkpoint ``path`` in ``tmp_dir`` with sentence-transformers files: ``modules.json``
    (Transformer, Pooling in ``1_Pooling``, and Normalize when ``normalize``) and
    ``1_Pooling/config.json`` whose only true flag is ``pooling_mode`` (e.g. ``"pooling_mode_mean_tokens"``)."""
    import shutil

    out = os.fspath(tmp_dir)
    shutil.copytree(path, out, dirs_exist_ok=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    flags = ["pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
             "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken"]
    pooling = {"word_embedding_dimension": read_config(path)["hidden_size"],
               **{flag: flag == pooling_mode for flag in flags}, "include_prompt": True}
    os.makedirs(os.path.join(out, "1_Pooling"), exist_ok=True)
    with open(os.path.join(out, "modules.json"), "w", encoding="utf-8") as f:
        json.dump(modules, f)
    with open(os.path.join(out, "1_Pooling", "config.json"), "w", encoding="utf-8") as f:
        json.dump(pooling, f)
    return out


def with_vocab_size(path: str, tmp_dir, vocab_size: int) -> str:
    """A copy of (single-file) checkpoint ``path`` in ``tmp_dir`` whose embedding and lm_head keep
    their first ``vocab_size`` rows and whose config says so. The tokenizer is kept whole: prompts
    are given as token ids below ``vocab_size``, and every id the model can produce decodes."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = os.fspath(tmp_dir)
    shutil.copytree(path, out, dirs_exist_ok=True)
    config = read_config(path)
    old_size = config["vocab_size"]
    weights = load_file(os.path.join(path, "model.safetensors"))
    for name, tensor in weights.items():
        if ("embed_tokens" in name or "lm_head" in name) and tensor.shape[0] == old_size:
            weights[name] = tensor[:vocab_size].contiguous()
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config["vocab_size"] = vocab_size
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return out
