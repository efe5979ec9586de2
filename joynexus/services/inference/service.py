"""Inference Model Service (paper sections 4.1.2, 4.3, A.3).

Keeps ONE resident frozen backbone and tenant serving states keyed by (tenant, policy version).
Requests from every tenant go through one Inference Queue; a worker thread forms a batch (target
size B, max wait T) by taking the tenants' pending requests round-robin (`TenantFairQueue`, the
Inference Scheduler), runs ONE shared backbone forward over it -- the backbone canonicalizes mixed
camera sets, image sizes and instruction lengths into one physical batch -- splits the features back
by the recorded row slices, and decodes each request with its own tenant's module at the version
that request was pinned to (`decode.BatchDecoder`). A tenant module that fails fails only its own
requests.

Serving states (`serving.ServingStates`): `load_weights` takes the payload
`TrainingModelService.export_params` produces; versions are held in a bounded per-tenant LRU, at most
`max_resident_serving` states stay in memory and the rest page out (`pager.ServingPager`), and LoRA
tenants' adapters sit on the shared backbone. A request pins its serving state when it is submitted,
so neither eviction nor paging breaks a request already in the queue. A batch mixing tenants with
different adapters (and tenants without) is still ONE backbone forward: each sample runs through its
own version's adapter (peft mixed-adapter batch).

Fairness (issue 11): a request of more than `max_chunk_samples` observations (or more than B,
whichever is smaller) is split at submission into chunks of that size (`requests.SplitRequest`), and
`TenantFairQueue` forms each batch round-robin across tenants, least recently served first. So one
tenant's 1,024-sample predict costs another tenant's 1-sample predict at most a chunk-sized batch of
waiting, not a 1,024-sample forward. The chunks' results are put back together in order for the
caller: the same actions as unsplit (per-observation seeds draw the same noise wherever a row is served).

Abandoned work (issue 26): a request whose caller stops waiting (`predict`'s timeout, or `cancel`
with the `request_key` it was submitted with) is cancelled and its entries leave the queue at once;
each tenant may have at most `max_queued_samples_per_tenant` samples waiting (`TenantQueueFull`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from joynexus.core.heap import freeze_startup_heap, in_ray_actor_process
from joynexus.core.histogram import BATCH_BOUNDS, LATENCY_BOUNDS, BucketHistogram
from joynexus.core.metering import INFERENCE, UsageMeter, build_meter, split_group_seconds
from joynexus.core.service_metrics import service_metrics, timed
from joynexus.core.serving_sets import ServingSetStore
from joynexus.models.action_modules import PrefixRows, by_prefix_layout, uses_layer_prefix
from joynexus.models.backbone import Backbone, BackboneFeatures, BackboneSource
from joynexus.models.module_batching import StackedParameterCache
from joynexus.models.placement import DevicePlacement
from joynexus.scheduling.inference_queue import InferenceRequest, Observation, TenantFairQueue, settle_future
from joynexus.services.inference.cancellation import KeyedRequests
from joynexus.services.inference.decode import BatchDecoder, as_tensor
from joynexus.services.inference.endpoint import PredictBySubmit
from joynexus.services.inference.errors import InferenceError, UnknownPolicyVersion
from joynexus.services.inference.requests import Pinned, SplitRequest
from joynexus.services.inference.serving import ServingState, ServingStates
from joynexus.services.residency import DEFAULT_MAX_RESIDENT_SERVING, ResidencyLimits, pins_until_settled

__all__ = [
    "DEFAULT_MAX_CHUNK_SAMPLES",
    "INFERENCE_SERVICE_ACTOR_NAME",
    "InferenceError",
    "InferenceModelService",
    "ServingState",
    "TenantFairQueue",
    "UnknownPolicyVersion",
]

INFERENCE_SERVICE_ACTOR_NAME = "joynexus.inference_service"
# The noise seed of an unseeded, unsampled request (see `submit`).
DEFAULT_NOISE_SEED = 0
# Observations one request puts into one backbone turn at most; a larger request is split (the
# effective size is also capped at max_batch_size). A quarter of the default B: a batch holding
# another tenant's small request still takes three of the large request's chunks, where chunks of
# B would leave the small request a forward of its own (measured: the bulk tenant's throughput is
# the same, benchmarks/predict_fairness.py).
DEFAULT_MAX_CHUNK_SAMPLES = 8
# Samples one tenant may have waiting in the Inference Queue (Settings.max_queued_samples_per_tenant):
# four of the largest requests, so a client pipelining big predicts is never refused, while a flood
# of abandoned ones cannot grow the queue (memory, CPU) without bound.
DEFAULT_MAX_QUEUED_SAMPLES_PER_TENANT = 4 * 4096
QUEUE_LIMIT_SETTING = "setting max_queued_samples_per_tenant, env JOYNEXUS_MAX_QUEUED_SAMPLES_PER_TENANT"
RECENT_BATCHES = 32  # batch compositions stats() shows, newest last
RECENT_BATCH_PARTS = 64  # entries listed per recorded batch (a B of thousands would bloat stats())

log = logging.getLogger(__name__)

# A batch's inputs: each observation's camera images, its instruction, and each request's rows.
_BatchInputs = tuple[list[list[torch.Tensor]], list[str], list[slice]]


class InferenceModelService(PredictBySubmit):
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
        max_queued_samples_per_tenant: int | None = DEFAULT_MAX_QUEUED_SAMPLES_PER_TENANT,
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
        split into chunks that queue fairly with other tenants' requests; None never splits.
        `max_queued_samples_per_tenant`: samples one tenant may have waiting (None: unbounded)."""
        # Who this is, for heartbeats: a restarted service answers with a new incarnation.
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        _check_options(max_versions_per_tenant, max_chunk_samples)
        if num_threads:
            torch.set_num_threads(num_threads)
        source = (
            BackboneSource.model_validate(backbone_source) if isinstance(backbone_source, dict) else backbone_source
        )
        self.placement = DevicePlacement.of(placement)
        self.backbone: Backbone = source.build(self.placement)
        self.device = self.backbone.device
        self.meter, self._owns_meter = build_meter(meter, database_url)
        # What it serves, recorded in the store on every change, so each restart path restores it.
        self._serving_sets = ServingSetStore(self.meter.store) if self.meter is not None else None
        self._record_lock = threading.Lock()
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0  # read per batch by the worker (tests and benchmarks set it)
        self.max_chunk_samples = max_chunk_samples
        self.queue = TenantFairQueue(max_queued_samples_per_tenant, setting=QUEUE_LIMIT_SETTING)
        self._keyed = KeyedRequests()  # requests submitted with a request_key, for `cancel`
        limits = ResidencyLimits(
            max_resident_serving, max_resident_serving_bytes, ("max_resident_serving", "max_resident_serving_bytes")
        )
        self.serving_states = ServingStates(
            self.backbone, max_versions_per_tenant=max_versions_per_tenant, limits=limits, spill_dir=spill_dir
        )
        self._serving = self.serving_states.residency  # what `pins_until_settled` pins requests' states in
        # Stacked parameters of same-architecture module groups (batched decode), reused across batches.
        self._stacked = StackedParameterCache()
        self._decoder = BatchDecoder(self._stacked)
        self._init_status()
        service_metrics()  # this process's signals endpoint (JOYNEXUS_METRICS_PORT)
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        if in_ray_actor_process():  # its own process: no full GC pass over the startup heap mid-batch (issue 17)
            freeze_startup_heap()
        if start_worker:
            self._worker = threading.Thread(target=self._serve_forever, name="inference-worker", daemon=True)
            self._worker.start()

    def _init_status(self) -> None:
        """The counters and histograms `stats` reports."""
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

    @property
    def max_versions(self) -> int:
        """Versions each tenant keeps loaded (the latest always among them)."""
        return self.serving_states.max_versions

    # -- serving states ---------------------------------------------------------------------
    @timed("weight_sync_seconds")
    def load_weights(self, payload: bytes) -> dict[str, Any]:
        """Install a tenant payload (safetensors + manifest) as a new serving version."""
        loaded = self.serving_states.install(payload)
        self._record_serving_set(loaded["tenant_id"])
        return loaded

    def _record_serving_set(self, tenant_id: str) -> None:
        """Write the tenant's serving set as it is now (read under the lock: the last writer writes
        the latest set); a store outage is logged, it does not fail the load."""
        if self._serving_sets is None:
            return
        try:
            with self._record_lock:
                versions = self.versions(tenant_id)
                if versions:
                    self._serving_sets.record(tenant_id, versions)
                else:
                    self._serving_sets.forget(tenant_id)
        except Exception as error:
            log.warning("serving set of tenant %r not recorded: %s", tenant_id, error)

    def versions(self, tenant_id: str) -> list[int]:
        return self.serving_states.versions(tenant_id)

    def latest_version(self, tenant_id: str) -> int | None:
        versions = self.versions(tenant_id)
        return versions[-1] if versions else None

    def tenants(self) -> list[str]:
        return self.serving_states.tenants()

    def flush_usage(self) -> bool:
        """Write the metered usage now (a usage read right after the work sees all of it)."""
        return self.meter.try_flush() if self.meter is not None else True

    def remove_tenant(self, tenant_id: str) -> int:
        """Forget every serving state of the tenant (tenant deletion), resident or paged out (its
        spill files too); returns how many versions."""
        removed = self.serving_states.remove_tenant(tenant_id)
        self._record_serving_set(tenant_id)
        return removed

    def evict_tenant(self, tenant_id: str) -> int:
        """Drop the tenant's serving states from this replica only (its replica set holds it
        elsewhere or pages it in again, issue 45.3): unlike `remove_tenant`, its recorded serving
        set, the deployment's, stays."""
        return self.serving_states.remove_tenant(tenant_id)

    def _resolve(self, tenant_id: str, version: int | None) -> ServingState:
        """The serving state a request will use, paged in if it was out; inside `submit` it stays
        pinned (never paged out) until the request settles."""
        return self.serving_states.resolve(tenant_id, version)

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
        request_key: str | None = None,
    ) -> Future:
        """Enqueue a request and return its future (the hook rollout loops call per env step).
        The version is resolved now, so the request is served by exactly that version.
        `sample=True` draws from the tenant's Gaussian policy and returns log-probabilities
        (RL rollouts); otherwise the deterministic action (evaluation, serving). `operation` names
        the purpose in the tenant's usage ("predict", "rollout", ...). With `request_key`, the
        caller can `cancel` it (its queued entries leave at once)."""
        if request_key is not None:
            KeyedRequests.check(request_key)  # before anything is queued
        future = self._enqueue(tenant_id, observations, policy_version, session_id, seeds, sample, operation)
        if request_key is not None:
            self._keyed.register(tenant_id, request_key, future)
        return future

    def cancel(self, tenant_id: str, request_key: str) -> bool:
        """Cancel the tenant's request submitted with `request_key` (its caller gave up): its
        entries leave the queue now. True if it was still waiting; a key not (yet) known is
        remembered, so a request that arrives after its cancel is cancelled on arrival."""
        return self._keyed.cancel(tenant_id, request_key)

    def _enqueue(
        self,
        tenant_id: str,
        observations: list[Observation],
        policy_version: int | None,
        session_id: str | None,
        seeds: list[int] | None,
        sample: bool,
        operation: str,
    ) -> Future:
        if not isinstance(operation, str) or not 0 < len(operation) <= 32:
            raise ValueError(f"operation: expected a name of 1..32 characters, got {operation!r}")
        state = self._resolve(tenant_id, policy_version)
        if sample and state.module.log_std is None:
            raise ValueError(f"sample: tenant {tenant_id!r}'s module is not a stochastic policy (not an RL tenant)")
        observations = [o if isinstance(o, Observation) else Observation(**o) for o in observations]
        self._check_observations(state, observations)
        if state.normalizer is not None:  # the module sees the state normalized, as it was trained
            observations = [
                dataclasses.replace(o, state=state.normalizer.normalize_state(o.state)) for o in observations
            ]
        if seeds is not None and len(seeds) != len(observations):
            raise ValueError(f"seeds has {len(seeds)} entries for {len(observations)} observations")
        if seeds is None and not sample and type(state.module).uses_noise:
            # Deterministic by default: a module that draws its starting noise (the flow-matching
            # expert) draws it from one fixed seed per observation, so the same observation gives the
            # same actions; callers that want other draws pass `seeds`.
            seeds = [DEFAULT_NOISE_SEED] * len(observations)

        def entry(start: int, stop: int, chunk: int = 0) -> InferenceRequest:
            return InferenceRequest(
                tenant_id=tenant_id,
                schema_signature=state.schema_signature,
                prefix_key=self.backbone.prefix_key,
                observations=observations[start:stop],
                policy_version=state.version,
                session_id=session_id,
                context=Pinned(state, None if seeds is None else seeds[start:stop], sample, operation, chunk=chunk),
            )

        size = self.chunk_samples()
        if size is None or len(observations) <= size:
            return self.queue.enqueue(entry(0, len(observations)))
        # Too large for one turn: chunks queue behind other tenants' requests (see TenantFairQueue).
        chunks = [entry(start, start + size, k) for k, start in enumerate(range(0, len(observations), size))]
        split = SplitRequest(chunks, self._finish_split, discard=self.queue.discard)
        for chunk in chunks:
            chunk.context.split = split
        self.queue.enqueue_many(chunks)
        return split.future

    def chunk_samples(self) -> int | None:
        """The most observations of one request that go into one forward (None: no splitting)."""
        if self.max_chunk_samples is None:
            return None
        return max(1, min(self.max_chunk_samples, self.max_batch_size))

    def _finish_split(self, split: SplitRequest, result: dict[str, Any]) -> None:
        self._latency.observe(time.monotonic() - split.enqueued_at)  # the caller's latency, not a chunk's
        settle_future(split.future, result=result)

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
        # Layer-wise experts (SmolVLA) read the prefix's per-layer cache: their requests share their own
        # grouped prefix forward; every other request shares the token-feature forward.
        layered = [r for r in batch if uses_layer_prefix(r.context.state.module)]
        tokens = [r for r in batch if not uses_layer_prefix(r.context.state.module)] if layered else batch
        served: list[tuple[InferenceRequest, dict[str, Any]]] = []
        if tokens:
            images, instructions, slices = _batch_inputs(tokens)
            try:
                features = self._shared_forward(tokens, images, instructions)
            except Exception as error:  # a bad shared forward fails its requests, never the service
                for request in tokens:
                    settle_future(request.future, exception=InferenceError(f"shared backbone forward failed: {error}"))
            else:
                served = self._decode_live(tokens, slices, features, images)
        samples = sum(r.size for r in batch)
        if layered:
            served += self._decode_layered(layered, samples)
            for _, result in served:  # the token decode counted its own rows: report the whole batch
                result["batch_samples"] = samples
        busy = time.perf_counter() - started
        self._release(batch, served, busy)
        self._record_batch(batch, samples, busy)

    def _decode_live(
        self, batch: list[InferenceRequest], slices: list[slice], features: BackboneFeatures, images: list
    ) -> list[tuple[InferenceRequest, dict[str, Any]]]:
        """Decode the batch's requests still wanted; fail those whose decode raised. Returns the rest
        with their results, not yet released."""
        served: list[tuple[InferenceRequest, dict[str, Any]]] = []
        live = [(request, rows) for request, rows in zip(batch, slices, strict=True) if not request.future.done()]
        for request, outcome in self._decoder.decode_batch(live, features, images):
            if isinstance(outcome, BaseException):
                split = request.context.split
                if split is None or not split.future.done():  # a split request fails once
                    self._stats["failed_requests"] += 1
                settle_future(request.future, exception=outcome)
            else:
                served.append((request, outcome))
        return served

    def _decode_layered(
        self, batch: list[InferenceRequest], samples: int
    ) -> list[tuple[InferenceRequest, dict[str, Any]]]:
        """Layer-wise experts' requests: ONE prefix forward per prefix layout over all their rows
        (each row's prefix token made by its tenant's module), then each request decoded by its own
        pinned version over its rows of the cache. A failed prefix fails only its own requests."""
        live = [r for r in batch if not r.future.done()]
        served: list[tuple[InferenceRequest, dict[str, Any]]] = []
        for (kind, _), indices in by_prefix_layout([r.context.state.module for r in live]).items():
            requests = [live[i] for i in indices]
            try:
                with torch.inference_mode():
                    rows = [_prefix_rows(r, self.backbone.device) for r in requests]
                    prefixes = kind.layer_prefixes(self.backbone, rows)
            except Exception as error:
                for request in requests:
                    settle_future(request.future, exception=InferenceError(f"shared prefix forward failed: {error}"))
                continue
            for request, prefix in zip(requests, prefixes, strict=True):
                outcome = self._decoder.decode_prefix(request, prefix, samples)
                if isinstance(outcome, BaseException):
                    self._stats["failed_requests"] += 1
                    settle_future(request.future, exception=outcome)
                else:
                    served.append((request, outcome))
        return served

    def _release(
        self, batch: list[InferenceRequest], served: list[tuple[InferenceRequest, dict[str, Any]]], busy: float
    ) -> None:
        """Charge each served request its share of the batch's `busy` seconds and hand it its result."""
        # Every member shares the forward, so shares are over the whole batch; failed requests are not charged.
        shares = split_group_seconds(busy, [r.size for r in batch])
        share_of = {id(request): share for request, share in zip(batch, shares, strict=True)}
        for request, result in served:
            if request.future.done():  # a chunk of a request that failed meanwhile: not charged
                continue
            result["device_seconds"] = share_of[id(request)]
            self._meter_request(request, result["device_seconds"])
            settle_future(request.future, result=result)  # a chunk's settles its part of the caller's request
            if request.context.split is None:
                self._latency.observe(time.monotonic() - request.enqueued_at)

    def _record_batch(self, batch: list[InferenceRequest], samples: int, busy: float) -> None:
        """Count the batch in `stats`: counters, histograms and its composition."""
        self._stats["batches"] += 1
        self._stats["busy_seconds"] += busy
        self._batch_hist.observe(samples)
        chunks = [r.context for r in batch if r.context.split is not None]
        firsts = sum(1 for pinned in chunks if pinned.chunk == 0)
        self._stats["requests"] += len(batch) - len(chunks) + firsts
        self._stats["split_requests"] += firsts
        self._stats["chunks"] += len(chunks)
        self._stats["samples"] += samples
        self._batch_sizes.append(samples)
        self._recent_batches.append(
            {
                "batch": self._stats["batches"],
                "samples": samples,
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
        finally:  # outside the adapter lock (is_current takes the states' lock: never the other way round)
            self.serving_states.drop_adapters([s for s in transient if not self.serving_states.is_current(s)])

    def _meter_request(self, request: InferenceRequest, seconds: float) -> None:
        if self.meter is None:
            return
        try:
            operation = request.context.operation
            self.meter.record(request.tenant_id, INFERENCE, operation, device_seconds=seconds, samples=request.size)
        except Exception as error:  # metering never fails a served request
            log.warning("inference usage of tenant %r not recorded: %s", request.tenant_id, error)

    # -- status -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        sizes = self._batch_sizes
        return {
            **self._stats,
            "queue_depth": self.queue.depth(),
            "queued_samples": self.queue.queued_samples(),
            "mean_batch_samples": float(np.mean(sizes)) if sizes else 0.0,
            "max_batch_samples": max(sizes) if sizes else 0,
            "tenants": {t: self.versions(t) for t in self.tenants()},
            "max_chunk_samples": self.chunk_samples(),
            "max_batch_size": self.max_batch_size,  # B and T as the worker reads them now
            "max_wait_s": self.max_wait_s,
            "recent_batches": list(self._recent_batches),
            "backbone_instances_created": type(self.backbone).instances_created,
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
        return {
            "role": "inference",
            "incarnation": self.incarnation,
            "started_at": self.started_at,
            "pid": os.getpid(),
            "tenants": self.tenants(),
            "queue_depth": self.queue.depth(),
            "requests_served": self._stats["requests"],  # callers' routers send here directly (issue 45.3)
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
        self.serving_states.close()  # the spill folder goes with the service


def _check_options(max_versions_per_tenant: int, max_chunk_samples: int | None) -> None:
    """Refuse bad options before the backbone is built."""
    if max_versions_per_tenant < 1:
        raise ValueError(f"max_versions_per_tenant must be >= 1, got {max_versions_per_tenant}")
    if max_chunk_samples is not None and (isinstance(max_chunk_samples, bool) or max_chunk_samples < 1):
        raise ValueError(f"max_chunk_samples must be >= 1 or None (never split), got {max_chunk_samples!r}")


def _batch_inputs(batch: list[InferenceRequest]) -> _BatchInputs:
    """The batch's images and instructions, one entry per observation, and each request's rows."""
    images: list[list[torch.Tensor]] = []
    instructions: list[str] = []
    slices: list[slice] = []
    for request in batch:
        start = len(images)
        for obs in request.observations:
            images.append([as_tensor(img) for img in obs.images])
            instructions.append(obs.instruction)
        slices.append(slice(start, len(images)))
    return images, instructions, slices


def _prefix_rows(request: InferenceRequest, device: torch.device) -> PrefixRows:
    """A layer-wise expert's request as a member of the grouped prefix forward."""
    observations = request.observations
    return PrefixRows(
        module=request.context.state.module,
        images=[[as_tensor(img) for img in obs.images] for obs in observations],
        instructions=[obs.instruction for obs in observations],
        state=torch.stack([as_tensor(obs.state) for obs in observations]).to(device),
    )


def _rss_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # a status answer never fails for it
        return None


def _device_memory_bytes(device: torch.device) -> int | None:
    """Accelerator memory torch holds allocated on the service's device (None on the CPU)."""
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
