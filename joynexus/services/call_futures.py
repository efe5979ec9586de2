"""Futures of lower-layer calls: a per-tenant ordered call queue with kept results (issue 28).

A client submits `forward_backward` / `optim_step` / `predict` / `sample` / `compute_logprobs`
without waiting and collects each result later, so it overlaps its next submission with the
current call (Tinker's `*_async`). One `CallFutures` serves a whole deployment: in Ray mode it is
one named actor every API replica shares (`call_futures_actor`), so a future submitted through one
replica is collected through any other, and a tenant's calls keep their order whichever replica
took them; in process it is a local object of the API.

Guarantees:

- order: a tenant's calls run one at a time in submission order (other tenants run beside them);
- bounded: at most `max_pending_per_tenant` calls wait per tenant (then `submit` refuses); a
  finished call's result is kept `keep_results_s` seconds and at most `max_kept_per_tenant` per
  tenant (the oldest go first), then collecting it answers "expired";
- all or nothing per step: an `optim_step` after a failed `forward_backward` of the same chain
  (since the last step) is refused and the chain's pending gradients are discarded, so a step never
  applies half of what its caller submitted;
- abandoned chains: when a tenant's queue is idle with gradients its futures accumulated but no
  `optim_step` submitted, and its client has neither submitted nor collected anything for
  `abandon_after_s`, those gradients are discarded (`TrainingModelService.discard_pending_gradients`)
  by the periodic sweep or, whichever comes first, when that tenant's next call is submitted; a later
  `optim_step` is then refused and says why.

The calls themselves are the services' own methods (validated by the gateway before submission),
metered here in device-seconds like the gateway meters its blocking calls.
"""

from __future__ import annotations

import collections
import itertools
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from joynexus.actors import actor_class, service_handle
from joynexus.core.metering import TRAINING, UsageMeter
from joynexus.services.sample_slices import sample_in_slices
from joynexus.services.training.errors import TenantSlotError
from joynexus.settings import database_url_ref, resolve_database_url

if TYPE_CHECKING:  # the API imports this module: it must not import the services (torch)
    from joynexus.services.inference.service import InferenceModelService
    from joynexus.services.training.service import TrainingModelService

__all__ = [
    "CALL_FUTURES_ACTOR_NAME",
    "CALL_KINDS",
    "CallFutures",
    "FutureLimits",
    "FutureRefused",
    "UnknownFuture",
    "call_futures_actor",
]

CALL_FUTURES_ACTOR_NAME = "joynexus.call_futures"
CALL_KINDS = ("forward_backward", "optim_step", "predict", "sample", "compute_logprobs")
# Calls the training service meters through us (predict is metered by the Inference Model Service).
_METERED = ("forward_backward", "optim_step", "sample", "compute_logprobs")


