"""The multimodal input processing and the prefix cache's image keys, without a model."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from halserve.kv_cache.hashing import hash_request_tokens
from halserve.multimodal.processing import MultiModalFeature, MultiModalProcessor, overlapping_identifiers
from halserve.request import Request
from halserve.sampling_params import SamplingParams

IMG = 9  # the placeholder token id in these tests


def processor() -> MultiModalProcessor:
    return MultiModalProcessor(SimpleNamespace(image_token_id=IMG, model_path="-"), model_cls=object)


def test_lone_placeholders_expand_in_order():
    ids, offsets = processor()._expand([1, IMG, 5, 6, IMG, 7], [3, 3])
    assert ids == [1, IMG, IMG, IMG, 5, 6, IMG, IMG, IMG, 7]
    assert offsets == [1, 6]


def test_images_of_different_sizes_expand_to_their_own_counts():
    ids, offsets = processor()._expand([IMG, 5, IMG], [2, 4])
    assert ids == [IMG, IMG, 5, IMG, IMG, IMG, IMG] and offsets == [0, 3]


def test_written_out_runs_are_kept_and_split_per_image():
    ids = [1, *[IMG] * 6, 4, *[IMG] * 3]
    assert processor()._expand(ids, [3, 3, 3]) == (ids, [1, 4, 8])
    ids = [1, *[IMG] * 5, 4, *[IMG] * 4]
    assert processor()._expand(ids, [2, 3, 4]) == (ids, [1, 3, 7])


@pytest.mark.parametrize("ids,counts", [
    ([1, IMG, IMG, 2], [3]), ([1, 2], [3]), ([IMG, *[IMG] * 3], [3, 3]), ([IMG] * 4, [3]),
    ([*[IMG] * 3, 1, *[IMG] * 2], [2, 3]),  # (the right total, split wrongly between the runs)
])
def test_placeholder_count_mismatch_is_a_clear_error(ids, counts):
    with pytest.raises(ValueError, match=r"image placeholder tokens \(id 9\) for \d image"):
        processor()._expand(ids, counts)


def feature(offset: int, length: int, ident: str) -> MultiModalFeature:
    return MultiModalFeature("image", {"pixel_values": torch.zeros(3, 2, 2)}, offset, length, ident)


def test_overlapping_identifiers():
    feats = [feature(4, 8, "a"), feature(20, 8, "b")]
    assert overlapping_identifiers(feats, 0, 4) == ()
    assert overlapping_identifiers(feats, 0, 5) == ("a",)
    assert overlapping_identifiers(feats, 8, 24) == ("a", "b")
    assert overlapping_identifiers(feats, 12, 20) == ()


def block_hashes(tokens: list[int], features, block_size: int = 4):
    req = Request("r", tokens, SamplingParams(), max_tokens=1, mm_features=features)
    return hash_request_tokens(block_size, tokens, req.block_hash_extra_keys)


def test_block_hashes_key_only_the_blocks_an_image_overlaps():
    tokens = [5, 6, 7, 8, 5, 6, *[IMG] * 4, 1, 2, 3, 4, 5, 6]  # 16 tokens: 4 blocks; the image at 6..9
    text_only = block_hashes(tokens, None)
    with_a, with_b = block_hashes(tokens, [feature(6, 4, "a")]), block_hashes(tokens, [feature(6, 4, "b")])
    assert with_a[0] == with_b[0] == text_only[0]  # before the image: shared with any prompt
    assert all(a != b for a, b in zip(with_a[1:], with_b[1:]))  # from the image's first block on: its own
    assert with_a[2] != text_only[2]  # the image's last block
    assert block_hashes(tokens, [feature(6, 4, "a")]) == with_a  # deterministic
