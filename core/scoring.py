"""Scoring text pairs with an embedding (bi-encoder) model, as vLLM does for one: the score of a
pair is the cosine similarity of the two texts' embeddings (``LLM.score``, ``POST /score``,
``POST /rerank``).

vLLM's pairings of ``text_1`` and ``text_2`` (a string counts as a list of one):

    1:1  text_1 = [a],       text_2 = [x]        -> (a, x)
    1:N  text_1 = [a],       text_2 = [x, y, z]  -> (a, x), (a, y), (a, z)
    N:N  text_1 = [a, b, c], text_2 = [x, y, z]  -> (a, x), (b, y), (c, z)

Any other pair of lengths is an error. Each distinct text is embedded once however many pairs
it is in: a query against N documents is N + 1 embeddings.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ScoringBatch:
    """What to embed for a scoring request, and which embeddings each score compares."""

    texts: list[str]  # each distinct text once, in order of first appearance (text_1's, then text_2's)
    text_params: list[str]  # per text, the request field it first came from, e.g. "text_2[3]" or "query"
    pairs: list[tuple[int, int]]  # per score, in request order: indexes into ``texts`` of its two sides


def pair_texts(text_1: Any, text_2: Any, names: tuple[str, str] = ("text_1", "text_2")) -> ScoringBatch:
    """The batch scoring ``text_1`` against ``text_2`` (each a string or a non-empty list of
    strings) paired 1:1, 1:N or N:N; ValueError, starting with the bad field's name (``names``),
    for anything else."""
    sides = [_text_list(value, name) for value, name in zip((text_1, text_2), names)]
    (first, first_params), (second, second_params) = sides
    if len(first) > 1 and len(first) != len(second):
        raise ValueError(f"{names[0]} and {names[1]} must pair 1:1, 1:N (one {names[0]}) or N:N (as many of "
                         f"each), got {len(first)} and {len(second)} texts")
    index: dict[str, int] = {}
    batch = ScoringBatch(texts=[], text_params=[], pairs=[])
    for text, param in zip([*first, *second], [*first_params, *second_params]):
        if text not in index:
            index[text] = len(batch.texts)
            batch.texts.append(text)
            batch.text_params.append(param)
    left = [index[text] for text in first]
    batch.pairs = [(left[i if len(left) > 1 else 0], index[text]) for i, text in enumerate(second)]
    return batch


def _text_list(value: Any, name: str) -> tuple[list[str], list[str]]:
    """``value`` as (texts, the field of each); ValueError naming the field if it is not a
    string or a non-empty list of strings."""
    if isinstance(value, str):
        return [value], [name]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a string or a list of strings, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must not be empty; give at least one text")
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise ValueError(f"{name}[{i}] must be a string, got {type(text).__name__}")
    return list(value), [f"{name}[{i}]" for i in range(len(value))]


def pair_scores(batch: ScoringBatch, embeddings: Sequence[Sequence[float]]) -> list[float]:
    """Per pair of ``batch``, the cosine similarity of its texts' ``embeddings`` (one per text):
    a . b / (|a| |b|) in float64, vectorized (a rerank of thousands of documents); 0.0 when
    either vector is all zeros (as torch's, whose eps keeps the quotient finite)."""
    import numpy as np

    assert len(embeddings) == len(batch.texts)
    if not batch.pairs:
        return []
    vectors = np.asarray(embeddings, dtype=np.float64)  # [texts, hidden]
    norms = np.linalg.norm(vectors, axis=1)
    left, right = (np.fromiter(side, dtype=np.int64, count=len(batch.pairs)) for side in zip(*batch.pairs))
    dots = np.einsum("ij,ij->i", vectors[left], vectors[right])
    denominators = norms[left] * norms[right]
    scores = np.divide(dots, denominators, out=np.zeros_like(dots), where=denominators != 0.0)
    return scores.tolist()
