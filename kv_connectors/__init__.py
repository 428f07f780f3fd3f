"""KV connectors (``--kv-transfer-config``): K/V blocks loaded from and saved to outside the
engine's KV cache. ``base.py`` holds the interface; bundled: ``SharedStorageConnector`` (files
in a shared directory), ``OffloadingConnector`` (a host-memory tier behind the prefix cache) and
``P2pConnector`` (decode engines pull prompt K/V from a prefill engine over TCP)."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.kv_connectors.base import ConnectorContext, KVConnector, KVTransferConfig, Role
    from halserve.models.loader import ModelInfo


def resolve_connector_cls(transfer_config: KVTransferConfig) -> type[KVConnector]:
    """The connector class ``kv_connector`` names: from ``kv_connector_module_path`` when given,
    else a registered plugin. ValueError naming the known ones otherwise."""
    from halserve.kv_connectors.base import KVConnector

    name = transfer_config.kv_connector
    if transfer_config.kv_connector_module_path:
        path = transfer_config.kv_connector_module_path
        try:
            cls = getattr(importlib.import_module(path), name)
        except ImportError as exc:
            raise ValueError(f"kv_connector_module_path {path!r} cannot be imported: {exc}") from None
        except AttributeError:
            raise ValueError(f"kv_connector_module_path {path!r} has no class {name!r}") from None
        if not (isinstance(cls, type) and issubclass(cls, KVConnector)):
            raise ValueError(f"{path}.{name} is not a halserve.kv_connectors.base.KVConnector subclass")
        return cls
    from halserve.plugins import get_plugin_manager

    registry = get_plugin_manager().kv_connectors
    reg = registry.get(name)
    if reg is None:
        raise ValueError(f"unknown kv_connector {name!r}; registered KV connectors: "
                         f"{', '.join(registry.names()) or 'none'} (or give kv_connector_module_path)")
    return reg.obj


def check_kv_transfer(config: EngineConfig) -> None:
    """Refuse, before anything loads, what a connector cannot run with (ValueError)."""
    transfer = config.kv_transfer_config
    if transfer is None:
        return
    if config.pipeline_parallel_size > 1:
        raise ValueError("kv_transfer_config does not work with pipeline parallelism yet; use "
                         "pipeline_parallel_size=1 (tensor parallelism is supported)")
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        raise ValueError("kv_transfer_config cannot be combined with a draft model (its KV cache is not "
                         "transferred); use speculative method 'ngram' or drop the connector")
    resolve_connector_cls(transfer).check_config(transfer, config)


def connector_context(config: EngineConfig, info: ModelInfo, rank: int = 0) -> ConnectorContext:
    from halserve.kv_connectors.base import ConnectorContext

    world = config.world_size
    model_id = "|".join(str(part) for part in (
        config.model, config.revision, info.architecture, info.dtype, config.kv_cache_dtype, config.quantization,
        info.num_layers, info.num_kv_heads, info.head_size, config.block_size))
    tags = tuple(f"tp{world}-r{r}" for r in range(world))
    return ConnectorContext(config=config, model_id=model_id, block_size=config.block_size, world_size=world,
                            rank=rank, rank_tag=tags[rank], rank_tags=tags)


def make_connector(config: EngineConfig, role: Role, context: ConnectorContext) -> KVConnector:
    transfer = config.kv_transfer_config
    return resolve_connector_cls(transfer)(transfer, role, context)


__all__ = ["check_kv_transfer", "connector_context", "make_connector", "resolve_connector_cls"]
