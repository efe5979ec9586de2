"""Inference Queue and Inference Scheduler (paper section 4.3, Appendix A.3).

Requests from any tenant enter one FIFO queue. The scheduler takes the largest FIFO-compatible
prefix: starting at the oldest request, it takes requests while they share the head's prefix key
(same base model and canonical prefix shape — never tenant identity) and the batch stays within
the target size B; it dispatches as soon as that prefix reaches B samples or the oldest request
has waited T. The first incompatible request ends the prefix and becomes the head of the next
batch, so it waits at most one batch longer and is never starved.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

PrefixKey = tuple[Any, ...]

_request_ids = itertools.count(1)


@dataclass(frozen=True)
class Observation:
    """What one environment step (or API call) hands the policy; tensors are float32 CHW in [0, 1]."""

    images: tuple[Any, ...]  # one (3, H, W) array or tensor per camera, in the tenant's camera order
    state: Any  # (state_dim,) array or tensor
    instruction: str = ""


@dataclass
class InferenceRequest:
    tenant_id: str
    schema_signature: str
    prefix_key: PrefixKey
    observations: list[Observation]  # usually one; a request may carry a small batch
    policy_version: int | None = None  # None: resolved to the tenant's latest version at submission
    session_id: str | None = None
    request_id: int = field(default_factory=lambda: next(_request_ids))
    enqueued_at: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future, repr=False)
    context: Any = field(default=None, repr=False)  # the serving service's own per-request data

    @property
    def size(self) -> int:
        return len(self.observations)


class InferenceQueueClosed(RuntimeError):
    pass


class InferenceQueue:
    """A thread-safe FIFO of requests; `collect_prefix` is the Inference Scheduler's batching rule."""

    def __init__(self) -> None:
        self._items: deque[InferenceRequest] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def enqueue(self, request: InferenceRequest) -> Future:
        if request.size < 1:
            raise ValueError("an inference request needs at least one observation")
        with self._cond:
            if self._closed:
                raise InferenceQueueClosed("the Inference Queue is closed")
            self._items.append(request)
            self._cond.notify_all()
        return request.future

    def depth(self) -> int:
        with self._cond:
            return len(self._items)

    def close(self) -> None:
        """Stop accepting work; pending requests fail so no caller waits forever."""
        with self._cond:
            self._closed = True
            pending, self._items = list(self._items), deque()
            self._cond.notify_all()
        for request in pending:
            if not request.future.done():
                request.future.set_exception(InferenceQueueClosed("the Inference Queue closed before serving this"))

    def collect_prefix(
        self, max_batch_size: int, timeout_s: float, poll_s: float | None = None
    ) -> list[InferenceRequest]:
        """Block until a batch is due, then remove and return it (empty if the wait ends with no
        requests: `poll_s` bounds how long an idle call blocks, so workers can check for shutdown).

        Due means: the FIFO-compatible prefix holds >= `max_batch_size` samples, or an incompatible
        request stands behind it (the prefix cannot grow), or the head has waited `timeout_s`."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        idle_deadline = None if poll_s is None else time.monotonic() + poll_s
        with self._cond:
            while True:
                if self._closed:
                    return []
                if self._items:
                    take, size, blocked = self._prefix(max_batch_size)
                    head_deadline = self._items[0].enqueued_at + timeout_s
                    now = time.monotonic()
                    if size >= max_batch_size or blocked or now >= head_deadline:
                        return [self._items.popleft() for _ in range(take)]
                    wait = head_deadline - now
                else:
                    if idle_deadline is not None and time.monotonic() >= idle_deadline:
                        return []
                    wait = None if idle_deadline is None else idle_deadline - time.monotonic()
                self._cond.wait(timeout=wait)

    def _prefix(self, max_batch_size: int) -> tuple[int, int, bool]:
        """(requests taken, samples taken, whether an incompatible or overflowing request ends it)."""
        head = self._items[0]
        take, size = 0, 0
        for request in self._items:
            if request.prefix_key != head.prefix_key:
                return take, size, True
            if take > 0 and size + request.size > max_batch_size:
                return take, size, True
            take += 1
            size += request.size
            if size >= max_batch_size:
                return take, size, False
        return take, size, False
