"""The tenant API server (FastAPI): the Master Service and the execution services over HTTP.

Two layers, as in the paper (section 4.1, Fig. 4):
- upper: declare work — submit a workload of the tenant's task, follow it (JSON or Server-Sent
  Events), cancel it; list policy versions, export one, read a checkpoint manifest; usage;
- lower: the core primitives on the caller's own tenant — train_batch, forward_backward +
  optim_step, predict through the shared Inference Queue, environment sessions, Training Queue
  partitions, export_params, load_weights, save.

Every route but /v1/health needs `Authorization: Bearer <key>`; /metrics the admin (operator)
key (unless `ApiSettings.metrics_public`). A tenant key scopes every call to
its tenant; the admin key creates tenants, issues keys and sets quotas. Bodies are JSON, or
msgpack with `Content-Type: application/msgpack` (answers in msgpack with `Accept:
application/msgpack`). The OpenAPI document is at /openapi.json, the docs at /docs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI

from joynexus.api.auth import ApiKeyStore, admin_key_from_env
from joynexus.api.errors import install_exception_handlers
from joynexus.api.gateway import ApiGateway
from joynexus.api.middleware import BodyLimitMiddleware, IdempotencyMiddleware
from joynexus.api.openpi import OpenPiStream
from joynexus.api.priority_gate import PriorityGate
from joynexus.api.rate_limits import TenantCallLimiter
from joynexus.api.routers import (
    admin,
    base_model,
    datasets,
    foreign,
    futures,
    lower,
    meta,
    state_control,
    stream,
    upper,
)
from joynexus.api.settings import ApiSettings
from joynexus.api.streaming import PolicyStream, TenantCounter
from joynexus.connect import Cluster
from joynexus.core.heap import freeze_startup_heap
from joynexus.master.usage import UsageLedger
from joynexus.ops.metrics import MetricsEndpoint
from joynexus.ops.role_follower import RoleFollower
from joynexus.protocol import schemas as s

API_VERSION = s.API_VERSION
log = logging.getLogger("joynexus.api")


def create_app(cluster: Cluster, settings: ApiSettings | None = None, *, admin_key: str | None = None) -> FastAPI:
    """The API over the deployment `cluster` (`joynexus.connect`). The admin key comes from
    `admin_key`, else the env JOYNEXUS_ADMIN_KEY; with neither and none stored, one is generated:
    it is in `app.state.generated_admin_key` (to print once) and only its hash is kept.

    What the routes depend on is in `app.state`: `gateway`, `keys`, `settings`, `event_streams`,
    `metrics`."""
    settings = settings or ApiSettings()
    keys = ApiKeyStore(cluster.store, admin_key or admin_key_from_env())
    ledger = UsageLedger(
        cluster.store,
        checkpoints=cluster.checkpoints,
        default_max_device_seconds=settings.default_max_device_seconds,
        default_max_queued_workloads=settings.default_max_queued_workloads,
        default_max_storage_bytes=settings.default_max_storage_bytes,
        datasets_dir=cluster.settings.data_dir / "datasets",
    )
    gateway = ApiGateway(cluster, keys, ledger, limits=settings.limits)
    # Ray mode: the roles are looked up again when one is replaced or a new deployment comes up.
    follower = RoleFollower(cluster) if cluster.mode == "ray" else None
    if follower is not None:
        follower.on_reconnect.append(gateway.forget_call_futures)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Predict calls block a worker thread while the Inference Queue batches them together.
        anyio.to_thread.current_default_thread_limiter().total_tokens = 128
        gateway.start()
        if follower is not None:
            follower.start()
        # The startup heap out of the cycle collector: a full collection over it would stall the
        # loop and every request for ~0.4 s (the policy stream's p99, issue 17). Once per process.
        freeze_startup_heap()
        try:
            yield
        finally:
            if follower is not None:
                follower.stop()
            gateway.stop()

    app = FastAPI(title="JoyNexus tenant API", version=API_VERSION, description=__doc__, lifespan=lifespan)
    app.state.gateway = gateway
    app.state.role_follower = follower
    app.state.event_streams = TenantCounter()  # open GET /v1/workloads/{id}/stream per tenant
    app.state.limiter = TenantCallLimiter(settings.rate_limits)  # per-tenant rate limits, in-flight bound
    app.state.training_gate = PriorityGate(settings.training_call_slots)  # training calls by tenant priority
    app.state.keys = keys
    app.state.settings = settings
    app.state.generated_admin_key = keys.ensure_admin_key()
    app.state.metrics = MetricsEndpoint(cluster, timeout_s=settings.metrics_timeout_s)
    install_exception_handlers(app)
    app.add_middleware(IdempotencyMiddleware, keys=keys)  # per authenticated tenant (issue 26)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.include_router(meta.metrics_router(public=settings.metrics_public))
    for router in (meta.router, admin.router, upper.router, stream.router, lower.router, foreign.router):
        app.include_router(router)
    app.include_router(base_model.router)  # GET /v1/base_model: exports run outside JoyNexus
    app.include_router(datasets.router)  # /v1/datasets: tenant dataset uploads
    app.include_router(state_control.router)  # /v1/load_state, /v1/fork
    app.include_router(futures.router)  # /v1/sample, /v1/compute_logprobs, /v1/futures (issue 28)
    robots = PolicyStream(gateway, keys, settings.policy_stream, limiter=app.state.limiter)
    app.include_router(robots.router())  # robots: /v1/stream
    # openpi clients: /v1/openpi, the same limits and per-tenant connection counts as /v1/stream
    openpi = OpenPiStream(gateway, keys, settings.policy_stream, robots.connections, limiter=app.state.limiter)
    app.include_router(openpi.router())
    robots.role_follower = openpi.role_follower = follower
    return app


__all__ = ["API_VERSION", "ApiSettings", "create_app"]
