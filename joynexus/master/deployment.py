"""Master Service: its wiring (paper section 4.1.1).

`Deployment` is what the Master Service runs on: the control plane (SQL store, Training Scheduler,
tenant creator), typed handles of the execution plane (Training Queue, Training Model Service,
Inference Model Service, Environment Service: named Ray actors, or local objects in one process),
the checkpoint store and MLflow. Clients never build one: they reach the Master through
`joynexus.connect`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from joynexus.actors import SerializedService, configure_placement, handle_of, init_ray, service_handle
from joynexus.artifacts import CheckpointStore
from joynexus.core.store import ControlPlaneStore
from joynexus.core.tenants import BackendCapabilities, BaseModelCapabilities
from joynexus.master.tenant_creator import TenantCreator
from joynexus.models.backbone import BackboneSource
from joynexus.models.placement import DevicePlacement
from joynexus.registry import ExperimentTracker
from joynexus.scheduling.training_queue import TrainingQueueClient, training_queue_actor
from joynexus.scheduling.training_scheduler import TrainingScheduler
from joynexus.services.environment.service import (
    EnvironmentPool,
    EnvironmentService,
    LocalEnvironmentWorkers,
    environment_pool_actor,
    environment_service_actor,
)
from joynexus.services.inference.replicas import InferenceReplicaSet, LocalReplicas, inference_replica_set_actor
from joynexus.services.inference.service import InferenceModelService, inference_service_actor
from joynexus.services.training.service import TrainingModelService, training_service_actor
from joynexus.settings import Settings

log = logging.getLogger(__name__)


_RESIDENT_ACTORS: list[Any] = []


@dataclass
class Deployment:
    settings: Settings
    store: ControlPlaneStore
    scheduler: TrainingScheduler
    queue: TrainingQueueClient
    training_service: TrainingModelService  # typed handles: a named Ray actor or a local object
    inference_service: InferenceModelService
    environment_service: EnvironmentService
    creator: TenantCreator
    tracker: ExperimentTracker
    checkpoints: CheckpointStore

    @classmethod
    def start(cls, settings: Settings | None = None, *, detached: bool = False) -> Deployment:
        """Connect to (or start) Ray and get-or-create the named service actors. Actors that are
        already running are reused as they are (no backbone reload). `detached=True` creates them
        with a detached lifetime, so they outlive this driver (`joynexus up`)."""
        settings = settings or Settings()
        queue_actor, service, inference, environment = create_service_actors(settings, detached=detached)
        queue = TrainingQueueClient(queue_actor)
        service = service_handle(TrainingModelService, service)
        inference = service_handle(InferenceModelService, inference)
        environment = service_handle(EnvironmentService, environment)
        caps = BaseModelCapabilities(**_capabilities_fields(service.capabilities()))
        store = ControlPlaneStore(settings.resolved_database_url())
        scheduler = TrainingScheduler(store, release_partition=queue.clear)
        creator = TenantCreator(
            store, scheduler, BackendCapabilities.single(caps), environment_probe=_probe(environment)
        )
        tracker = ExperimentTracker(settings.resolved_mlflow_uri(), artifact_location=_artifact_location(settings))
        checkpoints = CheckpointStore(_checkpoint_location(settings, in_process=True))
        return cls(settings, store, scheduler, queue, service, inference, environment, creator, tracker, checkpoints)

    @classmethod
    def in_process(cls, settings: Settings | None = None) -> Deployment:
        """The same deployment with every service a local object in this process (no Ray): for
        tests and for embedding the services in one process."""
        from joynexus.scheduling.training_queue import TrainingQueue

        settings = settings or Settings()
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        source = _backbone_source(settings)
        queue = TrainingQueue()
        checkpoints = _checkpoint_location(settings, in_process=True)
        local_training = TrainingModelService(
            source,
            checkpoints,
            queue=queue,
            num_threads=settings.torch_threads,
            keep_last=settings.checkpoint_keep_last,
            placement=DevicePlacement.from_settings(settings),
            max_resident_tenants=settings.max_resident_tenants,
            spill_dir=settings.resolved_spill_dir,
            max_active_tenants=settings.max_active_tenants,
        )
        # One call at a time, like an actor: the actor loop and API handlers call it from many threads.
        service = service_handle(TrainingModelService, SerializedService(local_training))
        database_url = settings.resolved_database_url()  # the services meter usage into the store
        inference = _local_inference(settings, source, database_url)
        environment = _local_environment(settings, database_url)
        store = ControlPlaneStore(settings.resolved_database_url())
        scheduler = TrainingScheduler(store, release_partition=queue.clear)
        creator = TenantCreator(
            store, scheduler, BackendCapabilities.single(service.capabilities()), environment_probe=_probe(environment)
        )
        tracker = ExperimentTracker(settings.resolved_mlflow_uri(), artifact_location=_artifact_location(settings))
        return cls(
            settings, store, scheduler, TrainingQueueClient(queue), service,
            service_handle(InferenceModelService, inference), service_handle(EnvironmentService, environment),
            creator, tracker, CheckpointStore(checkpoints),
        )  # fmt: skip

    def shutdown(self) -> None:
        self.environment_service.close_all()  # simulator worker processes never outlive us
        if not handle_of(self.inference_service).is_remote:
            self.inference_service.close()  # stop the local batching worker; a Ray actor goes with its cluster
        self.store.dispose()


def create_service_actors(settings: Settings, *, detached: bool = False) -> tuple[Any, Any, Any, Any]:
    """Connect to (or start) Ray and get-or-create the named execution-plane actors: Training
    Queue, Training Model Service, Inference Model Service, Environment Service (raw actor handles).
    Running actors are reused as they are (no backbone reload)."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = _checkpoint_location(settings, in_process=False)  # before Ray starts: see there
    init_ray(settings.ray_address)
    configure_placement(settings.resources)  # each role's Ray resources, for the actors made below
    queue = training_queue_actor(namespace=settings.ray_namespace, detached=detached)
    source = _backbone_source(settings)
    service = training_service_actor(
        source,
        checkpoints,
        queue,
        num_threads=settings.torch_threads,
        namespace=settings.ray_namespace,
        detached=detached,
        keep_last=settings.checkpoint_keep_last,
        placement=DevicePlacement.from_settings(settings),  # resolved in the actor's process
        max_resident_tenants=settings.max_resident_tenants,
        spill_dir=str(settings.resolved_spill_dir),
        max_active_tenants=settings.max_active_tenants,
    )
    if settings.inference_scaling.max_replicas > 1:  # replicas behind one front (issue 12)
        inference = inference_replica_set_actor(
            source,
            settings.inference_scaling,
            namespace=settings.ray_namespace,
            detached=detached,
            replica_resources=settings.resources.get("inference_service"),
            num_threads=settings.torch_threads,
            database_url=settings.resolved_database_url(),
            placement=DevicePlacement.from_settings(settings),
            max_resident_serving=settings.max_resident_serving,
            spill_dir=str(settings.resolved_spill_dir),
        )
    else:
        inference = inference_service_actor(
            source,
            num_threads=settings.torch_threads,
            namespace=settings.ray_namespace,
            detached=detached,
            database_url=settings.resolved_database_url(),
            placement=DevicePlacement.from_settings(settings),
            max_resident_serving=settings.max_resident_serving,
            spill_dir=str(settings.resolved_spill_dir),
        )
    if settings.environment_workers > 1:  # sessions spread over worker actors Ray places
        environment = environment_pool_actor(
            settings.environment_workers,
            namespace=settings.ray_namespace,
            detached=detached,
            database_url=settings.resolved_database_url(),
            worker_resources=settings.resources.get("environment_worker"),
        )
    else:
        environment = environment_service_actor(
            namespace=settings.ray_namespace, detached=detached, database_url=settings.resolved_database_url()
        )
    # A non-detached actor is destroyed once the handle that created it goes away (handles got by
    # name do not count). Keep every handle for the life of this driver, so a later call in this
    # process reuses the running services instead of catching them in teardown.
    _RESIDENT_ACTORS.extend((queue, service, inference, environment))
    return queue, service, inference, environment


