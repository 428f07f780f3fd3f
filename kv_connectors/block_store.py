"""The bookkeeping both bundled connectors share: a store of whole blocks keyed by block hash.

Scheduler side: a new request's lookup walks its block hashes after the local prefix-cache hit
and counts the leading ones the store holds; those blocks are loaded before the step's forward.
A producer saves each block once it is full of computed tokens (write-through), unless the store
holds its key already. Worker side: loads and saves run in bulk, before and after the forward.

Subclasses say how keys are found and kept (``count_present``, ``missing``, ``slots_for_*``) and
how block data move (``load_blocks``, ``save_blocks``).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from halserve.kv_cache.hashing import extend_block_hashes
from halserve.kv_connectors.base import BlockTransfer, KVConnector, KVConnectorMetadata

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from halserve.request import Request
    from halserve.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


def block_keys(request: Request, block_size: int, num_tokens: int, first: int = 0) -> list[str]:
    """Keys (hex block hashes) of the request's full blocks ``first`` .. within its first ``num_tokens`` tokens."""
    end = num_tokens // block_size
    if end <= first:
        return []
    hashes = extend_block_hashes(request.block_hashes, request.all_token_ids, block_size, num_tokens,
                                 request.block_hash_extra_keys)
    return [h.hex() for h in hashes[first:end]]


class BlockStoreConnector(KVConnector):
    # -- what a store implements -------------------------------------------------------
    def count_present(self, keys: list[str]) -> int:
        """(scheduler) How many of ``keys``, from the first, the store holds."""
        raise NotImplementedError

    def missing(self, keys: list[str]) -> list[bool]:
        """(scheduler) For each key, whether the store lacks it (what a save should write)."""
        raise NotImplementedError

    def slots_for_loads(self, keys: list[str]) -> list[int | None]:
        """(scheduler, optional) The store's slot of each key to load; default: None (the store has none)."""
        return [None] * len(keys)

    def slots_for_saves(self, keys: list[str]) -> dict[str, int | None]:
        """(scheduler, optional) The keys to save, each with its slot (evicting others as the store
        needs); a key left out is not saved. Default: every key, slot None (the store has none)."""
        return dict.fromkeys(keys)

    def load_blocks(self, transfers: list[BlockTransfer]) -> set[int]:
        """(worker) Write the blocks into the KV cache; returns the block ids that failed."""
        raise NotImplementedError

    def save_blocks(self, transfers: list[BlockTransfer], data: torch.Tensor) -> None:
        """(worker) Keep ``data[j]`` (``KVCacheAccess.read`` layout) under ``transfers[j]``."""
        raise NotImplementedError

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pending_loads: list[BlockTransfer] = []  # found at admission, sent with this step
        self._num_handled: dict[str, int] = {}  # req_id -> its leading blocks loaded, hit or saved
        self._block_ids: dict[str, list[int]] = {}  # req_id -> its block table (from the scheduler outputs)
        self._meta: KVConnectorMetadata | None = None  # (worker) this step's
        self._failed: set[int] = set()  # (worker) this step's blocks that failed to load
        self._loading: dict[int, str] = {}  # (scheduler) block id -> key, of the last step's loads
        self._bad_keys: set[str] = set()  # (scheduler) keys whose copies failed to load: never looked up again

    # -- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if not self.transfer_config.is_consumer:
            return 0
        block_size = self.context.block_size
        # (never the last token: it is fed to the model for its logits)
        keys = block_keys(request, block_size, request.num_tokens - 1, num_computed_tokens // block_size)
        if self._bad_keys:
            keys = keys[:next((i for i, key in enumerate(keys) if key in self._bad_keys), len(keys))]
        return self.count_present(keys) * block_size if keys else 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        block_size = self.context.block_size
        first, end = num_local_tokens // block_size, (num_local_tokens + num_external_tokens) // block_size
        self._num_handled[request.request_id] = end
        if end > first:
            keys = block_keys(request, block_size, end * block_size, first)
            self._pending_loads += [BlockTransfer(block_ids[i], key, slot)
                                    for i, key, slot in zip(range(first, end), keys, self.slots_for_loads(keys))]

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             requests: dict[str, Request]) -> KVConnectorMetadata:
        meta, self._pending_loads = KVConnectorMetadata(loads=self._pending_loads), []
        self._loading = {t.block_id: t.key for t in meta.loads}
        if not self.transfer_config.is_producer:
            return meta
        for new in scheduler_output.scheduled_new_reqs:
            self._block_ids[new.req_id] = list(new.block_ids)
        for cached in scheduler_output.scheduled_cached_reqs:
            self._block_ids[cached.req_id].extend(cached.new_block_ids)
        block_size = self.context.block_size
        candidates: dict[str, int] = {}  # key -> block id (one save per key)
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            # (its tokens whose K/V exists once the step has run; drafts may be rejected)
            start = self._num_handled.get(req_id, 0)
            keys = block_keys(request, block_size, request.num_computed_tokens + num_tokens - drafts, start)
            if not keys:  # (most decode steps: no block filled up)
                continue
            self._num_handled[req_id] = start + len(keys)
            table = self._block_ids[req_id]
            for i, key in enumerate(keys, start):
                candidates.setdefault(key, table[i])
        keys = [key for key, lacks in zip(candidates, self.missing(list(candidates))) if lacks]
        meta.saves = [BlockTransfer(candidates[key], key, slot) for key, slot in self.slots_for_saves(keys).items()]
        return meta

    def on_failed_blocks(self, block_ids: set[int]) -> None:
        self._bad_keys.update(self._loading[i] for i in block_ids if i in self._loading)

    def request_finished(self, request: Request) -> None:
        self._num_handled.pop(request.request_id, None)
        self._block_ids.pop(request.request_id, None)

    # -- worker side -------------------------------------------------------------------
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        self._meta = metadata
        failed = self.load_blocks(metadata.loads) if metadata.loads else set()
        if self.context.world_size > 1 and metadata.loads:
            failed = self._agree(metadata.loads, failed)
        self._failed = failed

    def _agree(self, loads: list[BlockTransfer], failed: set[int]) -> set[int]:
        """Every rank reports the same failures: a block that failed on one rank is garbage on all
        (each holds its share of the heads)."""
        import torch

        from halserve.distributed import tensor_model_parallel_all_reduce

        flags = torch.tensor([float(t.block_id in failed) for t in loads], device=self.caches.device)
        flags = tensor_model_parallel_all_reduce(flags)
        return {t.block_id for t, flag in zip(loads, flags.tolist()) if flag}

    def wait_for_save(self) -> None:
        meta, self._meta = self._meta, None
        if meta is None or not meta.saves:
            return
        data = self.caches.read([t.block_id for t in meta.saves])
        try:
            self.save_blocks(meta.saves, data)
        except Exception as exc:  # (a full disk: the blocks stay computed here, unsaved)
            logger.warning("%s could not save %d KV blocks: %s", self.name, len(meta.saves), exc)

    def get_failed_block_ids(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed
