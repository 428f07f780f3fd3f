"""Layer override (plugin API 2): models built for platform ``example`` get ``ExampleRMSNorm``
wherever halserve's own models build ``RMSNorm`` (registered in ``plugin.halserve_layer_overrides``).

The contract halserve checks when the plugin loads: a subclass of the built-in, the same constructor
signature (``hidden_size, eps, ctx``), the same ``forward(x, residual=None)`` arguments, and, once
built, the same parameters (``weight [hidden_size]``), so checkpoints load unchanged. The kit's
``layers`` check runs it against ``RMSNorm`` on the same weights.

``calls`` counts forwards in this process and the first one is logged, so a served completion shows
that the override ran (``scripts/vendor_example_check.sh`` greps the server's log for it).
"""
from __future__ import annotations

import logging

from halserve.layers import RMSNorm

logger = logging.getLogger(__name__)


class ExampleRMSNorm(RMSNorm):
    calls = 0  # forwards in this process (all instances)

    def forward(self, x, residual=None):
        import torch

        cls = type(self)
        cls.calls += 1
        if cls.calls == 1:
            logger.info("ExampleRMSNorm: first forward on the example device (hidden_size %d)", self.hidden_size)
        if residual is not None:  # the fused residual form: (normed(x + residual), x + residual)
            x = x + residual
            residual = x
        # [T, hidden_size]: normalise in fp32, round once, scale by the weight
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return out if residual is None else (out, residual)
