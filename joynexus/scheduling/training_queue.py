"""Training Queue (paper sections 4.2, A.2, A.5): the data plane of training jobs.

Partitions are keyed by the `partition_id` the Training Scheduler derives for each job. Data is
columnar: a partition holds fields (numpy arrays with one row per sample, or lists of strings) that
all share the sample axis. The two-step interface mirrors the paper: `get_meta` hands out the next
unconsumed sample indices for a named task, `get_data` returns the requested fields at those
indices, and `put(data, metadata=meta)` writes derived fields (advantages, returns, ...) back
against the same samples.

`TrainingQueue` is plain Python so its rules are unit-tested directly; in a deployment it runs as
one named Ray actor (`services.configs.TrainingQueueConfig.actor`) shared by producer, preprocessing and
actor processes.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

TRAINING_QUEUE_ACTOR_NAME = "joynexus.training_queue"

Column = np.ndarray | list


class TrainingQueueError(RuntimeError):
    pass


class UnknownPartition(TrainingQueueError, KeyError):
    def __init__(self, partition_id: str):
        super().__init__(f"no partition {partition_id!r} in the Training Queue (cleared or never written)")


@dataclass(frozen=True)
class BatchMeta:
    """Which samples of which partition a consumer task is reading; no tensors."""

    partition_id: str
    task_name: str
    indices: tuple[int, ...]
    fields: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.indices)


def _rows(column: Column) -> int:
    return len(column)


def _take(column: Column, indices: list[int]) -> Column:
    if isinstance(column, np.ndarray):
        return column[indices]
    return [column[i] for i in indices]


class _Partition:
    def __init__(self) -> None:
        self.fields: dict[str, Column] = {}
        self.num_samples = 0
        self.cursors: dict[str, int] = {}  # task_name -> next unconsumed sample index
        self.annotations: dict[str, Any] = {}


class TrainingQueue:
    def __init__(self) -> None:
        self._partitions: dict[str, _Partition] = {}
        # A restart in place (Ray) loses every partition: a new incarnation tells the Master's
        # Health Manager to release the jobs whose data went with it.
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = time.time()

    def heartbeat(self) -> dict[str, Any]:
        """Liveness answer (lock-free, in the actor's health group)."""
        return {
            "role": "training_queue",
            "incarnation": self.incarnation,
            "started_at": self.started_at,
            "pid": os.getpid(),
            "partitions": len(self._partitions),
        }

    # -- writes -----------------------------------------------------------------------------
    def put(
        self,
        partition_id: str,
        data: dict[str, Column],
        metadata: BatchMeta | None = None,
        annotations: dict[str, Any] | None = None,
    ) -> int:
        """Append samples (metadata=None) or write derived fields at `metadata.indices`.
        Returns the partition's sample count."""
        if not data:
            raise TrainingQueueError("put needs at least one field")
        rows = {name: _rows(col) for name, col in data.items()}
        if len(set(rows.values())) != 1:
            raise TrainingQueueError(f"fields of one put must have the same number of rows, got {rows}")
        n = next(iter(rows.values()))
        if metadata is not None:
            return self._write_derived(metadata, data, n)
        part = self._partitions.setdefault(partition_id, _Partition())
        if annotations:
            for key, value in annotations.items():
                if key in part.annotations and part.annotations[key] != value:
                    held = part.annotations[key]
                    raise TrainingQueueError(
                        f"partition {partition_id!r}: annotation {key!r} is {held!r}, put has {value!r}"
                    )
                part.annotations[key] = value
        if part.num_samples == 0 and not part.fields:
            part.fields = {name: _copy(col) for name, col in data.items()}
        else:
            if set(data) != set(part.fields):
                raise TrainingQueueError(
                    f"partition {partition_id!r}: appended fields {sorted(data)} differ from {sorted(part.fields)}"
                )
            for name, col in data.items():
                part.fields[name] = _concat(part.fields[name], col, name)
        part.num_samples += n
        return part.num_samples

    def _write_derived(self, meta: BatchMeta, data: dict[str, Column], n: int) -> int:
        part = self._get(meta.partition_id)
        if n != meta.size:
            raise TrainingQueueError(f"derived fields have {n} rows, metadata names {meta.size} samples")
        idx = list(meta.indices)
        for name, col in data.items():
            if name not in part.fields:
                if isinstance(col, np.ndarray):
                    full = np.zeros((part.num_samples, *col.shape[1:]), dtype=col.dtype)
                else:
                    full = [None] * part.num_samples
                part.fields[name] = full
            target = part.fields[name]
            if isinstance(target, np.ndarray):
                target[idx] = np.asarray(col, dtype=target.dtype)
            else:
                for i, value in zip(idx, col, strict=True):
                    target[i] = value
        return part.num_samples

    def clear(self, partition_id: str) -> bool:
        """Release a partition; idempotent (True if something was released)."""
        return self._partitions.pop(partition_id, None) is not None

    def clear_prefix(self, prefix: str) -> int:
        """Release every partition whose id starts with `prefix`; returns how many."""
        if not prefix:  # "" would match everything: never wipe the whole queue by accident
            raise TrainingQueueError("clear_prefix needs a non-empty prefix")
        victims = [pid for pid in self._partitions if pid.startswith(prefix)]
        for pid in victims:
            del self._partitions[pid]
        return len(victims)

    def clear_tenant(self, tenant_id: str) -> int:
        """Release every partition of a tenant; returns how many. Both kinds of partition id carry
        the tenant as their second segment: the API's `api/<tenant>/<name>` and the Training
        Scheduler's `<domain>/<tenant>/<task>/<job>` (`partition_id_for`)."""
        if not tenant_id or "/" in tenant_id:
            raise TrainingQueueError(f"clear_tenant: {tenant_id!r} is not a tenant id")
        victims = [pid for pid in self._partitions if _tenant_segment(pid) == tenant_id]
        for pid in victims:
            del self._partitions[pid]
        return len(victims)

    # -- reads ------------------------------------------------------------------------------
    def get_meta(
        self,
        partition_id: str,
        fields: list[str] | tuple[str, ...],
        batch_size: int,
        task_name: str = "train",
        order: list[int] | tuple[int, ...] | None = None,
    ) -> BatchMeta | None:
        """The next `batch_size` unconsumed samples for `task_name`, or None when exhausted.
        `order` (a permutation of the partition's sample indices) reads it in that order: a PPO
        epoch's shuffle, so its minibatches mix time steps and environments."""
        part = self._get(partition_id)
        missing = [f for f in fields if f not in part.fields]
        if missing:
            raise TrainingQueueError(f"partition {partition_id!r} has no fields {missing}; has {sorted(part.fields)}")
        if order is not None and sorted(int(i) for i in order) != list(range(part.num_samples)):
            raise TrainingQueueError(
                f"order: expected a permutation of the {part.num_samples} sample indices of {partition_id!r}"
            )
        start = part.cursors.get(task_name, 0)
        if start >= part.num_samples:
            return None
        stop = min(part.num_samples, start + batch_size)
        part.cursors[task_name] = stop
        indices = tuple(range(start, stop)) if order is None else tuple(int(i) for i in order[start:stop])
        return BatchMeta(partition_id, task_name, indices, tuple(fields))

    def get_data(self, meta: BatchMeta) -> dict[str, Column]:
        part = self._get(meta.partition_id)
        idx = list(meta.indices)
        return {name: _take(part.fields[name], idx) for name in meta.fields}

    def describe(self, partition_id: str) -> dict[str, Any]:
        part = self._get(partition_id)
        return {
            "num_samples": part.num_samples,
            "fields": sorted(part.fields),
            "annotations": dict(part.annotations),
            "cursors": dict(part.cursors),
        }

    def partitions(self) -> list[str]:
        return sorted(self._partitions)

    def has_partition(self, partition_id: str) -> bool:
        return partition_id in self._partitions

    def _get(self, partition_id: str) -> _Partition:
        part = self._partitions.get(partition_id)
        if part is None:
            raise UnknownPartition(partition_id)
        return part


def _tenant_segment(partition_id: str) -> str | None:
    parts = partition_id.split("/")
    return parts[1] if len(parts) >= 3 else None


def _copy(column: Column) -> Column:
    return np.array(column, copy=True) if isinstance(column, np.ndarray) else list(column)


def _concat(existing: Column, new: Column, name: str) -> Column:
    if isinstance(existing, np.ndarray):
        new = np.asarray(new)
        if new.shape[1:] != existing.shape[1:]:
            raise TrainingQueueError(f"field {name!r}: row shape {new.shape[1:]} differs from {existing.shape[1:]}")
        return np.concatenate([existing, new.astype(existing.dtype, copy=False)])
    return list(existing) + list(new)
