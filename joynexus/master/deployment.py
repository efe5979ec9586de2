"""Master Service: its wiring (paper section 4.1.1).

`Deployment` is what the Master Service runs on: the control plane (SQL store, Training Scheduler,
tenant creator), typed handles of the execution plane (Training Queue, Training Model Service,
Inference Model Service, Environment Service: named Ray actors, or local objects in one process),
the checkpoint store and MLflow. Clients never build one: they reach the Master through
`joynexus.connect`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from joynexus.actors import (
    EXECUTION_PLANE_ACTORS,
    SerializedService,
    configure_placement,
    handle_of,
    init_ray,
    service_handle,
)
from joynexus.artifacts import CheckpointStore
from joynexus.artifacts.checkpoints import checkpoint_store
from joynexus.artifacts.s3 import export_endpoint
from joynexus.core.store import ControlPlaneStore
from joynexus.core.tenants import BackendCapabilities, BaseModelCapabilities, TenantBackendConfig
from joynexus.master.tenant_creator import TenantCreator
from joynexus.registry import ExperimentTracker, tracker_from_settings
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import TrainingScheduler
from joynexus.services.producers.front import ProducerFront
from joynexus.settings import Settings

if TYPE_CHECKING:  # the Master imports this module: it must not import the services (torch, transformers)
    from joynexus.services.environment.service import EnvironmentService
    from joynexus.services.inference.endpoint import InferenceEndpoint
    from joynexus.services.producers.service import ProducerService
    from joynexus.services.training.service import TrainingModelService

log = logging.getLogger(__name__)

# The execution plane's named actors, in the order `create_service_actors` returns them.
SERVICE_ACTORS = EXECUTION_PLANE_ACTORS
PRODUCER_ACTOR_PREFIX = "joynexus.producers"  # replica i: "joynexus.producers-<i>" (services/producers/service.py)


_RESIDENT_ACTORS: list[Any] = []


@dataclass
class Deployment:
    settings: Settings
    store: ControlPlaneStore
    scheduler: TrainingScheduler
    queue: TrainingQueue
    training_service: TrainingModelService  # typed handles: a named Ray actor or a local object
    inference_service: InferenceEndpoint  # one service or its replica set (`services/inference/endpoint.py`)
    environment_service: EnvironmentService
    creator: TenantCreator
    tracker: ExperimentTracker
    checkpoints: CheckpointStore
    # The producer replicas' front (issue 40): where every data loop and weight move runs. Set by
    # `start` / `in_process` once the control plane exists (the local replicas share it).
    producers: ProducerFront | None = None

    @classmethod
    def start(cls, settings: Settings | None = None, *, detached: bool = False) -> Deployment:
        """Connect to (or start) Ray and get-or-create the named service actors. Actors that are
        already running are reused as they are (no backbone reload). `detached=True` creates them
        with a detached lifetime, so they outlive this driver (`joynexus up`)."""
        settings = settings or Settings()
        queue_actor, service, inference, environment = create_service_actors(settings, detached=detached)
        # Typed as the service classes (TYPE_CHECKING imports): the handles need only the actors.
        deployment = cls._assemble(
            settings,
            service_handle(TrainingQueue, queue_actor),
            service_handle(cast("type[TrainingModelService]", object), service),
            service_handle(cast("type[InferenceEndpoint]", object), inference),
            service_handle(cast("type[EnvironmentService]", object), environment),
        )
        replicas = running_producer_actors(settings)
        front = ProducerFront([service_handle(cast("type[ProducerService]", object), replica) for replica in replicas])
        deployment.producers = front
        # Specs compile on a producer replica: the compiler builds modules on torch's meta device and
        # reads datasets, and this Master imports neither stack (issue 40).
        deployment.creator.compile = lambda spec: TenantBackendConfig.model_validate(
            front.compile_tenant(spec.tenant, spec.model_dump(mode="json"))
        )
        return deployment

    @classmethod
    def in_process(cls, settings: Settings | None = None) -> Deployment:
        """The same deployment with every service a local object in this process (no Ray): for
        tests and for embedding the services in one process."""
        from joynexus.services.configs import (
            EnvironmentServiceConfig,
            InferenceServiceConfig,
            ProducerServiceConfig,
            TrainingQueueConfig,
            TrainingServiceConfig,
        )
        from joynexus.services.environment.service import EnvironmentService
        from joynexus.services.inference.service import InferenceModelService
        from joynexus.services.producers.context import SharedContext
        from joynexus.services.training.service import TrainingModelService

        settings = settings or Settings()
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        queue = TrainingQueueConfig().build()
        training_config = TrainingServiceConfig.from_settings(settings)
        if training_config.data_parallel > 1:
            raise ValueError(
                f"training_data_parallel: {training_config.data_parallel} ranks need a Ray deployment (each rank is "
                "its own process); an in-process deployment runs one device (JOYNEXUS_TRAINING_DATA_PARALLEL=1)"
            )
        # One call at a time, like an actor: the actor loop and API handlers call it from many threads.
        training: Any = SerializedService(training_config.build(queue))
        if training_config.shards > 1:  # M shards, each its own backbone (issue 45)
            others = [SerializedService(training_config.build(queue)) for _ in range(training_config.shards - 1)]
            training = training_config.shard_set([training, *others])
        deployment = cls._assemble(
            settings,
            service_handle(TrainingQueue, queue),
            service_handle(TrainingModelService, training),
            service_handle(InferenceModelService, InferenceServiceConfig.from_settings(settings).build()),
            service_handle(EnvironmentService, EnvironmentServiceConfig.from_settings(settings).build()),
        )
        # The same replicas as in a Ray deployment, over this process's store, scheduler and handles.
        deployment.producers = ProducerServiceConfig.from_settings(settings).build(SharedContext(deployment))
        return deployment

    @classmethod
    def _assemble(
        cls,
        settings: Settings,
        queue: TrainingQueue,
        training: TrainingModelService,
        inference: InferenceEndpoint,
        environment: EnvironmentService,
    ) -> Deployment:
        """The control plane over the execution plane's handles."""
        caps = BaseModelCapabilities(**_capabilities_fields(training.capabilities()))
        store = ControlPlaneStore(settings.resolved_database_url())
        scheduler = TrainingScheduler(store, release_partition=queue.clear)
        creator = TenantCreator(
            store, scheduler, BackendCapabilities.single(caps), environment_probe=_probe(environment)
        )
        tracker = tracker_from_settings(settings)
        return cls(
            settings, store, scheduler, queue, training, inference, environment, creator, tracker,
            checkpoint_store(settings),
        )  # fmt: skip

    def shutdown(self) -> None:
        for replica in self.producers.replicas if self.producers is not None else ():
            handle_of(replica).close_here()  # local replicas stop their loops with us
        self.environment_service.close_all()  # simulator worker processes never outlive us
        handle_of(self.inference_service).close_here()  # the local batching worker; an actor goes with its cluster
        self.store.dispose()


