"""Admission to a shared service in tenant priority order (the lower layer's priority classes).

The Training Model Service runs one call at a time; without a gate, lower-layer calls of every
tenant reach it in arrival order, so a low-priority tenant's backlog of forward_backward calls
delays a high-priority tenant's next step by the whole backlog. `PriorityGate` lets at most
`capacity` calls through at once and hands each freed place to the waiting call of the highest
priority; within a priority, tenants take turns (issue 41.1): a call's rank is one past its
tenant's previous call's or the last admitted one's, whichever is later (start-time fair queueing
with a unit cost per call, as the Inference Queue serves tenants in turn), so a tenant with many
calls waiting, or one whose sampling call re-enters for each of its slices, goes next at most once
before each other tenant's waiting call; first come first served within a rank. The priority is the tenant's
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
        self._waiting: list[tuple[int, int, int]] = []  # (-priority, rank, arrival): the head goes next
        self._arrivals = itertools.count()
        self._round = 0  # the rank of the last call let in
        self._tenant_rank: dict[str, int] = {}  # each tenant's latest call's rank (while it is ahead)

    def call(self, priority: int, function: Callable[..., R], *args: Any, tenant: str | None = None) -> R:
        """Run `function(*args)` once this caller's turn comes (`tenant`: whose call, for the turns)."""
        self._enter(priority, tenant)
        try:
            return function(*args)
        finally:
            self._leave()

    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def _rank(self, tenant: str | None) -> int:
        rank = max(self._round, self._tenant_rank.get(tenant, 0) if tenant is not None else 0) + 1
        if tenant is not None:
            self._tenant_rank[tenant] = rank
        return rank

    def _admitted(self, rank: int) -> None:
        self._round = max(self._round, rank)
        if len(self._tenant_rank) > 1024:  # ranks at or below the round order nothing any more
            self._tenant_rank = {t: r for t, r in self._tenant_rank.items() if r > self._round}

    def _enter(self, priority: int, tenant: str | None = None) -> None:
        with self._cond:
            rank = self._rank(tenant)
            if self._inside < self.capacity and not self._waiting:
                self._inside += 1
                self._admitted(rank)
                return
            ticket = (-priority, rank, next(self._arrivals))
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
            self._admitted(rank)
            self._cond.notify_all()  # the next waiter may fit too (capacity > 1)

    def _leave(self) -> None:
        with self._cond:
            self._inside -= 1
            self._cond.notify_all()


__all__ = ["PriorityGate"]
