"""`halserve bench serve` (its statistics, its image requests, short runs against the test server and
a tiny LLaVA server) and `halserve bench throughput`."""
from __future__ import annotations

import argparse
import base64
import io
import json
import subprocess
import sys

import pytest
from server_utils import SERVED_NAME, ServerProcess, server_args

from halserve.bench import serve as bench_serve
from halserve.bench.random_images import ImageSize, parse_image_size, random_image_urls, warmup_image_urls
from halserve.bench.serve import RequestResult, build_payload, compute_metrics, format_table

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')


def test_statistics():
    results = [
        RequestResult(success=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestResult(success=True, prompt_len=10, output_tokens=3, ttft=0.3, latency=0.7, itl=[0.2, 0.2]),
        RequestResult(success=False, error="HTTP 400: bad"),
    ]
    m = compute_metrics(results, duration=2.0)
    assert m["completed"] == 2 and m["failed"] == 1 and m["errors"] == ["HTTP 400: bad"]
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0) and m["total_token_throughput"] == pytest.approx(14.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT = (latency - ttft) / (tokens - 1): 100 ms and 200 ms
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    assert m["mean_itl_ms"] == pytest.approx(1000 * (0.4 + 0.4) / 6)
    assert m["p99_itl_ms"] == pytest.approx(200.0)
    table = format_table(m)
    assert "Serving Benchmark Result" in table and "Mean TTFT (ms):" in table and "P99 ITL (ms):" in table


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_against_the_server(server, checkpoint, tmp_path, endpoint):
    result = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "halserve.entrypoints.cli", "bench", "serve", "--base-url", server.url,
         "--model", SERVED_NAME, "--tokenizer", checkpoint, "--endpoint", endpoint, "--num-prompts", "6",
         "--random-input-len", "8", "--random-output-len", "5", "--max-concurrency", "3", "--request-rate", "50",
         "--result-json", str(result), *(["--save-detailed"] if endpoint == "/v1/completions" else [])],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Successful requests:" in proc.stdout
    data = json.loads(result.read_text())
    assert data["completed"] == 6 and data["total_output_tokens"] == 30
    assert data["mean_ttft_ms"] > 0 and data["mean_tpot_ms"] > 0
    if endpoint != "/v1/completions":
        assert "ttfts" not in data
        return
    assert data["total_input_tokens"] == 48
    # --save-detailed: per request, in send order
    assert data["input_lens"] == [8] * 6 and data["output_lens"] == [5] * 6 and data["errors"] == [""] * 6
    assert all(t and t > 0 for t in data["ttfts"]) and all(len(x) <= 4 for x in data["itls"])  # (a chunk a token
    # with text: a token that ends inside a character has none)
    itls = [x for request in data["itls"] for x in request]
    assert sum(itls) * 1000 / len(itls) == pytest.approx(data["mean_itl_ms"])
    assert data["start_times"] == sorted(data["start_times"]) and data["start_times"][-1] < data["duration"]
    assert sum(data["ttfts"]) * 1000 / 6 == pytest.approx(data["mean_ttft_ms"])
    assert all(text for text in data["generated_texts"])


def _png_size(url: str) -> tuple[int, int]:
    from PIL import Image

    assert url.startswith("data:image/png;base64,")
    with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as image:
        assert image.format == "PNG" and image.mode == "RGB"
        return image.size


@pytest.mark.parametrize("spec, expected", [
    ("224x224", ImageSize(224, 224, 224, 224)),
    ("200-400", ImageSize(200, 400, 200, 400)),
    ("64", ImageSize(64, 64, 64, 64)),
    ("30-40x10-20", ImageSize(30, 40, 10, 20)),
])
def test_image_size_specs(spec, expected):
    assert parse_image_size(spec) == expected


@pytest.mark.parametrize("spec", ["", "x", "224x", "0x10", "400-200", "2.5x3", "10-20-30"])
def test_bad_image_size_specs_are_usage_errors(spec):
    with pytest.raises(argparse.ArgumentTypeError, match="invalid image size"):
        parse_image_size(spec)


