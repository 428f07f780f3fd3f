"""The worker's side of a KV connector (``kv_transfer_config``): built once the KV cache exists,
run around each step's forward by the model runner::

    connector.start_load_kv(meta)            blocks found outside, into the cache
    forward (each attention layer: wait_for_layer_load(i) ... save_kv_layer(i))
    connector.wait_for_save()                blocks completed this step, out
    output.invalid_block_ids = connector.get_failed_block_ids()
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from halserve.kv_connectors.base import KVConnector, KVConnectorMetadata
    from halserve.worker.model_runner import ModelRunner


def attach_connector(runner: ModelRunner) -> KVConnector | None:
    """The worker-side connector the config asks for, with the runner's caches registered; None: none."""
    config = runner.config
    if config.kv_transfer_config is None:
        return None
    if not runner.supports_kv_connector:
        raise ValueError(f"the {type(runner).__name__} of platform {runner.platform.name!r} does not run KV "
                         "connectors; drop kv_transfer_config (--kv-transfer-config) or use another platform")
    from halserve.distributed import get_tp_rank
    from halserve.kv_connectors import connector_context, make_connector
    from halserve.kv_connectors.base import KVCacheAccess, Role

    layers = runner.model.attention_layers
    for index, layer in enumerate(layers):
        layer.layer_index = index
    views = [runner.attn_backend_cls.kv_cache_block_views(layer.kv_cache, runner.block_size, layer.num_kv_heads,
                                                           runner.info.head_size) for layer in layers]
    connector = make_connector(config, Role.WORKER, connector_context(config, runner.info, get_tp_rank()))
    connector.register_kv_caches(KVCacheAccess(views))
    return connector


def start_step(connector: KVConnector | None, metadata: KVConnectorMetadata | None) -> KVConnector | None:
    """Begin the step's loads; returns the connector the layers call this step (None: no transfers)."""
    if connector is None or metadata is None or not (metadata.loads or metadata.saves):
        return None
    connector.start_load_kv(metadata)
    return connector


def finish_step(connector: KVConnector | None) -> set[int]:
    """Finish the step's saves; the blocks whose loads failed."""
    if connector is None:
        return set()
    connector.wait_for_save()
    return connector.get_failed_block_ids()
