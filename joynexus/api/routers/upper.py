"""Upper-layer routes (a tenant key): declare work and read its results. The caller's tenant,
its workloads (submit, list, follow, cancel), policy versions and their exports, checkpoint
manifests, usage. The event stream of a workload is in `stream.py`."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response

from joynexus.api.gateway import tenant_info
from joynexus.api.middleware import WireRoute
from joynexus.api.routers.dependencies import ERRORS, Gateway, Tenant, Version, WorkloadId
from joynexus.api.routers.responses import payload_response, respond
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import SAFETENSORS_MEDIA_TYPE

router = APIRouter(prefix="/v1", route_class=WireRoute, tags=["upper layer"], responses=ERRORS)


@router.get("/tenant", response_model=s.TenantInfo)
def whoami(request: Request, tenant_id: Tenant, gateway: Gateway) -> Response:
    """The caller's tenant: its schema (shapes every tensor must have) and module."""
    return respond(request, tenant_info(gateway.tenant(tenant_id)))


@router.post("/workloads", response_model=s.WorkloadInfo, status_code=202)
def submit_workload(request: Request, body: s.WorkloadSubmit, tenant_id: Tenant, gateway: Gateway) -> Response:
    """Run the tenant's declared task (SFT today) for `jobs` training jobs. It waits in the
    admission queue (see `position`) while the tenant already runs one; 429 when a quota
    (spend cap, queued workloads) refuses it."""
    return respond(request, gateway.submit_workload(tenant_id, body), 202)


@router.get("/workloads", response_model=list[s.WorkloadInfo])
def list_workloads(request: Request, tenant_id: Tenant, gateway: Gateway) -> Response:
    return respond(request, gateway.list_workloads(tenant_id))


@router.get("/workloads/{workload_id}", response_model=s.WorkloadInfo)
def get_workload(request: Request, workload_id: WorkloadId, tenant_id: Tenant, gateway: Gateway) -> Response:
    return respond(request, gateway.workload(tenant_id, workload_id))


@router.post("/workloads/{workload_id}/cancel", response_model=s.WorkloadInfo)
def cancel_workload(request: Request, workload_id: WorkloadId, tenant_id: Tenant, gateway: Gateway) -> Response:
    return respond(request, gateway.cancel_workload(tenant_id, workload_id))


@router.get("/workloads/{workload_id}/events", response_model=s.WorkloadEvents)
def workload_events(
    request: Request,
    workload_id: WorkloadId,
    tenant_id: Tenant,
    gateway: Gateway,
    after: Annotated[int, Query(ge=0, le=2**62, description="only events with seq > after")] = 0,
) -> Response:
    return respond(request, gateway.workload_events(tenant_id, workload_id, after))


@router.get("/versions", response_model=s.Versions)
def versions(
    request: Request,
    tenant_id: Tenant,
    gateway: Gateway,
    after: Annotated[
        int | None,
        Query(ge=0, le=2**62, description="only checkpoints with version > after (omit: from the first)"),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="at most this many checkpoints")] = 100,
) -> Response:
    """The training slot's version, the served versions and one page of checkpointed versions
    (ascending); pass `next_after` back as `after` for the next page (None: that was the last)."""
    return respond(request, gateway.versions(tenant_id, after, limit))


@router.get(
    "/versions/{version}/export",
    response_model=s.ExportedParams,
    responses={200: {"content": {SAFETENSORS_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}},
)
def export_version(
    request: Request,
    version: Version,
    tenant_id: Tenant,
    gateway: Gateway,
    format: Annotated[Literal["safetensors", "json"], Query(description="raw bytes or JSON")] = "safetensors",
) -> Response:
    """A version's tenant payload (safetensors, manifest in its metadata; no backbone tensor):
    the current training version or a checkpointed one."""
    payload, manifest = gateway.export(tenant_id, version)
    return payload_response(request, payload, manifest, format)


@router.delete("/versions/{version}", response_model=s.VersionDeleted)
def delete_version(request: Request, version: Version, tenant_id: Tenant, gateway: Gateway) -> Response:
    """Delete one checkpointed version to free its storage (allowed at or over the storage quota);
    409 `version_in_use` for the latest checkpoint, a registered version or a served one."""
    return respond(request, gateway.delete_version(tenant_id, version))


@router.get("/checkpoints/{version}/manifest", response_model=s.Manifest)
def checkpoint_manifest(request: Request, version: Version, tenant_id: Tenant, gateway: Gateway) -> Response:
    return respond(request, gateway.checkpoint_manifest(tenant_id, version))


@router.get("/usage", response_model=s.Usage)
def usage(request: Request, tenant_id: Tenant, gateway: Gateway) -> Response:
    """Device-seconds (training, inference), samples, env steps, checkpoint bytes, quota, and the
    calls this server refused over the tenant's rate limits (`throttled`)."""
    throttled = request.app.state.limiter.throttled(tenant_id)
    return respond(request, gateway.usage(tenant_id).model_copy(update={"throttled": throttled}))
