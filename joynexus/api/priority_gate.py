"""Admission to a shared service in tenant priority order (the lower layer's priority classes).

The Training Model Service runs one call at a time; without a gate, lower-layer calls of every
tenant reach it in arrival order, so a low-priority tenant's backlog of forward_backward calls
delays a high-priority tenant's next step by the whole backlog. `PriorityGate` lets at most
`capacity` calls through at once and hands each freed place to the waiting call of the highest
priority, first come first served within a priority. The priority is the tenant's
`scheduling.priority` (spec, -100..100), the same number that orders its training jobs' leases
(`joynexus.scheduling.training_scheduler`), so a tenant has one priority class across both paths.

Waiters are worker threads of the tenant's own (`joynexus.api.rate_limits`), so a waiting call
holds none of the threads other tenants' calls need.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")


class PriorityGate:
    """At most `capacity` callers inside at once; the rest wait, highest priority first."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._cond = threading.Condition()
        self._inside = 0
        self._waiting: list[tuple[int, int]] = []  # (-priority, arrival): the heap's head goes next
        self._arrivals = itertools.count()

    def call(self, priority: int, function: Callable[..., R], *args: Any) -> R:
        """Run `function(*args)` once this caller's turn comes."""
        self._enter(priority)
        try:
            return function(*args)
        finally:
            self._leave()

    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def _enter(self, priority: int) -> None:
        with self._cond:
            if self._inside < self.capacity and not self._waiting:
                self._inside += 1
                return
            ticket = (-priority, next(self._arrivals))
            heapq.heappush(self._waiting, ticket)
            try:
                while not (self._inside < self.capacity and self._waiting[0] == ticket):
                    self._cond.wait()
            except BaseException:
                self._waiting.remove(ticket)
                heapq.heapify(self._waiting)
                self._cond.notify_all()
                raise
            heapq.heappop(self._waiting)
            self._inside += 1
            self._cond.notify_all()  # the next waiter may fit too (capacity > 1)

    def _leave(self) -> None:
        with self._cond:
            self._inside -= 1
            self._cond.notify_all()


__all__ = ["PriorityGate"]
