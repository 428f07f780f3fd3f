"""How many tokens could be a row's largest logit when the LM head runs one int8 activation level: the measurement
behind BENCHMARKS.md's "The LM head's second int8 level could go, measured, not built".

    python benchmarks/gguf_head_candidates.py [--file Q8_0] [--new-tokens 32]

transformers' float reading of SmolLM2-135M-Instruct's GGUF file gives the final hidden states of 4 chats and
their greedy answers; the native kernel's one-level rounding is simulated on them (d = amax / 127 per block of
32, round to nearest). Prints how often one level changes the argmax, the largest measured error as a share
of the rigorous bound |d logit_j| <= sum over blocks of (d_b / 2) x sum |w_j| in that block, and how many tokens
per row that bound leaves as possible argmaxes (the ones an exact recomputation would need).
"""
from __future__ import annotations

import argparse
import os
import subprocess

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CHATS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
         "Who wrote Romeo and Juliet?"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", default="Q8_0", help="SmolLM2 GGUF type (its head's type: Q8_0 in every file made here)")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shipped = subprocess.run(["bash", os.path.join(HERE, "..", "scripts", "get_smollm2.sh")], capture_output=True,
                             text=True, check=True).stdout.strip().splitlines()[-1]
    folder, name = os.path.dirname(shipped), f"SmolLM2-135M-Instruct.{args.file}.gguf"
    if not os.path.exists(os.path.join(folder, name)):
        raise SystemExit(f"{name} is missing: run benchmarks/compare_llamacpp.py --quants {args.file} once to make it")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hidden = []
    with torch.inference_mode():
        for chat in CHATS:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=False)
            out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
            hidden.append(model(out, output_hidden_states=True).hidden_states[-1][0])  # (after the final norm)
    x = torch.cat(hidden)  # [rows, hidden]
    w = model.lm_head.weight.float()  # [vocab, hidden]
    exact = x @ w.T
    blocks = x.view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    approx = (torch.round(blocks / scale) * scale).view_as(x) @ w.T
    bound = (scale.squeeze(-1) / 2) @ w.abs().view(w.shape[0], -1, 32).sum(-1).T  # [rows, vocab]
    floor = (approx - bound).amax(1, keepdim=True)
    candidates = (approx + bound >= floor).sum(1).float()
    flips = int((exact.argmax(1) != approx.argmax(1)).sum())
    print(f"{args.file} head, {x.shape[0]} rows: one level changes the argmax at {flips}; largest error "
          f"{float(((approx - exact).abs() / bound).max()):.2f} of the bound; possible argmaxes per row: median "
          f"{float(candidates.median()):.0f}, mean {float(candidates.mean()):.1f}, max {float(candidates.max()):.0f}")


if __name__ == "__main__":
    main()
