"""Lower-layer Training Queue partitions of the caller's tenant: put (append, or write derived
fields back at given rows), get the next unconsumed samples, describe, list, clear. A tenant's
partitions live under `api/<tenant>/` and are bounded in number and bytes."""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from joynexus.api.errors import InvalidInput, NotFound, QuotaExceeded
from joynexus.api.gateway.directory import TenantDirectory
from joynexus.api.gateway.limits import ApiLimits
from joynexus.api.gateway.service_errors import cause_of
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import Tensor
from joynexus.scheduling.training_queue import BatchMeta, TrainingQueueError, UnknownPartition

if TYPE_CHECKING:
    from joynexus.scheduling.training_queue import TrainingQueue

PARTITION_PREFIX = "api"


class TenantQueues:
    """The tenants' own partitions of the Training Queue, with the bytes each tenant put per
    partition (its byte bound) and one lock per tenant (a put's bound check and write are one step)."""

    def __init__(self, queue: TrainingQueue, directory: TenantDirectory, limits: ApiLimits):
        self._queue, self._directory, self._limits = queue, directory, limits
        self._lock = threading.Lock()
        self._bytes: dict[str, dict[str, int]] = {}  # per tenant: bytes put per partition name
        self._tenant_locks: dict[str, threading.Lock] = {}

    def _tenant_lock(self, tenant_id: str) -> threading.Lock:
        with self._lock:
            return self._tenant_locks.setdefault(tenant_id, threading.Lock())

    def forget_tenant(self, tenant_id: str) -> None:
        """A deleted tenant's byte counts go with it (the Master removed its partitions)."""
        with self._lock:
            self._bytes.pop(tenant_id, None)

    def _partition_id(self, tenant_id: str, name: str) -> str:
        if not re.fullmatch(s.PARTITION_NAME_PATTERN, name):
            raise InvalidInput("partition", f"{name!r} must match {s.PARTITION_NAME_PATTERN}")
        return f"{PARTITION_PREFIX}/{tenant_id}/{name}"

    def _own_partition(self, tenant_id: str, name: str) -> str:
        partition_id = self._partition_id(tenant_id, name)
        if not self._queue.has_partition(partition_id):
            raise NotFound("partition", name, "partition")
        return partition_id

    def put(self, tenant_id: str, name: str, request: s.QueuePut) -> s.PartitionInfo:
        self._directory.tenant(tenant_id)
        partition_id = self._partition_id(tenant_id, name)
        data, nbytes = self._columns_in(request.columns)
        rows = {key: len(col) for key, col in data.items()}
        if len(set(rows.values())) != 1:
            raise InvalidInput("columns", f"every column needs the same number of rows, got {rows}")
        metadata = None
        if request.indices is not None:
            info = self._describe(tenant_id, name)
            self._check_indices(request.indices, next(iter(rows.values())), info["num_samples"])
            metadata = BatchMeta(partition_id, request.task_name, tuple(request.indices), tuple(data))
        with self._tenant_lock(tenant_id):
            owned = self._bytes.setdefault(tenant_id, {})
            if name not in owned and metadata is None:
                existing = self._list_partition_ids(tenant_id)
                if len(existing) >= self._limits.max_partitions_per_tenant and partition_id not in existing:
                    raise QuotaExceeded(
                        f"your tenant already holds {len(existing)} partitions (limit "
                        f"{self._limits.max_partitions_per_tenant}); clear some first",
                        [("partition", "too many partitions")],
                    )
            if sum(owned.values()) + nbytes > self._limits.max_queue_bytes_per_tenant:
                raise QuotaExceeded(
                    f"this put would make your tenant's Training Queue data {sum(owned.values()) + nbytes} bytes, "
                    f"over the limit of {self._limits.max_queue_bytes_per_tenant}; clear consumed partitions first",
                    [("columns", "queue byte limit")],
                )
            try:
                self._queue.put(partition_id, data, metadata)
            except Exception as error:
                cause = cause_of(error)
                if isinstance(cause, TrainingQueueError | ValueError | TypeError):  # e.g. rows that do not fit
                    raise InvalidInput("columns", _strip_partition(str(cause), partition_id, name)) from None
                raise
            owned[name] = owned.get(name, 0) + nbytes
        return self.describe_partition(tenant_id, name)

    @staticmethod
    def _check_indices(indices: list[int], rows: int, num_samples: int) -> None:
        if len(indices) != rows:
            raise InvalidInput("indices", f"{len(indices)} indices for {rows} rows")
        if len(set(indices)) != len(indices):
            raise InvalidInput("indices", "indices must be unique")
        bad = [i for i in indices if not 0 <= i < num_samples]
        if bad:
            raise InvalidInput("indices", f"{bad[:5]} out of range: the partition holds {num_samples} samples")

    def get(self, tenant_id: str, name: str, request: s.QueueGet) -> s.QueueBatch:
        self._directory.tenant(tenant_id)
        partition_id = self._own_partition(tenant_id, name)
        try:
            queue = self._queue
            meta = queue.get_meta(partition_id, request.fields, request.batch_size, request.task_name)
            data = {} if meta is None else queue.get_data(meta)
        except Exception as error:
            cause = cause_of(error)
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

    def clear(self, tenant_id: str, name: str) -> s.Cleared:
        partition_id = self._own_partition(tenant_id, name)
        with self._tenant_lock(tenant_id):
            cleared = self._queue.clear(partition_id)
            self._bytes.get(tenant_id, {}).pop(name, None)
        return s.Cleared(cleared=bool(cleared))

    def _list_partition_ids(self, tenant_id: str) -> list[str]:
        prefix = f"{PARTITION_PREFIX}/{tenant_id}/"
        return [p for p in self._queue.partitions() if p.startswith(prefix)]

    def list_partitions(self, tenant_id: str) -> list[s.PartitionInfo]:
        prefix = f"{PARTITION_PREFIX}/{tenant_id}/"
        names = [p[len(prefix) :] for p in self._list_partition_ids(tenant_id)]
        infos = []
        for name in names:
            try:
                infos.append(self.describe_partition(tenant_id, name))
            except NotFound:  # cleared meanwhile
                continue
        return infos

    def _describe(self, tenant_id: str, name: str) -> dict[str, Any]:
        partition_id = self._partition_id(tenant_id, name)
        try:
            return self._queue.describe(partition_id)
        except Exception as error:
            if isinstance(cause_of(error), UnknownPartition | KeyError):
                raise NotFound("partition", name, "partition") from None
            raise

    def describe_partition(self, tenant_id: str, name: str) -> s.PartitionInfo:
        info = self._describe(tenant_id, name)
        nbytes = self._bytes.get(tenant_id, {}).get(name, 0)
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
                long = [i for i, text in enumerate(column) if len(text) > self._limits.max_string_chars]
                if long:
                    raise InvalidInput(
                        f"columns.{key}[{long[0]}]", f"longer than {self._limits.max_string_chars} chars"
                    )
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


def _strip_partition(message: str, partition_id: str, name: str) -> str:
    return message.replace(repr(partition_id), repr(name)).replace(partition_id, name)
