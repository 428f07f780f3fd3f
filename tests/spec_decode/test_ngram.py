"""Speculative decoding building blocks: the n-gram (prompt lookup) proposer, the accepted-
prefix count, and ``speculative_config`` parsing (dict, JSON string, errors)."""
from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from halserve.config import EngineConfig
from halserve.scheduler import make_spec_proposer
from halserve.spec_decode import NgramProposer, SpeculativeConfig, count_accepted


def reference_propose(tokens, min_n, max_n, k):
    """Plain-Python statement of the proposer's contract: the longest suffix n-gram
    (max_n .. min_n) with an earlier occurrence (one starting before the suffix itself);
    the k tokens after its latest occurrence followed by k tokens, else the (fewer) tokens
    after its earliest occurrence."""
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[len(tokens) - n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == suffix]
        if starts:
            full = [s for s in starts if s + n + k <= len(tokens)]
            start = full[-1] if full else starts[0]
            return tokens[start + n:start + n + k]
    return []


# -- NgramProposer --------------------------------------------------------------------
def test_longest_ngram_wins_over_a_later_shorter_one():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 7, 3, 8, 1, 2, 3]
    # n=3 "1 2 3" occurred at 0 (followed by 9 7 3); n=1 "3" occurred later at 5 (followed by 8)
    assert NgramProposer(1, 3, 3).propose(tokens) == [9, 7, 3]
    # with max_n=1 only the 1-gram is looked up: its latest occurrence (5) wins
    assert NgramProposer(1, 1, 3).propose(tokens) == [8, 1, 2]
    # n=2 "2 3" occurred at 1 only
    assert NgramProposer(2, 2, 2).propose(tokens) == [9, 7]


def test_latest_occurrence_wins():
    tokens = [1, 2, 5, 1, 2, 6, 4, 1, 2]
    assert NgramProposer(2, 2, 2).propose(tokens) == [6, 4]  # not [5, 1] (the first occurrence)
    assert NgramProposer(1, 4, 1).propose(tokens) == [6]


def test_in_a_loop_an_occurrence_followed_by_k_tokens_wins():
    loop = [7, 8, 9] * 4  # the latest earlier "8 9" is followed by 1 token only
    assert NgramProposer(2, 2, 4).propose(loop) == [7, 8, 9, 7]
    assert NgramProposer(1, 3, 5).propose([3] * 6) == [3, 3, 3]  # none followed by 5: the earliest (longest)
    assert NgramProposer(1, 3, 2).propose([3] * 6) == [3, 3]
    tokens = [1, 2, 5, 6, 1, 2, 9, 1, 2]
    assert NgramProposer(2, 2, 4).propose(tokens) == [5, 6, 1, 2]  # the latest is followed by 3 tokens only


def test_caps_k_and_max_num_tokens():
    tokens = [4, 5, 6, 7, 8, 9, 10, 4, 5]
    proposer = NgramProposer(1, 2, 3)
    assert proposer.propose(tokens) == [6, 7, 8]  # k = 3
    assert proposer.propose(tokens, 2) == [6, 7]
    assert proposer.propose(tokens, 3) == [6, 7, 8]
    assert proposer.propose(tokens, 10) == [6, 7, 8]  # max_num_tokens never raises k
    assert proposer.propose(tokens, 0) == []
    assert proposer.propose(tokens, -1) == []
    assert NgramProposer(1, 2, 6).propose(tokens) == [6, 7, 8, 9, 10, 4]


def test_no_match_and_too_short_sequences():
    assert NgramProposer(1, 4, 3).propose([1, 2, 3, 4, 5]) == []  # nothing recurs
    assert NgramProposer(1, 4, 3).propose([]) == []
    assert NgramProposer(1, 4, 3).propose([7]) == []  # the suffix alone is no earlier occurrence
    assert NgramProposer(3, 4, 3).propose([1, 2]) == []  # shorter than min_n
    assert NgramProposer(3, 4, 3).propose([1, 1, 1]) == []  # n=3 needs an occurrence before the suffix
    # only a 1-gram recurs, but min_n=2 excludes it
    assert NgramProposer(2, 4, 3).propose([5, 1, 2, 3, 7, 3]) == []
    assert NgramProposer(1, 4, 3).propose([5, 1, 2, 3, 7, 3]) == [7, 3]


def test_suffix_itself_is_not_a_match_but_overlap_is_allowed():
    # "2 2" recurs overlapping the suffix (start 1 of [2, 2, 2]): it proposes the last token
    assert NgramProposer(2, 2, 3).propose([2, 2, 2]) == [2]
    assert NgramProposer(1, 1, 3).propose([2, 2]) == [2]
    assert NgramProposer(1, 4, 5).propose([3, 3, 3, 3]) == [3]
    # max_n longer than the sequence: n shrinks to what can recur
    assert NgramProposer(1, 8, 4).propose([9, 4, 9]) == [4, 9]


