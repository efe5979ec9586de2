"""The synchronous tenant API client, `JoyNexusClient`, and its `WorkloadHandle`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx

from joynexus.client.calls import Calls, dataset_archive, default_repo_id, merged_versions, next_versions_page
from joynexus.client.errors import (
    ConnectionFailed,
    InvalidArgument,
    JoyNexusError,
    WorkloadFailed,
    WorkloadTimeout,
)
from joynexus.client.futures import SyncFutureCalls
from joynexus.client.transport import (
    TRANSIENT_ERRORS,
    Call,
    ClientBase,
    RetryPolicy,
    SSEParser,
    from_wire,
    http_client,
    parse_event,
    response_error,
    stream_error,
    transport_error,
)
from joynexus.protocol import schemas as s
from joynexus.protocol import state_control as sc

# How long `stream` keeps reconnecting without contact (a server restart takes seconds to minutes).
STREAM_RECONNECT_S = 300.0


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


class JoyNexusClient(ClientBase, SyncFutureCalls):
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
        self._http = http or http_client(httpx.Client, self.base_url, timeout_s)
        self._owns_http = http is None

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> JoyNexusClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, call: Call) -> Any:
        kwargs = self._request_kwargs(call)
        attempt = 0
        while True:
            try:
                response = self._http.request(call.method, call.path, **kwargs)
            except Exception as error:
                if not self._should_retry(attempt, None, error):
                    raise transport_error(self.base_url, error) from error
                time.sleep(self.retry.delay(attempt))
            else:
                if not self._should_retry(attempt, response, None):
                    return self._parse(call, response)
                time.sleep(self.retry.delay(attempt, response.headers.get("retry-after"), response.status_code))
            attempt += 1

    # upper layer
    def tenant(self) -> s.TenantInfo:
        return self._run(Calls.tenant())

    def submit(self, spec: Any = None, *, jobs: int | None = None) -> WorkloadHandle:
        """Submit a workload of the tenant's task; returns at once with a handle."""
        return WorkloadHandle(self, self._run(Calls.submit(spec, jobs)))

    def evaluate(
        self,
        *,
        version: int | None = None,
        episodes: int = 4,
        environment: dict[str, Any] | None = None,
        suite: list[dict[str, Any]] | None = None,
        videos: int = 0,
    ) -> WorkloadHandle:
        """Start an evaluation workload of one policy version; the handle's result has `.result`
        (with a `suite`: each entry's success and 95% interval; `videos`: mp4s in its MLflow run)."""
        return WorkloadHandle(self, self._run(Calls.evaluate(version, episodes, environment, suite, videos)))

    def workload(self, workload_id: str) -> s.WorkloadInfo:
        return self._run(Calls.workload(workload_id))

    def handle(self, workload_id: str) -> WorkloadHandle:
        return WorkloadHandle(self, self.workload(workload_id))

    def workloads(self) -> list[s.WorkloadInfo]:
        return self._run(Calls.workloads())

    def cancel(self, workload_id: str) -> s.WorkloadInfo:
        return self._run(Calls.cancel(workload_id))

    def events(self, workload_id: str, after: int = 0) -> s.WorkloadEvents:
        return self._run(Calls.events(workload_id, after))

    def stream(
        self, workload_id: str, after: int = 0, *, reconnect_s: float = STREAM_RECONNECT_S
    ) -> Iterator[s.WorkloadEvent]:
        """Server-Sent Events of a workload until it ends. A dropped connection or a restarting
        server (the stream closes without its `end`, connections are refused, 502/503/504) is
        reconnected from the last event received, for up to `reconnect_s` seconds without contact
        (before the first contact, the retry policy's attempts)."""
        attempt, lost_at, why, contacted = 0, None, None, False
        while True:
            try:
                headers = {**self._headers(), "Accept": "text/event-stream"}
                path = f"/v1/workloads/{workload_id}/stream"
                with self._http.stream("GET", path, params={"after": after}, headers=headers, timeout=None) as resp:
                    if resp.status_code in self.retry.retry_statuses:  # the server is (re)starting
                        resp.read()
                        raise httpx.RemoteProtocolError(f"HTTP {resp.status_code} from the stream")
                    if resp.status_code >= 400:
                        resp.read()
                        raise response_error(resp)
                    parser, contacted = SSEParser(), True
                    for line in resp.iter_lines():
                        attempt, lost_at = 0, None  # in contact (events and keep-alives)
                        parsed = parser.feed(line)
                        if parsed is None:
                            continue
                        kind, data = parsed
                        if kind == "end":
                            return
                        if kind == "error":
                            raise stream_error(data)
                        event = parse_event(data)
                        after = event.seq
                        yield event
                why = httpx.RemoteProtocolError("the stream closed before the workload ended")  # a restart
            except TRANSIENT_ERRORS as error:
                why = error
            except JoyNexusError:
                raise
            except Exception as error:  # any other failure of the connection (httpx, the transport)
                raise ConnectionFailed(self.base_url, error) from error
            lost_at = time.monotonic() if lost_at is None else lost_at
            if time.monotonic() - lost_at > reconnect_s or (not contacted and attempt + 1 >= self.retry.attempts):
                raise ConnectionFailed(self.base_url, why) from why
            time.sleep(self.retry.delay(attempt))
            attempt += 1

    def versions(self, *, after: int | None = None, limit: int | None = None) -> s.Versions:
        """The tenant's versions. With `limit`, one page of checkpoints (versions > `after`, None:
        from the first; its `next_after` continues); without, every one of them, page by page."""
        if limit is not None:
            return self._run(Calls.versions(after, limit))
        pages = [self._run(Calls.versions_page(after))]
        while (nxt := next_versions_page(pages, after)) is not None:
            after = nxt
            pages.append(self._run(Calls.versions_page(after)))
        return merged_versions(pages)

    def export(self, version: int | None = None, path: str | Path | None = None) -> bytes:
        """A tenant payload (safetensors bytes): a version, or the current training parameters."""
        if version is None:
            payload = self._run(Calls.export_params()).payload
        else:
            payload = self._run(Calls.export_version(version))
        if path is not None:
            try:
                Path(path).write_bytes(payload)
            except OSError as error:
                raise InvalidArgument([("path", f"cannot write {str(path)!r}: {error.strerror or error}")]) from None
        return payload

    def delete_version(self, version: int) -> s.VersionDeleted:
        """Delete one checkpointed version (not the latest, a registered or a served one) to free
        its storage; allowed at or over the storage quota."""
        return self._run(Calls.delete_version(version))

    def checkpoint_manifest(self, version: int) -> s.Manifest:
        return self._run(Calls.checkpoint_manifest(version))

    def usage(self) -> s.Usage:
        return self._run(Calls.usage())

    def upload_dataset(self, path: str | Path, *, repo_id: str | None = None) -> s.DatasetInfo:
        """Upload a LeRobot dataset (a folder, packed here, or a tar / zip archive) for your tenant;
        name it in a workload's spec as ``dataset: {id: <dataset_id>, repo_id: ...}``. `repo_id`
        defaults to ``local/<folder name>``."""
        archive, name = dataset_archive(path)
        return self._run(Calls.upload_dataset(archive, repo_id or default_repo_id(name)))

    def datasets(self) -> list[s.DatasetInfo]:
        """Your tenant's uploaded datasets."""
        return self._run(Calls.datasets())

    def delete_dataset(self, dataset_id: str) -> s.DatasetDeleted:
        """Delete an upload (not one a queued or running workload trains on) to free its storage."""
        return self._run(Calls.delete_dataset(dataset_id))

    # lower layer
    def train_batch(
        self, images: Any, state: Any, action: Any, *, action_is_pad: Any = None, instructions: list[str] | None = None
    ) -> s.TrainStepResult:
        return self._run(Calls.train_batch(images, state, action, action_is_pad, instructions))

    def forward_backward(
        self,
        images: Any,
        state: Any,
        action: Any,
        *,
        action_is_pad: Any = None,
        instructions: list[str] | None = None,
        loss: s.ForwardBackwardLoss = "default",
        advantages: Any = None,
        sampling_logprobs: Any = None,
        loss_config: dict[str, Any] | None = None,
    ) -> s.ForwardBackwardResult:
        call = Calls.forward_backward(
            images, state, action, action_is_pad, instructions, loss, advantages, sampling_logprobs, loss_config
        )
        return self._run(call)

    def optim_step(
        self,
        *,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        weight_decay: float | None = None,
        grad_clip: float | None = None,
    ) -> s.OptimStepResult:
        """Apply the pending gradients; the keywords set this step's AdamW hyperparameters only."""
        return self._run(Calls.optim_step(lr, betas, weight_decay, grad_clip))

    def load_state(self, version: int) -> sc.LoadStateResult:
        """Roll the training slot (module, adapter, optimizer) back to kept checkpoint `version`."""
        return self._run(Calls.load_state(version))

    def fork(
        self,
        new_tenant: str,
        *,
        version: int | None = None,
        learning_rate: float | None = None,
        seed: int | None = None,
    ) -> sc.TenantForked:
        """A new tenant from `version` (None: the current one) with another learning rate / seed;
        the answer carries its first API key."""
        return self._run(Calls.fork(new_tenant, version, learning_rate, seed))

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
        call = Calls.predict(images, state, instructions, policy_version, seeds, session_id, sample, timeout_s)
        return self._run(call)

    def export_params(self) -> s.ExportedParams:
        return self._run(Calls.export_params())

    def load_weights(self, payload: bytes | None = None, *, version: int | None = None) -> s.LoadWeightsResult:
        return self._run(Calls.load_weights(payload, version))

    def save(self, include_optim: bool = True) -> s.Manifest:
        return self._run(Calls.save(include_optim))

    def queue_put(
        self, partition: str, columns: dict[str, Any], *, indices: list[int] | None = None, task_name: str = "api"
    ) -> s.PartitionInfo:
        return self._run(Calls.queue_put(partition, columns, indices, task_name))

    def queue_get(self, partition: str, fields: list[str], batch_size: int, task_name: str = "train") -> s.QueueBatch:
        return self._run(Calls.queue_get(partition, fields, batch_size, task_name))

    def queue_describe(self, partition: str) -> s.PartitionInfo:
        return self._run(Calls.queue_describe(partition))

    def queue_partitions(self) -> list[s.PartitionInfo]:
        return self._run(Calls.queue_partitions())

    def queue_clear(self, partition: str) -> s.Cleared:
        return self._run(Calls.queue_clear(partition))

    def open_session(self, config: dict[str, Any], *, rollout_id: str = "api") -> s.SessionInfo:
        """Open an environment session; `.session_id`, and `.spec` (action_dim, cameras, ...)."""
        return self._run(Calls.open_session(config, rollout_id))

    def sessions(self) -> list[s.SessionInfo]:
        return self._run(Calls.sessions()).sessions

    def reset(self, session_id: str, seed: int | None = None) -> dict[str, Any]:
        return from_wire(self._run(Calls.reset(session_id, seed)).data)

    def step(self, session_id: str, action: Any) -> dict[str, Any]:
        return from_wire(self._run(Calls.step(session_id, action)).data)

    def close_session(self, session_id: str) -> s.Cleared:
        return self._run(Calls.close_session(session_id))

    # admin (with the admin key)
    def create_tenant(self, spec: Any, *, issue_key: bool = True) -> s.TenantCreated:
        return self._run(Calls.create_tenant(spec, issue_key))

    def tenants(self) -> list[s.TenantInfo]:
        return self._run(Calls.tenants())

    def issue_key(self, tenant_id: str, label: str = "") -> s.IssuedKey:
        return self._run(Calls.issue_key(tenant_id, label))

    def revoke_key(self, key_id: str) -> s.KeyInfo:
        return self._run(Calls.revoke_key(key_id))

    def delete_tenant(self, tenant_id: str, *, delete_artifacts: bool = False) -> s.TenantDeleted:
        """Delete a tenant with its keys, slots, queue data (and with `delete_artifacts` its
        checkpoints and registered model)."""
        return self._run(Calls.delete_tenant(tenant_id, delete_artifacts))

    def purge_tenant_artifacts(self, tenant_id: str) -> s.TenantDeleted:
        """Delete the checkpoints and registered model a deleted tenant left, freeing its id."""
        return self._run(Calls.purge_tenant_artifacts(tenant_id))

    def set_quota(
        self,
        tenant_id: str,
        *,
        max_device_seconds: float | None = None,
        max_queued_workloads: int | None = None,
        max_storage_bytes: int | None = None,
    ) -> s.Quota:
        call = Calls.set_quota(tenant_id, max_device_seconds, max_queued_workloads, max_storage_bytes)
        return self._run(call)

    def all_usage(self) -> list[s.Usage]:
        return self._run(Calls.all_usage())
