"""Inference Model Service (paper sections 4.1.2, 4.3, A.3).

Keeps ONE resident frozen backbone and tenant serving states keyed by (tenant, policy version).
Requests from every tenant go through one Inference Queue; a worker thread takes the largest
FIFO-compatible prefix (target size B, max wait T), runs ONE shared backbone forward over it —
the backbone canonicalizes mixed camera sets, image sizes and instruction lengths into one
physical batch — splits the features back by the recorded row slices, and decodes each request
with its own tenant's module at the version that request was pinned to. A tenant module that
fails fails only its own requests.

`load_weights` takes the payload `TrainingModelService.export_params` produces. Versions are held
in a bounded per-tenant LRU (the latest version is never evicted); a request pins its serving
state when it is submitted, so eviction never breaks a request already in the queue.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from joynexus.artifacts import decode_tenant_payload
from joynexus.core.histogram import BATCH_BOUNDS, LATENCY_BOUNDS, BucketHistogram
from joynexus.core.metering import INFERENCE, UsageMeter, build_meter, split_group_seconds
from joynexus.models.action_modules import ActionModule, ActionModuleConfig, build_action_module
from joynexus.models.backbone import ResidentBackbone
from joynexus.scheduling.inference_queue import InferenceQueue, InferenceRequest, Observation
from joynexus.services.training import BackboneSource

INFERENCE_SERVICE_ACTOR_NAME = "joynexus.inference_service"

log = logging.getLogger(__name__)


class InferenceError(RuntimeError):
    pass


class UnknownPolicyVersion(InferenceError, KeyError):
    def __init__(self, tenant_id: str, version: int | None, available: list[int]):
        what = "no serving state" if not available else f"no version {version} (loaded: {available})"
        super().__init__(f"tenant {tenant_id!r} has {what} in this Inference Model Service")
        self.tenant_id, self.version = tenant_id, version


@dataclass
class ServingState:
    tenant_id: str
    version: int
    schema_signature: str
    module: ActionModule
    manifest_digest: str
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class _Pinned:
    """What a queued request needs at execution time, resolved at submission."""

    state: ServingState
    seeds: list[int] | None
    sample: bool = False
    operation: str = "predict"  # what the usage entry is recorded as ("predict", "rollout", ...)


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
    ):
        """`meter` (or `database_url`, from which a Ray actor builds its own) records each request's
        device-seconds as inference usage of its tenant; without either nothing is recorded."""
        if max_versions_per_tenant < 1:
            raise ValueError(f"max_versions_per_tenant must be >= 1, got {max_versions_per_tenant}")
        if num_threads:
            torch.set_num_threads(num_threads)
        source = (
            BackboneSource.model_validate(backbone_source) if isinstance(backbone_source, dict) else backbone_source
        )
        self.backbone: ResidentBackbone = source.build()
        self.meter, self._owns_meter = build_meter(meter, database_url)
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_versions = max_versions_per_tenant
        self.queue = InferenceQueue()
        self._states: dict[str, OrderedDict[int, ServingState]] = {}
        self._lock = threading.RLock()
        self._stats = {"batches": 0, "requests": 0, "samples": 0, "failed_requests": 0, "busy_seconds": 0.0}
        self._batch_sizes: list[int] = []
        # For /metrics (joynexus.ops.metrics): served requests' latency, physical batch sizes.
        self._latency = BucketHistogram(LATENCY_BOUNDS)
        self._batch_hist = BucketHistogram(BATCH_BOUNDS)
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
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
        module = build_action_module(config)
        module.load_state_dict(tensors, strict=True)
        module.eval().requires_grad_(False)
        state = ServingState(
            manifest.tenant_id, manifest.policy_version, manifest.schema_signature, module, manifest.digest
        )
        with self._lock:
            versions = self._states.setdefault(manifest.tenant_id, OrderedDict())
            versions[manifest.policy_version] = state
            versions.move_to_end(manifest.policy_version)
            self._evict(versions)
        return {
            "tenant_id": manifest.tenant_id,
            "version": manifest.policy_version,
            "loaded": self.versions(manifest.tenant_id),
        }

    def _evict(self, versions: OrderedDict[int, ServingState]) -> None:
        latest = max(versions)
        while len(versions) > self.max_versions:
            victim = min((v for v in versions if v != latest), key=lambda v: versions[v].last_used)
            del versions[victim]

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
        """Forget every serving state of the tenant (tenant deletion); returns how many versions."""
        with self._lock:
            return len(self._states.pop(tenant_id, {}))

    def _resolve(self, tenant_id: str, version: int | None) -> ServingState:
        with self._lock:
            versions = self._states.get(tenant_id)
            if not versions:
                raise UnknownPolicyVersion(tenant_id, version, [])
            key = max(versions) if version is None else version
            state = versions.get(key)
            if state is None:
                raise UnknownPolicyVersion(tenant_id, version, sorted(versions))
            state.last_used = time.monotonic()
            versions.move_to_end(key)
            return state

    # -- requests ---------------------------------------------------------------------------
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
        request = InferenceRequest(
            tenant_id=tenant_id,
            schema_signature=state.schema_signature,
            prefix_key=self.backbone.prefix_key,
            observations=observations,
            policy_version=state.version,
            session_id=session_id,
            context=_Pinned(state, seeds, sample, operation),
        )
        return self.queue.enqueue(request)

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
            if not 1 <= len(obs.images) <= slots:
                raise ValueError(f"observations[{i}].images: {len(obs.images)} cameras, the backbone takes 1..{slots}")
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
            features = self.backbone.encode(images, instructions)
        except Exception as error:  # a bad shared forward fails the batch, never the service
            for request in batch:
                _settle(request.future, exception=InferenceError(f"shared backbone forward failed: {error}"))
            return
        served: list[tuple[InferenceRequest, dict[str, Any]]] = []
        for request, rows in zip(batch, slices, strict=True):
            if request.future.done():  # cancelled by its caller
                continue
            try:
                served.append((request, self._decode(request, features.select(rows).trimmed(), images, rows)))
            except Exception as error:
                self._stats["failed_requests"] += 1
                _settle(request.future, exception=error)
        # Every member shares the forward, so shares are over the whole batch; failed requests are not charged.
        busy = time.perf_counter() - started
        shares = split_group_seconds(busy, [r.size for r in batch])
        share_of = {id(request): share for request, share in zip(batch, shares, strict=True)}
        for request, result in served:
            result["device_seconds"] = share_of[id(request)]
            self._meter_request(request, result["device_seconds"])
            _settle(request.future, result=result)
            self._latency.observe(time.monotonic() - request.enqueued_at)
        self._stats["batches"] += 1
        self._stats["busy_seconds"] += busy
        self._batch_hist.observe(len(images))
        self._stats["requests"] += len(batch)
        self._stats["samples"] += len(images)
        self._batch_sizes.append(len(images))

    def _meter_request(self, request: InferenceRequest, seconds: float) -> None:
        if self.meter is None:
            return
        try:
            operation = request.context.operation
            self.meter.record(request.tenant_id, INFERENCE, operation, device_seconds=seconds, samples=request.size)
        except Exception as error:  # metering never fails a served request
            log.warning("inference usage of tenant %r not recorded: %s", request.tenant_id, error)

    def _decode(self, request: InferenceRequest, features: Any, images: list, rows: slice) -> dict[str, Any]:
        pinned: _Pinned = request.context
        module = pinned.state.module
        state = torch.stack([_as_tensor(obs.state) for obs in request.observations])
        log_probs = None
        with torch.inference_mode():
            if pinned.sample:
                dist = module.action_distribution(features, state)
                if pinned.seeds is None:
                    noise = torch.randn(dist.mean.shape)
                else:
                    noise = torch.stack(
                        [
                            torch.randn(dist.mean.shape[1:], generator=torch.Generator().manual_seed(s))
                            for s in pinned.seeds
                        ]
                    )
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
            "actions": actions.numpy(),
            "values": None if values is None else values.numpy(),
            "log_probs": None if log_probs is None else log_probs.numpy(),
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
            "backbone_instances_created": ResidentBackbone.instances_created,
            "latency_seconds": self._latency.snapshot(),
            "batch_samples": self._batch_hist.snapshot(),
            "rss_bytes": _rss_bytes(),
            "device_memory_bytes": _device_memory_bytes(),
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


def _rss_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # a status answer never fails for it
        return None


def _device_memory_bytes() -> int | None:
    """Accelerator memory torch holds allocated in this process (None without CUDA)."""
    return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else None


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
):  # type: ignore[no-untyped-def]
    """Get or create the named Inference Model Service actor. It is a threaded actor: many callers
    block in `predict` at once while its worker thread batches their requests together.
    `database_url`: the control-plane store the actor meters inference usage into (None: no metering)."""
    from joynexus.runtime import named_actor

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
    )
