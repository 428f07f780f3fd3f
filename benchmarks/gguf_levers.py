"""The GGUF decode levers of BENCHMARKS.md's "A decode step in one C++ call; the GGUF LM head at one level for
greedy rows", each measured with the lever on and off (SmolLM2-135M-Instruct's GGUF files, CPU, greedy):

    python benchmarks/gguf_levers.py phases --quant Q4_0          # ms a token: layers, LM head, inputs, sampling
    python benchmarks/gguf_levers.py alternate --quant Q4_0 --rounds 2   # llama-bench tg128 / the plan / Python loop
    python benchmarks/gguf_levers.py streams --quant Q4_0 --streams 16 64   # offline decode, plan / Python loop
    python benchmarks/gguf_levers.py head-kernel                  # the LM head: two levels / the argmax path
    python benchmarks/gguf_levers.py head-candidates --quant Q8_0  # groups the argmax path recomputes, real rows
    python benchmarks/gguf_levers.py paris                        # one-level prompts with the argmax head
    python benchmarks/gguf_levers.py prompt-levels --quant Q4_1   # one level for one projection kind's prompts

The files come from ``scripts/get_smollm2.sh`` (Q4_1) and ``benchmarks/compare_llamacpp.py`` (Q4_0, Q8_0: run
it once with ``--quants Q4_0,Q8_0``); llama.cpp from ``scripts/build_llamacpp.sh``. The plan is off with
``HALSERVE_FLAT_FORWARD=python``, the argmax head with ``HALSERVE_GGUF_ARGMAX_HEAD=0``; each setting runs in its
own process. Run under ``flock /tmp/cpu.lock`` on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.expanduser("~/.cache/halserve/models")
CHATS = ["What is the capital of France?", "Name three primary colors.", "What is 12 plus 7?",
         "Who wrote Romeo and Juliet?", "Write a haiku about the sea.", "Explain what a CPU does.",
         "Give me a synonym for happy.", "How many legs does a spider have?"]


def model_file(quant: str) -> str:
    path = os.path.join(MODELS, f"SmolLM2-135M-Instruct.{quant}.gguf")
    if not os.path.exists(path):
        subprocess.run(["bash", os.path.join(HERE, "..", "scripts", "get_smollm2.sh")], check=True,
                       capture_output=True)
    if not os.path.exists(path):
        sys.exit(f"{path} is missing: run benchmarks/compare_llamacpp.py --quants {quant} once to make it")
    return path


def in_process(setting: str, *args: str) -> str:
    """Run this script's ``_child`` subcommand with the lever setting (plan | python) and return its stdout."""
    env = dict(os.environ, HALSERVE_FLAT_FORWARD="python" if setting == "python" else "1")
    done = subprocess.run([sys.executable, __file__, "_child", *args], capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(done.stderr[-2000:])
    return done.stdout


def decode_tok_s(path: str, streams: int, prompt_len: int, tokens: int) -> float:
    """Best of 3: decode tok/s = streams x (tokens - 1) / (time for tokens - time for 1 token)."""
    from halserve import LLM, SamplingParams

    llm = LLM(path, platform="cpu", max_model_len=512, enable_prefix_caching=False)
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]}
               for _ in range(streams)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = max(best, streams * (tokens - 1) / (time.perf_counter() - start - first))
    return best


def cmd_child(args: argparse.Namespace) -> None:
    print(f"DECODE {decode_tok_s(args.path, args.n, args.prompt_len, args.tokens):.1f}")


def cmd_alternate(args: argparse.Namespace) -> None:
    bench = os.path.join(os.path.expanduser(args.llamacpp_bin), "llama-bench")
    path = model_file(args.quant)
    for r in range(args.rounds):
        out = subprocess.run([bench, "-m", path, "-t", "2", "-p", "0", "-n", "128", "-r", "3"], capture_output=True,
                             text=True, check=True).stdout
        tg = [line for line in out.splitlines() if "tg128" in line][0].split("|")[-2].strip()
        got = {s: in_process(s, path, "1", "128", "128").split()[-1] for s in ("plan", "python")}
        print(f"{args.quant} round {r}: llama.cpp tg128 {tg}  halserve plan {got['plan']}  "
              f"Python loop {got['python']} tok/s", flush=True)


def cmd_streams(args: argparse.Namespace) -> None:
    path = model_file(args.quant)
    for r in range(args.rounds):
        for n in args.streams:
            got = {s: in_process(s, path, str(n), "8", "64").split()[-1] for s in ("plan", "python")}
            print(f"{args.quant} round {r}, {n} streams: plan {got['plan']}  Python loop {got['python']} decode tok/s",
                  flush=True)


