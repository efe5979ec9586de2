"""Which inference replicas hold which tenants (issue 45.3): the assignment table of a replica set
with tenant affinity, modelled on Ray Serve's multiplexed-model routing (`serve.multiplexed`, a
request's `multiplexed_model_id`): each replica holds at most `max_tenants_per_replica` tenants'
serving states, the least recently used one leaving when another must come in; a tenant's requests
go to the replicas that hold it; a tenant with many requests in flight gets one more replica.

Pure bookkeeping, no calls: the replica set (`replicas.InferenceReplicaSet`) asks it where a tenant
goes, then loads or removes the serving states it names, and hands the table (`table()`) to the
callers' routers (`router.TenantRouter`), which send requests straight to the holders.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Placement:
    """What placing a tenant changed: the replicas that hold it now, and the serving states the set
    must load (`loads`: replica names for the tenant) and drop (`evictions`: (replica, tenant))."""

    holders: list[str]
    loads: list[str] = field(default_factory=list)
    evictions: list[tuple[str, str]] = field(default_factory=list)


class TenantAffinity:
    """Tenants per replica, each replica's tenants in least-recently-used order; `epoch` grows with
    every change, so a router knows when its copy of the table is stale."""

    def __init__(self, max_tenants_per_replica: int) -> None:
        if isinstance(max_tenants_per_replica, bool) or not isinstance(max_tenants_per_replica, int):
            raise ValueError(f"max_tenants_per_replica: expected an integer >= 1, got {max_tenants_per_replica!r}")
        if max_tenants_per_replica < 1:
            raise ValueError(f"max_tenants_per_replica: expected an integer >= 1, got {max_tenants_per_replica}")
        self.capacity = max_tenants_per_replica
        self._held: dict[str, OrderedDict[str, float]] = {}  # replica -> tenant -> last used, LRU first
        self._epochs = itertools.count(1)
        self.epoch = next(self._epochs)

    # -- replicas -----------------------------------------------------------------------------
    def add_replica(self, name: str) -> None:
        self._held.setdefault(name, OrderedDict())
        self._changed()

    def remove_replica(self, name: str) -> list[str]:
        """Forget a replica (stopped, or not serving): the tenants it held, which are placed again on
        their next request."""
        tenants = list(self._held.pop(name, {}))
        self._changed()
        return tenants

    def replicas(self) -> list[str]:
        return list(self._held)

    # -- tenants ------------------------------------------------------------------------------
    def holders(self, tenant_id: str) -> list[str]:
        return [name for name, tenants in self._held.items() if tenant_id in tenants]

    def tenants_of(self, replica: str) -> list[str]:
        return list(self._held.get(replica, ()))

    def touch(self, tenant_id: str) -> None:
        """The tenant was used: the last its holders would evict."""
        now = time.monotonic()
        for tenants in self._held.values():
            if tenant_id in tenants:
                tenants[tenant_id] = now
                tenants.move_to_end(tenant_id)

    def place(self, tenant_id: str, want: int = 1, *, usable: set[str] | None = None) -> Placement:
        """Make at least `want` replicas (of `usable`, default all; fewer if there are fewer) hold the
        tenant. A new holder is the usable replica with the fewest tenants; one that is full gives up
        its least recently used tenant (never `tenant_id`)."""
        if want < 1:
            raise ValueError(f"want: expected an integer >= 1, got {want!r}")
        usable = set(self._held) if usable is None else usable & set(self._held)
        holders = [name for name in self.holders(tenant_id) if name in usable]
        placement = Placement(holders)
        while len(holders) < want:
            free = [name for name in self._held if name in usable and name not in holders]
            if not free:
                break
            # Fewest tenants first (no eviction when one has room), then the one whose least recent
            # tenant was used longest ago.
            target = min(free, key=lambda n: (len(self._held[n]) >= self.capacity, len(self._held[n]), self._oldest(n)))
            tenants = self._held[target]
            while len(tenants) >= self.capacity:
                victim, _ = tenants.popitem(last=False)
                placement.evictions.append((target, victim))
            tenants[tenant_id] = time.monotonic()
            holders.append(target)
            placement.loads.append(target)
        if placement.loads:
            self._changed()
        self.touch(tenant_id)
        return placement

    def shrink(self, tenant_id: str, keep: int) -> list[str]:
        """Drop the tenant from its holders beyond `keep` (a hot tenant cooled down); the replicas
        that no longer hold it."""
        holders = self.holders(tenant_id)
        dropped = holders[keep:]
        for name in dropped:
            del self._held[name][tenant_id]
        if dropped:
            self._changed()
        return dropped

    def drop(self, tenant_id: str, replica: str) -> None:
        """The replica does not hold the tenant after all (its load failed)."""
        if self._held.get(replica, {}).pop(tenant_id, None) is not None:
            self._changed()

    def forget(self, tenant_id: str) -> list[str]:
        """The tenant is gone (deleted): the replicas that held it."""
        return self.shrink(tenant_id, 0)

    def table(self) -> dict[str, list[str]]:
        """tenant -> the replicas that hold it (what a router routes by)."""
        out: dict[str, list[str]] = {}
        for name, tenants in self._held.items():
            for tenant_id in tenants:
                out.setdefault(tenant_id, []).append(name)
        return out

    def _oldest(self, replica: str) -> float:
        tenants = self._held[replica]
        return next(iter(tenants.values())) if tenants else 0.0

    def _changed(self) -> None:
        self.epoch = next(self._epochs)
