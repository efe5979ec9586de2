"""The replica set's side of tenant affinity (issue 45.3; `affinity.TenantAffinity` is the table):
placing a tenant on replicas (loading its kept payloads there, evicting a full replica's least
recently used tenant), the table the callers' routers read (`assignment`, `route`), and this set's
own dispatch by it. A part of `replicas.InferenceReplicaSet` (its state: `affinity`, `_table`,
`_kept`, `_publish_lock`), kept apart so each file is one concern."""

from __future__ import annotations

import logging
from typing import Any

from joynexus.services.inference.errors import UnknownPolicyVersion

log = logging.getLogger(__name__)


class TenantPlacement:
    """Mixed into `InferenceReplicaSet`: every method runs on the set (and calls its `_active`)."""

    affinity: Any
    _table: dict[str, tuple[str, ...]]
    _kept: dict[str, Any]
    policy: Any
    _publish_lock: Any
    _cond: Any
    _tenant_in_flight: dict[str, int]
    _replicas: list[Any]

    def route(self, tenant_id: str, want: int = 1, avoid: list[str] | None = None) -> dict[str, Any]:
        """Make `want` active replicas hold the tenant (loading its kept payloads where it is new;
        a full replica gives up its least recently used tenant): what a router calls on a miss, for
        a hot tenant, or (`avoid`: replicas it cannot reach, which this set's monitor may not have
        seen yet) when its holders are gone. {"holders": replica names, "epoch": the table's}."""
        if isinstance(want, bool) or not isinstance(want, int) or want < 1:
            raise ValueError(f"want: expected an integer >= 1, got {want!r}")
        with self._publish_lock:
            if tenant_id not in self._kept:
                raise UnknownPolicyVersion(tenant_id, None, [])
            if self.affinity is None:
                holders = [r.name for r in self._active()]
            else:
                holders = self._place(tenant_id, want, set(avoid or ()))
            return {"holders": holders, "epoch": self.assignment()["epoch"]}

    def assignment(self, used: list[str] | None = None) -> dict[str, Any]:
        """The routing table a caller's router holds: the active replicas (by actor name), which of
        them hold each tenant, and the hot-tenant threshold. Without affinity every active replica
        holds every tenant. `used`: tenants the router sent requests for since its last read (their
        requests did not pass here), the last to be evicted."""
        self._touch(list(used or ()))
        active = [r.name for r in self._active()]
        if self.affinity is None:
            tenants = {t: list(active) for t in sorted(self._kept.copy())}
            epoch = hash(tuple(active))
        else:
            table, epoch = self._table, self.affinity.epoch
            tenants = {t: [n for n in names if n in active] for t, names in table.items()}
        return {
            "epoch": epoch,
            "replicas": active,
            "tenants": tenants,
            "max_tenants_per_replica": self.policy.max_tenants_per_replica,
            "hot_tenant_in_flight": self.policy.hot_tenant_in_flight,
        }

    def replica_target(self, name: str) -> Any:
        """The replica behind an actor name (a local router's resolver; on Ray a router looks the
        name up itself)."""
        with self._cond:
            for replica in self._replicas:
                if replica.name == name:
                    return replica.handle.target
        raise KeyError(f"replica {name!r} is not part of this set")

    def _holders(self, tenant_id: str) -> list[str]:
        """The tenant's active holders for this set's own dispatch: placed if none, and one more if
        it is hot."""
        with self._cond:
            active = {r.name for r in self._replicas if r.state == "active"}
            in_flight = self._tenant_in_flight.get(tenant_id, 0)
        holders = [n for n in self._table.get(tenant_id, ()) if n in active]
        hot = holders and in_flight >= self.policy.hot_tenant_in_flight * len(holders) and len(holders) < len(active)
        if (not holders or hot) and tenant_id in self._kept:
            holders = self.route(tenant_id, len(holders) + 1)["holders"]
        elif holders:
            self._touch([tenant_id])
        return holders

    def _touch(self, tenants: list[str]) -> None:
        """Mark tenants used (LRU order), unless a publish or restore holds the lock: then the order
        is a little older, and no request waits seconds for it."""
        if self.affinity is not None and self._publish_lock.acquire(blocking=False):
            try:
                for tenant_id in tenants:
                    self.affinity.touch(tenant_id)
            finally:
                self._publish_lock.release()

    def _place(self, tenant_id: str, want: int, avoid: set[str] | None = None) -> list[str]:
        """Under _publish_lock: place the tenant on `want` active replicas; evicted tenants leave
        their replica, a new holder gets the tenant's kept payloads."""
        assert self.affinity is not None
        by_name = {r.name: r for r in self._active() if r.name not in (avoid or ())}
        placement = self.affinity.place(tenant_id, want, usable=set(by_name))
        for name, victim in placement.evictions:
            try:
                by_name[name].handle.evict_tenant(victim)  # the deployment's recorded serving set stays
            except Exception as error:  # gone: it holds nothing then
                log.warning("evicting tenant %r from replica %s: %s", victim, name, error)
        try:
            for name in placement.loads:
                for _, payload in sorted(self._kept.get(tenant_id, {}).items()):
                    by_name[name].handle.load_weights(payload)
        except BaseException:
            for name in placement.loads:
                self.affinity.drop(tenant_id, name)
            raise
        finally:
            self._sync_table()
        return placement.holders

    def _sync_table(self) -> None:
        """Swap in the affinity's table whole (read without a lock by dispatch callbacks)."""
        if self.affinity is not None:
            self._table = {t: tuple(names) for t, names in self.affinity.table().items()}

    def _forget_replica(self, replica: Any) -> None:
        if self.affinity is not None:
            with self._publish_lock:
                self.affinity.remove_replica(replica.name)
                self._sync_table()
