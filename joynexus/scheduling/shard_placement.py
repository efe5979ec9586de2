"""Which Training Model Service shard holds each tenant (issue 45.1): `ShardPlacement`.

A deployment may run M Training Model Service shards, each its own backbone on its own device, each
holding a subset of the tenants. This module is the Training Scheduler's placement decision and the
guard that keeps a tenant on one shard at a time; it holds no tensors and calls no service (the
shard set, `services.training.shards`, does the moving).

Placement rules, in order:

- sticky: a placed tenant stays where it is until it is moved (its slot, optimizer state and paged
  copy live there; moving costs a page-out and a page-in);
- group-compatible tenants together: a shard already holding fewer than `group_size` tenants of the
  new tenant's group key takes it, so a grouped step (`train_jobs`) finds companions on its shard;
  past `group_size` the group spreads, because one grouped step trains at most that many anyway;
- otherwise the least loaded live shard with room, load being the tenants' recent training
  seconds (measured, `record_training`), memory the bound on slot bytes (`max_bytes_per_shard`).

The guard: a shard's actor loop leases only jobs of the tenants `leasable(shard)` names, inside a
`leasing(shard)` window, and counts each leased job as in flight (`begin`/`end`). A tenant being
moved is leasable nowhere, and `wait_idle` returns only once its in-flight jobs on the old shard
ended and every lease window that could have seen it closed: a tenant's jobs never run on two
shards at once.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["PlacementError", "ShardPlacement", "ShardsFull", "TenantFootprint"]

# How fast a tenant's measured load forgets the past (weight of the newest observation).
_LOAD_DECAY = 0.3


class PlacementError(RuntimeError):
    """A placement request that cannot be honoured (unknown tenant or shard, a lost shard)."""


class ShardsFull(PlacementError):
    """No live shard has room for the tenant (tenant count and slot bytes bounds)."""


@dataclass
class TenantFootprint:
    """What placement knows of one tenant: its group key, slot bytes and measured training load."""

    group_key: Hashable
    nbytes: int = 0
    load_s: float = 0.0  # decayed training seconds per job (0 until its first job)
    in_flight: int = 0  # jobs leased and not yet ended, on its current shard


@dataclass
class _Shard:
    index: int
    tenants: dict[str, TenantFootprint] = field(default_factory=dict)
    alive: bool = True
    open_windows: set[int] = field(default_factory=set)  # ids of lease windows in progress (`leasing`)


class ShardPlacement:
    """Tenant -> shard, with the one-shard-at-a-time guard. Thread-safe: the actor loops of all
    shards, the tenant creator and the health check call it from their threads."""

    def __init__(
        self,
        shards: int,
        *,
        max_tenants_per_shard: int | None = None,
        max_bytes_per_shard: int | None = None,
        group_size: int = 8,
    ) -> None:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if max_tenants_per_shard is not None and max_tenants_per_shard < 1:
            raise ValueError(f"max_tenants_per_shard must be >= 1 or None, got {max_tenants_per_shard}")
        if max_bytes_per_shard is not None and max_bytes_per_shard < 1:
            raise ValueError(f"max_bytes_per_shard must be >= 1 or None, got {max_bytes_per_shard}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.max_tenants_per_shard = max_tenants_per_shard
        self.max_bytes_per_shard = max_bytes_per_shard
        self.group_size = group_size
        self._shards = [_Shard(i) for i in range(shards)]
        self._where: dict[str, int] = {}
        self._moving: dict[str, frozenset[int]] = {}  # tenant -> its shard's windows open when its move began
        self._window_ids = itertools.count()
        self._changed = threading.Condition()

    # -- reading ---------------------------------------------------------------------------
    @property
    def shard_count(self) -> int:
        return len(self._shards)

    def live_shards(self) -> list[int]:
        with self._changed:
            return [s.index for s in self._shards if s.alive]

    def shard_of(self, tenant_id: str) -> int:
        with self._changed:
            try:
                return self._where[tenant_id]
            except KeyError:
                raise PlacementError(f"tenant {tenant_id!r} is not placed on any shard") from None

    def is_placed(self, tenant_id: str) -> bool:
        with self._changed:
            return tenant_id in self._where

    def tenants_of(self, shard: int) -> list[str]:
        with self._changed:
            return sorted(self._shard(shard).tenants)

    def footprint(self, tenant_id: str) -> TenantFootprint:
        with self._changed:
            return self._shards[self.shard_of(tenant_id)].tenants[tenant_id]

    def load(self, shard: int) -> float:
        """The shard's expected training seconds per round of one job per tenant."""
        with self._changed:
            return self._load(self._shard(shard))

    def summary(self) -> list[dict[str, object]]:
        """Per shard: alive, tenants, slot bytes, load (status pages, tests)."""
        with self._changed:
            return [
                {
                    "shard": s.index,
                    "alive": s.alive,
                    "tenants": len(s.tenants),
                    "bytes": sum(t.nbytes for t in s.tenants.values()),
                    "load_s": round(self._load(s), 6),
                }
                for s in self._shards
            ]

    # -- placing ---------------------------------------------------------------------------
    def place(
        self, tenant_id: str, group_key: Hashable, nbytes: int = 0, *, exclude: frozenset[int] = frozenset()
    ) -> int:
        """The tenant's shard: where it already is (sticky), else the choice of the module's rules."""
        with self._changed:
            if tenant_id in self._where:
                return self._where[tenant_id]
            shard = self._choose(group_key, nbytes, exclude)
            shard.tenants[tenant_id] = TenantFootprint(group_key, nbytes)
            self._where[tenant_id] = shard.index
            self._changed.notify_all()
            return shard.index

    def assign(self, tenant_id: str, shard: int, group_key: Hashable = None, nbytes: int = 0) -> None:
        """Record that the tenant's slot already lives on `shard` (a new Master adopting running
        shards); no rule is applied, nothing is bounded."""
        with self._changed:
            if tenant_id in self._where:
                raise PlacementError(f"tenant {tenant_id!r} is on shard {self._where[tenant_id]} already")
            self._shard(shard).tenants[tenant_id] = TenantFootprint(group_key, nbytes)
            self._where[tenant_id] = shard
            self._changed.notify_all()

    def unplace(self, tenant_id: str) -> None:
        """Forget the tenant (it was removed); nothing if it was not placed."""
        with self._changed:
            index = self._where.pop(tenant_id, None)
            if index is not None:
                self._shards[index].tenants.pop(tenant_id, None)
            self._moving.pop(tenant_id, None)
            self._changed.notify_all()

    def update_bytes(self, tenant_id: str, nbytes: int) -> None:
        with self._changed:
            self._shards[self.shard_of(tenant_id)].tenants[tenant_id].nbytes = nbytes

    def record_training(self, tenant_id: str, seconds: float) -> None:
        """A job of the tenant trained in `seconds` (its shard's load follows)."""
        with self._changed:
            index = self._where.get(tenant_id)
            if index is None:
                return
            footprint = self._shards[index].tenants[tenant_id]
            footprint.load_s = seconds if footprint.load_s == 0 else (
                (1 - _LOAD_DECAY) * footprint.load_s + _LOAD_DECAY * seconds
            )  # fmt: skip

    def _choose(self, group_key: Hashable, nbytes: int, exclude: frozenset[int]) -> _Shard:
        candidates = [s for s in self._shards if s.alive and s.index not in exclude and self._has_room(s, nbytes)]
        if not candidates:
            live = sum(1 for s in self._shards if s.alive)
            raise ShardsFull(
                f"no shard has room for a tenant of {nbytes} bytes: {live} live of {len(self._shards)} shards, "
                f"max_tenants_per_shard={self.max_tenants_per_shard}, max_bytes_per_shard={self.max_bytes_per_shard}"
            )
        with_group = [
            s
            for s in candidates
            if 0 < sum(1 for t in s.tenants.values() if t.group_key == group_key) < self.group_size
        ]
        pool = with_group or candidates
        # Least loaded, then fewest bytes, then fewest tenants, then the lowest index (deterministic).
        return min(pool, key=lambda s: (self._load(s), self._bytes(s), len(s.tenants), s.index))

    def _has_room(self, shard: _Shard, nbytes: int) -> bool:
        if self.max_tenants_per_shard is not None and len(shard.tenants) >= self.max_tenants_per_shard:
            return False
        return self.max_bytes_per_shard is None or self._bytes(shard) + nbytes <= self.max_bytes_per_shard

    @staticmethod
    def _bytes(shard: _Shard) -> int:
        return sum(t.nbytes for t in shard.tenants.values())

    def _load(self, shard: _Shard) -> float:
        """Sum of the tenants' measured seconds per job; a tenant not measured yet counts as the mean
        of the measured ones everywhere (1.0 when none is), so new tenants spread too."""
        measured = [t.load_s for s in self._shards for t in s.tenants.values() if t.load_s > 0]
        default = sum(measured) / len(measured) if measured else 1.0
        return sum(t.load_s if t.load_s > 0 else default for t in shard.tenants.values())

    def _shard(self, index: int) -> _Shard:
        if not 0 <= index < len(self._shards):
            raise PlacementError(f"shard {index} does not exist (0..{len(self._shards) - 1})")
        return self._shards[index]

    # -- the lease guard -------------------------------------------------------------------
    @contextmanager
    def leasing(self, shard: int) -> Iterator[frozenset[str]]:
        """A lease window of `shard`'s actor loop: yields the tenants it may lease jobs of (placed
        there, not moving; none if the shard is lost). Jobs leased inside must be `begin`-ed before
        the window closes."""
        with self._changed:
            state = self._shard(shard)
            window = next(self._window_ids)
            state.open_windows.add(window)
            tenants = frozenset(t for t in state.tenants if t not in self._moving) if state.alive else frozenset()
        try:
            yield tenants
        finally:
            with self._changed:
                state.open_windows.discard(window)
                self._changed.notify_all()

    def begin(self, tenant_id: str, shard: int) -> None:
        """A job of the tenant was leased by `shard`'s loop (inside its window): in flight there."""
        with self._changed:
            footprint = self._shard(shard).tenants.get(tenant_id)
            if footprint is None:
                raise PlacementError(f"tenant {tenant_id!r} is not on shard {shard}")
            footprint.in_flight += 1

    def end(self, tenant_id: str, shard: int) -> None:
        """That job ended (any outcome, or given back)."""
        with self._changed:
            footprint = self._shards[shard].tenants.get(tenant_id)
            if footprint is not None and footprint.in_flight > 0:
                footprint.in_flight -= 1
            self._changed.notify_all()

    def in_flight(self, tenant_id: str) -> int:
        return self.footprint(tenant_id).in_flight

    # -- moving ----------------------------------------------------------------------------
    def start_move(self, tenant_id: str) -> int:
        """Stop leasing the tenant's jobs anywhere (until `finish_move` / `cancel_move`); its shard."""
        with self._changed:
            index = self.shard_of(tenant_id)
            if tenant_id in self._moving:
                raise PlacementError(f"tenant {tenant_id!r} is already being moved")
            self._moving[tenant_id] = frozenset(self._shards[index].open_windows)
            return index

    def wait_idle(self, tenant_id: str, timeout_s: float = 60.0) -> bool:
        """Block until the moving tenant has no job in flight and every lease window of its shard
        opened before the move closed (one could still `begin` a job of it). False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            shard = self._shards[self.shard_of(tenant_id)]
            if tenant_id not in self._moving:
                raise PlacementError(f"tenant {tenant_id!r} is not being moved (start_move first)")
            windows_before = self._moving[tenant_id]

            def idle() -> bool:
                footprint = shard.tenants.get(tenant_id)
                busy = footprint is not None and footprint.in_flight > 0
                return not busy and not (windows_before & shard.open_windows)

            while not idle():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def finish_move(self, tenant_id: str, destination: int) -> None:
        """The tenant's slot now lives on `destination`: it is leasable there."""
        with self._changed:
            source = self._shards[self.shard_of(tenant_id)]
            target = self._shard(destination)
            if not target.alive:
                raise PlacementError(f"shard {destination} is lost")
            footprint = source.tenants.pop(tenant_id)
            footprint.in_flight = 0
            target.tenants[tenant_id] = footprint
            self._where[tenant_id] = destination
            self._moving.pop(tenant_id, None)
            self._changed.notify_all()

    def cancel_move(self, tenant_id: str) -> None:
        with self._changed:
            self._moving.pop(tenant_id, None)
            self._changed.notify_all()

    def choose_destination(self, tenant_id: str) -> int:
        """Where a move of the tenant should go: the module's rules over the other live shards."""
        with self._changed:
            index = self.shard_of(tenant_id)
            footprint = self._shards[index].tenants[tenant_id]
            return self._choose(footprint.group_key, footprint.nbytes, frozenset({index})).index

    def over_bytes(self) -> list[tuple[str, int]]:
        """(tenant, shard) to move off shards whose slot bytes exceed `max_bytes_per_shard`: the
        smallest tenants first that bring each such shard back under its bound."""
        if self.max_bytes_per_shard is None:
            return []
        moves: list[tuple[str, int]] = []
        with self._changed:
            for shard in self._shards:
                excess = self._bytes(shard) - self.max_bytes_per_shard
                for tenant_id, footprint in sorted(shard.tenants.items(), key=lambda item: item[1].nbytes):
                    if excess <= 0:
                        break
                    moves.append((tenant_id, shard.index))
                    excess -= footprint.nbytes
        return moves

    # -- losing a shard --------------------------------------------------------------------
    def lose(self, shard: int) -> list[str]:
        """The shard is gone: it takes no tenant and leases nothing from now on. Returns its tenants,
        now unplaced (re-`place` each: the shard set resumes them elsewhere from their checkpoints)."""
        with self._changed:
            state = self._shard(shard)
            state.alive = False
            lost = sorted(state.tenants)
            for tenant_id in lost:
                del self._where[tenant_id]
                self._moving.pop(tenant_id, None)
            state.tenants.clear()
            self._changed.notify_all()
            return lost

    def revive(self, shard: int) -> None:
        """A lost shard is back (a new actor, empty): it may take tenants again."""
        with self._changed:
            self._shard(shard).alive = True