@dataclass(frozen=True)
class FutureLimits:
    keep_results_s: float = 600.0  # a finished call's result is kept this long
    max_kept_per_tenant: int = 256  # finished results kept per tenant (oldest dropped first)
    max_pending_per_tenant: int = 64  # submitted, not yet finished
    abandon_after_s: float = 120.0  # no client contact this long: an open chain's gradients go
    sweep_interval_s: float = 5.0
    max_wait_s: float = 60.0  # the longest one collect waits for a result

    def __post_init__(self) -> None:
        for name in ("keep_results_s", "abandon_after_s", "sweep_interval_s", "max_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("max_kept_per_tenant", "max_pending_per_tenant"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


class UnknownFuture(KeyError):
    """No such future of this tenant (never submitted, someone else's, or its result expired)."""


class FutureRefused(RuntimeError):
    """The tenant's queue is full: collect results before submitting more."""


@dataclass
class _Call:
    future_id: str
    tenant_id: str
    kind: str
    args: dict[str, Any]
    submitted_at: float
    state: str = "pending"  # pending -> running -> done | failed
    result: Any = None
    error: BaseException | None = None
    finished_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def info(self) -> dict[str, Any]:
        return {"future_id": self.future_id, "kind": self.kind, "state": self.state, "submitted_at": self.submitted_at}


@dataclass
class _TenantQueue:
    pending: collections.deque[_Call] = field(default_factory=collections.deque)
    kept: collections.OrderedDict[str, _Call] = field(default_factory=collections.OrderedDict)
    draining: bool = False
    last_contact: float = 0.0
    open_gradients: bool = False  # a future's forward_backward succeeded since the last step / discard
    chain_mark: tuple[int, int] | None = None  # (version, accumulated microbatches) its last one left
    failed_in_chain: str | None = None  # the failed forward_backward future of the open chain
    discarded: str | None = None  # why the chain's gradients were discarded (for the next optim_step)


class CallFutures:
    """The per-tenant ordered call queue (module docstring). `training` / `inference`: the services
    (local objects or Ray actor handles); `meter` (or `database_url` to open one): where the
    training calls' device-seconds go."""

    def __init__(
        self,
        training: Any,
        inference: Any,
        *,
        meter: UsageMeter | None = None,
        database_url: str | None = None,
        limits: FutureLimits | None = None,
        max_workers: int = 16,
        sweep: bool = True,
    ) -> None:
        self.training = service_handle(cast("type[TrainingModelService]", object), training)
        self.inference = service_handle(cast("type[InferenceModelService]", object), inference)
        # an actor gets the database login by reference (settings.database_url_ref), read here
        url = resolve_database_url(database_url)
        self.meter = meter if meter is not None or url is None else UsageMeter.from_url(url)
        self.limits = limits or FutureLimits()
        self._lock = threading.Lock()
        self._tenants: dict[str, _TenantQueue] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="call-futures")
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        if sweep:
            self._sweeper = threading.Thread(target=self._sweep_loop, name="call-futures-sweep", daemon=True)
            self._sweeper.start()

    # -- the client's side -----------------------------------------------------------------------
    def submit(self, tenant_id: str, kind: str, args: dict[str, Any]) -> dict[str, Any]:
        """Queue `kind(tenant_id, **args)` behind the tenant's earlier calls: its future's info."""
        if kind not in CALL_KINDS:
            raise ValueError(f"kind: {kind!r} is not one of {list(CALL_KINDS)}")
        self._discard_if_abandoned(tenant_id)
        now = time.time()
        with self._lock:
            queue = self._tenants.setdefault(tenant_id, _TenantQueue())
            queue.last_contact = now
            if len(queue.pending) >= self.limits.max_pending_per_tenant:
                raise FutureRefused(
                    f"{len(queue.pending)} calls of tenant {tenant_id!r} are waiting (the limit is "
                    f"{self.limits.max_pending_per_tenant}): collect results before submitting more"
                )
            call = _Call(f"fut-{next(self._ids)}-{secrets.token_hex(6)}", tenant_id, kind, args, now)
            queue.pending.append(call)
            queue.kept[call.future_id] = call
            start = not queue.draining
            queue.draining = True
        if start:
            self._pool.submit(self._drain, tenant_id)
        return call.info()

    def collect(self, tenant_id: str, future_id: str, wait_s: float = 0.0) -> dict[str, Any]:
        """The future's info, waiting up to `wait_s` for it to finish; a finished one also carries
        `result` (the service's answer) or `error` (its exception, to raise)."""
        with self._lock:
            queue = self._tenants.get(tenant_id)
            call = queue.kept.get(future_id) if queue is not None else None
            if call is None or queue is None:
                raise UnknownFuture(future_id)
            queue.last_contact = time.time()
        call.done.wait(max(0.0, min(wait_s, self.limits.max_wait_s)))
        with self._lock:
            queue.last_contact = time.time()
        info = call.info()
        if call.state == "done":
            info["result"] = call.result
        elif call.state == "failed":
            info["error"] = call.error
        return info

    def tenant_status(self, tenant_id: str) -> dict[str, Any]:
        """Pending and kept futures of a tenant, and whether its chain holds open gradients."""
        with self._lock:
            queue = self._tenants.get(tenant_id) or _TenantQueue()
            return {
                "pending": len(queue.pending),
                "kept": len(queue.kept),
                "open_gradients": queue.open_gradients,
                "discarded": queue.discarded,
            }

    def sweep(self, now: float | None = None) -> list[str]:
        """Expire old results and discard abandoned chains' gradients: the tenants discarded."""
        now = time.time() if now is None else now
        with self._lock:
            tenants = list(self._tenants)
        discarded = [t for t in tenants if self._discard_if_abandoned(t, now)]
        with self._lock:
            for tenant_id, queue in list(self._tenants.items()):
                self._expire(queue, now)
                if not (queue.kept or queue.pending or queue.draining or queue.open_gradients or queue.discarded):
                    del self._tenants[tenant_id]  # nothing left of it: a deleted tenant leaves no trace
        return discarded

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.meter is not None:
            self.meter.try_flush()

    # -- execution ---------------------------------------------------------------------------------
    def _drain(self, tenant_id: str) -> None:
        """Run the tenant's calls in order until its queue is empty (one drain per tenant at a time)."""
        while True:
            with self._lock:
                queue = self._tenants[tenant_id]
                if not queue.pending:
                    queue.draining = False
                    return
                call = queue.pending[0]
                call.state = "running"
            try:
                result, error = self._run(queue, call), None
            except Exception as raised:
                result, error = None, raised
            with self._lock:
                queue.pending.popleft()
                self._settle(queue, call, result, error)
                self._expire(queue, time.time())

    def _run(self, queue: _TenantQueue, call: _Call) -> Any:
        tenant_id, args = call.tenant_id, call.args
        if call.kind == "optim_step" and queue.failed_in_chain is not None:
            failed, queue.failed_in_chain = queue.failed_in_chain, None
            self.training.discard_pending_gradients(tenant_id)
            queue.open_gradients = False
            raise TenantSlotError(
                f"forward_backward future {failed} of this step failed: the step's pending gradients were "
                "discarded (a step applies all of its microbatches or none); submit them again"
            )
        if call.kind == "optim_step" and queue.discarded is not None:
            reason, queue.discarded = queue.discarded, None
            raise TenantSlotError(f"no pending gradients to apply: {reason}")
        if call.kind == "predict":
            return self.inference.predict(tenant_id, **args)
        if call.kind == "sample":  # in bounded slices: other tenants' calls reach the service between them
            result = sample_in_slices(lambda sliced: self.training.sample(tenant_id, **sliced), args)
        else:
            result = getattr(self.training, call.kind)(tenant_id, **args)
        if self.meter is not None and call.kind in _METERED:
            samples = result.get("samples", 0) if call.kind == "forward_backward" else 0
            seconds = float(result.get("seconds", 0.0))
            self.meter.record(tenant_id, TRAINING, call.kind, device_seconds=seconds, samples=samples)
        return result

    @staticmethod
    def _settle(queue: _TenantQueue, call: _Call, result: Any, error: BaseException | None) -> None:
        call.result, call.error = result, error
        call.state = "failed" if error is not None else "done"
        call.finished_at = time.time()
        if call.kind == "forward_backward":
            if error is None:
                queue.open_gradients, queue.discarded = True, None
                queue.chain_mark = (result["version"], result["accumulated_microbatches"])
            elif queue.failed_in_chain is None:  # the next optim_step of this chain is refused
                queue.failed_in_chain = call.future_id
        elif call.kind == "optim_step":
            queue.open_gradients, queue.failed_in_chain = False, None
        call.done.set()

    def _expire(self, queue: _TenantQueue, now: float) -> None:
        """Drop finished results past their time, then the oldest past the count (lock held)."""
        finished = [c for c in queue.kept.values() if c.finished_at is not None]
        over = len(finished) - self.limits.max_kept_per_tenant
        for call in finished:
            if over > 0 or now - call.finished_at > self.limits.keep_results_s:  # type: ignore[operator]
                del queue.kept[call.future_id]
                over -= 1

    # -- abandoned chains --------------------------------------------------------------------------
    def _discard_if_abandoned(self, tenant_id: str, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        with self._lock:
            queue = self._tenants.get(tenant_id)
            if queue is None or not queue.open_gradients or queue.pending or queue.draining:
                return False
            idle = now - queue.last_contact
            if idle <= self.limits.abandon_after_s:
                return False
            queue.open_gradients, queue.failed_in_chain = False, None
            queue.draining = True  # nothing of this tenant runs while its gradients go
            mark = queue.chain_mark
        try:  # only what the chain left: a blocking step or microbatch since then keeps them
            dropped = self.training.discard_pending_gradients(tenant_id, mark)
        except Exception:  # the tenant is gone (its slot with it): nothing left to discard
            dropped = {"microbatches": 0}
        with self._lock:
            if dropped["microbatches"]:
                queue.discarded = (
                    f"the futures chain's {dropped['microbatches']} forward_backward microbatches were discarded "
                    f"after {idle:.0f} s without a call or collect from the client (abandon_after_s="
                    f"{self.limits.abandon_after_s:g})"
                )
            queue.draining = False
            start = bool(queue.pending)
            queue.draining = start
        if start:  # calls submitted while the gradients went
            self._pool.submit(self._drain, tenant_id)
        return True

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.limits.sweep_interval_s):
            try:
                self.sweep()
            except Exception:  # the sweep retries next interval; a service hiccup must not end it
                pass


