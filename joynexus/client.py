"""Python client of the JoyNexus tenant API: `JoyNexusClient` (sync) and `AsyncJoyNexusClient`.

Both speak the server's own pydantic models (`joynexus.protocol.schemas`), so results are typed:

    from joynexus.client import JoyNexusClient

    with JoyNexusClient("http://127.0.0.1:8765", api_key) as client:
        handle = client.submit(jobs=4)              # a workload handle, returned at once
        print(handle.progress().completed_jobs)     # where it is now
        final = handle.result(timeout=600)          # waits; raises WorkloadFailed if it failed
        step = client.train_batch(images, state, action)   # lower layer: one optimizer step

Tensors go in as numpy arrays, torch CPU tensors or plain nested lists of numbers (lists get the
dtype the field expects: float32 for images / states / actions / advantages, uint8 for integer
images, bool for masks) and come back as `wire.Tensor` (`.to_numpy()`). Bodies are msgpack by
default (raw tensor bytes); `wire="json"` sends JSON.

Errors: everything this client raises is a `JoyNexusError` (`status_code`, `code`, `message`,
`problems`): `ApiRequestError` (4xx), `ServerError` (5xx), `ConnectionFailed` (no answer: refused,
unreachable, timed out), `InvalidResponse` (an answer it cannot read), `InvalidArgument` (refused
before sending; `SpecFileError` for a spec file that does not parse, with its line and column),
`WorkloadFailed` and `WorkloadTimeout` (from a workload handle's `result`).

Retries: only transient failures — connection errors and 502 / 503 / 504 — with exponential
backoff and jitter; never a 4xx. Every POST carries an `Idempotency-Key` that its retries reuse,
so a retried optimizer step is applied once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from joynexus.protocol import schemas as s
from joynexus.protocol.wire import (
    JSON_MEDIA_TYPE,
    MSGPACK_MEDIA_TYPE,
    Tensor,
    TensorKind,
    WireError,
    as_tensor,
    msgpack_dumps,
    msgpack_loads,
)

__all__ = [
    "ApiRequestError",
    "AsyncJoyNexusClient",
    "AsyncWorkloadHandle",
    "ConnectionFailed",
    "InvalidArgument",
    "InvalidResponse",
    "JoyNexusClient",
    "JoyNexusError",
    "RetryPolicy",
    "ServerError",
    "SpecFileError",
    "WorkloadFailed",
    "WorkloadHandle",
    "WorkloadTimeout",
    "load_spec_file",
]

DEFAULT_URL = "http://127.0.0.1:8765"
VERSIONS_PAGE = 1000  # checkpoints per GET /v1/versions page when the client pages through all
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


def _body(code: str, message: str, problems: list[tuple[str, str]] | tuple[()] = ()) -> s.ErrorBody:
    return s.ErrorBody(code=code, message=message, problems=[s.Problem(field=f, reason=r) for f, r in problems])


class JoyNexusError(Exception):
    """Every error this client raises: the HTTP status of an error answer (None where there was no
    such answer), a machine-readable code, a message, and the field problems (`.field`, `.reason`)."""

    def __init__(self, status_code: int | None, body: s.ErrorBody):
        self.status_code = status_code
        self.code = body.code
        self.message = body.message
        self.problems = body.problems
        head = body.code if status_code is None else f"{status_code} {body.code}"
        super().__init__(f"{head}: {body.message}")

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (process pools, Ray, Prefect) whatever the subclass
        return (_restore_error, (type(self), self.args, self.__dict__))


def _restore_error(cls: type[JoyNexusError], args: tuple[Any, ...], state: dict[str, Any]) -> JoyNexusError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class ApiRequestError(JoyNexusError):
    """4xx: the request was wrong (or refused); retrying the same request will not help."""


class ServerError(JoyNexusError):
    """5xx (after the retries, for 502 / 503 / 504)."""


class ConnectionFailed(JoyNexusError):
    """No answer from the server, after the retries: refused, unreachable, timed out or dropped.
    `code` is "timeout" for a timeout, else "connection_failed"; `__cause__` is httpx's error."""

    def __init__(self, url: str, error: BaseException):
        code = "timeout" if isinstance(error, httpx.TimeoutException) else "connection_failed"
        detail = str(error) or "no detail"
        super().__init__(None, _body(code, f"no answer from {url} ({type(error).__name__}: {detail})"))
        self.url = url


class InvalidResponse(JoyNexusError):
    """An answer this client cannot read: not JSON / msgpack, or not the shape it expects."""

    def __init__(self, what: str, reason: str, status_code: int | None = None):
        super().__init__(status_code, _body("invalid_response", f"{what}: {reason}"))


class InvalidArgument(JoyNexusError, ValueError):
    """An argument refused before anything was sent; `problems` name the fields."""

    def __init__(self, problems: list[tuple[str, str]], message: str | None = None):
        message = message or "; ".join(f"{field}: {reason}" for field, reason in problems)
        super().__init__(None, _body("invalid_argument", message, problems))


