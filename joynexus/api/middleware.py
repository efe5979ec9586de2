"""ASGI pieces of the tenant API: a request-size cap, idempotent replays, msgpack request bodies.

- `BodyLimitMiddleware` answers 413 before a handler runs when a body is larger than the cap
  (by Content-Length, or by counting when the length is not declared).
- `IdempotencyMiddleware` makes a POST with an `Idempotency-Key` header safe to retry: the first
  answer (below 500) is kept for a while and replayed to a retry with the same key, tenant and
  body, so a client retrying after a lost answer never applies an optimizer step twice. The key
  is verified first and answers are kept per authenticated tenant, each with its own bound, so
  neither unauthenticated floods nor another tenant's traffic evict a tenant's keys.
- `WireRoute` lets every JSON endpoint also take `Content-Type: application/msgpack`: the body is
  decoded (no ext types, no pickle) and validated by the same pydantic model, with tensor bytes
  arriving as raw `bin` instead of base64.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any

import anyio.to_thread
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from joynexus.api.auth import ApiKeyStore
from joynexus.api.errors import InvalidInput
from joynexus.protocol.wire import MSGPACK_MEDIA_TYPES, msgpack_loads

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _json_error(status: int, code: str, message: str, field: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"code": code, "message": message, "problems": [{"field": field, "reason": message}]}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return status, headers, body


async def _send_response(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _read_body(receive: Receive, limit: int | None) -> tuple[bytes | None, list[Message]]:
    """The whole body (None if over `limit`), and any non-body message that arrived meanwhile."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), [message]
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            return None, []
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), []


