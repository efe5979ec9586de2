"""Lower-layer routes (a tenant key): the core primitives on the caller's own tenant. Training
(train_batch, forward_backward + optim_step, export_params, save), serving weights (load_weights),
predict through the shared Inference Queue, Training Queue partitions, environment sessions.

Every route runs its work through the caller tenant's rate limits and own worker threads
(`call_limited`): 429 `rate_limited` / `too_many_in_flight` with Retry-After beyond them."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from joynexus.api.abandoned import answered_unless_hung_up, new_request_key
from joynexus.api.middleware import WireRoute
from joynexus.api.routers.dependencies import ERRORS, Gateway, PartitionName, SessionId, Tenant
from joynexus.api.routers.limited import batch_samples, call_limited, column_rows, rows
from joynexus.api.routers.responses import payload_response, respond
from joynexus.protocol import schemas as s

router = APIRouter(prefix="/v1", route_class=WireRoute, tags=["lower layer"], responses=ERRORS)


# -- training -------------------------------------------------------------------------------------
@router.post("/train_batch", response_model=s.TrainStepResult)
async def train_batch(request: Request, body: s.SampleBatch, tenant_id: Tenant, gateway: Gateway) -> Response:
    """One optimizer step on the caller's slot from these samples."""
    return await call_limited(
        request,
        tenant_id,
        lambda: respond(request, gateway.train_batch(tenant_id, body)),
        samples=batch_samples(body),
        training=True,
    )


@router.post("/forward_backward", response_model=s.ForwardBackwardResult)
async def forward_backward(
    request: Request, body: s.ForwardBackwardRequest, tenant_id: Tenant, gateway: Gateway
) -> Response:
    """Loss and gradients, summed into the slot's pending gradients; no step, no new version."""
    return await call_limited(
        request,
        tenant_id,
        lambda: respond(request, gateway.forward_backward(tenant_id, body)),
        samples=batch_samples(body),
        training=True,
    )


@router.post("/optim_step", response_model=s.OptimStepResult)
async def optim_step(
    request: Request, tenant_id: Tenant, gateway: Gateway, body: s.OptimStepRequest | None = None
) -> Response:
    """Apply the pending gradients (clip, AdamW), zero them, bump the version; the body (optional)
    sets this step's lr, betas, weight_decay, grad_clip."""
    return await call_limited(
        request, tenant_id, lambda: respond(request, gateway.optim_step(tenant_id, body)), training=True
    )


@router.post("/params/export", response_model=s.ExportedParams)
async def export_params(request: Request, tenant_id: Tenant, gateway: Gateway) -> Response:
    """The current training parameters as a tenant payload (export_params)."""

    def answer() -> Response:
        payload, manifest = gateway.export(tenant_id, None)
        return payload_response(request, payload, manifest, "json")

    return await call_limited(request, tenant_id, answer, training=True)


@router.post("/weights/load", response_model=s.LoadWeightsResult)
async def load_weights(request: Request, body: s.LoadWeightsRequest, tenant_id: Tenant, gateway: Gateway) -> Response:
    """Install serving weights in the Inference Model Service (load_weights)."""
    return await call_limited(request, tenant_id, lambda: respond(request, gateway.load_weights(tenant_id, body)))


@router.post("/save", response_model=s.Manifest)
async def save(request: Request, body: s.SaveRequest, tenant_id: Tenant, gateway: Gateway) -> Response:
    """Checkpoint the training slot (parameters, optionally optimizer state)."""
    return await call_limited(
        request, tenant_id, lambda: respond(request, gateway.save(tenant_id, body.include_optim)), training=True
    )


# -- inference ------------------------------------------------------------------------------------
@router.post("/predict", response_model=s.PredictResult)
async def predict(request: Request, body: s.PredictRequest, tenant_id: Tenant, gateway: Gateway) -> Response:
    """Actions through the shared Inference Queue, batched with other tenants' requests. A client
    that hangs up meanwhile has its request called off in the service at once (not at `timeout_s`)."""
    request_key = new_request_key()
    call = call_limited(
        request,
        tenant_id,
        lambda: respond(request, gateway.predict(tenant_id, body, request_key)),
        samples=batch_samples(body.observations),
    )
    return await answered_unless_hung_up(request, call, lambda: gateway.cancel_predict(tenant_id, request_key))