class SpecFileError(InvalidArgument):
    """A workload spec file that cannot be read, does not parse (YAML or JSON), or holds no mapping.
    `line` and `column` (1-based) say where a syntax error is; None when not known."""

    def __init__(self, path: str | Path, reason: str, line: int | None = None, column: int | None = None):
        self.path, self.reason, self.line, self.column = str(path), reason, line, column
        where = self.path + "".join(f":{n}" for n in (line, column) if n is not None)
        super().__init__([("spec", f"{where}: {reason}")], message=f"{where}: {reason}")


class WorkloadFailed(JoyNexusError, RuntimeError):
    """A workload ended failed or cancelled; `.status` is its final `WorkloadInfo`."""

    def __init__(self, status: s.WorkloadInfo):
        self.status = status
        message = f"workload {status.workload_id} {status.state}: {status.error}"
        super().__init__(None, _body(f"workload_{status.state}", message))


class WorkloadTimeout(JoyNexusError, TimeoutError):
    """A workload handle's `result(timeout)` ran out of time; the workload goes on."""

    def __init__(self, status: s.WorkloadInfo, timeout: float | None):
        self.status = status
        message = f"workload {status.workload_id} is still {status.state} after {timeout} s"
        super().__init__(None, _body("workload_timeout", message))


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4  # total tries, the first included
    backoff_s: float = 0.25
    max_backoff_s: float = 5.0
    retry_statuses: frozenset[int] = frozenset({502, 503, 504})

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        if retry_after is not None:
            try:
                return min(self.max_backoff_s, max(0.0, float(retry_after)))
            except ValueError:
                pass
        return min(self.max_backoff_s, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.0)


@dataclass
class _Call:
    """One API request, described once and run by the sync or the async client."""

    method: str
    path: str
    model: Any = None  # a pydantic model class, a TypeAdapter-able type, or None for raw bytes
    body: BaseModel | dict[str, Any] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    raw: bool = False  # the answer is bytes (safetensors), not a model


@functools.cache
def _adapter(model: Any) -> TypeAdapter:
    return TypeAdapter(model)


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def _error(response: httpx.Response) -> JoyNexusError:
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
    cls = ApiRequestError if response.status_code < 500 else ServerError
    return cls(response.status_code, body)


def _transport_error(url: str, error: Exception) -> JoyNexusError:
    """What a failed request raises: our own errors as they are, anything else as ConnectionFailed."""
    return error if isinstance(error, JoyNexusError) else ConnectionFailed(url, error)


def _event(data: str) -> s.WorkloadEvent:
    try:
        return s.WorkloadEvent.model_validate_json(data)
    except ValidationError as error:
        raise InvalidResponse("workload event", _first_error(error)) from None


def _stream_error(data: str) -> JoyNexusError:
    """The `error` event of a workload stream (the workload is not the caller's, or is gone)."""
    try:
        return ApiRequestError(404, s.ErrorBody.model_validate_json(data))
    except ValidationError as error:
        return InvalidResponse("workload stream error event", _first_error(error))


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0] if error.errors() else {}
    where = ".".join(str(part) for part in first.get("loc", ())) or "body"
    return f"{where}: {first.get('msg', str(error))} ({error.error_count()} problem(s))"


def _http_client(cls: Any, base_url: str, timeout_s: float) -> Any:
    try:
        return cls(base_url=base_url, timeout=timeout_s)
    except (httpx.InvalidURL, ValueError, TypeError) as error:
        raise InvalidArgument([("base_url", f"{base_url!r} is not a usable URL ({error})")]) from None


