"""Inference Model Service (paper sections 4.1.2, 4.3, A.3).

Keeps ONE resident frozen backbone and tenant serving states keyed by (tenant, policy version).
Requests from every tenant go through one Inference Queue; a worker thread forms a batch (target
size B, max wait T) by taking the tenants' pending requests round-robin, runs ONE shared backbone
forward over it —
the backbone canonicalizes mixed camera sets, image sizes and instruction lengths into one
physical batch — splits the features back by the recorded row slices, and decodes each request
with its own tenant's module at the version that request was pinned to. A tenant module that
fails fails only its own requests.

`load_weights` takes the payload `TrainingModelService.export_params` produces. Versions are held
in a bounded per-tenant LRU (the latest version is never evicted); a request pins its serving
state when it is submitted, so eviction never breaks a request already in the queue.

Tenant density (issue 14.5): at most `max_resident_serving` serving states, over all tenants, stay
in memory; the least recently used beyond it are paged out to a spill folder (each written once,
when loaded: a serving state never changes) and paged in by the next request for them, pinned
versions too (`tenant_residency`, `_ServingPager`). A state with a request queued or in a batch is
never paged out; page-ins happen at submission, so group batching sees resident modules only.

LoRA tenants: a payload carrying adapter tensors (`adapter/...`, config in the manifest's
`extra["adapter"]`) installs, beside its module, a peft LoRA adapter on the shared backbone, one per
serving version. A batch mixing tenants with different adapters (and tenants without) is still ONE
backbone forward: each sample runs through its own version's adapter (peft mixed-adapter batch). An
evicted version's adapter leaves the backbone; a request pinned to it re-installs it for its batch.

Fairness (issue 11): a request of more than `max_chunk_samples` observations (or more than B,
whichever is smaller) is split at submission into chunks of that size, and `TenantFairQueue` forms
each batch round-robin across tenants, least recently served first. So one tenant's 1,024-sample
predict costs another tenant's 1-sample predict at most a chunk-sized batch of waiting, not a
1,024-sample forward. The chunks' results are put back together in order for the caller: the same
actions as unsplit (per-observation seeds draw the same noise wherever a row is served).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from joynexus.artifacts import decode_tenant_payload
from joynexus.core.heap import freeze_startup_heap, in_ray_actor_process
from joynexus.core.histogram import BATCH_BOUNDS, LATENCY_BOUNDS, BucketHistogram
from joynexus.core.metering import INFERENCE, UsageMeter, build_meter, split_group_seconds
from joynexus.models.action_modules import ActionModule, ActionModuleConfig, build_action_module
from joynexus.models.adapters import LoraAdapterConfig, split_tenant_state
from joynexus.models.backbone import BackboneFeatures, BackboneSource, ResidentBackbone
from joynexus.models.module_batching import (
    StackedParameterCache,
    architecture_key,
    gather_inputs,
    group_log_prob,
    group_policy_mean,
    group_policy_std,
    group_predict,
    group_value,
    pad_rows,
    unpad_actions,
)
from joynexus.models.placement import DevicePlacement
from joynexus.scheduling.inference_queue import InferenceQueueClosed, InferenceRequest, Observation
from joynexus.services.residency import (
    DEFAULT_MAX_RESIDENT_SERVING,
    ResidencyLimits,
    TenantResidency,
    UnknownEntry,
    pins_until_settled,
    rebuild_module,
    tensor_bytes,
)

INFERENCE_SERVICE_ACTOR_NAME = "joynexus.inference_service"
# Observations one request puts into one backbone turn at most; a larger request is split (the
# effective size is also capped at max_batch_size). A quarter of the default B: a batch holding
# another tenant's small request still takes three of the large request's chunks, where chunks of
# B would leave the small request a forward of its own (measured: the bulk tenant's throughput is
# the same, benchmarks/predict_fairness.py).
DEFAULT_MAX_CHUNK_SAMPLES = 8
RECENT_BATCHES = 32  # batch compositions stats() shows, newest last
_SPARE_MODULES = 4  # modules of paged-out serving states kept per architecture for reuse (_ServingPager)
RECENT_BATCH_PARTS = 64  # entries listed per recorded batch (a B of thousands would bloat stats())

log = logging.getLogger(__name__)


class InferenceError(RuntimeError):
    pass


class UnknownPolicyVersion(InferenceError, KeyError):
    def __init__(self, tenant_id: str, version: int | None, available: list[int]):
        what = "no serving state" if not available else f"no version {version} (loaded: {available})"
        super().__init__(f"tenant {tenant_id!r} has {what} in this Inference Model Service")
        self.tenant_id, self.version, self.available = tenant_id, version, list(available)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its own fields: the default (cls(*args)) fails on the one message argument,
        # and Ray then hands callers an UnserializableException instead of this error.
        return (type(self), (self.tenant_id, self.version, self.available))


@dataclass
class ServingState:
    tenant_id: str
    version: int
    schema_signature: str
    module: ActionModule
    manifest_digest: str
    last_used: float = field(default_factory=time.monotonic)
    # The version's LoRA adapter (None: the tenant has none): its config, its tensors (kept here, so
    # it can be re-installed for a pinned request after eviction) and its key on the backbone.
    adapter: LoraAdapterConfig | None = None
    adapter_state: dict[str, torch.Tensor] | None = None
    adapter_key: tuple[Any, ...] | None = None


@dataclass
class _Pinned:
    """What a queued request needs at execution time, resolved at submission."""

    state: ServingState
    seeds: list[int] | None
    sample: bool = False
    operation: str = "predict"  # what the usage entry is recorded as ("predict", "rollout", ...)
    split: _Split | None = None  # set on each chunk of a split request
    chunk: int = 0  # this chunk's index within its split request


class _Split:
    """The caller's side of a request split into chunks: gathers the chunks' results, in chunk
    order, into one result on the caller's future. The first chunk that fails fails the request;
    once the request is settled (or cancelled by its caller) its unserved chunks are cancelled, and
    the queue drops cancelled chunks instead of running them."""

    def __init__(self, chunks: list[InferenceRequest], on_result: Callable[[_Split, dict[str, Any]], None]) -> None:
        self.future: Future = Future()
        self.request_id = chunks[0].request_id
        self.enqueued_at = chunks[0].enqueued_at
        self._chunks = chunks
        self._results: list[dict[str, Any] | None] = [None] * len(chunks)
        self._remaining = len(chunks)
        self._lock = threading.Lock()
        self._on_result = on_result  # (split, joined result) -> None; settles self.future
        for index, chunk in enumerate(chunks):
            chunk.future.add_done_callback(lambda done, index=index: self._chunk_done(index, done))
        self.future.add_done_callback(self._cancel_chunks)

    def _chunk_done(self, index: int, done: Future) -> None:
        if done.cancelled():  # only we cancel chunks: the request is already settled
            return
        error = done.exception()
        with self._lock:
            if self.future.done():
                return
            if error is None:
                self._results[index] = done.result()
                self._remaining -= 1
                if self._remaining:
                    return
                joined = _join_chunks(self._results)
        # Settled outside the lock: the caller's callbacks (and _cancel_chunks) run right here.
        if error is not None:
            _settle(self.future, exception=error)
        else:
            self._on_result(self, joined)

    def _cancel_chunks(self, _: Future) -> None:
        for chunk in self._chunks:
            chunk.future.cancel()  # a no-op on the chunks already served


def _join_chunks(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from a split request's chunk results, rows in chunk order."""

    def rows(key: str) -> np.ndarray | None:
        arrays = [part[key] for part in parts]
        return None if arrays[0] is None else np.concatenate(arrays)

    return {
        **parts[0],
        "actions": rows("actions"),
        "values": rows("values"),
        "log_probs": rows("log_probs"),
        "batch_samples": max(part["batch_samples"] for part in parts),  # the largest shared batch it rode in
        "device_seconds": sum(part["device_seconds"] for part in parts),
    }


