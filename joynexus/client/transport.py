"""How the clients talk HTTP: where to (URL, key from the environment), retries, request encoding,
answer and error decoding, Server-Sent Events; shared by the sync and the async client."""

from __future__ import annotations

import functools
import json
import os
import random
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from joynexus.client.errors import (
    ApiRequestError,
    ConnectionFailed,
    InvalidArgument,
    InvalidResponse,
    JoyNexusError,
    RateLimited,
    ServerError,
)
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import (
    JSON_MEDIA_TYPE,
    MSGPACK_MEDIA_TYPE,
    Tensor,
    WireError,
    msgpack_dumps,
    msgpack_loads,
)

DEFAULT_URL = "http://127.0.0.1:8765"
API_KEY_ENV = "JOYNEXUS_API_KEY"
URL_ENV = "JOYNEXUS_URL"

# Connection-level failures that say nothing reached (or came back from) the server: safe to retry.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


RATE_LIMIT_CODES = frozenset({"rate_limited", "too_many_in_flight", "too_many_streams"})


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of transient failures. `retry_rate_limited`: also retry a 429 of a rate limit
    (`RateLimited`) after the server's Retry-After, waiting at most `max_rate_limit_wait_s` per try."""

    attempts: int = 4  # total tries, the first included
    backoff_s: float = 0.25
    max_backoff_s: float = 5.0
    retry_statuses: frozenset[int] = frozenset({502, 503, 504})
    retry_rate_limited: bool = False
    max_rate_limit_wait_s: float = 30.0

    def delay(self, attempt: int, retry_after: str | None = None, status_code: int | None = None) -> float:
        cap = self.max_rate_limit_wait_s if status_code == 429 else self.max_backoff_s
        if retry_after is not None:
            try:
                return min(cap, max(0.0, float(retry_after)))
            except ValueError:
                pass
        return min(cap, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.0)


@dataclass
class Call:
    """One API request, described once and run by the sync or the async client."""

    method: str
    path: str
    model: Any = None  # a pydantic model class, a TypeAdapter-able type, or None for raw bytes
    body: BaseModel | dict[str, Any] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    raw: bool = False  # the answer is bytes (safetensors), not a model
    content: bytes | None = None  # a raw request body (a dataset archive) instead of `body`


@functools.cache
def _adapter(model: Any) -> TypeAdapter:
    return TypeAdapter(model)


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def response_error(response: httpx.Response) -> JoyNexusError:
    """The error of a 4xx / 5xx answer: its ErrorBody, or (a proxy's HTML page, an empty body) its
    text and reason phrase under the code "http_error"."""
    data = _json_or_none(response)
    try:
        body = s.ErrorBody.model_validate(data)
    except ValidationError:
        try:
            text = " ".join(response.text.split())[:500]
        except (UnicodeDecodeError, LookupError):
            text = ""
        body = s.ErrorBody(code="http_error", message=text or response.reason_phrase or "no message")
    if response.status_code == 429 and body.code in RATE_LIMIT_CODES:
        return RateLimited(response.status_code, body, _seconds(response.headers.get("retry-after")))
    cls = ApiRequestError if response.status_code < 500 else ServerError
    return cls(response.status_code, body)


def _seconds(value: str | None) -> float | None:
    try:
        return None if value is None else max(0.0, float(value))
    except ValueError:
        return None


def transport_error(url: str, error: Exception) -> JoyNexusError:
    """What a failed request raises: our own errors as they are, anything else as ConnectionFailed."""
    return error if isinstance(error, JoyNexusError) else ConnectionFailed(url, error)


def parse_event(data: str) -> s.WorkloadEvent:
    try:
        return s.WorkloadEvent.model_validate_json(data)
    except ValidationError as error:
        raise InvalidResponse("workload event", first_error(error)) from None


def stream_error(data: str) -> JoyNexusError:
    """The `error` event of a workload stream (the workload is not the caller's, or is gone)."""
    try:
        return ApiRequestError(404, s.ErrorBody.model_validate_json(data))
    except ValidationError as error:
        return InvalidResponse("workload stream error event", first_error(error))


def first_error(error: ValidationError) -> str:
    first = error.errors()[0] if error.errors() else {}
    where = ".".join(str(part) for part in first.get("loc", ())) or "body"
    return f"{where}: {first.get('msg', str(error))} ({error.error_count()} problem(s))"


