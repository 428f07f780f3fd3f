"""benchmarks/gpu: the e2e device script's logic, run here on a CPU (``DRY_RUN=1``: tiny configs of
the same architectures, small counts, the same drivers and steps), and its pieces."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU = os.path.join(ROOT, "benchmarks", "gpu")


def test_configs_have_the_real_sizes_and_a_tokenizer_for_every_id(tmp_path):
    sys.path.insert(0, GPU)
    try:
        import make_configs
    finally:
        sys.path.remove(GPU)
    from transformers import AutoConfig, AutoTokenizer

    path = make_configs.write_model(str(tmp_path), "qwen2.5-0.5b", tiny=False)
    config = AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size, config.tie_word_embeddings) == (896, 24, 14, 2, 151936, True)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == config.vocab_size and tok.eos_token_id == config.eos_token_id
    assert tok.convert_ids_to_tokens([7, config.vocab_size - 1]) == ["t7", f"t{config.vocab_size - 1}"]
    assert make_configs.LLAMA_3_1_8B["vocab_size"] == 128256 and make_configs.LLAMA_3_1_8B["num_key_value_heads"] == 8


def test_summary_reports_missing_steps(tmp_path):
    folder = tmp_path / "json"
    folder.mkdir()
    (folder / "halserve_small.json").write_text(json.dumps({
        "label": "m", "decode": [
            {"mode": "graphs", "batch": 1, "context": 8, "tokens_per_s": 30.0, "roofline_tokens_per_s": 60.0},
            {"mode": "eager", "batch": 1, "context": 8, "tokens_per_s": 10.0, "roofline_tokens_per_s": 60.0}],
        "offline": None}))
    (folder / "hf_small.json").write_text(json.dumps({"decode": [{"batch": 1, "tokens_per_s": 15.0}]}))
    out = tmp_path / "summary.json"
    subprocess.run([sys.executable, os.path.join(GPU, "e2e_summary.py"), str(folder), str(out)], check=True,
                   capture_output=True, text=True)
    summary = json.loads(out.read_text())
    assert summary["decode"] == [{"model": "m", "batch": 1, "context": 8, "graphs_tokens_per_s": 30.0,
                                  "eager_tokens_per_s": 10.0, "graphs_async_tokens_per_s": None,
                                  "roofline_tokens_per_s": 60.0, "transformers_tokens_per_s": 15.0}]
    lines = subprocess.run([sys.executable, os.path.join(GPU, "e2e_summary.py"), str(folder), str(out)], check=True,
                           capture_output=True, text=True).stdout
    assert "graphs+async" not in lines  # no async step ran: no column
    (folder / "halserve_small_async.json").write_text(json.dumps({
        "label": "m", "decode": [{"mode": "graphs+async", "batch": 1, "context": 8, "tokens_per_s": 45.0,
                                  "roofline_tokens_per_s": 60.0}], "offline": None}))
    lines = subprocess.run([sys.executable, os.path.join(GPU, "e2e_summary.py"), str(folder), str(out)], check=True,
                           capture_output=True, text=True).stdout
    assert "graphs+async 45.0 (1.50x of graphs)" in lines, lines
    assert json.loads(out.read_text())["decode"][0]["graphs_async_tokens_per_s"] == 45.0
    assert summary["serve"] is None


@pytest.mark.extended
@pytest.mark.slow  # three engines, a server and two transformers runs of tiny models: a few minutes
def test_e2e_dry_run(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "E2E_WORK": str(work),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", os.path.join(GPU, "run_gpu_checks.sh"), "e2e"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1500)
    log = (out / "e2e.log").read_text() if (out / "e2e.log").exists() else proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    for name in ("tests", "decode-qwen2.5-0.5b", "decode-llama-3.1-8b", "decode-async-qwen2.5-0.5b",
                 "decode-async-llama-3.1-8b", "prefill-kernel", "serve-llama-3.1-8b", "peer-qwen2.5-0.5b",
                 "peer-llama-3.1-8b"):
        assert f"=== {name}: ok" in log, name
    summary = json.loads((out / "e2e_summary.json").read_text())
    assert summary["scale"] == "dry"
    rows = {(r["model"], r["batch"]): r for r in summary["decode"]}
    assert set(rows) == {(m, b) for m in ("qwen2.5-0.5b", "llama-3.1-8b") for b in (1, 4)}
    for row in rows.values():
        assert row["graphs_tokens_per_s"] > 0 and row["eager_tokens_per_s"] > 0 and row["transformers_tokens_per_s"] > 0
        assert row["graphs_async_tokens_per_s"] > 0  # the same rows with --async-scheduling
        assert row["roofline_tokens_per_s"] > row["graphs_tokens_per_s"]
    (offline,) = summary["offline"]
    assert offline["prompts"] == 8 and offline["transformers_output_tokens_per_s"] > 0
    assert summary["serve"]["completed"] == 8 and summary["serve"]["failed"] == 0
    assert summary["prefill_tflops"] and "TFLOP/s" in summary["prefill_tflops"][0]
    assert log.count("[profile]") >= 3 * 12  # three lines per decode row (--profile): 12 rows
    # what comes back from a device run: at most 8 files
    assert sorted(os.listdir(out)) == ["device.txt", "e2e.log", "e2e_summary.json", "serve_server.log"]