def test_image_requests_are_chat_messages_seeded_by_the_seed():
    size = parse_image_size("30-60x20-40")
    urls = random_image_urls(3, 2, size, seed=7)
    assert [len(u) for u in urls] == [2, 2, 2] and len({u for per in urls for u in per}) == 6
    for url in (u for per in urls for u in per):
        width, height = _png_size(url)
        assert 30 <= width <= 60 and 20 <= height <= 40
    assert random_image_urls(3, 2, size, seed=7) == urls  # deterministic by seed ...
    assert random_image_urls(2, 2, size, seed=7) == urls[:2]  # ... and by index, whatever --num-prompts
    assert all(a != b for a, b in zip(random_image_urls(3, 2, size, seed=8), urls))
    warmup = warmup_image_urls(2, size, seed=7)  # (the test request's: none of the timed images)
    assert len(warmup) == 2 and not set(warmup) & {u for per in urls for u in per}
    assert random_image_urls(2, 0, size, seed=7) == [[], []]

    payload = build_payload("/v1/chat/completions", "m", "w5 w6", 16, urls[0])
    assert payload["stream"] and payload["ignore_eos"] and payload["max_tokens"] == 16
    (message,) = payload["messages"]
    assert message["role"] == "user"
    assert message["content"] == [{"type": "image_url", "image_url": {"url": urls[0][0]}},
                                  {"type": "image_url", "image_url": {"url": urls[0][1]}},
                                  {"type": "text", "text": "w5 w6"}]
    assert build_payload("/v1/chat/completions", "m", "w5", 4, [])["messages"][0]["content"] == "w5"
    with pytest.raises(ValueError, match="chat endpoint"):
        build_payload("/v1/completions", "m", [5, 6], 4, urls[0])


@pytest.mark.parametrize("flags, expected", [
    (["--random-images", "1", "--endpoint", "/v1/completions"], "--random-images needs --endpoint /v1/chat/completions"),
    (["--random-images", "-1"], "--random-images must be >= 0"),
    (["--random-images", "1", "--seed", "-3"], "--seed must be >= 0"),
])
def test_bench_serve_image_usage_errors_exit_2(flags, expected, capsys):
    parser = argparse.ArgumentParser()
    bench_serve.add_args(parser)
    args = parser.parse_args(["--base-url", "http://127.0.0.1:9", "--model", "m", *flags])
    assert bench_serve.run(args) == 2 and expected in capsys.readouterr().err


def test_bench_serve_endpoint_defaults_to_chat_with_images():
    parser = argparse.ArgumentParser()
    bench_serve.add_args(parser)
    for flags, endpoint in (([], "/v1/completions"), (["--random-images", "2"], "/v1/chat/completions")):
        args = parser.parse_args(["--base-url", "x", "--model", "m", *flags])
        assert bench_serve.resolve_image_args(args) is None and args.endpoint == endpoint


def test_bench_serve_with_images_against_a_llava_server(tmp_path):
    from mm_factory import make_llava_checkpoint

    checkpoint = make_llava_checkpoint(tmp_path / "tiny_llava")  # (56 px, 14 px patches: 16 tokens an image)
    srv = ServerProcess(server_args(checkpoint), str(tmp_path / "llava.log"))
    try:
        srv.wait_ready()
        result = tmp_path / "bench.json"
        proc = subprocess.run(
            [sys.executable, "-m", "halserve.entrypoints.cli", "bench", "serve", "--base-url", srv.url,
             "--model", SERVED_NAME, "--tokenizer", checkpoint, "--random-images", "2",
             "--random-image-size", "40-80", "--num-prompts", "4", "--random-input-len", "6",
             "--random-output-len", "4", "--max-concurrency", "2", "--result-json", str(result)],
            capture_output=True, text=True, timeout=120,
        )
    finally:
        srv.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr + srv.log()
    data = json.loads(result.read_text())
    assert data["endpoint"] == "/v1/chat/completions" and data["random_images"] == 2
    assert data["random_image_size"] == "40-80x40-80"
    assert data["completed"] == 4 and data["failed"] == 0 and data["total_output_tokens"] == 16
    # usage's prompt tokens: each request's 2 images became 2 x 16 placeholder tokens, plus its text
    assert data["total_input_tokens"] >= 4 * (2 * 16 + 6)
    assert data["mean_ttft_ms"] > 0 and data["mean_tpot_ms"] > 0


@pytest.mark.parametrize("flags, expected", [
    (["--num-prompts", "-1"], "--num-prompts must be >= 1"),
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--output-json", "/"], "--output-json /: cannot write a file there"),
    (["--block-size", "3"], "--block-size: block_size must be a power of two"),
    (["--input-len", "100", "--output-len", "100"], "exceed the model's max_model_len 128"),
])
def test_bench_throughput_usage_errors_exit_2(checkpoint, flags, expected):
    """Bad values are a one-line error and exit 2 (not a traceback, nor found after the run)."""
    proc = subprocess.run([sys.executable, "-m", "halserve.entrypoints.cli", "bench", "throughput", "--model",
                           checkpoint, "--platform", "cpu", "--max-model-len", "128", *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_bench_throughput_runs_and_writes_its_figures(checkpoint, tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, "-m", "halserve.entrypoints.cli", "bench", "throughput", "--model",
                           checkpoint, "--platform", "cpu", "--num-prompts", "4", "--input-len", "8", "--output-len",
                           "4", "--output-json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert figures["num_requests"] == 4 and figures["num_output_tokens"] == 16 and figures["requests_per_s"] > 0
