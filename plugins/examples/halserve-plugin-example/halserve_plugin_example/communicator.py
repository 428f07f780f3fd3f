"""The example device's communicator (plugin API 2): what ``ExamplePlatform.make_device_communicator``
returns for each group of ranks. Every op not overridden here is halserve's torch.distributed default
(gloo for this device): a vendor overrides the ops its collective library does and calls ``super()``
for the rest. The kit's ``communicator`` check compares every op with gloo's on two processes.
"""
from __future__ import annotations

from halserve.distributed.communicator import DeviceCommunicator


class ExampleCommunicator(DeviceCommunicator):
    def all_reduce(self, x):
        """Half-precision sums travel in float32 and are rounded once (as a device accumulating in
        fp32 would); float32 goes through the default."""
        import torch

        if x.dtype not in (torch.float16, torch.bfloat16):
            return super().all_reduce(x)
        acc = x.float()  # [same shape as x]
        super().all_reduce(acc)
        return x.copy_(acc)
