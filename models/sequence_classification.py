"""Sequence classifiers and reward models of the Llama family: transformers'
``LlamaForSequenceClassification``, ``MistralForSequenceClassification``,
``Qwen2ForSequenceClassification`` and ``Qwen3ForSequenceClassification`` (reward models such as
Skywork-Reward-Llama are the first, with one label).

    hidden = LlamaModel(input_ids, positions)     [T, H]   the decoder of llama.py, final norm applied
    pooled = hidden[last prompt token]            [N, H]   the model runner's pooler (LAST)
    logits = pooled @ score.weight.T              [N, num_labels]   score: Linear(H, num_labels, bias=False)
    output = activation(logits)                   softmax / sigmoid / identity (``classifier_activation``)

transformers pools the rightmost token that is not ``pad_token_id``; for an unpadded prompt that
is its last token, which is what halserve (like vLLM) always takes, even if the prompt ends in the
pad token.

The model-module protocol of ``LlamaForCausalLM``, with ``classify`` in place of ``compute_logits``
(there is no LM head: the runner never samples a token for these models)::

    forward(input_ids [T], positions [T]) -> hidden [T, H]
    classify(hidden [N, H]) -> float32 [N, num_labels]   raw logits
    activate(logits [N, num_labels]) -> float32 [N, num_labels]
    attention_layers, load_weights                        as LlamaForCausalLM's
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from halserve.layers import ModelContext
from halserve.models.llama import LlamaForCausalLM, LlamaModel


def classifier_activation(hf_config: Any) -> str:
    """What turns a classifier's logits into its output, read from the config as transformers'
    classification losses read it (and as vLLM serves it): ``problem_type`` "regression" ->
    identity (the logits are the scores), "multi_label_classification" -> a sigmoid per class;
    otherwise softmax over the classes, or a sigmoid when there is a single label (reward
    models, cross-encoders), where a softmax would always give 1."""
    problem_type = getattr(hf_config, "problem_type", None)
    if problem_type == "regression":
        return "identity"
    if problem_type == "multi_label_classification":
        return "sigmoid"
    return "sigmoid" if hf_config.num_labels < 2 else "softmax"


class ClassifierHead:
    """The ``score`` head of a decoder classifier, shared by ``LlamaForSequenceClassification`` and the
    Transformers backend's ``TransformersForSequenceClassification``: ``build_score_head`` in the model's
    ``__init__``, then ``classify`` and ``activate`` as the pooling runner calls them."""

    score: nn.Linear
    activation: str

    def build_score_head(self, hf_config: Any, ctx: ModelContext) -> None:
        # [num_labels, H], a few rows: every tensor-parallel rank holds all of it, as the final hidden
        # state is whole on every rank
        self.score = nn.Linear(hf_config.hidden_size, hf_config.num_labels, bias=False, dtype=ctx.dtype)
        self.activation = classifier_activation(hf_config)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw class logits [N, num_labels] of pooled final hidden states [N, H], in float32
        (as vLLM's float32 head; transformers computes them in the model's dtype)."""
        return nn.functional.linear(hidden.float(), self.score.weight.float())

    def activate(self, logits: torch.Tensor) -> torch.Tensor:
        """The config's activation (``classifier_activation``) of ``classify``'s logits, per row."""
        if self.activation == "softmax":
            return logits.softmax(dim=-1)
        if self.activation == "sigmoid":
            return logits.sigmoid()
        return logits


class LlamaForSequenceClassification(ClassifierHead, nn.Module):
    STACKED_PARAMS = LlamaForCausalLM.STACKED_PARAMS
    supports_pipeline_parallel = True

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        super().__init__()
        num_labels = getattr(hf_config, "num_labels", 0)
        if not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"a sequence classifier needs num_labels >= 1 in its config.json, got {num_labels!r}")
        self.config = hf_config
        self.model = LlamaModel(hf_config, ctx)
        # (read by the decoder's load_weights: a classifier checkpoint has no lm_head to skip or tie,
        # whatever its config's tie_word_embeddings says)
        self.tie_word_embeddings = False
        self.build_score_head(hf_config, ctx)

    # The decoder's, unchanged: the same checkpoint names, plus `score.weight` (a plain parameter).
    forward = LlamaForCausalLM.forward
    attention_layers = LlamaForCausalLM.attention_layers
    load_weights = LlamaForCausalLM.load_weights
