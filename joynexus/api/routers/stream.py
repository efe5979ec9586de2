"""A workload's progress as Server-Sent Events (GET /v1/workloads/{id}/stream). The robots' policy
stream (/v1/stream, a websocket) is `joynexus.api.streaming.PolicyStream`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import StreamingResponse

from joynexus.api.errors import ApiError
from joynexus.api.gateway import ApiGateway
from joynexus.api.middleware import WireRoute
from joynexus.api.rate_limits import TenantCallLimiter
from joynexus.api.routers.dependencies import ERRORS, Gateway, Tenant, WorkloadId
from joynexus.api.settings import ApiSettings
from joynexus.api.streaming import TenantCounter

FINAL_EVENT_GRACE_S = 2.0
router = APIRouter(prefix="/v1", route_class=WireRoute, tags=["upper layer"], responses=ERRORS)


def settings_of(request: Request) -> ApiSettings:
    return request.app.state.settings


def event_streams_of(request: Request) -> TenantCounter:
    """Open event streams per tenant, of this app."""
    return request.app.state.event_streams


@router.get(
    "/workloads/{workload_id}/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events"}},
)
async def stream_workload(
    request: Request,
    workload_id: WorkloadId,
    tenant_id: Tenant,
    gateway: Gateway,
    settings: Annotated[ApiSettings, Depends(settings_of)],
    event_streams: Annotated[TenantCounter, Depends(event_streams_of)],
    after: Annotated[int, Query(ge=0, le=2**62)] = 0,
    last_event_id: Annotated[str | None, Header(max_length=32)] = None,
) -> StreamingResponse:
    """Progress and metric events as Server-Sent Events (`event: <kind>`, `id: <seq>`,
    `data: <json>`), ending with `event: end` carrying the final status. A tenant holds at
    most `max_streams_per_tenant` open streams (429 `too_many_streams` beyond)."""
    if last_event_id is not None and last_event_id.isdigit():
        after = max(after, int(last_event_id))
    limiter: TenantCallLimiter = request.app.state.limiter
    limit = settings.max_streams_per_tenant
    # The slot first: a refused open costs nothing but this check (no thread, no Master call), so a
    # burst of opens cannot queue up work in front of other tenants' calls.
    if not event_streams.acquire(tenant_id, limit):
        limiter.refuse_stream(tenant_id)
        raise ApiError(
            f"your tenant already has {limit} open event streams (the limit is {limit} per tenant); "
            "close one, or poll GET /v1/workloads/{id}/events instead",
            [("max_streams_per_tenant", f"limit of {limit} open event streams per tenant reached")],
            headers={"Retry-After": "1"},
        ).with_status(429, "too_many_streams")
    slot = _StreamSlot(event_streams, tenant_id)
    try:
        # 404 before the stream starts; the stream slots already bound these, so they wait for a thread.
        await limiter.run(tenant_id, gateway.workload, tenant_id, workload_id, wait=True)
    except BaseException:
        slot.release()
        raise
    return _EventStreamResponse(
        slot,
        _event_stream(request, gateway, settings, slot, workload_id, after),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


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
    short blocking call, one of its tenant's own."""
    tenant_id = slot.tenant_id
    limiter: TenantCallLimiter = request.app.state.limiter
    try:
        last_sent = time.monotonic()
        final_seen, done_at = False, None
        while True:
            try:
                batch = await limiter.run_unmetered(tenant_id, gateway.workload_events, tenant_id, workload_id, after)
            except ApiError as error:
                yield f"event: error\ndata: {error.body().model_dump_json()}\n\n"
                return
            for event in batch.events:
                after = event.seq
                final_seen = final_seen or event.kind == batch.workload.state
                yield f"id: {event.seq}\nevent: {event.kind}\ndata: {event.model_dump_json()}\n\n"
                last_sent = time.monotonic()
            if batch.workload.done:
                # The Master records the final state just before it appends the final-state event:
                # wait briefly for that event, so a stream never ends without it (a stream opened
                # after it was sent, with `after` past it, ends after the grace).
                done_at = done_at or time.monotonic()
                if final_seen or time.monotonic() - done_at >= FINAL_EVENT_GRACE_S:
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
