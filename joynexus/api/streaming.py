"""The policy server for robots: one websocket per robot, observations in, action chunks out.

Endpoint: ``/v1/stream`` (websocket). Every frame, both ways, is ONE binary msgpack map; tensors are
`joynexus.protocol.wire.Tensor` maps (``{"dtype", "shape", "data": <bin>}``), decoded with the wire
module's dtype allow-list; nothing is ever unpickled.

Authentication (either):
- ``Authorization: Bearer <tenant key>`` on the upgrade request (the robot client does this), or
- a first frame ``{"type": "hello", "api_key": "<tenant key>"}`` within `auth_timeout_s`
  (for clients that cannot set headers).
A missing, invalid or revoked key, or the admin key, closes the connection with 1008 (policy
violation) and a short reason. Once authenticated the server sends
``{"type": "ready", "tenant": {tenant_id, schema_signature, cameras, image_size, state_dim,
action_dim, action_chunk}, "limits": {max_frame_bytes, max_in_flight, max_connections_per_tenant}}``.

Client -> server::

    {"type": "obs", "seq": n, "observations": {"images": Tensor, "state": Tensor, "instructions": [str] | None},
     "policy_version": None | int, "seeds": None | [int]}

``images`` is (N, cameras, 3, H, W) uint8 or float in [0, 1], ``state`` (N, state_dim): the same
checks as ``POST /v1/predict`` (the same gateway call), so the errors are the same.
``policy_version`` pins a served version, None takes the latest. ``seq`` is the client's request
number (0 <= seq < 2**63), echoed back.

Server -> client::

    {"type": "actions", "seq": n, "policy_version": v, "actions": Tensor (N, action_chunk, action_dim) float32,
     "latency_ms": server-side ms, "batch_samples": samples in the shared backbone batch}
    {"type": "error", "seq": n | None, "code": str, "message": str, "problems": [{"field", "reason"}]}

An error frame answers a bad request (invalid observation, unknown version, no serving weights,
too many requests in flight, ...) and the connection stays open. Answers may come out of order
when several requests are in flight; match them by ``seq``.

Requests of every connection, robot and tenant go through the shared Inference Queue (the
gateway's predict runs in a worker thread), so concurrent robots are group-batched into one
backbone forward.

Close codes: 1003 a frame that is not a binary msgpack map; 1009 a frame over `max_frame_bytes`;
1008 authentication refused; 1013 the tenant already holds `max_connections_per_tenant`
connections (try again later); 1011 an unexpected server error (logged with a reference, never a
traceback to the client). Safe by default: bounded frames, in-flight requests and connections.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Any, Literal

import anyio.to_thread
from fastapi import APIRouter, WebSocket
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from joynexus.actors import role_unavailable_errors
from joynexus.api.abandoned import keyed_predict
from joynexus.api.auth import ApiKeyStore, Principal
from joynexus.api.errors import ApiError, role_away, validation_problems
from joynexus.api.gateway import ApiGateway
from joynexus.api.rate_limits import TenantCallLimiter
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import WireError, msgpack_dumps, msgpack_loads

log = logging.getLogger("joynexus.api.stream")

STREAM_PATH = "/v1/stream"
CLOSE_NORMAL = 1000
CLOSE_UNSUPPORTED = 1003
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL = 1011
CLOSE_TRY_LATER = 1013


class StreamSettings(BaseModel):
    """Per-connection and per-tenant limits of the policy stream."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_frame_bytes: int = Field(default=8 << 20, ge=1024)
    max_in_flight: int = Field(default=4, ge=1, le=256)
    max_connections_per_tenant: int = Field(default=32, ge=1)
    auth_timeout_s: float = Field(default=10.0, gt=0)
    request_timeout_s: float = Field(default=30.0, gt=0, le=600)


