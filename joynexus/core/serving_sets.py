"""The serving set in the control-plane store: per tenant, the policy versions the Inference Model
Service serves and the one it pins a request without a version to (issue 26.7).

The service records its set after every change (`load_weights`, tenant removal), so the store
always says what clients were being served; the Master restores it on every restart path (the
service restarted in place, the Master restarted, a whole new deployment on the same store:
`master/serving_restore.py`), instead of serving whatever the training slot holds now.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, select

from joynexus.core.store import ControlPlaneStore, ServingSetRecord, utcnow


@dataclass(frozen=True)
class ServingSet:
    tenant_id: str
    versions: tuple[int, ...]  # ascending
    pinned_version: int | None  # what a request without a version is served by (the newest loaded)


class ServingSetStore:
    def __init__(self, store: ControlPlaneStore):
        self.store = store

    def record(self, tenant_id: str, versions: list[int]) -> ServingSet:
        """Replace the tenant's recorded set with `versions` (what the service holds now)."""
        ordered = sorted({int(v) for v in versions})
        pinned = ordered[-1] if ordered else None
        with self.store.transaction() as s:
            row = s.get(ServingSetRecord, tenant_id)
            if row is None:
                s.add(ServingSetRecord(tenant_id=tenant_id, versions=ordered, pinned_version=pinned))
            else:
                row.versions, row.pinned_version, row.updated_at = ordered, pinned, utcnow()
        return ServingSet(tenant_id, tuple(ordered), pinned)

    def forget(self, tenant_id: str) -> None:
        """The tenant is served nothing any more (deleted)."""
        with self.store.transaction() as s:
            s.execute(delete(ServingSetRecord).where(ServingSetRecord.tenant_id == tenant_id))

    def get(self, tenant_id: str) -> ServingSet | None:
        with self.store.read() as s:
            row = s.get(ServingSetRecord, tenant_id)
            return None if row is None else _serving_set(row)

    def all(self) -> dict[str, ServingSet]:
        with self.store.read() as s:
            return {row.tenant_id: _serving_set(row) for row in s.scalars(select(ServingSetRecord))}


def _serving_set(row: ServingSetRecord) -> ServingSet:
    return ServingSet(row.tenant_id, tuple(int(v) for v in row.versions), row.pinned_version)
