"""What a producer replica works with: the control-plane store and the Training Scheduler over it
(leases are compare-and-set rows, safe across processes), typed handles of the Training Queue and
the Training / Inference / Environment services, the checkpoint store and MLflow.

In one process (tests, `--services in-process`) the replicas share the Master's own objects; as Ray
actors (`ProducerServiceConfig.actor`) each replica builds its own from the settings and looks the
services up by name (`from_settings`): the same `ProducerService` code runs over both."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from joynexus.actors import ROLE_OF_ACTOR, running_actor, service_handle
from joynexus.artifacts import CheckpointStore
from joynexus.artifacts.checkpoints import checkpoint_store
from joynexus.core.store import ControlPlaneStore, TenantRecord
from joynexus.core.tenants import Tenant, tenant_of
from joynexus.registry import ExperimentTracker, tracker_from_settings
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import TrainingScheduler
from joynexus.services.inference.router import inference_endpoint
from joynexus.settings import Settings

if TYPE_CHECKING:  # names the types only: the replica builds no model at import
    from joynexus.services.environment.sessions import EnvironmentService
    from joynexus.services.inference.endpoint import InferenceEndpoint
    from joynexus.services.training.service import TrainingModelService

_TRACKER_LOCK = threading.Lock()


@dataclass
class ProducerContext:
    settings: Settings
    store: ControlPlaneStore
    scheduler: TrainingScheduler
    queue: TrainingQueue
    training_service: TrainingModelService
    inference_service: InferenceEndpoint
    environment_service: EnvironmentService
    checkpoints: CheckpointStore
    # None until first used: a replica that opened MLflow at start would race the Master's first
    # open of a fresh embedded database (both migrating it at once).
    tracker_: ExperimentTracker | None = None

    @property
    def tracker(self) -> ExperimentTracker:
        with _TRACKER_LOCK:
            if self.tracker_ is None:
                self.tracker_ = tracker_from_settings(self.settings)
            return self.tracker_

    @classmethod
    def from_settings(cls, settings: Settings) -> ProducerContext:
        """A replica's own context in its Ray process: the services by name (never created here)."""
        names = {role: name for name, role in ROLE_OF_ACTOR.items()}

        def lookup(role: str) -> Any:
            return running_actor(names[role], settings.ray_namespace, role)

        queue = service_handle(TrainingQueue, lookup("training_queue"))
        store = ControlPlaneStore(settings.resolved_database_url())
        return cls(
            settings=settings,
            store=store,
            scheduler=TrainingScheduler(store, release_partition=queue.clear),
            queue=queue,
            training_service=_training_service(settings, lookup),
            inference_service=service_handle(
                cast("type[InferenceEndpoint]", object),
                inference_endpoint(  # with replicas: rollouts' requests go straight to the tenant's replicas
                    lookup("inference_service"),
                    replicated=settings.inference_scaling.max_replicas > 1,
                    namespace=settings.ray_namespace,
                ),
            ),
            environment_service=service_handle(cast("type[EnvironmentService]", object), lookup("environment_service")),
            checkpoints=checkpoint_store(settings),
        )

    def tenant(self, tenant_id: str) -> Tenant:
        """The tenant as its row says now (KeyError when it is gone)."""
        with self.store.read() as s:
            record = s.get(TenantRecord, tenant_id)
            if record is None:
                raise KeyError(tenant_id)
            return tenant_of(record)


class SharedContext(ProducerContext):
    """In one process: the Master's own objects (`master.deployment.Deployment`), read at every use,
    so a service replaced under the deployment (restarted in place) is the one the replicas call."""

    _FIELDS = frozenset(
        ("settings", "store", "scheduler", "queue", "training_service", "inference_service",
         "environment_service", "checkpoints", "tracker")
    )  # fmt: skip

    def __init__(self, source: Any):  # noqa: D107 - not the dataclass's: every field is the source's
        object.__setattr__(self, "_source", source)

    def __getattribute__(self, name: str) -> Any:
        if name in SharedContext._FIELDS:
            return getattr(object.__getattribute__(self, "_source"), name)
        return object.__getattribute__(self, name)


def _training_service(settings: Settings, lookup: Callable[[str], Any]) -> TrainingModelService:
    """The Training Model Service by name; with M shards (issue 45) a router over the shard actors
    that sends each tenant's call to its shard (`TrainingShardRouter`)."""
    if settings.training_shards <= 1:
        return service_handle(cast("type[TrainingModelService]", object), lookup("training_service"))
    from joynexus.services.training.shard_router import TrainingShardRouter, shard_actor_name

    shards = [
        running_actor(shard_actor_name(i), settings.ray_namespace, "training_service")
        for i in range(settings.training_shards)
    ]
    return cast("TrainingModelService", TrainingShardRouter(shards))
