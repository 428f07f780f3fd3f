"""The engine core's record of the LoRA adapters its workers hold.

Workers load an adapter only when the core asks (``add_lora``, which validates it before any
request that uses it is queued) and drop it only when the core says (``remove_lora``), so a
step never reads an adapter from disk: files that change or vanish later cannot fail a step.
The core keeps at most ``max_cpu_loras`` adapters loaded, evicting the least recently used
that no unfinished request uses (a later request for it loads it again, at admission); an
adapter removed while requests still use it is dropped by the workers once they finish.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from halserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRARegistry:
    def __init__(self, max_cpu_loras: int, rpc: Callable[..., object], in_use: Callable[[], set[int]]) -> None:
        self.max_cpu_loras = max_cpu_loras
        self._rpc = rpc  # the executor's collective_rpc: every worker runs the method
        self._in_use = in_use  # lora_int_ids of the unfinished requests
        self.loras: OrderedDict[int, LoRARequest] = OrderedDict()  # loaded on the workers, LRU first
        self._retiring: set[int] = set()  # removed, but loaded until their last request ends
        self._pins: dict[int, int] = {}  # lora_int_id -> callers keeping it loaded (``pin``)

    def add(self, lora: LoRARequest) -> bool:
        """Have every worker load and validate ``lora`` unless it holds it; ValueError, with the
        engine unharmed, when it cannot be served. True if it was loaded now."""
        known = self.loras.get(lora.lora_int_id)
        if known is not None:  # (a removed one still in use too: it stays until that use ends)
            if (known.lora_name, known.lora_path) != (lora.lora_name, lora.lora_path):
                raise ValueError(f"lora_int_id {lora.lora_int_id} is already used by adapter {known.lora_name!r} "
                                 f"({known.lora_path}); give adapter {lora.lora_name!r} its own lora_int_id")
            self.loras.move_to_end(lora.lora_int_id)
            return False
        self._rpc("add_lora", lora)
        self.loras[lora.lora_int_id] = lora
        self._evict(keep=lora.lora_int_id)  # (its request is not queued yet: not "in use")
        return True

    def pin(self, lora_id: int) -> None:
        """Keep an adapter loaded while a caller needs it between requests (a beam search's
        steps); it counts as in use until ``unpin``."""
        self._pins[lora_id] = self._pins.get(lora_id, 0) + 1

    def unpin(self, lora_id: int) -> None:
        if self._pins.get(lora_id, 0) <= 1:
            self._pins.pop(lora_id, None)
        else:
            self._pins[lora_id] -= 1
        self.release()

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter: new requests cannot use it; the workers drop it now, or once the
        requests still using it end (``release``)."""
        if lora_id not in self.loras or lora_id in self._retiring:
            return False
        if lora_id in self._used():
            self._retiring.add(lora_id)
        else:
            self._drop(lora_id)
        return True

    def release(self) -> None:
        """After a step: drop the removed adapters whose last request ended, and the least
        recently used idle ones while more than ``max_cpu_loras`` are loaded."""
        if self._retiring:
            in_use = self._used()
            for lora_id in [i for i in self._retiring if i not in in_use]:
                self._retiring.discard(lora_id)
                self._drop(lora_id)
        self._evict()

    def ids(self) -> set[int]:
        """The adapters requests may use."""
        return set(self.loras) - self._retiring

    def _used(self) -> set[int]:
        return self._in_use() | set(self._pins)

    def _evict(self, keep: int | None = None) -> None:
        if len(self.loras) <= self.max_cpu_loras:
            return
        in_use = self._used()
        for lora_id in [i for i in self.loras if i not in in_use and i != keep]:
            if len(self.loras) <= self.max_cpu_loras:
                break
            logger.debug("LoRA %d unloaded (max_cpu_loras=%d)", lora_id, self.max_cpu_loras)
            self._retiring.discard(lora_id)
            self._drop(lora_id)

    def _drop(self, lora_id: int) -> None:
        del self.loras[lora_id]
        self._rpc("remove_lora", lora_id)
