"""``/v1/datasets``: a tenant uploads a LeRobot dataset (tar or zip body, at most the API's body
limit), lists and deletes its own (`joynexus.data.uploads`). An upload is validated with Great
Expectations against the tenant's observation interface before it is kept, and its unpacked bytes
count against the tenant's storage quota together with its checkpoints (the usage ledger's
`storage_bytes`; `dataset_bytes` is their share). A workload trains on one by naming it in its
spec: ``dataset: {id: <dataset_id>, repo_id: ...}``. With a bucket configured an upload is also kept
under the tenant's prefix of the artifact store (`joynexus.data.shared_uploads`), so every API replica
lists and deletes it and the Master finds it wherever it runs."""

from __future__ import annotations

import hashlib
import threading
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from joynexus.api.abandoned import answered_unless_hung_up
from joynexus.api.errors import Conflict, InvalidInput, NotFound, QuotaExceeded
from joynexus.api.routers.dependencies import ERRORS, Gateway, Tenant
from joynexus.data.shared_uploads import (
    delete_shared_upload,
    publish_upload,
    shared_upload_records,
    upload_store,
)
from joynexus.data.uploads import (
    DATASET_ID_PATTERN,
    ArchiveTooLarge,
    DatasetUploadError,
    UnpackLimits,
    delete_tenant_dataset,
    find_tenant_dataset,
    store_uploaded_dataset,
    tenant_datasets,
)
from joynexus.protocol import schemas as s

router = APIRouter(prefix="/v1", tags=["upper layer"], responses=ERRORS)

REPO_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$"
ACTIVE_STATES = ("queued", "running")


def _datasets_dir(gateway: Gateway):
    return gateway.cluster.settings.data_dir / "datasets"


def _shared(gateway: Gateway):
    return upload_store(gateway.cluster.settings)


def _described(dataset) -> dict:
    return {"dataset_id": dataset.sha256, "repo_id": dataset.repo_id or None, "bytes": dataset.nbytes}


@router.post("/datasets", status_code=201, response_model=s.DatasetInfo)
async def upload_dataset(
    request: Request,
    tenant_id: Tenant,
    gateway: Gateway,
    repo_id: Annotated[str, Query(pattern=REPO_ID_PATTERN, description="the dataset's LeRobot repo id")],
) -> Response:
    """Upload a LeRobot dataset (tar, tar.gz or zip body). 201 with its id (the archive's sha256).
    The archive is unpacked in a child process within the server's bounds (bytes, files, ratio,
    the tenant's upload quota); a client that hangs up stops the work (answered 499, nothing kept)."""
    data = await request.body()
    if not data:
        raise InvalidInput("body", "empty: send the dataset archive (tar or zip)")
    cancelled = threading.Event()
    return await answered_unless_hung_up(
        request, _stored(request, tenant_id, gateway, repo_id, data, cancelled), cancelled.set
    )


async def _stored(
    request: Request, tenant_id: str, gateway: Gateway, repo_id: str, data: bytes, cancelled: threading.Event
) -> JSONResponse:
    from joynexus.data.validation import DatasetExpectation  # pandas, Great Expectations: not at start

    obs = gateway.tenant(tenant_id).spec.observation
    expectation = DatasetExpectation(
        cameras=tuple(obs.cameras), image_size=tuple(obs.image_size), state_dim=obs.state_dim, action_dim=obs.action_dim
    )
    settings = request.app.state.settings
    datasets = _datasets_dir(gateway)
    store = _shared(gateway)
    kept = {d.sha256: d.nbytes for d in tenant_datasets(datasets, tenant_id)}
    if store is not None:
        shared = await run_in_threadpool(shared_upload_records, store, tenant_id)
        kept |= {k: int(r["bytes"]) for k, r in shared.items() if k not in kept}
    new = (await run_in_threadpool(hashlib.sha256, data)).hexdigest() not in kept  # 64 MiB: off the event loop
    quota = settings.max_dataset_bytes_per_tenant
    room = quota - sum(kept.values()) if quota is not None and new else None
    if room is not None and room <= 0:
        raise _over_upload_quota(sum(kept.values()), quota)
    limits = UnpackLimits(
        max_bytes=max(1, min(settings.max_dataset_unpacked_bytes, room if room is not None else 1 << 62)),
        max_files=settings.max_dataset_files,
        max_ratio=settings.max_dataset_compression_ratio,
    )
    try:
        stored = await run_in_threadpool(  # validation is blocking work; the unpacking is a child process's
            store_uploaded_dataset,
            data, tenant_id=tenant_id, repo_id=repo_id, datasets_dir=datasets, expectation=expectation,
            limits=limits, cancelled=cancelled,
        )  # fmt: skip
    except ArchiveTooLarge as error:
        if room is not None and room < settings.max_dataset_unpacked_bytes:  # the quota was the bound
            raise _over_upload_quota(sum(kept.values()), quota) from None
        raise InvalidInput(error.field, error.reason) from None
    except DatasetUploadError as error:
        raise InvalidInput(error.field, error.reason) from None
    if stored.sha256 not in kept:
        local = {d.sha256: d.nbytes for d in tenant_datasets(datasets, tenant_id)}  # this one, and racing ones
        uploads = sum(local.values()) + sum(n for k, n in kept.items() if k not in local)
        allowed = gateway.ledger.max_storage_bytes(tenant_id)
        used = gateway.ledger.storage_bytes(tenant_id)  # checkpoints and uploads, this one included
        if (quota is not None and uploads > quota) or (allowed is not None and used > allowed):
            delete_tenant_dataset(datasets, tenant_id, stored.sha256)
            if quota is not None and uploads > quota:
                raise _over_upload_quota(uploads - stored.nbytes, quota)
            reason = f"checkpoints and datasets would take {used:,} of {allowed:,} bytes"
            raise QuotaExceeded(f"dataset refused: {reason}", [("quota.max_storage_bytes", reason)])
    if store is not None:  # shared before it is answered: a workload naming it may run anywhere
        await run_in_threadpool(publish_upload, store, tenant_id, stored)
    return JSONResponse(_described(stored), status_code=201)


