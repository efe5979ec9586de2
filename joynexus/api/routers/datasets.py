"""``/v1/datasets``: a tenant uploads a LeRobot dataset (tar or zip body, at most the API's body
limit) and lists its own (`joynexus.data.uploads`). An upload is validated with Great Expectations
against the tenant's observation interface before it is kept, and its unpacked bytes count
against the tenant's storage quota together with its checkpoints."""

from __future__ import annotations

import shutil
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from joynexus.api.errors import InvalidInput, QuotaExceeded
from joynexus.api.routers.dependencies import ERRORS, Gateway, Tenant
from joynexus.data.uploads import DatasetUploadError, store_uploaded_dataset, tenant_datasets
from joynexus.data.validation import DatasetExpectation

router = APIRouter(prefix="/v1", tags=["upper layer"], responses=ERRORS)

REPO_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$"


def _datasets_dir(gateway: Gateway):
    return gateway.cluster.settings.data_dir / "datasets"


@router.post("/datasets", status_code=201)
async def upload_dataset(
    request: Request,
    tenant_id: Tenant,
    gateway: Gateway,
    repo_id: Annotated[str, Query(pattern=REPO_ID_PATTERN, description="the dataset's LeRobot repo id")],
) -> JSONResponse:
    """Upload a LeRobot dataset (tar, tar.gz or zip body). 201 with its id (the archive's sha256)."""
    data = await request.body()
    if not data:
        raise InvalidInput("body", "empty: send the dataset archive (tar or zip)")
    obs = gateway.tenant(tenant_id).spec.observation
    expectation = DatasetExpectation(
        cameras=tuple(obs.cameras), image_size=tuple(obs.image_size), state_dim=obs.state_dim, action_dim=obs.action_dim
    )
    datasets = _datasets_dir(gateway)
    known = {d.sha256 for d in tenant_datasets(datasets, tenant_id)}
    limit = request.app.state.settings.max_dataset_unpacked_bytes
    try:
        stored = await run_in_threadpool(  # unpacking and validation are blocking work
            store_uploaded_dataset,
            data, tenant_id=tenant_id, repo_id=repo_id, datasets_dir=datasets, expectation=expectation,
            max_unpacked_bytes=limit,
        )  # fmt: skip
    except DatasetUploadError as error:
        raise InvalidInput(error.field, error.reason) from None
    allowed = gateway.ledger.max_storage_bytes(tenant_id)
    if allowed is not None and stored.sha256 not in known:
        used = gateway.ledger.storage_bytes(tenant_id) + sum(d.nbytes for d in tenant_datasets(datasets, tenant_id))
        if used > allowed:
            shutil.rmtree(stored.root, ignore_errors=True)
            reason = f"checkpoints and datasets would take {used:,} of {allowed:,} bytes"
            raise QuotaExceeded(f"dataset refused: {reason}", [("quota.max_storage_bytes", reason)])
    return JSONResponse({"dataset_id": stored.sha256, "repo_id": repo_id, "bytes": stored.nbytes}, status_code=201)


@router.get("/datasets")
def list_datasets(tenant_id: Tenant, gateway: Gateway) -> JSONResponse:
    """The caller's uploaded datasets (never another tenant's)."""
    found = tenant_datasets(_datasets_dir(gateway), tenant_id)
    return JSONResponse([{"dataset_id": d.sha256, "bytes": d.nbytes} for d in found])
