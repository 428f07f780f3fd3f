"""Embeddings (vLLM's ``PoolingParams``): a request that returns the model's last hidden state
of its prompt's last token instead of generating (``LLM.embed``, ``POST /v1/embeddings``).

Last-token pooling is what decoder embedding models use (Qwen3-Embedding, gte-Qwen2,
e5-mistral): the engine runs the prompt as an ordinary request that stops after one token,
and the model runner keeps the final-norm hidden state at the last prompt position.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PoolingParams:
    normalize: bool = True
    """Scale the embedding to unit L2 norm (cosine similarity becomes a dot product)."""
    dimensions: int | None = None
    """Keep only the first this many dimensions (Matryoshka models), normalized after the cut."""

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        if self.dimensions is not None and (type(self.dimensions) is not int or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")

    def check(self, hidden_size: int) -> None:
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions {self.dimensions} exceeds the model's embedding size {hidden_size}")


def pool(rows, params: list[PoolingParams]) -> list[list[float]]:
    """Embeddings from last-token hidden states ``rows`` [R, hidden], one per params."""
    import torch

    out = []
    for row, p in zip(rows.float(), params):
        vec = row[: p.dimensions] if p.dimensions is not None else row
        if p.normalize:
            vec = torch.nn.functional.normalize(vec, dim=0)
        out.append(vec.cpu().tolist())
    return out