def cmd_phases(args: argparse.Namespace) -> None:
    """ms a step (one token per stream) of the model runner's forward, the layers (the flat forward), the LM head,
    inputs and sampling."""
    sys.path.insert(0, HERE)
    from step_overhead import PhaseTimer

    from halserve import LLM, SamplingParams
    from halserve.models import llama, llama_flat
    from halserve.worker import model_runner

    timer = PhaseTimer()
    seconds, calls = timer.seconds, timer.calls
    timer.wrap(llama_flat.LlamaFlatForward, "__call__", "layers")
    timer.wrap(llama.LlamaForCausalLM, "compute_logits", "LM head")
    for name in ("_forward", "_sample", "_prepare_inputs"):
        timer.wrap(model_runner.ModelRunner, name, name)
    llm = LLM(model_file(args.quant), platform="cpu", max_model_len=512, enable_prefix_caching=False,
              block_size=args.block_size)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    n = args.prompt_len
    prompt = [{"prompt_token_ids": list(range(1000 + 7 * i, 1000 + n + 7 * i))} for i in range(args.streams)]
    llm.generate(prompt, params, use_tqdm=False)
    for _ in range(3):
        for table in (seconds, calls, timer.durations):
            table.clear()
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        wall = time.perf_counter() - start
        if n <= 3:  # every step a decode step: means
            print(f"{args.streams} stream(s): {1e3 * wall / 128:.3f} ms a step: " + ", ".join(
                f"{k} {1e3 * seconds[k] / calls[k]:.3f}" for k in seconds), flush=True)
        else:  # the prompts' few long steps apart: medians over the calls
            print(f"{args.streams} stream(s) x {n}-token prompts: {wall:.2f} s, medians: " + ", ".join(
                f"{k} {1e3 * statistics.median(timer.durations[k]):.3f}" for k in seconds), flush=True)


def cmd_head_kernel(args: argparse.Namespace) -> None:
    import torch

    from halserve.kernels.gguf_blocks import random_blocks
    from halserve.platforms.cpu_kernels.native_gguf import ARGMAX_MIN_ROWS, QTYPE_CODES, NativeGgufGemm

    kernel = NativeGgufGemm()
    kernel.min_activation_levels = 2  # (as the LM head sets it)
    weights = [random_blocks("Q8_0", 49152, 576) for _ in range(2)]  # SmolLM2's head; two, alternated
    for w in weights:
        kernel.argmax_logits(torch.randn(16, 576), w, "Q8_0")  # (its repacked copy and |w| sums made once)

    def ms(fn, n: int) -> float:
        for i in range(3):
            fn(i % 2)
        start = time.perf_counter()
        for i in range(n):
            fn(i % 2)
        return 1e3 * (time.perf_counter() - start) / n

    for m in args.rows:
        x = torch.randn(m, 576)
        n = 100 if m == 1 else 30
        two = ms(lambda i: kernel(x, weights[i], "Q8_0"), n)
        # (below ARGMAX_MIN_ROWS argmax_logits takes the two-level call: the op itself is timed there, to show why)
        argmax = ms(lambda i: kernel.ops.gguf_gemm_packed_argmax(
            x, kernel.packed(weights[i], "Q8_0", 576), QTYPE_CODES["Q8_0"], 49152, 576, kernel.isa_code,
            kernel.abs_block_sums(weights[i], "Q8_0", 576)), n)
        note = f" (argmax_logits takes the two-level call below {ARGMAX_MIN_ROWS} rows)" if m < ARGMAX_MIN_ROWS else ""
        print(f"{m} rows: two levels {two:.3f} ms, argmax op {argmax:.3f} ms{note}")


