"""``OffloadingConnector``: a second tier of the prefix cache in host memory (vLLM's name and keys).

Every block the engine fills is also copied into a host pool (write-through, after the step's
forward). When a new request's prefix is no longer in the device cache (its blocks were evicted
for others) but still in the pool, the blocks are copied back instead of recomputed. The pool is
an LRU of ``num_cpu_blocks`` rows, the same rows on every rank (each holds its share of heads).

The scheduler side owns the pool's index (key -> row) and picks the rows; the workers only copy,
so both sides agree without talking. Size it with ``cpu_bytes_to_use`` (all ranks together) or
``num_cpu_blocks``. On a GPU the pool is pinned host memory.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from halserve.kv_connectors.block_store import BlockStoreConnector

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from halserve.config import EngineConfig
    from halserve.kv_connectors.base import BlockTransfer, KVCacheAccess, KVTransferConfig


def _positive_int(extra: dict, key: str, name: str = "OffloadingConnector") -> int | None:
    value = extra.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 1:
        raise ValueError(f"{name}: {key} must be a positive integer, got {value!r}")
    return int(value)


def check_pool_config(name: str, extra: dict, config: EngineConfig) -> None:
    """The host pool's settings: exactly one size, and whole engine blocks."""
    nbytes, nblocks = _positive_int(extra, "cpu_bytes_to_use", name), _positive_int(extra, "num_cpu_blocks", name)
    if (nbytes is None) == (nblocks is None):
        raise ValueError(f'{name} needs exactly one of kv_connector_extra_config "cpu_bytes_to_use" (host bytes for '
                         'all ranks, e.g. 8000000000) and "num_cpu_blocks"')
    block_size = _positive_int(extra, "block_size", name)
    if block_size is not None and block_size != config.block_size:
        raise ValueError(f"{name}: block_size {block_size} differs from the engine's block_size {config.block_size}; "
                         "halserve moves whole engine blocks (drop the key or make them equal)")


class OffloadingConnector(BlockStoreConnector):
    name = "OffloadingConnector"
    description = "an LRU pool of K/V blocks in host memory behind the device prefix cache"
    extra_config_keys = ("cpu_bytes_to_use", "num_cpu_blocks", "block_size")

    @classmethod
    def check_config(cls, transfer_config: KVTransferConfig, config: EngineConfig) -> None:
        super().check_config(transfer_config, config)
        check_pool_config(cls.name, transfer_config.kv_connector_extra_config, config)
        if transfer_config.kv_role != "kv_both":
            raise ValueError(f"OffloadingConnector saves and loads its own blocks: kv_role must be 'kv_both', "
                             f"got {transfer_config.kv_role!r}")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_slots = 0
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> pool row, least recently used first
        self._free: list[int] = []
        self.pool: torch.Tensor | None = None  # (worker) [num_slots, *block_shape]
        # (worker) the key each row holds; None while it is written (or never was): a load checks it,
        # so a save that failed is a failed load (recomputed), never another block's K/V
        self._row_keys: list[str | None] = []

    # -- sizing (worker, then scheduler) ---------------------------------------------------
    def register_kv_caches(self, caches: KVCacheAccess) -> None:
        import torch

        super().register_kv_caches(caches)
        rows = _positive_int(self.extra, "num_cpu_blocks", self.name)
        if rows is None:
            rows = self.extra["cpu_bytes_to_use"] // (self.context.world_size * caches.bytes_per_block)
        if rows < 1:
            raise ValueError(f"{self.name}: cpu_bytes_to_use={self.extra['cpu_bytes_to_use']} holds no block "
                             f"of {caches.bytes_per_block} bytes per rank x {self.context.world_size} ranks; raise it")
        pin = caches.device.type != "cpu" and torch.cuda.is_available()
        self.pool = torch.empty((rows, *caches.block_shape), dtype=caches.dtype, pin_memory=pin)
        self._row_keys = [None] * rows

    def worker_info(self) -> dict[str, Any]:
        return {"num_cpu_blocks": 0 if self.pool is None else self.pool.shape[0]}

    def on_workers_ready(self, infos: list[dict[str, Any]]) -> None:
        self.num_slots = min(info["num_cpu_blocks"] for info in infos)
        self._free = list(range(self.num_slots - 1, -1, -1))

    # -- scheduler side ----------------------------------------------------------------
    def count_present(self, keys: list[str]) -> int:
        count = 0
        for key in keys:
            if key not in self._index:
                break
            count += 1
        return count

    def missing(self, keys: list[str]) -> list[bool]:
        return [key not in self._index for key in keys]

    def slots_for_loads(self, keys: list[str]) -> list[int | None]:
        for key in keys:
            self._index.move_to_end(key)
        return [self._index[key] for key in keys]

    def slots_for_saves(self, keys: list[str]) -> dict[str, int | None]:
        """Free rows first, then the least recently used ones. A row loaded this step may be taken:
        the workers load before the forward and save after it. Of more saves than rows, the last
        ``num_slots`` are kept."""
        slots: dict[str, int | None] = {}
        for key in keys[max(0, len(keys) - self.num_slots):]:
            slot = self._free.pop() if self._free else self._index.popitem(last=False)[1]
            self._index[key] = slot
            slots[key] = slot
        return slots

    # -- worker side -------------------------------------------------------------------
    def load_blocks(self, transfers: list[BlockTransfer]) -> set[int]:
        import torch

        good = [t for t in transfers if self._row_keys[t.slot] == t.key]
        if good:
            rows = torch.tensor([t.slot for t in good], dtype=torch.long)
            self.caches.write([t.block_id for t in good], self.pool.index_select(0, rows))
        return {t.block_id for t in transfers} - {t.block_id for t in good}

    def save_blocks(self, transfers: list[BlockTransfer], data: torch.Tensor) -> None:
        import torch

        for t in transfers:
            self._row_keys[t.slot] = None
        rows = torch.tensor([t.slot for t in transfers], dtype=torch.long)
        self.pool.index_copy_(0, rows, data.to("cpu", non_blocking=False))
        for t in transfers:
            self._row_keys[t.slot] = t.key