def create_service_actors(settings: Settings, *, detached: bool = False) -> tuple[Any, Any, Any, Any]:
    """Connect to (or start) Ray and get-or-create the named execution-plane actors: Training
    Queue, Training Model Service, Inference Model Service, Environment Service (raw actor handles).
    Running actors are reused as they are (no backbone reload).

    When all four run (the Master of a deployment `joynexus up` made, a Master restarted in place)
    they are only looked up by name: the service classes, torch and transformers are imported only
    to create a missing one, so a process that never runs a model stays light."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    # Before Ray starts: a local Ray inherits it.
    export_endpoint(settings.checkpoint_location, settings.s3_endpoint_url)
    init_ray(settings.ray_address)
    running = _running_service_actors(settings.ray_namespace)
    if running is not None:
        _ensure_producer_actors(settings, detached=detached)
        return running
    from joynexus.services.configs import (
        EnvironmentServiceConfig,
        InferenceServiceConfig,
        TrainingQueueConfig,
        TrainingServiceConfig,
    )

    configure_placement(settings.resources)  # each role's Ray resources, for the actors made below
    where = {"namespace": settings.ray_namespace, "detached": detached}
    queue = TrainingQueueConfig().actor(**where)
    training_config = TrainingServiceConfig.from_settings(settings)
    if training_config.shards > 1:  # M shard actors on one placement group, one tenant-keyed set (issue 45)
        service = training_config.shard_set(training_config.shard_actors(queue, **where))
    else:
        service = training_config.actor(queue, **where)
    inference = InferenceServiceConfig.from_settings(settings).actor(**where)
    environment = EnvironmentServiceConfig.from_settings(settings).actor(**where)
    # A non-detached actor is destroyed once the handle that created it goes away (handles got by
    # name do not count). Keep every handle for the life of this driver, so a later call in this
    # process reuses the running services instead of catching them in teardown.
    _RESIDENT_ACTORS.extend((queue, service, inference, environment))
    _ensure_producer_actors(settings, detached=detached)
    return queue, service, inference, environment


def _ensure_producer_actors(settings: Settings, *, detached: bool) -> None:
    """Create the producer replicas that are missing (after the services they look up by name).
    Their class is imported only then: a Master that finds them running stays light."""
    if running_producer_actors(settings, missing_ok=True):
        return
    from joynexus.services.configs import ProducerServiceConfig

    configure_placement(settings.resources)
    replicas = ProducerServiceConfig.from_settings(settings).actors(namespace=settings.ray_namespace, detached=detached)
    _RESIDENT_ACTORS.extend(replicas)


def running_producer_actors(settings: Settings, *, missing_ok: bool = False) -> list[Any]:
    """The producer replicas by name (`joynexus.producers-<i>`, i < settings.producer_replicas);
    with `missing_ok`, [] when any is missing (else ValueError naming it)."""
    import ray

    found = []
    for i in range(settings.producer_replicas):
        name = f"{PRODUCER_ACTOR_PREFIX}-{i}"
        try:
            found.append(ray.get_actor(name, namespace=settings.ray_namespace))
        except ValueError:
            if missing_ok:
                return []
            raise ValueError(f"producer replica {name} is not running (namespace {settings.ray_namespace})") from None
    return found


def _running_service_actors(namespace: str | None) -> tuple[Any, Any, Any, Any] | None:
    """The four execution-plane actors by name (Ray initialized), or None if any is missing. A
    lookup loads only the actor's stand-in class (`actors.ActorShell`), not the service's module."""
    import ray

    found = []
    for name in SERVICE_ACTORS:
        try:
            found.append(ray.get_actor(name, namespace=namespace))
        except ValueError:
            return None
    queue, training, inference, environment = found
    return queue, training, inference, environment


def _probe(environment: Any) -> Any:
    """Ask the Environment Service what a simulator config produces (a short-lived session)."""

    def probe(config: dict[str, Any]) -> dict[str, Any]:
        session = environment.open_session("joynexus-probe", "spec-check", config)
        try:
            return environment.spec("joynexus-probe", session)
        finally:
            environment.close("joynexus-probe", session)

    return probe


def _capabilities_fields(caps: Any) -> dict[str, Any]:
    return {name: getattr(caps, name) for name in BaseModelCapabilities.__dataclass_fields__}
