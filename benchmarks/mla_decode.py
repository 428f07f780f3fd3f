"""MLA decode on the CPU: the absorbed path (attention over the latent rows, ``forward_mla``) against the
naive one (each request's latents expanded into per-head K/V, then attention), one layer, torch backend.

    python benchmarks/mla_decode.py [--batch 8] [--context 512 2048] [--dtype float32] [--threads 2]

DeepSeek-V2-Lite's attention shape by default: 16 heads, kv_lora_rank 512, qk_nope 128, qk_rope 64,
v 128, block size 16. Both paths read the same latent pages (576 values per position) and write the
step's rows; the naive one is the prefill path's ``mla_expanded_attention`` applied to each decode.
Prints ms per decode step of one layer and the implied decode tokens/s of the attention alone over
V2-Lite's 27 layers (no projections, no MoE).
"""
from __future__ import annotations

import argparse
import time

import torch

from halserve.attention_backends.base import AttentionMetadata
from halserve.attention_backends.torch_ref import TorchAttentionBackend


def decode_metadata(batch: int, context: int, block_size: int) -> TorchAttentionBackend:
    per_req = -(-context // block_size)
    tables = torch.arange(1, 1 + batch * per_req, dtype=torch.int32).view(batch, per_req)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    slots = tables[:, (context - 1) // block_size].long() * block_size + (context - 1) % block_size
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    common = AttentionMetadata(num_actual_tokens=batch, num_reqs=batch, max_query_len=1, max_seq_len=context,
                               query_start_loc=qsl, seq_lens=seq_lens, block_table=tables, slot_mapping=slots,
                               query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    return TorchAttentionBackend.build_metadata(common)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--nope", type=int, default=128)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--v", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    h, r, dn, dr, dv, bs = args.heads, args.rank, args.nope, args.rope, args.v, args.block_size
    backend = TorchAttentionBackend(h, dn + dr, (dn + dr) ** -0.5, 1)
    w_uk = (torch.randn(h, dn, r, generator=gen) / r**0.5).to(dtype)
    w_uv = (torch.randn(h, dv, r, generator=gen) / r**0.5).to(dtype)
    print(f"MLA decode, one layer: batch {args.batch}, heads {h}, latent {r}+{dr}, nope {dn}, v {dv}, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    print("| context | absorbed ms/step | naive ms/step | naive / absorbed | absorbed tok/s (attention x "
          f"{args.layers} layers) | naive tok/s |")
    print("|---|---|---|---|---|---|")
    for context in args.context:
        meta = decode_metadata(args.batch, context, bs)
        num_blocks = 1 + args.batch * -(-context // bs)
        cache = torch.randn(num_blocks, bs, r + dr, generator=gen).to(dtype)
        q_nope = torch.randn(args.batch, h, dn, generator=gen).to(dtype)
        q_pe = torch.randn(args.batch, h, dr, generator=gen).to(dtype)
        kv_c = torch.randn(args.batch, r, generator=gen).to(dtype)
        k_pe = torch.randn(args.batch, dr, generator=gen).to(dtype)
        visible = torch.ones(1, context, dtype=torch.bool)

        def absorbed():
            meta.cache.clear()  # (a new step: its per-step gathers are rebuilt, as in serving)
            return backend.forward_mla(q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv)

        def naive():
            backend._write_mla(cache, torch.cat([kv_c, k_pe], dim=-1), meta.slot_mapping.long(), 1.0)
            outs = []
            for i in range(args.batch):
                rows = backend._read_mla(cache, meta.block_table[i].long(), 1.0, dtype)[:context]
                outs.append(backend.mla_expanded_attention(q_nope[i : i + 1], q_pe[i : i + 1], rows, w_uk, w_uv,
                                                           visible))
            return torch.cat(outs)

        with torch.inference_mode():
            torch.testing.assert_close(absorbed(), naive(), atol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                                       rtol=2e-2 if dtype == torch.bfloat16 else 1e-4)
            times = {}
            for name, fn in (("absorbed", absorbed), ("naive", naive)):
                fn()
                best = float("inf")
                for _ in range(args.iters):
                    start = time.perf_counter()
                    fn()
                    best = min(best, time.perf_counter() - start)
                times[name] = best * 1e3
        a, n = times["absorbed"], times["naive"]
        tok = lambda ms: args.batch / (ms * args.layers / 1e3)  # noqa: E731
        print(f"| {context} | {a:.2f} | {n:.2f} | {n / a:.1f}x | {tok(a):.0f} | {tok(n):.0f} |")


if __name__ == "__main__":
    main()
