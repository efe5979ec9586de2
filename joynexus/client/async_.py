"""The asyncio tenant API client, `AsyncJoyNexusClient`, and its `AsyncWorkloadHandle`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import httpx

from joynexus.client.calls import Calls, dataset_archive, default_repo_id, merged_versions, next_versions_page
from joynexus.client.errors import (
    ConnectionFailed,
    JoyNexusError,
    WorkloadFailed,
    WorkloadTimeout,
)
from joynexus.client.futures import AsyncFutureCalls
from joynexus.client.transport import (
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


class AsyncJoyNexusClient(ClientBase, AsyncFutureCalls):
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
        self._http = http or http_client(httpx.AsyncClient, self.base_url, timeout_s)
        self._owns_http = http is None

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncJoyNexusClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self, call: Call) -> Any:
        kwargs = self._request_kwargs(call)
        attempt = 0
        while True:
            try:
                response = await self._http.request(call.method, call.path, **kwargs)
            except Exception as error:
                if not self._should_retry(attempt, None, error):
                    raise transport_error(self.base_url, error) from error
                await asyncio.sleep(self.retry.delay(attempt))
            else:
                if not self._should_retry(attempt, response, None):
                    return self._parse(call, response)
                retry_after = response.headers.get("retry-after")
                await asyncio.sleep(self.retry.delay(attempt, retry_after, response.status_code))
            attempt += 1

    async def tenant(self) -> s.TenantInfo:
        return await self._run(Calls.tenant())

    async def submit(self, spec: Any = None, *, jobs: int | None = None) -> AsyncWorkloadHandle:
        return AsyncWorkloadHandle(self, await self._run(Calls.submit(spec, jobs)))

    async def evaluate(
        self,
        *,
        version: int | None = None,
        episodes: int = 4,
        environment: dict[str, Any] | None = None,
        suite: list[dict[str, Any]] | None = None,
        videos: int = 0,
    ) -> AsyncWorkloadHandle:
        return AsyncWorkloadHandle(
            self, await self._run(Calls.evaluate(version, episodes, environment, suite, videos))
        )

    async def workload(self, workload_id: str) -> s.WorkloadInfo:
        return await self._run(Calls.workload(workload_id))

    async def workloads(self) -> list[s.WorkloadInfo]:
        return await self._run(Calls.workloads())

    async def cancel(self, workload_id: str) -> s.WorkloadInfo:
        return await self._run(Calls.cancel(workload_id))

    async def events(self, workload_id: str, after: int = 0) -> s.WorkloadEvents:
        return await self._run(Calls.events(workload_id, after))

    async def stream(self, workload_id: str, after: int = 0) -> AsyncIterator[s.WorkloadEvent]:
        headers = {**self._headers(), "Accept": "text/event-stream"}
        path = f"/v1/workloads/{workload_id}/stream"
        try:
            async with self._http.stream("GET", path, params={"after": after}, headers=headers, timeout=None) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise response_error(resp)
                parser = SSEParser()
                async for line in resp.aiter_lines():
                    parsed = parser.feed(line)
                    if parsed is None:
                        continue
                    kind, data = parsed
                    if kind == "end":
                        return
                    if kind == "error":
                        raise stream_error(data)
                    yield parse_event(data)
        except JoyNexusError:
            raise
        except Exception as error:  # the connection failed (httpx, the transport)
            raise ConnectionFailed(self.base_url, error) from error

    async def versions(self, *, after: int | None = None, limit: int | None = None) -> s.Versions:
        """As `JoyNexusClient.versions`: one page with `limit`, else every checkpoint page by page."""
        if limit is not None:
            return await self._run(Calls.versions(after, limit))
        pages = [await self._run(Calls.versions_page(after))]
        while (nxt := next_versions_page(pages, after)) is not None:
            after = nxt
            pages.append(await self._run(Calls.versions_page(after)))
        return merged_versions(pages)

    async def export(self, version: int | None = None) -> bytes:
        if version is None:
            return (await self._run(Calls.export_params())).payload
        return await self._run(Calls.export_version(version))

    async def delete_version(self, version: int) -> s.VersionDeleted:
        return await self._run(Calls.delete_version(version))

    async def checkpoint_manifest(self, version: int) -> s.Manifest:
        return await self._run(Calls.checkpoint_manifest(version))

    async def usage(self) -> s.Usage:
        return await self._run(Calls.usage())

    async def upload_dataset(self, path: str | Path, *, repo_id: str | None = None) -> s.DatasetInfo:
        """`JoyNexusClient.upload_dataset` (a folder is packed in a worker thread)."""
        archive, name = await asyncio.to_thread(dataset_archive, path)
        return await self._run(Calls.upload_dataset(archive, repo_id or default_repo_id(name)))

    async def datasets(self) -> list[s.DatasetInfo]:
        return await self._run(Calls.datasets())

    async def delete_dataset(self, dataset_id: str) -> s.DatasetDeleted:
        return await self._run(Calls.delete_dataset(dataset_id))

    async def train_batch(
        self, images: Any, state: Any, action: Any, *, action_is_pad: Any = None, instructions: list[str] | None = None
    ) -> s.TrainStepResult:
        return await self._run(Calls.train_batch(images, state, action, action_is_pad, instructions))

    async def forward_backward(
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
        return await self._run(call)

    async def optim_step(
        self,
        *,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        weight_decay: float | None = None,
        grad_clip: float | None = None,
    ) -> s.OptimStepResult:
        """Apply the pending gradients; the keywords set this step's AdamW hyperparameters only."""
        return await self._run(Calls.optim_step(lr, betas, weight_decay, grad_clip))

    async def load_state(self, version: int) -> sc.LoadStateResult:
        """Roll the training slot (module, adapter, optimizer) back to kept checkpoint `version`."""
        return await self._run(Calls.load_state(version))

    async def fork(
        self,
        new_tenant: str,
        *,
        version: int | None = None,
        learning_rate: float | None = None,
        seed: int | None = None,
    ) -> sc.TenantForked:
        """A new tenant from `version` (None: the current one) with another learning rate / seed;
        the answer carries its first API key."""
        return await self._run(Calls.fork(new_tenant, version, learning_rate, seed))

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
        call = Calls.predict(images, state, instructions, policy_version, seeds, session_id, sample, timeout_s)
        return await self._run(call)

    async def export_params(self) -> s.ExportedParams:
        return await self._run(Calls.export_params())

    async def load_weights(self, payload: bytes | None = None, *, version: int | None = None) -> s.LoadWeightsResult:
        return await self._run(Calls.load_weights(payload, version))

    async def save(self, include_optim: bool = True) -> s.Manifest:
        return await self._run(Calls.save(include_optim))

    async def queue_put(
        self, partition: str, columns: dict[str, Any], *, indices: list[int] | None = None, task_name: str = "api"
    ) -> s.PartitionInfo:
        return await self._run(Calls.queue_put(partition, columns, indices, task_name))

    async def queue_get(
        self, partition: str, fields: list[str], batch_size: int, task_name: str = "train"
    ) -> s.QueueBatch:
        return await self._run(Calls.queue_get(partition, fields, batch_size, task_name))

    async def queue_clear(self, partition: str) -> s.Cleared:
        return await self._run(Calls.queue_clear(partition))

    async def open_session(self, config: dict[str, Any], *, rollout_id: str = "api") -> s.SessionInfo:
        return await self._run(Calls.open_session(config, rollout_id))

    async def reset(self, session_id: str, seed: int | None = None) -> dict[str, Any]:
        return from_wire((await self._run(Calls.reset(session_id, seed))).data)

    async def step(self, session_id: str, action: Any) -> dict[str, Any]:
        return from_wire((await self._run(Calls.step(session_id, action))).data)

    async def close_session(self, session_id: str) -> s.Cleared:
        return await self._run(Calls.close_session(session_id))
