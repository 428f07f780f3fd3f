"""The scheduler's per-step budget of image tokens to encode (``halserve.multimodal.budget``)."""
from __future__ import annotations

import torch
from scheduler_helpers import make_request

from halserve.multimodal.budget import fit_encoder_budget
from halserve.multimodal.processing import MultiModalFeature
from halserve.scheduler import Scheduler, SchedulerConfig

IMG = 9


def image_request(req_id: str, offsets: list[int], length: int = 12, prompt_len: int = 20):
    prompt = [5] * prompt_len
    for offset in offsets:
        prompt[offset : offset + length] = [IMG] * length
    request = make_request(req_id, prompt)
    request.mm_features = [MultiModalFeature("image", {"pixel_values": torch.zeros(1)}, offset, length,
                                             f"{req_id}-{offset}") for offset in offsets]
    return request


def test_fit_encoder_budget_cuts_before_an_image_that_does_not_fit():
    req = image_request("r", [2, 30], prompt_len=48)
    assert fit_encoder_budget(req, 0, 48, 16, 16, fresh=True) == (30, 12)  # the second image waits
    assert fit_encoder_budget(req, 0, 48, 10, 16, fresh=True) == (2, 0)  # no room for the first
    assert fit_encoder_budget(req, 0, 48, 30, 30, fresh=True) == (48, 24)
    assert fit_encoder_budget(req, 0, 48, 8, 8, fresh=True) == (30, 12)  # a step's first image always fits
    # a running request's image begun in an earlier step is encoded already; a fresh one's is not
    assert fit_encoder_budget(req, 5, 10, 0, 16, fresh=False) == (10, 0)
    assert fit_encoder_budget(req, 5, 10, 4, 16, fresh=True) == (0, 0)
    assert fit_encoder_budget(image_request("t", []), 0, 20, 0, 16, fresh=True) == (20, 0)


def test_scheduler_spreads_images_over_steps():
    """Budget 24: "a" takes its prompt and 12-token image; "b"'s 16-token image no longer fits, so its
    chunk stops before it; next step it does."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, max_model_len=64, block_size=4,
                                      num_blocks=64))
    first, second = image_request("a", [2]), image_request("b", [2], length=16)
    sched.add_request(first)
    sched.add_request(second)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 20, "b": 2}
    sched.update_from_output(out, _outputs(out, {"a": [7]}))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 18}


def _outputs(out, sampled: dict):
    from halserve.scheduler_output import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[sampled.get(i, []) for i in ids],
                             logprobs=[None] * len(ids))