class _Base:
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

    def _request_kwargs(self, call: _Call) -> dict[str, Any]:
        try:
            return self._encoded(call)
        except (TypeError, ValueError, OverflowError) as error:  # a body msgpack / JSON cannot carry
            raise InvalidArgument([("body", f"cannot be encoded: {type(error).__name__}: {error}")]) from None

    def _encoded(self, call: _Call) -> dict[str, Any]:
        headers = self._headers()
        kwargs: dict[str, Any] = {"params": call.params, "headers": headers}
        if call.method == "POST":
            headers["Idempotency-Key"] = uuid.uuid4().hex  # reused by every retry of this call
        if call.raw:
            headers["Accept"] = "application/octet-stream"
        if call.body is not None:
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
    def _parse(call: _Call, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            raise _error(response)
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
            raise InvalidResponse(what, _first_error(error), response.status_code) from None

    def _should_retry(self, attempt: int, response: httpx.Response | None, error: Exception | None) -> bool:
        if attempt + 1 >= self.retry.attempts:
            return False
        if error is not None:
            return isinstance(error, TRANSIENT_ERRORS)
        return response is not None and response.status_code in self.retry.retry_statuses


# -- request builders (shared by both clients) ---------------------------------------------------


def load_spec_file(path: str | Path) -> dict[str, Any]:
    """A workload spec file (YAML, or JSON for a `.json` file) as a dict. SpecFileError names the
    file, and for a syntax error its line and column, with the parser's reason."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SpecFileError(path, f"cannot be read ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise SpecFileError(path, f"is not UTF-8 text (byte {error.start})") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise SpecFileError(path, f"JSON syntax error: {error.msg}", error.lineno, error.colno) from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            reason = ": ".join(part for part in (error.context, error.problem) if part) or "not valid YAML"
            line, column = (mark.line + 1, mark.column + 1) if mark is not None else (None, None)
            raise SpecFileError(path, f"YAML syntax error: {reason}", line, column) from None
        except yaml.YAMLError as error:
            raise SpecFileError(path, f"YAML syntax error: {error}") from None
    if not isinstance(data, dict):
        got = "nothing" if data is None else f"a {type(data).__name__}"
        raise SpecFileError(path, f"holds {got}, not a mapping of spec fields (tenant, task, observation, ...)")
    return data


def _spec_dict(spec: Any) -> dict[str, Any] | None:
    if spec is None:
        return None
    if isinstance(spec, str | Path):
        return load_spec_file(spec)
    if isinstance(spec, BaseModel):
        return spec.model_dump(mode="json")
    try:
        return dict(spec)
    except (TypeError, ValueError):
        reason = f"expected a dict, a WorkloadSpec or a file path, got {type(spec).__name__}"
        raise InvalidArgument([("spec", reason)]) from None


def _tensor(value: Any, field: str, kind: TensorKind = "float") -> Tensor | None:
    """A request tensor (see `wire.as_tensor`: plain lists get the dtype `kind` names)."""
    if value is None:
        return None
    try:
        return as_tensor(value, field, kind)
    except WireError as error:
        raise InvalidArgument([(error.field, error.reason)]) from None


def _samples(images: Any, state: Any, action: Any, action_is_pad: Any, instructions: list[str] | None) -> dict:
    return {
        "images": _tensor(images, "images", "image"),
        "state": _tensor(state, "state"),
        "action": _tensor(action, "action"),
        "action_is_pad": _tensor(action_is_pad, "action_is_pad", "bool"),
        "instructions": instructions,
    }


def _columns(columns: dict[str, Any]) -> dict[str, Any]:
    """Queue columns: lists of strings as they are; arrays / tensors as tensors with their dtype
    (numbers in a plain list are refused: a queue column's dtype is not known here)."""
    out: dict[str, Any] = {}
    for key, value in columns.items():
        if isinstance(value, list | tuple):
            if not all(isinstance(item, str) for item in value):
                reason = "a list is a column of strings; pass numbers as a numpy array (its dtype is kept)"
                raise InvalidArgument([(f"columns.{key}", reason)])
            out[key] = list(value)
        elif isinstance(value, Tensor):
            out[key] = value
        else:
            try:
                out[key] = Tensor.from_numpy(value.detach().cpu().numpy() if hasattr(value, "detach") else value)
            except (WireError, ValueError, TypeError) as error:
                raise InvalidArgument([(f"columns.{key}", str(getattr(error, "reason", error)))]) from None
    return out


def _checked(builder: Any) -> Any:
    """A request builder whose invalid arguments (pydantic's checks of the request models) raise
    InvalidArgument with their fields, before anything is sent."""

    @functools.wraps(builder)
    def build(*args: Any, **kwargs: Any) -> _Call:
        try:
            return builder(*args, **kwargs)
        except ValidationError as error:
            problems = [
                (".".join(str(part) for part in item["loc"]) or "argument", item["msg"]) for item in error.errors()
            ]
            raise InvalidArgument(problems) from None

    return staticmethod(build)


def _check_builders(cls: type) -> type:
    for name, value in list(vars(cls).items()):
        if isinstance(value, staticmethod):
            setattr(cls, name, _checked(value.__func__))
    return cls


@_check_builders
class _Calls:
    """What each API operation sends; each returns a `_Call`."""

    @staticmethod
    def tenant() -> _Call:
        return _Call("GET", "/v1/tenant", s.TenantInfo)

    @staticmethod
    def submit(spec: Any, jobs: int | None) -> _Call:
        return _Call("POST", "/v1/workloads", s.WorkloadInfo, s.WorkloadSubmit(jobs=jobs, spec=_spec_dict(spec)))

    @staticmethod
    def evaluate(version: int | None, episodes: int, environment: dict[str, Any] | None) -> _Call:
        body = s.WorkloadSubmit(task="eval", version=version, episodes=episodes, environment=environment)
        return _Call("POST", "/v1/workloads", s.WorkloadInfo, body)

    @staticmethod
    def workload(workload_id: str) -> _Call:
        return _Call("GET", f"/v1/workloads/{workload_id}", s.WorkloadInfo)

    @staticmethod
    def workloads() -> _Call:
        return _Call("GET", "/v1/workloads", list[s.WorkloadInfo])

    @staticmethod
    def cancel(workload_id: str) -> _Call:
        return _Call("POST", f"/v1/workloads/{workload_id}/cancel", s.WorkloadInfo)

    @staticmethod
    def events(workload_id: str, after: int) -> _Call:
        return _Call("GET", f"/v1/workloads/{workload_id}/events", s.WorkloadEvents, params={"after": after})

    @staticmethod
    def versions(after: int | None, limit: int) -> _Call:
        params = {"limit": limit} if after is None else {"after": after, "limit": limit}
        return _Call("GET", "/v1/versions", s.Versions, params=params)

    @staticmethod
    def export_version(version: int) -> _Call:
        return _Call("GET", f"/v1/versions/{version}/export", params={"format": "safetensors"}, raw=True)

    @staticmethod
    def export_params() -> _Call:
        return _Call("POST", "/v1/params/export", s.ExportedParams)

    @staticmethod
    def checkpoint_manifest(version: int) -> _Call:
        return _Call("GET", f"/v1/checkpoints/{version}/manifest", s.Manifest)

    @staticmethod
    def usage() -> _Call:
        return _Call("GET", "/v1/usage", s.Usage)

    @staticmethod
    def train_batch(images: Any, state: Any, action: Any, action_is_pad: Any, instructions: Any) -> _Call:
        body = s.SampleBatch(**_samples(images, state, action, action_is_pad, instructions))
        return _Call("POST", "/v1/train_batch", s.TrainStepResult, body)

    @staticmethod
    def forward_backward(
        images: Any, state: Any, action: Any, action_is_pad: Any, instructions: Any, loss: str, advantages: Any
    ) -> _Call:
        body = s.ForwardBackwardRequest(
            **_samples(images, state, action, action_is_pad, instructions),
            loss=loss,
            advantages=_tensor(advantages, "advantages"),
        )
        return _Call("POST", "/v1/forward_backward", s.ForwardBackwardResult, body)

    @staticmethod
    def optim_step() -> _Call:
        return _Call("POST", "/v1/optim_step", s.OptimStepResult)

    @staticmethod
    def predict(
        images: Any,
        state: Any,
        instructions: Any,
        policy_version: Any,
        seeds: Any,
        session_id: Any,
        sample: bool,
        timeout_s: float,
    ) -> _Call:
        body = s.PredictRequest(
            observations=s.ObservationBatch(
                images=_tensor(images, "images", "image"), state=_tensor(state, "state"), instructions=instructions
            ),
            policy_version=policy_version,
            seeds=seeds,
            session_id=session_id,
            sample=sample,
            timeout_s=timeout_s,
        )
        return _Call("POST", "/v1/predict", s.PredictResult, body)

    @staticmethod
    def load_weights(payload: bytes | None, version: int | None) -> _Call:
        return _Call(
            "POST", "/v1/weights/load", s.LoadWeightsResult, s.LoadWeightsRequest(payload=payload, version=version)
        )

    @staticmethod
    def save(include_optim: bool) -> _Call:
        return _Call("POST", "/v1/save", s.Manifest, s.SaveRequest(include_optim=include_optim))

    @staticmethod
    def queue_put(partition: str, columns: dict[str, Any], indices: list[int] | None, task_name: str) -> _Call:
        body = s.QueuePut(columns=_columns(columns), indices=indices, task_name=task_name)
        return _Call("POST", f"/v1/queue/partitions/{partition}", s.PartitionInfo, body)

    @staticmethod
    def queue_get(partition: str, fields: list[str], batch_size: int, task_name: str) -> _Call:
        body = s.QueueGet(fields=fields, batch_size=batch_size, task_name=task_name)
        return _Call("POST", f"/v1/queue/partitions/{partition}/get", s.QueueBatch, body)

    @staticmethod
    def queue_describe(partition: str) -> _Call:
        return _Call("GET", f"/v1/queue/partitions/{partition}", s.PartitionInfo)

    @staticmethod
    def queue_partitions() -> _Call:
        return _Call("GET", "/v1/queue/partitions", list[s.PartitionInfo])

    @staticmethod
    def queue_clear(partition: str) -> _Call:
        return _Call("DELETE", f"/v1/queue/partitions/{partition}", s.Cleared)

    @staticmethod
    def open_session(config: dict[str, Any], rollout_id: str) -> _Call:
        return _Call("POST", "/v1/env/sessions", s.SessionInfo, s.SessionOpen(config=config, rollout_id=rollout_id))

    @staticmethod
    def sessions() -> _Call:
        return _Call("GET", "/v1/env/sessions", s.SessionList)

    @staticmethod
    def reset(session_id: str, seed: int | None) -> _Call:
        return _Call("POST", f"/v1/env/sessions/{session_id}/reset", s.EnvResult, s.EnvReset(seed=seed))

    @staticmethod
    def step(session_id: str, action: Any) -> _Call:
        body = s.EnvStep(action=_tensor(action, "action"))
        return _Call("POST", f"/v1/env/sessions/{session_id}/step", s.EnvResult, body)

    @staticmethod
    def close_session(session_id: str) -> _Call:
        return _Call("DELETE", f"/v1/env/sessions/{session_id}", s.Cleared)

    # admin
    @staticmethod
    def create_tenant(spec: Any, issue_key: bool) -> _Call:
        return _Call("POST", "/v1/admin/tenants", s.TenantCreated, _spec_dict(spec), params={"issue_key": issue_key})

    @staticmethod
    def tenants() -> _Call:
        return _Call("GET", "/v1/admin/tenants", list[s.TenantInfo])

    @staticmethod
    def issue_key(tenant_id: str, label: str) -> _Call:
        return _Call("POST", f"/v1/admin/tenants/{tenant_id}/keys", s.IssuedKey, s.IssueKeyRequest(label=label))

    @staticmethod
    def revoke_key(key_id: str) -> _Call:
        return _Call("DELETE", f"/v1/admin/keys/{key_id}", s.KeyInfo)

    @staticmethod
    def delete_tenant(tenant_id: str, delete_artifacts: bool) -> _Call:
        params = {"delete_artifacts": delete_artifacts}
        return _Call("DELETE", f"/v1/admin/tenants/{tenant_id}", s.TenantDeleted, params=params)

    @staticmethod
    def set_quota(
        tenant_id: str,
        max_device_seconds: float | None,
        max_queued_workloads: int | None,
        max_storage_bytes: int | None = None,
    ) -> _Call:
        body = s.QuotaUpdate(
            max_device_seconds=max_device_seconds,
            max_queued_workloads=max_queued_workloads,
            max_storage_bytes=max_storage_bytes,
        )
        return _Call("PUT", f"/v1/admin/tenants/{tenant_id}/quota", s.Quota, body.model_dump())

    @staticmethod
    def all_usage() -> _Call:
        return _Call("GET", "/v1/admin/usage", list[s.Usage])


def _next_versions_page(pages: list[s.Versions], after: int | None) -> int | None:
    """The `after` of the next page, or None when the last one is in (or the server does not move on)."""
    nxt = pages[-1].next_after
    return nxt if nxt is not None and (after is None or nxt > after) else None


def _merged_versions(pages: list[s.Versions]) -> s.Versions:
    """Every page's checkpoints under the last page's (freshest) training and serving state."""
    return pages[-1].model_copy(update={"checkpoints": [c for p in pages for c in p.checkpoints], "next_after": None})


class _SSEParser:
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


def _from_wire(value: Any) -> Any:
    """Environment results with their wire tensors turned back into numpy arrays."""
    if isinstance(value, dict):
        if set(value) == {"dtype", "shape", "data"}:
            try:
                return Tensor.model_validate(value).to_numpy()
            except ValidationError as error:
                raise InvalidResponse("a tensor of an environment result", _first_error(error)) from None
        return {k: _from_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_wire(v) for v in value]
    return value


# -- sync -------------------------------------------------------------------------------------


class WorkloadHandle:
    """A submitted workload: `.progress()` now, `.result(timeout)` when done, `.events()` live."""

    def __init__(self, client: JoyNexusClient, status: s.WorkloadInfo):
        self.client = client
        self.workload_id = status.workload_id
        self.submitted = status

    def __repr__(self) -> str:
        return f"WorkloadHandle({self.workload_id!r})"

    def progress(self) -> s.WorkloadInfo:
        return self.client.workload(self.workload_id)

    def done(self) -> bool:
        return self.progress().done

    def cancel(self) -> s.WorkloadInfo:
        return self.client.cancel(self.workload_id)

    def events(self, after: int = 0) -> Iterator[s.WorkloadEvent]:
        """Live progress and metric events (Server-Sent Events) until the workload ends."""
        return self.client.stream(self.workload_id, after)

    def result(self, timeout: float | None = None, *, poll_s: float = 0.5) -> s.WorkloadInfo:
        """Wait for the final status; WorkloadFailed if it failed or was cancelled, WorkloadTimeout
        (a TimeoutError) if `timeout` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.progress()
            if status.done:
                if status.state != "completed":
                    raise WorkloadFailed(status)
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise WorkloadTimeout(status, timeout)
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))


class JoyNexusClient(_Base):
    """Synchronous client. `base_url` / `api_key` default to env JOYNEXUS_URL / JOYNEXUS_API_KEY."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout_s: float = 120.0,
        retry: RetryPolicy | None = None,
        wire: Literal["msgpack", "json"] = "msgpack",
        http: httpx.Client | None = None,
    ):
        super().__init__(base_url, api_key, timeout_s=timeout_s, retry=retry, wire=wire)
        self._http = http or _http_client(httpx.Client, self.base_url, timeout_s)
        self._owns_http = http is None

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> JoyNexusClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, call: _Call) -> Any:
        kwargs = self._request_kwargs(call)
        attempt = 0
        while True:
            try:
                response = self._http.request(call.method, call.path, **kwargs)
            except Exception as error:
                if not self._should_retry(attempt, None, error):
                    raise _transport_error(self.base_url, error) from error
                time.sleep(self.retry.delay(attempt))
            else:
                if not self._should_retry(attempt, response, None):
                    return self._parse(call, response)
                time.sleep(self.retry.delay(attempt, response.headers.get("retry-after")))
            attempt += 1

    # upper layer
    def tenant(self) -> s.TenantInfo:
        return self._run(_Calls.tenant())

    def submit(self, spec: Any = None, *, jobs: int | None = None) -> WorkloadHandle:
        """Submit a workload of the tenant's task; returns at once with a handle."""
        return WorkloadHandle(self, self._run(_Calls.submit(spec, jobs)))

    def evaluate(
        self, *, version: int | None = None, episodes: int = 4, environment: dict[str, Any] | None = None
    ) -> WorkloadHandle:
        """Start an evaluation workload of one policy version; the handle's result has `.result`."""
        return WorkloadHandle(self, self._run(_Calls.evaluate(version, episodes, environment)))

    def workload(self, workload_id: str) -> s.WorkloadInfo:
        return self._run(_Calls.workload(workload_id))

    def handle(self, workload_id: str) -> WorkloadHandle:
        return WorkloadHandle(self, self.workload(workload_id))

    def workloads(self) -> list[s.WorkloadInfo]:
        return self._run(_Calls.workloads())

    def cancel(self, workload_id: str) -> s.WorkloadInfo:
        return self._run(_Calls.cancel(workload_id))

    def events(self, workload_id: str, after: int = 0) -> s.WorkloadEvents:
        return self._run(_Calls.events(workload_id, after))

    def stream(self, workload_id: str, after: int = 0) -> Iterator[s.WorkloadEvent]:
        """Server-Sent Events of a workload until it ends; reconnects after a dropped connection."""
        attempt = 0
        while True:
            try:
                headers = {**self._headers(), "Accept": "text/event-stream"}
                path = f"/v1/workloads/{workload_id}/stream"
                with self._http.stream("GET", path, params={"after": after}, headers=headers, timeout=None) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                        raise _error(resp)
                    parser = _SSEParser()
                    for line in resp.iter_lines():
                        parsed = parser.feed(line)
                        if parsed is None:
                            continue
                        kind, data = parsed
                        if kind == "end":
                            return
                        if kind == "error":
                            raise _stream_error(data)
                        event = _event(data)
                        after = event.seq
                        attempt = 0
                        yield event
                    return
            except TRANSIENT_ERRORS as error:
                if attempt + 1 >= self.retry.attempts:
                    raise ConnectionFailed(self.base_url, error) from error
                time.sleep(self.retry.delay(attempt))
                attempt += 1
            except JoyNexusError:
                raise
            except Exception as error:  # any other failure of the connection (httpx, the transport)
                raise ConnectionFailed(self.base_url, error) from error

    def versions(self, *, after: int | None = None, limit: int | None = None) -> s.Versions:
        """The tenant's versions. With `limit`, one page of checkpoints (versions > `after`, None:
        from the first; its `next_after` continues); without, every one of them, page by page."""
        if limit is not None:
            return self._run(_Calls.versions(after, limit))
        pages = [self._run(_Calls.versions(after, VERSIONS_PAGE))]
        while (nxt := _next_versions_page(pages, after)) is not None:
            after = nxt
            pages.append(self._run(_Calls.versions(after, VERSIONS_PAGE)))
        return _merged_versions(pages)

    def export(self, version: int | None = None, path: str | Path | None = None) -> bytes:
        """A tenant payload (safetensors bytes): a version, or the current training parameters."""
        if version is None:
            payload = self._run(_Calls.export_params()).payload
        else:
            payload = self._run(_Calls.export_version(version))
        if path is not None:
            try:
                Path(path).write_bytes(payload)
            except OSError as error:
                raise InvalidArgument([("path", f"cannot write {str(path)!r}: {error.strerror or error}")]) from None
        return payload

    def checkpoint_manifest(self, version: int) -> s.Manifest:
        return self._run(_Calls.checkpoint_manifest(version))

    def usage(self) -> s.Usage:
        return self._run(_Calls.usage())

    # lower layer
    def train_batch(
        self, images: Any, state: Any, action: Any, *, action_is_pad: Any = None, instructions: list[str] | None = None
    ) -> s.TrainStepResult:
        return self._run(_Calls.train_batch(images, state, action, action_is_pad, instructions))

    def forward_backward(
        self,
        images: Any,
        state: Any,
        action: Any,
        *,
        action_is_pad: Any = None,
        instructions: list[str] | None = None,
        loss: Literal["default", "advantage_weighted", "policy_gradient"] = "default",
        advantages: Any = None,
    ) -> s.ForwardBackwardResult:
        return self._run(_Calls.forward_backward(images, state, action, action_is_pad, instructions, loss, advantages))

    def optim_step(self) -> s.OptimStepResult:
        return self._run(_Calls.optim_step())

    def predict(
        self,
        images: Any,
        state: Any,
        *,
        instructions: list[str] | None = None,
        policy_version: int | None = None,
        seeds: list[int] | None = None,
        session_id: str | None = None,
        sample: bool = False,
        timeout_s: float = 60.0,
    ) -> s.PredictResult:
        call = _Calls.predict(images, state, instructions, policy_version, seeds, session_id, sample, timeout_s)
        return self._run(call)

    def export_params(self) -> s.ExportedParams:
        return self._run(_Calls.export_params())

    def load_weights(self, payload: bytes | None = None, *, version: int | None = None) -> s.LoadWeightsResult:
        return self._run(_Calls.load_weights(payload, version))

    def save(self, include_optim: bool = True) -> s.Manifest:
        return self._run(_Calls.save(include_optim))

    def queue_put(
        self, partition: str, columns: dict[str, Any], *, indices: list[int] | None = None, task_name: str = "api"
    ) -> s.PartitionInfo:
        return self._run(_Calls.queue_put(partition, columns, indices, task_name))

    def queue_get(self, partition: str, fields: list[str], batch_size: int, task_name: str = "train") -> s.QueueBatch:
        return self._run(_Calls.queue_get(partition, fields, batch_size, task_name))

    def queue_describe(self, partition: str) -> s.PartitionInfo:
        return self._run(_Calls.queue_describe(partition))

    def queue_partitions(self) -> list[s.PartitionInfo]:
        return self._run(_Calls.queue_partitions())

    def queue_clear(self, partition: str) -> s.Cleared:
        return self._run(_Calls.queue_clear(partition))

    def open_session(self, config: dict[str, Any], *, rollout_id: str = "api") -> s.SessionInfo:
        """Open an environment session; `.session_id`, and `.spec` (action_dim, cameras, ...)."""
        return self._run(_Calls.open_session(config, rollout_id))

    def sessions(self) -> list[s.SessionInfo]:
        return self._run(_Calls.sessions()).sessions

    def reset(self, session_id: str, seed: int | None = None) -> dict[str, Any]:
        return _from_wire(self._run(_Calls.reset(session_id, seed)).data)

    def step(self, session_id: str, action: Any) -> dict[str, Any]:
        return _from_wire(self._run(_Calls.step(session_id, action)).data)

    def close_session(self, session_id: str) -> s.Cleared:
        return self._run(_Calls.close_session(session_id))

    # admin (with the admin key)
    def create_tenant(self, spec: Any, *, issue_key: bool = True) -> s.TenantCreated:
        return self._run(_Calls.create_tenant(spec, issue_key))

    def tenants(self) -> list[s.TenantInfo]:
        return self._run(_Calls.tenants())

    def issue_key(self, tenant_id: str, label: str = "") -> s.IssuedKey:
        return self._run(_Calls.issue_key(tenant_id, label))

    def revoke_key(self, key_id: str) -> s.KeyInfo:
        return self._run(_Calls.revoke_key(key_id))

    def delete_tenant(self, tenant_id: str, *, delete_artifacts: bool = False) -> s.TenantDeleted:
        """Delete a tenant with its keys, slots, queue data (and with `delete_artifacts` its
        checkpoints and registered model)."""
        return self._run(_Calls.delete_tenant(tenant_id, delete_artifacts))

    def set_quota(
        self,
        tenant_id: str,
        *,
        max_device_seconds: float | None = None,
        max_queued_workloads: int | None = None,
        max_storage_bytes: int | None = None,
    ) -> s.Quota:
        call = _Calls.set_quota(tenant_id, max_device_seconds, max_queued_workloads, max_storage_bytes)
        return self._run(call)

    def all_usage(self) -> list[s.Usage]:
        return self._run(_Calls.all_usage())