class TenantFairQueue:
    """The Inference Queue with batches formed fairly across tenants; the interface of
    `joynexus.scheduling.inference_queue.InferenceQueue` (enqueue / depth / close / collect_prefix).

    Each tenant has its own FIFO of entries (requests, or chunks of split requests). A batch takes
    one entry from each tenant in turn — least recently served tenant first, ties by arrival — and
    goes round again while entries fit within B and share the first entry's prefix key. A tenant
    whose next entry does not fit sits out the rest of that batch (its own order is kept). The
    first entry is always taken, so every batch serves the tenant at the front, which then goes to
    the back: a tenant with pending work is served within (tenants with pending work) batches.

    Due, as for `InferenceQueue`: the batch holds >= B samples, or an entry could not join it
    (waiting cannot grow it), or the oldest pending entry has waited T.
    """

    def __init__(self) -> None:
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
        with self._cond:
            if self._closed:
                raise InferenceQueueClosed("the Inference Queue is closed")
            for request in requests:
                self._tenants.setdefault(request.tenant_id, deque()).append(request)
            self._count += len(requests)
            self._cond.notify_all()

    def depth(self) -> int:
        """Entries waiting (a split request counts once per unserved chunk). Cheap: the lock is
        held while a batch is picked, never while one runs."""
        with self._cond:
            return self._count

    def close(self) -> None:
        """Stop accepting work; pending requests fail so no caller waits forever."""
        with self._cond:
            self._closed = True
            pending = [request for entries in self._tenants.values() for request in entries]
            self._tenants.clear()
            self._count = 0
            self._cond.notify_all()
        for request in pending:
            _settle(request.future, exception=InferenceQueueClosed("the Inference Queue closed before serving this"))

    def collect_prefix(
        self, max_batch_size: int, timeout_s: float, poll_s: float | None = None
    ) -> list[InferenceRequest]:
        """Block until a batch is due, then remove and return it (empty if the wait ends with no
        requests: `poll_s` bounds how long an idle call blocks, so workers can check for shutdown).
        The name is `InferenceQueue`'s; the batch is the fair one described on the class."""
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
                while n < len(entries) and entries[n].future.done():  # cancelled: never run it
                    del entries[n]
                    self._count -= 1
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
        for tenant in set(order):
            self._last_served[tenant] = self._batches
            if not self._tenants[tenant]:
                del self._tenants[tenant]
        self._batches += 1
        self._count -= len(batch)
        return batch


def _as_tensor(value: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(value, dtype=np.float32))


