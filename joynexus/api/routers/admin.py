"""Admin routes (/v1/admin, the admin key): tenants, their API keys and quotas, everyone's usage."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response

from joynexus.api.errors import NotFound
from joynexus.api.gateway import tenant_info
from joynexus.api.middleware import WireRoute
from joynexus.api.routers.dependencies import ADMIN_ERRORS, Admin, Gateway, Keys, TenantIdPath
from joynexus.api.routers.responses import respond
from joynexus.protocol import schemas as s
from joynexus.spec import WorkloadSpec

router = APIRouter(prefix="/v1/admin", route_class=WireRoute, tags=["admin"], responses=ADMIN_ERRORS)


@router.post("/tenants", response_model=s.TenantCreated, status_code=201)
def create_tenant(
    request: Request,
    spec: WorkloadSpec,
    _: Admin,
    gateway: Gateway,
    keys: Keys,
    issue_key: Annotated[bool, Query(description="also issue the tenant's first API key")] = True,
) -> Response:
    """Create a tenant from a workload spec (the tenant creator validates it against the
    backend) and, by default, issue its first API key (shown only in this answer)."""
    tenant = gateway.create_tenant(spec)
    key = keys.issue(tenant.tenant_id, label="first key") if issue_key else None
    return respond(request, s.TenantCreated(tenant=tenant_info(tenant), key=key), 201)


@router.get("/tenants", response_model=list[s.TenantInfo])
def list_tenants(request: Request, _: Admin, gateway: Gateway) -> Response:
    return respond(request, [tenant_info(t) for t in gateway.tenants()])


@router.post("/tenants/{tenant_id}/keys", response_model=s.IssuedKey, status_code=201)
def issue_key(
    request: Request, tenant_id: TenantIdPath, body: s.IssueKeyRequest, _: Admin, gateway: Gateway, keys: Keys
) -> Response:
    gateway.tenant(tenant_id)
    return respond(request, keys.issue(tenant_id, label=body.label), 201)


@router.get("/tenants/{tenant_id}/keys", response_model=list[s.KeyInfo])
def list_keys(request: Request, tenant_id: TenantIdPath, _: Admin, gateway: Gateway, keys: Keys) -> Response:
    gateway.tenant(tenant_id)
    return respond(request, keys.list(tenant_id))


@router.delete("/keys/{key_id}", response_model=s.KeyInfo)
def revoke_key(request: Request, key_id: Annotated[str, Path(max_length=32)], _: Admin, keys: Keys) -> Response:
    revoked = keys.revoke(key_id)
    if revoked is None:
        raise NotFound("API key", key_id, "key_id")
    return respond(request, revoked)


@router.delete("/tenants/{tenant_id}", response_model=s.TenantDeleted)
def delete_tenant(
    request: Request,
    tenant_id: TenantIdPath,
    _: Admin,
    gateway: Gateway,
    delete_artifacts: Annotated[
        bool, Query(description="also delete its checkpoints and registered model (irreversible)")
    ] = False,
) -> Response:
    """Delete a tenant: its workloads are cancelled and its jobs released; its keys, slots,
    serving versions, sessions, queue data, quota and usage rows go; with `delete_artifacts`
    its checkpoints and registered model too. Without them the id stays retired (a new tenant
    would inherit them): creating a tenant with it answers 409 until the artifacts are purged
    (DELETE /v1/admin/tenants/{tenant_id}/artifacts)."""
    report = gateway.delete_tenant(tenant_id, delete_artifacts)
    request.app.state.limiter.forget(tenant_id)  # a tenant created again under this id starts afresh
    request.app.state.keys.forget_tenant(tenant_id)  # its key rows are gone: no verified key lingers
    return respond(request, s.TenantDeleted(tenant_id=tenant_id, removed=_jsonable_report(report)))


@router.delete("/tenants/{tenant_id}/artifacts", response_model=s.TenantDeleted)
def purge_tenant_artifacts(request: Request, tenant_id: TenantIdPath, _: Admin, gateway: Gateway) -> Response:
    """Delete the checkpoints and registered model a deleted tenant left (deleted without
    `delete_artifacts`), which frees its id for a new tenant; 409 while the tenant exists."""
    report = gateway.purge_tenant_artifacts(tenant_id)
    return respond(request, s.TenantDeleted(tenant_id=tenant_id, removed=_jsonable_report(report)))


@router.put("/tenants/{tenant_id}/quota", response_model=s.Quota)
def set_quota(request: Request, tenant_id: TenantIdPath, body: s.QuotaUpdate, _: Admin, gateway: Gateway) -> Response:
    gateway.tenant(tenant_id)
    return respond(request, gateway.master.set_quota(tenant_id, body))


@router.get("/usage", response_model=list[s.Usage])
def all_usage(request: Request, _: Admin, gateway: Gateway) -> Response:
    limiter = request.app.state.limiter
    usages = [gateway.usage(t.tenant_id) for t in gateway.tenants()]
    return respond(request, [u.model_copy(update={"throttled": limiter.throttled(u.tenant_id)}) for u in usages])


def _jsonable_report(report: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in report.items() if k != "tenant_id"}
