"""KV connectors: K/V blocks that live outside this engine's KV cache (vLLM V1's two roles).

A connector is built twice: once in the engine core beside the scheduler (``Role.SCHEDULER``)
and once in every worker (``Role.WORKER``). They talk only through the per-step metadata the
scheduler side builds, which rides on the ``SchedulerOutput``::

    scheduler side                                   worker side (every rank)
    get_num_new_matched_tokens(req, n_local)  ->  tokens found outside (after the local hit)
    update_state_after_alloc(req, blocks, n)  ->  remember which blocks to fill
    build_connector_meta(scheduler_output)    ->  KVConnectorMetadata  --> start_load_kv(meta)
                                                                             wait_for_layer_load(i)
                                                                             (layer i attends)
                                                                             save_kv_layer(i)
                                                                           wait_for_save()
    on_failed_blocks(ids)  <--  ModelRunnerOutput.invalid_block_ids  <--  get_failed_block_ids()
    request_finished(req)

Keys are the stable chained block hashes of ``halserve.kv_cache.hashing``: equal keys mean
equal token prefixes, in any process on any machine. Block data travel in one layout whatever
the attention backend: ``[num_layers, 2 (K, V), block_size, num_kv_heads, head_size]`` of this
rank's layers and heads (``KVCacheAccess``).
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from halserve.config_json import json_object

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from halserve.config import EngineConfig
    from halserve.request import Request
    from halserve.scheduler_output import SchedulerOutput

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_EXAMPLE = '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", ' \
           '"kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'


class KVTransferConfig(BaseModel):
    """vLLM's ``--kv-transfer-config``: which connector, which role, and the connector's own settings.

    ``kv_role``: ``kv_producer`` saves the K/V it computes and never loads; ``kv_consumer`` loads
    and never saves; ``kv_both`` does both."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_connector: str = Field(min_length=1)
    """A connector's name (``halserve plugins`` lists them), or a class in ``kv_connector_module_path``."""
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = "kv_both"
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    """The connector's own settings (each connector documents its keys and refuses unknown ones)."""
    kv_connector_module_path: str | None = None
    """A module holding a ``KVConnector`` subclass named ``kv_connector`` (instead of a plugin)."""
    engine_id: str | None = None
    """A name for this engine in logs and keys; free-form."""
    kv_ip: str = "127.0.0.1"
    """Where a connector that serves K/V (P2pConnector's producer) listens."""
    kv_port: int = Field(default=14579, ge=1, le=65535)
    """Its port (vLLM's default)."""

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: object) -> KVTransferConfig:
        """From a dict, a JSON string (``--kv-transfer-config``) or an instance."""
        if isinstance(value, cls):
            return value
        return cls(**json_object(value, "kv_transfer_config", _EXAMPLE))