class ObsFrame(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["obs"]
    seq: int = Field(ge=0, lt=2**63)
    observations: s.ObservationBatch
    policy_version: int | None = Field(default=None, ge=0)
    seeds: list[int] | None = Field(default=None, max_length=s.MAX_SAMPLES_PER_REQUEST)


class _Refused(Exception):
    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


def error_frame(seq: int | None, code: str, message: str, problems: list[tuple[str, str]] | None = None) -> dict:
    return {
        "type": "error",
        "seq": seq,
        "code": code,
        "message": message,
        "problems": [{"field": f, "reason": r} for f, r in problems or []],
    }


def api_error_frame(seq: int | None, error: ApiError) -> dict:
    """An API error as an error frame; its Retry-After (429, 503) as `retry_after_s`."""
    frame = error_frame(seq, error.code, error.message, error.problems)
    if error.headers and "Retry-After" in error.headers:
        frame["retry_after_s"] = float(error.headers["Retry-After"])
    return frame


def _short(reason: str) -> str:
    """Close reasons must fit a control frame (123 bytes)."""
    data = reason.encode("utf-8")
    return reason if len(data) <= 120 else data[:117].decode("utf-8", "ignore") + "..."


class TenantCounter:
    """Open connections (websockets, event streams) per tenant, bounded by a per-tenant limit.
    Thread-safe: acquired from worker threads and released on the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def acquire(self, tenant_id: str, limit: int) -> bool:
        with self._lock:
            if self._counts.get(tenant_id, 0) >= limit:
                return False
            self._counts[tenant_id] = self._counts.get(tenant_id, 0) + 1
            return True

    def release(self, tenant_id: str) -> None:
        with self._lock:
            left = self._counts.get(tenant_id, 0) - 1
            if left > 0:
                self._counts[tenant_id] = left
            else:
                self._counts.pop(tenant_id, None)

    def count(self, tenant_id: str) -> int:
        with self._lock:
            return self._counts.get(tenant_id, 0)


def tenant_interface(cfg: Any) -> dict[str, Any]:
    """The tenant's observation/action interface a robot client reads on connect (both endpoints)."""
    return {
        "tenant_id": cfg.tenant_id,
        "schema_signature": cfg.schema_signature,
        "cameras": list(cfg.cameras),
        "image_size": list(cfg.image_size),
        "state_dim": cfg.state_dim,
        "action_dim": cfg.action_dim,
        "action_chunk": cfg.action_chunk,
    }


def _rows(request: s.PredictRequest) -> int:
    shape = request.observations.state.shape
    return shape[0] if shape else 0


class PolicyStream:
    """The websocket endpoint; one instance per app (it holds the per-tenant connection counts)."""

    # Authorization schemes accepted on the upgrade request (lower case).
    auth_schemes: tuple[str, ...] = ("bearer",)

    def __init__(
        self,
        gateway: ApiGateway,
        keys: ApiKeyStore,
        settings: StreamSettings | None = None,
        connections: TenantCounter | None = None,
        *,
        limiter: TenantCallLimiter | None = None,
    ):
        """`connections`: the per-tenant connection counts, shared with another robot endpoint
        (/v1/openpi) so a tenant's limit covers its robots on both. `limiter`: the app's per-tenant
        rate limits and worker threads, shared with the HTTP routes."""
        self.limiter = limiter or TenantCallLimiter()
        self.gateway = gateway
        self.keys = keys
        self.settings = settings or StreamSettings()
        self.connections = connections if connections is not None else TenantCounter()
        self.role_follower: Any = None  # set by the app on Ray: looks roles up again when one is away

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_websocket_route(STREAM_PATH, self.serve, name="policy_stream")
        return router

    # -- one connection -----------------------------------------------------------------------
    async def serve(self, websocket: WebSocket) -> None:
        tenant_id: str | None = None
        try:
            await websocket.accept()
            principal = await self._authenticate(websocket)
            tenant_id = principal.tenant_id
            assert tenant_id is not None
            if not self.connections.acquire(tenant_id, self.settings.max_connections_per_tenant):
                tenant_id = None  # nothing to release
                raise _Refused(
                    CLOSE_TRY_LATER,
                    f"too many connections for this tenant (limit {self.settings.max_connections_per_tenant})",
                )
            await self._session(websocket, principal.tenant_id)
        except _Refused as refused:
            await self._close(websocket, refused.code, refused.reason)
        except WebSocketDisconnect:
            pass
        except Exception as error:  # never a traceback to the client
            reference = uuid.uuid4().hex[:12]
            log.error("policy stream error %s (tenant %s)", reference, tenant_id, exc_info=error)
            await self._close(websocket, CLOSE_INTERNAL, f"internal server error (reference {reference})")
        finally:
            if tenant_id is not None:
                self.connections.release(tenant_id)

    async def _close(self, websocket: WebSocket, code: int, reason: str) -> None:
        if websocket.application_state == WebSocketState.DISCONNECTED:
            return
        try:
            await websocket.close(code, _short(reason))
        except Exception:  # the peer went away meanwhile
            pass

    async def _receive_frame(self, websocket: WebSocket) -> Any:
        """The next frame decoded; disconnects raise WebSocketDisconnect, bad frames _Refused."""
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", CLOSE_NORMAL))
        data = message.get("bytes")
        if data is None:
            raise _Refused(CLOSE_UNSUPPORTED, "expected binary msgpack frames, got a text frame")
        if len(data) > self.settings.max_frame_bytes:
            raise _Refused(
                CLOSE_TOO_BIG, f"frame of {len(data)} bytes is over the limit of {self.settings.max_frame_bytes}"
            )
        try:
            frame = self._decode(data)
        except WireError as error:
            raise _Refused(CLOSE_UNSUPPORTED, f"undecodable frame: {error.reason}") from None
        if not isinstance(frame, dict):
            raise _Refused(CLOSE_UNSUPPORTED, "a frame must be a msgpack map")
        return frame

    def _decode(self, data: bytes) -> Any:
        """A frame's bytes decoded (this endpoint's msgpack dialect)."""
        return msgpack_loads(data)

    async def _authenticate(self, websocket: WebSocket) -> Principal:
        header = websocket.headers.get("authorization")
        if header is not None:
            scheme, _, key = header.partition(" ")
            if scheme.lower() not in self.auth_schemes or not key.strip():
                raise _Refused(CLOSE_POLICY, "malformed Authorization header: send 'Bearer <key>'")
            key = key.strip()
        else:
            try:
                with anyio.fail_after(self.settings.auth_timeout_s):
                    frame = await self._receive_frame(websocket)
            except TimeoutError:
                raise _Refused(CLOSE_POLICY, "missing API key: no Authorization header and no hello frame") from None
            key = frame.get("api_key") if frame.get("type") == "hello" else None
            if not isinstance(key, str) or not key:
                raise _Refused(CLOSE_POLICY, "missing API key: send 'Authorization: Bearer <key>' or a hello frame")
        if len(key) > 256:
            raise _Refused(CLOSE_POLICY, "invalid or revoked API key")
        principal = await self.keys.authenticate(key)
        if principal is None:
            raise _Refused(CLOSE_POLICY, "invalid or revoked API key")
        if principal.tenant_id is None:
            raise _Refused(CLOSE_POLICY, "the policy stream serves a tenant: connect with that tenant's API key")
        return principal

    async def _session(self, websocket: WebSocket, tenant_id: str) -> None:
        try:
            tenant = await anyio.to_thread.run_sync(self.gateway.tenant, tenant_id)
        except ApiError as error:
            raise _Refused(CLOSE_POLICY, error.message) from None
        cfg = tenant.backend_config
        send_lock = asyncio.Lock()

        async def send(frame: dict) -> None:
            async with send_lock:
                await websocket.send_bytes(msgpack_dumps(frame))

        await send(
            {
                "type": "ready",
                "tenant": {**tenant_interface(cfg), "tenant_id": tenant_id},
                "limits": {
                    "max_frame_bytes": self.settings.max_frame_bytes,
                    "max_in_flight": self.settings.max_in_flight,
                    "max_connections_per_tenant": self.settings.max_connections_per_tenant,
                },
            }
        )
        in_flight: set[asyncio.Task] = set()
        try:
            while True:
                frame = await self._receive_frame(websocket)
                seq = frame.get("seq") if isinstance(frame.get("seq"), int) else None
                kind = frame.get("type")
                if kind == "hello":  # already authenticated (header): nothing to do
                    continue
                if kind != "obs":
                    problem = [("type", f"unknown frame type {kind!r}: send 'obs'")]
                    await send(error_frame(seq, "invalid_input", problem[0][1], problem))
                    continue
                try:
                    obs = ObsFrame.model_validate(frame)
                except ValidationError as error:
                    problems = [(p.field, p.reason) for p in validation_problems(list(error.errors()), ())]
                    message = "; ".join(f"{f}: {r}" for f, r in problems[:5]) or "invalid frame"
                    await send(error_frame(seq, "invalid_input", message, problems))
                    continue
                if len(in_flight) >= self.settings.max_in_flight:
                    limit = self.settings.max_in_flight
                    await send(
                        error_frame(
                            obs.seq,
                            "too_many_in_flight",
                            f"{limit} requests of this connection are in flight already (the limit)",
                            [("seq", f"wait for an answer before sending more than {limit}")],
                        )
                    )
                    continue
                task = asyncio.create_task(self._answer(tenant_id, obs, send))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
        finally:
            for task in in_flight:
                task.cancel()

    async def _answer(self, tenant_id: str, obs: ObsFrame, send: Any) -> None:
        started = time.perf_counter()
        try:
            request = s.PredictRequest(
                observations=obs.observations,
                policy_version=obs.policy_version,
                seeds=obs.seeds,
                timeout_s=self.settings.request_timeout_s,
            )
            # Blocks one of the tenant's own worker threads while the Inference Queue groups it with
            # other robots' requests; over the tenant's rate limit: an error frame with retry_after_s.
            # Keyed, so that if the robot hangs up meanwhile its queued work is called off at once.
            result = await keyed_predict(self.limiter, self.gateway, tenant_id, request, _rows(request))
            frame: dict[str, Any] = {
                "type": "actions",
                "seq": obs.seq,
                "policy_version": result.policy_version,
                "actions": result.actions.model_dump(),
                "latency_ms": (time.perf_counter() - started) * 1000.0,
                "batch_samples": result.batch_samples,
            }
        except ApiError as error:
            frame = api_error_frame(obs.seq, error)
        except ValidationError as error:
            problems = [(p.field, p.reason) for p in validation_problems(list(error.errors()), ())]
            frame = error_frame(obs.seq, "invalid_input", "invalid request", problems)
        except role_unavailable_errors() as error:  # as HTTP answers it: 503-like, never `internal`
            log.warning("policy stream of tenant %s: a role is away: %s", tenant_id, error)
            frame = api_error_frame(obs.seq, role_away(error, self.role_follower))
        except Exception as error:
            reference = uuid.uuid4().hex[:12]
            log.error("policy stream request %s of tenant %s failed", reference, tenant_id, exc_info=error)
            frame = error_frame(obs.seq, "internal", f"internal server error (reference {reference} in the server log)")
        try:
            await send(frame)
        except Exception:  # the connection closed meanwhile: nobody to answer
            pass


__all__ = ["STREAM_PATH", "PolicyStream", "StreamSettings", "TenantCounter", "error_frame"]