def call_futures_actor(training: Any, inference: Any, *, database_url: str, namespace: str | None = None) -> Any:
    """The deployment's one `CallFutures` actor (created on first use, then shared by every API
    replica): detached, so a replica that restarts does not take the other replicas' futures along;
    threaded, so collects waiting for results do not hold up submissions."""
    import ray

    from joynexus.actors import role_resources

    options: dict[str, Any] = {
        "name": CALL_FUTURES_ACTOR_NAME,
        "get_if_exists": True,
        "lifetime": "detached",
        # no CPU of its own by default; a deployment gives it some (deployments/config.yaml), so it is
        # never placed on a Ray head of num-cpus 0, whose restart would restart it and lose its futures
        **role_resources("call_futures").ray_options(default_num_cpus=0),
        "max_concurrency": 64,
        # Restarted in place if its process dies: the futures it held are lost (collecting one
        # answers "not found"), new submissions work again at once.
        "max_restarts": -1,
    }
    if namespace is not None:
        options["namespace"] = namespace
    # Its stand-in class (`actor_class`): `joynexus down` and other drivers look it up without torch.
    # The database login by reference: Ray keeps actor arguments in the GCS (settings.database_url_ref).
    login = database_url_ref(database_url)
    return ray.remote(actor_class(CallFutures)).options(**options).remote(training, inference, database_url=login)