# -- async ------------------------------------------------------------------------------------


class AsyncWorkloadHandle:
    def __init__(self, client: AsyncJoyNexusClient, status: s.WorkloadInfo):
        self.client = client
        self.workload_id = status.workload_id
        self.submitted = status

    async def progress(self) -> s.WorkloadInfo:
        return await self.client.workload(self.workload_id)

    async def cancel(self) -> s.WorkloadInfo:
        return await self.client.cancel(self.workload_id)

    def events(self, after: int = 0) -> AsyncIterator[s.WorkloadEvent]:
        return self.client.stream(self.workload_id, after)

    async def result(self, timeout: float | None = None, *, poll_s: float = 0.5) -> s.WorkloadInfo:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = await self.progress()
            if status.done:
                if status.state != "completed":
                    raise WorkloadFailed(status)
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise WorkloadTimeout(status, timeout)
            await asyncio.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))


class AsyncJoyNexusClient(_Base):
    """The same API with `await`; many calls can be in flight at once (e.g. `asyncio.gather`)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout_s: float = 120.0,
        retry: RetryPolicy | None = None,
        wire: Literal["msgpack", "json"] = "msgpack",
        http: httpx.AsyncClient | None = None,
    ):
        super().__init__(base_url, api_key, timeout_s=timeout_s, retry=retry, wire=wire)
        self._http = http or _http_client(httpx.AsyncClient, self.base_url, timeout_s)
        self._owns_http = http is None

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncJoyNexusClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self, call: _Call) -> Any:
        kwargs = self._request_kwargs(call)
        attempt = 0
        while True:
            try:
                response = await self._http.request(call.method, call.path, **kwargs)
            except Exception as error:
                if not self._should_retry(attempt, None, error):
                    raise _transport_error(self.base_url, error) from error
                await asyncio.sleep(self.retry.delay(attempt))
            else:
                if not self._should_retry(attempt, response, None):
                    return self._parse(call, response)
                await asyncio.sleep(self.retry.delay(attempt, response.headers.get("retry-after")))
            attempt += 1

    async def tenant(self) -> s.TenantInfo:
        return await self._run(_Calls.tenant())

    async def submit(self, spec: Any = None, *, jobs: int | None = None) -> AsyncWorkloadHandle:
        return AsyncWorkloadHandle(self, await self._run(_Calls.submit(spec, jobs)))

    async def evaluate(
        self, *, version: int | None = None, episodes: int = 4, environment: dict[str, Any] | None = None
    ) -> AsyncWorkloadHandle:
        return AsyncWorkloadHandle(self, await self._run(_Calls.evaluate(version, episodes, environment)))

    async def workload(self, workload_id: str) -> s.WorkloadInfo:
        return await self._run(_Calls.workload(workload_id))

    async def workloads(self) -> list[s.WorkloadInfo]:
        return await self._run(_Calls.workloads())

    async def cancel(self, workload_id: str) -> s.WorkloadInfo:
        return await self._run(_Calls.cancel(workload_id))

    async def events(self, workload_id: str, after: int = 0) -> s.WorkloadEvents:
        return await self._run(_Calls.events(workload_id, after))

    async def stream(self, workload_id: str, after: int = 0) -> AsyncIterator[s.WorkloadEvent]:
        headers = {**self._headers(), "Accept": "text/event-stream"}
        path = f"/v1/workloads/{workload_id}/stream"
        try:
            async with self._http.stream("GET", path, params={"after": after}, headers=headers, timeout=None) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise _error(resp)
                parser = _SSEParser()
                async for line in resp.aiter_lines():
                    parsed = parser.feed(line)
                    if parsed is None:
                        continue
                    kind, data = parsed
                    if kind == "end":
                        return
                    if kind == "error":
                        raise _stream_error(data)
                    yield _event(data)
        except JoyNexusError:
            raise
        except Exception as error:  # the connection failed (httpx, the transport)
            raise ConnectionFailed(self.base_url, error) from error

    async def versions(self, *, after: int | None = None, limit: int | None = None) -> s.Versions:
        """As `JoyNexusClient.versions`: one page with `limit`, else every checkpoint page by page."""
        if limit is not None:
            return await self._run(_Calls.versions(after, limit))
        pages = [await self._run(_Calls.versions(after, VERSIONS_PAGE))]
        while (nxt := _next_versions_page(pages, after)) is not None:
            after = nxt
            pages.append(await self._run(_Calls.versions(after, VERSIONS_PAGE)))
        return _merged_versions(pages)

    async def export(self, version: int | None = None) -> bytes:
        if version is None:
            return (await self._run(_Calls.export_params())).payload
        return await self._run(_Calls.export_version(version))

    async def checkpoint_manifest(self, version: int) -> s.Manifest:
        return await self._run(_Calls.checkpoint_manifest(version))

    async def usage(self) -> s.Usage:
        return await self._run(_Calls.usage())

    async def train_batch(
        self, images: Any, state: Any, action: Any, *, action_is_pad: Any = None, instructions: list[str] | None = None
    ) -> s.TrainStepResult:
        return await self._run(_Calls.train_batch(images, state, action, action_is_pad, instructions))

    async def forward_backward(
        self,
        images: Any,
        state: Any,
        action: Any,
        *,
        action_is_pad: Any = None,
        instructions: list[str] | None = None,
        loss: Literal["default", "advantage_weighted", "policy_gradient"] = "default",
        advantages: Any = None,
    ) -> s.ForwardBackwardResult:
        return await self._run(
            _Calls.forward_backward(images, state, action, action_is_pad, instructions, loss, advantages)
        )

    async def optim_step(self) -> s.OptimStepResult:
        return await self._run(_Calls.optim_step())

    async def predict(
        self,
        images: Any,
        state: Any,
        *,
        instructions: list[str] | None = None,
        policy_version: int | None = None,
        seeds: list[int] | None = None,
        session_id: str | None = None,
        sample: bool = False,
        timeout_s: float = 60.0,
    ) -> s.PredictResult:
        call = _Calls.predict(images, state, instructions, policy_version, seeds, session_id, sample, timeout_s)
        return await self._run(call)

    async def export_params(self) -> s.ExportedParams:
        return await self._run(_Calls.export_params())

    async def load_weights(self, payload: bytes | None = None, *, version: int | None = None) -> s.LoadWeightsResult:
        return await self._run(_Calls.load_weights(payload, version))

    async def save(self, include_optim: bool = True) -> s.Manifest:
        return await self._run(_Calls.save(include_optim))

    async def queue_put(
        self, partition: str, columns: dict[str, Any], *, indices: list[int] | None = None, task_name: str = "api"
    ) -> s.PartitionInfo:
        return await self._run(_Calls.queue_put(partition, columns, indices, task_name))

    async def queue_get(
        self, partition: str, fields: list[str], batch_size: int, task_name: str = "train"
    ) -> s.QueueBatch:
        return await self._run(_Calls.queue_get(partition, fields, batch_size, task_name))

    async def queue_clear(self, partition: str) -> s.Cleared:
        return await self._run(_Calls.queue_clear(partition))

    async def open_session(self, config: dict[str, Any], *, rollout_id: str = "api") -> s.SessionInfo:
        return await self._run(_Calls.open_session(config, rollout_id))

    async def reset(self, session_id: str, seed: int | None = None) -> dict[str, Any]:
        return _from_wire((await self._run(_Calls.reset(session_id, seed))).data)

    async def step(self, session_id: str, action: Any) -> dict[str, Any]:
        return _from_wire((await self._run(_Calls.step(session_id, action))).data)

    async def close_session(self, session_id: str) -> s.Cleared:
        return await self._run(_Calls.close_session(session_id))
