"""Foreign weights and evaluation declarations (issue 24.5): a tenant installs weights trained
elsewhere for itself, the admin for any tenant; the admin declares an evaluation of target tenants
and versions and reads its comparison table (a target tenant reads its own rows)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request, Response

from joynexus.api.auth import Principal
from joynexus.api.middleware import WireRoute
from joynexus.api.routers.dependencies import ADMIN_ERRORS, ERRORS, Admin, Gateway, Tenant, TenantIdPath, principal
from joynexus.api.routers.responses import respond
from joynexus.protocol import schemas as s

router = APIRouter(prefix="/v1", route_class=WireRoute, tags=["foreign weights, evaluations"], responses=ERRORS)


@router.post("/weights/install", response_model=s.InstalledWeights, status_code=201)
def install_weights(request: Request, body: s.InstallWeightsRequest, tenant_id: Tenant, gateway: Gateway) -> Response:
    """Install weights trained elsewhere as your tenant's next policy version: each tensor is
    checked (name, shape, float dtype, finite) against your action module, then checkpointed,
    served and registered in MLflow with tags `source` and `sha256`."""
    return respond(request, gateway.install_weights(tenant_id, body, "tenant"), 201)


@router.post(
    "/admin/tenants/{tenant_id}/weights/install",
    response_model=s.InstalledWeights,
    status_code=201,
    responses=ADMIN_ERRORS,
)
def admin_install_weights(
    request: Request, tenant_id: TenantIdPath, body: s.InstallWeightsRequest, _: Admin, gateway: Gateway
) -> Response:
    """The admin's variant of POST /v1/weights/install, for any tenant."""
    return respond(request, gateway.install_weights(tenant_id, body, "admin"), 201)


@router.post("/admin/evaluations", response_model=s.EvaluationDeclaration, status_code=202, responses=ADMIN_ERRORS)
def declare_evaluation(request: Request, body: s.EvaluationDeclare, _: Admin, gateway: Gateway) -> Response:
    """An evaluation declaration (paper 4.2): evaluate each target tenant at its version (resolved
    once) on its simulator; GET /v1/evaluations/{id} shows the comparison table when done."""
    return respond(request, gateway.declare_evaluation(body), 202)


@router.get("/evaluations/{declaration_id}", response_model=s.EvaluationDeclaration)
def get_evaluation(
    request: Request,
    declaration_id: Annotated[str, Path(max_length=64)],
    caller: Annotated[Principal, Depends(principal)],
    gateway: Gateway,
) -> Response:
    """A declaration's state and comparison table (the admin: whole; a target tenant: its rows)."""
    return respond(request, gateway.evaluation(declaration_id, None if caller.is_admin else caller.tenant_id))
