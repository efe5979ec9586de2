"""Lower-layer sampling and call futures (a tenant key; issue 28).

- `POST /v1/sample`, `POST /v1/compute_logprobs`: forward-only calls on the caller's training slot;
- `POST /v1/futures/{call}` (forward_backward, optim_step, predict, sample, compute_logprobs; the
  body of the blocking call): 202 with the future, queued behind the tenant's earlier calls;
- `GET /v1/futures/{future_id}?wait_s=`: 200 with the call's own answer once done, the call's own
  error if it failed, 202 with the future while it waits or runs (after up to `wait_s` seconds).

Every route runs through the caller's rate limits (`call_limited`); a sample costs its
observations x `n` samples of the samples/s bucket, a future what its blocking call costs.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from pydantic import BaseModel

from joynexus.api.middleware import WireRoute
from joynexus.api.routers.dependencies import ERRORS, Gateway, Tenant
from joynexus.api.routers.limited import batch_samples, call_limited, sampled_chunks, training_turn
from joynexus.api.routers.responses import respond
from joynexus.protocol import sampling_schemas as ss
from joynexus.protocol import schemas as s

router = APIRouter(prefix="/v1", route_class=WireRoute, tags=["lower layer"], responses=ERRORS)

FutureId = Annotated[str, Path(pattern=ss.FUTURE_ID_PATTERN, description="a future of your tenant")]


# -- sampling (blocking) ----------------------------------------------------------------------------
@router.post("/sample", response_model=ss.SampleResult)
async def sample(request: Request, body: ss.SampleRequest, tenant_id: Tenant, gateway: Gateway) -> Response:
    """`n` action chunks per observation from the current training policy, with log-probabilities.
    Sent to the Training Model Service in slices, each in the tenant's turn at the training gate."""
    turn = training_turn(request, tenant_id)
    return await call_limited(
        request, tenant_id, lambda: respond(request, gateway.sample(tenant_id, body, turn=turn)),
        samples=sampled_chunks(body),
    )  # fmt: skip


@router.post("/compute_logprobs", response_model=ss.ComputeLogprobsResult)
async def compute_logprobs(
    request: Request, body: ss.ComputeLogprobsRequest, tenant_id: Tenant, gateway: Gateway
) -> Response:
    """log pi(action | obs) under the current training policy; no gradient, no version change."""
    return await call_limited(
        request, tenant_id, lambda: respond(request, gateway.compute_logprobs(tenant_id, body)),
        samples=batch_samples(body), training=True,
    )  # fmt: skip


# -- futures ----------------------------------------------------------------------------------------
# A future pays the caller's buckets as its blocking call does, for the same samples, when it is
# submitted: queueing the work instead of waiting for it must not make it free.
async def _submit(
    request: Request, tenant_id: str, gateway: Gateway, kind: str, body: BaseModel | None, samples: int
) -> Response:
    def answer() -> Response:
        return respond(request, gateway.submit_call(tenant_id, kind, body), 202)

    return await call_limited(request, tenant_id, answer, samples=samples)


@router.post("/futures/forward_backward", response_model=ss.FutureInfo, status_code=202)
async def forward_backward_async(
    request: Request, body: s.ForwardBackwardRequest, tenant_id: Tenant, gateway: Gateway
) -> Response:
    return await _submit(request, tenant_id, gateway, "forward_backward", body, batch_samples(body))


@router.post("/futures/optim_step", response_model=ss.FutureInfo, status_code=202)
async def optim_step_async(
    request: Request, tenant_id: Tenant, gateway: Gateway, body: s.OptimStepRequest | None = None
) -> Response:
    """The blocking optim_step's body (this step's lr, betas, weight_decay, grad_clip), applied."""
    return await _submit(request, tenant_id, gateway, "optim_step", body, 0)


@router.post("/futures/predict", response_model=ss.FutureInfo, status_code=202)
async def predict_async(request: Request, body: s.PredictRequest, tenant_id: Tenant, gateway: Gateway) -> Response:
    return await _submit(request, tenant_id, gateway, "predict", body, batch_samples(body.observations))


@router.post("/futures/sample", response_model=ss.FutureInfo, status_code=202)
async def sample_async(request: Request, body: ss.SampleRequest, tenant_id: Tenant, gateway: Gateway) -> Response:
    return await _submit(request, tenant_id, gateway, "sample", body, sampled_chunks(body))


@router.post("/futures/compute_logprobs", response_model=ss.FutureInfo, status_code=202)
async def compute_logprobs_async(
    request: Request, body: ss.ComputeLogprobsRequest, tenant_id: Tenant, gateway: Gateway
) -> Response:
    return await _submit(request, tenant_id, gateway, "compute_logprobs", body, batch_samples(body))


@router.get("/futures/{future_id}", responses={202: {"model": ss.FutureInfo, "description": "not done yet"}})
async def collect(
    request: Request,
    future_id: FutureId,
    tenant_id: Tenant,
    gateway: Gateway,
    wait_s: Annotated[float, Query(ge=0, le=60, description="wait this long for the call to finish")] = 0.0,
) -> Response:
    """The call's own answer once it is done (the blocking call's model), else 202 with the future.
    A wait holds one of the tenant's own threads (within its in-flight bound), not a shared one."""

    def answer() -> Response:
        info, result = gateway.collect_call(tenant_id, future_id, wait_s)
        if result is None:
            return respond(request, info, 202)
        response = respond(request, result)
        response.headers["X-JoyNexus-Future-Kind"] = info.kind
        return response

    return await call_limited(request, tenant_id, answer)
