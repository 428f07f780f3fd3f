"""The Platform interface: everything halserve needs to know about a kind of device.

A platform plugin subclasses ``Platform``, fills the class attributes and the small
``_probe`` hook, and returns the class from its ``halserve_platforms`` hook. halserve
calls ``probe()`` (cheap, never raises) to list and auto-detect platforms, and
instantiates only the selected platform.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from halserve.config import EngineConfig
    from halserve.distributed.communicator import DeviceCommunicator


@dataclass(frozen=True, slots=True)
class ProbeResult:
    available: bool
    reason: str  # always set: why available ("2 cores") or why not ("torch.version.hip is None; ...")


class Platform:
    """One kind of device. Subclasses set the class attributes below."""

    name: ClassVar[str]
    """What ``--platform`` takes, e.g. ``"cuda"``."""
    device_type: ClassVar[str]
    """The torch device type: ``cuda`` (CUDA and ROCm), ``xpu``, ``xla``, ``cpu``."""
    dist_backend: ClassVar[str]
    """torch.distributed backend: ``nccl``, ``gloo``, ``xccl``, ..."""
    ray_device_key: ClassVar[str] = "GPU"
    """The Ray resource one rank asks for (the ``ray`` executor): ``CPU`` (then as many as its
    threads), ``GPU`` (CUDA, ROCm and XPU devices) or ``TPU``; one device per rank otherwise."""
    priority: ClassVar[int] = 0
    """Auto-detection order: the available platform with the highest priority wins."""
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    """Model dtypes, by torch name, best first."""
    default_dtype: ClassVar[str] = "float32"
    """What ``dtype="auto"`` becomes when the checkpoint's dtype is not supported."""
    fp8_dtype: ClassVar[str | None] = None
    """``float8_e4m3fn`` (OCP, NVIDIA, MI350), ``float8_e4m3fnuz`` (MI300) or None."""
    preferred_attention_backends: ClassVar[tuple[str, ...]] = ("torch",)
    """Attention backends by name, in order of preference; the first that supports the
    model's configuration is used."""
    description: ClassVar[str] = ""
    graph_mode: ClassVar[str] = "eager"
    """How a decode step's forward runs, as ``halserve plugins`` shows it: ``cuda_graphs`` /
    ``hip_graphs`` (captured at start-up at padded batch sizes, replayed; ``graph_capture``),
    ``xla_buckets`` (the XLA runner's padded shapes, each compiled once), ``eager``."""

    @classmethod
    def auto_dtype(cls, checkpoint_dtype: str | None) -> tuple[str, str]:
        """(optional) What ``dtype="auto"`` becomes for a checkpoint stored in ``checkpoint_dtype``
        (a torch dtype name, or None when the config names none), with the reason to log.

        Called once by the model loader. Default: the checkpoint's dtype when this platform
        supports it, else ``default_dtype``. A platform overrides it when a supported dtype is
        not the fastest one here (the CPU without native bf16 dot products)."""
        if checkpoint_dtype in cls.supported_dtypes:
            return checkpoint_dtype, "the checkpoint's dtype"
        if checkpoint_dtype is None:
            return cls.default_dtype, f"the checkpoint names no dtype; {cls.name}'s default"
        return cls.default_dtype, f"{cls.name} does not support the checkpoint's {checkpoint_dtype}; its default"

    # -- probing (class level: nothing is instantiated to list platforms) -------------
    @classmethod
    def _probe(cls) -> ProbeResult:
        """(subclasses) Decide availability. May raise; ``probe`` turns that into a reason."""
        raise NotImplementedError

    @classmethod
    def probe(cls) -> ProbeResult:
        """Whether this platform can run here, with a human reason. Never raises."""
        try:
            result = cls._probe()
        except Exception as exc:  # noqa: BLE001 - a probe must never take the caller down
            return ProbeResult(False, f"probe raised {type(exc).__name__}: {exc}")
        if not isinstance(result, ProbeResult) or not result.reason:
            return ProbeResult(False, f"probe of {cls.name!r} returned {result!r} instead of a ProbeResult with a reason")
        return result

    def make_tp_communicator(self, group: Any, rank: int, size: int) -> Any:
        """(optional, plugin API 1) default: None. A faster all-reduce/all-gather than the device
        communicator's for some tensors: an object with ``supports(x)``, ``all_reduce(x)`` and
        ``all_gather(x, dim)``, tried first for the tensors it supports (the CPU's shared memory).
        Called by every rank of a tensor-parallel group (``group``: its process group, None for the
        default one) after torch.distributed is initialised; see ``halserve.distributed.set_tp_communicator``."""
        return None

    def make_device_communicator(self, group: Any, rank: int, size: int) -> DeviceCommunicator:
        """(optional, plugin API 2) default: ``halserve.distributed.communicator.DeviceCommunicator``,
        torch.distributed on ``dist_backend``. This platform's collectives and point-to-point ops
        (all_reduce, all_gather, all_to_all, broadcast, send, recv) for one group of ranks: return a
        subclass overriding the ops your collective library does (the kit's ``communicator`` check
        compares each with gloo's result on two processes).

        Called after torch.distributed is initialised, by every rank of each tensor-parallel group
        (``group``: its process group; ``rank``/``size``: within it) and, with pipeline stages, of
        the whole world (``group`` None) for the stages' send/recv."""
        from halserve.distributed.communicator import DeviceCommunicator

        return DeviceCommunicator(group, rank, size)

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {
            "device_type": cls.device_type,
            "dist_backend": cls.dist_backend,
            "ray_device_key": cls.ray_device_key,
            "priority": cls.priority,
            "supported_dtypes": list(cls.supported_dtypes),
            "default_dtype": cls.default_dtype,
            "fp8_dtype": cls.fp8_dtype,
            "preferred_attention_backends": list(cls.preferred_attention_backends),
            "graph_mode": cls.graph_mode,
            # (plugin API 2) whose collectives: the platform's own communicator or torch.distributed's
            "device_communicator": (f"{cls.__module__}.{cls.__qualname__}.make_device_communicator"
                                    if cls.make_device_communicator is not Platform.make_device_communicator
                                    else f"torch.distributed ({cls.dist_backend})"),
        }

    # -- device handling (instance level: only for the selected platform) -------------
    def device(self, index: int = 0) -> torch.device:
        import torch

        return torch.device(self.device_type, index)

    def device_count(self) -> int:
        """Number of devices of this platform visible to the process."""
        return 1

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        """(free_bytes, total_bytes) of device ``index``."""
        raise NotImplementedError(f"platform {self.name!r} does not report device memory")

    def kv_cache_budget(self, fraction: float) -> int:
        """Bytes the KV cache may take when the user did not size it (optional)
        default: ``fraction`` of the device memory still free after the model loaded."""
        free, _total = self.memory_info()
        return int(free * fraction)

    def memory_in_use(self, index: int = 0) -> int:
        """Bytes of device ``index`` this process holds, read after the model loaded (optional)
        default: total - free, which counts other processes' memory too (exact on a device of its own)."""
        free, total = self.memory_info(index)
        return total - free

    def kv_cache_budget_of_total(self, utilization: float) -> int:
        """vLLM's ``--gpu-memory-utilization``: this engine may use ``utilization`` of the device's total
        memory for everything; the KV cache gets that less ``memory_in_use()`` (weights loaded). Called
        by the model runner after loading; a ValueError says how much is missing."""
        _free, total = self.memory_info()
        in_use = self.memory_in_use()
        budget = int(total * utilization) - in_use
        if budget <= 0:
            gib = 1 << 30
            raise ValueError(
                f"--gpu-memory-utilization {utilization}: {utilization} x {total / gib:.1f} GiB of {self.name} "
                f"memory = {total * utilization / gib:.1f} GiB, but this process already holds "
                f"{in_use / gib:.1f} GiB with the model loaded, leaving nothing for the KV cache; raise it")
        return budget

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One layer's zeroed KV-cache tensor (optional) default: ``torch.zeros`` on
        ``self.device()``. A platform overrides it to place the cache specially."""
        import torch

        return torch.zeros(shape, dtype=dtype, device=self.device())

    def set_device(self, index: int) -> None:
        """Make ``index`` the current device of this process (optional) default: no-op."""

    def synchronize(self) -> None:
        """Wait for queued device work (optional) default: no-op."""

    def empty_cache(self) -> None:
        """Release cached allocator memory (optional) default: no-op."""

    # -- worker lifecycle: sleep mode (halserve.worker.sleep_mode) -----------------------
    def release_memory(self) -> None:
        """(optional) default: ``gc.collect()``, then ``empty_cache()`` (on CUDA and ROCm,
        ``torch.cuda.empty_cache``: the caching allocator's free blocks go back to the driver), then
        ``empty_host_cache()`` (pinned host blocks that held weights offloaded at level 1).

        Hand the memory the worker just freed back to the OS or the device driver, so that other
        programs can use it while the engine sleeps. Called by the worker after ``sleep`` dropped
        the KV cache (and at level 2 the weights), and after ``update_weights`` dropped the old
        weights. A platform whose allocator keeps freed memory overrides it (the CPU trims glibc's
        heap)."""
        import gc

        gc.collect()
        self.empty_cache()
        self.empty_host_cache()

    def empty_host_cache(self) -> None:
        """(optional) default: ``torch.accelerator.empty_host_cache()`` when torch has it and an
        accelerator is present, else nothing.

        torch's pinned-memory allocator (CachingHostAllocator) rounds each block up to a power of two
        and keeps freed blocks for reuse: after ``restore_weights`` dropped the host copies of the
        weights, their pinned memory is still held by this process until this call. Called by
        ``restore_weights`` and ``release_memory``."""
        import torch

        accelerator: Any = getattr(torch, "accelerator", None)
        if hasattr(accelerator, "empty_host_cache") and accelerator.current_accelerator() is not None:
            accelerator.empty_host_cache()

    def offload_weights(self, model: Any) -> None:
        """(optional) default: every tensor holding ``model``'s weights moved to host memory, pinned
        when it can (the copy back at wake_up is then a DMA): its parameters and buffers, and the
        tensors its modules keep as plain attributes (a quant method's repacked weights and scales,
        MLA's absorbed ``w_uk``/``w_uv``, a kernel's prepared weight; halserve.platforms.weight_moves).
        Each storage moves once, so tensors that shared one (a scale and its view, tied weights)
        still share one.

        Sleep level 1 keeps the weights in host memory and frees their device memory; called by the
        worker before ``release_memory``. ``restore_weights`` undoes it at ``wake_up``. A platform
        whose weights already live in host memory (the CPU) makes it a no-op. Host memory held while
        asleep: the weights' bytes, each storage's block rounded up to a power of two by torch's
        pinned allocator (at most twice the weights; pageable memory, when pinning fails, is exact)."""
        import torch

        from halserve.platforms.weight_moves import move_weights

        pin = True

        def to_host(data: torch.Tensor) -> torch.Tensor:  # data: one storage as uint8 [nbytes]
            nonlocal pin
            host = None
            if pin:
                try:
                    host = torch.empty(data.shape, dtype=torch.uint8, device="cpu", pin_memory=True)
                except RuntimeError:  # no pinned memory on this machine: pageable then
                    pin = False
            if host is None:
                host = torch.empty(data.shape, dtype=torch.uint8, device="cpu")
            return host.copy_(data)

        move_weights(model, to_host)

    def restore_weights(self, model: Any) -> None:
        """(optional) default: every tensor ``offload_weights`` moved goes back to ``self.device()``,
        the host copies are dropped and ``empty_host_cache()`` hands their pinned memory back. Called
        by the worker at ``wake_up`` after a level-1 sleep (``offload_weights``)."""
        from halserve.platforms.weight_moves import move_weights

        device = self.device()
        move_weights(model, lambda data: data.to(device, non_blocking=True, copy=True))
        self.synchronize()  # (torch's pinned allocator reuses a freed block only after its copies ran)
        self.empty_host_cache()

    def supports_fp8(self) -> bool:
        return self.fp8_dtype is not None

    def fp8_e4m3_dtype(self) -> str | None:
        """The e4m3 fp8 flavour of *this* device (optional) default: ``fp8_dtype``. A
        platform whose parts differ (MI300's e4m3fnuz, MI350's OCP e4m3fn) overrides it;
        an fp8 KV cache ("fp8", "fp8_e4m3") is allocated in it."""
        return self.fp8_dtype

    def graph_capture(self) -> Any:
        """(optional) default: None, every step runs eagerly. A ``halserve.platforms.graph_capture.
        GraphCapture`` that records a decode step's forward and replays it. Called once per model
        runner after its warm-up (never with ``enforce_eager``); the runner then captures decode-only
        batches at the padded sizes of ``halserve.worker.capture_sizes`` and runs the others eagerly."""
        return None

    def seed_everything(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    model_runner_cls: ClassVar[str] = "halserve.worker.model_runner:ModelRunner"
    """(optional) "module:Class" of the model runner this platform's workers use; XLA
    platforms need one that pads steps to static shapes."""

    def check_and_update_config(self, config: EngineConfig) -> None:
        """Adjust an EngineConfig for this platform (optional) default: resolve ``dtype``.

        Called once after selection, before the config is used. Must be idempotent.
        Raise ``ValueError`` for settings this platform cannot run.
        """
        dtype = getattr(config, "dtype", None)
        if dtype not in (None, "auto") and dtype not in self.supported_dtypes:
            raise ValueError(
                f"platform {self.name!r} does not support dtype {dtype!r}; supported: "
                f"{', '.join(self.supported_dtypes)}"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