def _replaying(body: bytes, pending: list[Message], receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_large = f"the request body is larger than this server's limit of {self.max_bytes} bytes"
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await _send_response(send, *_json_error(400, "bad_request", "invalid Content-Length", "content-length"))
                return
            if length > self.max_bytes:
                await _send_response(send, *_json_error(413, "payload_too_large", too_large, "body"))
                return
        body, pending = await _read_body(receive, self.max_bytes)
        if body is None:
            await _send_response(send, *_json_error(413, "payload_too_large", too_large, "body"))
            return
        await self.app(scope, _replaying(body, pending, receive), send)


_Stored = tuple[float, str, int, list[tuple[bytes, bytes]], bytes]  # at, fingerprint, status, headers, body
PRINCIPAL_SCOPE_KEY = "joynexus.principal"  # (credential, Principal) the middleware verified, for the route


def _bearer_credential(authorization: bytes | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header (scheme in any case), else None."""
    if not authorization:
        return None
    scheme, _, credential = authorization.decode("latin-1").strip().partition(" ")
    credential = credential.strip()
    return credential if scheme.lower() == "bearer" and credential else None


class IdempotencyMiddleware:
    """Replays kept answers to retried POSTs, kept per authenticated tenant (issue 26).

    The caller's key is verified here, before the cache is looked at: a request without a valid
    key never reads or writes it (it goes on to the route, which answers 401), so made-up keys
    cannot churn it. Answers are kept per tenant (the admin is one more caller), each with its own
    bound of `max_entries` answers and `max_bytes_per_caller` bytes, and a tenant only ever evicts
    its own oldest answers: no caller table shared by an LRU, so no tenant's traffic can push out
    another's keys. Every key of a tenant shares its answers (a retry after a key rotation still
    replays). Answers older than `ttl_s` are dropped, for every tenant, as time passes.

    The verified principal is left in the request's scope (`PRINCIPAL_SCOPE_KEY`) so the route's
    own authentication does not look the key up a second time."""

    def __init__(
        self,
        app: ASGIApp,
        keys: ApiKeyStore,
        *,
        max_entries: int = 1024,
        max_bytes_per_caller: int = 64 << 20,
        ttl_s: float = 600.0,
        max_body_bytes: int = 8 << 20,
    ):
        self.app = app
        self.keys = keys
        self.max_entries = max_entries  # per tenant
        self.max_bytes_per_caller = max_bytes_per_caller
        self.ttl_s = ttl_s
        self.max_body_bytes = max_body_bytes
        # tenant ("tenant:<id>", or "admin") -> (key hash -> stored answer, oldest first)
        self._done: dict[str, OrderedDict[str, _Stored]] = {}
        self._bytes: dict[str, int] = {}  # caller -> body bytes it keeps
        self._running: dict[tuple[str, str], asyncio.Event] = {}
        self._next_sweep = 0.0

    def entries(self, caller: str) -> int:
        """Answers kept for a caller ("tenant:<id>" or "admin")."""
        return len(self._done.get(caller, ()))

    async def _caller(self, scope: Scope, headers: dict[bytes, bytes]) -> str | None:
        """The authenticated caller of the request, or None (no valid key: never cached)."""
        credential = _bearer_credential(headers.get(b"authorization"))
        if credential is None or len(credential) > 256:
            return None
        principal = await anyio.to_thread.run_sync(self.keys.verify, credential)
        if principal is None:
            return None
        scope.setdefault("state", {})[PRINCIPAL_SCOPE_KEY] = (credential, principal)
        return "admin" if principal.tenant_id is None else f"tenant:{principal.tenant_id}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        key = headers.get(b"idempotency-key")
        if not key:
            await self.app(scope, receive, send)
            return
        if len(key) > 200:
            await _send_response(
                send, *_json_error(422, "invalid_input", "Idempotency-Key is longer than 200 bytes", "idempotency-key")
            )
            return
        caller = await self._caller(scope, headers)
        if caller is None:  # unauthenticated: the route answers 401; the cache is not touched
            await self.app(scope, receive, send)
            return
        body, pending = await _read_body(receive, None)
        assert body is not None
        cache_key = hashlib.sha256(key + b"\n" + scope["path"].encode()).hexdigest()
        running_key = (caller, cache_key)
        fingerprint = hashlib.sha256(body).hexdigest()
        while running_key in self._running:  # the same request is being served: wait for its answer
            await self._running[running_key].wait()
        self._expire()
        stored = self._done.get(caller, {}).get(cache_key)
        if stored is not None:
            _, stored_fingerprint, status, stored_headers, stored_body = stored
            if stored_fingerprint != fingerprint:
                message = "this Idempotency-Key was already used with a different request body"
                await _send_response(send, *_json_error(422, "invalid_input", message, "idempotency-key"))
                return
            await _send_response(send, status, [*stored_headers, (b"idempotent-replayed", b"true")], stored_body)
            return
        event = self._running[running_key] = asyncio.Event()
        captured: dict[str, Any] = {"status": 500, "headers": [], "chunks": [], "size": 0}

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                captured["status"] = message["status"]
                captured["headers"] = list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                captured["size"] += len(message.get("body", b""))
                if captured["size"] <= self.max_body_bytes:
                    captured["chunks"].append(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, _replaying(body, pending, receive), capture)
            # 401 (unverified) and 499 (the caller hung up: nothing was answered) are not kept.
            status = captured["status"]
            if status < 500 and status not in (401, 499) and captured["size"] <= self.max_body_bytes:
                answer = (
                    time.monotonic(),
                    fingerprint,
                    captured["status"],
                    captured["headers"],
                    b"".join(captured["chunks"]),
                )
                self._store(caller, cache_key, answer)
        finally:
            del self._running[running_key]
            event.set()

    def _store(self, caller: str, cache_key: str, answer: _Stored) -> None:
        entries = self._done.get(caller)
        if entries is None:
            entries = self._done[caller] = OrderedDict()
        old = entries.pop(cache_key, None)
        self._bytes[caller] = self._bytes.get(caller, 0) - (len(old[4]) if old else 0) + len(answer[4])
        entries[cache_key] = answer
        # Evict only this caller's own oldest answers: other callers' keys are never touched here.
        while len(entries) > self.max_entries or (len(entries) > 1 and self._bytes[caller] > self.max_bytes_per_caller):
            self._bytes[caller] -= len(entries.popitem(last=False)[1][4])

    def _expire(self) -> None:
        """Drop answers older than the TTL, every caller's (at most every tenth of the TTL)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.ttl_s / 10
        cutoff = now - self.ttl_s
        for caller in list(self._done):
            entries = self._done[caller]
            while entries and next(iter(entries.values()))[0] < cutoff:  # kept in the order they were stored
                self._bytes[caller] -= len(entries.popitem(last=False)[1][4])
            if not entries:
                del self._done[caller]
                self._bytes.pop(caller, None)


def refuse_unread_if_told_to_wait(request: Request) -> None:
    """429 before the body is read when the calling tenant was refused this route by a rate limit
    and its wait has not passed (`TenantCallLimiter.refuse_unread`). Only a key verified moments
    ago is looked at (no I/O here); it is left in the scope (`PRINCIPAL_SCOPE_KEY`), so the route's
    authentication does not look it up again. Any other call goes on to the route's own checks."""
    limiter = getattr(request.app.state, "limiter", None)
    keys: ApiKeyStore | None = getattr(request.app.state, "keys", None)
    if limiter is None or keys is None or request.method not in _BODY_METHODS:
        return
    credential = _bearer_credential(request.headers.get("authorization", "").encode("latin-1"))
    principal = keys.cached(credential) if credential is not None and len(credential) <= 256 else None
    if principal is None:
        return
    request.scope.setdefault("state", {})[PRINCIPAL_SCOPE_KEY] = (credential, principal)
    if principal.tenant_id is not None:
        limiter.refuse_unread(principal.tenant_id, request.scope["path"])


_EMPTY_BODIES = (None, {})  # what a client may send to a route that takes no body (e.g. `json={}`)


async def refuse_an_unread_body(request: Request, media: str) -> None:
    """422 on `body` for a route that takes none but was sent one: its fields would be dropped
    without a word (a futures optim_step ignored `lr` and answered 202)."""
    raw = await request.body()
    if not raw.strip():
        return
    try:
        decoded = msgpack_loads(raw) if media in MSGPACK_MEDIA_TYPES else json.loads(raw)
    except Exception:  # undecodable: still a body the route would not read
        decoded = raw
    if decoded in _EMPTY_BODIES:
        return
    named = f" (fields {sorted(map(str, decoded))})" if isinstance(decoded, dict) else ""
    route = f"{request.method} {request.scope['path']}"
    raise InvalidInput("body", f"{route} takes no body, and would not read the one sent{named}: send none")


class WireRoute(APIRoute):
    """An APIRoute whose JSON body may also arrive as msgpack (same model, raw tensor bytes), and
    whose body is not read for a tenant told to wait (`refuse_unread_if_told_to_wait`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        takes_no_body = self.body_field is None

        async def route(request: Request) -> Response:
            refuse_unread_if_told_to_wait(request)
            media = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if takes_no_body and request.method in _BODY_METHODS:
                await refuse_an_unread_body(request, media)
            if media in MSGPACK_MEDIA_TYPES:
                body = await request.body()
                scope = dict(request.scope)
                scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"] + [
                    (b"content-type", b"application/json")
                ]
                decoded = Request(scope, request.receive)
                decoded._body = body
                if body:
                    decoded._json = msgpack_loads(body)
                request = decoded
            return await handler(request)

        return route
