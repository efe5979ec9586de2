"""How the inference replica set makes its replicas (local objects or Ray actors) and adds up
their stats (`replicas.InferenceReplicaSet`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from joynexus.actors import named_actor
from joynexus.models.backbone import BackboneSource
from joynexus.services.inference.service import InferenceModelService
from joynexus.settings import RoleResources


class ReplicaFactory(Protocol):
    """Makes and stops replicas; picklable, so a Ray actor of the set can hold one."""

    def create(self, name: str) -> Any: ...

    def destroy(self, target: Any) -> None: ...


@dataclass(frozen=True)
class LocalReplicas:
    """Replicas as `InferenceModelService` objects of this process."""

    backbone_source: BackboneSource
    service_kwargs: dict[str, Any] = field(default_factory=dict)

    def create(self, name: str) -> InferenceModelService:
        return InferenceModelService(self.backbone_source, **self.service_kwargs)

    def destroy(self, target: Any) -> None:
        target.close()


@dataclass(frozen=True)
class RayReplicas:
    """Replicas as Ray actors owned by the process that creates them (the set's actor), placed by
    Ray with the `inference_service` role's resources."""

    backbone_source: BackboneSource
    namespace: str | None = None
    resources: RoleResources = field(default_factory=RoleResources)
    service_kwargs: dict[str, Any] = field(default_factory=dict)
    scheduling_strategy: str | None = None  # e.g. "SPREAD": one replica per node where they fit

    def create(self, name: str) -> Any:
        return named_actor(
            InferenceModelService,
            name,
            self.backbone_source,
            namespace=self.namespace,
            num_cpus=1,
            max_concurrency=64,
            ray_resources=self.resources,
            get_if_exists=False,
            scheduling_strategy=self.scheduling_strategy,
            **self.service_kwargs,
        )

    def destroy(self, target: Any) -> None:
        import ray

        ray.kill(target, no_restart=True)


def merge_histograms(snapshots: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Sum `BucketHistogram` snapshots with the same bounds (cumulative counts add up)."""
    present = [s for s in snapshots if s]
    if not present:
        return None
    buckets = [[bound, 0] for bound, _ in present[0]["buckets"]]
    for snapshot in present:
        for slot, (_, count) in zip(buckets, snapshot["buckets"], strict=True):
            slot[1] += count
    return {"buckets": buckets, "sum": sum(s["sum"] for s in present), "count": sum(s["count"] for s in present)}


def sum_known(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None
