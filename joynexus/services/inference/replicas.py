"""Inference Model Service replicas behind one front (paper 4.5: elastic inference).

`InferenceReplicaSet` has the interface of `InferenceModelService` (`endpoint.InferenceEndpoint`:
submit / predict / load_weights / versions / latest_version / tenants / remove_tenant / flush_usage /
stats / heartbeat / close) and fronts N replicas of it, each a full service with its own backbone
and its own batching queue:
- routing: each request goes to the active replica with the fewest requests in flight (counted
  here, no call needed); that replica group-batches it with its other requests. A request whose
  replica died or closed under it is sent to another replica (a prediction has no side effect), and
  so is one a replica refused for a version published here (Ray restarted it in place and it took
  the request before the monitor restored its weights; it takes no traffic until restored).
- tenant affinity (issue 45.3; `ScalingPolicy.max_tenants_per_replica`): a replica holds at most
  that many tenants (`affinity.TenantAffinity`, LRU), loaded from the payloads kept here on demand;
  a tenant's requests go only to its holders; one with over `hot_tenant_in_flight` requests in
  flight per holder gets one more. Callers route themselves (`router.TenantRouter`, by
  `assignment()` / `route()`): a request does not pass through this set's actor.
- weights: `load_weights` publishes to every replica (with affinity: the tenant's holders); the
  last `max_versions_per_tenant` payloads of each tenant are kept, so a new replica, or one Ray
  restarted in place, gets them before it takes traffic. A request without a version is pinned
  here to the tenant's latest version, which every active replica (holder) holds.
- scaling: `scale_to(n)` within the policy's bounds, and, when the policy is elastic, an
  autoscaler round every `interval_s` (`joynexus.scheduling.autoscaler`: queue depth per replica,
  p99 latency, cooldown). Scale-in drains: the replica stops taking requests, its requests in
  flight finish, then it is stopped.

Replicas are local objects (`LocalReplicas`: tests, one process) or Ray actors (`RayReplicas`);
in a deployment the set itself is the named actor `joynexus.inference_service` (threaded) and its
replica actors are its own (not detached): they go when it goes, and a restarted set starts fresh
ones, which the Master's Health Manager serves again (`publish_weights` of the tenants it held).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from joynexus.actors import ServiceHandle
from joynexus.artifacts import decode_tenant_payload
from joynexus.scheduling.autoscaler import Autoscaler, LoadSignals
from joynexus.scheduling.inference_queue import Observation, settle_future
from joynexus.services.inference.affinity import TenantAffinity
from joynexus.services.inference.cancellation import KeyedRequests, cancel_request
from joynexus.services.inference.endpoint import PredictBySubmit
from joynexus.services.inference.errors import InferenceError, UnknownPolicyVersion, cause_of, replica_gone
from joynexus.services.inference.replica_factory import (  # noqa: F401
    LocalReplicas,
    RayReplicas,
    ReplicaFactory,
    merge_histograms,
    sum_known,
)
from joynexus.services.inference.service import InferenceModelService
from joynexus.services.inference.tenant_placement import TenantPlacement
from joynexus.settings import ScalingPolicy

log = logging.getLogger(__name__)

REPLICA_ACTOR_PREFIX = "joynexus.inference_replica"
MAX_ATTEMPTS = 3  # replicas one request may be sent to (the first one died or closed under it)
LATENCY_WINDOW_S = 30.0  # p99 over the requests finished this recently
PROBE_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 600.0  # a new replica builds its backbone before it answers


@dataclass(eq=False)
class _Replica:
    name: str
    handle: ServiceHandle
    state: str = "starting"  # starting -> active <-> restoring | unreachable -> draining -> stopped
    in_flight: int = 0
    served: int = 0
    incarnation: str | None = None
    pid: int | None = None
    restarts: int = 0
    queue_depth: int = 0  # its queue as its last heartbeat said (routers' requests included)
    reported: int = 0  # requests it served by its last heartbeat (routers' too; since its last restart)
    created_at: float = field(default_factory=time.time)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "in_flight": self.in_flight,
            "served": max(self.served, self.reported),
            "incarnation": self.incarnation,
            "pid": self.pid,
            "restarts": self.restarts,
        }


class InferenceReplicaSet(TenantPlacement, PredictBySubmit):
    def __init__(
        self,
        factory: ReplicaFactory,
        *,
        policy: ScalingPolicy | None = None,
        max_versions_per_tenant: int = 3,
        autoscale: bool = True,
    ):
        """Starts `policy.min_replicas` replicas (each built before this returns) and, with an
        elastic policy and `autoscale`, the autoscaler; a monitor restores restarted replicas."""
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        self.policy = policy or ScalingPolicy()
        if max_versions_per_tenant < 1:
            raise ValueError(f"max_versions_per_tenant must be >= 1, got {max_versions_per_tenant}")
        self.max_versions = max_versions_per_tenant
        self.factory = factory
        self.autoscaler = Autoscaler(self.policy)
        self.autoscale = autoscale and self.policy.elastic
        self._replicas: list[_Replica] = []
        self._next_index = 0
        self._cond = threading.Condition()  # guards _replicas' states and counters; drains wait on it
        self._publish_lock = threading.RLock()  # one publish / replay at a time: a new replica misses none
        self._scale_lock = threading.Lock()
        self._kept: dict[str, OrderedDict[int, bytes]] = {}  # tenant -> version -> payload (for new replicas)
        self._latencies: deque[tuple[float, float]] = deque(maxlen=4096)  # (finished at, seconds)
        self._counts = {"requests": 0, "failed_requests": 0, "rerouted_requests": 0, "scale_events": 0}
        self._events: deque[dict[str, Any]] = deque(maxlen=32)
        self._last_decision = "none"
        # Which replicas hold which tenants (None: every replica holds every tenant); changed under
        # _publish_lock, with the loads and removals it asks for.
        cap = self.policy.max_tenants_per_replica
        self.affinity = TenantAffinity(cap) if cap is not None else None
        self._tenant_in_flight: dict[str, int] = {}  # this set's own requests per tenant (hot tenants)
        self._table: dict[str, tuple[str, ...]] = {}  # the affinity's table, swapped whole on each change
        self._keyed = KeyedRequests()  # requests submitted with a request_key, for `cancel`
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self.scale_to(self.policy.min_replicas, reason="start")
        self._monitor = threading.Thread(target=self._run, name="inference-replicas", daemon=True)
        self._monitor.start()

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
        """Route a request to a replica; a future of its result (see `InferenceModelService.submit`).
        Without a version the request is pinned to the tenant's latest published version.
        Cancelling the future (`cancel` by `request_key`, or `predict`'s timeout) cancels it on its
        replica, whose queue drops its work."""
        if request_key is not None:
            KeyedRequests.check(request_key)
        if policy_version is None:
            policy_version = self.latest_published(tenant_id)
        request = {
            "policy_version": policy_version,
            "session_id": session_id,
            "seeds": seeds,
            "sample": sample,
            "operation": operation,
        }
        outer: Future = Future()
        with self._cond:
            self._counts["requests"] += 1
        self._dispatch(outer, tenant_id, list(observations), request, time.monotonic(), MAX_ATTEMPTS, set())
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
        started: float,
        attempts: int,
        tried: set[str],
    ) -> None:
        held = None if self.affinity is None else set(self._holders(tenant_id))
        if held == set() and tenant_id not in self._kept:  # never published here: the caller's error
            with self._cond:
                self._counts["failed_requests"] += 1
            outer.set_exception(UnknownPolicyVersion(tenant_id, request["policy_version"], []))
            return
        with self._cond:
            active = [r for r in self._replicas if r.state == "active" and (held is None or r.name in held)]
            candidates = [r for r in active if r.name not in tried] or active
            if not candidates:
                self._counts["failed_requests"] += 1
                outer.set_exception(InferenceError("no Inference Model Service replica is serving right now"))
                return
            replica = min(candidates, key=lambda r: (r.in_flight, r.served))
            replica.in_flight += 1
            self._tenant_in_flight[tenant_id] = self._tenant_in_flight.get(tenant_id, 0) + 1
        tried.add(replica.name)
        replica_key = uuid.uuid4().hex  # this attempt's key on the replica, to cancel it there
        try:
            inner = replica.handle.start(  # locally, the service's own queue hands out the future
                InferenceModelService.predict, tenant_id, observations, locally=InferenceModelService.submit,
                **request, request_key=replica_key,
            )  # fmt: skip
        except BaseException as error:
            inner = Future()
            inner.set_exception(error)

        def abandoned(_: Future) -> None:  # the caller gave up: the replica drops the queued work too
            if outer.cancelled() and not inner.done():
                try:
                    cancel_request(replica.handle, tenant_id, replica_key, wait=False)
                except Exception as error:  # the replica is gone: nothing of it is queued
                    log.debug("cancel on replica %s failed: %s", replica.name, error)

        outer.add_done_callback(abandoned)

        def done(finished: Future) -> None:
            with self._cond:
                replica.in_flight -= 1
                replica.served += 1
                self._tenant_in_flight[tenant_id] -= 1
                self._cond.notify_all()
            if outer.done() or finished.cancelled():  # the caller gave up on it (cancelled): nothing to pass on
                return
            error = cause_of(finished.exception())
            if error is None:
                with self._cond:
                    self._latencies.append((time.monotonic(), time.monotonic() - started))
                settle_future(outer, result=finished.result())
                return
            lost = self._lost_weights(replica, tenant_id, request["policy_version"], error)
            if (lost or replica_gone(error)) and attempts > 1:
                log.warning("replica %s failed a request (%s); sending it to another", replica.name, error)
                with self._cond:
                    self._counts["rerouted_requests"] += 1
                # On a thread of its own: placing the tenant may load weights, and this callback's
                # thread may be one a publisher waits on.
                threading.Thread(
                    target=self._dispatch,
                    args=(outer, tenant_id, observations, request, started, attempts - 1, tried),
                    daemon=True,
                ).start()
                return
            with self._cond:
                self._counts["failed_requests"] += 1
            settle_future(outer, exception=error)

        inner.add_done_callback(done)

    def _lost_weights(self, replica: _Replica, tenant_id: str, version: int | None, error: BaseException) -> bool:
        """A replica that does not know a version published here lost its weights: Ray restarted it
        in place and it took this request before the monitor saw the new incarnation (a call sent
        while an actor restarts may run in its new process). It takes no traffic until the monitor
        has restored it."""
        if not isinstance(error, UnknownPolicyVersion):
            return False
        if self.affinity is not None and replica.name not in self._table.get(tenant_id, ()):
            return True  # the tenant left that replica (evicted) since: sent where it is now
        if version is None:
            return False
        # Read without _publish_lock: this runs in a future's callback, whose thread may be the one
        # a publisher holding that lock waits on (a dict lookup is atomic under the GIL).
        if version not in self._kept.get(tenant_id, {}):
            return False  # never published (or no longer kept): the caller's error
        with self._cond:
            if replica.state == "active":
                replica.state = "unreachable"
        return True

    # -- weights ------------------------------------------------------------------------------
    def load_weights(self, payload: bytes) -> dict[str, Any]:
        """Publish a tenant payload to every replica (a refused payload is refused by all alike);
        kept for replicas that start later or restart."""
        with self._publish_lock:
            targets = self._live()
            tenant_id = None
            if self.affinity is not None and targets:  # its holders, or one replica placed now
                tenant_id = decode_tenant_payload(payload)[1].tenant_id
                held = set(self._place(tenant_id, 1))
                targets = [r for r in targets if r.name in held]
            if not targets:
                raise InferenceError("no Inference Model Service replica to load weights into")
            results = self._on_each(targets, InferenceModelService.load_weights, payload)
            answer = next((r for r in results.values() if not isinstance(r, BaseException)), None)
            refused = [e for e in results.values() if isinstance(e, BaseException) and not replica_gone(e)]
            if refused or answer is None:
                if tenant_id is not None and tenant_id not in self._kept:  # a new tenant refused: held nowhere
                    self.affinity.forget(tenant_id)  # type: ignore[union-attr]
                    self._sync_table()
                raise (refused or list(results.values()))[0]
            versions = self._kept.setdefault(answer["tenant_id"], OrderedDict())
            versions[answer["version"]] = payload
            while len(versions) > self.max_versions:  # the oldest go first; never the latest
                versions.pop(min(versions))
        return answer

    def latest_published(self, tenant_id: str) -> int | None:
        """The tenant's highest published version (every active replica holds it); None if none."""
        with self._publish_lock:
            versions = self._kept.get(tenant_id)
            return max(versions) if versions else None

    def versions(self, tenant_id: str) -> list[int]:
        """Versions every active replica serves (with affinity: every active holder; a tenant held
        by none serves its kept versions, paged in on its next request)."""
        targets = self._active()
        if self.affinity is not None:
            held = self._table.get(tenant_id, ())
            targets = [r for r in targets if r.name in held]
            if not targets:
                with self._publish_lock:
                    return sorted(self._kept.get(tenant_id, ()))
        served: set[int] | None = None
        for answer in self._on_each(targets, InferenceModelService.versions, tenant_id).values():
            if isinstance(answer, BaseException):
                continue
            served = set(answer) if served is None else served & set(answer)
        return sorted(served or ())

    def latest_version(self, tenant_id: str) -> int | None:
        versions = self.versions(tenant_id)
        return versions[-1] if versions else None

    def tenants(self) -> list[str]:
        with self._publish_lock:
            return sorted(self._kept)

    def remove_tenant(self, tenant_id: str) -> int:
        with self._publish_lock:
            self._kept.pop(tenant_id, None)
            results = self._on_each(self._live(), InferenceModelService.remove_tenant, tenant_id)
            if self.affinity is not None:
                self.affinity.forget(tenant_id)
                self._sync_table()
        counts = [r for r in results.values() if not isinstance(r, BaseException)]
        return max(counts, default=0)

    def flush_usage(self) -> bool:
        results = self._on_each(self._live(), InferenceModelService.flush_usage)
        return all(r is True for r in results.values())

    # -- scaling ------------------------------------------------------------------------------
    def scale_to(self, replicas: int, *, reason: str = "operator") -> dict[str, Any]:
        """Start or drain replicas until `replicas` are active (within the policy's bounds)."""
        p = self.policy
        if (
            isinstance(replicas, bool)
            or not isinstance(replicas, int)
            or not p.min_replicas <= replicas <= p.max_replicas
        ):
            raise ValueError(
                f"replicas: {replicas!r} is outside [min_replicas={p.min_replicas}, max_replicas={p.max_replicas}]"
            )
        with self._scale_lock:
            before = len(self._active())
            while len(self._active()) < replicas:
                self._add_replica()
            while len(self._active()) > replicas:
                self._drain_and_remove(min(self._active(), key=lambda r: (r.in_flight, -r.created_at)))
            after = len(self._active())
            if after != before and reason != "start":  # the first replicas are not a scaling event
                self.autoscaler.note_change(time.monotonic())
                with self._cond:
                    self._counts["scale_events"] += 1
                    self._events.append({"at": time.time(), "from": before, "to": after, "reason": reason})
                log.info("inference replicas %d -> %d (%s)", before, after, reason)
        return {"replicas": after, "before": before, "reason": reason}

    def set_autoscale(self, enabled: bool) -> bool:
        """Pause (False) or resume (True) the autoscaler, e.g. while an operator holds a size with
        `scale_to`; only an elastic policy can autoscale. Returns whether it now runs."""
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled: expected true or false, got {enabled!r}")
        if enabled and not self.policy.elastic:
            raise ValueError(
                f"enabled: the policy is a fixed size (min_replicas = max_replicas = {self.policy.max_replicas})"
            )
        self.autoscale = enabled
        return self.autoscale

    def replicas(self) -> list[dict[str, Any]]:
        with self._cond:
            return [r.describe() for r in self._replicas]

    def _add_replica(self) -> _Replica:
        with self._cond:
            index, self._next_index = self._next_index, self._next_index + 1
        name = f"{REPLICA_ACTOR_PREFIX}.{self.incarnation}.{index}"
        replica = _Replica(name, ServiceHandle(self.factory.create(name)))
        with self._cond:
            self._replicas.append(replica)  # visible (starting), not routable yet
        try:
            beat = replica.handle.probe("heartbeat", STARTUP_TIMEOUT_S)  # waits for its backbone
            replica.incarnation, replica.pid = beat.get("incarnation"), beat.get("pid")
            self._restore(replica, "active")
            if self.affinity is not None:  # holds no tenant yet: tenants are placed on it on demand
                with self._publish_lock:
                    self.affinity.add_replica(name)
        except BaseException:
            self._stop_replica(replica)
            raise
        return replica

    def _restore(self, replica: _Replica, state_after: str) -> int:
        """Load every kept payload into `replica` (version order; with affinity only its tenants'),
        then let it take traffic."""
        with self._publish_lock:
            mine = None if self.affinity is None else set(self.affinity.tenants_of(replica.name))
            payloads = [
                p
                for tenant_id, versions in self._kept.items()
                if mine is None or tenant_id in mine
                for _, p in sorted(versions.items())
            ]
            for payload in payloads:
                replica.handle.load_weights(payload)
            with self._cond:
                replica.state = state_after
        return len(payloads)

    def _drain_and_remove(self, replica: _Replica) -> None:
        deadline = time.monotonic() + self.policy.drain_timeout_s
        with self._cond:
            replica.state = "draining"  # no new requests from here on
        self._forget_replica(replica)  # routers' next table leaves it out
        with self._cond:
            while replica.in_flight > 0 and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            left = replica.in_flight
        if left:  # stopped anyway; its requests are sent to another replica (see _dispatch)
            log.warning(
                "replica %s still had %d requests after draining %.0f s",
                replica.name,
                left,
                self.policy.drain_timeout_s,
            )
        self._stop_replica(replica)

    def _stop_replica(self, replica: _Replica) -> None:
        self._forget_replica(replica)
        try:
            self.factory.destroy(replica.handle.target)
        except Exception as error:  # gone already
            log.warning("stopping replica %s: %s", replica.name, error)
        with self._cond:
            replica.state = "stopped"
            if replica in self._replicas:
                self._replicas.remove(replica)

    # -- monitor: restarts in place and the autoscaler ----------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.policy.interval_s):
            try:
                self.check_replicas()
                if self.autoscale:
                    self.autoscale_round()
            except Exception:  # the monitor must outlive a bad round
                log.exception("inference replica round failed")

    def check_replicas(self) -> list[str]:
        """Probe each replica; one Ray restarted in place (a new incarnation) gets every kept
        payload back before it takes traffic again; one that does not answer takes none meanwhile."""
        restored = []
        with self._cond:
            watched = [r for r in self._replicas if r.state in ("active", "unreachable", "restoring")]
        for replica in watched:
            try:
                beat = replica.handle.probe("heartbeat", PROBE_TIMEOUT_S)
            except Exception as error:
                with self._cond:
                    if replica.state == "active":
                        replica.state = "unreachable"
                log.warning("replica %s does not answer: %s", replica.name, error)
                continue
            replica.queue_depth = int(beat.get("queue_depth") or 0)
            replica.reported = int(beat.get("requests_served") or 0)
            if beat.get("incarnation") != replica.incarnation:
                with self._cond:
                    replica.state, replica.restarts = "restoring", replica.restarts + 1
                replica.incarnation, replica.pid = beat.get("incarnation"), beat.get("pid")
                count = self._restore(replica, "active")
                restored.append(replica.name)
                log.warning("replica %s restarted in place; %d payloads loaded again", replica.name, count)
            elif replica.state == "unreachable":
                with self._cond:
                    replica.state = "active"
        return restored

    def signals(self) -> LoadSignals:
        now = time.monotonic()
        with self._cond:
            active = [r for r in self._replicas if r.state == "active"]
            recent = [s for at, s in self._latencies if now - at <= LATENCY_WINDOW_S]
            # Routers send requests straight to replicas: their queues (last heartbeat) count too.
            in_flight = sum(max(r.in_flight, r.queue_depth) for r in active)
        p99 = float(np.percentile(recent, 99)) if recent else None
        return LoadSignals(replicas=len(active), in_flight=in_flight, p99_latency_s=p99)

    def autoscale_round(self) -> dict[str, Any]:
        signals = self.signals()
        decision = self.autoscaler.decide(signals, time.monotonic())
        self._last_decision = f"{decision.desired} replicas: {decision.reason}"
        if decision.changes(signals.replicas):
            return self.scale_to(decision.desired, reason=f"autoscaler: {decision.reason}")
        return {"replicas": signals.replicas, "before": signals.replicas, "reason": decision.reason}

    # -- status -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The replicas' stats summed (counters, histograms), plus the set's own view."""
        per_replica = self._on_each(self._live(), InferenceModelService.stats)
        answers = [s for s in per_replica.values() if not isinstance(s, BaseException)]
        total: dict[str, Any] = {}
        for key in ("batches", "requests", "samples", "failed_requests", "busy_seconds", "split_requests", "chunks"):
            total[key] = sum(s.get(key, 0) for s in answers)
        samples = total["samples"]
        signals = self.signals()
        with self._cond:
            counts, events = dict(self._counts), list(self._events)
        total.update(
            {
                # The replicas' own queues, read now (routers' requests included), and this set's.
                "queue_depth": max(sum(s.get("queue_depth", 0) for s in answers), self._own_in_flight()),
                "mean_batch_samples": samples / total["batches"] if total["batches"] else 0.0,
                "max_batch_samples": max((s.get("max_batch_samples", 0) for s in answers), default=0),
                "tenants": {t: self.versions(t) for t in self.tenants()},
                # One config for every replica: the first answer's B, T and chunk size are the set's.
                **{
                    key: answers[0].get(key) if answers else None
                    for key in ("max_chunk_samples", "max_batch_size", "max_wait_s")
                },
                "latency_seconds": merge_histograms([s.get("latency_seconds") for s in answers]),
                "batch_samples": merge_histograms([s.get("batch_samples") for s in answers]),
                "rss_bytes": sum_known([s.get("rss_bytes") for s in answers]),
                "device_memory_bytes": sum_known([s.get("device_memory_bytes") for s in answers]),
                "replicas": self.replicas(),
                "replica_set": {
                    **counts,
                    "policy": self.policy.model_dump(),
                    "autoscale": self.autoscale,
                    "p99_latency_s": signals.p99_latency_s,
                    "last_decision": self._last_decision,
                    "scale_events_recent": events,
                },
            }
        )
        return total

    def heartbeat(self) -> dict[str, Any]:
        """Cheap: no call to a replica (the monitor probes them). `tenants` are the ones published
        here, what the Master serves again if this set restarts."""
        with self._cond:
            replicas = [r.describe() for r in self._replicas]
            in_flight = sum(r.in_flight for r in self._replicas)
        tenants = sorted(self._kept.copy())  # not under _publish_lock: a restore holds it for seconds
        return {
            "role": "inference",
            "incarnation": self.incarnation,
            "started_at": self.started_at,
            "pid": os.getpid(),
            "tenants": tenants,
            "queue_depth": in_flight,
            "replicas": replicas,
        }

    def close(self) -> None:
        self._stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=10)
        with self._cond:
            replicas = list(self._replicas)
        for replica in replicas:
            self._stop_replica(replica)

    # -- internals ----------------------------------------------------------------------------
    def _own_in_flight(self) -> int:
        with self._cond:
            return sum(r.in_flight for r in self._replicas)

    def _active(self) -> list[_Replica]:
        with self._cond:
            return [r for r in self._replicas if r.state == "active"]

    def _live(self) -> list[_Replica]:
        """Replicas that hold (or are about to hold) weights: everything not stopped or starting."""
        with self._cond:
            return [r for r in self._replicas if r.state in ("active", "restoring", "unreachable", "draining")]

    @staticmethod
    def _on_each(replicas: list[_Replica], method: Any, *args: Any) -> dict[str, Any]:
        """Call `method` on every replica at once; {name: result or the exception it raised}."""
        futures = {r.name: r.handle.start(method, *args) for r in replicas}
        results: dict[str, Any] = {}
        for name, future in futures.items():
            try:
                results[name] = future.result(timeout=120)
            except BaseException as error:  # noqa: BLE001 - reported per replica
                results[name] = cause_of(error)
        return results
