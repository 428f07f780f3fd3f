"""Google TPUs through torch-xla (PJRT)."""
from __future__ import annotations

import glob
import importlib.util
import os

from halserve.platforms.base import Platform, ProbeResult
from halserve.plugins import PluginManifest, hookimpl

# TEST-ONLY: makes the tpu platform available on torch-xla's CPU device (PJRT_DEVICE=CPU),
# so its model runner and XLA attention fallback run in CI without a TPU. Never on by default.
TEST_SWITCH = "HALSERVE_TPU_ALLOW_XLA_CPU"


def _test_switch_on() -> bool:
    return os.environ.get(TEST_SWITCH, "").strip().lower() in ("1", "true", "yes")


def _tpu_device_files() -> list[str]:
    # TPU VMs expose the chips as /dev/accel* (v2-v4) or /dev/vfio/<n> (v5e and later).
    return glob.glob("/dev/accel*") + [p for p in glob.glob("/dev/vfio/*") if os.path.basename(p).isdigit()]


class TpuPlatform(Platform):
    name = "tpu"
    device_type = "xla"
    dist_backend = "xla"
    ray_device_key = "TPU"
    priority = 70
    supported_dtypes = ("bfloat16", "float32")
    default_dtype = "bfloat16"
    fp8_dtype = None
    preferred_attention_backends = ("xla", "torch")
    description = "Google TPUs (torch-xla / PJRT; Pallas ragged paged attention)"
    graph_mode = "xla_buckets"
    model_runner_cls = "halserve.worker.xla_model_runner:XlaModelRunner"

    @classmethod
    def _probe(cls) -> ProbeResult:
        if importlib.util.find_spec("torch_xla") is None:
            return ProbeResult(False, "torch_xla is not installed (pip install 'halserve[tpu]' on a TPU VM)")
        pjrt = os.environ.get("PJRT_DEVICE", "")
        if _test_switch_on() and pjrt.upper() in ("", "CPU"):
            return ProbeResult(
                True,
                f"test switch {TEST_SWITCH}=1: running on the XLA CPU device (PJRT_DEVICE=CPU), "
                "not a TPU; for tests only",
            )
        if pjrt and pjrt.upper() != "TPU":
            return ProbeResult(False, f"PJRT_DEVICE={pjrt} selects a non-TPU XLA device; there is no TPU to run on")
        if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
            return ProbeResult(False, "torch_xla is installed but libtpu is not (no TPU runtime): this is not a TPU VM")
        devices = _tpu_device_files()
        if not devices:
            return ProbeResult(False, "no TPU chips found (/dev/accel* and /dev/vfio/<n> are absent)")
        return ProbeResult(True, f"{len(devices)} TPU chip(s) found")

    def __init__(self) -> None:
        if _test_switch_on() and not os.environ.get("PJRT_DEVICE"):
            # the switch means the XLA CPU device; never let torch-xla guess
            os.environ["PJRT_DEVICE"] = "CPU"

    @staticmethod
    def is_real_tpu() -> bool:
        """Whether the XLA device is a TPU (not the XLA CPU device of the test switch)."""
        from halserve.attention_backends.xla import xla_device_kind

        return xla_device_kind() == "TPU"

    def device(self, index: int = 0):
        import torch_xla

        return torch_xla.device(index)

    def device_count(self) -> int:
        import torch_xla.runtime as xr

        return xr.addressable_device_count()

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        import torch_xla.core.xla_model as xm

        if not self.is_real_tpu():  # XLA CPU device (test switch): host memory
            import psutil

            vm = psutil.virtual_memory()
            return vm.available, vm.total

        info = xm.get_memory_info(self.device(index))
        total = int(info.get("bytes_limit", info.get("kb_total", 0) * 1024))
        used = int(info.get("bytes_used", total - info.get("kb_free", 0) * 1024))
        return total - used, total

    def synchronize(self) -> None:
        import torch_xla

        torch_xla.sync()


@hookimpl
def halserve_manifest() -> PluginManifest:
    return PluginManifest(name="tpu", version="0.1.0", api=">=1,<3", description=TpuPlatform.description)


@hookimpl
def halserve_platforms() -> list[type]:
    return [TpuPlatform]


@hookimpl
def halserve_attention_backends() -> list[type]:
    # The module imports no torch_xla; the backend imports it inside its calls.
    from halserve.attention_backends.xla import XlaAttentionBackend

    return [XlaAttentionBackend]
