"""Inference Queue and Inference Scheduler (paper section 4.3, Appendix A.3).

`TenantFairQueue` is the queue the Inference Model Service runs. Requests from every tenant enter
it; each tenant's requests (or the chunks of a split request) wait in that tenant's own FIFO. The
scheduler forms a batch by taking one entry from each tenant in turn -- least recently served tenant
first, ties by arrival -- and going round again while entries share the first entry's prefix key
(same base model and canonical prefix shape, never tenant identity) and the batch stays within the
target size B. It dispatches as soon as the batch reaches B samples, or an entry could not join it
(waiting cannot grow it), or the oldest pending entry has waited T. An entry that could not join
(another prefix key, or too large for what is left of B) sits out that batch only, its tenant's
order kept. Every batch takes the first entry of the tenant served least recently, so a tenant with
pending work leads a batch within (tenants with pending work) batches -- an incompatible entry with
one tenant ahead of it waits at most one batch -- and none is starved. With a single tenant a batch
is the paper's largest FIFO-compatible prefix. Tenant identity never decides what shares a batch,
only the order in which tenants are offered a place in it.

Abandoned work leaves at once (issue 26): an entry whose future is cancelled (its caller timed out,
hung up, or its split request settled) is taken out of its tenant's FIFO by the cancellation itself,
so it neither runs nor holds memory; and each tenant may have at most `max_samples_per_tenant`
samples waiting (`TenantQueueFull` beyond), so one tenant's flood cannot grow the queue unbounded.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
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
    queued: bool = field(default=False, repr=False, compare=False)  # in a tenant's FIFO now (queue lock)

    @property
    def size(self) -> int:
        return len(self.observations)


class InferenceQueueClosed(RuntimeError):
    pass


class TenantQueueFull(RuntimeError):
    """A tenant already has `limit` samples waiting: its new request is refused, nothing enqueued."""

    def __init__(self, tenant_id: str, queued: int, requested: int, limit: int, setting: str):
        self.tenant_id, self.queued, self.requested, self.limit, self.setting = (
            tenant_id,
            queued,
            requested,
            limit,
            setting,
        )
        super().__init__(
            f"tenant {tenant_id!r} has {queued} samples waiting in the Inference Queue; {requested} more would pass "
            f"the limit of {limit} queued samples per tenant ({setting}): wait for answers before sending more"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray as itself (the API answers it with 429)
        return (TenantQueueFull, (self.tenant_id, self.queued, self.requested, self.limit, self.setting))


def settle_future(future: Future, *, result: Any = None, exception: BaseException | None = None) -> None:
    """Resolve a request's future unless its caller cancelled it meanwhile."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled between the check and the set
        pass


