"""Offline image throughput (workload V1 of ``workloads.py``) through halserve's or vLLM's ``LLM``.

    python benchmarks/mm_throughput.py --engine halserve MODEL [--num-prompts 64] [--output-len 64] [--json FILE]
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 \\
        /path/to/vllm-venv/bin/python benchmarks/mm_throughput.py --engine vllm MODEL [...]

Runs under either engine's Python (it imports only the engine it is asked for, numpy and PIL).
Both engines get the same requests (numpy ``default_rng(seed)``): per prompt one random RGB PIL
image of ``image_sides`` (200-400 px) sides, and a string of ``--text-len`` random WordLevel words
``w<id>`` (ids in [10, 8191)) with one ``<image>`` in the middle, which each engine's processor
expands to the model's 196 placeholder tokens; greedy, ``ignore_eos``, no detokenizing, prefix
caching off, float32. One warm-up ``generate`` of 2 other requests (other images: vLLM's processor
cache must not serve the timed ones), then one timed ``generate`` of all of them, image
preprocessing included.

Prints elapsed s, requests/s, output tokens/s, total tokens/s (prompt tokens, image placeholders
included, plus output tokens), and the first request's prompt length and greedy output token ids,
to compare the two engines' outputs (float32: they should agree on most tokens).
"""
from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import IMAGE_TOKEN, MM_WORKLOADS, VOCAB  # noqa: E402

WORKLOAD = MM_WORKLOADS["V1"]


class _PixtralHelperFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """vLLM 0.32's ``models/llava.py`` imports ``models/pixtral.py``, which takes one pure-Python helper,
    ``_num_image_tokens``, from transformers' ``models.pixtral.image_processing_pixtral``; in
    transformers 5 that module is the torchvision backend and fails to import without torchvision
    ("No module named 'torchvision'"), so vLLM cannot even inspect a LLaVA checkpoint in a venv without
    torchvision (BENCHMARKS.md's vLLM venv has none). Only then, this serves that module from
    ``image_processing_pil_pixtral``, which defines the same function (same code). Nothing else
    changes: the LLaVA checkpoint's image processor is the PIL ``CLIPImageProcessor`` in both engines.
    Installed at import time, so vLLM's worker processes (spawned ones re-import this file) get it too;
    vLLM inspects a lazily registered model class in a fresh ``python -m`` process, which has no such
    finder, so ``make_llm`` registers the class, imported here, with ``ModelRegistry`` as well."""

    TARGET = "transformers.models.pixtral.image_processing_pixtral"
    SOURCE = "transformers.models.pixtral.image_processing_pil_pixtral"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.TARGET or importlib.util.find_spec("torchvision") is not None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        source = importlib.import_module(self.SOURCE)
        module.__dict__.update({k: v for k, v in vars(source).items() if not k.startswith("__")})


sys.meta_path.insert(0, _PixtralHelperFinder())


def build_requests(num_prompts: int, text_len: int, seed: int) -> list[dict]:
    """``[{"prompt": "w.. w.. <image> w.. ...", "multi_modal_data": {"image": PIL.Image}}, ...]``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    low, high = WORKLOAD["image_sides"]
    requests = []
    for _ in range(num_prompts):
        words = [f"w{i}" for i in rng.integers(10, VOCAB - 1, size=text_len)]  # (VOCAB - 1 is <image>)
        half = text_len // 2
        text = " ".join(words[:half] + [IMAGE_TOKEN] + words[half:])
        width, height = (int(x) for x in rng.integers(low, high + 1, size=2))
        pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        requests.append({"prompt": text, "multi_modal_data": {"image": Image.fromarray(pixels, "RGB")}})
    return requests


def make_llm(engine: str, model: str):
    """(LLM, SamplingParams class, shutdown callable) of ``engine``."""
    if engine == "halserve":
        from halserve import LLM, SamplingParams

        llm = LLM(model, platform="cpu", dtype="float32", enable_prefix_caching=False)
        return llm, SamplingParams, llm.llm_engine.shutdown
    from vllm import LLM, ModelRegistry, SamplingParams

    if importlib.util.find_spec("torchvision") is None:  # (see _PixtralHelperFinder)
        from vllm.model_executor.models.llava import LlavaForConditionalGeneration

        ModelRegistry.register_model("LlavaForConditionalGeneration", LlavaForConditionalGeneration)
    llm = LLM(model=model, dtype="float32", enable_prefix_caching=False, seed=0, max_num_seqs=256,
              limit_mm_per_prompt={"image": 1})
    return llm, SamplingParams, lambda: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("halserve", "vllm"), required=True)
    ap.add_argument("model")
    ap.add_argument("--num-prompts", type=int, default=WORKLOAD["num_prompts"])
    ap.add_argument("--output-len", type=int, default=WORKLOAD["output_len"])
    ap.add_argument("--text-len", type=int, default=WORKLOAD["text_len"], help="random words around the image")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()

    requests = build_requests(args.num_prompts, args.text_len, args.seed)
    warmup = build_requests(2, args.text_len, args.seed + 1)
    llm, SamplingParams, shutdown = make_llm(args.engine, args.model)  # noqa: N806
    try:
        llm.generate(warmup, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False),
                     use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        shutdown()
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    first = list(outputs[0].outputs[0].token_ids)
    result = {
        "engine": args.engine,
        "elapsed_s": elapsed,
        "num_requests": len(outputs),
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "num_prompt_tokens": num_in,
        "num_output_tokens": num_out,
        "first_prompt_len": len(outputs[0].prompt_token_ids),
        "first_output_token_ids": first,
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],  # (to compare the engines')
    }
    print(f"first request: {result['first_prompt_len']} prompt tokens; output token ids {first}")
    print(f"{args.engine}: {elapsed:.2f} s, {result['requests_per_s']:.2f} requests/s, "
          f"{result['output_tokens_per_s']:.1f} output tok/s, {result['total_tokens_per_s']:.1f} total tok/s "
          f"({len(outputs)} requests, {num_in} prompt + {num_out} output tokens)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
