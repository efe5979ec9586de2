"""Per-tenant rate limits and call bounds of the tenant API, so one tenant cannot stall another's calls.

Every lower-layer call (training primitives, predict, queue, environment sessions) and every
observation of the robot streams passes `TenantCallLimiter` before it touches a worker thread:

- two token buckets per tenant, requests/s and samples/s (each holds `burst_s` seconds of its
  rate); a call they cannot pay is refused at once with 429 `rate_limited` and `Retry-After`;
- at most `max_in_flight` of a tenant's blocking calls at once (429 `too_many_in_flight` beyond);
- a tenant refused by a bucket that calls the same route again before the refused call could have
  been paid (its Retry-After) is refused at once, before its body is read: parsing and decoding a
  large body costs the server's event loop milliseconds that every other tenant's calls wait behind,
  and a client that ignores Retry-After would otherwise spend them on calls refused anyway;
- those calls run in worker threads bounded per tenant (`anyio` capacity limiter of its own), not
  in the shared pool every route borrows from: a tenant with 128 predicts waiting in the Inference
  Queue used to hold every thread of the server, and another tenant's calls waited behind them.

Limits are service-wide defaults with per-tenant overrides (`RateLimitSettings`, from
`ApiSettings.rate_limits` or the environment variable JOYNEXUS_RATE_LIMITS_JSON). What was refused
is counted per tenant and shown in GET /v1/usage (`throttled`). Counts and buckets are this API
server's own (each replica limits what reaches it).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from joynexus.api.errors import ApiError
from joynexus.protocol import schemas as s

R = TypeVar("R")
RATE_LIMITS_ENV = "JOYNEXUS_RATE_LIMITS_JSON"
MAX_REFUSED_ROUTES = 4096  # (tenant, route) refusals remembered until their wait ends, at most


class TenantRateLimits(BaseModel):
    """One tenant's limits (None: that limit is off)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    requests_per_s: float | None = Field(default=200.0, gt=0, le=1e6)
    samples_per_s: float | None = Field(default=4000.0, gt=0, le=1e9)
    burst_s: float = Field(default=2.0, gt=0, le=3600, description="a bucket holds this many seconds of its rate")
    # Each in-flight call holds a worker thread (it waits on a service), so this also bounds the
    # threads one tenant can occupy.
    max_in_flight: int = Field(default=32, ge=1, le=4096)


class RateLimitSettings(BaseModel):
    """`default` for every tenant; `tenants` overrides the fields it names for those tenants.
    `enabled=False`: nothing is refused (buckets and the in-flight bound are off); each tenant's
    calls still run in worker threads of its own, at most `max_in_flight` at once, the rest wait."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    default: TenantRateLimits = TenantRateLimits()
    tenants: dict[str, TenantRateLimits] = Field(default_factory=dict)

    def for_tenant(self, tenant_id: str) -> TenantRateLimits:
        override = self.tenants.get(tenant_id)
        if override is None:
            return self.default
        return self.default.model_copy(update={name: getattr(override, name) for name in override.model_fields_set})

    @classmethod
    def from_env(cls) -> RateLimitSettings:
        """From JOYNEXUS_RATE_LIMITS_JSON (e.g. '{"default": {"requests_per_s": 50}, "tenants":
        {"fleet-a": {"max_in_flight": 128}}}'); unset: the defaults. A bad value's error names it."""
        text = os.environ.get(RATE_LIMITS_ENV, "").strip()
        if not text:
            return cls()
        try:
            return cls.model_validate(json.loads(text))
        except (json.JSONDecodeError, ValidationError) as error:
            raise ValueError(f"{RATE_LIMITS_ENV}: {error}") from None


class TokenBucket:
    """`rate` tokens per second, at most `capacity` kept. A cost above the capacity is accepted
    once the bucket is full and leaves it in debt, so no single call is refused forever."""

    __slots__ = ("rate", "capacity", "tokens", "updated")

    def __init__(self, rate: float, capacity: float, now: float):
        self.rate, self.capacity, self.tokens, self.updated = rate, capacity, capacity, now

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds until `cost` can be paid (0: now). Refills; takes nothing."""
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        missing = min(cost, self.capacity) - self.tokens
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, cost: float) -> None:
        self.tokens -= cost