class TenantFairQueue:
    """The Inference Queue, thread-safe; `collect_prefix` is the Inference Scheduler's batching rule.

    Each tenant has its own FIFO of entries (requests, or chunks of split requests). A batch takes
    one entry from each tenant in turn — least recently served tenant first, ties by arrival — and
    goes round again while entries fit within B and share the first entry's prefix key. A tenant
    whose next entry does not fit sits out the rest of that batch (its own order is kept). The
    first entry is always taken, so every batch serves the tenant at the front, which then goes to
    the back: a tenant with pending work is served within (tenants with pending work) batches.

    Due: the batch holds >= B samples, or an entry could not join it
    (waiting cannot grow it), or the oldest pending entry has waited T.
    """

    def __init__(
        self, max_samples_per_tenant: int | None = None, *, setting: str = "max_queued_samples_per_tenant"
    ) -> None:
        """`max_samples_per_tenant`: samples one tenant may have waiting (None: unbounded);
        `setting` is the name a refusal cites, so the operator knows what to raise."""
        if max_samples_per_tenant is not None and max_samples_per_tenant < 1:
            raise ValueError(f"max_samples_per_tenant must be >= 1 or None, got {max_samples_per_tenant}")
        self.max_samples_per_tenant = max_samples_per_tenant
        self._setting = setting
        self._samples: dict[str, int] = {}  # tenant -> samples waiting
        self._tenants: dict[str, deque[InferenceRequest]] = {}
        self._last_served: dict[str, int] = {}  # tenant -> number of the last batch that took from it
        self._batches = 0
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False

    def enqueue(self, request: InferenceRequest) -> Future:
        self.enqueue_many([request])
        return request.future

    def enqueue_many(self, requests: list[InferenceRequest]) -> None:
        """Enqueue all of them together (a split request's chunks), or none if the queue is closed."""
        for request in requests:
            if request.size < 1:
                raise ValueError("an inference request needs at least one observation")
        adding: dict[str, int] = {}
        for request in requests:
            adding[request.tenant_id] = adding.get(request.tenant_id, 0) + request.size
        with self._cond:
            if self._closed:
                raise InferenceQueueClosed("the Inference Queue is closed")
            limit = self.max_samples_per_tenant
            for tenant, samples in adding.items():
                queued = self._samples.get(tenant, 0)
                if limit is not None and queued + samples > limit:
                    raise TenantQueueFull(tenant, queued, samples, limit, self._setting)
            for request in requests:
                self._tenants.setdefault(request.tenant_id, deque()).append(request)
                request.queued = True
            for tenant, samples in adding.items():
                self._samples[tenant] = self._samples.get(tenant, 0) + samples
            self._count += len(requests)
            self._cond.notify_all()
        for request in requests:  # a cancelled entry leaves at once (also one cancelled already)
            request.future.add_done_callback(functools.partial(self._on_settled, request))

    def discard(self, requests: list[InferenceRequest]) -> int:
        """Take these entries out of the queue (those still waiting; the rest are ignored), in one
        pass per tenant; returns how many were waiting. A split request drops its chunks so."""
        with self._cond:
            waiting = [request for request in requests if request.queued]
            for tenant in {request.tenant_id for request in waiting}:
                gone = {id(request) for request in waiting if request.tenant_id == tenant}
                self._tenants[tenant] = deque(e for e in self._tenants[tenant] if id(e) not in gone)
            for request in waiting:
                self._unqueued(request)
            return len(waiting)

    def _on_settled(self, request: InferenceRequest, future: Future) -> None:
        if future.cancelled() and request.queued:
            self.discard([request])

    def _unqueued(self, request: InferenceRequest) -> None:
        """Count an entry that left its FIFO. Caller holds the lock."""
        request.queued = False
        self._count -= 1
        left = self._samples.get(request.tenant_id, 0) - request.size
        if left > 0:
            self._samples[request.tenant_id] = left
        else:
            self._samples.pop(request.tenant_id, None)

    def depth(self, tenant_id: str | None = None) -> int:
        """Entries waiting (a split request counts once per unserved chunk), of one tenant or of
        all. Cheap: the lock is held while a batch is picked, never while one runs."""
        with self._cond:
            if tenant_id is None:
                return self._count
            return len(self._tenants.get(tenant_id, ()))

    def queued_samples(self, tenant_id: str | None = None) -> int:
        """Samples waiting, of one tenant or of all (what `max_samples_per_tenant` bounds)."""
        with self._cond:
            if tenant_id is None:
                return sum(self._samples.values())
            return self._samples.get(tenant_id, 0)

    def close(self) -> None:
        """Stop accepting work; pending requests fail so no caller waits forever."""
        with self._cond:
            self._closed = True
            pending = [request for entries in self._tenants.values() for request in entries]
            for request in pending:
                request.queued = False
            self._tenants.clear()
            self._samples.clear()
            self._count = 0
            self._cond.notify_all()
        for request in pending:
            settle_future(
                request.future, exception=InferenceQueueClosed("the Inference Queue closed before serving this")
            )

    def collect_prefix(
        self, max_batch_size: int, timeout_s: float, poll_s: float | None = None
    ) -> list[InferenceRequest]:
        """Block until a batch is due, then remove and return it (empty if the wait ends with no
        requests: `poll_s` bounds how long an idle call blocks, so workers can check for shutdown).
        The batch is the fair one described on the class; with one tenant, the largest
        FIFO-compatible prefix."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        idle_deadline = None if poll_s is None else time.monotonic() + poll_s
        with self._cond:
            while True:
                if self._closed:
                    return []
                plan = self._plan(max_batch_size)
                if plan is not None:
                    order, size, blocked, oldest = plan
                    head_deadline = oldest + timeout_s
                    now = time.monotonic()
                    if size >= max_batch_size or blocked or now >= head_deadline:
                        return self._take(order)
                    wait: float | None = head_deadline - now
                else:
                    if idle_deadline is not None and time.monotonic() >= idle_deadline:
                        return []
                    wait = None if idle_deadline is None else idle_deadline - time.monotonic()
                self._cond.wait(timeout=wait)

    def _plan(self, max_batch_size: int) -> tuple[list[str], int, bool, float] | None:
        """The next batch as (tenant of each entry, in the order taken; samples; whether an entry
        could not join; oldest pending entry's enqueue time), or None with nothing pending.
        Drops entries cancelled by their callers on the way. Caller holds the lock."""
        for tenant in [t for t, entries in self._tenants.items() if not entries]:
            del self._tenants[tenant]
        if not self._tenants:
            return None
        active = sorted(self._tenants, key=lambda t: (self._last_served.get(t, -1), self._tenants[t][0].request_id))
        taken: dict[str, int] = {}
        order: list[str] = []
        size, blocked, key = 0, False, None
        while active and size < max_batch_size:
            again = []
            for tenant in active:
                if size >= max_batch_size:
                    break
                entries, n = self._tenants[tenant], taken.get(tenant, 0)
                while n < len(entries) and entries[n].future.done():  # settled meanwhile: never run it
                    self._unqueued(entries[n])
                    del entries[n]
                if n >= len(entries):
                    continue
                entry = entries[n]
                key = entry.prefix_key if key is None else key
                if entry.prefix_key != key or (size > 0 and size + entry.size > max_batch_size):
                    blocked = True  # sits out this batch; its later entries wait behind it
                    continue
                taken[tenant] = n + 1
                order.append(tenant)
                size += entry.size
                if n + 1 < len(entries):
                    again.append(tenant)
            active = again
        heads = [entries[0].enqueued_at for entries in self._tenants.values() if entries]
        if not heads:  # everything pending was cancelled
            return None
        return order, size, blocked, min(heads)

    def _take(self, order: list[str]) -> list[InferenceRequest]:
        """Remove the planned entries (each tenant's from its front, round-robin order kept)."""
        batch = [self._tenants[tenant].popleft() for tenant in order]
        for request in batch:
            self._unqueued(request)
        for tenant in set(order):
            self._last_served[tenant] = self._batches
            if not self._tenants[tenant]:
                del self._tenants[tenant]
        self._batches += 1
        return batch
