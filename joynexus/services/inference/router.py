"""The caller's side of tenant-affine inference (issue 45.3): `TenantRouter` routes each request
straight to a replica that holds its tenant, so it never passes through the replica set's front actor
(`joynexus.inference_service`), which stays for control calls (weights, tenants, stats, placement).

The router holds the set's assignment table (`InferenceReplicaSet.assignment`: tenant -> the active
replicas holding it, by actor name) and handles of those replicas' named actors. Per request:
- a tenant missing from the table is placed by the front (`route`: it loads the tenant's serving
  states on a replica, evicting that replica's least recently used tenant when it is full), once;
- among the tenant's holders, the one with the fewest of this router's requests in flight takes it;
- a tenant with more than `hot_tenant_in_flight` of this router's requests in flight per holder asks
  the front for one more holder (in the background: the request itself does not wait for it);
- a request whose replica died, stopped, or no longer holds the tenant (evicted since the table was
  read) refreshes the table and goes to a holder again (a prediction has no side effect), at most
  `MAX_ATTEMPTS` replicas in all. The table is also refreshed every `refresh_s`.

`inference_endpoint` gives a caller what it should hold: a router in front of a replica set, the
service itself otherwise.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from joynexus.actors import ServiceHandle, handle_of
from joynexus.scheduling.inference_queue import Observation, settle_future
from joynexus.services.inference.cancellation import KeyedRequests, cancel_request
from joynexus.services.inference.endpoint import PredictBySubmit
from joynexus.services.inference.errors import InferenceError, UnknownPolicyVersion, cause_of, replica_gone

log = logging.getLogger(__name__)

# Replicas one request may be sent to: a replica gone, or one that gave the tenant up to another
# (evicted) since the table was read, is a move, not a failure.
MAX_ATTEMPTS = 4
REFRESH_S = 2.0  # the table is read again at least this often (replicas added, drained, tenants moved)


class TenantRouter(PredictBySubmit):
    """Requests of any tenant, routed in this process to the replicas that hold it; every other
    call goes to the front (`front`: the replica set, a local object or its named actor)."""

    def __init__(
        self,
        front: Any,
        *,
        namespace: str | None = None,
        resolve: Callable[[str], Any] | None = None,
        refresh_s: float = REFRESH_S,
    ) -> None:
        """`resolve(name)`: the replica behind an actor name (default: the named Ray actor in
        `namespace`; a local set passes its `replica_target`)."""
        if refresh_s <= 0:
            raise ValueError(f"refresh_s: expected seconds > 0, got {refresh_s!r}")
        self.front = handle_of(front)
        self.namespace = namespace
        self._resolve = resolve or self._named_actor
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._table: dict[str, list[str]] = {}
        self._handles: dict[str, ServiceHandle] = {}
        self._epoch: Any = None
        self._fetched_at = 0.0
        self._hot = 8.0
        self._in_flight: dict[str, int] = {}  # replica -> this router's requests on it
        self._tenant_in_flight: dict[str, int] = {}
        self._expanding: set[str] = set()
        self._used: set[str] = set()  # tenants routed since the last read (the front's LRU order)
        self._keyed = KeyedRequests()
        self.counts = {"requests": 0, "rerouted_requests": 0, "failed_requests": 0, "refreshes": 0, "placements": 0}
        self.sent: dict[str, dict[str, int]] = {}  # tenant -> replica -> requests sent (what tests read)
        # The table is read on the first request: building a router calls nothing.

    def _named_actor(self, name: str) -> Any:
        import ray

        return ray.get_actor(name, namespace=self.namespace)

    # -- the table ----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the front's assignment table now; look up replicas not seen before."""
        with self._lock:
            used, self._used = sorted(self._used), set()
        table = self.front.assignment(used)
        handles = {}
        for name in table["replicas"]:
            handle = self._handles.get(name)
            if handle is None:
                try:
                    handle = ServiceHandle(self._resolve(name))
                except (KeyError, ValueError) as error:  # gone between the table and the lookup
                    log.info("replica %s not found: %s", name, error)
                    continue
            handles[name] = handle
        with self._lock:
            self._handles = handles
            self._table = {t: list(names) for t, names in table["tenants"].items()}
            self._epoch, self._fetched_at = table["epoch"], time.monotonic()
            self._hot = float(table["hot_tenant_in_flight"])
            self.counts["refreshes"] += 1

    def _place(self, tenant_id: str, want: int, avoid: list[str] | None = None) -> list[str]:
        """Ask the front to place the tenant on `want` replicas (none of `avoid`); the table is read
        again after."""
        self.front.route(tenant_id, want, avoid)
        with self._lock:
            self.counts["placements"] += 1
        self.refresh()
        with self._lock:
            return list(self._table.get(tenant_id, ()))

    def _holders(self, tenant_id: str) -> list[str]:
        if time.monotonic() - self._fetched_at > self.refresh_s:
            try:
                self.refresh()
            except Exception as error:  # the front is away: the table read last still routes
                if not self._table:
                    raise
                log.warning("inference routing table not refreshed (%s); routing by the last one", error)
                self._fetched_at = time.monotonic()
        with self._lock:
            holders = list(self._table.get(tenant_id, ()))
            in_flight = self._tenant_in_flight.get(tenant_id, 0)
            hot = (
                holders
                and in_flight >= self._hot * len(holders)
                and len(holders) < len(self._handles)
                and tenant_id not in self._expanding
            )
            if hot:
                self._expanding.add(tenant_id)
        if not holders:
            return self._place(tenant_id, 1)
        if hot:  # one more replica for a hot tenant; this request goes where it is held now
            threading.Thread(target=self._expand, args=(tenant_id, len(holders) + 1), daemon=True).start()
        return holders

    def _expand(self, tenant_id: str, want: int) -> None:
        try:
            self._place(tenant_id, want)
        except Exception as error:  # its current holders keep serving it
            log.warning("one more replica for tenant %r: %s", tenant_id, error)
        finally:
            with self._lock:
                self._expanding.discard(tenant_id)

    # -- requests -----------------------------------------------------------------------------
    def submit(
        self,
        tenant_id: str,
        observations: list[Observation],
        *,
        policy_version: int | None = None,
        session_id: str | None = None,
        seeds: list[int] | None = None,
        sample: bool = False,
        operation: str = "predict",
        request_key: str | None = None,
    ) -> Future:
        """A future of the request's result (see `InferenceModelService.submit`), served by a replica
        that holds the tenant. Without a version, the replica serves the tenant's latest, which
        every holder has (the front loads a new version into all holders before it answers)."""
        if request_key is not None:
            KeyedRequests.check(request_key)
        request = {
            "policy_version": policy_version,
            "session_id": session_id,
            "seeds": seeds,
            "sample": sample,
            "operation": operation,
        }
        outer: Future = Future()
        with self._lock:
            self.counts["requests"] += 1
        self._dispatch(outer, tenant_id, list(observations), request, MAX_ATTEMPTS, set())
        if request_key is not None:
            self._keyed.register(tenant_id, request_key, outer)
        return outer

    def cancel(self, tenant_id: str, request_key: str) -> bool:
        """Cancel the tenant's request submitted with `request_key`, here and on its replica."""
        return self._keyed.cancel(tenant_id, request_key)

    def _dispatch(
        self,
        outer: Future,
        tenant_id: str,
        observations: list[Observation],
        request: dict[str, Any],
        attempts: int,
        tried: set[str],
    ) -> None:
        try:
            holders = self._holders(tenant_id)
            if not self._usable(holders, tried):
                # Every holder failed it, or is gone from here while the front has not seen it yet
                # (its monitor probes every interval_s): one holder elsewhere.
                holders = self._place(tenant_id, 1, [h for h in holders if h not in self._handles or h in tried])
        except BaseException as error:  # the front refused (unknown tenant) or is away
            self._fail(outer, error)
            return
        with self._lock:
            candidates = self._usable(holders, tried) or self._usable(holders, set())
            if not candidates:
                self.counts["failed_requests"] += 1
                outer.set_exception(InferenceError(f"no Inference Model Service replica holds tenant {tenant_id!r}"))
                return
            name = min(candidates, key=lambda n: self._in_flight.get(n, 0))
            handle = self._handles[name]
            self._in_flight[name] = self._in_flight.get(name, 0) + 1
            self._tenant_in_flight[tenant_id] = self._tenant_in_flight.get(tenant_id, 0) + 1
            self._used.add(tenant_id)
            sent = self.sent.setdefault(tenant_id, {})
            sent[name] = sent.get(name, 0) + 1
        tried.add(name)
        key = uuid.uuid4().hex  # this attempt's key on the replica, to cancel it there
        try:
            if handle.is_remote:  # the actor's `predict`, by name: this module imports no torch (clients hold it)
                inner = handle.target.predict.remote(tenant_id, observations, **request, request_key=key).future()
            else:
                inner = handle.target.submit(tenant_id, observations, **request, request_key=key)
        except BaseException as error:
            inner = Future()
            inner.set_exception(error)

        def abandoned(_: Future) -> None:  # the caller gave up: the replica drops the queued work too
            if outer.cancelled() and not inner.done():
                try:
                    cancel_request(handle, tenant_id, key, wait=False)
                except Exception as error:  # the replica is gone: nothing of it is queued
                    log.debug("cancel on replica %s failed: %s", name, error)

        outer.add_done_callback(abandoned)

        def done(finished: Future) -> None:
            with self._lock:
                self._in_flight[name] -= 1
                self._tenant_in_flight[tenant_id] -= 1
            if outer.done() or finished.cancelled():
                return
            error = cause_of(finished.exception())
            if error is None:
                settle_future(outer, result=finished.result())
                return
            if self._moved(name, tenant_id, request["policy_version"], error) and attempts > 1:
                log.info("replica %s failed a request of %r (%s); routing it again", name, tenant_id, error)
                with self._lock:
                    self.counts["rerouted_requests"] += 1
                    self._fetched_at = 0.0  # read the table again before routing it
                # Its own thread: reading the table is a call, and this callback's thread is Ray's.
                args = (outer, tenant_id, observations, request, attempts - 1, tried)
                threading.Thread(target=self._dispatch, args=args, daemon=True).start()
                return
            self._fail(outer, error)

        inner.add_done_callback(done)

    def _usable(self, holders: list[str], tried: set[str]) -> list[str]:
        """The holders this router reaches and has not tried for the request."""
        return [n for n in holders if n in self._handles and n not in tried]

    def _moved(self, name: str, tenant_id: str, version: int | None, error: BaseException) -> bool:
        """Whether the request failed for where it was sent, not for what it asked: the replica is
        gone, or it does not hold the tenant (any more); then it is routed again."""
        if replica_gone(error):
            with self._lock:
                self._handles.pop(name, None)  # until the table names it again
            return True
        # A replica holding the tenant but not the pinned version: the caller's error.
        return isinstance(error, UnknownPolicyVersion) and not (version is not None and error.available)

    def _fail(self, outer: Future, error: BaseException) -> None:
        with self._lock:
            self.counts["failed_requests"] += 1
        settle_future(outer, exception=error)

    # -- everything else is the front's -------------------------------------------------------
    def load_weights(self, payload: bytes) -> dict[str, Any]:
        return self.front.load_weights(payload)

    def versions(self, tenant_id: str) -> list[int]:
        return self.front.versions(tenant_id)

    def latest_version(self, tenant_id: str) -> int | None:
        return self.front.latest_version(tenant_id)

    def tenants(self) -> list[str]:
        return self.front.tenants()

    def remove_tenant(self, tenant_id: str) -> int:
        removed = self.front.remove_tenant(tenant_id)
        with self._lock:
            self._table.pop(tenant_id, None)
        return removed

    def flush_usage(self) -> bool:
        return self.front.flush_usage()

    def stats(self) -> dict[str, Any]:
        """The front's stats, with this router's counts under `router`."""
        with self._lock:
            counts = dict(self.counts)
        return {**self.front.stats(), "router": counts}

    def heartbeat(self) -> dict[str, Any]:
        return self.front.heartbeat()

    def close(self) -> None:
        """Nothing of the deployment closes with a caller's router."""

    @property
    def _actor_id(self) -> Any:
        """The front actor's id: a role follower comparing ids sees the router as its front."""
        return getattr(self.front.target, "_actor_id", None)

    def __getattr__(self, name: str) -> Any:  # scale_to, replicas, assignment, ...: the front's
        if name.startswith("_") or name == "front":
            raise AttributeError(name)
        return getattr(self.front, name)

    def __reduce__(self) -> tuple[Any, ...]:  # a router travels as its front (by handle) and namespace
        return (_rebuild, (self.front.target, self.namespace, self.refresh_s))


def _rebuild(front: Any, namespace: str | None, refresh_s: float) -> TenantRouter:
    return TenantRouter(front, namespace=namespace, refresh_s=refresh_s)


def inference_endpoint(target: Any, *, replicated: bool, namespace: str | None = None) -> Any:
    """What a caller holds for the deployment's inference: with replicas (`replicated`: the settings'
    `inference_scaling.max_replicas > 1`) a `TenantRouter` over the set's actor, so requests go
    straight to the replicas; otherwise the service's actor itself."""
    if not replicated or not handle_of(target).is_remote:
        return target
    return TenantRouter(target, namespace=namespace)
