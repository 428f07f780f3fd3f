"""Embeddings (vLLM's ``PoolingParams``): a request that returns a pooled final hidden state of
its prompt instead of generating (``LLM.embed``, ``POST /v1/embeddings``).

The engine runs the prompt as an ordinary request that stops after one token; the model
runner pools the final-norm hidden states of the prompt (``halserve.worker.pooler``):

    LAST  the last prompt token's (decoder embedding models: Qwen3-Embedding, gte-Qwen2, e5-mistral)
    MEAN  the average over every prompt token (most sentence-transformers models)
    CLS   the first prompt token's (BERT-style models)

A request leaves ``pooling_type`` and ``normalize`` unset to take the model's defaults
(``halserve.pooler_config``: the checkpoint's sentence-transformers files or ``--pooler-config``).

Classification (``task="classify"``: ``LLM.classify``, ``POST /classify``) pools the same way and
then applies the classifier model's ``score`` head (``halserve.models.sequence_classification``)
to the pooled row: class probabilities, or the raw logits with ``activation=False``. Which task a
model serves is fixed by its architecture (``check_task``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from halserve.models.loader import ModelInfo
    from halserve.pooler_config import PoolerConfig
    from halserve.sampling_params import SamplingParams

POOLING_TYPES = ("LAST", "MEAN", "CLS")  # vLLM's names
TASKS = ("embed", "classify")
# Types that read every prompt position, so a request of one never starts from a prefix-cache hit.
WHOLE_PROMPT_POOLING_TYPES = ("MEAN", "CLS")


@dataclass(slots=True)
class PoolingParams:
    normalize: bool | None = None
    """Scale the embedding to unit L2 norm (cosine similarity becomes a dot product);
    None: the model's default (True unless its sentence-transformers config has no Normalize)."""
    dimensions: int | None = None
    """Keep only the first this many dimensions (Matryoshka models), normalized after the cut."""
    pooling_type: str | None = None
    """LAST, MEAN or CLS; None: the model's (its pooler config), which the engine fills in."""
    task: str | None = None
    """embed or classify; None: set by the API that runs it (``LLM.embed``, ``LLM.classify``), embed if not."""
    activation: bool | None = None
    """classify only: apply the classifier's activation (softmax over the classes; sigmoid for a
    single label or a multi-label model); False returns the raw logits. None: True."""

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        if self.dimensions is not None and (type(self.dimensions) is not int or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if isinstance(self.pooling_type, str):
            self.pooling_type = self.pooling_type.upper()  # (any case, as --pooler-config)
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.activation is not None and not isinstance(self.activation, bool):
            raise ValueError(f"activation must be true or false, got {self.activation!r}")
        if self.task == "classify" and (self.normalize is not None or self.dimensions is not None):
            raise ValueError("normalize and dimensions apply to embeddings; a classify request takes activation "
                             "(false: raw logits) instead")
        if self.task == "embed" and self.activation is not None:
            raise ValueError("activation applies to classify requests; an embedding request takes normalize instead")

    def check(self, hidden_size: int) -> None:
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions {self.dimensions} exceeds the model's embedding size {hidden_size}")

    def with_defaults(self, config: PoolerConfig) -> PoolingParams:
        """These params with the fields left unset taken from the model's pooler config
        (``self`` when nothing is unset). Called by the engine when the request is added. A
        classify request takes only the pooling type (its activation defaults in the runner)."""
        if self.task == "classify":
            return self if self.pooling_type is not None else replace(self, pooling_type=config.pooling_type)
        if self.normalize is not None and self.pooling_type is not None and self.task is not None:
            return self
        return replace(
            self,
            normalize=config.normalize if self.normalize is None else self.normalize,
            pooling_type=config.pooling_type if self.pooling_type is None else self.pooling_type,
            task="embed",
        )

    @property
    def reads_whole_prompt(self) -> bool:
        """Whether pooling needs the hidden state of every prompt position (MEAN, CLS): the
        KV-cache manager then gives the request no prefix-cache hit, whose tokens would be skipped."""
        return self.pooling_type in WHOLE_PROMPT_POOLING_TYPES


def check_task(params: SamplingParams, model_info: ModelInfo) -> None:
    """Refuse, naming what to use instead, a request the model cannot serve: a classification
    model (``model_info.runner == "pooling"``: a ``*ForSequenceClassification`` checkpoint, no LM
    head) only classifies; a generative model generates and embeds but has no classifier head.
    Called by the input processor, so every route (offline and HTTP) gets the same error."""
    pooling = params.pooling
    task = "generate" if pooling is None else pooling.task or "embed"
    arch = getattr(model_info, "architecture", "unknown architecture")
    if getattr(model_info, "runner", "generate") == "pooling":
        if task != "classify":
            what = "generate text" if task == "generate" else "compute embeddings (as in vLLM)"
            raise ValueError(f"the model is a classification model ({arch}, num_labels={model_info.num_labels}): "
                             f"it cannot {what}; use LLM.classify or POST /classify")
        if params.prompt_logprobs is not None:
            raise ValueError(f"prompt_logprobs needs a generative model; the classification model ({arch}) has "
                             "no LM head to score prompt tokens")
    elif task == "classify":
        raise ValueError(f"the model is a generative model ({arch}) with no classification head; classify needs a "
                         "*ForSequenceClassification checkpoint (e.g. Qwen2ForSequenceClassification). Use "
                         "LLM.generate or /v1/completions to generate, LLM.embed or /v1/embeddings to embed")
