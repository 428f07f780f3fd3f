"""vLLM's serve flags: a launch line copied from vLLM's documentation starts halserve; each flag does
what it does in vLLM or logs why it changes nothing; an unknown flag names the nearest halserve flag."""
from __future__ import annotations

import json
import logging

import httpx
import pytest
from scheduler_helpers import make_request

from halserve.config import EngineConfig
from halserve.entrypoints.cli import build_parser, main
from halserve.entrypoints.vllm_flags import NO_EFFECT, apply_vllm_flags
from halserve.scheduler import Scheduler, SchedulerConfig


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def build(*argv: str) -> EngineConfig:
    from halserve.entrypoints.cli_serve import build_config

    args = parse(*argv)
    apply_vllm_flags(args)
    return build_config(args, args.model or "m")


# -- the launch line ---------------------------------------------------------------------
@pytest.mark.slow  # (starts a server)
def test_vllm_doc_launch_line_starts_the_server(tmp_path):
    """vLLM's docs: ``vllm serve MODEL --gpu-memory-utilization 0.9 --max-model-len 4096
    --enable-chunked-prefill --disable-log-requests --dtype auto --trust-remote-code``, on the demo model
    (its context is 64 tokens), plus the other flags users pass most."""
    from server_utils import ServerProcess

    from halserve.demo import DEMO_MODEL_PATH

    line = [DEMO_MODEL_PATH, "--gpu-memory-utilization", "0.9", "--max-model-len", "64", "--enable-chunked-prefill",
            "--disable-log-requests", "--dtype", "auto", "--trust-remote-code", "--disable-log-stats",
            "--enforce-eager", "--generation-config", "vllm", "--max-logprobs", "3", "--swap-space", "4",
            "--disable-frontend-multiprocessing", "--metrics-prefix", "vllm", "--platform", "cpu",
            "--served-model-name", "adder", "--log-level", "info"]
    server = ServerProcess(line, str(tmp_path / "server.log")).wait_ready()
    try:
        ok = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "adder", "prompt": "123+456=", "max_tokens": 4, "temperature": 0, "logprobs": 3})
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["text"].startswith("579")
        too_many = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "adder", "prompt": "1+2=", "max_tokens": 2, "logprobs": 4})
        assert too_many.status_code == 400 and "--max-logprobs 3" in too_many.text
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        for name in ("vllm:num_requests_running", "vllm:gpu_cache_usage_perc", "vllm:generation_tokens_total"):
            assert f'{name}{{model_name="adder"}}' in metrics
        assert "halserve:" not in metrics
    finally:
        server.stop()
    log = server.log()
    for flag in ("--disable-log-requests", "--disable-log-stats", "--swap-space"):
        assert sum(f"{flag} changes nothing in halserve" in line for line in log.splitlines()) == 1, log
    assert "--gpu-memory-utilization 0.9 on the CPU" in log