def _over_upload_quota(used: int, quota: int) -> QuotaExceeded:
    reason = f"your uploads take {used:,} bytes; the bound of one tenant's uploads is {quota:,} bytes"
    return QuotaExceeded(
        f"dataset refused: {reason} (delete an upload to make room)", [("max_dataset_bytes_per_tenant", reason)]
    )


@router.get("/datasets", response_model=list[s.DatasetInfo])
def list_datasets(tenant_id: Tenant, gateway: Gateway) -> JSONResponse:
    """The caller's uploaded datasets (never another tenant's), made through any API replica."""
    listed = {d.sha256: _described(d) for d in tenant_datasets(_datasets_dir(gateway), tenant_id)}
    store = _shared(gateway)
    if store is not None:
        for dataset_id, record in shared_upload_records(store, tenant_id).items():
            listed.setdefault(
                dataset_id,
                {"dataset_id": dataset_id, "repo_id": record.get("repo_id") or None, "bytes": record["bytes"]},
            )
    return JSONResponse([listed[k] for k in sorted(listed)])


@router.delete("/datasets/{dataset_id}", response_model=s.DatasetDeleted)
def delete_dataset(
    tenant_id: Tenant,
    gateway: Gateway,
    dataset_id: Annotated[str, Path(pattern=DATASET_ID_PATTERN, description="as POST /v1/datasets returned it")],
) -> JSONResponse:
    """Delete one of the caller's uploads and give its bytes back to the storage quota. 404 for an
    id the caller never uploaded (another tenant's too); 409 while a queued or running workload,
    or the tenant's own spec, trains on it. Versions trained on it keep its digest."""
    datasets = _datasets_dir(gateway)
    store = _shared(gateway)
    shared = shared_upload_records(store, tenant_id).get(dataset_id) if store is not None else None
    if find_tenant_dataset(datasets, tenant_id, dataset_id) is None and shared is None:
        raise NotFound("dataset", dataset_id, "dataset_id")
    own = gateway.tenant(tenant_id).spec.dataset
    workloads = gateway.list_workloads(tenant_id)
    users = [w.workload_id for w in workloads if w.state in ACTIVE_STATES and w.dataset_id == dataset_id]
    if users or (own is not None and own.id == dataset_id):
        reason = f"workloads {users} train on it" if users else "your tenant's spec trains on it"
        raise Conflict(f"dataset {dataset_id} is in use: {reason}", [("dataset_id", reason)])
    deleted = delete_tenant_dataset(datasets, tenant_id, dataset_id)
    removed_shared = store is not None and delete_shared_upload(store, tenant_id, dataset_id)
    if deleted is None and not removed_shared:  # deleted meanwhile by another request
        raise NotFound("dataset", dataset_id, "dataset_id")
    if deleted is not None:
        described = _described(deleted)
    else:  # another replica's upload, never fetched here
        assert shared is not None
        described = {"dataset_id": dataset_id, "repo_id": shared.get("repo_id") or None, "bytes": shared["bytes"]}
    body = {**described, "deleted": True, "storage_bytes": gateway.ledger.storage_bytes(tenant_id)}
    return JSONResponse(body)
