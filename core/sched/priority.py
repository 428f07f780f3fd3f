"""The ``priority`` scheduling policy's waiting queue (``SchedulerConfig.scheduling_policy``).

Under ``fcfs`` the scheduler's waiting queue is a deque: new requests at the back, preempted ones
at the front. Under ``priority`` it is a ``PriorityWaitingQueue``: kept sorted by each request's
key, ``(Request.priority, arrival rank)``, lower first, so the best request is at index 0 and a
preempted request goes back to where its key puts it (ahead of everything that arrived after it
at its level: FCFS within a level). It offers the deque operations the scheduler uses, so the
step loop reads the same under both policies.

A sorted list rather than a heap: admission walks the queue by index (a gate may pass a request
over and look at the next one), which a heap cannot do without popping; inserting is a binary
search and one ``memmove`` (microseconds for thousands of waiting requests).
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from halserve.request import Request

__all__ = ["PriorityWaitingQueue"]


class PriorityWaitingQueue:
    """Waiting requests in key order (``key(request)``: ``(priority, arrival rank)``, unique per
    request). ``append`` and ``appendleft`` both insert by key (the deque names the scheduler calls
    for a new and for a preempted request)."""

    __slots__ = ("_key", "_requests")

    def __init__(self, key: Callable[[Request], tuple[int, int]]) -> None:
        self._key = key
        self._requests: list[Request] = []

    def append(self, request: Request) -> None:
        bisect.insort(self._requests, request, key=self._key)

    appendleft = append

    def _index(self, request: Request) -> int:
        i = bisect.bisect_left(self._requests, self._key(request), key=self._key)
        if i == len(self._requests) or self._requests[i] is not request:
            raise ValueError(f"request {request.request_id!r} is not waiting")
        return i

    def remove(self, request: Request) -> None:
        del self._requests[self._index(request)]

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]

    def __delitem__(self, index: int) -> None:
        del self._requests[index]

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __repr__(self) -> str:
        return f"PriorityWaitingQueue({[r.request_id for r in self._requests]!r})"