def test_proposal_is_truncated_at_the_end_of_the_sequence():
    assert NgramProposer(1, 2, 5).propose([5, 6, 5]) == [6, 5]
    assert NgramProposer(1, 3, 8).propose([1, 2, 3, 1, 2]) == [3, 1, 2]


def test_proposer_matches_the_reference_on_random_sequences():
    rng = random.Random(11)
    nonempty = 0
    for _ in range(600):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 25))]
        limit = rng.choice([None, 0, 1, 2, 7])
        got = NgramProposer(min_n, max_n, k).propose(tokens, limit)
        want = reference_propose(tokens, min_n, max_n, k if limit is None else min(k, limit))
        assert got == want, (tokens, min_n, max_n, k, limit)
        assert all(isinstance(t, int) for t in got)
        nonempty += bool(got)
    assert nonempty > 200


def test_proposer_rejects_bad_ngram_range():
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(0, 3, 2)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(4, 3, 2)


def test_count_accepted_is_the_common_prefix():
    assert count_accepted([1, 2, 3], [1, 2, 3, 4]) == 3
    assert count_accepted([1, 2, 3], [1, 9]) == 1
    assert count_accepted([1, 2, 3], [7]) == 0
    assert count_accepted([], [7]) == 0
    assert count_accepted([1, 2], [1]) == 1  # (a request that stopped: fewer tokens came back)


# -- speculative_config ------------------------------------------------------------------
FULL = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}


@pytest.mark.parametrize("value", [FULL, json.dumps(FULL), SpeculativeConfig(**FULL)])
def test_parse_dict_json_and_instance(value):
    spec = SpeculativeConfig.parse(value)
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == ("ngram", 3, 5, 2)
    assert spec.min_ngram == 2
    config = EngineConfig(model="m", speculative_config=value)
    assert config.speculative_config == spec
    proposer = make_spec_proposer(config)
    assert (proposer.min_n, proposer.max_n, proposer.num_speculative_tokens) == (2, 5, 3)


def test_defaults_min_ngram_equals_prompt_lookup_max():
    spec = SpeculativeConfig.parse('{"num_speculative_tokens": 4}')
    assert (spec.method, spec.prompt_lookup_max, spec.prompt_lookup_min, spec.min_ngram) == ("ngram", 4, None, 4)
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert spec.min_ngram == 3
    proposer = make_spec_proposer(EngineConfig(model="m", speculative_config=spec))
    assert (proposer.min_n, proposer.max_n) == (3, 3)
    # so a 1-gram repeat proposes nothing, a 3-gram one does
    assert proposer.propose([7, 8, 9, 1, 9]) == []
    assert proposer.propose([7, 8, 9, 1, 7, 8, 9]) == [1, 7]


def test_off_by_default():
    config = EngineConfig(model="m")
    assert config.speculative_config is None and make_spec_proposer(config) is None
    assert EngineConfig(model="m", speculative_config=None).speculative_config is None


def test_config_is_frozen():
    spec = SpeculativeConfig.parse(FULL)
    with pytest.raises(ValidationError):
        spec.num_speculative_tokens = 9
    assert spec.num_speculative_tokens == 3


@pytest.mark.parametrize(
    "value, match",
    [
        ('{"method": "ngram", "num_speculative_tokens": ', "not valid JSON"),
        ("ngram", "not valid JSON"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' is not supported"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' is not supported"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
         r"prompt_lookup_min \(3\) must be <= prompt_lookup_max \(2\)"),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
        ({"num_speculative_tokens": 2, "prompt_lookup_maximum": 3}, "prompt_lookup_maximum"),
        ("[1, 2]", "must be a dict or a JSON object"),
        (42, "must be a dict or a JSON object"),
    ],
)
def test_bad_configs_raise_clear_errors(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(value)
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m", speculative_config=value)


def test_unknown_keys_are_refused_not_ignored():
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.parse({"num_speculative_tokens": 2, "num_lookahead_slots": 4})
    assert "num_lookahead_slots" in str(info.value) and "xtra" in str(info.value)  # pydantic: "Extra inputs ..."


def test_a_keyed_sequence_gives_what_a_fresh_one_gives_as_it_grows():
    """The scheduler's per-request buffer (``key``) is copied incrementally; it must never go stale."""
    rng = random.Random(11)
    proposer = NgramProposer(1, 4, 3)
    tokens = [rng.randrange(5) for _ in range(3)]
    for _ in range(600):  # past the buffer's first size (256): it grows
        tokens.extend(rng.randrange(5) for _ in range(rng.randrange(1, 4)))
        assert proposer.propose(tokens, key="r") == proposer.propose(tokens) == reference_propose(tokens, 1, 4, 3)
    proposer.forget("r")
    assert "r" not in proposer._buffers
    assert proposer.propose([1, 2, 1], key="r") == [2, 1]  # a new sequence under a forgotten key
