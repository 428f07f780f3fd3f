"""Tiny random-weight sequence-classification checkpoints, written by transformers' own
``*ForSequenceClassification`` classes (the decoder of ``model_factory`` plus ``score``).

``make_classifier(tmp_dir, arch="qwen2", num_labels=3, id2label=None, seed=0, **config_overrides) -> str``
writes config.json (``architectures``: e.g. ``Qwen2ForSequenceClassification``, ``num_labels``,
``id2label``, ``pad_token_id`` 0, which transformers' head needs to find the last token),
model.safetensors (float32) and model_factory's tokenizer into ``tmp_dir``.
``hf_logits(path)`` returns a function: token ids -> transformers' pooled logits [num_labels].
"""
from __future__ import annotations

import os

import torch
from model_factory import ARCHS, _hf_config, _randomize, make_tokenizer

HIDDEN_SIZE = 64
VOCAB_SIZE = 512


def classifier_architecture(arch: str) -> str:
    return ARCHS[arch][1].replace("ForCausalLM", "ForSequenceClassification")


def make_classifier(tmp_dir, arch: str = "qwen2", num_labels: int = 3, id2label: dict[int, str] | None = None,
                    seed: int = 0, **config_overrides) -> str:
    import transformers

    path = os.fspath(tmp_dir)
    os.makedirs(path, exist_ok=True)
    config = _hf_config(arch, vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=None, intermediate_size=128, max_position_embeddings=512,
                        tie_word_embeddings=False, rope_scaling=None, sliding_window=None, overrides=config_overrides)
    config.num_labels = num_labels
    if id2label is not None:
        config.id2label = dict(id2label)
        config.label2id = {label: i for i, label in id2label.items()}
    config.architectures = [classifier_architecture(arch)]
    torch.manual_seed(seed)
    model = getattr(transformers, classifier_architecture(arch))(config).to(torch.float32)
    _randomize(model, HIDDEN_SIZE, seed)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(VOCAB_SIZE, seed).save_pretrained(path)
    return path


def hf_logits(path: str):
    """transformers' classifier logits [num_labels] (float32) of one unpadded token-id prompt."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0]

    return run
