"""What the vision-language models share (LLaVA, LLaVA-NeXT, Qwen2-VL, InternVL): a Llama-family decoder
under ``language_model`` (``LlamaForCausalLM``) and vision parts under ``VISION_PREFIXES``, built on the
first pipeline stage only. Subclasses add the multimodal protocol's model-specific members
(docs/multimodal.md) and ``_load_vision_weight``."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from halserve.distributed import get_pp_state
from halserve.layers import Attention
from halserve.models.llama import LlamaForCausalLM
from halserve.models.pipeline import IntermediateTensors


class VisionLanguageModel(nn.Module):
    supports_pipeline_parallel = True
    supports_multimodal = True
    STACKED_PARAMS = LlamaForCausalLM.STACKED_PARAMS  # the decoder's fused q/k/v and gate/up (read by LoRA)
    # checkpoint name prefix -> ours, first match wins (map_checkpoint_name); ours put the decoder under
    # language_model.model. / language_model.lm_head.
    CHECKPOINT_RENAMES: list[tuple[str, str]] = []
    VISION_PREFIXES: tuple[str, ...] = ()  # (our names) the tensors _load_vision_weight loads

    language_model: LlamaForCausalLM

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        return self.language_model.model(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The text embeddings [T, H] of ``input_ids`` [T] (first pipeline stage)."""
        return self.language_model.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    @property
    def attention_layers(self) -> list[Attention]:
        return self.language_model.attention_layers

    @classmethod
    def image_token_id(cls, hf_config: Any) -> int:
        """The id of the image placeholder token: the config's ``image_token_id`` (``image_token_index``
        in older LLaVA configs)."""
        token_id = getattr(hf_config, "image_token_id", None)
        if token_id is None:
            token_id = getattr(hf_config, "image_token_index", None)
        if token_id is None:
            raise ValueError(f"the {type(hf_config).__name__} names no image token (image_token_id / "
                             "image_token_index); is the checkpoint's config.json complete?")
        return int(token_id)

    @classmethod
    def map_checkpoint_name(cls, name: str) -> str:
        """A checkpoint's (or a LoRA adapter's) tensor or module name -> ours."""
        for theirs, ours in cls.CHECKPOINT_RENAMES:
            if name.startswith(theirs):
                return ours + name.removeprefix(theirs)
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors (any naming ``CHECKPOINT_RENAMES`` maps) -> the set of loaded parameter names
        of this module. The decoder's stream through ``LlamaForCausalLM.load_weights`` (q/k/v and gate/up
        fusion, tensor-parallel slicing, other pipeline stages' layers, a tied LM head); the vision parts'
        load on the way (first pipeline stage; skipped on the others)."""
        is_first = get_pp_state().is_first
        loaded: set[str] = set()

        def language_weights():
            for original, tensor in weights:
                name = self.map_checkpoint_name(original)
                if name.startswith("language_model."):
                    yield name.removeprefix("language_model."), tensor
                elif name.startswith(self.VISION_PREFIXES):
                    if is_first:
                        loaded.update(self._load_vision_weight(name, original, tensor))
                else:
                    raise ValueError(f"checkpoint tensor {original!r} has no matching parameter in "
                                     f"{type(self).__name__}; is this checkpoint for a different architecture?")

        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(language_weights())}
        return loaded

    def _load_vision_weight(self, name: str, original: str, tensor: torch.Tensor) -> Iterable[str]:
        """Load one vision tensor (``name``: ours, ``original``: the checkpoint's); the names of the
        parameters it loaded (none for a tensor skipped: a vision layer not built). Each model defines it."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to load its vision tensors "
                                  "(_load_vision_weight)")

    def _load_parameter(self, module: nn.Module, prefix: str, name: str, original: str,
                        tensor: torch.Tensor) -> set[str]:
        """Copy ``tensor`` into ``module``'s parameter ``name`` (``prefix``: the module's name here)."""
        params = dict(module.named_parameters(prefix=prefix))
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {original!r} has no matching parameter in {prefix} of "
                             f"{type(self).__name__} (expected one of {', '.join(params)})")
        if param.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {original!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.data.copy_(tensor)
        return {name}