def rate_limited(tenant_id: str, setting: str, limit: float, wait_s: float) -> ApiError:
    """429 `rate_limited` naming the setting, with Retry-After (whole seconds, at least 1)."""
    retry_after = max(1, math.ceil(wait_s))
    unit = setting.removesuffix("_per_s")
    message = (
        f"tenant {tenant_id!r} is over its rate limit of {limit:g} {unit}/s (rate_limits.{setting}); "
        f"retry after {retry_after} s"
    )
    return ApiError(message, [(f"rate_limits.{setting}", f"limit of {limit:g} {unit}/s reached")],
                    headers={"Retry-After": str(retry_after)}).with_status(429, "rate_limited")  # fmt: skip


def too_many_in_flight(tenant_id: str, limit: int) -> ApiError:
    message = (
        f"tenant {tenant_id!r} already has {limit} calls in flight (rate_limits.max_in_flight is {limit}); "
        "wait for an answer before sending more"
    )
    return ApiError(message, [("rate_limits.max_in_flight", f"limit of {limit} calls in flight reached")],
                    headers={"Retry-After": "1"}).with_status(429, "too_many_in_flight")  # fmt: skip


class TenantCallLimiter:
    """The per-tenant buckets, in-flight counts, worker-thread limiters and refusal counts of one
    API server. `admit` is cheap and thread-safe; `run` is the way a route runs a blocking call."""

    def __init__(self, settings: RateLimitSettings | None = None, clock: Callable[[], float] = time.monotonic):
        self.settings = settings or RateLimitSettings()
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        self._in_flight: dict[str, int] = {}
        self._threads: dict[str, anyio.CapacityLimiter] = {}
        self._refused: dict[str, dict[str, int]] = {}
        # (tenant, route) -> (until, setting, rate) of its last refused call: see `refuse_unread`.
        self._refused_until: dict[tuple[str, str], tuple[float, str, float]] = {}

    def admit(self, tenant_id: str, samples: int = 0, route: str | None = None) -> None:
        """Pay one request and `samples` samples from the tenant's buckets, or raise 429 (and pay
        nothing: a refused call does not use up the tenant's budget). With `route`, a refusal is
        remembered until it could have been paid, for `refuse_unread`."""
        if not self.settings.enabled:
            return
        limits = self.settings.for_tenant(tenant_id)
        now = self._clock()
        with self._lock:
            costs = [("requests_per_s", limits.requests_per_s, 1.0), ("samples_per_s", limits.samples_per_s, samples)]
            buckets = []
            for setting, rate, cost in costs:
                if rate is None or cost <= 0:
                    continue
                bucket = self._bucket(tenant_id, setting, rate, rate * limits.burst_s, now)
                wait_s = bucket.wait_s(cost, now)
                if wait_s > 0:
                    self._count(tenant_id, setting)
                    if route is not None:
                        self._remember_refusal((tenant_id, route), (now + wait_s, setting, rate))
                    raise rate_limited(tenant_id, setting, rate, wait_s)
                buckets.append((bucket, cost))
            for bucket, cost in buckets:
                bucket.take(cost)

    def refuse_unread(self, tenant_id: str, route: str) -> None:
        """Raise 429 if the tenant's last call of `route` was refused and the wait it was told has
        not passed: the same call now would be refused again, so it is refused before its body is
        read (a smaller call sent meanwhile is refused too: it was told to wait). Counted like the
        refusal it repeats."""
        if not self.settings.enabled:
            return
        with self._lock:
            refused = self._refused_until.get((tenant_id, route))
            if refused is None:
                return
            until, setting, rate = refused
            wait_s = until - self._clock()
            if wait_s <= 0:
                del self._refused_until[(tenant_id, route)]
                return
            self._count(tenant_id, setting)
        raise rate_limited(tenant_id, setting, rate, wait_s)

    def refuse_stream(self, tenant_id: str) -> None:
        """Count an event stream refused by `max_streams_per_tenant` (shown in usage)."""
        with self._lock:
            self._count(tenant_id, "streams")

    async def run(
        self,
        tenant_id: str,
        call: Callable[..., R],
        *args: Any,
        samples: int = 0,
        wait: bool = False,
        route: str | None = None,
    ) -> R:
        """`call(*args)` in one of the tenant's own worker threads, after `admit` and within its
        in-flight bound: beyond it 429, or with `wait` a wait for a thread (robot streams, whose
        connections already bound what can wait). A cancelled caller (a closed connection) does
        not abandon the thread: the slot stays taken until the call really ends, so the bound
        counts real threads. `route`: the HTTP route called, see `refuse_unread`."""
        self.admit(tenant_id, samples, route)
        with self.in_flight(tenant_id, refuse=not wait):
            return await anyio.to_thread.run_sync(call, *args, limiter=self._thread_limiter(tenant_id))

    async def run_unmetered(self, tenant_id: str, call: Callable[..., R], *args: Any) -> R:
        """`call(*args)` in one of the tenant's own worker threads, not charged to its buckets or
        in-flight bound (the polls of an event stream it already opened)."""
        return await anyio.to_thread.run_sync(call, *args, limiter=self._thread_limiter(tenant_id))

    @contextmanager
    def in_flight(self, tenant_id: str, *, refuse: bool = True) -> Iterator[None]:
        limit = self.settings.for_tenant(tenant_id).max_in_flight
        with self._lock:
            if refuse and self.settings.enabled and self._in_flight.get(tenant_id, 0) >= limit:
                self._count(tenant_id, "max_in_flight")
                raise too_many_in_flight(tenant_id, limit)
            self._in_flight[tenant_id] = self._in_flight.get(tenant_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._in_flight[tenant_id] - 1
                if left:
                    self._in_flight[tenant_id] = left
                else:
                    del self._in_flight[tenant_id]

    def in_flight_count(self, tenant_id: str) -> int:
        with self._lock:
            return self._in_flight.get(tenant_id, 0)

    def throttled(self, tenant_id: str) -> s.ThrottleCounts:
        with self._lock:
            return s.ThrottleCounts(**self._refused.get(tenant_id, {}))

    def forget(self, tenant_id: str) -> None:
        """Drop a deleted tenant's buckets and counts (its id may be created again)."""
        with self._lock:
            for key in [key for key in self._buckets if key[0] == tenant_id]:
                del self._buckets[key]
            self._refused.pop(tenant_id, None)
            for key in [key for key in self._refused_until if key[0] == tenant_id]:
                del self._refused_until[key]
            if not self._in_flight.get(tenant_id):
                self._threads.pop(tenant_id, None)

    # -- internals (the lock held) ----------------------------------------------------------------
    def _bucket(self, tenant_id: str, setting: str, rate: float, capacity: float, now: float) -> TokenBucket:
        bucket = self._buckets.get((tenant_id, setting))
        if bucket is None or bucket.rate != rate or bucket.capacity != capacity:
            bucket = self._buckets[(tenant_id, setting)] = TokenBucket(rate, capacity, now)
        return bucket

    def _remember_refusal(self, key: tuple[str, str], refusal: tuple[float, str, float]) -> None:
        self._refused_until.pop(key, None)  # re-inserted last: the oldest refusals go first
        self._refused_until[key] = refusal
        while len(self._refused_until) > MAX_REFUSED_ROUTES:
            del self._refused_until[next(iter(self._refused_until))]

    def _count(self, tenant_id: str, limit: str) -> None:
        counts = self._refused.setdefault(tenant_id, {})
        counts[limit] = counts.get(limit, 0) + 1

    def _thread_limiter(self, tenant_id: str) -> anyio.CapacityLimiter:
        # Created on the event loop (anyio needs one); one loop per app serves every call.
        limit = self.settings.for_tenant(tenant_id).max_in_flight
        with self._lock:
            limiter = self._threads.get(tenant_id)
            if limiter is None:
                limiter = self._threads[tenant_id] = anyio.CapacityLimiter(limit)
            return limiter


__all__ = [
    "RATE_LIMITS_ENV",
    "RateLimitSettings",
    "TenantCallLimiter",
    "TenantRateLimits",
    "TokenBucket",
    "rate_limited",
    "too_many_in_flight",
]
