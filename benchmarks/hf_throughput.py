"""The same workload through transformers' ``generate`` (batched, left padding, greedy).

    python benchmarks/hf_throughput.py MODEL N I O [--json FILE] [--batch B]
"""
import json
import sys
import time


def main() -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model_path, n, i, o = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    out_json = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    batch = int(sys.argv[sys.argv.index("--batch") + 1]) if "--batch" in sys.argv else n
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = torch.tensor(rng.integers(min(10, vocab - 1), vocab, size=(n, i)))
    start = time.perf_counter()
    num_out = 0
    with torch.inference_mode():
        for s in range(0, n, batch):
            x = prompts[s : s + batch]
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=o, min_new_tokens=o,
                               do_sample=False, pad_token_id=0)
            num_out += (y.shape[1] - i) * y.shape[0]
    elapsed = time.perf_counter() - start
    result = {"elapsed_s": elapsed, "requests_per_s": n / elapsed, "output_tokens_per_s": num_out / elapsed,
              "total_tokens_per_s": (num_out + n * i) / elapsed}
    print(f"transformers: {result['output_tokens_per_s']:.1f} output tok/s ({num_out} tokens in {elapsed:.2f}s)")
    if out_json:
        with open(out_json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
