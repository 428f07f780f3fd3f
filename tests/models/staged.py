"""Loading a checkpoint for the model tests: whole, or as its pipeline stages in one process.

``load(path, num_stages=1)``: the model as the engine builds it (float32, CPU platform, the torch
reference attention backend); with ``num_stages`` > 1 a ``StagedModel`` whose stages are built and
loaded as their ranks would (the pipeline state set by hand), run one after another.
"""
from __future__ import annotations

import torch

import halserve.distributed as distributed


def load(path: str, num_stages: int = 1):
    from halserve.attention_backends.torch_ref import TorchAttentionBackend
    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info, load_model
    from halserve.platforms.cpu import CpuPlatform

    config = EngineConfig(model=path, dtype="float32", pipeline_parallel_size=num_stages)
    platform = CpuPlatform()
    info = get_model_info(config, platform)
    if num_stages == 1:
        return load_model(config, info, platform, TorchAttentionBackend, progress=False)
    stages = []
    try:
        for stage in range(num_stages):
            distributed._pp_state = distributed.PipelineParallelState(rank=stage, size=num_stages)
            stages.append(load_model(config, info, platform, TorchAttentionBackend, progress=False))
    finally:
        distributed.destroy_tensor_parallel()
    return StagedModel(stages)


class StagedModel(torch.nn.Module):
    """The stages of one model, run one after another as the ranks would (stage s's intermediate
    tensors into stage s + 1). The first stage embeds: a vision-language model's ``embed_*`` and its
    ``inputs_embeds`` are the first stage's."""

    def __init__(self, stages: list[torch.nn.Module]) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(stages)
        for name in ("config", "embed_input_ids", "embed_images", "embed_multimodal"):
            if hasattr(stages[0], name):
                setattr(self, name, getattr(stages[0], name))

    @property
    def attention_layers(self):
        return [layer for stage in self.stages for layer in stage.attention_layers]

    def forward(self, input_ids, positions, inputs_embeds=None):
        first = {} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        carried = self.stages[0](input_ids, positions, **first)
        for stage in self.stages[1:]:
            carried = stage(input_ids, positions, carried)
        return carried

    def compute_logits(self, hidden):
        return self.stages[-1].compute_logits(hidden)
