"""The Master Service's tenant lifecycle beyond create and delete (issue 26).

- Retired ids: deleting a tenant without its artifacts (checkpoints, registered model) keeps them,
  so the id is tombstoned in the store (`TenantCreator.delete(tombstone=...)`); creating a tenant
  with that id is refused (`TenantIdRetired`, naming `tenant_id` and why) until `purge` deletes
  them. An id whose checkpoints are still stored without a tombstone (a deletion before tombstones,
  or a store rebuilt beside old checkpoints) is refused the same way.
- Healing: a tenant marked unhealthy (its slot did not build, e.g. a corrupt latest checkpoint) is
  tried again when it is looked up (at most every `UNHEALTHY_RETRY_S`) and by the periodic
  housekeeping, so a repaired checkpoint is picked up without a restart.
- Housekeeping: crash leftovers of the checkpoint store are swept at start and then periodically
  (`joynexus.artifacts.leftovers`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from joynexus.artifacts.leftovers import sweep_leftovers
from joynexus.data.uploads import delete_tenant_datasets
from joynexus.master.tenant_creator import TenantIdRetired

if TYPE_CHECKING:
    from joynexus.core.tenants import Tenant
    from joynexus.master.deployment import Deployment

log = logging.getLogger(__name__)

UNHEALTHY_RETRY_S = 5.0  # an unhealthy tenant's slot is rebuilt at most this often on lookups
# MasterService._forget_tenant's report keys of what a deletion with its artifacts removes.
ARTIFACT_STEPS = ("checkpoint_objects", "registered_model", "uploaded_datasets")


class TenantNotDeleted(RuntimeError):
    """Purging the artifacts of a tenant that still exists (delete it first)."""


def retired_reason(report: dict[str, Any], delete_artifacts: bool) -> str | None:
    """Why a deleted tenant's id stays retired (None: its artifacts are gone, the id is free)."""
    if not delete_artifacts:
        return "it belonged to a deleted tenant whose checkpoints and registered model were kept"
    failed = [f"{name} {report[name]}" for name in ARTIFACT_STEPS if str(report.get(name)).startswith("not removed")]
    if failed:
        return f"it belonged to a deleted tenant whose artifacts were not all deleted ({'; '.join(failed)})"
    return None


def check_id_reusable(deployment: Deployment, tenant_id: str) -> None:
    """Refuse a new tenant a retired id, or one whose earlier tenant's checkpoints are still stored
    (TenantIdRetired, saying why); the creator checks the tombstone again in its transaction."""
    try:
        deployment.creator.get(tenant_id)
        return  # it exists: the creator answers TenantExists
    except KeyError:
        pass
    retired = deployment.creator.tombstone(tenant_id)
    if retired is not None:
        raise TenantIdRetired.of(tenant_id, retired)
    if deployment.checkpoints.has_objects(tenant_id):
        raise TenantIdRetired.of(tenant_id, "checkpoints of an earlier tenant with this id are still stored")


def purge(deployment: Deployment, tenant_id: str) -> dict[str, Any]:
    """Delete a deleted tenant's kept artifacts (checkpoints, registered model, uploads) and free its id.
    TenantNotDeleted while the tenant exists; the tombstone stays if a deletion failed."""
    try:
        deployment.creator.get(tenant_id)
    except KeyError:
        pass
    else:
        raise TenantNotDeleted(f"tenant_id: tenant {tenant_id!r} exists; delete it (with its artifacts) instead")
    report: dict[str, Any] = {"tenant_id": tenant_id}
    steps: tuple[tuple[str, Callable[[], Any]], ...] = (
        ("checkpoint_objects", lambda: deployment.checkpoints.delete_tenant(tenant_id)),
        ("registered_model", lambda: deployment.tracker.delete_tenant_model(tenant_id)),
        ("uploaded_datasets", lambda: delete_tenant_datasets(deployment.settings.data_dir / "datasets", tenant_id)),
    )
    for name, step in steps:
        try:
            report[name] = step()
        except Exception as error:  # reported; the id stays retired
            report[name] = f"not removed: {type(error).__name__}: {error}"
            log.warning("purging tenant %s: %s failed: %s", tenant_id, name, error)
    if retired_reason(report, delete_artifacts=True) is None:
        report["tombstone"] = "lifted" if deployment.creator.lift_tombstone(tenant_id) else "none"
    else:
        report["tombstone"] = "kept"
    return report


class TenantHousekeeping:
    """Periodic work of the Master beside the Health Manager's rounds: the checkpoint leftover
    sweep and the retry of unhealthy tenants; and the rate limit of retries on lookups."""

    def __init__(
        self,
        deployment: Deployment,
        restore_slot: Callable[[Tenant], None],
        *,
        sweep_every_s: float,
        leftover_grace_s: float,
        retry_unhealthy_every_s: float,
    ):
        self.deployment = deployment
        self.restore_slot = restore_slot
        self.sweep_every_s = sweep_every_s
        self.leftover_grace_s = leftover_grace_s
        self.retry_unhealthy_every_s = retry_unhealthy_every_s
        self._lock = threading.Lock()
        self._last_sweep: float | None = None
        self._last_retry_round = time.monotonic()
        self._last_retry: dict[str, float] = {}

    def tick(self) -> None:
        """Called every Health Manager round; does what is due (the sweep at once on the first)."""
        now = time.monotonic()
        if self._last_sweep is None or now - self._last_sweep >= self.sweep_every_s:
            self._last_sweep = now
            try:
                sweep_leftovers(self.deployment.checkpoints, grace_s=self.leftover_grace_s)
            except Exception:  # the next sweep tries again
                log.exception("sweeping checkpoint leftovers failed")
        if now - self._last_retry_round >= self.retry_unhealthy_every_s:
            self._last_retry_round = now
            try:
                for tenant in self.deployment.creator.list():
                    if tenant.status == "unhealthy":
                        self.heal(tenant)
            except Exception:  # never fails the Health Manager's round; the next one tries again
                log.exception("retrying unhealthy tenants failed")

    def heal(self, tenant: Tenant) -> Tenant:
        """Rebuild an unhealthy tenant's slot (rate-limited per tenant); the tenant as it is after."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_retry.get(tenant.tenant_id, float("-inf")) < UNHEALTHY_RETRY_S:
                return tenant
            self._last_retry[tenant.tenant_id] = now
        self.restore_slot(tenant)
        try:
            return self.deployment.creator.get(tenant.tenant_id)
        except KeyError:  # deleted meanwhile
            return tenant
