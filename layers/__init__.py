"""Model building blocks: they resolve their kernels once at construction and delegate
matmuls to the quant method and attention to the selected backend."""
from halserve.layers.activation import GeluAndMul, SiluAndMul
from halserve.layers.attention import Attention
from halserve.layers.context import ModelContext
from halserve.layers.fused_moe import FusedMoE
from halserve.layers.layernorm import GemmaRMSNorm, RMSNorm
from halserve.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from halserve.layers.rotary import RotaryEmbedding, get_rope
from halserve.layers.vocab import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "FusedMoE",
    "GeluAndMul",
    "GemmaRMSNorm",
    "LinearBase",
    "MergedColumnParallelLinear",
    "ModelContext",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "get_rope",
]
