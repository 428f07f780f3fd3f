"""Tensor-parallel layers: each simulated rank loads its slice of the full checkpoint
tensor, and combining the ranks' outputs (concat / sum) gives the unsharded result."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import halserve.layers.linear as linear_mod
import halserve.layers.vocab as vocab_mod
from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ModelContext,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)

CTX = ModelContext("cpu", torch.float32, TorchAttentionBackend)


def as_rank(monkeypatch, rank: int, size: int) -> None:
    for mod in (linear_mod, vocab_mod):
        monkeypatch.setattr(mod, "get_tp_rank", lambda: rank)
        monkeypatch.setattr(mod, "get_tp_size", lambda: size)


def load(layer, name, tensor, shard_id=None):
    param = getattr(layer, name)
    param.weight_loader(param, tensor) if shard_id is None else param.weight_loader(param, tensor, shard_id)


def test_column_and_row_parallel(monkeypatch):
    w1, b1, w2, b2 = torch.randn(8, 6), torch.randn(8), torch.randn(6, 8), torch.randn(6)
    x = torch.randn(3, 6)
    hidden_parts, out = [], torch.zeros(3, 6)
    for rank in range(2):
        as_rank(monkeypatch, rank, 2)
        col = ColumnParallelLinear(6, 8, True, CTX, "col")
        row = RowParallelLinear(8, 6, True, CTX, "row")
        load(col, "weight", w1), load(col, "bias", b1), load(row, "weight", w2), load(row, "bias", b2)
        h = col(x)  # [3, 4]: this rank's outputs
        hidden_parts.append(h)
        out += row(h)  # partial sums; bias only on rank 0 (the all-reduce adds it once)
    torch.testing.assert_close(torch.cat(hidden_parts, -1), F.linear(x, w1, b1))
    torch.testing.assert_close(out, F.linear(F.linear(x, w1, b1), w2, b2))


def test_merged_gate_up(monkeypatch):
    gate, up, x = torch.randn(8, 4), torch.randn(8, 4), torch.randn(2, 4)
    for rank in range(2):
        as_rank(monkeypatch, rank, 2)
        layer = MergedColumnParallelLinear(4, [8, 8], False, CTX, "gate_up")
        load(layer, "weight", gate, 0), load(layer, "weight", up, 1)
        want = torch.cat([F.linear(x, gate[rank * 4 : rank * 4 + 4]), F.linear(x, up[rank * 4 : rank * 4 + 4])], -1)
        torch.testing.assert_close(layer(x), want)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_with_kv_head_replication(monkeypatch, tp):
    head, heads, kv_heads = 2, 4, 2  # tp=4 > kv heads: each kv head lives on two ranks
    wq, wk, wv = torch.randn(heads * head, 3), torch.randn(kv_heads * head, 3), torch.randn(kv_heads * head, 3)
    bq, bk, bv = torch.randn(heads * head), torch.randn(kv_heads * head), torch.randn(kv_heads * head)
    x = torch.randn(5, 3)
    for rank in range(tp):
        as_rank(monkeypatch, rank, tp)
        layer = QKVParallelLinear(3, head, heads, kv_heads, True, CTX, "qkv")
        for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            load(layer, "weight", w, shard), load(layer, "bias", b, shard)
        q_heads = heads // tp
        kv_rank = rank // layer.kv_replicas
        kv_local = layer.num_kv_heads * head
        q_rows = slice(rank * q_heads * head, (rank + 1) * q_heads * head)
        kv_rows = slice(kv_rank * kv_local, (kv_rank + 1) * kv_local)
        want = torch.cat([F.linear(x, wq[q_rows], bq[q_rows]), F.linear(x, wk[kv_rows], bk[kv_rows]),
                          F.linear(x, wv[kv_rows], bv[kv_rows])], -1)
        torch.testing.assert_close(layer(x), want)


def test_qkv_bad_shard_id():
    layer = QKVParallelLinear(3, 2, 2, 1, False, CTX, "qkv")
    with pytest.raises(ValueError, match="'x'"):
        load(layer, "weight", torch.randn(4, 3), "x")


def test_indivisible_heads_is_a_value_error(monkeypatch):
    as_rank(monkeypatch, 0, 3)
    with pytest.raises(ValueError, match="not divisible by tensor parallel size 3"):
        QKVParallelLinear(3, 2, 4, 4, False, CTX, "qkv")


def test_shape_mismatch_names_the_layer():
    layer = ColumnParallelLinear(6, 8, False, CTX, "model.layers.0.mlp.up")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up.*\(8, 5\)"):
        load(layer, "weight", torch.randn(8, 5))


def test_vocab_parallel_embedding_and_lm_head(monkeypatch):
    vocab, dim = 11, 4  # 11 rows over 2 ranks: padded to 12
    table, ids, hidden = torch.randn(vocab, dim), torch.tensor([0, 5, 6, 10, 3]), torch.randn(2, dim)
    emb_sum, logit_parts = torch.zeros(5, dim), []
    for rank in range(2):
        as_rank(monkeypatch, rank, 2)
        emb = VocabParallelEmbedding(vocab, dim, CTX)
        load(emb, "weight", table)
        emb_sum += emb(ids)  # ranks contribute the rows they own, zeros elsewhere
        head = ParallelLMHead(vocab, dim, CTX)
        load(head, "weight", table)
        logit_parts.append(head.gemm(hidden, head.weight, None))
    torch.testing.assert_close(emb_sum, F.embedding(ids, table))
    torch.testing.assert_close(torch.cat(logit_parts, -1)[:, :vocab], hidden @ table.T)


def test_lm_head_logits_are_float32_and_tied():
    ctx = ModelContext("cpu", torch.bfloat16, TorchAttentionBackend)
    emb = VocabParallelEmbedding(7, 4, ctx)
    head = ParallelLMHead(7, 4, ctx, tie_to=emb)
    assert head.weight is emb.weight
    logits = head.compute_logits(torch.randn(3, 4, dtype=torch.bfloat16))
    assert logits.shape == (3, 7) and logits.dtype == torch.float32


def test_rms_norm_fused_residual_and_silu_and_mul():
    norm = RMSNorm(8, 1e-6, CTX)
    norm.weight.data.uniform_(0.5, 1.5)
    x, res = torch.randn(3, 8), torch.randn(3, 8)
    out, new_res = norm(x, res)
    s = x + res
    torch.testing.assert_close(new_res, s)
    torch.testing.assert_close(out, s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight)
    y = torch.randn(3, 10)
    torch.testing.assert_close(SiluAndMul(5, CTX)(y), F.silu(y[:, :5]) * y[:, 5:])


def test_a_kernel_that_keeps_the_weight_as_is_leaves_it_a_parameter():
    """The cuda platform's ``gemm`` (torch's F.linear, no repacking) gives the weight back from
    ``prepare_weight``: the layers keep it as their parameter (what sleep mode, LoRA and weight
    accounting read) and hold no second reference. (``param.data`` is a new object at every read:
    comparing two reads made every weight look "prepared" and emptied the parameter; the H200 run of
    2026-11-28 counted Llama-3.1-8B's parameters as 1.05 GB.)"""
    from halserve.platforms.weight_moves import weight_storages

    ctx = ModelContext("cuda", torch.float32, TorchAttentionBackend)  # (its kernels resolve on any host)
    w, x = torch.randn(8, 6), torch.randn(3, 6)
    layer = ColumnParallelLinear(6, 8, False, ctx, "col")
    assert type(layer.gemm_kernel).__name__ == "TorchGemm"
    load(layer, "weight", w)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.shape == (8, 6) and getattr(layer, "prepared_weight", None) is None
    torch.testing.assert_close(layer(x), F.linear(x, w))
    head = ParallelLMHead(10, 6, ctx)
    load(head, "weight", torch.randn(10, 6))
    head.process_weights_after_loading()
    assert head.prepared_weight is None and head.weight.shape == (10, 6)
    assert sum(t.untyped_storage().nbytes() for t in weight_storages(layer)) == w.numel() * 4


def test_a_kernel_that_repacks_the_weight_drops_the_dense_copy():
    from halserve.kernels.reference import TorchGemm

    class Transposing(TorchGemm):
        def prepare_weight(self, weight):
            return weight.t().contiguous()

        def __call__(self, x, weight, bias=None):
            return F.linear(x, weight.t(), bias)

    w, x = torch.randn(8, 6), torch.randn(3, 6)
    layer = ColumnParallelLinear(6, 8, False, CTX, "col")
    layer.gemm_kernel = Transposing()
    load(layer, "weight", w)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.numel() == 0 and layer.prepared_weight.shape == (6, 8)
    torch.testing.assert_close(layer(x), F.linear(x, w))