# -- Training Queue -------------------------------------------------------------------------------
@router.get("/queue/partitions", response_model=list[s.PartitionInfo])
async def list_partitions(request: Request, tenant_id: Tenant, gateway: Gateway) -> Response:
    return await call_limited(request, tenant_id, lambda: respond(request, gateway.queue_list(tenant_id)))


@router.post("/queue/partitions/{partition}", response_model=s.PartitionInfo)
async def queue_put(
    request: Request, partition: PartitionName, body: s.QueuePut, tenant_id: Tenant, gateway: Gateway
) -> Response:
    """Append samples (or, with `indices`, write derived fields back at those rows)."""
    return await call_limited(
        request,
        tenant_id,
        lambda: respond(request, gateway.queue_put(tenant_id, partition, body)),
        samples=column_rows(body),
    )


@router.get("/queue/partitions/{partition}", response_model=s.PartitionInfo)
async def describe_partition(
    request: Request, partition: PartitionName, tenant_id: Tenant, gateway: Gateway
) -> Response:
    return await call_limited(
        request, tenant_id, lambda: respond(request, gateway.queue_describe(tenant_id, partition))
    )


@router.post("/queue/partitions/{partition}/get", response_model=s.QueueBatch)
async def queue_get(
    request: Request, partition: PartitionName, body: s.QueueGet, tenant_id: Tenant, gateway: Gateway
) -> Response:
    """The next unconsumed samples for `task_name` (get_meta + get_data)."""
    return await call_limited(
        request, tenant_id, lambda: respond(request, gateway.queue_get(tenant_id, partition, body))
    )


@router.delete("/queue/partitions/{partition}", response_model=s.Cleared)
async def queue_clear(request: Request, partition: PartitionName, tenant_id: Tenant, gateway: Gateway) -> Response:
    return await call_limited(request, tenant_id, lambda: respond(request, gateway.queue_clear(tenant_id, partition)))


# -- environment sessions -------------------------------------------------------------------------
@router.post("/env/sessions", response_model=s.SessionInfo, status_code=201)
async def open_session(request: Request, body: s.SessionOpen, tenant_id: Tenant, gateway: Gateway) -> Response:
    return await call_limited(request, tenant_id, lambda: respond(request, gateway.open_session(tenant_id, body), 201))


@router.get("/env/sessions", response_model=s.SessionList)
async def list_sessions(request: Request, tenant_id: Tenant, gateway: Gateway) -> Response:
    return await call_limited(request, tenant_id, lambda: respond(request, gateway.sessions(tenant_id)))


@router.post("/env/sessions/{session_id}/reset", response_model=s.EnvResult)
async def reset_session(
    request: Request, session_id: SessionId, body: s.EnvReset, tenant_id: Tenant, gateway: Gateway
) -> Response:
    return await call_limited(
        request, tenant_id, lambda: respond(request, gateway.reset_session(tenant_id, session_id, body))
    )


@router.post("/env/sessions/{session_id}/step", response_model=s.EnvResult)
async def step_session(
    request: Request, session_id: SessionId, body: s.EnvStep, tenant_id: Tenant, gateway: Gateway
) -> Response:
    return await call_limited(
        request,
        tenant_id,
        lambda: respond(request, gateway.step_session(tenant_id, session_id, body)),
        samples=rows(body.action),
    )


@router.delete("/env/sessions/{session_id}", response_model=s.Cleared)
async def close_session(request: Request, session_id: SessionId, tenant_id: Tenant, gateway: Gateway) -> Response:
    return await call_limited(
        request, tenant_id, lambda: respond(request, gateway.close_session(tenant_id, session_id))
    )
