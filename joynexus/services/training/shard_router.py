"""The sharded Training Model Service as a caller outside the Master sees it (issue 45): each
tenant's call goes straight to the shard that holds the tenant's slot.

The Master owns the placement (`services.training.shards.TrainingShards`, in its process); a
producer replica only needs to reach a tenant's slot (export a version, read its policy version,
checkpoint it). `TrainingShardRouter` finds the holder by asking the shards which tenants they hold,
remembers it, and asks again when the shard it remembered no longer holds the tenant (a move or a
lost shard's recovery) or is gone: routing in the caller's handle, no hop through the Master. It is
torch-free (it names the service type only) and holds no tensor beyond what a call returns."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from joynexus.actors import role_unavailable, service_handle
from joynexus.services.training.errors import UnknownTenant

if TYPE_CHECKING:
    from joynexus.services.training.service import TrainingModelService

R = TypeVar("R")


def shard_actor_name(index: int) -> str:
    """Shard `index`'s named actor (the Training Model Service's name, then `.shard-<i>`)."""
    return f"joynexus.training_service.shard-{index}"


class NoShardHoldsTenant(UnknownTenant):
    def __init__(self, tenant_id: str, shards: int):
        KeyError.__init__(self, f"no training shard of {shards} holds tenant {tenant_id!r}")
        self.tenant_id = tenant_id


class TrainingShardRouter:
    def __init__(self, shards: Sequence[Any]):
        """`shards`: the shard services or their Ray actors, shard i at index i."""
        if not shards:
            raise ValueError("TrainingShardRouter needs at least one shard")
        self._shards = [service_handle(cast("type[TrainingModelService]", object), s) for s in shards]
        self._holder: dict[str, int] = {}
        self._gone: set[int] = set()
        self._lock = threading.Lock()

    @property
    def shard_count(self) -> int:
        return len(self._shards)

    # -- the calls a producer replica makes ----------------------------------------------------
    def export_params(self, tenant_id: str) -> bytes:
        return self._on_holder(tenant_id, lambda shard: shard.export_params(tenant_id))

    def policy_version(self, tenant_id: str) -> int:
        return self._on_holder(tenant_id, lambda shard: shard.policy_version(tenant_id))

    def tenant_status(self, tenant_id: str) -> dict[str, Any]:
        return self._on_holder(tenant_id, lambda shard: shard.tenant_status(tenant_id))

    def save(self, tenant_ids: list[str] | None = None, include_optim: bool = True) -> list[dict[str, Any]]:
        """Each tenant checkpointed on its own shard, manifests in the order asked (every tenant
        of every shard when `tenant_ids` is None)."""
        ids = self.tenants() if tenant_ids is None else list(tenant_ids)
        return [self._on_holder(t, lambda shard, t=t: shard.save([t], include_optim)[0]) for t in ids]

    def tenants(self) -> list[str]:
        return sorted({t for _, shard in self._live() for t in shard.tenants()})

    def capabilities(self) -> Any:
        return self._first(lambda shard: shard.capabilities())

    def backbone_info(self) -> dict[str, Any]:
        return self._first(lambda shard: shard.backbone_info())

    # -- routing ---------------------------------------------------------------------------------
    def holder_of(self, tenant_id: str, *, refresh: bool = False) -> int:
        """The index of the shard holding the tenant: remembered, else found by asking every live
        shard (`NoShardHoldsTenant` when none does)."""
        with self._lock:
            known = None if refresh else self._holder.get(tenant_id)
        if known is not None:
            return known
        for index, shard in self._live():
            try:
                held = tenant_id in shard.tenants()
            except Exception as error:
                if not role_unavailable(error):
                    raise
                self._mark_gone(index)
                continue
            if held:
                with self._lock:
                    self._holder[tenant_id] = index
                return index
        raise NoShardHoldsTenant(tenant_id, len(self._shards))

    def _on_holder(self, tenant_id: str, call: Callable[[TrainingModelService], R]) -> R:
        """`call` on the tenant's shard; once more on the shard found afresh when the remembered one
        no longer holds the tenant or is gone."""
        index = self.holder_of(tenant_id)
        try:
            return call(self._shards[index])
        except Exception as error:
            if role_unavailable(error):
                self._mark_gone(index)
            elif not _unknown_tenant(error):
                raise
        return call(self._shards[self.holder_of(tenant_id, refresh=True)])

    def _first(self, call: Callable[[TrainingModelService], R]) -> R:
        for index, shard in self._live():
            try:
                return call(shard)
            except Exception as error:
                if not role_unavailable(error):
                    raise
                self._mark_gone(index)
        raise NoShardHoldsTenant("(any)", len(self._shards))

    def _live(self) -> list[tuple[int, TrainingModelService]]:
        with self._lock:
            gone = set(self._gone)
        # Every shard is asked again once all were seen gone: a shard restarts in place under its name.
        live = [(i, s) for i, s in enumerate(self._shards) if i not in gone]
        return live or list(enumerate(self._shards))

    def _mark_gone(self, index: int) -> None:
        with self._lock:
            self._gone.add(index)
            for tenant_id in [t for t, i in self._holder.items() if i == index]:
                del self._holder[tenant_id]


def _unknown_tenant(error: BaseException) -> bool:
    """A shard that no longer holds the tenant (its slot moved): locally, or behind Ray's task error."""
    return isinstance(error, UnknownTenant) or isinstance(getattr(error, "cause", None), UnknownTenant)

