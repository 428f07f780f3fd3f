"""Run one throughput workload through vLLM's offline LLM (run with vLLM's own Python).

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 \
        /path/to/vllm-venv/bin/python benchmarks/vllm_throughput.py MODEL N I O [--json FILE] \
        [--speculative-config JSON] [--tensor-parallel-size N] [--pipeline-parallel-size N] \
        [--distributed-executor-backend mp|ray] [--dtype float32|bfloat16]

(several ranks on CPU: VLLM_CPU_OMP_THREADS_BIND gives each rank its cores, e.g. "0|1")

Same prompts as ``halserve bench throughput`` (numpy default_rng(seed) ids in [10, vocab)),
greedy, ignore_eos, prefix caching off, float32 (or --dtype). Prints output tokens/s.
"""
import json
import sys
import time


def main() -> None:
    import numpy as np
    from vllm import LLM, SamplingParams

    model, n, i, o = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    out_json = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    spec = sys.argv[sys.argv.index("--speculative-config") + 1] if "--speculative-config" in sys.argv else None
    extra = {"speculative_config": json.loads(spec)} if spec else {}
    for flag, cast in (("--tensor-parallel-size", int), ("--pipeline-parallel-size", int),
                       ("--distributed-executor-backend", str)):
        if flag in sys.argv:
            extra[flag.removeprefix("--").replace("-", "_")] = cast(sys.argv[sys.argv.index(flag) + 1])
    dtype = sys.argv[sys.argv.index("--dtype") + 1] if "--dtype" in sys.argv else "float32"
    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=False, seed=0, max_num_seqs=256, **extra)
    vocab = llm.get_tokenizer().vocab_size if hasattr(llm.get_tokenizer(), "vocab_size") else 8192
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": p} for p in rng.integers(min(10, vocab - 1), vocab, size=(n, i)).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(x.outputs[0].token_ids) for x in outs)
    result = {"elapsed_s": elapsed, "requests_per_s": n / elapsed, "output_tokens_per_s": num_out / elapsed,
              "total_tokens_per_s": (num_out + n * i) / elapsed}
    print(f"vLLM: {result['output_tokens_per_s']:.1f} output tok/s ({num_out} tokens in {elapsed:.2f}s)")
    if out_json:
        with open(out_json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
