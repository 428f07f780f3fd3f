"""Embeddings (vLLM's ``PoolingParams``): a request that returns a pooled final hidden state of
its prompt instead of generating (``LLM.embed``, ``POST /v1/embeddings``).

The engine runs the prompt as an ordinary request that stops after one token; the model
runner pools the final-norm hidden states of the prompt (``halserve.worker.pooler``):

    LAST  the last prompt token's (decoder embedding models: Qwen3-Embedding, gte-Qwen2, e5-mistral)
    MEAN  the average over every prompt token (most sentence-transformers models)
    CLS   the first prompt token's (BERT-style models)

A request leaves ``pooling_type`` and ``normalize`` unset to take the model's defaults
(``halserve.pooler_config``: the checkpoint's sentence-transformers files or ``--pooler-config``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from halserve.pooler_config import PoolerConfig

POOLING_TYPES = ("LAST", "MEAN", "CLS")  # vLLM's names
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

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        if self.dimensions is not None and (type(self.dimensions) is not int or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if isinstance(self.pooling_type, str):
            self.pooling_type = self.pooling_type.upper()  # (any case, as --pooler-config)
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    def check(self, hidden_size: int) -> None:
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions {self.dimensions} exceeds the model's embedding size {hidden_size}")

    def with_defaults(self, config: "PoolerConfig") -> "PoolingParams":
        """These params with the fields left unset taken from the model's pooler config
        (``self`` when nothing is unset). Called by the engine when the request is added."""
        if self.normalize is not None and self.pooling_type is not None:
            return self
        return replace(
            self,
            normalize=config.normalize if self.normalize is None else self.normalize,
            pooling_type=config.pooling_type if self.pooling_type is None else self.pooling_type,
        )

    @property
    def reads_whole_prompt(self) -> bool:
        """Whether pooling needs the hidden state of every prompt position (MEAN, CLS): the
        KV-cache manager then gives the request no prefix-cache hit, whose tokens would be skipped."""
        return self.pooling_type in WHOLE_PROMPT_POOLING_TYPES
