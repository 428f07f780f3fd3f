"""Decode steps through captured graphs (worker/step_graphs.py), on the CPU.

The CPU platform captures nothing itself; here it is given the reference ``EagerReplayCapture``,
whose replay runs the recorded forward again on the runner's static buffers. Greedy output must
then equal the eager engine's token for token: every per-step input (tokens, positions, slots,
context lengths, block tables, query starts) reaches the model through the buffers, and the
padding rows write only to the null block (a stray write into a request's blocks changes its
later tokens). The GPU twin, with real CUDA graphs, is tests/platforms/triton/test_triton_engine_gpu.py.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

from halserve.platforms.graph_capture import EagerReplayCapture

MAX_TOKENS = [3, 9, 14, 20, 6, 11]  # requests finish one by one: decode batches of 6 down to 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from model_factory import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt")), "llama", layer_scale=0.8)


@pytest.fixture
def replay_capture(monkeypatch):
    from halserve.platforms.cpu import CpuPlatform

    capture = EagerReplayCapture()
    monkeypatch.setattr(CpuPlatform, "graph_capture", lambda self: capture)
    return capture


def _generate(path, prompts, **kwargs):
    from halserve import LLM, SamplingParams

    llm = LLM(path, platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=48, max_num_seqs=8,
              num_kv_blocks=64, **kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params[: len(prompts)], use_tqdm=False)
    return llm, outputs


def _prompts(seed=0):
    rng = random.Random(seed)
    # one shorter than a block, one spanning blocks, one chunked over steps (budget 48)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 17, 33, 70, 2, 40)]


def _runner(llm):
    return llm.llm_engine.core.executor.worker.model_runner


def test_replayed_decode_equals_eager_token_for_token(checkpoint, replay_capture, caplog):
    prompts = _prompts()
    with caplog.at_level(logging.INFO, logger="halserve.worker.step_graphs"):
        llm, replayed = _generate(checkpoint, prompts, max_cudagraph_capture_size=8)
    assert "graph mode eager_replay: decode batches [1, 2, 4, 8] captured" in caplog.text
    assert sorted(_runner(llm).step_graphs.replays) == [1, 2, 4, 8]
    assert replay_capture.num_replays >= max(MAX_TOKENS) - 2  # every decode-only step after the prefills
    _, eager = _generate(checkpoint, prompts, enforce_eager=True)
    for i, (g, e) in enumerate(zip(replayed, eager)):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, f"prompt {i} differs"
        assert len(g.outputs[0].token_ids) == MAX_TOKENS[i]
        for a, b in zip(g.outputs[0].logprobs, e.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[k].logprob - b[k].logprob) < 1e-4 for k in a)


def test_padding_rows_write_only_the_null_block(checkpoint, replay_capture):
    """Three requests replay the graph of 4: the fourth row writes slot 0 (the null block's) and
    leaves every other block of the cache as the eager step leaves it."""
    llm, _ = _generate(checkpoint, _prompts(1)[:3], max_cudagraph_capture_size=4)
    runner = _runner(llm)
    graphs = runner.step_graphs
    caches = [c.clone() for c in runner.kv_caches]
    for cache in runner.kv_caches:
        cache[:, 0].fill_(7.0)  # the null block, marked
    from halserve.attention_backends.base import AttentionMetadata

    # a decode step of 3 requests at positions 20, 21, 22 (blocks 1 and 2 of each), real slots
    table = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    seq_lens = torch.tensor([21, 22, 23], dtype=torch.int32)
    slots = (table[:, 1].long() * 16 + (seq_lens.long() - 1) % 16)
    qsl = torch.arange(4, dtype=torch.int32)
    common = AttentionMetadata(num_actual_tokens=3, num_reqs=3, max_query_len=1, max_seq_len=23,
                               query_start_loc=qsl, seq_lens=seq_lens, block_table=table, slot_mapping=slots,
                               query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    with torch.inference_mode():
        hidden = graphs.replay(common, torch.tensor([5, 6, 7]), seq_lens.long() - 1)
    assert hidden.shape[0] == 3
    assert graphs.slot_mapping[3].item() == 0 and graphs.seq_lens[3].item() == 1
    assert graphs.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    for before, after in zip(caches, runner.kv_caches):
        changed = (before != after).flatten(2).any(-1).any(0).nonzero().flatten().tolist()  # blocks written
        assert set(changed) <= {0, 2, 4, 6}, changed  # the null block and the three decode blocks
        assert (after[:, 0] != 7.0).any()  # the padding row wrote into the null block
    assert {2, 4, 6} <= {b for b in range(runner.kv_caches[0].shape[1])
                         if (caches[0][:, b] != runner.kv_caches[0][:, b]).any()}


def test_steps_the_graphs_do_not_hold_run_eagerly(checkpoint, replay_capture):
    from halserve.attention_backends.base import AttentionMetadata

    llm, _ = _generate(checkpoint, _prompts(2)[:2], max_cudagraph_capture_size=2)
    graphs = _runner(llm).step_graphs
    one = torch.zeros(1, dtype=torch.int32)

    def metadata(num_reqs, num_tokens, max_query_len):
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
        return AttentionMetadata(num_actual_tokens=num_tokens, num_reqs=num_reqs, max_query_len=max_query_len,
                                 max_seq_len=8, query_start_loc=qsl, seq_lens=one.repeat(num_reqs),
                                 block_table=one.repeat(num_reqs, 1), slot_mapping=torch.zeros(num_tokens).long(),
                                 query_start_loc_cpu=qsl, seq_lens_cpu=one.repeat(num_reqs))

    ids = torch.zeros(4, dtype=torch.long)
    assert graphs.replay(metadata(1, 4, 4), ids, ids) is None  # a prefill
    assert graphs.replay(metadata(3, 3, 1), ids[:3], ids[:3]) is None  # more requests than the largest graph
    assert graphs.replay(metadata(1, 1, 1), ids[:1], ids[:1], inputs_embeds=ids) is None  # image embeddings


@pytest.mark.parametrize("kwargs,reason", [
    ({"enforce_eager": True}, "enforce_eager is set"),
    ({}, "platform 'cpu' captures no graphs (graph_mode eager)"),
])
def test_eager_runners_say_why(checkpoint, kwargs, reason, caplog):
    with caplog.at_level(logging.INFO, logger="halserve.worker.step_graphs"):
        llm, _ = _generate(checkpoint, _prompts()[:1], **kwargs)
    assert f"decode steps run eagerly: {reason}" in caplog.text
    assert _runner(llm).step_graphs is None


def test_platforms_declare_their_graph_mode():
    from halserve.platforms.cpu import CpuPlatform
    from halserve.platforms.cuda import CudaPlatform
    from halserve.platforms.rocm import RocmPlatform
    from halserve.platforms.tpu import TpuPlatform

    modes = {cls.name: cls.describe()["graph_mode"] for cls in (CpuPlatform, CudaPlatform, RocmPlatform, TpuPlatform)}
    assert modes == {"cpu": "eager", "cuda": "cuda_graphs", "rocm": "hip_graphs", "tpu": "xla_buckets"}
    assert CpuPlatform().graph_capture() is None
