"""Master Service: the tenant creator (paper section 4.1.1).

Has a workload spec compiled (`services/producers/spec_compiler.py`: checked against what the
backend can do, the tenant's schema signature, the backend config the model services consume; on a
producer replica in a deployment) and persists the tenant together with its training policy in ONE
transaction — a rejected spec leaves no tenant, policy or file behind. It also marks tenants
unhealthy / healthy and deletes a tenant's control-plane rows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from joynexus.core.store import Base, ControlPlaneStore, TenantRecord, TenantTombstoneRecord
from joynexus.core.tenants import BackendCapabilities, Tenant, TenantBackendConfig, tenant_of
from joynexus.scheduling.training_scheduler import TrainingScheduler
from joynexus.services.producers.spec_compiler import SpecCompiler
from joynexus.spec import SpecError, TaskType, WorkloadSpec, parse_workload_spec

__all__ = ["SpecCompiler", "TenantCreator", "TenantExists", "TenantIdRetired"]


ACTIVE, UNHEALTHY = "active", "unhealthy"  # TenantRecord.status values


class TenantExists(SpecError):
    pass


class TenantIdRetired(TenantExists):
    """The id belonged to a deleted tenant whose artifacts were kept: a new tenant would inherit them."""

    @classmethod
    def of(cls, tenant_id: str, why: str) -> TenantIdRetired:
        return cls(
            [
                (
                    "tenant",
                    f"tenant_id {tenant_id!r} cannot be reused: {why}; a new tenant would inherit them. Purge "
                    f"them first (DELETE /v1/admin/tenants/{tenant_id}/artifacts, `joynexus tenant purge "
                    f"{tenant_id}`) or choose another id",
                )
            ]
        )


class TenantCreator:
    def __init__(
        self,
        store: ControlPlaneStore,
        scheduler: TrainingScheduler,
        capabilities: BackendCapabilities,
        *,
        validate_datasets: bool = True,
        environment_probe: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ):
        self.store = store
        self.scheduler = scheduler
        self.compiler = SpecCompiler(
            capabilities, validate_datasets=validate_datasets, environment_probe=environment_probe
        )
        # Where a spec is compiled (it imports the model stack): here by default; a deployment's
        # Master hands it to a producer replica instead (`Deployment.start`), so it stays light.
        self.compile: Callable[[WorkloadSpec], TenantBackendConfig] = self.compiler.compile

    def create(self, spec: WorkloadSpec | dict[str, Any] | str | Path) -> Tenant:
        if not isinstance(spec, WorkloadSpec):
            spec = parse_workload_spec(spec)
        config = self.compile(spec)
        with self.store.transaction() as session:
            if session.get(TenantRecord, spec.tenant) is not None:
                raise TenantExists([("tenant", f"tenant {spec.tenant!r} already exists")])
            tombstone = session.get(TenantTombstoneRecord, spec.tenant)
            if tombstone is not None:
                raise TenantIdRetired.of(spec.tenant, tombstone.reason)
            session.add(
                TenantRecord(
                    tenant_id=spec.tenant,
                    task_type=spec.task.value,
                    base_model_id=spec.base_model,
                    schema_signature=config.schema_signature,
                    spec=spec.model_dump(mode="json"),
                    backend_config=config.model_dump(mode="json"),
                )
            )
            if spec.task is not TaskType.EVAL:  # evaluation never creates training work
                sched = spec.scheduling
                self.scheduler.register_policy(
                    spec.tenant,
                    spec.task.value,
                    priority=sched.priority,
                    max_in_flight=sched.max_in_flight_jobs,
                    completion_target=sched.completion_target,
                    max_policy_staleness=sched.max_policy_staleness,
                    session=session,
                )
        return Tenant(spec.tenant, spec, config.schema_signature, config)

    def get(self, tenant_id: str) -> Tenant:
        with self.store.transaction() as session:
            record = session.get(TenantRecord, tenant_id)
            if record is None:
                raise KeyError(f"no tenant {tenant_id!r}")
            return tenant_of(record)

    def list(self) -> list[Tenant]:
        from sqlalchemy import select

        with self.store.transaction() as session:
            return [tenant_of(r) for r in session.scalars(select(TenantRecord).order_by(TenantRecord.created_at))]

    # -- health: one tenant's failure (e.g. its slot does not build) stays its own ---------------
    def mark_unhealthy(self, tenant_id: str, reason: str) -> None:
        self._set_status(tenant_id, UNHEALTHY, reason)

    def mark_healthy(self, tenant_id: str) -> None:
        self._set_status(tenant_id, ACTIVE, None)

    def _set_status(self, tenant_id: str, status: str, reason: str | None) -> None:
        with self.store.transaction() as session:
            record = session.get(TenantRecord, tenant_id, with_for_update=True)
            if record is None:
                raise KeyError(f"no tenant {tenant_id!r}")
            record.status, record.status_reason = status, reason

    def delete(self, tenant_id: str, *, tombstone: str | None = None) -> None:
        """Remove the tenant and every control-plane row of it (policies, jobs, workloads, API keys,
        quota, usage, ...) in ONE transaction. Its queue partitions, slots and artifacts are the
        caller's (the Master Service's) to release. `tombstone`: why the id stays retired (its
        artifacts were kept), recorded in the same transaction; None: the id is free again."""
        from sqlalchemy import delete

        with self.store.transaction() as session:
            if session.get(TenantRecord, tenant_id, with_for_update=True) is None:
                raise KeyError(f"no tenant {tenant_id!r}")
            # Every table with a tenant_id column, so a table added later cannot keep orphan rows.
            # Admin API keys have tenant_id NULL and never match.
            for table in Base.metadata.sorted_tables:
                if "tenant_id" in table.c:
                    session.execute(delete(table).where(table.c.tenant_id == tenant_id))
            if tombstone is not None:
                session.add(TenantTombstoneRecord(tenant_id=tenant_id, reason=tombstone))

    def tombstone(self, tenant_id: str) -> str | None:
        """Why a deleted tenant's id is retired (its artifacts were kept); None if it is not."""
        with self.store.read() as session:
            record = session.get(TenantTombstoneRecord, tenant_id)
            return None if record is None else record.reason

    def lift_tombstone(self, tenant_id: str) -> bool:
        """Free a retired id again (its artifacts are gone); False if it was not retired."""
        with self.store.transaction() as session:
            record = session.get(TenantTombstoneRecord, tenant_id, with_for_update=True)
            if record is None:
                return False
            session.delete(record)
            return True
