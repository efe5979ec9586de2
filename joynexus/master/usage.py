"""Usage metering and quotas per tenant.

What is metered, and where the number comes from:
- training device-seconds and samples: lower-layer calls record the time the Training Model
  Service spent on them (`seconds` it returns, else the time of the call); workload training is
  read from the completed training jobs' results in the control-plane store (`seconds`,
  `samples`), so nothing is counted twice;
- inference device-seconds and environment steps: metered inside the Inference Model Service and
  the Environment Service themselves (`joynexus.core.metering.UsageMeter`), so API calls, RL
  rollouts and evaluations are all counted: every shared backbone batch is timed and each request
  gets its share by samples;
- storage: bytes of the tenant's checkpoints, as the CheckpointStore counts them, plus the unpacked
  bytes of the datasets it uploaded (`dataset_bytes`, `joynexus.data.uploads`); deleting an upload
  gives its bytes back.

Quotas: a spend cap on device-seconds (training + inference) stops admission of new work once
reached (`SpendCapReached`, a clear message, HTTP 429); work already running finishes. A storage
quota (`max_storage_bytes`) likewise stops admission once the tenant's checkpoints and uploads take
that many bytes (`StorageQuotaReached`, a kind of `SpendCapReached`); checkpoint retention in the
CheckpointStore (keep the last K plus the registered versions) is what frees them. Running
workloads per tenant are bounded by the Master Service (one at a time); further submissions wait
in its queue with a visible position, up to `max_queued_workloads`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select

from joynexus.core.metering import ENVIRONMENT, INFERENCE, TRAINING
from joynexus.core.store import (
    ControlPlaneStore,
    TenantForkRecord,
    TenantQuotaRecord,
    TrainingJobRecord,
    UsageRecord,
    utcnow,
)
from joynexus.data.uploads import tenant_dataset_bytes
from joynexus.protocol.schemas import DeviceSeconds, Quota, QuotaUpdate, Usage

if TYPE_CHECKING:
    from joynexus.artifacts import CheckpointStore

__all__ = ["ENVIRONMENT", "INFERENCE", "TRAINING", "SpendCapReached", "StorageQuotaReached", "UsageLedger"]


class SpendCapReached(RuntimeError):
    pass


class StorageQuotaReached(SpendCapReached):
    """The tenant's checkpoints take its whole storage quota; a SpendCapReached, so every caller
    that refuses admission on a spend cap refuses on this too."""


class UsageLedger:
    """Usage rows and quotas in the control-plane store (tables `usage_records`, `tenant_quotas`)."""

    def __init__(
        self,
        store: ControlPlaneStore,
        *,
        checkpoints: CheckpointStore | None = None,
        checkpoint_root: Path | None = None,
        default_max_device_seconds: float | None = None,
        default_max_queued_workloads: int | None = 8,
        default_max_storage_bytes: int | None = None,
        datasets_dir: Path | None = None,
    ):
        """`checkpoints` answers the tenants' checkpoint bytes (`tenant_bytes`); `checkpoint_root`, a local
        folder read directly, is deprecated (it misses object-store checkpoints). `datasets_dir`: where
        uploads are kept (`<data_dir>/datasets`); their bytes count in storage too."""
        if checkpoints is not None and checkpoint_root is not None:
            raise ValueError("pass either checkpoints or checkpoint_root, not both")
        if checkpoint_root is not None:
            warnings.warn(
                "UsageLedger(checkpoint_root=...) is deprecated; pass checkpoints=CheckpointStore",
                DeprecationWarning,
                stacklevel=2,
            )
        self.store = store
        self.checkpoints = checkpoints
        self.checkpoint_root = checkpoint_root
        self.datasets_dir = datasets_dir
        self.default_max_device_seconds = default_max_device_seconds
        self.default_max_queued_workloads = default_max_queued_workloads
        if default_max_storage_bytes is not None and default_max_storage_bytes < 0:
            raise ValueError(f"invalid default_max_storage_bytes {default_max_storage_bytes!r}: expected >= 0 or None")
        self.default_max_storage_bytes = default_max_storage_bytes

    # -- quotas -------------------------------------------------------------------------------
    def quota(self, tenant_id: str) -> Quota:
        # A pure read (every predict's admission check asks): no write lock, so concurrent requests
        # and the usage meter's flushes never queue behind each other here (issue 17).
        with self.store.read() as session:
            record = session.get(TenantQuotaRecord, tenant_id)
            seconds = record.max_device_seconds if record is not None else None
            queued = record.max_queued_workloads if record is not None else None
            storage = record.max_storage_bytes if record is not None else None
        # A dict through model_validate: Quota ignores unknown keys, so max_storage_bytes shows up
        # once the schema declares it and is dropped (not an error) before.
        return Quota.model_validate(
            {
                "max_device_seconds": seconds if seconds is not None else self.default_max_device_seconds,
                "max_queued_workloads": queued if queued is not None else self.default_max_queued_workloads,
                "max_storage_bytes": storage if storage is not None else self.default_max_storage_bytes,
            }
        )

    def max_storage_bytes(self, tenant_id: str) -> int | None:
        """The tenant's storage quota in checkpoint bytes (its own, else the default); None: none."""
        with self.store.read() as session:
            record = session.get(TenantQuotaRecord, tenant_id)
            storage = record.max_storage_bytes if record is not None else None
        return storage if storage is not None else self.default_max_storage_bytes

    def set_max_storage_bytes(self, tenant_id: str, max_storage_bytes: int | None) -> Quota:
        """Set (None: restore the default of) the tenant's storage quota, leaving its other limits."""
        if max_storage_bytes is not None and (
            isinstance(max_storage_bytes, bool) or not isinstance(max_storage_bytes, int) or max_storage_bytes < 0
        ):
            raise ValueError(f"invalid max_storage_bytes {max_storage_bytes!r}: expected an int >= 0 or None")
        with self.store.transaction() as session:
            record = session.get(TenantQuotaRecord, tenant_id)
            if record is None:
                record = TenantQuotaRecord(tenant_id=tenant_id)
                session.add(record)
            record.max_storage_bytes = max_storage_bytes
            record.updated_at = utcnow()
        return self.quota(tenant_id)

    def set_quota(self, tenant_id: str, update: QuotaUpdate) -> Quota:
        with self.store.transaction() as session:
            record = session.get(TenantQuotaRecord, tenant_id)
            if record is None:
                record = TenantQuotaRecord(tenant_id=tenant_id)
                session.add(record)
            record.max_device_seconds = update.max_device_seconds
            record.max_queued_workloads = update.max_queued_workloads
            # Like the other limits once QuotaUpdate declares it; an update that cannot name it
            # (the schema before that) leaves the stored storage quota as it is.
            if "max_storage_bytes" in type(update).model_fields:
                record.max_storage_bytes = update.max_storage_bytes
            record.updated_at = utcnow()
        return self.quota(tenant_id)

    def check_spend(self, tenant_id: str, *, storage: bool = True) -> None:
        """Raise SpendCapReached when the tenant has used up its device-seconds, and (unless
        `storage=False`, for calls that write no checkpoint) StorageQuotaReached when its
        checkpoints take its whole storage quota. A tenant of a fork line (an owner with forks, or
        a fork) is also held to the owner's quotas over the whole line, so a fork made before its
        source reached a quota stops with it."""
        owner, line = self.fork_line(tenant_id)
        checks = [(tenant_id, [tenant_id])] + ([(owner, line)] if len(line) > 1 else [])
        for quota_of, members in checks:
            cap = self.quota(quota_of).max_device_seconds
            if cap is None:
                continue
            spent = sum(self.device_seconds(member).total for member in members)
            if spent >= cap:
                whose = _whose(tenant_id, quota_of, members)
                raise SpendCapReached(
                    f"{whose} has spent {spent:.3f} of {cap:g} device-seconds (quota.max_device_seconds); "
                    "no new work is admitted until an admin raises the quota"
                )
        if storage:
            for quota_of, members in checks:
                self._check_storage(tenant_id, quota_of, members)

    def check_storage(self, tenant_id: str) -> None:
        """Raise StorageQuotaReached when the tenant's checkpoint and dataset bytes reach its storage quota."""
        self._check_storage(tenant_id, tenant_id, [tenant_id])

    def _check_storage(self, tenant_id: str, quota_of: str, members: list[str]) -> None:
        allowed = self.max_storage_bytes(quota_of)
        if allowed is None:
            return  # no quota: no listing of the tenant's checkpoints either
        used = sum(self.storage_bytes(member) for member in members)
        if used >= allowed:
            raise StorageQuotaReached(
                f"{_whose(tenant_id, quota_of, members)} stores {used:,} bytes of checkpoints and datasets, at or "
                f"above the quota of {allowed:,} bytes (quota.max_storage_bytes); no new work is admitted until old "
                "checkpoints are pruned or deleted (or uploads or forks deleted), or an admin raises the quota"
            )

    # -- fork lines (issue 41.3) --------------------------------------------------------------
    def fork_line(self, tenant_id: str) -> tuple[str, list[str]]:
        """(the owner of the tenant's fork line, [owner, *its forks]); a tenant outside any line is
        its own owner, alone."""
        with self.store.read() as session:
            record = session.get(TenantForkRecord, tenant_id)
            owner = tenant_id if record is None else record.owner_tenant_id
            forks = session.scalars(
                select(TenantForkRecord.tenant_id).where(TenantForkRecord.owner_tenant_id == owner)
            ).all()
        return owner, [owner, *sorted(forks)]

    def forks(self, owner_tenant_id: str) -> list[dict[str, Any]]:
        """The forks the tenant owns (forks of its forks too), oldest first."""
        query = (
            select(TenantForkRecord)
            .where(TenantForkRecord.owner_tenant_id == owner_tenant_id)
            .order_by(TenantForkRecord.created_at, TenantForkRecord.tenant_id)
        )
        with self.store.read() as session:
            return [
                {
                    "tenant_id": r.tenant_id,
                    "source_tenant_id": r.source_tenant_id,
                    "source_version": r.source_version,
                    "created_at": r.created_at.timestamp(),
                }
                for r in session.scalars(query)
            ]

    def record_fork(self, tenant_id: str, source_tenant_id: str, source_version: int) -> str:
        """Record `tenant_id` as a fork of `source_tenant_id` with a copy of the source's own quota
        row (its limits, not the server defaults, which the fork gets anyway); returns the owner."""
        with self.store.transaction() as session:
            source_fork = session.get(TenantForkRecord, source_tenant_id)
            owner = source_tenant_id if source_fork is None else source_fork.owner_tenant_id
            session.add(
                TenantForkRecord(
                    tenant_id=tenant_id,
                    owner_tenant_id=owner,
                    source_tenant_id=source_tenant_id,
                    source_version=source_version,
                )
            )
            quota = session.get(TenantQuotaRecord, source_tenant_id)
            if quota is not None:
                session.merge(
                    TenantQuotaRecord(
                        tenant_id=tenant_id,
                        max_device_seconds=quota.max_device_seconds,
                        max_queued_workloads=quota.max_queued_workloads,
                        max_storage_bytes=quota.max_storage_bytes,
                    )
                )
        return owner

    # -- reading ------------------------------------------------------------------------------
    def device_seconds(self, tenant_id: str) -> DeviceSeconds:
        api = self._api_totals(tenant_id)
        jobs_seconds, _ = self._workload_training(tenant_id)
        training = api[TRAINING]["device_seconds"] + jobs_seconds
        inference = api[INFERENCE]["device_seconds"]
        return DeviceSeconds(training=training, inference=inference, total=training + inference)

    def summary(self, tenant_id: str, *, running: int = 0, queued: int = 0) -> Usage:
        api = self._api_totals(tenant_id)
        jobs_seconds, jobs_samples = self._workload_training(tenant_id)
        training = api[TRAINING]["device_seconds"] + jobs_seconds
        inference = api[INFERENCE]["device_seconds"]
        quota = self.quota(tenant_id)
        total = training + inference
        checkpoint_bytes, dataset_bytes = self.checkpoint_bytes(tenant_id), self.dataset_bytes(tenant_id)
        return Usage(
            tenant_id=tenant_id,
            device_seconds=DeviceSeconds(training=training, inference=inference, total=total),
            samples_trained=api[TRAINING]["samples"] + jobs_samples,
            samples_predicted=api[INFERENCE]["samples"],
            env_steps=api[ENVIRONMENT]["env_steps"],
            storage_bytes=checkpoint_bytes + dataset_bytes,
            dataset_bytes=dataset_bytes,
            workloads_running=running,
            workloads_queued=queued,
            quota=quota,
            remaining_device_seconds=None
            if quota.max_device_seconds is None
            else max(0.0, quota.max_device_seconds - total),
        )

    def storage_bytes(self, tenant_id: str) -> int:
        """What the storage quota counts: the tenant's checkpoint bytes plus its uploads' bytes."""
        return self.checkpoint_bytes(tenant_id) + self.dataset_bytes(tenant_id)

    def dataset_bytes(self, tenant_id: str) -> int:
        """Unpacked bytes of the datasets the tenant uploaded (0 without a datasets folder)."""
        return 0 if self.datasets_dir is None else tenant_dataset_bytes(self.datasets_dir, tenant_id)

    def checkpoint_bytes(self, tenant_id: str) -> int:
        if self.checkpoints is not None:
            return int(self.checkpoints.tenant_bytes(tenant_id))
        if self.checkpoint_root is None:  # deprecated path below: a local checkpoint folder
            return 0
        from joynexus.artifacts import CheckpointStore

        return CheckpointStore(Path(self.checkpoint_root)).tenant_bytes(tenant_id)

    def _api_totals(self, tenant_id: str) -> dict[str, dict[str, float]]:
        totals = {c: {"device_seconds": 0.0, "samples": 0, "env_steps": 0} for c in (TRAINING, INFERENCE, ENVIRONMENT)}
        query = (
            select(
                UsageRecord.category,
                func.sum(UsageRecord.device_seconds),
                func.sum(UsageRecord.samples),
                func.sum(UsageRecord.env_steps),
            )
            .where(UsageRecord.tenant_id == tenant_id)
            .group_by(UsageRecord.category)
        )
        with self.store.read() as session:
            for category, seconds, samples, steps in session.execute(query):
                totals.setdefault(category, {"device_seconds": 0.0, "samples": 0, "env_steps": 0})
                totals[category] = {
                    "device_seconds": float(seconds or 0.0),
                    "samples": int(samples or 0),
                    "env_steps": int(steps or 0),
                }
        return totals

    def _workload_training(self, tenant_id: str) -> tuple[float, int]:
        """(seconds, samples) of the tenant's completed training jobs, from their stored results."""
        query = select(TrainingJobRecord.result).where(
            TrainingJobRecord.tenant_id == tenant_id, TrainingJobRecord.state == "completed"
        )
        seconds, samples = 0.0, 0
        with self.store.read() as session:
            for (result,) in session.execute(query):
                if isinstance(result, dict):
                    seconds += float(result.get("seconds") or 0.0)
                    samples += int(result.get("samples") or 0)
        return seconds, samples


def _whose(tenant_id: str, quota_of: str, members: list[str]) -> str:
    """Who a refusal is about: the tenant alone, or its fork line under the owner's quota."""
    if members == [tenant_id]:
        return f"tenant {tenant_id!r}"
    return f"tenant {tenant_id!r}'s fork line (owner {quota_of!r} and its forks {members[1:]})"
