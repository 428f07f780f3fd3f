"""Model variant (plugin API 2): on platform ``example`` the architecture ``LlamaForCausalLM`` is
built as ``ExampleLlamaForCausalLM`` (``ModelArchitecture(..., platform="example", override=True)`` in
``plugin.halserve_model_architectures``); every other platform keeps halserve's own.

A vendor subclasses the built-in and changes what its device needs (a fused MLP, another weight
layout made in ``load_weights``); the kit's ``variants`` check requires greedy outputs identical to
the built-in's on a random checkpoint. This one only marks itself and logs when it is built.
"""
from __future__ import annotations

import logging

from halserve.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


class ExampleLlamaForCausalLM(LlamaForCausalLM):
    built = 0  # instances made in this process

    def __init__(self, hf_config, ctx, make_mlp=None):
        super().__init__(hf_config, ctx, make_mlp)
        type(self).built += 1
        logger.info("ExampleLlamaForCausalLM: built for platform %s", ctx.platform_name)
