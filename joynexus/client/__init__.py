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
backoff and jitter; never a 4xx, except with `RetryPolicy(retry_rate_limited=True)` a 429 of a
per-tenant rate limit (`RateLimited`, which carries the server's `retry_after`), after that wait.
Every POST carries an `Idempotency-Key` that its retries reuse,
so a retried optimizer step is applied once.

The package: `errors` (the error kinds), `transport` (URL, retries, encoding and decoding, SSE),
`calls` (what each operation sends; spec files), `sync` and `async_` (the two clients).
"""

from joynexus.client.async_ import AsyncJoyNexusClient, AsyncWorkloadHandle
from joynexus.client.calls import load_spec_file
from joynexus.client.errors import (
    ApiRequestError,
    ConnectionFailed,
    InvalidArgument,
    InvalidResponse,
    JoyNexusError,
    RateLimited,
    ServerError,
    SpecFileError,
    WorkloadFailed,
    WorkloadTimeout,
)
from joynexus.client.futures import AsyncCallFuture, CallFuture, FutureTimeout
from joynexus.client.sync import JoyNexusClient, WorkloadHandle
from joynexus.client.transport import RetryPolicy

__all__ = [
    "ApiRequestError",
    "AsyncCallFuture",
    "AsyncJoyNexusClient",
    "AsyncWorkloadHandle",
    "CallFuture",
    "ConnectionFailed",
    "FutureTimeout",
    "InvalidArgument",
    "InvalidResponse",
    "JoyNexusClient",
    "JoyNexusError",
    "RateLimited",
    "RetryPolicy",
    "ServerError",
    "SpecFileError",
    "WorkloadFailed",
    "WorkloadHandle",
    "WorkloadTimeout",
    "load_spec_file",
]
