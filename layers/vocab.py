"""Token embedding and LM head, sharded along the vocabulary across tensor-parallel ranks.

    vocab (padded to a multiple of tp):  | rank 0 rows | rank 1 rows | ... |
    embedding: each rank looks up the ids it owns (zeros elsewhere), all-reduce sums
    lm head:   each rank scores its rows, all-gather concatenates, padding is cut off
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
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, embedding_dim, dtype=ctx.dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
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
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.weight.shape[1]}, rows_per_rank={self.rows_per_rank}"


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> float32 logits over the vocabulary. ``tie_to`` shares the
    embedding's weight (tied word embeddings): nothing separate is loaded."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ModelContext,
                 tie_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, ctx)
        if tie_to is not None:
            self.weight = tie_to.weight
        self.gemm = resolve_kernel("gemm", ctx.platform_name, dtype=ctx.dtype_name,
                                   n=self.rows_per_rank, k=embedding_dim)

    def process_weights_after_loading(self) -> None:
        # Called once by the loader. The dense weight stays: a tied embedding reads it too.
        prepared = self.gemm.prepare_weight(self.weight.data)
        self.prepared_weight = None if prepared is self.weight.data else prepared

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [N, hidden] -> logits [N, vocab] float32
        weight = getattr(self, "prepared_weight", None)
        logits = self.gemm(hidden, self.weight if weight is None else weight, None)  # [N, rows_per_rank]
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.num_embeddings].float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding lookup; call compute_logits(hidden)")
