"""MLA decode on the CPU: the absorbed path (attention over the latent rows, ``forward_mla``) against the
naive one (each request's latents expanded into per-head K/V, then attention), one layer, torch backend;
and the cpu_native backend's absorbed path (the native kernel ``mla_decode.cpp`` over the cache in place).

    python benchmarks/mla_decode.py [--batch 8] [--context 512 2048] [--dtype float32] [--threads 2]

DeepSeek-V2-Lite's attention shape by default: 16 heads, kv_lora_rank 512, qk_nope 128, qk_rope 64,
v 128, block size 16. Both paths read the same latent pages (576 values per position) and write the
step's rows; the naive one is the prefill path's ``mla_expanded_attention`` applied to each decode.
Prints ms per decode step of one layer and the implied decode tokens/s of the attention alone over
V2-Lite's 27 layers (no projections, no MoE). ``--kv-cache-dtype fp8`` times the torch and native absorbed
paths over fp8 pages (the naive column then reads the same pages). The native column is left out where
the kernels cannot be built (no C++ toolchain).
"""
from __future__ import annotations

import argparse
import time

import torch

from halserve.attention_backends.base import AttentionMetadata, kv_cache_torch_dtype
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
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8", "fp8_e5m2"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    h, r, dn, dr, dv, bs = args.heads, args.rank, args.nope, args.rope, args.v, args.block_size
    kv_dtype = args.kv_cache_dtype
    backend = TorchAttentionBackend(h, dn + dr, (dn + dr) ** -0.5, 1, kv_cache_dtype=kv_dtype)
    native = native_backend(h, dn + dr, kv_dtype)
    cache_dtype = kv_cache_torch_dtype(kv_dtype, dtype)
    w_uk = (torch.randn(h, dn, r, generator=gen) / r**0.5).to(dtype)
    w_uv = (torch.randn(h, dv, r, generator=gen) / r**0.5).to(dtype)
    print(f"MLA decode, one layer: batch {args.batch}, heads {h}, latent {r}+{dr}, nope {dn}, v {dv}, {args.dtype}, "
          f"kv cache {kv_dtype}, {torch.get_num_threads()} threads; tok/s: the attention alone x {args.layers} layers")
    names = ["absorbed", "naive"] + (["native"] if native is not None else [])
    print("| context | " + " | ".join(f"{name} ms/step" for name in names) + " | naive / absorbed"
          + (" | absorbed / native" if native is not None else "") + " | "
          + " | ".join(f"{name} tok/s" for name in names) + " |")
    print("|---" * (2 * len(names) + len(names)) + "|")
    for context in args.context:
        meta = decode_metadata(args.batch, context, bs)
        num_blocks = 1 + args.batch * -(-context // bs)
        cache = torch.randn(num_blocks, bs, r + dr, generator=gen).to(cache_dtype)
        q_nope = torch.randn(args.batch, h, dn, generator=gen).to(dtype)
        q_pe = torch.randn(args.batch, h, dr, generator=gen).to(dtype)
        kv_c = torch.randn(args.batch, r, generator=gen).to(dtype)
        k_pe = torch.randn(args.batch, dr, generator=gen).to(dtype)
        visible = torch.ones(1, context, dtype=torch.bool)

        def absorbed():
            meta.cache.clear()  # (a new step: its per-step gathers are rebuilt, as in serving)
            return backend.forward_mla(q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv)

        def on_native():
            meta.cache.clear()
            return native.forward_mla(q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv)

        def naive():
            backend._write_mla(cache, torch.cat([kv_c, k_pe], dim=-1), meta.slot_mapping.long(), 1.0)
            outs = []
            for i in range(args.batch):
                rows = backend._read_mla(cache, meta.block_table[i].long(), 1.0, dtype)[:context]
                outs.append(backend.mla_expanded_attention(q_nope[i : i + 1], q_pe[i : i + 1], rows, w_uk, w_uv,
                                                           visible))
            return torch.cat(outs)

        paths = {"absorbed": absorbed, "naive": naive, "native": on_native}
        with torch.inference_mode():
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
            want = absorbed()
            for name in names[1:]:
                torch.testing.assert_close(paths[name](), want, atol=tol, rtol=tol, msg=f"{name} differs from absorbed")
            times = {}
            for name in names:
                fn = paths[name]
                fn()
                best = float("inf")
                for _ in range(args.iters):
                    start = time.perf_counter()
                    fn()
                    best = min(best, time.perf_counter() - start)
                times[name] = best * 1e3
        a, n = times["absorbed"], times["naive"]
        tok = lambda ms: args.batch / (ms * args.layers / 1e3)  # noqa: E731
        ratios = f"{n / a:.1f}x" + (f" | {a / times['native']:.1f}x" if native is not None else "")
        print(f"| {context} | " + " | ".join(f"{times[name]:.2f}" for name in names) + f" | {ratios} | "
              + " | ".join(f"{tok(times[name]):.0f}" for name in names) + " |")


def native_backend(heads: int, head_size: int, kv_cache_dtype: str):
    """The cpu_native backend for MLA layers of this shape, or None where its kernels cannot be built."""
    from halserve.attention_backends.cpu_native import CpuNativeAttentionBackend
    from halserve.platforms import cpu_kernels

    if cpu_kernels.toolchain_missing() is not None or cpu_kernels.load_library("mla") is None:
        print(f"(no native column: {cpu_kernels.toolchain_missing() or cpu_kernels.load_error('mla')})")
        return None
    return CpuNativeAttentionBackend(heads, head_size, head_size**-0.5, 1, kv_cache_dtype=kv_cache_dtype)


if __name__ == "__main__":
    main()