class InferenceModelService:
    def __init__(
        self,
        backbone_source: BackboneSource | dict[str, Any],
        *,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        max_versions_per_tenant: int = 3,
        num_threads: int | None = None,
        start_worker: bool = True,
        meter: UsageMeter | None = None,
        database_url: str | None = None,
        max_chunk_samples: int | None = DEFAULT_MAX_CHUNK_SAMPLES,
        placement: DevicePlacement | dict[str, Any] | str | None = None,
        max_resident_serving: int = DEFAULT_MAX_RESIDENT_SERVING,
        max_resident_serving_bytes: int | None = None,
        spill_dir: str | Path | None = None,
    ):
        """`max_resident_serving` / `max_resident_serving_bytes`: how many serving states (one per
        tenant and version; and bytes of their tensors) stay in memory; the least recently used
        beyond them are paged out to a folder under `spill_dir` (None: a temporary folder) and paged
        in on the next request for them. A state with a request queued or in a batch stays.
        `placement`: the device (and backbone dtype) the backbone and the serving modules live on
        (None: what JOYNEXUS_DEVICE / JOYNEXUS_DTYPE say); results leave as numpy arrays whatever the device.
        `meter` (or `database_url`, from which a Ray actor builds its own) records each request's
        device-seconds as inference usage of its tenant; without either nothing is recorded.
        `max_chunk_samples`: a request of more observations (or of more than `max_batch_size`) is
        split into chunks that queue fairly with other tenants' requests; None never splits."""
        # Who this is, for heartbeats: a restarted service answers with a new incarnation.
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        if max_versions_per_tenant < 1:
            raise ValueError(f"max_versions_per_tenant must be >= 1, got {max_versions_per_tenant}")
        if max_chunk_samples is not None and (isinstance(max_chunk_samples, bool) or max_chunk_samples < 1):
            raise ValueError(f"max_chunk_samples must be >= 1 or None (never split), got {max_chunk_samples!r}")
        if num_threads:
            torch.set_num_threads(num_threads)
        source = (
            BackboneSource.model_validate(backbone_source) if isinstance(backbone_source, dict) else backbone_source
        )
        self.placement = DevicePlacement.of(placement)
        self.backbone: ResidentBackbone = source.build(self.placement)
        self.device = self.backbone.device
        self.meter, self._owns_meter = build_meter(meter, database_url)
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_versions = max_versions_per_tenant
        self.max_chunk_samples = max_chunk_samples
        self.queue = TenantFairQueue()
        # Each tenant's loaded versions, least recently used first (the per-tenant version bound);
        # the serving states themselves, resident or paged out, are in _serving, by (tenant, version).
        self._states: dict[str, OrderedDict[int, None]] = {}
        self._lock = threading.RLock()  # guards _states; never held while a batch runs
        # Lock order: _serving's lock, then _lock or the backbone's adapter lock (its pager takes
        # them); so _serving is never called with _lock held.
        self._serving: TenantResidency[tuple[str, int], ServingState] = TenantResidency(
            _ServingPager(self),
            ResidencyLimits(
                max_resident_serving, max_resident_serving_bytes, ("max_resident_serving", "max_resident_serving_bytes")
            ),
            spill_dir,
            name="inference-serving",
        )
        self._adapter_ids = itertools.count(1)  # one backbone adapter key per serving state
        # Stacked parameters of same-architecture module groups (batched decode), reused across batches.
        self._stacked = StackedParameterCache()
        self._stats = {
            "batches": 0,
            "requests": 0,  # callers' requests; a split one counts once, when its first chunk is served
            "samples": 0,
            "failed_requests": 0,
            "busy_seconds": 0.0,
            "split_requests": 0,
            "chunks": 0,  # chunks of split requests served
        }
        self._batch_sizes: list[int] = []
        # Who shared each recent forward: how fairness is seen (and tested) without timing anything.
        self._recent_batches: deque[dict[str, Any]] = deque(maxlen=RECENT_BATCHES)
        # For /metrics (joynexus.ops.metrics): served requests' latency, physical batch sizes.
        self._latency = BucketHistogram(LATENCY_BOUNDS)
        self._batch_hist = BucketHistogram(BATCH_BOUNDS)
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        if in_ray_actor_process():  # its own process: no full GC pass over the startup heap mid-batch (issue 17)
            freeze_startup_heap()
        if start_worker:
            self._worker = threading.Thread(target=self._serve_forever, name="inference-worker", daemon=True)
            self._worker.start()

    # -- serving states ---------------------------------------------------------------------
    def load_weights(self, payload: bytes) -> dict[str, Any]:
        """Install a tenant payload (safetensors + manifest) as a new serving version."""
        tensors, manifest = decode_tenant_payload(payload)
        if manifest.base_model_id != self.backbone.model_id:
            raise InferenceError(
                f"payload of tenant {manifest.tenant_id!r} was trained on base model {manifest.base_model_id!r}, "
                f"this service holds {self.backbone.model_id!r}"
            )
        config = ActionModuleConfig.model_validate(manifest.module_config)
        if config.feature_dim != self.backbone.hidden_size:
            raise InferenceError(
                f"payload of tenant {manifest.tenant_id!r} expects feature_dim {config.feature_dim}, "
                f"the backbone gives {self.backbone.hidden_size}"
            )
        module_tensors, adapter_tensors = split_tenant_state(tensors)
        module = build_action_module(config)
        module.load_state_dict(module_tensors, strict=True)
        module.eval().requires_grad_(False).to(self.device)  # payloads are CPU tensors; serve on our device
        state = ServingState(
            manifest.tenant_id, manifest.policy_version, manifest.schema_signature, module, manifest.digest
        )
        self._install_adapter(state, manifest.extra.get("adapter"), adapter_tensors)
        tenant_id, version = manifest.tenant_id, manifest.policy_version
        # Into the residency first, then listed: a listed version always resolves. Resident now; the
        # least recently used serving states beyond the bound page out.
        replaced = self._serving.add((tenant_id, version), state)
        with self._lock:
            versions = self._states.setdefault(tenant_id, OrderedDict())
            versions[version] = None
            versions.move_to_end(version)
            evicted = self._evict(versions)
        dropped = [s for s in (self._serving.remove((tenant_id, v)) for v in evicted) if s is not None]
        if replaced is not None:
            dropped.append(replaced)
        self._drop_adapters(dropped)  # outside _lock: the worker takes the adapter lock, then _lock
        return {
            "tenant_id": manifest.tenant_id,
            "version": manifest.policy_version,
            "loaded": self.versions(manifest.tenant_id),
        }

    def _install_adapter(self, state: ServingState, config: Any, adapter_tensors: dict[str, torch.Tensor]) -> None:
        """Put a payload's LoRA adapter on the backbone for `state` (strictly checked: the config's
        keys and shapes, finite values), or refuse the payload."""
        where = f"payload of tenant {state.tenant_id!r} v{state.version}"
        if config is None:
            if adapter_tensors:
                raise InferenceError(f"{where} holds LoRA adapter tensors but its manifest names no adapter")
            return
        if not adapter_tensors:
            raise InferenceError(f"{where}: its manifest names an adapter, but it holds no adapter tensors")
        try:
            state.adapter = LoraAdapterConfig.model_validate(config)
            state.adapter_state = {k: v.detach().clone() for k, v in adapter_tensors.items()}
            state.adapter_key = ("serving", state.tenant_id, state.version, next(self._adapter_ids))
            self.backbone.adapters.add(state.adapter_key, state.adapter, state=state.adapter_state)
        except (ValueError, KeyError, RuntimeError) as error:
            raise InferenceError(f"{where}: its LoRA adapter does not fit this backbone: {error}") from error

    def _drop_adapters(self, states: list[ServingState]) -> None:
        """Take dropped serving states' adapters off the backbone."""
        for state in states:
            if state.adapter_key is not None:
                self.backbone.adapters.remove(state.adapter_key)

    def _is_current(self, state: ServingState) -> bool:
        """Whether `state` is what its version serves now (not evicted, replaced, or paged out)."""
        return self._serving.peek((state.tenant_id, state.version)) is state

    def _evict(self, versions: OrderedDict[int, None]) -> list[int]:
        """Drop the least recently used versions beyond the bound (never the latest); returns them."""
        latest = max(versions)
        dropped = []
        while len(versions) > self.max_versions:
            victim = next(v for v in versions if v != latest)  # least recently used first
            del versions[victim]
            dropped.append(victim)
        return dropped

    def versions(self, tenant_id: str) -> list[int]:
        with self._lock:
            return sorted(self._states.get(tenant_id, {}))

    def latest_version(self, tenant_id: str) -> int | None:
        versions = self.versions(tenant_id)
        return versions[-1] if versions else None

    def tenants(self) -> list[str]:
        with self._lock:
            return sorted(self._states)

    def flush_usage(self) -> bool:
        """Write the metered usage now (a usage read right after the work sees all of it)."""
        return self.meter.try_flush() if self.meter is not None else True

    def remove_tenant(self, tenant_id: str) -> int:
        """Forget every serving state of the tenant (tenant deletion), resident or paged out (its
        spill files too); returns how many versions."""
        with self._lock:
            versions = list(self._states.pop(tenant_id, {}))
        states = [s for s in (self._serving.remove((tenant_id, v)) for v in versions) if s is not None]
        self._drop_adapters(states)  # a paged-out state's adapter left the backbone with its page-out
        return len(versions)

    def _resolve(self, tenant_id: str, version: int | None) -> ServingState:
        """The serving state a request will use, paged in if it was out; inside `submit` it stays
        pinned (never paged out) until the request settles."""
        with self._lock:
            versions = self._states.get(tenant_id)
            if not versions:
                raise UnknownPolicyVersion(tenant_id, version, [])
            key = max(versions) if version is None else version
            if key not in versions:
                raise UnknownPolicyVersion(tenant_id, version, sorted(versions))
            versions.move_to_end(key)
        try:
            state = self._serving.use((tenant_id, key))  # outside _lock (lock order, see __init__)
        except UnknownEntry:  # evicted or removed since the check
            raise UnknownPolicyVersion(tenant_id, version, self.versions(tenant_id)) from None
        state.last_used = time.monotonic()
        return state

    def residency_stats(self) -> dict[str, Any]:
        """Serving states in memory and paged out: counts, bytes, hits, page-ins and page-outs."""
        return self._serving.stats()

    # -- requests ---------------------------------------------------------------------------
    @pins_until_settled("_serving")  # the resolved serving state stays in memory while the request waits
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
    ) -> Future:
        """Enqueue a request and return its future (the hook rollout loops call per env step).
        The version is resolved now, so the request is served by exactly that version.
        `sample=True` draws from the tenant's Gaussian policy and returns log-probabilities
        (RL rollouts); otherwise the deterministic action (evaluation, serving). `operation` names
        the purpose in the tenant's usage ("predict", "rollout", ...)."""
        if not isinstance(operation, str) or not 0 < len(operation) <= 32:
            raise ValueError(f"operation: expected a name of 1..32 characters, got {operation!r}")
        state = self._resolve(tenant_id, policy_version)
        if sample and state.module.log_std is None:
            raise ValueError(f"sample: tenant {tenant_id!r}'s module is not a stochastic policy (not an RL tenant)")
        observations = [o if isinstance(o, Observation) else Observation(**o) for o in observations]
        self._check_observations(state, observations)
        if seeds is not None and len(seeds) != len(observations):
            raise ValueError(f"seeds has {len(seeds)} entries for {len(observations)} observations")

        def entry(start: int, stop: int, chunk: int = 0) -> InferenceRequest:
            return InferenceRequest(
                tenant_id=tenant_id,
                schema_signature=state.schema_signature,
                prefix_key=self.backbone.prefix_key,
                observations=observations[start:stop],
                policy_version=state.version,
                session_id=session_id,
                context=_Pinned(state, None if seeds is None else seeds[start:stop], sample, operation, chunk=chunk),
            )

        size = self.chunk_samples()
        if size is None or len(observations) <= size:
            return self.queue.enqueue(entry(0, len(observations)))
        # Too large for one turn: chunks queue behind other tenants' requests (see TenantFairQueue).
        chunks = [entry(start, start + size, k) for k, start in enumerate(range(0, len(observations), size))]
        split = _Split(chunks, self._finish_split)
        for chunk in chunks:
            chunk.context.split = split
        self.queue.enqueue_many(chunks)
        return split.future

    def chunk_samples(self) -> int | None:
        """The most observations of one request that go into one forward (None: no splitting)."""
        if self.max_chunk_samples is None:
            return None
        return max(1, min(self.max_chunk_samples, self.max_batch_size))

    def _finish_split(self, split: _Split, result: dict[str, Any]) -> None:
        self._latency.observe(time.monotonic() - split.enqueued_at)  # the caller's latency, not a chunk's
        _settle(split.future, result=result)

    def predict(
        self,
        tenant_id: str,
        observations: list[Observation] | list[dict[str, Any]],
        *,
        policy_version: int | None = None,
        session_id: str | None = None,
        seeds: list[int] | None = None,
        sample: bool = False,
        timeout_s: float | None = 60.0,
        operation: str = "predict",
    ) -> dict[str, Any]:
        """Actions (and values where the module has a value head) for a tenant's observations;
        `sample=True` also returns the log-probabilities of the sampled actions (see `submit`).
        The result's `device_seconds` is this request's share of its shared batch's time."""
        future = self.submit(
            tenant_id,
            observations,
            policy_version=policy_version,
            session_id=session_id,
            seeds=seeds,
            sample=sample,
            operation=operation,
        )
        return future.result(timeout=timeout_s)

    def _check_observations(self, state: ServingState, observations: list[Observation]) -> None:
        cfg = state.module.config
        for i, obs in enumerate(observations):
            slots = self.backbone.max_images
            if not 0 <= len(obs.images) <= slots:
                raise ValueError(f"observations[{i}].images: {len(obs.images)} cameras, the backbone takes 0..{slots}")
            for c, image in enumerate(obs.images):
                shape = tuple(np.shape(image))
                if len(shape) != 3 or shape[0] != 3:
                    raise ValueError(f"observations[{i}].images[{c}]: expected (3, H, W), got {shape}")
            state_shape = tuple(np.shape(obs.state))
            if state_shape != (cfg.state_dim,):
                raise ValueError(
                    f"observations[{i}].state: expected shape ({cfg.state_dim},) for tenant "
                    f"{state.tenant_id!r}, got {state_shape}"
                )

    # -- the batching worker ----------------------------------------------------------------
    def _serve_forever(self) -> None:
        while not self._stop.is_set():
            batch = self.queue.collect_prefix(self.max_batch_size, self.max_wait_s, poll_s=0.2)
            if batch:
                self.execute(batch)

    def execute(self, batch: list[InferenceRequest]) -> None:
        """One shared backbone forward for the batch, then each request's own tenant decode. The
        batch's time is split over its requests by samples: each result carries its share as
        `device_seconds`, and the meter records it as the tenant's inference usage. Results are
        released together, once the batch time (and so each share) is known."""
        started = time.perf_counter()
        images: list[list[torch.Tensor]] = []
        instructions: list[str] = []
        slices: list[slice] = []
        for request in batch:
            start = len(images)
            for obs in request.observations:
                images.append([_as_tensor(img) for img in obs.images])
                instructions.append(obs.instruction)
            slices.append(slice(start, len(images)))
        try:
            features = self._shared_forward(batch, images, instructions)
        except Exception as error:  # a bad shared forward fails the batch, never the service
            for request in batch:
                _settle(request.future, exception=InferenceError(f"shared backbone forward failed: {error}"))
            return
        served: list[tuple[InferenceRequest, dict[str, Any]]] = []
        live = [(request, rows) for request, rows in zip(batch, slices, strict=True) if not request.future.done()]
        for request, outcome in self._decode_batch(live, features, images):
            if isinstance(outcome, BaseException):
                split = request.context.split
                if split is None or not split.future.done():  # a split request fails once
                    self._stats["failed_requests"] += 1
                _settle(request.future, exception=outcome)
            else:
                served.append((request, outcome))
        # Every member shares the forward, so shares are over the whole batch; failed requests are not charged.
        busy = time.perf_counter() - started
        shares = split_group_seconds(busy, [r.size for r in batch])
        share_of = {id(request): share for request, share in zip(batch, shares, strict=True)}
        for request, result in served:
            if request.future.done():  # a chunk of a request that failed meanwhile: not charged
                continue
            result["device_seconds"] = share_of[id(request)]
            self._meter_request(request, result["device_seconds"])
            _settle(request.future, result=result)  # a chunk's settles its part of the caller's request
            if request.context.split is None:
                self._latency.observe(time.monotonic() - request.enqueued_at)
        self._stats["batches"] += 1
        self._stats["busy_seconds"] += busy
        self._batch_hist.observe(len(images))
        chunks = [r.context for r in batch if r.context.split is not None]
        firsts = sum(1 for pinned in chunks if pinned.chunk == 0)
        self._stats["requests"] += len(batch) - len(chunks) + firsts
        self._stats["split_requests"] += firsts
        self._stats["chunks"] += len(chunks)
        self._stats["samples"] += len(images)
        self._batch_sizes.append(len(images))
        self._recent_batches.append(
            {
                "batch": self._stats["batches"],
                "samples": len(images),
                "parts": [
                    {
                        "tenant_id": r.tenant_id,
                        "request_id": r.request_id if r.context.split is None else r.context.split.request_id,
                        "chunk": None if r.context.split is None else r.context.chunk,
                        "samples": r.size,
                    }
                    for r in batch[:RECENT_BATCH_PARTS]
                ],
                "parts_left_out": max(0, len(batch) - RECENT_BATCH_PARTS),
            }
        )

    def _shared_forward(self, batch: list[InferenceRequest], images: list, instructions: list[str]) -> Any:
        """ONE backbone forward for the batch; with adapter tenants in it, each sample through its
        pinned version's adapter (a mixed-adapter batch). An adapter evicted since its request was
        pinned is installed for this forward only."""
        states = [request.context.state for request in batch]
        if all(state.adapter is None for state in states):
            return self.backbone.encode(images, instructions)
        keys: list[Any] = []
        transient: list[ServingState] = []
        adapters = self.backbone.adapters
        try:
            with adapters.lock:  # nothing installs or drops an adapter between the check and the forward
                for request, state in zip(batch, states, strict=True):
                    if state.adapter is not None and state.adapter_key not in adapters:
                        adapters.add(state.adapter_key, state.adapter, state=state.adapter_state)
                        transient.append(state)
                    keys.extend([state.adapter_key] * request.size)
                return self.backbone.encode(images, instructions, keys)
        finally:  # outside the adapter lock (_is_current takes _lock: never the other way round)
            self._drop_adapters([state for state in transient if not self._is_current(state)])

    def _meter_request(self, request: InferenceRequest, seconds: float) -> None:
        if self.meter is None:
            return
        try:
            operation = request.context.operation
            self.meter.record(request.tenant_id, INFERENCE, operation, device_seconds=seconds, samples=request.size)
        except Exception as error:  # metering never fails a served request
            log.warning("inference usage of tenant %r not recorded: %s", request.tenant_id, error)

    def _decode_batch(
        self, live: list[tuple[InferenceRequest, slice]], features: BackboneFeatures, images: list
    ) -> list[tuple[InferenceRequest, dict[str, Any] | Exception]]:
        """Every live request's decode, in batch order. Requests whose modules share an architecture
        (and mode: sampled or not) are decoded as ONE batched computation over their modules'
        stacked parameters (`models.module_batching`); kinds without a batched kernel decode one
        request at a time. A group whose batched decode raises is decoded request by request, so
        a failing module fails only its own requests."""
        outcomes: dict[int, dict[str, Any] | Exception] = {}
        groups: dict[Any, list[tuple[InferenceRequest, slice]]] = {}
        for request, rows in live:
            pinned: _Pinned = request.context
            key = architecture_key(pinned.state.module)
            if key is None:
                outcomes[id(request)] = self._decode_alone(request, features, images, rows)
            else:
                groups.setdefault((key, pinned.sample), []).append((request, rows))
        for members in groups.values():
            try:
                outcomes.update(self._decode_group(members, features, images))
            except Exception as error:  # find the failing module: decode its group one request at a time
                log.debug("batched decode of %d requests fell back to per-request: %s", len(members), error)
                for request, rows in members:
                    outcomes[id(request)] = self._decode_alone(request, features, images, rows)
        return [(request, outcomes[id(request)]) for request, _ in live]

    def _decode_alone(
        self, request: InferenceRequest, features: BackboneFeatures, images: list, rows: slice
    ) -> dict[str, Any] | Exception:
        try:
            return self._decode(request, features.select(rows).trimmed(), images, rows)
        except Exception as error:
            return error

    def _decode_group(
        self, members: list[tuple[InferenceRequest, slice]], features: BackboneFeatures, images: list
    ) -> dict[int, dict[str, Any]]:
        """One batched decode of same-architecture requests (state/action dims and chunks may
        differ: padded). Rows of one module (several requests of a tenant version) run as one
        member; noise is drawn per request (per observation when seeded) exactly as `_decode`
        draws it, so results equal the per-request path."""
        by_module: dict[int, list[tuple[InferenceRequest, slice]]] = {}
        for request, rows in members:
            by_module.setdefault(id(request.context.state.module), []).append((request, rows))
        # A canonical member order (tenant, version), so a recurring set of tenants hits the cache.
        order = sorted(by_module.values(), key=lambda reqs: (reqs[0][0].tenant_id, reqs[0][0].context.state.version))
        modules = [reqs[0][0].context.state.module for reqs in order]
        device = features.tokens.device
        states = [
            torch.stack([_as_tensor(obs.state) for request, _ in reqs for obs in request.observations])
            for reqs in order
        ]
        rows = [[i for _, r in reqs for i in range(r.start, r.stop)] for reqs in order]
        sample = members[0][0].context.sample
        cfg = modules[0].config
        with torch.inference_mode():
            inputs = gather_inputs(features, rows, states)
            if not bool(inputs.mask.any(dim=-1).all()):
                raise ValueError("features.mask: every sample needs at least one real token")
            params = self._stacked.get(modules)
            noise = None
            if sample or type(modules[0]).uses_noise:
                # Drawn in batch order (unseeded draws come from the global generator, as per request).
                drawn = {id(request): self._noise(request, device) for request, _ in members}
                chunk_shape = (max(m.config.action_chunk for m in modules), max(m.config.action_dim for m in modules))
                noise = pad_rows(
                    [torch.cat([drawn[id(r)] for r, _ in reqs]) for reqs in order], inputs.rows, chunk_shape
                )
            log_probs = None
            if sample:
                mean = group_policy_mean(modules, params, inputs)
                std = group_policy_std(modules, params)
                actions = mean + std * noise
                log_probs = group_log_prob(modules, mean, std, actions)
            else:
                actions = group_predict(modules, params, inputs, noise)
            per_member = unpad_actions(modules, inputs, actions)
            values = group_value(modules, params, inputs) if cfg.value_head else None
        results: dict[int, dict[str, Any]] = {}
        for g, reqs in enumerate(order):
            offset = 0
            for request, _ in reqs:
                own = slice(offset, offset + request.size)
                offset += request.size
                results[id(request)] = {
                    "tenant_id": request.tenant_id,
                    "policy_version": request.context.state.version,
                    "actions": per_member[g][own].cpu().numpy(),
                    "values": None if values is None else values[g, own].cpu().numpy(),
                    "log_probs": None if log_probs is None else log_probs[g, own].cpu().numpy(),
                    "batch_samples": len(images),
                }
        return results

    @staticmethod
    def _noise(request: InferenceRequest, device: torch.device) -> torch.Tensor:
        """The request's noise rows, drawn as `_decode` draws them: a sampled request's standard
        normal per action (CPU generators, then moved), a flow expert's x0 through `draw_noise`."""
        pinned: _Pinned = request.context
        module = pinned.state.module
        cfg = module.config
        if pinned.sample:
            shape = (cfg.action_chunk, cfg.action_dim)
            if pinned.seeds is None:
                return torch.randn((request.size, *shape)).to(device)
            draws = [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in pinned.seeds]
            return torch.stack(draws).to(device)
        if pinned.seeds is None:
            return module.draw_noise(request.size, device=device)
        return torch.cat([module.draw_noise(1, torch.Generator().manual_seed(s), device=device) for s in pinned.seeds])

    def _decode(self, request: InferenceRequest, features: Any, images: list, rows: slice) -> dict[str, Any]:
        pinned: _Pinned = request.context
        module = pinned.state.module
        state = torch.stack([_as_tensor(obs.state) for obs in request.observations]).to(features.tokens.device)
        log_probs = None
        with torch.inference_mode():
            if pinned.sample:
                dist = module.action_distribution(features, state)
                noise = self._noise(request, dist.mean.device)
                actions = dist.mean + dist.stddev * noise
                log_probs = dist.log_prob(actions).sum(dim=(-1, -2))
            elif pinned.seeds is None:
                actions = module.predict(features, state)
            else:  # per-observation generators: the same draws whether served alone or grouped
                actions = torch.cat(
                    [
                        module.predict(
                            features.select([i]), state[i : i + 1], generator=torch.Generator().manual_seed(s)
                        )
                        for i, s in enumerate(pinned.seeds)
                    ]
                )
            values = module.value(features, state) if module.config.value_head else None
        return {
            "tenant_id": request.tenant_id,
            "policy_version": pinned.state.version,
            "actions": actions.cpu().numpy(),
            "values": None if values is None else values.cpu().numpy(),
            "log_probs": None if log_probs is None else log_probs.cpu().numpy(),
            "batch_samples": len(images),
        }

    # -- status -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        sizes = self._batch_sizes
        return {
            **self._stats,
            "queue_depth": self.queue.depth(),
            "mean_batch_samples": float(np.mean(sizes)) if sizes else 0.0,
            "max_batch_samples": max(sizes) if sizes else 0,
            "tenants": {t: self.versions(t) for t in self.tenants()},
            "max_chunk_samples": self.chunk_samples(),
            "recent_batches": list(self._recent_batches),
            "backbone_instances_created": ResidentBackbone.instances_created,
            "latency_seconds": self._latency.snapshot(),
            "batch_samples": self._batch_hist.snapshot(),
            "rss_bytes": _rss_bytes(),
            "device_memory_bytes": _device_memory_bytes(self.device),
            "residency": self._serving.stats(),
            **self.backbone.placement_info(),
        }

    def heartbeat(self) -> dict[str, Any]:
        """A liveness probe: who this is and how loaded, cheaply. Takes only locks held for a moment
        (never one a running batch holds), so it answers while a long batch runs."""
        with self._lock:
            tenants = sorted(self._states)
        return {
            "role": "inference",
            "incarnation": self.incarnation,
            "started_at": self.started_at,
            "pid": os.getpid(),
            "tenants": tenants,
            "queue_depth": self.queue.depth(),
            **self.backbone.placement_info(),
        }

    def close(self) -> None:
        self._stop.set()
        self.queue.close()
        if self._worker is not None:
            self._worker.join(timeout=5)
        if self.meter is not None:  # write what the last batches recorded; a shared meter stays open
            if self._owns_meter:
                self.meter.close()
            else:
                self.meter.try_flush()
        self._serving.close()  # the spill folder goes with the service


