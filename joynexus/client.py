"""Python client of the JoyNexus tenant API: `JoyNexusClient` (sync) and `AsyncJoyNexusClient`.

Both speak the server's own pydantic models (`joynexus.protocol.schemas`), so results are typed:

    from joynexus.client import JoyNexusClient

    with JoyNexusClient("http://127.0.0.1:8765", api_key) as client:
        handle = client.submit(jobs=4)              # a workload handle, returned at once
        print(handle.progress().completed_jobs)     # where it is now
        final = handle.result(timeout=600)          # waits; raises WorkloadFailed if it failed
        step = client.train_batch(images, state, action)   # lower layer: one optimizer step

Tensors go in as numpy arrays (or torch CPU tensors) and come back as `wire.Tensor`
(`.to_numpy()`). Bodies are msgpack by default (raw tensor bytes); `wire="json"` sends JSON.

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
from pydantic import BaseModel, TypeAdapter

from joynexus.protocol import schemas as s
from joynexus.protocol.wire import JSON_MEDIA_TYPE, MSGPACK_MEDIA_TYPE, Tensor, msgpack_dumps, msgpack_loads, tensor

__all__ = [
    "ApiRequestError",
    "AsyncJoyNexusClient",
    "AsyncWorkloadHandle",
    "JoyNexusClient",
    "JoyNexusError",
    "RetryPolicy",
    "ServerError",
    "WorkloadFailed",
    "WorkloadHandle",
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


class JoyNexusError(Exception):
    """An error answer of the API: HTTP status, machine-readable code, message, field problems."""

    def __init__(self, status_code: int, body: s.ErrorBody):
        self.status_code = status_code
        self.code = body.code
        self.message = body.message
        self.problems = body.problems
        super().__init__(f"{status_code} {body.code}: {body.message}")


class ApiRequestError(JoyNexusError):
    """4xx: the request was wrong (or refused); retrying the same request will not help."""


class ServerError(JoyNexusError):
    """5xx (after the retries, for 502 / 503 / 504)."""


class WorkloadFailed(RuntimeError):
    def __init__(self, status: s.WorkloadInfo):
        self.status = status
        super().__init__(f"workload {status.workload_id} {status.state}: {status.error}")


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
    data = _json_or_none(response)
    try:
        body = s.ErrorBody.model_validate(data)
    except Exception:
        body = s.ErrorBody(code="http_error", message=response.text[:500] or response.reason_phrase)
    cls = ApiRequestError if response.status_code < 500 else ServerError
    return cls(response.status_code, body)


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
            else:
                kwargs["json"] = data
        return kwargs

    @staticmethod
    def _parse(call: _Call, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            raise _error(response)
        if call.raw:
            return response.content
        media = response.headers.get("content-type", "").split(";")[0].strip()
        data = msgpack_loads(response.content) if media == MSGPACK_MEDIA_TYPE else response.json()
        if call.model is None:
            return data
        return _adapter(call.model).validate_python(data)

    def _should_retry(self, attempt: int, response: httpx.Response | None, error: Exception | None) -> bool:
        if attempt + 1 >= self.retry.attempts:
            return False
        if error is not None:
            return isinstance(error, TRANSIENT_ERRORS)
        return response is not None and response.status_code in self.retry.retry_statuses


# -- request builders (shared by both clients) ---------------------------------------------------


def _spec_dict(spec: Any) -> dict[str, Any] | None:
    if spec is None:
        return None
    if isinstance(spec, str | Path):
        import yaml

        data = yaml.safe_load(Path(spec).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"spec file {str(spec)!r} does not hold a mapping")
        return data
    if isinstance(spec, BaseModel):
        return spec.model_dump(mode="json")
    return dict(spec)


def _tensor(value: Any) -> Tensor | None:
    if value is None or isinstance(value, Tensor):
        return value
    return tensor(value)


def _samples(images: Any, state: Any, action: Any, action_is_pad: Any, instructions: list[str] | None) -> dict:
    return {
        "images": _tensor(images),
        "state": _tensor(state),
        "action": _tensor(action),
        "action_is_pad": _tensor(action_is_pad),
        "instructions": instructions,
    }


def _columns(columns: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, list | tuple) else _tensor(v) for k, v in columns.items()}


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
            **_samples(images, state, action, action_is_pad, instructions), loss=loss, advantages=_tensor(advantages)
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
            observations=s.ObservationBatch(images=_tensor(images), state=_tensor(state), instructions=instructions),
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
        return _Call("POST", f"/v1/env/sessions/{session_id}/step", s.EnvResult, s.EnvStep(action=_tensor(action)))

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
            return Tensor.model_validate(value).to_numpy()
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
        """Wait for the final status; WorkloadFailed if it failed or was cancelled, TimeoutError
        if `timeout` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.progress()
            if status.done:
                if status.state != "completed":
                    raise WorkloadFailed(status)
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"workload {self.workload_id} is still {status.state} after {timeout} s")
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
        self._http = http or httpx.Client(base_url=self.base_url, timeout=timeout_s)
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
                    raise
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
                            raise ApiRequestError(404, s.ErrorBody.model_validate_json(data))
                        event = s.WorkloadEvent.model_validate_json(data)
                        after = event.seq
                        attempt = 0
                        yield event
                    return
            except TRANSIENT_ERRORS:
                if attempt + 1 >= self.retry.attempts:
                    raise
                time.sleep(self.retry.delay(attempt))
                attempt += 1

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
            Path(path).write_bytes(payload)
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
                raise TimeoutError(f"workload {self.workload_id} is still {status.state} after {timeout} s")
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
        self._http = http or httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)
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
                    raise
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
                    raise ApiRequestError(404, s.ErrorBody.model_validate_json(data))
                yield s.WorkloadEvent.model_validate_json(data)

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
