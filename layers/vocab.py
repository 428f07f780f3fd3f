"""Token embedding and LM head, sharded along the vocabulary across tensor-parallel ranks.

    vocab (padded to a multiple of tp):  | rank 0 rows | rank 1 rows | ... |
    embedding: each rank looks up the ids it owns (zeros elsewhere), all-reduce sums
    lm head:   each rank scores its rows, all-gather concatenates, padding is cut off

With the ``gguf`` quantization method, a token embedding (and the LM head it ties, or an untied one) whose
GGUF type has a ``gguf_gemm`` kernel keeps the file's blocks, ``uint8 [rows, row bytes]``: a lookup
dequantizes the rows it reads, the LM head runs ``gguf_gemm`` (SmolLM2's 49152 x 576 head in Q8_0 is a
quarter of float32's bytes to read per decode step).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from halserve.distributed import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from halserve.kernels import resolve_kernel
from halserve.layers.context import ModelContext


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ModelContext) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_padded = -(-num_embeddings // self.tp_size) * self.tp_size
        self.rows_per_rank = self.num_embeddings_padded // self.tp_size
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.embedding_dim = embedding_dim
        self.dtype = ctx.dtype
        # the GGUF type whose blocks this layer holds (None: a float weight); the quant method decides
        self.gguf_qtype: str | None = self._gguf_qtype(ctx)
        shape: tuple[int, ...] = (self.rows_per_rank, embedding_dim)
        dtype = ctx.dtype
        if self.gguf_qtype is not None:
            from halserve.kernels.gguf_blocks import row_bytes

            shape, dtype = (self.rows_per_rank, row_bytes(self.gguf_qtype, embedding_dim)), torch.uint8
        self.weight = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def _gguf_qtype(self, ctx: ModelContext) -> str | None:
        vocab_qtype = getattr(ctx.quant_method, "vocab_qtype", None)
        return None if vocab_qtype is None else vocab_qtype("embedding")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if (loaded.dtype == torch.uint8) != (param.dtype == torch.uint8):
            raise ValueError(f"{type(self).__name__}: the checkpoint tensor is {loaded.dtype}, the layer holds "
                             f"{param.dtype} (GGUF blocks are uint8; the quant method and the loader disagree)")
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"embedding checkpoint tensor has shape {tuple(loaded.shape)}, expected "
                f"({self.num_embeddings}, {param.shape[1]}) (vocab_size, hidden_size)"
            )
        rows = loaded[self.vocab_start : self.vocab_end]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids [T] -> [T, hidden]
        if self.tp_size == 1:
            return self._lookup(input_ids)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = self._lookup(local_ids) * owned.unsqueeze(-1).to(self.dtype)
        return tensor_model_parallel_all_reduce(out)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf_qtype is None:
            return F.embedding(ids, self.weight)
        from halserve.kernels.gguf_blocks import dequantize

        rows = self.weight[ids.reshape(-1)]  # [T, row bytes] uint8
        return dequantize(rows, self.gguf_qtype, self.embedding_dim).to(self.dtype).reshape(*ids.shape, -1)

    def extra_repr(self) -> str:
        kind = "" if self.gguf_qtype is None else f", {self.gguf_qtype} blocks"
        return f"{self.num_embeddings}, {self.embedding_dim}, rows_per_rank={self.rows_per_rank}{kind}"


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> float32 logits over the vocabulary. ``tie_to`` shares the
    embedding's weight (tied word embeddings): nothing separate is loaded."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ModelContext,
                 tie_to: VocabParallelEmbedding | None = None) -> None:
        self._is_tied = tie_to is not None  # (a plain flag: before Module.__init__, and no submodule)
        self._tied_qtype = None if tie_to is None else tie_to.gguf_qtype
        super().__init__(num_embeddings, embedding_dim, ctx)
        if tie_to is not None:
            self.weight = tie_to.weight
        if self.gguf_qtype is not None:
            self.gemm = resolve_kernel("gguf_gemm", ctx.platform_name, dtype=ctx.dtype_name, n=self.rows_per_rank,
                                       k=embedding_dim, qtype=self.gguf_qtype)
            if hasattr(self.gemm, "min_activation_levels"):  # a kernel that rounds activations to int8 blocks:
                # two levels (x ~ d q + d2 q2) here, as one level's ~0.7% error flips near-tie tokens
                self.gemm.min_activation_levels = 2
            if hasattr(self.gemm, "cache_panel"):  # many rows (32+ streams): keep the dequantized head between
                # steps rather than dequantizing all its rows each step (vocab x hidden x 4 bytes, on first use)
                self.gemm.cache_panel = True
        else:
            self.gemm = resolve_kernel("gemm", ctx.platform_name, dtype=ctx.dtype_name,
                                       n=self.rows_per_rank, k=embedding_dim)

    def _gguf_qtype(self, ctx: ModelContext) -> str | None:
        if self._is_tied:  # the embedding's weight, blocks or not
            return self._tied_qtype
        vocab_qtype = getattr(ctx.quant_method, "vocab_qtype", None)
        return None if vocab_qtype is None else vocab_qtype("lm_head")

    def process_weights_after_loading(self) -> None:
        # Called once by the loader. The dense weight stays: a tied embedding reads it too.
        if self.gguf_qtype is not None:  # the blocks as stored (a tied embedding reads them too)
            self.prepared_weight = None
            return
        data = self.weight.data  # (a new tensor object at every read: compared once)
        prepared = self.gemm.prepare_weight(data)
        self.prepared_weight = None if prepared is data else prepared

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [N, hidden] -> logits [N, vocab] float32
        weight = getattr(self, "prepared_weight", None)
        weight = self.weight if weight is None else weight
        if self.gguf_qtype is not None:
            logits = self._gguf_logits(hidden, weight)  # [N, rows_per_rank]
        else:
            logits = self.gemm(hidden, weight, None)  # [N, rows_per_rank]
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.num_embeddings].float()

    def _gguf_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The GGUF head's logits; rows whose logits only feed an argmax (``forward_context.set_argmax_rows``)
        through the kernel's ``argmax_logits`` where it has one (same first maximum, cheaper elsewhere)."""
        from halserve.forward_context import argmax_only_rows

        argmax_logits = getattr(self.gemm, "argmax_logits", None)
        rows = None if argmax_logits is None else argmax_only_rows()
        if rows is None or len(rows) != hidden.shape[0] or not any(rows):
            return self.gemm(hidden, weight, self.gguf_qtype)
        if all(rows):
            return argmax_logits(hidden, weight, self.gguf_qtype)
        mask = torch.tensor(rows, device=hidden.device)
        picked, others = mask.nonzero().squeeze(1), (~mask).nonzero().squeeze(1)
        first = argmax_logits(hidden.index_select(0, picked), weight, self.gguf_qtype)
        logits = torch.empty(hidden.shape[0], first.shape[1], dtype=first.dtype, device=first.device)
        logits.index_copy_(0, picked, first)
        logits.index_copy_(0, others, self.gemm(hidden.index_select(0, others), weight, self.gguf_qtype).to(first.dtype))
        return logits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding lookup; call compute_logits(hidden)")