class _ServingPager:
    """How a serving state leaves memory and comes back (`TenantResidency`'s pager): its module's
    tensors and its adapter's, with what names the version. A serving state never changes, so it is
    written once and later page-outs only drop it; a page-in builds a NEW state object (and adapter
    key), so a request still holding the old one keeps serving from it, and the shared forward
    treats its adapter as not current (installed for that batch only)."""

    immutable = True

    def __init__(self, service: InferenceModelService) -> None:
        self._service = service
        # Modules of paged-out states, per architecture, for the next page-in of the same config to
        # overwrite in place (a fifth of the cost of building one, most of a page-in otherwise). One
        # is taken only once the state that held it is gone: until then a request may still serve
        # from it. A few per config: at most _SPARE_MODULES modules' memory beyond the bound.
        self._spares: dict[ActionModuleConfig, deque[tuple[weakref.ref[ServingState], ActionModule]]] = {}
        # Each recycled module's tensors by state-dict name, found once per module (not per page-in).
        self._tensors_of: weakref.WeakKeyDictionary[ActionModule, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()

    def _reuse(self, config: ActionModuleConfig, tensors: dict[str, torch.Tensor]) -> ActionModule | None:
        """A spare module of this config with `tensors` copied in (exactly its keys and shapes), or None."""
        spares = self._spares.get(config)
        for entry in list(spares or ()):
            holder, module = entry
            if holder() is not None:  # a request still holds the old state: it may be serving from it
                continue
            spares.remove(entry)  # type: ignore[union-attr]
            own = self._tensors_of.get(module)
            if own is None:
                own = self._tensors_of[module] = dict(module.state_dict(keep_vars=True))
            if own.keys() != tensors.keys() or any(own[k].shape != t.shape for k, t in tensors.items()):
                return None  # not this module's state after all: build one
            with torch.no_grad():
                for name, tensor in tensors.items():
                    own[name].copy_(tensor)
            return module
        return None

    def nbytes(self, state: ServingState) -> int:
        adapter = list((state.adapter_state or {}).values())
        return tensor_bytes([*state.module.parameters(), *state.module.buffers(), *adapter])

    def can_page_out(self, key: tuple[str, int], state: ServingState) -> bool:
        return True  # requests pin what they need; nothing else holds a state in memory

    def at_rest(self, key: tuple[str, int], state: ServingState) -> None:
        pass

    def spill(self, key: tuple[str, int], state: ServingState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"module/{k}": v for k, v in state.module.state_dict().items()}
        tensors.update({f"adapter/{k}": v for k, v in (state.adapter_state or {}).items()})
        meta = {
            "tenant_id": state.tenant_id,
            "version": state.version,
            "schema_signature": state.schema_signature,
            "manifest_digest": state.manifest_digest,
            "module_config": state.module.config.model_dump(mode="json"),
            "adapter": None if state.adapter is None else state.adapter.model_dump(mode="json"),
        }
        return tensors, meta

    def evicted(self, key: tuple[str, int], state: ServingState) -> None:
        self._service._drop_adapters([state])
        spares = self._spares.setdefault(state.module.config, deque(maxlen=_SPARE_MODULES))
        spares.append((weakref.ref(state), state.module))

    def restore(self, key: tuple[str, int], tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> ServingState:
        module_tensors = {k.removeprefix("module/"): v for k, v in tensors.items() if k.startswith("module/")}
        adapter_tensors = {k.removeprefix("adapter/"): v for k, v in tensors.items() if k.startswith("adapter/")}
        config = ActionModuleConfig.model_validate(meta["module_config"])
        module = self._reuse(config, module_tensors)  # in place: it stays eval, without grad, on our device
        if module is None:
            module = rebuild_module(lambda: build_action_module(config), module_tensors, self._service.device)
            module.eval().requires_grad_(False)
        state = ServingState(
            meta["tenant_id"], int(meta["version"]), meta["schema_signature"], module, meta["manifest_digest"]
        )
        if meta["adapter"] is not None:
            service = self._service
            state.adapter = LoraAdapterConfig.model_validate(meta["adapter"])
            state.adapter_state = adapter_tensors
            state.adapter_key = ("serving", state.tenant_id, state.version, next(service._adapter_ids))
            service.backbone.adapters.add(state.adapter_key, state.adapter, state=adapter_tensors)
        return state


def _rss_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # a status answer never fails for it
        return None


def _device_memory_bytes(device: torch.device) -> int | None:
    """Accelerator memory torch holds allocated on the service's device (None on the CPU)."""
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None


def _settle(future: Future, *, result: Any = None, exception: BaseException | None = None) -> None:
    """Resolve a request's future unless its caller cancelled it meanwhile."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled between the check and the set
        pass


def inference_service_actor(
    backbone_source: BackboneSource,
    *,
    max_batch_size: int = 32,
    max_wait_ms: float = 5.0,
    num_threads: int = 1,
    num_cpus: float = 1,
    namespace: str | None = None,
    detached: bool = False,
    database_url: str | None = None,
    max_chunk_samples: int | None = DEFAULT_MAX_CHUNK_SAMPLES,
    placement: DevicePlacement | None = None,
    max_resident_serving: int = DEFAULT_MAX_RESIDENT_SERVING,
    spill_dir: str | None = None,
):  # type: ignore[no-untyped-def]
    """Get or create the named Inference Model Service actor. It is a threaded actor: many callers
    block in `predict` at once while its worker thread batches their requests together.
    `database_url`: the control-plane store the actor meters inference usage into (None: no metering).
    `max_resident_serving`, `spill_dir`: the resident bound of serving states and where the rest page out."""
    from joynexus.actors import named_actor

    return named_actor(
        InferenceModelService,
        INFERENCE_SERVICE_ACTOR_NAME,
        backbone_source,
        namespace=namespace,
        detached=detached,
        num_cpus=num_cpus,
        max_concurrency=64,
        max_batch_size=max_batch_size,
        max_wait_ms=max_wait_ms,
        num_threads=num_threads,
        database_url=database_url,
        max_chunk_samples=max_chunk_samples,
        placement=placement,
        max_resident_serving=max_resident_serving,
        spill_dir=spill_dir,
    )
