"""Device handling shared by the platforms whose devices torch exposes as ``cuda``
(NVIDIA through CUDA, AMD through HIP): the same ``torch.cuda`` calls serve both."""
from __future__ import annotations

from typing import Any

from halserve.platforms.base import Platform


class TorchCudaApiPlatform(Platform):
    """A platform whose devices are driven through ``torch.cuda`` (subclasses set the
    class attributes and the probe)."""

    device_type = "cuda"

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count()

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        import torch

        return torch.cuda.mem_get_info(index)

    def set_device(self, index: int) -> None:
        import torch

        torch.cuda.set_device(index)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()

    def empty_host_cache(self) -> None:
        """torch's pinned-block cache emptied: ``torch.accelerator.empty_host_cache`` where torch has it
        (added in 2026; torch 2.13 has it), else ``torch._C._host_emptyCache`` (torch 2.5 on); torch
        older than 2.5 has neither, and its cached pinned blocks stay with this process until it exits."""
        import torch

        accelerator: Any = getattr(torch, "accelerator", None)
        if hasattr(accelerator, "empty_host_cache"):
            if accelerator.current_accelerator() is not None:
                accelerator.empty_host_cache()
        elif hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()

    def graph_capture(self):
        """torch.cuda graphs (HIP graphs on ROCm); None when the platform was moved off a GPU
        (the interpreted Triton tests put its tensors on the CPU)."""
        if self.device_type != "cuda":
            return None
        from halserve.platforms.graph_capture import CudaGraphCapture

        return CudaGraphCapture(self.device(), name=self.graph_mode)

    def seed_everything(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)