class Role(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(slots=True)
class BlockTransfer:
    """One block to move: this engine's ``block_id`` <-> the outside copy under ``key`` (a block
    hash in hex); ``slot`` is the connector's own place for it (a host pool row), None when it has none."""

    block_id: int
    key: str
    slot: int | None = None


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the workers for one step: blocks to load before the forward
    and blocks to save after it (each block's K/V is complete once the step has run)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class ConnectorContext:
    """What a connector may read about the engine it serves, on either side."""

    config: EngineConfig
    model_id: str  # what identifies the model's K/V (its path or hub id, dtype, KV dtype, shapes)
    block_size: int
    world_size: int
    rank: int = 0  # the worker's rank (0 on the scheduler side)
    rank_tag: str = ""  # the worker's tensor/pipeline position, e.g. "tp2pp1-r0" (worker side)
    rank_tags: tuple[str, ...] = ()  # every rank's tag (both sides)


class KVCacheAccess:
    """A worker's KV cache seen block by block, in the connector layout.

    ``views[i]`` is layer i's (keys, values), each ``[num_blocks, block_size, num_kv_heads, head_size]``
    (views of the backend's own tensor: ``AttentionBackend.kv_cache_block_views``)."""

    def __init__(self, views: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not views:
            raise ValueError("a KV connector needs at least one attention layer's cache")
        self.views = views
        first = views[0][0]
        self.block_shape = (len(views), 2, *first.shape[1:])  # one block of every layer
        self.dtype = first.dtype
        self.device = first.device

    def read(self, block_ids: list[int]) -> torch.Tensor:
        """``[len(block_ids), num_layers, 2, block_size, H, D]``, a copy (on the cache's device)."""
        import torch

        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        layers = [torch.stack([keys.index_select(0, index), values.index_select(0, index)])
                  for keys, values in self.views]
        return torch.stack(layers).permute(2, 0, 1, 3, 4, 5)

    def write(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Store ``data`` (as ``read`` returns it, on any device) into the blocks ``block_ids``."""
        import torch

        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(self.device, self.dtype).permute(1, 2, 0, 3, 4, 5)  # [L, 2, n, B, H, D]
        for (keys, values), layer in zip(self.views, data):
            keys.index_copy_(0, index, layer[0])
            values.index_copy_(0, index, layer[1])

    @property
    def bytes_per_block(self) -> int:
        import math

        import torch

        return math.prod(self.block_shape) * torch.tensor([], dtype=self.dtype).element_size()


class KVConnector:
    """Base class of KV connectors; plugins return subclasses from ``halserve_kv_connectors``.

    A subclass implements both roles (one instance per role and process). The scheduler-side
    methods run in the engine core between steps; the worker-side ones inside a step. Errors
    that come from outside (a missing file, a full disk) must not raise on the worker: a block
    that could not be loaded is reported by ``get_failed_block_ids`` and its requests are
    recomputed; a save that failed is logged and forgotten."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    extra_config_keys: ClassVar[tuple[str, ...]] = ()
    """The keys ``kv_connector_extra_config`` may hold; others are refused, naming these."""

    def __init__(self, transfer_config: KVTransferConfig, role: Role, context: ConnectorContext) -> None:
        self.transfer_config = transfer_config
        self.role = role
        self.context = context
        self.extra = dict(transfer_config.kv_connector_extra_config)

    @classmethod
    def check_config(cls, transfer_config: KVTransferConfig, config: EngineConfig) -> None:
        """Raise ValueError when this connector cannot run with these settings (called before the
        model loads, so a mistake costs nothing). The default checks the extra config's keys."""
        unknown = sorted(set(transfer_config.kv_connector_extra_config) - set(cls.extra_config_keys))
        if unknown:
            known = ", ".join(cls.extra_config_keys) or "none"
            raise ValueError(f"kv_connector_extra_config of {cls.name}: unknown key(s) {', '.join(unknown)}; "
                             f"it takes: {known}")

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"description": cls.description, "extra_config_keys": list(cls.extra_config_keys)}

    # -- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the ``num_computed_tokens`` of the local prefix-cache hit whose K/V the
        connector can load this step (a whole number of blocks; 0: none)."""
        return 0

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        """The request got its blocks (``block_ids``: its whole table); the ``num_external_tokens``
        after its ``num_local_tokens`` are to be loaded into them."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             requests: dict[str, Request]) -> KVConnectorMetadata:
        """This step's loads and saves (``requests``: the scheduler's, by id)."""
        return KVConnectorMetadata()

    def request_finished(self, request: Request) -> None:
        """The request finished or was preempted: forget what the connector held for it."""

    def on_failed_blocks(self, block_ids: set[int]) -> None:
        """The workers could not load these blocks; their requests are recomputed."""

    def on_workers_ready(self, infos: list[dict[str, Any]]) -> None:
        """Every rank's ``worker_info``, once the KV caches exist (before the first step)."""

    # -- worker side -------------------------------------------------------------------
    def register_kv_caches(self, caches: KVCacheAccess) -> None:
        self.caches = caches

    def worker_info(self) -> dict[str, Any]:
        """What the scheduler side needs to know of this rank (``on_workers_ready``)."""
        return {}

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin loading this step's blocks (before the forward)."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Block until layer ``layer_index``'s loads are in the cache (before it attends)."""

    def save_kv_layer(self, layer_index: int) -> None:
        """Layer ``layer_index`` has written this step's K/V (saves may start for it)."""

    def wait_for_save(self) -> None:
        """Block until this step's saves no longer read the cache (after the forward)."""

    def get_failed_block_ids(self) -> set[int]:
        """Blocks of this step that could not be loaded (and are garbage); cleared by the call."""
        return set()

    def shutdown(self) -> None:
        """Release what the connector holds (files stay)."""
