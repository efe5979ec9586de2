"""State-control routes (a tenant key): roll the caller's training slot back to a kept version
(`load_state`), fork one of its versions into a new tenant (`fork`), list and delete the forks it
owns (`GET /v1/forks`, `DELETE /v1/forks/{tenant_id}`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from joynexus.api.auth import Principal
from joynexus.api.middleware import WireRoute
from joynexus.api.routers.dependencies import ERRORS, Gateway, Tenant, TenantIdPath, principal
from joynexus.api.routers.responses import respond
from joynexus.protocol import schemas as s
from joynexus.protocol import state_control as sc

router = APIRouter(prefix="/v1", route_class=WireRoute, tags=["lower layer: state control"], responses=ERRORS)


@router.post("/load_state", response_model=sc.LoadStateResult)
def load_state(request: Request, body: sc.LoadStateRequest, tenant_id: Tenant, gateway: Gateway) -> Response:
    """Roll your training slot (action module, adapter, AdamW state, counters) back to a kept
    checkpoint version; pending forward_backward gradients are discarded. A checkpoint saved
    without optimizer state restores the weights with fresh AdamW moments (`optimizer_restored`)."""
    return respond(request, gateway.load_state(tenant_id, body))


@router.post("/fork", response_model=sc.TenantForked, status_code=201)
def fork(
    request: Request,
    body: sc.ForkRequest,
    tenant_id: Tenant,
    caller: Annotated[Principal, Depends(principal)],
    gateway: Gateway,
) -> Response:
    """A new tenant from a kept version of yours (None: your current one, checkpointed now) with
    another learning_rate or seed: same schema, module and data, its own copy of the weights and
    optimizer state. Its first API key is in this answer (shown once). The fork inherits your quotas
    and counts against them (its owner is you, or your source's owner); 409 when the id is taken or
    being forked, 429 past max_forks_per_tenant."""
    return respond(request, gateway.fork(tenant_id, body, caller.key_id), 201)


@router.get("/forks", response_model=sc.ForkList)
def list_forks(request: Request, tenant_id: Tenant, gateway: Gateway) -> Response:
    """The forks you own (forks of your forks too): their spend and storage count against your quotas."""
    return respond(request, gateway.forks(tenant_id))


@router.delete("/forks/{fork_tenant_id}", response_model=s.TenantDeleted)
def delete_fork(request: Request, fork_tenant_id: TenantIdPath, tenant_id: Tenant, gateway: Gateway) -> Response:
    """Delete a fork you own with its checkpoints and registered model (its id is free again)."""
    report = gateway.delete_fork(tenant_id, fork_tenant_id)
    request.app.state.limiter.forget(fork_tenant_id)
    request.app.state.keys.forget_tenant(fork_tenant_id)
    removed = {k: str(v) for k, v in report.items() if k != "tenant_id"}
    return respond(request, s.TenantDeleted(tenant_id=fork_tenant_id, removed=removed))