def cmd_head_candidates(args: argparse.Namespace) -> None:
    import torch

    from halserve import LLM, SamplingParams
    from halserve.platforms.cpu_kernels.native_gguf import QTYPE_CODES, NativeGgufGemm

    caught = []
    original = NativeGgufGemm.argmax_logits

    def keep(self, x, qweight, qtype):
        if len(caught) < 40:
            caught.append((self, x.clone(), qweight, qtype))
        return original(self, x, qweight, qtype)

    NativeGgufGemm.argmax_logits = keep
    llm = LLM(model_file(args.quant), platform="cpu", max_model_len=512)
    llm.chat([[{"role": "user", "content": q}] for q in CHATS * 2], SamplingParams(max_tokens=48, temperature=0.0),
             use_tqdm=False)
    per_row: list[int] = []
    for kernel, x, w, qtype in caught:
        n, k = w.shape[0], x.shape[1]
        one = kernel.ops.gguf_gemm_packed(x, kernel.packed(w, qtype, k), QTYPE_CODES[qtype], n, k, kernel.isa_code, 1)
        changed = original(kernel, x, w, qtype) != one  # [M, N]: the recomputed groups' outputs
        groups = -(-n // 16)
        padded = torch.zeros(x.shape[0], groups * 16, dtype=torch.bool)
        padded[:, :n] = changed
        per_row += padded.view(x.shape[0], groups, 16).any(-1).sum(-1).tolist()
    per_row.sort()
    print(f"{args.quant}: {len(caught)} head calls, {len(per_row)} rows; groups of 16 recomputed per row: median "
          f"{per_row[len(per_row) // 2]}, p90 {per_row[int(len(per_row) * 0.9)]}, max {per_row[-1]} of {groups}")


def cmd_paris(args: argparse.Namespace) -> None:
    """The chats answered with the default prompts (two int8 levels) and with one-level prompts, each chat 8 times
    over so the LM head takes the argmax path; one setting per process."""
    if args.one_level_prompts is None:
        for setting in ("two", "one"):
            done = subprocess.run([sys.executable, __file__, "paris", "--quant", args.quant, "--one-level-prompts",
                                   setting], capture_output=True, text=True)
            print(done.stdout, end="")
        return
    import halserve.platforms.cpu_kernels.native_gguf as native_gguf

    if args.one_level_prompts == "one":
        native_gguf.TWO_LEVEL_MIN_ROWS = 1 << 30
    from halserve import LLM, SamplingParams

    llm = LLM(model_file(args.quant), platform="cpu", max_model_len=512)
    for chat in CHATS[:4]:
        out = llm.chat([[{"role": "user", "content": chat}]] * 8, SamplingParams(max_tokens=16, temperature=0.0),
                       use_tqdm=False)
        print(f"{args.one_level_prompts}-level prompts: {chat!r} -> {out[0].outputs[0].text[:70]!r}")


def cmd_prompt_levels(args: argparse.Namespace) -> None:
    """Would one int8 level do for some of a prompt's GEMMs? benchmarks/gguf_agreement.py's scoring (the 8 chats,
    greedy answers and teacher-forced log-probs against the file dequantized at load) with prompts at one level for
    one projection kind at a time (qkv_proj, o_proj, gate_up_proj, down_proj), then all four; two elsewhere."""
    sys.path.insert(0, HERE)
    import gguf_agreement

    import halserve.platforms.cpu_kernels.native_gguf as native_gguf
    from halserve.quant_methods import gguf as gguf_method

    one: set = set()
    process = gguf_method.GgufLinearMethod.process_weights_after_loading
    levels = native_gguf.NativeGgufGemm.activation_levels

    def tagged(self, layer) -> None:  # each layer's kernel knows its projection's kind
        process(self, layer)
        for kernel, _w, _q in layer.gguf_runs:
            kernel._kind = layer.prefix.split(".")[-1]

    def chosen(self, m: int) -> int:
        return 1 if getattr(self, "_kind", None) in one and self.min_activation_levels == 1 else levels(self, m)

    gguf_method.GgufLinearMethod.process_weights_after_loading = tagged
    native_gguf.NativeGgufGemm.activation_levels = chosen
    chats = [[{"role": "user", "content": q}] for q in gguf_agreement.questions()]
    path = gguf_agreement.model_path(args.quant)
    reference, ref_forced, sequences = gguf_agreement.run(path, chats, None, quantization="unquantized",
                                                          kv_cache_dtype="float32")
    kinds = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    for setting in [[], *([k] for k in kinds), kinds]:
        one.clear()
        one.update(setting)
        got, forced, _ = gguf_agreement.run(path, chats, None, sequences, quantization="gguf")
        same = sum(a[1] == b[1] for a, b in zip(got, reference))
        pairs = [(g, r) for (gt, gl), (rt, rl) in zip(forced, ref_forced) for g, r in zip(zip(gt, gl), zip(rt, rl))]
        top = sum(g[0] == r[0] for g, r in pairs)
        diff = sum(abs(g[1] - r[1]) for g, r in pairs) / len(pairs)
        print(f"{args.quant}: one level for {'+'.join(setting) or 'none (the default)'}: {same} of {len(got)} answers "
              f"token-identical; teacher-forced top token {top} of {len(pairs)}, mean |d logprob| {diff:.4f}; Paris "
              f"answer {got[0][0][:40]!r}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    for name, fn in (("phases", cmd_phases), ("alternate", cmd_alternate), ("streams", cmd_streams),
                     ("head-kernel", cmd_head_kernel), ("head-candidates", cmd_head_candidates), ("paris", cmd_paris),
                     ("prompt-levels", cmd_prompt_levels)):
        p = sub.add_parser(name)
        p.set_defaults(fn=fn)
        p.add_argument("--quant", default="Q4_1" if name in ("paris", "prompt-levels") else "Q4_0")
        if name == "alternate":
            p.add_argument("--rounds", type=int, default=2)
            p.add_argument("--llamacpp-bin", default="~/.cache/halserve/llamacpp/11434.0.0/llama.cpp/build/bin")
        if name == "streams":
            p.add_argument("--rounds", type=int, default=2)
            p.add_argument("--streams", type=int, nargs="+", default=[16, 64])
        if name == "head-kernel":
            p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
        if name == "phases":
            p.add_argument("--streams", type=int, default=1, help="greedy streams decoding together")
            p.add_argument("--prompt-len", type=int, default=3, help="tokens in each stream's prompt")
            p.add_argument("--block-size", type=int, default=16, help="KV-cache block size (tokens)")
        if name == "paris":
            p.add_argument("--one-level-prompts", choices=["one", "two"], default=None, help=argparse.SUPPRESS)
    child = sub.add_parser("_child")
    child.set_defaults(fn=cmd_child)
    child.add_argument("path")
    child.add_argument("n", type=int)
    child.add_argument("prompt_len", type=int)
    child.add_argument("tokens", type=int)
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
