"""Tenants (admin): create one from a workload spec, delete one, and the tenant as the API shows it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from joynexus.api.errors import ApiError, Conflict, NotFound
from joynexus.api.gateway.directory import TenantDirectory
from joynexus.api.gateway.queue import TenantQueues
from joynexus.core.tenants import Tenant, simulator_config
from joynexus.master.tenant_creator import TenantExists
from joynexus.protocol import schemas as s
from joynexus.spec import SpecError, WorkloadSpec

if TYPE_CHECKING:
    from joynexus.master.service import MasterService


def tenant_info(tenant: Tenant) -> s.TenantInfo:
    """The tenant as the API shows it: its schema (the shapes every tensor must have) and module."""
    cfg = tenant.backend_config
    return s.TenantInfo(
        tenant_id=tenant.tenant_id,
        task=cfg.task_type,
        base_model=cfg.base_model_id,
        schema_signature=cfg.schema_signature,
        cameras=list(cfg.cameras),
        image_size=cfg.image_size,
        state_dim=cfg.state_dim,
        action_dim=cfg.action_dim,
        action_chunk=cfg.action_chunk,
        action_module={"kind": cfg.action_module["kind"], "size": cfg.action_module.get("size")},
        instruction=cfg.instruction,
        microbatch_size=cfg.microbatch_size,
        stochastic=bool(cfg.action_module.get("stochastic", False)),
        environment=simulator_config(cfg) if getattr(cfg, "environment", None) else None,
        status=tenant.status,
        status_reason=tenant.status_reason,
    )


class TenantAdmin:
    """Create, delete and purge tenants (admin calls); the directory and the tenant's queue bytes
    follow what the Master did."""

    def __init__(self, master: MasterService, directory: TenantDirectory, queues: TenantQueues):
        self._master, self._directory, self._queues = master, directory, queues

    def create(self, spec: WorkloadSpec) -> Tenant:
        try:
            tenant = self._master.create_tenant(spec)
        except TenantExists as error:
            raise Conflict(str(error), list(error.problems)) from None
        except SpecError as error:  # field paths are relative to the spec, which is the request body
            raise ApiError("invalid workload spec", list(error.problems)).with_status(422, "invalid_spec") from None
        self._directory.remember(tenant)
        return tenant

    def delete(self, tenant_id: str, delete_artifacts: bool) -> dict[str, Any]:
        try:
            report = self._master.delete_tenant(tenant_id, delete_artifacts=delete_artifacts)
        except KeyError:
            raise NotFound("tenant", tenant_id, "tenant_id") from None
        self._directory.forget(tenant_id)
        self._queues.forget_tenant(tenant_id)
        return report

    def purge_artifacts(self, tenant_id: str) -> dict[str, Any]:
        """Delete a deleted tenant's kept artifacts and free its id; 409 while the tenant exists."""
        from joynexus.master.tenant_lifecycle import TenantNotDeleted

        try:
            return self._master.purge_tenant_artifacts(tenant_id)
        except TenantNotDeleted as error:
            reason = str(error).split(": ", 1)[-1]
            raise Conflict(reason, [("tenant_id", reason)]) from None