# -- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, nearest", [
    ("--gpu-memory-utilisation", "--gpu-memory-utilization"),
    ("--kv-cache-memory-bytes", "--kv-cache-memory"),
    ("--num-gpu-blocks-override", "--num-kv-blocks"),
    ("--max-num-sequences", "--max-num-seqs"),
    ("--max-num-seq", "--max-num-seqs"),  # a prefix of a real flag is not taken for it
])
def test_unknown_flag_names_the_nearest_halserve_flag(flag, nearest, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", flag, "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "halserve serve: error: unrecognized arguments:" in err
    assert f"{flag}: the nearest halserve flag is {nearest}" in err


def test_unknown_flag_without_a_neighbour(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--frobnicate"])
    assert "--frobnicate: no similar halserve flag; see halserve serve --help" in capsys.readouterr().err


def test_gpu_memory_utilization_and_kv_cache_memory_fraction_conflict(capsys):
    assert main(["serve", "--platform", "cpu", "--gpu-memory-utilization", "0.5",
                 "--kv-cache-memory-fraction", "0.5"]) == 2
    assert "gpu_memory_utilization (vLLM's" in capsys.readouterr().err
    assert main(["serve", "--platform", "cpu", "--gpu-memory-utilization", "1.5"]) == 2
    assert "--gpu-memory-utilization: Input should be less than or equal to 1" in capsys.readouterr().err


def test_model_flag_is_the_model_argument(capsys):
    assert build("--model", "org/name").model == "org/name"
    assert main(["serve", "a/b", "--model", "c/d", "--platform", "cpu"]) == 2
    assert "MODEL given twice" in capsys.readouterr().err


# -- each flag's effect ------------------------------------------------------------------
def test_flags_map_onto_the_engine_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    config = build("--gpu-memory-utilization", "0.8", "--no-enable-chunked-prefill", "--max-logprobs", "5",
                   "--generation-config", str(tmp_path), "--trust-remote-code", "--enforce-eager")
    assert config.gpu_memory_utilization == 0.8
    assert config.enable_chunked_prefill is False
    assert config.max_logprobs == 5
    assert config.generation_config == str(tmp_path)
    assert config.trust_remote_code and config.enforce_eager
    default = build()
    assert default.gpu_memory_utilization is None and default.kv_cache_memory_fraction == 0.9
    assert default.enable_chunked_prefill and default.generation_config == "auto" and default.max_logprobs == 20
    assert build("--enable-chunked-prefill").enable_chunked_prefill
    assert parse("--disable-frontend-multiprocessing").disable_frontend_multiprocessing


def test_generation_config_folder_must_hold_one(tmp_path, capsys):
    assert main(["serve", "--platform", "cpu", "--generation-config", str(tmp_path)]) == 2
    assert "not 'auto', 'vllm' or a folder holding generation_config.json" in capsys.readouterr().err


@pytest.mark.parametrize("dest", sorted(NO_EFFECT))
def test_flags_without_effect_log_one_line_each(dest, caplog):
    flag = "--" + dest.replace("_", "-")
    args = parse(flag, "4") if dest == "swap_space" else parse(flag)
    with caplog.at_level(logging.INFO, logger="halserve.serve"):
        apply_vllm_flags(args)
    assert [r.getMessage() for r in caplog.records] == [f"{flag} changes nothing in halserve: {NO_EFFECT[dest]}"]


def test_no_chunked_prefill_prefills_whole_prompts():
    """Budget 32: with chunking, B's 20-token prompt would get the 12 tokens A leaves; without, B waits a step
    and then runs whole."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32, block_size=4,
                                      num_blocks=64, enable_chunked_prefill=False))
    sched.add_request(make_request("a", range(20), max_tokens=3))
    sched.add_request(make_request("b", range(100, 120), max_tokens=3))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 20}
    from halserve.scheduler_output import ModelRunnerOutput

    sched.update_from_output(first, ModelRunnerOutput(["a"], [[7]], [None]))
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"a": 1, "b": 20}


def test_no_chunked_prefill_needs_a_budget_of_max_model_len():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be >= max_model_len \(64\)"):
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4, num_blocks=64,
                        enable_chunked_prefill=False)
    config = EngineConfig(model="m", max_num_batched_tokens=16, enable_chunked_prefill=False)
    config.fit_unchunked_prefill(64)
    assert config.max_num_batched_tokens == 64
    chunked = EngineConfig(model="m", max_num_batched_tokens=16)
    chunked.fit_unchunked_prefill(64)
    assert chunked.max_num_batched_tokens == 16


class _FixedMemoryCpu:
    """A CPU platform with 10 GiB of RAM of which 8 are available, 1 held by this process."""

    @staticmethod
    def patch(monkeypatch):
        from halserve.platforms.cpu import CpuPlatform

        gib = 1 << 30
        monkeypatch.setattr(CpuPlatform, "memory_info", lambda self, index=0: (8 * gib, 10 * gib))
        monkeypatch.setattr(CpuPlatform, "memory_in_use", lambda self, index=0: 1 * gib)
        return CpuPlatform()


def test_gpu_memory_utilization_is_a_share_of_total_memory(monkeypatch):
    gib = 1 << 30
    cpu = _FixedMemoryCpu.patch(monkeypatch)
    assert cpu.kv_cache_budget_of_total(0.5) == 5 * gib - 1 * gib  # 0.5 x 10 GiB less the 1 GiB held
    assert cpu.kv_cache_budget_of_total(1.0) == 8 * gib  # 9 GiB, capped at the 8 available on the CPU
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0.05: .* already holds 1.0 GiB"):
        cpu.kv_cache_budget_of_total(0.05)


def test_engine_sizes_the_kv_cache_from_gpu_memory_utilization(monkeypatch):
    """The model runner asks the platform: a share that leaves nothing after the weights stops the start."""
    from halserve import LLM
    from halserve.demo import DEMO_MODEL_PATH

    _FixedMemoryCpu.patch(monkeypatch)
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.05"):
        LLM(DEMO_MODEL_PATH, platform="cpu", gpu_memory_utilization=0.05)


def test_engine_applies_max_logprobs_generation_config_and_unchunked_prefill(tmp_path):
    from halserve import LLM, SamplingParams
    from halserve.demo import DEMO_MODEL_PATH

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 3}))
    llm = LLM(DEMO_MODEL_PATH, platform="cpu", max_logprobs=2, generation_config=str(tmp_path),
              enable_chunked_prefill=False, max_num_batched_tokens=16, gpu_memory_utilization=0.9)
    assert llm.llm_engine.model_info.generation_defaults == {"temperature": 0.0, "top_k": 3}
    assert llm.llm_engine.config.max_num_batched_tokens == 64  # raised to the demo's max_model_len
    out = llm.generate(["123+456="], SamplingParams(max_tokens=4, logprobs=2), use_tqdm=False)
    assert out[0].outputs[0].text.startswith("579")
    with pytest.raises(ValueError, match=r"logprobs=3 is more than this server allows \(--max-logprobs 2\)"):
        llm.generate(["1+2="], SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
    vllm_defaults = LLM(DEMO_MODEL_PATH, platform="cpu", generation_config="vllm")
    assert vllm_defaults.llm_engine.model_info.generation_defaults == {}