def _local_inference(settings: Settings, source: BackboneSource, database_url: str) -> Any:
    """The Inference Model Service in this process: one, or a replica set of them (issue 12)."""
    kwargs = {
        "num_threads": settings.torch_threads,
        "database_url": database_url,
        "placement": DevicePlacement.from_settings(settings),
        "max_resident_serving": settings.max_resident_serving,
        "spill_dir": settings.resolved_spill_dir,
    }
    if settings.inference_scaling.max_replicas > 1:
        return InferenceReplicaSet(LocalReplicas(source, kwargs), policy=settings.inference_scaling)
    return InferenceModelService(source, **kwargs)


def _local_environment(settings: Settings, database_url: str) -> Any:
    """The Environment Service in this process: one, or a pool of workers (issue 12)."""
    if settings.environment_workers > 1:
        workers = LocalEnvironmentWorkers({"database_url": database_url})
        return EnvironmentPool(workers, workers=settings.environment_workers)
    return EnvironmentService(database_url=database_url)


def _probe(environment: Any) -> Any:
    """Ask the Environment Service what a simulator config produces (a short-lived session)."""

    def probe(config: dict[str, Any]) -> dict[str, Any]:
        session = environment.open_session("joynexus-probe", "spec-check", config)
        try:
            return environment.spec("joynexus-probe", session)
        finally:
            environment.close("joynexus-probe", session)

    return probe


def _backbone_source(settings: Settings) -> BackboneSource:
    if settings.backbone_path:
        return BackboneSource(preset=None, path=settings.backbone_path)
    return BackboneSource(preset=settings.backbone_preset)


def _capabilities_fields(caps: Any) -> dict[str, Any]:
    return {name: getattr(caps, name) for name in BaseModelCapabilities.__dataclass_fields__}


def _checkpoint_location(settings: Settings, *, in_process: bool) -> Any:
    """The Training Model Service's checkpoint root: the local folder, or with a bucket an S3 store
    (in process) / an s3:// URI (a Ray actor receives a string and builds the store itself, taking
    the endpoint from JOYNEXUS_S3_ENDPOINT_URL in its environment: exported here, a local Ray
    started by this process inherits it; a remote cluster's nodes must set it)."""
    if not settings.s3_bucket:
        return settings.checkpoint_root
    from joynexus.artifacts.s3 import ENDPOINT_ENV, S3BlobStore

    if in_process:
        return S3BlobStore.from_uri(settings.checkpoint_location, endpoint_url=settings.s3_endpoint_url)
    if settings.s3_endpoint_url:
        os.environ.setdefault(ENDPOINT_ENV, settings.s3_endpoint_url)
    return settings.checkpoint_location


def _artifact_location(settings: Settings) -> str | None:
    if settings.mlflow_artifact_location:  # an S3 bucket is configured: MLflow artifacts go there too
        from joynexus.artifacts.s3 import configure_mlflow_s3

        configure_mlflow_s3(settings.s3_endpoint_url)
        return settings.mlflow_artifact_location
    if settings.mlflow_tracking_uri:
        return None  # a tracking server decides where artifacts live
    return (settings.data_dir / "mlflow" / "artifacts").resolve().as_uri()
