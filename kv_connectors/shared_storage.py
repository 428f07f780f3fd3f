"""``SharedStorageConnector``: K/V blocks as files in a directory every engine can reach.

One safetensors file per block and rank::

    <shared_storage_path>/<namespace>/<rank tag>/<key[:2]>/<key>.safetensors     tensor "kv"
                                                     [num_layers, 2, block_size, num_kv_heads, head_size]

``namespace`` (16 hex digits) hashes what makes K/V differ between engines for equal tokens: the
model (its path or hub id), dtype, KV-cache dtype, quantization and shapes; ``rank tag`` the
tensor-parallel layout. The key is the block's chained hash, so a file serves any request whose
prompt starts with the same tokens, on any engine sharing the directory: a second instance (or
the same one after a restart) skips the prefill of what the first computed, and a prefill
instance (``kv_producer``) can hand its K/V to a decode instance (``kv_consumer``).

Files are written to a temporary name and renamed, so a reader never sees half a file. With
``max_storage_bytes`` a producer keeps its namespace under that size: at the step after every tenth
of it saved, it deletes the least recently used files (a load refreshes a file's time) down to 90%. Without it
nothing is ever deleted. A file that cannot be read (removed, truncated, from another layout) is
reported and its requests are recomputed, so deleting files under a running engine is safe.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any

from halserve.kv_connectors.block_store import BlockStoreConnector

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from halserve.config import EngineConfig
    from halserve.kv_connectors.base import BlockTransfer, KVTransferConfig

logger = logging.getLogger(__name__)


class SharedStorageConnector(BlockStoreConnector):
    name = "SharedStorageConnector"
    description = "K/V blocks as safetensors files in a shared directory (prefix reuse across engines, P/D)"
    extra_config_keys = ("shared_storage_path", "namespace", "max_storage_bytes")

    @classmethod
    def check_config(cls, transfer_config: KVTransferConfig, config: EngineConfig) -> None:
        super().check_config(transfer_config, config)
        path = transfer_config.kv_connector_extra_config.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise ValueError('SharedStorageConnector needs kv_connector_extra_config "shared_storage_path": a '
                             'directory every engine can reach, e.g. {"shared_storage_path": "/mnt/kv"}')
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"SharedStorageConnector: cannot create shared_storage_path {path!r}: {exc}") from None
        cap = transfer_config.kv_connector_extra_config.get("max_storage_bytes")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"SharedStorageConnector: max_storage_bytes must be a positive integer (bytes), "
                             f"got {cap!r}")
        if transfer_config.is_producer and not os.access(path, os.W_OK):
            raise ValueError(f"SharedStorageConnector: shared_storage_path {path!r} is not writable, and kv_role "
                             f"{transfer_config.kv_role!r} saves there; fix its permissions or use kv_consumer")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        namespace = self.extra.get("namespace") or hashlib.sha256(self.context.model_id.encode()).hexdigest()[:16]
        self.root = os.path.join(self.extra["shared_storage_path"], str(namespace))
        self.max_storage_bytes: int | None = self.extra.get("max_storage_bytes")
        self._block_bytes = 0  # (scheduler) one block of every rank, on disk (from the workers)
        self._bytes_since_prune = 0

    def path(self, rank_tag: str, key: str) -> str:
        return os.path.join(self.root, rank_tag, key[:2], key + ".safetensors")

    def _stored(self, key: str) -> bool:
        return all(os.path.exists(self.path(tag, key)) for tag in self.context.rank_tags)

    # -- scheduler side ----------------------------------------------------------------
    def on_workers_ready(self, infos: list[dict[str, Any]]) -> None:
        self._block_bytes = sum(info.get("block_bytes", 0) for info in infos)

    def build_connector_meta(self, scheduler_output, requests):
        cap = self.max_storage_bytes
        # (the saves of the steps before are on disk by now: the workers write them after their forward)
        if cap is not None and self._bytes_since_prune >= max(cap // 10, self._block_bytes, 1):
            self._bytes_since_prune = 0
            self.prune(cap)
        meta = super().build_connector_meta(scheduler_output, requests)
        if cap is not None:
            self._bytes_since_prune += len(meta.saves) * self._block_bytes
        return meta

    def prune(self, max_bytes: int) -> int:
        """Delete the least recently used block files of this namespace until it holds at most 90%
        of ``max_bytes``; returns the bytes deleted. Files another engine deletes meanwhile are skipped."""
        files = []
        for folder, _, names in os.walk(self.root):
            for name in names:
                if name.endswith(".safetensors"):
                    path = os.path.join(folder, name)
                    try:
                        stat = os.stat(path)
                    except OSError:
                        continue
                    files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        if total <= max_bytes:
            return 0
        freed = 0
        for _, size, path in sorted(files):
            if total - freed <= max_bytes * 9 // 10:
                break
            try:
                os.unlink(path)
                freed += size
            except OSError:
                pass
        logger.info("SharedStorageConnector: pruned %d bytes of K/V files from %s (max_storage_bytes=%d)", freed,
                    self.root, max_bytes)
        return freed

    def count_present(self, keys: list[str]) -> int:
        count = 0
        for key in keys:
            if not self._stored(key):
                break
            count += 1
        return count

    def missing(self, keys: list[str]) -> list[bool]:
        return [not self._stored(key) for key in keys]

    # -- worker side -------------------------------------------------------------------
    def worker_info(self) -> dict[str, Any]:
        # (a file holds the block and ~100 bytes of header)
        return {"block_bytes": self.caches.bytes_per_block + 128}

    def load_blocks(self, transfers: list[BlockTransfer]) -> set[int]:
        import torch
        from safetensors.torch import load_file

        ok, blocks, failed = [], [], set()
        for transfer in transfers:
            path = self.path(self.context.rank_tag, transfer.key)
            try:
                kv = load_file(path)["kv"]
                if tuple(kv.shape) != self.caches.block_shape or kv.dtype != self.caches.dtype:
                    raise ValueError(f"it holds {kv.dtype} {tuple(kv.shape)} but this engine's blocks are "
                                     f"{self.caches.dtype} {self.caches.block_shape}")
            except Exception as exc:  # (removed, truncated, another layout: recomputed instead)
                logger.warning("SharedStorageConnector: cannot load KV block %s: %s", path, exc)
                failed.add(transfer.block_id)
                continue
            ok.append(transfer.block_id)
            blocks.append(kv)
            try:
                os.utime(path)  # (recently used: pruned last)
            except OSError:
                pass
        if ok:
            self.caches.write(ok, torch.stack(blocks))
        return failed

    def save_blocks(self, transfers: list[BlockTransfer], data: torch.Tensor) -> None:
        from safetensors.torch import save_file

        data = data.cpu()
        for transfer, kv in zip(transfers, data):
            path = self.path(self.context.rank_tag, transfer.key)
            if os.path.exists(path):  # (another engine saved it meanwhile)
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            os.close(fd)
            try:
                save_file({"kv": kv.contiguous()}, tmp, metadata={"format": "halserve-kv-block-v1"})
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
