"""State control in the Master (issue 28.3): roll a tenant's training slot back to a kept version,
and fork a tenant's version into a new tenant with another learning rate or seed.

A fork is the source's workload spec with a new tenant id and the overridden `training` fields:
the same schema, module, adapter, data and environment, so it joins the same shared backbone and
groups with its source. Its weights are a copy: the source version's checkpoint (module, adapter,
AdamW state, counters) is written as the new tenant's version 0, then the tenant is created the
usual way (validated, persisted, its slot restored from that checkpoint). The two tenants share
nothing mutable — separate checkpoint folders, slots, optimizers, version counters, queues — and a
fork that fails at any step leaves neither a tenant nor a checkpoint behind.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from joynexus.core.tenants import Tenant
from joynexus.spec import SpecError, WorkloadSpec, parse_workload_spec

log = logging.getLogger(__name__)

__all__ = ["FORK_OVERRIDES", "ForkLimitReached", "fork_spec", "fork_tenant", "load_state"]

# What a fork may change; everything else is the source's (a fork keeps its schema).
FORK_OVERRIDES = ("learning_rate", "seed")


def fork_spec(source: Tenant, new_tenant: str, overrides: dict[str, Any] | None) -> WorkloadSpec:
    """The new tenant's spec: the source's with `new_tenant` and the `training` overrides, checked
    (SpecError: `new_tenant` or `overrides.<field>` with the reason)."""
    overrides = {k: v for k, v in dict(overrides or {}).items() if v is not None}
    unknown = sorted(set(overrides) - set(FORK_OVERRIDES))
    if unknown:
        reason = f"a fork keeps its source's schema, module and data; only {list(FORK_OVERRIDES)} may change"
        raise SpecError([(f"overrides.{name}", reason) for name in unknown])
    data = source.spec.model_dump(mode="json")
    data["tenant"] = new_tenant
    data["training"] = {**data["training"], **overrides}
    try:
        return parse_workload_spec(data)
    except SpecError as error:
        renamed = {"tenant": "new_tenant", **{f"training.{k}": f"overrides.{k}" for k in FORK_OVERRIDES}}
        raise SpecError([(renamed.get(field, field), reason) for field, reason in error.problems]) from None


def load_state(deployment: Any, tenant_id: str, version: Any) -> dict[str, Any]:
    """Roll the tenant's training slot back to checkpoint `version` (the Training Model Service's
    `load_state`: module, adapter, optimizer, counters; pending gradients discarded)."""
    return deployment.training_service.load_state(tenant_id, version)


def _source_version(deployment: Any, source: Tenant, version: int | None) -> int:
    """The kept checkpoint version to fork (None: the source's current training version, saved now)."""
    checkpoints = deployment.checkpoints
    if version is None:
        manifest = deployment.training_service.save([source.tenant_id], True)[0]
        return int(manifest["policy_version"])
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise SpecError([("version", f"{version!r} must be an int >= 0 (a kept checkpoint version)")])
    kept = checkpoints.versions(source.tenant_id)
    if version not in kept:
        reason = f"tenant {source.tenant_id!r} has no checkpoint of version {version} (kept: {kept})"
        raise SpecError([("version", reason)])
    return version


class ForkLimitReached(RuntimeError):
    """The owner of a fork line has `max_forks_per_tenant` forks already."""


# New tenant ids being forked right now, per deployment: a second fork racing for the same id is
# refused at once (TenantExists, 409) instead of colliding with the first one's checkpoint write.
_forking: set[tuple[int, str]] = set()
_forking_lock = threading.Lock()


@contextmanager
def _claim_fork_name(deployment: Any, new_tenant: str) -> Iterator[None]:
    from joynexus.master.tenant_creator import TenantExists

    key = (id(deployment), new_tenant)
    with _forking_lock:
        if key in _forking:
            raise TenantExists([("new_tenant", f"tenant {new_tenant!r} is being created by another fork right now")])
        _forking.add(key)
    try:
        yield
    finally:
        with _forking_lock:
            _forking.discard(key)


def _check_fork_bound(master: Any, source: Tenant) -> None:
    limit = master.options.max_forks_per_tenant
    owner, line = master.ledger.fork_line(source.tenant_id)
    if len(line) - 1 >= limit:
        raise ForkLimitReached(
            f"tenant {owner!r} already owns {len(line) - 1} forks (max_forks_per_tenant is {limit}; forks of "
            "forks count against the first fork's owner); delete one (DELETE /v1/forks/{tenant_id}) first"
        )


def fork_tenant(
    master: Any, source: Tenant, new_tenant: str, *, version: int | None = None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Create `new_tenant` from `source`'s `version` (module docstring). Returns the new Tenant, the
    source version forked, the new tenant's version (0) and the owner of its fork line. Raises
    SpecError naming the field (`new_tenant`, `version`, `overrides.*`), TenantExists if the id is
    taken or being forked, ForkLimitReached past `max_forks_per_tenant`."""
    deployment = master.deployment
    spec = fork_spec(source, new_tenant, overrides)
    with _claim_fork_name(deployment, new_tenant):
        _check_new_id(deployment, new_tenant)
        _check_fork_bound(master, source)
        forked = _source_version(deployment, source, version)
        # The copy runs in the Training Model Service (the source's shard): the Master holds no tensor.
        deployment.training_service.fork_checkpoint(source.tenant_id, forked, new_tenant)
        try:
            # An upload the source trains on (dataset.id) stays the source's: the fork names it from there.
            tenant = master.create_tenant(spec, starts_from_checkpoint=True, dataset_owner=source.tenant_id)
            owner = master.ledger.record_fork(new_tenant, source.tenant_id, forked)
        except BaseException:
            _undo_fork(master, new_tenant)
            raise
    return {
        "tenant": tenant,
        "forked_from": {"tenant_id": source.tenant_id, "version": forked},
        "version": 0,
        "owner": owner,
    }


def _check_new_id(deployment: Any, new_tenant: str) -> None:
    from joynexus.master.tenant_creator import TenantExists
    from joynexus.master.tenant_lifecycle import check_id_reusable

    try:
        deployment.creator.get(new_tenant)
    except KeyError:
        pass
    else:
        raise TenantExists([("new_tenant", f"tenant {new_tenant!r} already exists")])
    check_id_reusable(deployment, new_tenant)  # a retired id, or an earlier tenant's leftovers
    checkpoints = deployment.checkpoints
    if checkpoints.versions(new_tenant) or checkpoints.latest_version(new_tenant) is not None:
        raise SpecError([("new_tenant", f"checkpoints of an earlier tenant {new_tenant!r} remain; choose another id")])


def _undo_fork(master: Any, new_tenant: str) -> None:
    """A fork failed after its checkpoint was written: remove the tenant (if it was created) and
    the checkpoint; reported, the original error is the one raised."""
    deployment = master.deployment
    try:
        deployment.creator.get(new_tenant)
    except KeyError:
        pass
    else:
        try:
            master.delete_tenant(new_tenant, delete_artifacts=True)
            return
        except Exception:
            log.warning("fork %s: the tenant could not be removed after a failed fork", new_tenant, exc_info=True)
    try:
        deployment.checkpoints.delete_tenant(new_tenant)
    except Exception:
        log.warning("fork %s: its checkpoint could not be removed after a failed create", new_tenant, exc_info=True)
