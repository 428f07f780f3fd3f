"""The captured decode batch sizes and the padding of a step to one of them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from halserve.worker.capture_sizes import capture_sizes, max_capture_size, padded_size


def test_ladder_is_1_2_4_then_every_8_then_every_16():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes = capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]) if b <= 256)
    assert all(b - a == 16 for a, b in zip(sizes, sizes[1:]) if a >= 256)
    assert sizes[-1] == 512 and len(sizes) == 3 + 32 + 16


@pytest.mark.parametrize("max_size,expected", [(1, [1]), (3, [1, 2, 3]), (4, [1, 2, 4]), (12, [1, 2, 4, 8, 12]),
                                               (260, capture_sizes(256) + [260])])
def test_the_largest_size_is_always_captured(max_size, expected):
    assert capture_sizes(max_size) == expected


def test_padding_picks_the_smallest_size_that_holds_the_batch():
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 13, 16, 17, 63, 64)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 16, 24, 64, 64]
    assert padded_size(65, sizes) is None  # past the largest: eager
    with pytest.raises(ValueError, match="at least one request"):
        padded_size(0, sizes)
    with pytest.raises(ValueError, match=">= 1"):
        capture_sizes(0)


def test_padding_never_adds_more_than_a_step_of_the_ladder():
    sizes = capture_sizes(512)
    for n in range(1, 513):
        size = padded_size(n, sizes)
        assert n <= size and size - n < (16 if n > 256 else 8 if n > 4 else n), n


def _config(**kw):
    base = dict(max_cudagraph_capture_size=None, max_num_seqs=256, max_num_batched_tokens=2048)
    return SimpleNamespace(**{**base, **kw})


def test_largest_size_follows_the_flag_and_the_batch_limits():
    assert max_capture_size(_config()) == 256  # max_num_seqs
    assert max_capture_size(_config(max_num_seqs=1024)) == 512  # the default cap
    assert max_capture_size(_config(max_cudagraph_capture_size=64)) == 64
    assert max_capture_size(_config(max_cudagraph_capture_size=64, max_num_batched_tokens=40)) == 40


def test_engine_config_validates_the_flags():
    from pydantic import ValidationError

    from halserve.config import EngineConfig

    config = EngineConfig(model="m", enforce_eager=True, max_cudagraph_capture_size=32, load_format="dummy")
    assert (config.enforce_eager, config.max_cudagraph_capture_size, config.load_format) == (True, 32, "dummy")
    with pytest.raises(ValidationError):
        EngineConfig(model="m", max_cudagraph_capture_size=0)