def http_client(cls: Any, base_url: str, timeout_s: float) -> Any:
    try:
        return cls(base_url=base_url, timeout=timeout_s)
    except (httpx.InvalidURL, ValueError, TypeError) as error:
        raise InvalidArgument([("base_url", f"{base_url!r} is not a usable URL ({error})")]) from None


class ClientBase:
    def __init__(
        self,
        base_url: str | None,
        api_key: str | None,
        *,
        timeout_s: float,
        retry: RetryPolicy | None,
        wire: Literal["msgpack", "json"],
    ):
        self.base_url = (base_url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            reason = f"{self.base_url!r} is not an http:// or https:// URL (e.g. {DEFAULT_URL})"
            raise InvalidArgument([("base_url", reason)])
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.wire = wire

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": MSGPACK_MEDIA_TYPE if self.wire == "msgpack" else JSON_MEDIA_TYPE}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _request_kwargs(self, call: Call) -> dict[str, Any]:
        try:
            return self._encoded(call)
        except (TypeError, ValueError, OverflowError) as error:  # a body msgpack / JSON cannot carry
            raise InvalidArgument([("body", f"cannot be encoded: {type(error).__name__}: {error}")]) from None

    def _encoded(self, call: Call) -> dict[str, Any]:
        headers = self._headers()
        kwargs: dict[str, Any] = {"params": call.params, "headers": headers}
        if call.method == "POST":
            headers["Idempotency-Key"] = uuid.uuid4().hex  # reused by every retry of this call
        if call.raw:
            headers["Accept"] = "application/octet-stream"
        if call.content is not None:
            headers["Content-Type"] = "application/octet-stream"
            kwargs["content"] = call.content
        elif call.body is not None:
            if isinstance(call.body, BaseModel):
                data = call.body.model_dump(exclude_none=True, mode="python" if self.wire == "msgpack" else "json")
            else:
                data = call.body
            if self.wire == "msgpack":
                headers["Content-Type"] = MSGPACK_MEDIA_TYPE
                kwargs["content"] = msgpack_dumps(data)
            else:  # encoded here (not by httpx) so an unencodable body fails before sending
                headers["Content-Type"] = JSON_MEDIA_TYPE
                kwargs["content"] = json.dumps(
                    data, ensure_ascii=False, separators=(",", ":"), allow_nan=False
                ).encode()
        return kwargs

    @staticmethod
    def _parse(call: Call, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            raise response_error(response)
        if call.raw:
            return response.content
        what = f"the answer to {call.method} {call.path}"
        media = response.headers.get("content-type", "").split(";")[0].strip()
        try:
            data = msgpack_loads(response.content) if media == MSGPACK_MEDIA_TYPE else response.json()
        except (WireError, ValueError, UnicodeDecodeError) as error:
            body = " ".join(response.text.split())[:200] if media != MSGPACK_MEDIA_TYPE else f"{media} bytes"
            raise InvalidResponse(what, f"not {media or 'JSON'} ({type(error).__name__}): {body!r}") from None
        if call.model is None:
            return data
        try:
            return _adapter(call.model).validate_python(data)
        except ValidationError as error:
            raise InvalidResponse(what, first_error(error), response.status_code) from None

    def _should_retry(self, attempt: int, response: httpx.Response | None, error: Exception | None) -> bool:
        if attempt + 1 >= self.retry.attempts:
            return False
        if error is not None:
            return isinstance(error, TRANSIENT_ERRORS)
        if response is not None and response.status_code == 429 and self.retry.retry_rate_limited:
            return isinstance(response_error(response), RateLimited)
        return response is not None and response.status_code in self.retry.retry_statuses


class SSEParser:
    """Incremental Server-Sent Events parser: feed lines, get (event, data) when one completes."""

    def __init__(self) -> None:
        self.event, self.data = "message", []

    def feed(self, line: str) -> tuple[str, str] | None:
        if not line:
            done = (self.event, "\n".join(self.data)) if self.data else None
            self.event, self.data = "message", []
            return done
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self.event = value
        elif name == "data":
            self.data.append(value)
        return None


def from_wire(value: Any) -> Any:
    """Environment results with their wire tensors turned back into numpy arrays."""
    if isinstance(value, dict):
        if set(value) == {"dtype", "shape", "data"}:
            try:
                return Tensor.model_validate(value).to_numpy()
            except ValidationError as error:
                raise InvalidResponse("a tensor of an environment result", first_error(error)) from None
        return {k: from_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    return value
