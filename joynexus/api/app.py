"""The tenant API server (FastAPI): the Master Service and the execution services over HTTP.

Two layers, as in the paper (section 4.1, Fig. 4):
- upper: declare work — submit a workload of the tenant's task, follow it (JSON or Server-Sent
  Events), cancel it; list policy versions, export one, read a checkpoint manifest; usage;
- lower: the core primitives on the caller's own tenant — train_batch, forward_backward +
  optim_step, predict through the shared Inference Queue, environment sessions, Training Queue
  partitions, export_params, load_weights, save.

Every route but /v1/health (and /metrics, unless `ApiSettings.metrics_public` is off) needs
`Authorization: Bearer <key>`. A tenant key scopes every call to
its tenant; the admin key creates tenants, issues keys and sets quotas. Bodies are JSON, or
msgpack with `Content-Type: application/msgpack` (answers in msgpack with `Accept:
application/msgpack`). The OpenAPI document is at /openapi.json, the docs at /docs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, Header, Path, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from joynexus.api.auth import ApiKeyStore, Principal, admin_key_from_env
from joynexus.api.errors import ApiError, Forbidden, NotFound, Unauthenticated, install_exception_handlers
from joynexus.api.gateway import ApiGateway, ApiLimits, manifest_model, tenant_info
from joynexus.api.middleware import BodyLimitMiddleware, IdempotencyMiddleware, WireRoute
from joynexus.api.services import ApiServices
from joynexus.api.streaming import PolicyStream, StreamSettings, TenantCounter
from joynexus.core.heap import freeze_startup_heap
from joynexus.master.usage import UsageLedger
from joynexus.ops.metrics import MetricsEndpoint
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import MSGPACK_MEDIA_TYPE, SAFETENSORS_MEDIA_TYPE, msgpack_dumps, wants_msgpack
from joynexus.spec import WorkloadSpec

API_VERSION = s.API_VERSION
log = logging.getLogger("joynexus.api")


class ApiSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8765, ge=0, le=65535)
    max_body_bytes: int = Field(default=64 << 20, ge=1024)
    default_max_device_seconds: float | None = Field(default=None, ge=0)
    default_max_queued_workloads: int | None = Field(default=8, ge=0)
    default_max_storage_bytes: int | None = Field(default=None, ge=0)  # checkpoint bytes per tenant
    stream_poll_s: float = Field(default=0.25, gt=0)
    stream_heartbeat_s: float = Field(default=15.0, gt=0)
    # Open Server-Sent Event streams per tenant: each polls the Master, so one tenant's thousands
    # of idle streams must not crowd out everyone else's calls.
    max_streams_per_tenant: int = Field(default=8, ge=1)
    limits: ApiLimits = Field(default_factory=ApiLimits)
    policy_stream: StreamSettings = Field(default_factory=StreamSettings)  # /v1/stream (websocket)
    # GET /metrics (Prometheus text format). Public by default: Prometheus scrapes inside the cluster
    # without credentials, and the page holds aggregate numbers only (tenant ids, no keys, no data);
    # False: the admin key is needed (bearer_token in the scrape config).
    metrics_public: bool = True
    metrics_timeout_s: float = Field(default=3.0, gt=0, description="per-source limit of one scrape")


_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <API key>`")


def _respond(request: Request, model: BaseModel | list[BaseModel], status_code: int = 200) -> Response:
    """JSON, or msgpack when the client asks for it (tensor bytes stay raw there)."""
    if wants_msgpack(request.headers.get("accept")):
        data: Any = [m.model_dump() for m in model] if isinstance(model, list) else model.model_dump()
        return Response(msgpack_dumps(data), status_code=status_code, media_type=MSGPACK_MEDIA_TYPE)
    data = [m.model_dump(mode="json") for m in model] if isinstance(model, list) else model.model_dump(mode="json")
    return JSONResponse(data, status_code=status_code)


# -- auth: every route depends on one of these ---------------------------------------------------
def _principal(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    if credentials is None:
        raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
    found = request.app.state.keys.verify(credentials.credentials)
    if found is None:
        raise Unauthenticated("invalid or revoked API key")
    return found


def _tenant_scope(caller: Annotated[Principal, Depends(_principal)]) -> str:
    if caller.tenant_id is None:
        raise Forbidden("this endpoint acts on a tenant's own resources: call it with that tenant's API key")
    return caller.tenant_id


def _admin_only(caller: Annotated[Principal, Depends(_principal)]) -> Principal:
    if not caller.is_admin:
        raise Forbidden("this endpoint needs the admin key")
    return caller


Tenant = Annotated[str, Depends(_tenant_scope)]
Admin = Annotated[Principal, Depends(_admin_only)]
WorkloadId = Annotated[str, Path(max_length=64, description="a workload id of your tenant")]
Version = Annotated[int, Path(ge=0, le=2**31, description="a policy version of your tenant")]
PartitionName = Annotated[str, Path(pattern=s.PARTITION_NAME_PATTERN, description="a partition of your tenant")]
SessionId = Annotated[str, Path(pattern=s.SESSION_ID_PATTERN, description="an environment session of yours")]
TenantIdPath = Annotated[str, Path(max_length=64, description="a tenant id")]


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": s.ErrorBody, "description": text}
    for code, text in (
        (401, "missing or invalid API key"),
        (404, "no such resource in the caller's tenant (another tenant's id answers the same)"),
        (413, "request body over the size limit"),
        (422, "invalid input: each problem names the field and the reason"),
        (429, "a quota stops this: the message says which"),
    )
}
_ADMIN_ERRORS = {**_ERRORS, 403: {"model": s.ErrorBody, "description": "needs the admin key"}}


def create_app(
    services: ApiServices,
    settings: ApiSettings | None = None,
    *,
    admin_key: str | None = None,
) -> FastAPI:
    """The API over `services`. The admin key comes from `admin_key`, else the env
    JOYNEXUS_ADMIN_KEY; with neither and none stored, one is generated: it is in
    `app.state.generated_admin_key` (to print once) and only its hash is kept."""
    settings = settings or ApiSettings()
    keys = ApiKeyStore(services.store, admin_key or admin_key_from_env())
    ledger = UsageLedger(
        services.store,
        checkpoints=services.checkpoints,
        default_max_device_seconds=settings.default_max_device_seconds,
        default_max_queued_workloads=settings.default_max_queued_workloads,
        default_max_storage_bytes=settings.default_max_storage_bytes,
    )
    gateway = ApiGateway(services, keys, ledger, limits=settings.limits)
    event_streams = TenantCounter()  # open GET /v1/workloads/{id}/stream per tenant

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> Any:
        import anyio.to_thread

        # Predict calls block a worker thread while the Inference Queue batches them together.
        anyio.to_thread.current_default_thread_limiter().total_tokens = 128
        gateway.start()
        # The startup heap out of the cycle collector: a full collection over it would stall the
        # loop and every request for ~0.4 s (the policy stream's p99, issue 17). Once per process.
        freeze_startup_heap()
        try:
            yield
        finally:
            gateway.stop()

    app = FastAPI(
        title="JoyNexus tenant API",
        version=API_VERSION,
        description=__doc__,
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    app.state.event_streams = event_streams
    app.state.keys = keys
    app.state.settings = settings
    app.state.generated_admin_key = keys.ensure_admin_key()
    install_exception_handlers(app)
    metrics = MetricsEndpoint(services.cluster, timeout_s=settings.metrics_timeout_s)
    app.state.metrics = metrics

    @app.get(
        "/metrics",
        tags=["meta"],
        response_class=Response,
        dependencies=[] if settings.metrics_public else [Depends(_admin_only)],
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text exposition format"}},
    )
    def prometheus_metrics() -> Response:
        """Control, learning and system signals (joynexus.ops.metrics); sources that do not answer
        in time are left out and counted in joynexus_scrape_errors_total."""
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    app.add_middleware(IdempotencyMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)

    public = APIRouter(prefix="/v1", route_class=WireRoute)
    admin = APIRouter(prefix="/v1/admin", route_class=WireRoute, tags=["admin"], responses=_ADMIN_ERRORS)
    upper = APIRouter(prefix="/v1", route_class=WireRoute, tags=["upper layer"], responses=_ERRORS)
    lower = APIRouter(prefix="/v1", route_class=WireRoute, tags=["lower layer"], responses=_ERRORS)

    @public.get("/health", response_model=s.Health, tags=["meta"], responses={503: {"model": s.Health}})
    def health(request: Request) -> Response:
        """The truth per role (Master, its threads, every service): 200 when all are healthy, 503
        with the same body when one is down or restoring, or the Master does not answer."""
        report = gateway.health()
        return _respond(request, report, status_code=200 if report.status == "ok" else 503)

    # -- admin -----------------------------------------------------------------------------------
    @admin.post("/tenants", response_model=s.TenantCreated, status_code=201)
    def create_tenant(
        request: Request,
        spec: WorkloadSpec,
        _: Admin,
        issue_key: Annotated[bool, Query(description="also issue the tenant's first API key")] = True,
    ) -> Response:
        """Create a tenant from a workload spec (the tenant creator validates it against the
        backend) and, by default, issue its first API key (shown only in this answer)."""
        tenant = gateway.create_tenant(spec)
        key = keys.issue(tenant.tenant_id, label="first key") if issue_key else None
        return _respond(request, s.TenantCreated(tenant=tenant_info(tenant), key=key), 201)

    @admin.get("/tenants", response_model=list[s.TenantInfo])
    def list_tenants(request: Request, _: Admin) -> Response:
        return _respond(request, [tenant_info(t) for t in gateway.tenants()])

    @admin.post("/tenants/{tenant_id}/keys", response_model=s.IssuedKey, status_code=201)
    def issue_key(request: Request, tenant_id: TenantIdPath, body: s.IssueKeyRequest, _: Admin) -> Response:
        gateway.tenant(tenant_id)
        return _respond(request, keys.issue(tenant_id, label=body.label), 201)

    @admin.get("/tenants/{tenant_id}/keys", response_model=list[s.KeyInfo])
    def list_keys(request: Request, tenant_id: TenantIdPath, _: Admin) -> Response:
        gateway.tenant(tenant_id)
        return _respond(request, keys.list(tenant_id))

    @admin.delete("/keys/{key_id}", response_model=s.KeyInfo)
    def revoke_key(request: Request, key_id: Annotated[str, Path(max_length=32)], _: Admin) -> Response:
        revoked = keys.revoke(key_id)
        if revoked is None:
            raise NotFound("API key", key_id, "key_id")
        return _respond(request, revoked)

    @admin.delete("/tenants/{tenant_id}", response_model=s.TenantDeleted)
    def delete_tenant(
        request: Request,
        tenant_id: TenantIdPath,
        _: Admin,
        delete_artifacts: Annotated[
            bool, Query(description="also delete its checkpoints and registered model (irreversible)")
        ] = False,
    ) -> Response:
        """Delete a tenant: its workloads are cancelled and its jobs released; its keys, slots,
        serving versions, sessions, queue data, quota and usage rows go; with `delete_artifacts`
        its checkpoints and registered model too."""
        report = gateway.delete_tenant(tenant_id, delete_artifacts)
        return _respond(request, s.TenantDeleted(tenant_id=tenant_id, removed=_jsonable_report(report)))

    @admin.put("/tenants/{tenant_id}/quota", response_model=s.Quota)
    def set_quota(request: Request, tenant_id: TenantIdPath, body: s.QuotaUpdate, _: Admin) -> Response:
        gateway.tenant(tenant_id)
        return _respond(request, gateway.master.set_quota(tenant_id, body))

    @admin.get("/usage", response_model=list[s.Usage])
    def all_usage(request: Request, _: Admin) -> Response:
        return _respond(request, [gateway.usage(t.tenant_id) for t in gateway.tenants()])

    # -- upper layer -----------------------------------------------------------------------------
    @upper.get("/tenant", response_model=s.TenantInfo)
    def whoami(request: Request, tenant_id: Tenant) -> Response:
        """The caller's tenant: its schema (shapes every tensor must have) and module."""
        return _respond(request, tenant_info(gateway.tenant(tenant_id)))

    @upper.post("/workloads", response_model=s.WorkloadInfo, status_code=202)
    def submit_workload(request: Request, body: s.WorkloadSubmit, tenant_id: Tenant) -> Response:
        """Run the tenant's declared task (SFT today) for `jobs` training jobs. It waits in the
        admission queue (see `position`) while the tenant already runs one; 429 when a quota
        (spend cap, queued workloads) refuses it."""
        return _respond(request, gateway.submit_workload(tenant_id, body), 202)

    @upper.get("/workloads", response_model=list[s.WorkloadInfo])
    def list_workloads(request: Request, tenant_id: Tenant) -> Response:
        return _respond(request, gateway.list_workloads(tenant_id))

    @upper.get("/workloads/{workload_id}", response_model=s.WorkloadInfo)
    def get_workload(request: Request, workload_id: WorkloadId, tenant_id: Tenant) -> Response:
        return _respond(request, gateway.workload(tenant_id, workload_id))

    @upper.post("/workloads/{workload_id}/cancel", response_model=s.WorkloadInfo)
    def cancel_workload(request: Request, workload_id: WorkloadId, tenant_id: Tenant) -> Response:
        return _respond(request, gateway.cancel_workload(tenant_id, workload_id))

    @upper.get("/workloads/{workload_id}/events", response_model=s.WorkloadEvents)
    def workload_events(
        request: Request,
        workload_id: WorkloadId,
        tenant_id: Tenant,
        after: Annotated[int, Query(ge=0, le=2**62, description="only events with seq > after")] = 0,
    ) -> Response:
        return _respond(request, gateway.workload_events(tenant_id, workload_id, after))

    @upper.get(
        "/workloads/{workload_id}/stream",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events"}},
    )
    def stream_workload(
        request: Request,
        workload_id: WorkloadId,
        tenant_id: Tenant,
        after: Annotated[int, Query(ge=0, le=2**62)] = 0,
        last_event_id: Annotated[str | None, Header(max_length=32)] = None,
    ) -> StreamingResponse:
        """Progress and metric events as Server-Sent Events (`event: <kind>`, `id: <seq>`,
        `data: <json>`), ending with `event: end` carrying the final status. A tenant holds at
        most `max_streams_per_tenant` open streams (429 `too_many_streams` beyond)."""
        gateway.workload(tenant_id, workload_id)  # 404 before the stream starts
        if last_event_id is not None and last_event_id.isdigit():
            after = max(after, int(last_event_id))
        limit = settings.max_streams_per_tenant
        if not event_streams.acquire(tenant_id, limit):
            raise ApiError(
                f"your tenant already has {limit} open event streams (the limit is {limit} per tenant); "
                "close one, or poll GET /v1/workloads/{id}/events instead",
                [("max_streams_per_tenant", f"limit of {limit} open event streams per tenant reached")],
            ).with_status(429, "too_many_streams")
        slot = _StreamSlot(event_streams, tenant_id)
        return _EventStreamResponse(
            slot,
            _event_stream(request, gateway, settings, slot, workload_id, after),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @upper.get("/versions", response_model=s.Versions)
    def versions(
        request: Request,
        tenant_id: Tenant,
        after: Annotated[
            int | None,
            Query(ge=0, le=2**62, description="only checkpoints with version > after (omit: from the first)"),
        ] = None,
        limit: Annotated[int, Query(ge=1, le=1000, description="at most this many checkpoints")] = 100,
    ) -> Response:
        """The training slot's version, the served versions and one page of checkpointed versions
        (ascending); pass `next_after` back as `after` for the next page (None: that was the last)."""
        return _respond(request, gateway.versions(tenant_id, after, limit))

    @upper.get(
        "/versions/{version}/export",
        response_model=s.ExportedParams,
        responses={200: {"content": {SAFETENSORS_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}},
    )
    def export_version(
        request: Request,
        version: Version,
        tenant_id: Tenant,
        format: Annotated[Literal["safetensors", "json"], Query(description="raw bytes or JSON")] = "safetensors",
    ) -> Response:
        """A version's tenant payload (safetensors, manifest in its metadata; no backbone tensor):
        the current training version or a checkpointed one."""
        payload, manifest = gateway.export(tenant_id, version)
        return _payload_response(request, payload, manifest, format)

    @upper.get("/checkpoints/{version}/manifest", response_model=s.Manifest)
    def checkpoint_manifest(request: Request, version: Version, tenant_id: Tenant) -> Response:
        return _respond(request, gateway.checkpoint_manifest(tenant_id, version))

    @upper.get("/usage", response_model=s.Usage)
    def usage(request: Request, tenant_id: Tenant) -> Response:
        """Device-seconds (training, inference), samples, env steps, checkpoint bytes, quota."""
        return _respond(request, gateway.usage(tenant_id))

    # -- lower layer: training -------------------------------------------------------------------
    @lower.post("/train_batch", response_model=s.TrainStepResult)
    def train_batch(request: Request, body: s.SampleBatch, tenant_id: Tenant) -> Response:
        """One optimizer step on the caller's slot from these samples."""
        return _respond(request, gateway.train_batch(tenant_id, body))

    @lower.post("/forward_backward", response_model=s.ForwardBackwardResult)
    def forward_backward(request: Request, body: s.ForwardBackwardRequest, tenant_id: Tenant) -> Response:
        """Loss and gradients, summed into the slot's pending gradients; no step, no new version."""
        return _respond(request, gateway.forward_backward(tenant_id, body))

    @lower.post("/optim_step", response_model=s.OptimStepResult)
    def optim_step(request: Request, tenant_id: Tenant) -> Response:
        """Apply the pending gradients (clip, AdamW), zero them, bump the version."""
        return _respond(request, gateway.optim_step(tenant_id))

    @lower.post("/params/export", response_model=s.ExportedParams)
    def export_params(request: Request, tenant_id: Tenant) -> Response:
        """The current training parameters as a tenant payload (export_params)."""
        payload, manifest = gateway.export(tenant_id, None)
        return _payload_response(request, payload, manifest, "json")

    @lower.post("/weights/load", response_model=s.LoadWeightsResult)
    def load_weights(request: Request, body: s.LoadWeightsRequest, tenant_id: Tenant) -> Response:
        """Install serving weights in the Inference Model Service (load_weights)."""
        return _respond(request, gateway.load_weights(tenant_id, body))

    @lower.post("/save", response_model=s.Manifest)
    def save(request: Request, body: s.SaveRequest, tenant_id: Tenant) -> Response:
        """Checkpoint the training slot (parameters, optionally optimizer state)."""
        return _respond(request, gateway.save(tenant_id, body.include_optim))

    # -- lower layer: inference ------------------------------------------------------------------
    @lower.post("/predict", response_model=s.PredictResult)
    def predict(request: Request, body: s.PredictRequest, tenant_id: Tenant) -> Response:
        """Actions through the shared Inference Queue, batched with other tenants' requests."""
        return _respond(request, gateway.predict(tenant_id, body))

    # -- lower layer: Training Queue -------------------------------------------------------------
    @lower.get("/queue/partitions", response_model=list[s.PartitionInfo])
    def list_partitions(request: Request, tenant_id: Tenant) -> Response:
        return _respond(request, gateway.queue_list(tenant_id))

    @lower.post("/queue/partitions/{partition}", response_model=s.PartitionInfo)
    def queue_put(request: Request, partition: PartitionName, body: s.QueuePut, tenant_id: Tenant) -> Response:
        """Append samples (or, with `indices`, write derived fields back at those rows)."""
        return _respond(request, gateway.queue_put(tenant_id, partition, body))

    @lower.get("/queue/partitions/{partition}", response_model=s.PartitionInfo)
    def describe_partition(request: Request, partition: PartitionName, tenant_id: Tenant) -> Response:
        return _respond(request, gateway.queue_describe(tenant_id, partition))

    @lower.post("/queue/partitions/{partition}/get", response_model=s.QueueBatch)
    def queue_get(request: Request, partition: PartitionName, body: s.QueueGet, tenant_id: Tenant) -> Response:
        """The next unconsumed samples for `task_name` (get_meta + get_data)."""
        return _respond(request, gateway.queue_get(tenant_id, partition, body))

    @lower.delete("/queue/partitions/{partition}", response_model=s.Cleared)
    def queue_clear(request: Request, partition: PartitionName, tenant_id: Tenant) -> Response:
        return _respond(request, gateway.queue_clear(tenant_id, partition))

    # -- lower layer: environment sessions -------------------------------------------------------
    @lower.post("/env/sessions", response_model=s.SessionInfo, status_code=201)
    def open_session(request: Request, body: s.SessionOpen, tenant_id: Tenant) -> Response:
        return _respond(request, gateway.open_session(tenant_id, body), 201)

    @lower.get("/env/sessions", response_model=s.SessionList)
    def list_sessions(request: Request, tenant_id: Tenant) -> Response:
        return _respond(request, gateway.sessions(tenant_id))

    @lower.post("/env/sessions/{session_id}/reset", response_model=s.EnvResult)
    def reset_session(request: Request, session_id: SessionId, body: s.EnvReset, tenant_id: Tenant) -> Response:
        return _respond(request, gateway.reset_session(tenant_id, session_id, body))

    @lower.post("/env/sessions/{session_id}/step", response_model=s.EnvResult)
    def step_session(request: Request, session_id: SessionId, body: s.EnvStep, tenant_id: Tenant) -> Response:
        return _respond(request, gateway.step_session(tenant_id, session_id, body))

    @lower.delete("/env/sessions/{session_id}", response_model=s.Cleared)
    def close_session(request: Request, session_id: SessionId, tenant_id: Tenant) -> Response:
        return _respond(request, gateway.close_session(tenant_id, session_id))

    for router in (public, admin, upper, lower):
        app.include_router(router)
    app.include_router(PolicyStream(gateway, keys, settings.policy_stream).router())  # robots: /v1/stream
    return app


def _payload_response(request: Request, payload: bytes, manifest: Any, format: str) -> Response:
    if format == "json" or wants_msgpack(request.headers.get("accept")):
        exported = s.ExportedParams(version=manifest.policy_version, manifest=manifest_model(manifest), payload=payload)
        return _respond(request, exported)
    filename = f"{manifest.tenant_id}-v{manifest.policy_version}.safetensors"
    return Response(
        payload,
        media_type=SAFETENSORS_MEDIA_TYPE,
        headers={
            "X-JoyNexus-Version": str(manifest.policy_version),
            "X-JoyNexus-Manifest-Digest": manifest.digest,
            "Content-Disposition": f'attachment; filename="{filename}"',
        },
    )


def _jsonable_report(report: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in report.items() if k != "tenant_id"}


class _StreamSlot:
    """One tenant's hold on an event-stream slot; `release` is idempotent (it is called both by
    the generator's finally and by the response, whichever ends first)."""

    def __init__(self, counter: TenantCounter, tenant_id: str):
        self.counter, self.tenant_id, self._held = counter, tenant_id, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.counter.release(self.tenant_id)


class _EventStreamResponse(StreamingResponse):
    """A StreamingResponse that gives its tenant's stream slot back however it ends: finished,
    client gone, cancelled, or never iterated at all (a generator that never started runs no finally)."""

    def __init__(self, slot: _StreamSlot, content: AsyncIterator[str], **kwargs: Any):
        super().__init__(content, **kwargs)
        self.slot = slot

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slot.release()


async def _event_stream(
    request: Request, gateway: ApiGateway, settings: ApiSettings, slot: _StreamSlot, workload_id: str, after: int
) -> AsyncIterator[str]:
    """Polls the Master for new events. Async on purpose: between polls the stream holds no
    worker thread (a sleeping sync generator pinned one each, so one tenant's open streams could
    exhaust the threadpool every tenant's calls run in); each poll borrows a thread only for the
    short blocking call."""
    tenant_id = slot.tenant_id
    try:
        last_sent = time.monotonic()
        while True:
            try:
                batch = await anyio.to_thread.run_sync(gateway.workload_events, tenant_id, workload_id, after)
            except ApiError as error:
                yield f"event: error\ndata: {error.body().model_dump_json()}\n\n"
                return
            for event in batch.events:
                after = event.seq
                yield f"id: {event.seq}\nevent: {event.kind}\ndata: {event.model_dump_json()}\n\n"
                last_sent = time.monotonic()
            if batch.workload.done:
                yield f"event: end\ndata: {batch.workload.model_dump_json()}\n\n"
                return
            if time.monotonic() - last_sent >= settings.stream_heartbeat_s:
                yield ": keep-alive\n\n"
                last_sent = time.monotonic()
            # A silent stream sends nothing a closed socket would fail on: look for the disconnect.
            if await request.is_disconnected():
                return
            await asyncio.sleep(settings.stream_poll_s)
    finally:
        slot.release()


__all__ = ["ApiSettings", "create_app"]
