"""How a GGUF model's arithmetic settings move its answers: SmolLM2-135M-Instruct's greedy chat answers to the
8 questions of ``tests/models/test_gguf_smollm2.py`` under each KV-cache dtype (and, optionally, one int8
activation level), counted token-identical against the same file dequantized at load and run in float32
throughout (``--quantization unquantized``, float32 cache: the reference the tests compare with transformers).
Free-running answers compound their first difference, so each setting is also scored teacher-forced: the
reference's prompts and answers prefilled with ``prompt_logprobs=1``, giving over every position whether the
setting's top token is the reference's and how far its log-probability of the reference's token is from the
reference's own (mean absolute difference; this measures prompt arithmetic: two int8 levels from 16 rows).

    python benchmarks/gguf_agreement.py                       # the shipped Q4_1 file
    python benchmarks/gguf_agreement.py --files Q4_1,Q4_0,Q8_0 --kv-cache-dtypes float32,float16,bfloat16

The files come from ``scripts/get_smollm2.sh`` (Q4_0 and Q8_0 are made from its F16 conversion by
``llama-quantize``: ``benchmarks/compare_llamacpp.py`` prepares them). Prints, per file and setting, how many
answers are token-identical to the reference, the first token where each other one departs, and the Paris answer.
"""
from __future__ import annotations

import argparse
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))

MAX_TOKENS = 32


def questions() -> list[str]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("smollm2_test", os.path.join(HERE, "..", "tests", "models",
                                                                             "test_gguf_smollm2.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.QUESTIONS)


def model_path(name: str) -> str:
    shipped = subprocess.run(["bash", os.path.join(HERE, "..", "scripts", "get_smollm2.sh")], capture_output=True,
                             text=True, check=True).stdout.strip().splitlines()[-1]
    path = os.path.join(os.path.dirname(shipped), f"SmolLM2-135M-Instruct.{name}.gguf")
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing: run benchmarks/compare_llamacpp.py --quants {name} once to make it")
    return path


def run(path: str, conversations: list, levels: int | None, forced: list[list[int]] | None = None,
        **kwargs) -> tuple[list[tuple[str, list[int]]], list[tuple[list[int], list[float]]], list[list[int]]]:
    """(free-running answers as (text, ids), teacher-forced (top ids, log-probs of the forced ids) of ``forced``
    (default: this run's own prompts + answers), the prompts + answers)."""
    from halserve import LLM, SamplingParams

    if levels is not None:
        os.environ["HALSERVE_GGUF_ACTIVATION_LEVELS"] = str(levels)
    else:
        os.environ.pop("HALSERVE_GGUF_ACTIVATION_LEVELS", None)
    llm = LLM(path, platform="cpu", dtype="float32", max_model_len=512, num_kv_blocks=128, **kwargs)
    try:
        outs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
        scored = llm.generate([{"prompt_token_ids": ids} for ids in forced or sequences],
                              SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    forced_scores = []
    for o in scored:
        tops, logprobs = [], []
        for token, entry in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:]):
            tops.append(next(t for t, lp in entry.items() if lp.rank == 1))
            logprobs.append(entry[token].logprob)
        forced_scores.append((tops, logprobs))
    return [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs], forced_scores, sequences


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", default="Q4_1", help="comma-separated SmolLM2 GGUF types (Q4_1, Q4_0, Q8_0, ...)")
    ap.add_argument("--kv-cache-dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--one-level", action="store_true", help="also each setting with one int8 activation level")
    args = ap.parse_args()
    conversations = [[{"role": "user", "content": q}] for q in questions()]
    for name in args.files.split(","):
        path = model_path(name)
        reference, ref_forced, sequences = run(path, conversations, None, quantization="unquantized",
                                               kv_cache_dtype="float32")
        print(f"\n{name}: reference (dequantized, float32 cache): {reference[0][0]!r}", flush=True)
        settings = [(kv, None) for kv in args.kv_cache_dtypes.split(",")]
        if args.one_level:
            settings += [(kv, 1) for kv in args.kv_cache_dtypes.split(",")]
        for kv, levels in settings:
            got, forced, _ = run(path, conversations, levels, sequences, quantization="gguf", kv_cache_dtype=kv)
            same = sum(a[1] == b[1] for a, b in zip(got, reference))
            departs = [next((i for i, (x, y) in enumerate(zip(a[1], b[1])) if x != y), min(len(a[1]), len(b[1])))
                       for a, b in zip(got, reference) if a[1] != b[1]]
            pairs = [(g, r) for (gt, gl), (rt, rl) in zip(forced, ref_forced) for g, r in zip(zip(gt, gl), zip(rt, rl))]
            top_same = sum(g[0] == r[0] for g, r in pairs)
            mean_diff = sum(abs(g[1] - r[1]) for g, r in pairs) / len(pairs)
            label = f"gguf, {kv} KV cache" + (", one int8 level" if levels == 1 else "")
            print(f"{name}: {label}: {same} of {len(got)} answers token-identical (others depart at tokens {departs}); "
                  f"teacher-forced: top token the reference's at {top_same} of {len(pairs)} positions, mean |d "
                  f"logprob| {mean_diff:.4f}; Paris answer {got[0][0]!r}", flush=True)

if __name__ == "__main__":
    main()
