"""halserve.scoring: vLLM's 1:1 / 1:N / N:N pairing, each distinct text once, cosine scores."""
from __future__ import annotations

import numpy as np
import pytest

from halserve.scoring import ScoringBatch, pair_scores, pair_texts


def test_one_to_n_embeds_each_distinct_text_once():
    batch = pair_texts("q", ["a", "b", "a", "q"])
    assert batch == ScoringBatch(texts=["q", "a", "b"], text_params=["text_1", "text_2[0]", "text_2[1]"],
                                 pairs=[(0, 1), (0, 2), (0, 1), (0, 0)])
    assert pair_texts(["q"], "a").pairs == [(0, 1)]


def test_n_to_n_pairs_element_wise():
    batch = pair_texts(["a", "b", "c"], ["x", "a", "y"], names=("query", "documents"))
    assert batch.texts == ["a", "b", "c", "x", "y"]
    assert batch.text_params == ["query[0]", "query[1]", "query[2]", "documents[0]", "documents[2]"]
    assert batch.pairs == [(0, 3), (1, 0), (2, 4)]


@pytest.mark.parametrize("text_1, text_2, message", [
    (["a", "b"], ["x"], "text_1 and text_2 must pair 1:1, 1:N .* got 2 and 1 texts"),
    (["a", "b"], ["x", "y", "z"], "got 2 and 3 texts"),
    ([], "x", "text_1 must not be empty"),
    ("a", [], "text_2 must not be empty"),
    ("a", ["x", None], r"text_2\[1\] must be a string, got NoneType"),
    (b"a", "x", "text_1 must be a string or a list of strings, got bytes"),
])
def test_bad_input_names_the_field(text_1, text_2, message):
    with pytest.raises(ValueError, match=message):
        pair_texts(text_1, text_2)


def test_scores_are_cosine_similarities():
    def scores(first, second):  # (one pair of 2-d embeddings)
        return pair_scores(pair_texts("a", "b"), [first, second])

    assert scores([1.0, 0.0], [2.0, 0.0]) == pytest.approx([1.0])
    assert scores([1.0, 0.0], [0.0, 3.0]) == pytest.approx([0.0])
    assert scores([1.0, 1.0], [-1.0, -1.0]) == pytest.approx([-1.0])
    assert scores([0.0, 0.0], [1.0, 0.0]) == [0.0]  # (undefined: 0, as torch's)
    batch = pair_texts("q", ["a", "q"])
    assert pair_scores(batch, [[1.0, 0.0], [1.0, 1.0]]) == pytest.approx([2 ** -0.5, 1.0])
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(5, 64))
    batch = pair_texts(["t0", "t1", "t2"], ["t3", "t4", "t0"])
    want = [float(vectors[i] @ vectors[j] / np.linalg.norm(vectors[i]) / np.linalg.norm(vectors[j]))
            for i, j in batch.pairs]
    assert pair_scores(batch, vectors.tolist()) == pytest.approx(want, abs=1e-12)
