"""Tenant-scoped operations of the API: every method takes the caller's tenant and reaches only
that tenant's slot, versions, checkpoints, serving states, queue partitions, sessions and workloads.

The HTTP layer (`joynexus.api.app`) stays thin: it authenticates, then calls one method here. This
module checks request tensors against the tenant's schema (field, expected shape, received shape),
adds the tenant and schema annotations itself (a client never names a tenant), meters usage,
applies quotas, and turns service exceptions into `ApiError`s. Whatever an id of another tenant
would reach raises the same `NotFound` as an id that does not exist.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from joynexus.actors import handle_of
from joynexus.api.auth import ApiKeyStore
from joynexus.api.errors import (
    ApiError,
    Conflict,
    InvalidInput,
    NotFound,
    QuotaExceeded,
    ServiceUnavailable,
)
from joynexus.api.services import ApiServices, timed_call
from joynexus.artifacts import CheckpointError, PayloadError, TenantManifest, decode_tenant_payload
from joynexus.core.metering import TRAINING, UsageMeter
from joynexus.core.tenants import Tenant, simulator_config
from joynexus.master.tenant_creator import TenantExists
from joynexus.master.usage import SpendCapReached, StorageQuotaReached, UsageLedger
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import Tensor
from joynexus.spec import SpecError, WorkloadSpec, parse_workload_spec

PARTITION_PREFIX = "api"
TENANT_CACHE_S = 2.0
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): (.+)$", re.S)
FLOAT_DTYPES = ("float16", "float32", "float64")
IMAGE_DTYPES = ("uint8", *FLOAT_DTYPES)
MASK_DTYPES = ("bool", "uint8")


@dataclass(frozen=True)
class ApiLimits:
    max_samples_per_request: int = s.MAX_SAMPLES_PER_REQUEST
    max_queue_bytes_per_tenant: int = 256 << 20
    max_partitions_per_tenant: int = 64
    max_string_chars: int = 4096


def _cause(error: BaseException) -> BaseException:
    """The service's own exception, also behind Ray's RayTaskError wrapper."""
    return getattr(error, "cause", None) or error


def invalid_from(error: BaseException, default_field: str) -> InvalidInput:
    """An InvalidInput from a service message that starts with `field: reason` when it does."""
    text = str(error).strip() or type(error).__name__
    match = _FIELD_PREFIX.match(text)
    if match:
        return InvalidInput(match.group(1), match.group(2))
    return InvalidInput(default_field, text)


def manifest_model(manifest: TenantManifest) -> s.Manifest:
    return s.Manifest(**json.loads(manifest.to_json()), digest=manifest.digest)


def tenant_info(tenant: Tenant) -> s.TenantInfo:
    cfg = tenant.backend_config
    return s.TenantInfo(
        tenant_id=tenant.tenant_id,
        task=cfg.task_type,
        base_model=cfg.base_model_id,
        schema_signature=cfg.schema_signature,
        cameras=list(cfg.cameras),
        image_size=cfg.image_size,
        state_dim=cfg.state_dim,
        action_dim=cfg.action_dim,
        action_chunk=cfg.action_chunk,
        action_module={"kind": cfg.action_module["kind"], "size": cfg.action_module.get("size")},
        instruction=cfg.instruction,
        microbatch_size=cfg.microbatch_size,
        stochastic=bool(cfg.action_module.get("stochastic", False)),
        environment=simulator_config(cfg) if getattr(cfg, "environment", None) else None,
        status=tenant.status,
        status_reason=tenant.status_reason,
    )


class ApiGateway:
    def __init__(
        self,
        services: ApiServices,
        keys: ApiKeyStore,
        ledger: UsageLedger,
        *,
        limits: ApiLimits | None = None,
    ):
        self.services = services
        self.keys = keys
        self.ledger = ledger
        # Lower-layer training calls are metered like the services meter theirs: batched rows.
        self.meter = UsageMeter(services.store)
        self.limits = limits or ApiLimits()
        self._tenants: dict[str, tuple[float, Tenant]] = {}  # short-lived cache of the Master's answers
        self._lock = threading.Lock()
        self._queue_bytes: dict[str, dict[str, int]] = {}
        self._tenant_locks: dict[str, threading.Lock] = {}
        self.master = services.master

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to start: the Master Service owns workloads, slots and admission."""

    def stop(self) -> None:
        """Write the metered lower-layer usage (the Master owns everything else)."""
        self.meter.try_flush()

    # -- tenants (admin) --------------------------------------------------------------------------
    def create_tenant(self, spec: WorkloadSpec) -> Tenant:
        try:
            tenant = self.master.create_tenant(spec)
        except TenantExists as error:
            raise Conflict(str(error), list(error.problems)) from None
        except SpecError as error:  # field paths are relative to the spec, which is the request body
            raise ApiError("invalid workload spec", list(error.problems)).with_status(422, "invalid_spec") from None
        with self._lock:
            self._tenants[tenant.tenant_id] = (time.monotonic(), tenant)
        return tenant

    def delete_tenant(self, tenant_id: str, delete_artifacts: bool) -> dict[str, Any]:
        try:
            report = self.master.delete_tenant(tenant_id, delete_artifacts=delete_artifacts)
        except KeyError:
            raise NotFound("tenant", tenant_id, "tenant_id") from None
        with self._lock:
            self._tenants.pop(tenant_id, None)
            self._queue_bytes.pop(tenant_id, None)
        return report

    def tenant(self, tenant_id: str, *, healthy: bool = True) -> Tenant:
        """The tenant (cached for TENANT_CACHE_S); `healthy` refuses an unhealthy one with its reason."""
        now = time.monotonic()
        with self._lock:
            cached = self._tenants.get(tenant_id)
        if cached is not None and now - cached[0] < TENANT_CACHE_S:
            tenant = cached[1]
        else:
            try:
                tenant = self.master.get_tenant(tenant_id)
            except KeyError:
                raise NotFound("tenant", tenant_id, "tenant_id") from None
            with self._lock:
                self._tenants[tenant_id] = (now, tenant)
        if healthy and tenant.status != "active":
            raise ApiError(
                f"tenant {tenant_id!r} is {tenant.status}: {tenant.status_reason}",
                [("tenant", tenant.status_reason or tenant.status)],
            ).with_status(409, "tenant_unhealthy")
        return tenant

    def tenants(self) -> list[Tenant]:
        return self.master.list_tenants()

    def _tenant_lock(self, tenant_id: str) -> threading.Lock:
        with self._lock:
            return self._tenant_locks.setdefault(tenant_id, threading.Lock())

    # -- quotas and usage -------------------------------------------------------------------------
    def check_admission(self, tenant_id: str, *, storage: bool = False) -> None:
        """Refuse new work over the spend cap; with `storage` (a call that writes a checkpoint) also
        over the storage quota (listing checkpoints is not worth it on every predict or step)."""
        try:
            self.ledger.check_spend(tenant_id, storage=storage)
        except StorageQuotaReached as error:
            raise QuotaExceeded(str(error), [("quota.max_storage_bytes", str(error))]) from None
        except SpendCapReached as error:
            raise QuotaExceeded(str(error), [("quota.max_device_seconds", str(error))]) from None

    def health(self, timeout_s: float = 5.0) -> s.Health:
        """The Master's Health Manager's report per role; `down` when the Master does not answer."""
        try:
            roles = handle_of(self.master).probe("health", timeout_s)
        except Exception as error:
            detail = f"the Master Service does not answer: {type(error).__name__}: {error}"[:300]
            return s.Health(
                status="down", version=s.API_VERSION, roles={"master": s.RoleHealth(healthy=False, detail=detail)}
            )
        status = "ok" if all(entry["healthy"] for entry in roles.values()) else "degraded"
        return s.Health(
            status=status, version=s.API_VERSION, roles={name: s.RoleHealth(**entry) for name, entry in roles.items()}
        )

    def usage(self, tenant_id: str) -> s.Usage:
        self.meter.flush()  # read-your-writes, as the Master does for the services' meters
        return self.master.usage(tenant_id)

    # -- workloads (upper layer) ------------------------------------------------------------------
    def submit_workload(self, tenant_id: str, request: s.WorkloadSubmit) -> s.WorkloadInfo:
        tenant = self.tenant(tenant_id)
        declared = tenant.spec.task.value
        task = request.task or declared
        if task not in (declared, "eval"):
            reason = f"your tenant was created for {declared!r}: submit {declared!r} (training) or 'eval', got {task!r}"
            raise InvalidInput("task", reason)
        jobs = request.jobs
        if request.spec is not None:
            spec = self._check_submitted_spec(tenant, request.spec)
            if jobs is None:
                jobs = spec.scheduling.completion_target
        from joynexus.master.service import TenantUnavailable
        from joynexus.master.workloads.manager import AdmissionRefused

        try:
            if task == "eval":
                version: int | str = "latest" if request.version is None else request.version
                status = self.master.evaluate(
                    tenant_id, version=version, episodes=request.episodes, environment=request.environment
                )
            else:
                status = self.master.submit_workload(tenant_id, jobs=jobs)
        except AdmissionRefused as error:
            field = next(
                (f"quota.{name}" for name in ("max_queued_workloads", "max_storage_bytes") if name in str(error)),
                "quota.max_device_seconds",
            )
            raise QuotaExceeded(str(error), [(field, str(error))]) from None
        except TenantUnavailable as error:
            raise ApiError(str(error), [("tenant", error.reason)]).with_status(409, "tenant_unhealthy") from None
        except (ValueError, TypeError) as error:
            raise invalid_from(error, "task") from None
        return s.WorkloadInfo.model_validate(status.model_dump())

    def _check_submitted_spec(self, tenant: Tenant, data: dict[str, Any]) -> WorkloadSpec:
        try:
            spec = parse_workload_spec(data)
        except SpecError as error:
            raise ApiError("invalid workload spec", [(f"spec.{f}", r) for f, r in error.problems]).with_status(
                422, "invalid_spec"
            ) from None
        if spec.tenant != tenant.tenant_id:
            raise InvalidInput("spec.tenant", f"must be your tenant {tenant.tenant_id!r}, got {spec.tenant!r}")
        if spec.task != tenant.spec.task:
            raise InvalidInput(
                "spec.task",
                f"tenant {tenant.tenant_id!r} was created for task {tenant.spec.task.value!r}, got {spec.task.value!r}",
            )
        signature = spec.vla_schema().signature
        if signature != tenant.schema_signature:
            raise InvalidInput(
                "spec.observation",
                f"the interface (schema signature {signature[:16]}) differs from the one tenant "
                f"{tenant.tenant_id!r} was created with ({tenant.schema_signature[:16]}); a new interface needs a "
                "new tenant",
            )
        return spec

    def workload(self, tenant_id: str, workload_id: str) -> s.WorkloadInfo:
        try:
            status = self.master.get_workload(workload_id, tenant_id)
        except KeyError:
            raise NotFound("workload", workload_id, "workload_id") from None
        return s.WorkloadInfo.model_validate(status.model_dump())

    def list_workloads(self, tenant_id: str) -> list[s.WorkloadInfo]:
        return [s.WorkloadInfo.model_validate(w.model_dump()) for w in self.master.list_workloads(tenant_id)]

    def cancel_workload(self, tenant_id: str, workload_id: str) -> s.WorkloadInfo:
        try:
            status = self.master.cancel_workload(workload_id, tenant_id)
        except KeyError:
            raise NotFound("workload", workload_id, "workload_id") from None
        return s.WorkloadInfo.model_validate(status.model_dump())

    def workload_events(self, tenant_id: str, workload_id: str, after: int) -> s.WorkloadEvents:
        try:
            events = self.master.workload_events(workload_id, after, tenant_id)
        except KeyError:
            raise NotFound("workload", workload_id, "workload_id") from None
        info = self.workload(tenant_id, workload_id)
        return s.WorkloadEvents(workload=info, events=[s.WorkloadEvent.model_validate(e) for e in events])

    # -- versions, checkpoints, export ------------------------------------------------------------
    def versions(self, tenant_id: str, after: int | None = None, limit: int = 100) -> s.Versions:
        """One page of checkpoints (versions > `after`, None: from version 0 on; ascending, at most
        `limit`) from ONE listing of the tenant's checkpoints; `next_after` continues (None: no more)."""
        status = self.services.training_service.tenant_status(tenant_id)
        # One more than asked for says whether another page follows without a second listing.
        start = -1 if after is None else after
        infos = self.services.checkpoints.version_infos(tenant_id, after=start, limit=limit + 1)
        page = infos[:limit]
        checkpoints = [
            s.CheckpointInfo(version=i.version, created_at=i.created_at, digest=i.digest, size_bytes=i.size_bytes)
            for i in page
        ]
        return s.Versions(
            training_version=status["version"],
            optimizer_steps=status["optimizer_steps"],
            checkpoints=checkpoints,
            serving_versions=self.services.inference_service.versions(tenant_id),
            next_after=page[-1].version if len(infos) > limit else None,
        )

    def _checkpoint_manifest(self, tenant_id: str, version: int) -> TenantManifest:
        """The manifest of one of the tenant's checkpoints (no tensors read)."""
        if version not in self.services.checkpoints.versions(tenant_id):
            raise NotFound("checkpoint version", version, "version")
        return self.services.checkpoints.read_manifest(tenant_id, version)

    def checkpoint_manifest(self, tenant_id: str, version: int) -> s.Manifest:
        return manifest_model(self._checkpoint_manifest(tenant_id, version))

    def export(self, tenant_id: str, version: int | None = None) -> tuple[bytes, TenantManifest]:
        """The tenant payload of `version` (None: the current training parameters)."""
        current = self.services.training_service.policy_version(tenant_id)
        if version is None or version == current:
            payload = self.services.training_service.export_params(tenant_id)
            return payload, decode_tenant_payload(payload)[1]
        if version not in self.services.checkpoints.versions(tenant_id):
            raise NotFound("policy version", version, "version")
        from joynexus.artifacts import encode_tenant_payload

        try:
            manifest, module_state, _ = self.services.checkpoints.load_tenant(tenant_id, version)
        except CheckpointError as error:
            raise ApiError(f"checkpoint version {version} cannot be read: {error}").with_status(
                500, "checkpoint_unreadable"
            ) from None
        return encode_tenant_payload(module_state, manifest), manifest

    def save(self, tenant_id: str, include_optim: bool) -> s.Manifest:
        self.check_admission(tenant_id, storage=True)
        manifests = self.services.training_service.save([tenant_id], include_optim)
        return s.Manifest.model_validate(manifests[0])

    def load_weights(self, tenant_id: str, request: s.LoadWeightsRequest) -> s.LoadWeightsResult:
        tenant = self.tenant(tenant_id)
        if request.payload is not None:
            if request.version is not None:
                raise InvalidInput("version", "give either payload or version, not both")
            payload = request.payload
            module_state, manifest = self._check_payload(tenant, payload)
            self._check_payload_finite(module_state)
            self._check_payload_issued(tenant_id, manifest)
        else:
            payload, _ = self.export(tenant_id, request.version)
        with self._service_errors("payload"):
            try:
                loaded = self.services.inference_service.load_weights(payload)
            except RuntimeError as error:  # load_state_dict: names or shapes differ from the module
                cause = _cause(error)
                if type(cause) is RuntimeError:
                    first = str(cause).strip().splitlines()[0]
                    raise InvalidInput("payload", f"tensors do not fit the tenant's action module: {first}") from None
                raise
        return s.LoadWeightsResult(version=loaded["version"], serving_versions=loaded["loaded"])

    @staticmethod
    def _check_payload(tenant: Tenant, payload: bytes) -> tuple[dict[str, Any], TenantManifest]:
        """A payload may only install the caller's own module, with the interface and module
        config the tenant was created with (so it cannot name another tenant or grow the module).
        Returns the decoded (module_state, manifest)."""
        try:
            module_state, manifest = decode_tenant_payload(payload)
        except PayloadError as error:
            raise InvalidInput("payload", str(error)) from None
        cfg = tenant.backend_config
        for field, got, expected in (
            ("tenant_id", manifest.tenant_id, cfg.tenant_id),
            ("schema_signature", manifest.schema_signature, cfg.schema_signature),
            ("base_model_id", manifest.base_model_id, cfg.base_model_id),
        ):
            if got != expected:
                raise InvalidInput(f"payload.manifest.{field}", f"must be {expected!r} for your tenant, got {got!r}")
        if json.loads(json.dumps(manifest.module_config)) != json.loads(json.dumps(cfg.action_module)):
            raise InvalidInput(
                "payload.manifest.module_config", "differs from the action module config your tenant was created with"
            )
        # A payload cannot add, drop or reshape the tenant's LoRA adapter on the shared backbone.
        adapter = (manifest.extra or {}).get("adapter")
        if json.loads(json.dumps(adapter)) != json.loads(json.dumps(cfg.adapter)):
            raise InvalidInput(
                "payload.manifest.extra.adapter", "differs from the adapter config your tenant was created with"
            )
        return module_state, manifest

    @staticmethod
    def _check_payload_finite(module_state: dict[str, Any]) -> None:
        """NaN / Inf weights would serve NaN actions to robots: refuse them by tensor name."""
        import torch

        for name, value in module_state.items():
            if (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
                raise InvalidInput("payload", f"tensor {name!r} holds NaN or infinite values")

    def _check_payload_issued(self, tenant_id: str, manifest: TenantManifest) -> None:
        """Only versions this service issued, with the manifest it issued them with: a made-up
        version would later collide with the real one of that number in the serving versions."""
        version = manifest.policy_version
        field = "payload.manifest.version"
        with self._service_errors("payload"):
            current = self.services.training_service.policy_version(tenant_id)
        issued = self.services.checkpoints.issued_version(tenant_id)
        # The slot's own version counts as issued (version 0 exists before anything is recorded).
        newest = current if issued is None else max(issued, current)
        if version < 0 or version > newest:
            raise InvalidInput(field, f"version {version} was never issued for your tenant (the newest is {newest})")
        expected: list[str] = []  # digests of the manifests this service gave version `version`
        try:  # one read, not a listing of every checkpoint: a missing manifest means no checkpoint
            expected.append(self.services.checkpoints.read_manifest(tenant_id, version).digest)
        except CheckpointError as error:
            if not isinstance(error.__cause__, FileNotFoundError):
                raise ApiError(f"checkpoint version {version} cannot be read: {error}").with_status(
                    500, "checkpoint_unreadable"
                ) from None
        if version == current:
            with self._service_errors("payload"):
                _, exported = decode_tenant_payload(self.services.training_service.export_params(tenant_id))
            # Each export stamps its own created_at: compare everything but the time stamp.
            expected.append(dataclasses.replace(exported, created_at=manifest.created_at).digest)
        if expected and manifest.digest not in expected:
            raise InvalidInput(
                field,
                f"the manifest of version {version} differs from the one this service issued for it "
                f"(digest {manifest.digest[:16]}); to serve that version, load it by version instead",
            )

    # -- lower layer: training --------------------------------------------------------------------
    def train_batch(self, tenant_id: str, batch: s.SampleBatch) -> s.TrainStepResult:
        tenant = self.tenant(tenant_id)
        columns = self._sample_columns(tenant, batch)
        self.check_admission(tenant_id)
        with self._service_errors("batch"):
            result, seconds = timed_call(self.services.training_service, "train_batch", tenant_id, columns)
        samples = len(columns["task"])
        self.meter.record(tenant_id, TRAINING, "train_batch", device_seconds=seconds, samples=samples)
        return s.TrainStepResult(
            loss=result["loss"],
            version=result["version"],
            optimizer_steps=result["optimizer_steps"],
            samples=samples,
            device_seconds=seconds,
        )

    def forward_backward(self, tenant_id: str, request: s.ForwardBackwardRequest) -> s.ForwardBackwardResult:
        tenant = self.tenant(tenant_id)
        columns = self._sample_columns(tenant, request)
        samples = len(columns["task"])
        if request.loss != "default":
            if request.advantages is None:
                raise InvalidInput("advantages", f"required when loss is {request.loss!r}: one float per sample")
            columns["advantages"] = self._float_array(request.advantages, "advantages", (samples,))
        elif request.advantages is not None:
            raise InvalidInput("advantages", "only used with loss 'advantage_weighted' or 'policy_gradient'")
        self.check_admission(tenant_id)
        with self._service_errors("batch"):
            result, seconds = timed_call(
                self.services.training_service, "forward_backward", tenant_id, columns, request.loss
            )
        seconds = result.get("seconds", seconds)
        self.meter.record(tenant_id, TRAINING, "forward_backward", device_seconds=seconds, samples=samples)
        return s.ForwardBackwardResult(
            loss=result["loss"],
            samples=samples,
            accumulated_microbatches=result["accumulated_microbatches"],
            accumulated_samples=result["accumulated_samples"],
            version=result["version"],
            device_seconds=seconds,
        )

    def optim_step(self, tenant_id: str) -> s.OptimStepResult:
        self.tenant(tenant_id)
        with self._service_errors("tenant"):
            result, seconds = timed_call(self.services.training_service, "optim_step", tenant_id)
        seconds = result.get("seconds", seconds)
        self.meter.record(tenant_id, TRAINING, "optim_step", device_seconds=seconds)
        return s.OptimStepResult(
            loss=result["loss"],
            grad_norm=result["grad_norm"],
            microbatches=result["microbatches"],
            samples=result["samples"],
            optimizer_steps=result["optimizer_steps"],
            version=result["version"],
            device_seconds=seconds,
        )

    # -- lower layer: inference -------------------------------------------------------------------
    def predict(self, tenant_id: str, request: s.PredictRequest) -> s.PredictResult:
        from joynexus.scheduling.inference_queue import Observation

        tenant = self.tenant(tenant_id)
        obs = request.observations
        images, state, instructions = self._observation_arrays(tenant, obs.images, obs.state, obs.instructions)
        n = images.shape[0]
        if request.seeds is not None and len(request.seeds) != n:
            raise InvalidInput("seeds", f"expected {n} seeds (one per observation), got {len(request.seeds)}")
        if request.seeds is not None and any(not 0 <= seed < 2**63 for seed in request.seeds):
            raise InvalidInput("seeds", "each seed must be in [0, 2**63)")
        observations = [
            Observation(images=tuple(images[i]), state=state[i], instruction=instructions[i]) for i in range(n)
        ]
        self.check_admission(tenant_id)
        with self._service_errors("observations"):
            # The request rides the shared Inference Queue of the resident service, which meters it.
            result = self.services.inference_service.predict(
                tenant_id,
                observations,
                policy_version=request.policy_version,
                session_id=request.session_id,
                seeds=request.seeds,
                sample=request.sample,
                timeout_s=request.timeout_s,
            )
        seconds = float(result.get("device_seconds", 0.0))
        values, log_probs = result.get("values"), result.get("log_probs")
        return s.PredictResult(
            policy_version=result["policy_version"],
            actions=Tensor.from_numpy(np.asarray(result["actions"], dtype=np.float32)),
            values=None if values is None else Tensor.from_numpy(np.asarray(values, dtype=np.float32)),
            log_probs=None if log_probs is None else Tensor.from_numpy(np.asarray(log_probs, dtype=np.float32)),
            batch_samples=result["batch_samples"],
            device_seconds=seconds,
        )

    # -- lower layer: Training Queue --------------------------------------------------------------
    def _partition_id(self, tenant_id: str, name: str) -> str:
        if not re.fullmatch(s.PARTITION_NAME_PATTERN, name):
            raise InvalidInput("partition", f"{name!r} must match {s.PARTITION_NAME_PATTERN}")
        return f"{PARTITION_PREFIX}/{tenant_id}/{name}"

    def _own_partition(self, tenant_id: str, name: str) -> str:
        partition_id = self._partition_id(tenant_id, name)
        if not self.services.queue.has_partition(partition_id):
            raise NotFound("partition", name, "partition")
        return partition_id

    def queue_put(self, tenant_id: str, name: str, request: s.QueuePut) -> s.PartitionInfo:
        self.tenant(tenant_id)
        partition_id = self._partition_id(tenant_id, name)
        data, nbytes = self._columns_in(request.columns)
        rows = {key: len(col) for key, col in data.items()}
        if len(set(rows.values())) != 1:
            raise InvalidInput("columns", f"every column needs the same number of rows, got {rows}")
        from joynexus.scheduling.training_queue import BatchMeta, TrainingQueueError

        metadata = None
        if request.indices is not None:
            info = self._describe(tenant_id, name)
            self._check_indices(request.indices, next(iter(rows.values())), info["num_samples"])
            metadata = BatchMeta(partition_id, request.task_name, tuple(request.indices), tuple(data))
        with self._tenant_lock(tenant_id):
            owned = self._queue_bytes.setdefault(tenant_id, {})
            if name not in owned and metadata is None:
                existing = self._list_partition_ids(tenant_id)
                if len(existing) >= self.limits.max_partitions_per_tenant and partition_id not in existing:
                    raise QuotaExceeded(
                        f"your tenant already holds {len(existing)} partitions (limit "
                        f"{self.limits.max_partitions_per_tenant}); clear some first",
                        [("partition", "too many partitions")],
                    )
            if sum(owned.values()) + nbytes > self.limits.max_queue_bytes_per_tenant:
                raise QuotaExceeded(
                    f"this put would make your tenant's Training Queue data {sum(owned.values()) + nbytes} bytes, "
                    f"over the limit of {self.limits.max_queue_bytes_per_tenant}; clear consumed partitions first",
                    [("columns", "queue byte limit")],
                )
            try:
                self.services.queue.put(partition_id, data, metadata)
            except Exception as error:
                cause = _cause(error)
                if isinstance(cause, TrainingQueueError | ValueError | TypeError):  # e.g. rows that do not fit
                    raise InvalidInput("columns", _strip_partition(str(cause), partition_id, name)) from None
                raise
            owned[name] = owned.get(name, 0) + nbytes
        return self.queue_describe(tenant_id, name)

    @staticmethod
    def _check_indices(indices: list[int], rows: int, num_samples: int) -> None:
        if len(indices) != rows:
            raise InvalidInput("indices", f"{len(indices)} indices for {rows} rows")
        if len(set(indices)) != len(indices):
            raise InvalidInput("indices", "indices must be unique")
        bad = [i for i in indices if not 0 <= i < num_samples]
        if bad:
            raise InvalidInput("indices", f"{bad[:5]} out of range: the partition holds {num_samples} samples")

    def queue_get(self, tenant_id: str, name: str, request: s.QueueGet) -> s.QueueBatch:
        self.tenant(tenant_id)
        partition_id = self._own_partition(tenant_id, name)
        from joynexus.scheduling.training_queue import TrainingQueueError, UnknownPartition

        try:
            queue = self.services.queue
            meta = queue.get_meta(partition_id, request.fields, request.batch_size, request.task_name)
            data = {} if meta is None else queue.get_data(meta)
        except Exception as error:
            cause = _cause(error)
            if isinstance(cause, UnknownPartition):
                raise NotFound("partition", name, "partition") from None
            if isinstance(cause, TrainingQueueError):
                raise InvalidInput("fields", _strip_partition(str(cause), partition_id, name)) from None
            raise
        return s.QueueBatch(
            partition=name,
            task_name=request.task_name,
            indices=list(meta.indices) if meta is not None else [],
            columns=self._columns_out(data),
            exhausted=meta is None,
        )

    def queue_clear(self, tenant_id: str, name: str) -> s.Cleared:
        partition_id = self._own_partition(tenant_id, name)
        with self._tenant_lock(tenant_id):
            cleared = self.services.queue.clear(partition_id)
            self._queue_bytes.get(tenant_id, {}).pop(name, None)
        return s.Cleared(cleared=bool(cleared))

    def _list_partition_ids(self, tenant_id: str) -> list[str]:
        prefix = f"{PARTITION_PREFIX}/{tenant_id}/"
        return [p for p in self.services.queue.partitions() if p.startswith(prefix)]

    def queue_list(self, tenant_id: str) -> list[s.PartitionInfo]:
        prefix = f"{PARTITION_PREFIX}/{tenant_id}/"
        names = [p[len(prefix) :] for p in self._list_partition_ids(tenant_id)]
        infos = []
        for name in names:
            try:
                infos.append(self.queue_describe(tenant_id, name))
            except NotFound:  # cleared meanwhile
                continue
        return infos

    def _describe(self, tenant_id: str, name: str) -> dict[str, Any]:
        from joynexus.scheduling.training_queue import UnknownPartition

        partition_id = self._partition_id(tenant_id, name)
        try:
            return self.services.queue.describe(partition_id)
        except Exception as error:
            if isinstance(_cause(error), UnknownPartition | KeyError):
                raise NotFound("partition", name, "partition") from None
            raise

    def queue_describe(self, tenant_id: str, name: str) -> s.PartitionInfo:
        info = self._describe(tenant_id, name)
        nbytes = self._queue_bytes.get(tenant_id, {}).get(name, 0)
        return s.PartitionInfo(
            partition=name,
            num_samples=info["num_samples"],
            fields=info["fields"],
            cursors=info["cursors"],
            bytes=nbytes,
        )

    def _columns_in(self, columns: dict[str, s.Column]) -> tuple[dict[str, Any], int]:
        data: dict[str, Any] = {}
        nbytes = 0
        for key, column in columns.items():
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", key):
                raise InvalidInput(f"columns.{key}", "column names are 1-64 characters of [A-Za-z0-9_.-]")
            if isinstance(column, Tensor):
                if not column.shape:
                    raise InvalidInput(f"columns.{key}", "a column needs a sample axis (shape [N, ...])")
                data[key] = column.to_numpy()
                nbytes += column.nbytes
            else:
                long = [i for i, text in enumerate(column) if len(text) > self.limits.max_string_chars]
                if long:
                    raise InvalidInput(f"columns.{key}[{long[0]}]", f"longer than {self.limits.max_string_chars} chars")
                data[key] = list(column)
                nbytes += sum(len(text) for text in column)
        return data, nbytes

    @staticmethod
    def _columns_out(data: dict[str, Any]) -> dict[str, s.Column]:
        out: dict[str, s.Column] = {}
        for key, column in data.items():
            if isinstance(column, np.ndarray):
                out[key] = Tensor.from_numpy(column)
            else:
                out[key] = ["" if value is None else str(value) for value in column]
        return out

    # -- lower layer: environment sessions --------------------------------------------------------
    def _environment(self) -> Any:
        service = self.services.environment_service
        if service is None:
            raise ServiceUnavailable("this server runs no Environment Service")
        return service

    @contextmanager
    def _session_errors(self, session_id: str | None, field: str) -> Iterator[None]:
        """Environment Service exceptions as API errors; another tenant's session is a 404."""
        from joynexus.envs.base import SimulatorUnavailable
        from joynexus.services.environment.service import SessionFailed, SessionLimitExceeded, SimulatorError

        try:
            yield
        except ApiError:
            raise
        except Exception as error:
            cause = _cause(error)
            if isinstance(cause, KeyError) and session_id is not None:  # UnknownSession: missing or not yours
                raise NotFound("session", session_id, "session_id") from None
            if isinstance(cause, SessionLimitExceeded):
                raise QuotaExceeded(str(cause), [("sessions", str(cause))]) from None
            if isinstance(cause, SessionFailed):
                raise ApiError(str(cause), [("session_id", cause.reason)]).with_status(409, "session_failed") from None
            if isinstance(cause, SimulatorError):
                raise ApiError(str(cause), [(field, str(cause))]).with_status(409, "simulator_error") from None
            if isinstance(cause, SimulatorUnavailable):
                raise InvalidInput("config.simulator", f"cannot run on this server: {cause}") from None
            if isinstance(cause, ValueError):
                raise invalid_from(cause, field) from None
            if type(cause) is RuntimeError:  # e.g. "call reset() before step()"
                raise Conflict(str(cause), [(field, str(cause))]) from None
            raise

    def open_session(self, tenant_id: str, request: s.SessionOpen) -> s.SessionInfo:
        self.tenant(tenant_id)
        self.check_admission(tenant_id)
        env = self._environment()
        with self._session_errors(None, "config"):
            session_id = env.open_session(tenant_id, request.rollout_id, request.config)
            spec = env.spec(tenant_id, session_id)
        return s.SessionInfo(session_id=session_id, rollout_id=request.rollout_id, state="ready", spec=spec)

    def sessions(self, tenant_id: str) -> s.SessionList:
        described = self._environment().sessions(tenant_id)
        return s.SessionList(sessions=[s.SessionInfo.model_validate(d) for d in described])

    def reset_session(self, tenant_id: str, session_id: str, request: s.EnvReset) -> s.EnvResult:
        with self._session_errors(session_id, "seed"):
            result = self._environment().reset(tenant_id, session_id, request.seed)
        return s.EnvResult(data=_to_wire(result))

    def step_session(self, tenant_id: str, session_id: str, request: s.EnvStep) -> s.EnvResult:
        action = self._float_array(request.action, "action", None)
        self.check_admission(tenant_id)
        with self._session_errors(session_id, "action"):
            result = self._environment().step(tenant_id, session_id, action)
        return s.EnvResult(data=_to_wire(result))

    def close_session(self, tenant_id: str, session_id: str) -> s.Cleared:
        with self._session_errors(session_id, "session_id"):
            self._environment().close(tenant_id, session_id)
        return s.Cleared(cleared=True)

    # -- request tensors against the tenant's schema ----------------------------------------------
    def _sample_columns(self, tenant: Tenant, batch: s.SampleBatch) -> dict[str, Any]:
        """Training columns (the Training Model Service's format) with this tenant's annotations."""
        cfg = tenant.backend_config
        images, state, instructions = self._observation_arrays(tenant, batch.images, batch.state, batch.instructions)
        n = images.shape[0]
        action = self._float_array(batch.action, "action", (n, cfg.action_chunk, cfg.action_dim))
        if batch.action_is_pad is None:
            pad = np.zeros((n, cfg.action_chunk), dtype=bool)
        else:
            pad = self._array(batch.action_is_pad, "action_is_pad", (n, cfg.action_chunk), MASK_DTYPES).astype(bool)
        return {
            "images": images,
            "state": state,
            "action": action,
            "action_is_pad": pad,
            "task": instructions,
            "tenant_id": [tenant.tenant_id] * n,
            "schema_signature": [tenant.schema_signature] * n,
        }

    def _observation_arrays(
        self, tenant: Tenant, images_in: Tensor | None, state_in: Tensor, instructions_in: list[str] | None
    ) -> tuple[np.ndarray, np.ndarray, list[str]]:
        cfg = tenant.backend_config
        height, width = cfg.image_size
        cameras = len(cfg.cameras)
        if images_in is None:
            if cameras:
                raise InvalidInput(
                    "images",
                    f"required: your tenant has cameras {list(cfg.cameras)}; send shape (N, {cameras}, 3, {height}, "
                    f"{width})",
                )
            # A state-only tenant: N comes from the state, and every sample has no camera image.
            n = state_in.shape[0] if len(state_in.shape) == 2 else 0
            if not n:
                raise InvalidInput(
                    "state", f"expected shape (N, {cfg.state_dim}) with N >= 1, got {tuple(state_in.shape)}"
                )
            if n > self.limits.max_samples_per_request:
                raise InvalidInput(
                    "state", f"{n} samples, the limit per request is {self.limits.max_samples_per_request}"
                )
            images_in = Tensor.from_numpy(np.zeros((n, 0, 3, height, width), dtype=np.float32))
        if len(images_in.shape) != 5 or not images_in.shape[0]:
            raise InvalidInput(
                "images",
                f"expected shape (N, {cameras}, 3, {height}, {width}) [samples, cameras {list(cfg.cameras)}, "
                f"channels, height, width] with N >= 1, got {tuple(images_in.shape)}",
            )
        n = images_in.shape[0]
        if n > self.limits.max_samples_per_request:
            raise InvalidInput("images", f"{n} samples, the limit per request is {self.limits.max_samples_per_request}")
        images = self._array(images_in, "images", (n, cameras, 3, height, width), IMAGE_DTYPES)
        images = images.astype(np.float32) / 255.0 if images.dtype == np.uint8 else _to_float32(images, "images")
        if images.size and (images.min() < 0.0 or images.max() > 1.0):
            raise InvalidInput("images", "float images must lie in [0, 1] (or send uint8 in [0, 255])")
        state = self._float_array(state_in, "state", (n, cfg.state_dim))
        if instructions_in is None:
            instructions = [""] * n
        else:
            if len(instructions_in) != n:
                raise InvalidInput("instructions", f"expected {n} strings (one per sample), got {len(instructions_in)}")
            long = [i for i, text in enumerate(instructions_in) if len(text) > s.MAX_INSTRUCTION_CHARS]
            if long:
                raise InvalidInput(f"instructions[{long[0]}]", f"longer than {s.MAX_INSTRUCTION_CHARS} characters")
            instructions = list(instructions_in)
        return images, state, instructions

    @staticmethod
    def _array(tensor: Tensor, field: str, shape: tuple[int, ...] | None, dtypes: tuple[str, ...]) -> np.ndarray:
        if tensor.dtype not in dtypes:
            raise InvalidInput(f"{field}.dtype", f"{tensor.dtype!r} is not accepted here; use one of {list(dtypes)}")
        if shape is not None and tuple(tensor.shape) != shape:
            raise InvalidInput(f"{field}.shape", f"expected {shape}, got {tuple(tensor.shape)}")
        array = tensor.to_numpy()
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise InvalidInput(field, "holds NaN or infinite values")
        return array

    def _float_array(self, tensor: Tensor, field: str, shape: tuple[int, ...] | None) -> np.ndarray:
        array = self._array(tensor, field, shape, FLOAT_DTYPES)
        return _to_float32(array, field)

    # -- service errors ---------------------------------------------------------------------------
    @contextmanager
    def _service_errors(self, field: str, not_found: tuple[str, Any, str] | None = None) -> Iterator[None]:
        """Turn a service's exception into the API error a client can act on."""
        from joynexus.scheduling.inference_queue import InferenceQueueClosed
        from joynexus.services.inference.service import UnknownPolicyVersion
        from joynexus.services.training.service import TenantSlotError

        try:
            yield
        except ApiError:
            raise
        except Exception as error:
            cause = _cause(error)
            if isinstance(cause, UnknownPolicyVersion):
                if cause.version is None:
                    raise ApiError(
                        "no serving weights for your tenant yet: load them with POST /v1/weights/load",
                        [("policy_version", "nothing is being served")],
                    ).with_status(404, "not_found") from None
                raise NotFound("policy version", cause.version, "policy_version") from None
            if isinstance(cause, KeyError) and not_found is not None:
                raise NotFound(*not_found) from None
            if isinstance(cause, TenantSlotError):
                raise Conflict(str(cause), [(field, str(cause))]) from None
            if isinstance(cause, InferenceQueueClosed):
                raise ServiceUnavailable("the Inference Model Service is shutting down") from None
            if isinstance(cause, TimeoutError):
                raise ApiError(
                    "the request did not finish within its timeout", [("timeout_s", "exceeded")]
                ).with_status(504, "timeout") from None
            if isinstance(cause, ValueError):
                raise invalid_from(cause, field) from None
            raise


def _to_float32(array: np.ndarray, field: str) -> np.ndarray:
    """The float32 the services compute in; finite float64 values beyond float32's range would
    silently become inf in the cast (and NaN losses or actions later), so they are refused."""
    with np.errstate(over="ignore"):
        out = array.astype(np.float32)
    if out.size and not np.isfinite(out).all():
        limit = float(np.finfo(np.float32).max)
        raise InvalidInput(field, f"values overflow float32 (|x| > {limit:.8g}); send values within float32 range")
    return out


def _strip_partition(message: str, partition_id: str, name: str) -> str:
    return message.replace(repr(partition_id), repr(name)).replace(partition_id, name)


def _to_wire(value: Any) -> Any:
    """Service results as JSON-able data with arrays as wire tensors (recursively)."""
    if isinstance(value, np.ndarray):
        return Tensor.from_numpy(value)
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return _to_wire(value.to_dict())
    if isinstance(value, dict):
        return {str(k): _to_wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_wire(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
