"""XlaAttentionBackend on the XLA CPU device (PJRT_DEVICE=CPU) against the torch reference
backend on CPU tensors, torch-xla's own reference of the Pallas kernel, and a dense float64
reference; graph compilations bounded by the buckets; the tpu platform's probe."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
from paged_scenario import TOL, Scenario, mixed_scenario

from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.attention_backends.xla import XlaAttentionBackend, xla_device_kind
from halserve.worker.xla_buckets import max_num_graphs, metadata_to_device, pad_step

BLOCK = 16
HEAD = 64
MAX_BLOCKS = 6  # fixed block-table width (max_model_len 96): one graph per bucket pair
MAX_TOKENS = 64  # max_num_batched_tokens
MAX_SEQS = 16

CONFIGS = {
    "gqa": (8, 2, None, None),
    "mqa_window": (4, 1, 12, None),
    "gqa_softcap": (8, 2, None, 5.0),
}


@pytest.fixture(scope="module")
def xla():
    return torch_xla.device()


def _pad(step):
    n = step.metadata.num_actual_tokens
    padded = pad_step(step.metadata, torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                      max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS, max_blocks_per_req=MAX_BLOCKS)

    def pad_rows(x):
        out = torch.zeros((padded.num_tokens_padded, *x.shape[1:]), dtype=x.dtype)
        out[:n] = x
        return out

    return padded, pad_rows


def _xla_step(attn, step, cache, dtype, device):
    """Pad, move to the XLA device, run; returns the padded output on the host."""
    padded, pad_rows = _pad(step)
    md = XlaAttentionBackend.build_metadata(metadata_to_device(padded.metadata, device))
    q, k, v = (pad_rows(x.to(dtype)).to(device) for x in (step.q, step.k, step.v))
    out = attn.forward(q, k, v, cache, md)
    torch_xla.sync()
    return out.cpu(), padded


def test_device_is_xla_cpu(xla):
    assert xla.type == "xla"
    assert xla_device_kind() == "CPU"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_mixed_batches_match_reference(config, dtype, xla):
    h, kvh, window, cap = CONFIGS[config]
    sc = Scenario(num_heads=h, num_kv_heads=kvh, head_size=HEAD, block_size=BLOCK, num_blocks=24,
                  sliding_window=window, soft_cap=cap, seed=3)
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    attn = XlaAttentionBackend(h, HEAD, sc.scale, kvh, **kw)
    ref = TorchAttentionBackend(h, HEAD, sc.scale, kvh, **kw)
    cache = torch.zeros(XlaAttentionBackend.kv_cache_shape(sc.num_blocks, BLOCK, kvh, HEAD), dtype=dtype).to(xla)
    ref_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(sc.num_blocks, BLOCK, kvh, HEAD), dtype=dtype)
    tol = TOL[dtype]
    for i, step in enumerate(mixed_scenario(sc)):
        out, padded = _xla_step(attn, step, cache, dtype, xla)
        n = step.metadata.num_actual_tokens
        out_ref = ref.forward(step.q.to(dtype), step.k.to(dtype), step.v.to(dtype), ref_cache,
                              TorchAttentionBackend.build_metadata(step.metadata))
        err = (out[:n].double() - step.expected).abs().max().item()
        err_ref = (out[:n].double() - out_ref.double()).abs().max().item()
        print(f"{config} {dtype} step {i} (T={n}->{padded.num_tokens_padded}, R={step.metadata.num_reqs}->"
              f"{padded.num_reqs_padded}): vs dense {err:.2e}, vs torch_ref {err_ref:.2e}")
        assert err <= tol, f"step {i}: differs from the dense reference by {err}"
        assert err_ref <= 2 * tol
        assert out[n:].abs().sum() == 0, "padded rows must be zero"
    # both caches hold the same K/V, in their own layouts
    xc = cache.cpu()
    assert torch.equal(xc[:, :, 0::2], ref_cache[0]) and torch.equal(xc[:, :, 1::2], ref_cache[1])


def test_layout_matches_torch_xla_pallas_reference(xla):
    """torch-xla's reference of the Pallas kernel (use_kernel=False; the kernel itself needs
    a TPU) reads our cache and block tables exactly as the fallback does."""
    from torch_xla.experimental.custom_kernel import ragged_paged_attention

    h, kvh, window, cap = 8, 2, 12, 5.0
    sc = Scenario(num_heads=h, num_kv_heads=kvh, head_size=HEAD, block_size=BLOCK, num_blocks=24,
                  sliding_window=window, soft_cap=cap, seed=5)
    attn = XlaAttentionBackend(h, HEAD, sc.scale, kvh, sliding_window=window, logits_soft_cap=cap)
    cache = torch.zeros(XlaAttentionBackend.kv_cache_shape(sc.num_blocks, BLOCK, kvh, HEAD)).to(xla)
    for i, step in enumerate(mixed_scenario(sc)):
        out, padded = _xla_step(attn, step, cache, torch.float32, xla)
        md = padded.metadata
        n = step.metadata.num_actual_tokens
        ref = ragged_paged_attention(
            padded_q := torch.cat([step.q, torch.zeros(padded.num_tokens_padded - n, h, HEAD)]), cache.cpu(),
            md.seq_lens, md.block_table, md.query_start_loc, torch.tensor([step.metadata.num_reqs], dtype=torch.int32),
            sm_scale=sc.scale, sliding_window=window, soft_cap=cap, use_kernel=False)
        assert padded_q.shape[0] == padded.num_tokens_padded
        err = (out[:n] - ref[:n]).abs().max().item()
        print(f"step {i}: fallback vs torch-xla's ragged_paged_attention reference {err:.2e}")
        assert err <= 2e-5


def test_pallas_path_refuses_a_non_tpu_device(xla):
    attn = XlaAttentionBackend(4, HEAD, HEAD**-0.5, 2)
    sc = Scenario(num_heads=4, num_kv_heads=2, head_size=HEAD, block_size=BLOCK, num_blocks=8, seed=1)
    sc.add("a")
    step = sc.step([("a", 3)])
    padded, pad_rows = _pad(step)
    md = XlaAttentionBackend.build_metadata(metadata_to_device(padded.metadata, xla))
    cache = torch.zeros(XlaAttentionBackend.kv_cache_shape(8, BLOCK, 2, HEAD)).to(xla)
    with pytest.raises(RuntimeError, match="only on a TPU"):
        attn._pallas_attention(pad_rows(step.q).to(xla), cache, md)


def test_unpadded_slot_mapping_and_wrong_layout_raise(xla):
    attn = XlaAttentionBackend(4, HEAD, HEAD**-0.5, 2)
    sc = Scenario(num_heads=4, num_kv_heads=2, head_size=HEAD, block_size=BLOCK, num_blocks=8, seed=1)
    sc.add("a")
    step = sc.step([("a", 3)])
    md = XlaAttentionBackend.build_metadata(step.metadata)
    q = torch.zeros(16, 4, HEAD)
    kv = torch.zeros(16, 2, HEAD)
    cache = torch.zeros(XlaAttentionBackend.kv_cache_shape(8, BLOCK, 2, HEAD))
    with pytest.raises(ValueError, match="pad the step"):
        attn.forward(q, kv, kv, cache, md)
    with pytest.raises(ValueError, match="2 \\* num_kv_heads"):
        attn.forward(q[:3], kv[:3], kv[:3], torch.zeros(2, 8, BLOCK, 2, HEAD), md)


def _compile_count() -> int:
    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def test_graph_compilations_stay_within_the_bucket_bound(xla):
    """Steps of many different sizes compile one graph per (token bucket, request bucket)
    they touch; repeating sizes (or new sizes in seen buckets) compiles nothing new."""
    import random

    h, kvh = 4, 2
    sc = Scenario(num_heads=h, num_kv_heads=kvh, head_size=HEAD, block_size=BLOCK, num_blocks=200, seed=9)
    attn = XlaAttentionBackend(h, HEAD, sc.scale, kvh)
    cache = torch.zeros(XlaAttentionBackend.kv_cache_shape(sc.num_blocks, BLOCK, kvh, HEAD)).to(xla)
    rng = random.Random(0)
    names = [f"r{i}" for i in range(12)]
    for name in names:
        sc.add(name)
    lens = dict.fromkeys(names, 0)

    def random_step():
        k = rng.randint(1, 12)
        chosen = rng.sample(names, k)
        budget = MAX_TOKENS
        schedule = []
        for name in chosen:
            room = min(MAX_BLOCKS * BLOCK - lens[name], budget - (k - len(schedule) - 1))
            if room < 1:
                continue
            n = 1 if lens[name] and rng.random() < 0.7 else rng.randint(1, min(room, 20))
            schedule.append((name, n))
            lens[name] += n
            budget -= n
        return schedule

    before = _compile_count()
    buckets = set()
    for _ in range(14):
        schedule = random_step()
        if not schedule:
            continue
        step = sc.step(schedule)
        out, padded = _xla_step(attn, step, cache, torch.float32, xla)
        buckets.add((padded.num_tokens_padded, padded.num_reqs_padded))
        n = step.metadata.num_actual_tokens
        assert (out[:n].double() - step.expected).abs().max().item() <= TOL[torch.float32]
    compiles = _compile_count() - before
    print(f"{compiles} compilations for {len(buckets)} bucket pairs {sorted(buckets)}; "
          f"bound {max_num_graphs(MAX_TOKENS, MAX_SEQS)} pairs")
    # each step is one graph (K/V write + attention); a bucket pair compiles it once
    assert compiles <= len(buckets) <= max_num_graphs(MAX_TOKENS, MAX_SEQS)


# -- the tpu platform -------------------------------------------------------------------------


def _plugins_json(**env):
    e = {k: v for k, v in os.environ.items() if k != "HALSERVE_TPU_ALLOW_XLA_CPU"}
    e.update(PJRT_DEVICE="CPU", **env)
    proc = subprocess.run([sys.executable, "-m", "halserve.entrypoints.cli", "plugins", "--json"],
                          capture_output=True, text=True, timeout=300, env=e)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_tpu_unavailable_without_a_tpu():
    data = _plugins_json()
    tpu = next(p for p in data["platforms"] if p["name"] == "tpu")
    print("tpu:", tpu["reason"])
    assert not tpu["available"]
    assert "no TPU" in tpu["reason"] and "PJRT_DEVICE=CPU" in tpu["reason"]
    assert data["selected_platform"] == "cpu"
    xla_backend = next(b for b in data["attention_backends"] if b["name"] == "xla")
    assert xla_backend["plugin"] == "tpu" and xla_backend["platforms"] == ["tpu"]


def test_tpu_available_on_xla_cpu_only_with_the_test_switch():
    data = _plugins_json(HALSERVE_TPU_ALLOW_XLA_CPU="1")
    tpu = next(p for p in data["platforms"] if p["name"] == "tpu")
    print("tpu (switch on):", tpu["reason"])
    assert tpu["available"]
    assert "test switch HALSERVE_TPU_ALLOW_XLA_CPU=1" in tpu["reason"] and "not a TPU" in tpu["reason"]
    assert data["selected_platform"] == "tpu"
    assert data["resolved_attention_backend"] == "xla", data["attention_backend_error"]


# -- engine level -----------------------------------------------------------------------------


def _engine(path, platform):
    from halserve import LLM

    return LLM(path, platform=platform, dtype="float32", block_size=16, max_num_batched_tokens=32, max_num_seqs=8,
               num_kv_blocks=32)


def _greedy(llm, prompts, max_tokens=6):
    from halserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in got]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from model_factory import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt")), "llama", num_heads=4, num_kv_heads=2)


def test_engine_on_the_tpu_platform_matches_the_cpu_platform(tiny_checkpoint, monkeypatch):
    """The whole engine on the tpu platform (XLA CPU device, test switch on, xla attention
    backend, bucketed XLA model runner) gives the CPU platform's greedy tokens."""
    import random

    monkeypatch.setenv("HALSERVE_TPU_ALLOW_XLA_CPU", "1")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 45)]
    tpu_llm = _engine(tiny_checkpoint, "tpu")
    assert tpu_llm.llm_engine.core.executor.collective_rpc("attention_backend_name")[0] == "xla"
    assert _greedy(tpu_llm, prompts) == _greedy(_engine(tiny_checkpoint, "cpu"), prompts)


def test_engine_compilations_within_the_bucket_bound(tiny_checkpoint, monkeypatch):
    """Runs with varied batch sizes and prompt lengths compile at most one graph per
    (token bucket, request bucket) pair."""
    import random

    monkeypatch.setenv("HALSERVE_TPU_ALLOW_XLA_CPU", "1")
    llm = _engine(tiny_checkpoint, "tpu")
    rng = random.Random(1)
    before = _compile_count()
    for batch in (1, 3, 8, 5, 2, 7):
        prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))] for _ in range(batch)]
        _greedy(llm, prompts, max_tokens=rng.randrange(2, 8))
    compiles = _compile_count() - before
    bound = max_num_graphs(32, 8)
    print(f"{compiles} graph compilations over 6 varied runs; bucket bound {bound}")
    assert 0 < compiles <= bound
