"""State-control routes (a tenant key): roll the caller's training slot back to a kept version
(`load_state`), fork one of its versions into a new tenant (`fork`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from joynexus.api.auth import Principal
from joynexus.api.middleware import WireRoute
from joynexus.api.routers.dependencies import ERRORS, Gateway, Tenant, principal
from joynexus.api.routers.responses import respond
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
    optimizer state. Its first API key is in this answer (shown once)."""
    return respond(request, gateway.fork(tenant_id, body, caller.key_id), 201)
