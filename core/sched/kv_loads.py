"""The scheduler side of a KV connector (``kv_transfer_config``): K/V found outside the local
prefix cache is loaded into a new request's blocks instead of computed.

Admission (``schedule`` step 2)::

    local hit   [0, num_local)                    blocks from the prefix cache
    external    [num_local, num_local + num_ext)  loaded by the workers before the forward
    computed    [num_local + num_ext, ...)        the request's prefill chunk

When the workers report blocks they could not load, those blocks are uncached and every running
request holding one is recomputed without the connector (``failed_load_victims``).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from halserve.kv_cache.manager import KVCacheManager
    from halserve.kv_connectors.base import KVConnector
    from halserve.request import Request
    from halserve.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


class ConnectorLoads:
    def __init__(self, connector: KVConnector, kv_cache_manager: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv_cache_manager
        self.num_hit_tokens = 0  # cumulative: tokens loaded instead of computed

    def external_hit(self, request: Request, num_local: int) -> int:
        """Tokens after the local prefix-cache hit that the connector can load: whole blocks, and
        only where a local hit would be allowed (never the last token; not for prompt logprobs)."""
        if request.kv_load_failed:
            return 0
        num_external = self.connector.get_num_new_matched_tokens(request, num_local)
        return max(0, min(num_external, self.kv.max_cache_hit_tokens(request) - num_local))

    def on_admitted(self, request: Request, num_local: int, num_external: int) -> None:
        """``request`` got its blocks; its ``num_external`` tokens after ``num_local`` are to be loaded."""
        self.connector.update_state_after_alloc(request, self.kv.get_block_ids(request.request_id), num_local,
                                                num_external)
        self.num_hit_tokens += num_external

    def fill_metadata(self, output: SchedulerOutput, requests: dict) -> None:
        output.kv_connector_metadata = self.connector.build_connector_meta(output, requests)

    def failed_load_victims(self, block_ids: set[int], running: list[Request]) -> list[Request]:
        """Forget ``block_ids`` as prefix-cache entries; the running requests holding one (in
        running order), to be recomputed."""
        kv = self.kv
        for block_id in block_ids:
            kv.block_pool.uncache(kv.block_pool.blocks[block_id])
        return [r for r in running if not block_ids.isdisjoint(kv.get_block_ids(r.request_id))]

    def failed_loads_recovered(self, block_ids: set[int], victims: list[Request]) -> None:
        self.connector.on_failed_blocks(block_ids)
        logger.warning("KV connector: %d blocks failed to load; recomputing %d requests: %s", len(block_ids),
                       len(victims), ", ".join(r.request_id for r in victims))
