"""Calls whose caller went away, and roles that are away, on every path a robot or client uses.

- A predict whose caller hangs up (an HTTP client closing its connection, a robot's websocket
  closing) is called off in the Inference Model Service at once, by its request key: its queued
  chunks leave the Inference Queue instead of being computed for nobody (issue 26, item 2). The
  caller's worker thread keeps its slot until the call really ends (the shield), so a hang-up
  cannot be used to get around the tenant's in-flight bound.
- A role that is away (Master, a service, the Ray cluster under them) is answered like the HTTP
  routes answer it: `unavailable` with a retry delay, never `internal` (issue 26, item 6)."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable

from fastapi import Request, Response

from joynexus.api.gateway import ApiGateway
from joynexus.api.rate_limits import TenantCallLimiter
from joynexus.protocol import schemas as s

log = logging.getLogger(__name__)

# What an abandoned HTTP call is "answered" with (nginx's "client closed request"); nobody reads
# it, and the idempotency cache does not keep it (a retry with the same key runs again).
CLIENT_CLOSED_REQUEST = 499


def new_request_key() -> str:
    return uuid.uuid4().hex


def call_off_in_background(gateway: ApiGateway, tenant_id: str, request_key: str) -> None:
    """Cancel the tenant's keyed predict in the Inference Model Service, off the event loop and
    without waiting (the caller is going away; the request's own timeout is the fallback)."""

    def cancel() -> None:
        try:
            gateway.cancel_predict(tenant_id, request_key)
        except Exception as error:  # best effort
            log.warning("could not call off predict %s of tenant %s: %s", request_key, tenant_id, error)

    threading.Thread(target=cancel, name="predict-call-off", daemon=True).start()


def consume_outcome(call: asyncio.Future) -> None:
    """A shielded call whose caller went away: its outcome is nobody's (no 'never retrieved')."""
    if not call.cancelled():
        call.exception()


async def keyed_predict(
    limiter: TenantCallLimiter, gateway: ApiGateway, tenant_id: str, request: s.PredictRequest, samples: int
) -> s.PredictResult:
    """The gateway's predict in one of the tenant's worker threads (waiting for one); if the
    awaiting task is cancelled (its connection closed), the request is called off in the service."""
    request_key = new_request_key()
    call = asyncio.ensure_future(
        limiter.run(tenant_id, gateway.predict, tenant_id, request, request_key, samples=samples, wait=True)
    )
    call.add_done_callback(consume_outcome)
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        call_off_in_background(gateway, tenant_id, request_key)
        raise


async def _disconnected(request: Request) -> None:
    """Returns when the HTTP client closes its connection. The body was read already, so the next
    ASGI message is the disconnect (the server sends it when the peer goes away)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def answered_unless_hung_up(
    request: Request, call: Awaitable[Response], call_off: Callable[[], None]
) -> Response:
    """`call`'s answer; if the client hangs up first, `call_off()` runs in the background and the
    call is left to end on its own (its worker thread keeps the slot until then)."""
    answer = asyncio.ensure_future(call)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        answer.cancel()
        raise
    finally:
        gone.cancel()
    if answer in done:
        return answer.result()
    answer.add_done_callback(consume_outcome)
    threading.Thread(target=_quietly, args=(call_off,), name="predict-call-off", daemon=True).start()
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def _quietly(call_off: Callable[[], None]) -> None:
    try:
        call_off()
    except Exception as error:  # best effort: the request's own timeout still ends it
        log.warning("could not call off an abandoned predict: %s", error)


__all__ = [
    "CLIENT_CLOSED_REQUEST",
    "answered_unless_hung_up",
    "call_off_in_background",
    "consume_outcome",
    "keyed_predict",
]
