"""One construction object per execution-plane role (tinker-cookbook's config-that-builds habit).

Each config is read from the `Settings` once (`from_settings`) and makes its service either as an
object of this process (`build()`: tests, one-process embedding) or as the role's named Ray actor
(`actor()`: the service is then built inside the actor's process, where its device resolves). A new
service setting is one field here and one line in `from_settings`; `master/deployment.py` only wires
the configs together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from joynexus.actors import handle_of, named_actor, role_resources, service_handle
from joynexus.artifacts.s3 import export_endpoint
from joynexus.artifacts.stores import checkpoint_blobs
from joynexus.models.backbone import METADATA_FILE, BackboneSource
from joynexus.models.placement import DevicePlacement
from joynexus.scheduling.training_queue import TRAINING_QUEUE_ACTOR_NAME, TrainingQueue
from joynexus.services.environment.service import (
    ENVIRONMENT_SERVICE_ACTOR_NAME,
    EnvironmentPool,
    EnvironmentService,
    LocalEnvironmentWorkers,
    RayEnvironmentWorkers,
)
from joynexus.services.inference.replicas import InferenceReplicaSet, LocalReplicas, RayReplicas
from joynexus.services.inference.service import (
    DEFAULT_MAX_CHUNK_SAMPLES,
    DEFAULT_MAX_QUEUED_SAMPLES_PER_TENANT,
    INFERENCE_SERVICE_ACTOR_NAME,
    InferenceModelService,
)
from joynexus.services.producers.context import ProducerContext
from joynexus.services.producers.front import ProducerFront
from joynexus.services.producers.service import ProducerService, producer_actor_name
from joynexus.services.residency import DEFAULT_MAX_RESIDENT_SERVING, DEFAULT_MAX_RESIDENT_TENANTS
from joynexus.services.training.packing import DEFAULT_MAX_ACTIVE_TENANTS
from joynexus.services.training.service import TRAINING_SERVICE_ACTOR_NAME, TrainingModelService
from joynexus.services.training.shard_router import shard_actor_name
from joynexus.services.training.shards import TrainingShards
from joynexus.settings import RoleResources, ScalingPolicy, Settings, database_url_ref


def backbone_source(settings: Settings) -> BackboneSource:
    """The resident backbone the settings name: a local checkpoint directory, else a preset."""
    if settings.backbone_path:
        model_id = settings.backbone_id or directory_model_id(settings.backbone_path)
        return BackboneSource(preset=None, path=settings.backbone_path, model_id=model_id)
    return BackboneSource(
        preset=settings.backbone_preset,
        image_size=settings.backbone_image_size,
        feature_layers=settings.backbone_feature_layers,
    )


def directory_model_id(path: str | Path) -> str | None:
    """The id a plain checkpoint directory is served under when JOYNEXUS_BACKBONE_ID is unset and
    its config.json has no `_name_or_path` (transformers' save_pretrained writes none): the
    directory's own name (e.g. `SmolVLM-256M-Instruct`), which a tenant's base_model can say,
    instead of this server's absolute path (issue 41.11). None: the directory names its own id
    (JoyNexus metadata, or `_name_or_path`), or it is not readable (the loader says why)."""
    root = Path(path).expanduser()
    if (root / METADATA_FILE).is_file():
        return None
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name_or_path = config.get("_name_or_path") if isinstance(config, dict) else None
    if isinstance(name_or_path, str) and name_or_path:
        return None
    return root.resolve().name or None


@dataclass(frozen=True)
class TrainingQueueConfig:
    """The Training Queue: one call at a time (Ray's default actor concurrency), so partitions
    need no locks."""

    def build(self) -> TrainingQueue:
        return TrainingQueue()

    def actor(self, *, namespace: str | None = None, detached: bool = False) -> Any:
        return named_actor(TrainingQueue, TRAINING_QUEUE_ACTOR_NAME, namespace=namespace, detached=detached)


DATA_PARALLEL_FRONT_CPUS = 0.05  # the logical service's own actor (`DataParallelTrainingService`)


@dataclass(frozen=True)
class TrainingServiceConfig:
    """The Training Model Service: the resident backbone plus every tenant's training slot."""

    backbone: BackboneSource
    checkpoint_root: str  # a local folder or an s3:// URI (`Settings.checkpoint_location`)
    s3_endpoint_url: str | None = None
    num_threads: int = 1
    keep_last: int | None = None
    placement: DevicePlacement | None = None  # resolved in the process that builds the service
    max_resident_tenants: int = DEFAULT_MAX_RESIDENT_TENANTS
    spill_dir: str | None = None
    max_active_tenants: int = DEFAULT_MAX_ACTIVE_TENANTS
    shards: int = 1  # Training Model Service shards (`shard_actors`, `services.training.shards`)
    max_tenants_per_shard: int | None = None
    group_max: int = 8  # placement keeps up to this many group-compatible tenants on one shard
    data_parallel: int = 1  # ranks per service (`DataParallelTrainingService`; 1: one device)
    data_parallel_verify_every: int = 1

    @classmethod
    def from_settings(cls, settings: Settings) -> TrainingServiceConfig:
        return cls(
            backbone=backbone_source(settings),
            checkpoint_root=settings.checkpoint_location,
            s3_endpoint_url=settings.s3_endpoint_url,
            num_threads=settings.torch_threads,
            keep_last=settings.checkpoint_keep_last,
            placement=DevicePlacement.from_settings(settings),
            max_resident_tenants=settings.max_resident_tenants,
            spill_dir=str(settings.resolved_spill_dir),
            max_active_tenants=settings.max_active_tenants,
            shards=settings.training_shards,
            max_tenants_per_shard=settings.max_tenants_per_shard,
            group_max=settings.training_group_max,
            data_parallel=settings.training_data_parallel,
            data_parallel_verify_every=settings.training_data_parallel_verify_every,
        )

    def export_endpoint(self) -> None:
        """Export the s3:// root's endpoint for the actors (`artifacts.s3.export_endpoint`)."""
        export_endpoint(self.checkpoint_root, self.s3_endpoint_url)

    def _options(self) -> dict[str, Any]:
        return {
            "keep_last": self.keep_last,
            "placement": self.placement,
            "max_resident_tenants": self.max_resident_tenants,
            "spill_dir": self.spill_dir,
            "max_active_tenants": self.max_active_tenants,
        }

    def build(self, queue: Any) -> TrainingModelService:
        """The service in this process, reading partitions from `queue` (a TrainingQueue or its actor)."""
        blobs = checkpoint_blobs(self.checkpoint_root, self.s3_endpoint_url)
        return TrainingModelService(self.backbone, blobs, queue, self.num_threads, **self._options())

    def actor(self, queue: Any, *, namespace: str | None = None, detached: bool = False) -> Any:
        """Get or create the named actor; one call at a time, one CPU unless the role's resources say
        otherwise. The actor opens an s3:// root itself (`export_endpoint` first). With
        `data_parallel` K > 1 it is the logical service over K ranks on one placement group."""
        # By name, not the creating driver's handle: a restart in place after that driver
        # exited (`joynexus up`) looks the queue up again.
        queue_arg = handle_of(queue).constructor_argument(TRAINING_QUEUE_ACTOR_NAME, namespace)
        if self.data_parallel > 1:
            bundle, _ = self._bundle()
            group = self._placement_group("ranks", self.data_parallel, bundle, namespace, detached, 600.0)
            return self._data_parallel_actor(TRAINING_SERVICE_ACTOR_NAME, queue_arg, group, 0, namespace, detached)
        return named_actor(
            TrainingModelService,
            TRAINING_SERVICE_ACTOR_NAME,
            self.backbone,
            self.checkpoint_root,
            queue_arg,
            self.num_threads,
            namespace=namespace,
            detached=detached,
            num_cpus=1,
            **self._options(),
        )

    def _bundle(self) -> tuple[dict[str, float], RoleResources]:
        """One device's bundle: the training role's resources (`training_service`)."""
        resources = role_resources("training_service")
        bundle = {"CPU": 1.0 if resources.num_cpus is None else resources.num_cpus}
        if resources.num_gpus:
            bundle["GPU"] = resources.num_gpus
        bundle.update(resources.resources)
        placed = RoleResources(
            num_cpus=bundle["CPU"], num_gpus=resources.num_gpus, memory=resources.memory, resources=resources.resources
        )
        return bundle, placed

    @staticmethod
    def _placement_group(
        kind: str, bundles: int, bundle: dict[str, float], namespace: str | None, detached: bool, timeout_s: float
    ) -> Any:
        """The deployment's placement group of `bundles` device bundles (`kind`: "shards", "ranks"),
        reserved together before any backbone loads; a Master started again reuses the running one."""
        import ray
        from ray.util.placement_group import get_placement_group, placement_group

        name = f"{TRAINING_SERVICE_ACTOR_NAME}.{kind}.{namespace or 'default'}"
        try:
            group = get_placement_group(name)
        except ValueError:
            group = placement_group(
                [dict(bundle) for _ in range(bundles)],
                strategy="PACK",
                name=name,
                lifetime="detached" if detached else None,
            )
        if len(group.bundle_specs) != bundles:
            raise ValueError(
                f"training {kind}: placement group {name!r} has {len(group.bundle_specs)} bundles, the settings "
                f"ask for {bundles} (JOYNEXUS_TRAINING_SHARDS x JOYNEXUS_TRAINING_DATA_PARALLEL); "
                "remove it (`joynexus down`) first"
            )
        ray.get(group.ready(), timeout=timeout_s)
        return group

    def _data_parallel_actor(
        self, name: str, queue_arg: Any, group: Any, bundle_offset: int, namespace: str | None, detached: bool
    ) -> Any:
        """The logical service `name` over `data_parallel` ranks on bundles `bundle_offset`.. of
        `group`; the actor itself holds no backbone, its ranks hold the devices."""
        from joynexus.services.training.data_parallel import DataParallelTrainingService

        _, placed = self._bundle()
        return named_actor(
            DataParallelTrainingService,
            name,
            self.backbone,
            self.checkpoint_root,
            queue_arg,
            self.num_threads,
            namespace=namespace,
            detached=detached,
            # A sliver of CPU, no device: it is not placed on a head that offers no CPU (a head
            # restart would restart it too), and its ranks hold the devices.
            ray_resources=RoleResources(num_cpus=DATA_PARALLEL_FRONT_CPUS),
            world_size=self.data_parallel,
            rank_options=placed.ray_options(default_num_cpus=1),
            placement_group=group,
            bundle_offset=bundle_offset,
            verify_every=self.data_parallel_verify_every,
            **self._options(),
        )

    def shard_actors(
        self, queue: Any, *, namespace: str | None = None, detached: bool = False, ready_timeout_s: float = 600.0
    ) -> list[Any]:
        """The `shards` Training Model Service actors (`joynexus.training_service.shard-<i>`), shard i
        on bundle i of one placement group: each bundle is the role's resources (`training_service`:
        with `num_gpus` 1 every shard gets its own device), reserved together before any backbone
        loads, so M shards never start on fewer devices than they need. With `data_parallel` K > 1
        each shard is a logical service over K ranks, on bundles i*K .. i*K + K-1."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle, placed = self._bundle()
        ranks = self.data_parallel
        group = self._placement_group("shards", self.shards * ranks, bundle, namespace, detached, ready_timeout_s)
        queue_arg = handle_of(queue).constructor_argument(TRAINING_QUEUE_ACTOR_NAME, namespace)
        if ranks > 1:
            return [
                self._data_parallel_actor(shard_actor_name(i), queue_arg, group, i * ranks, namespace, detached)
                for i in range(self.shards)
            ]
        return [
            named_actor(
                TrainingModelService,
                shard_actor_name(i),
                self.backbone,
                self.checkpoint_root,
                queue_arg,
                self.num_threads,
                namespace=namespace,
                detached=detached,
                role="training_service",
                ray_resources=placed,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
                **self._options(),
            )
            for i in range(self.shards)
        ]

    @staticmethod
    def remove_shard_group(namespace: str | None = None) -> bool:
        """Release the shards' (and a data-parallel service's ranks') placement groups of the
        deployment in `namespace` (its actors gone); False if there is none."""
        from ray.util.placement_group import get_placement_group, remove_placement_group

        removed = False
        for kind in ("shards", "ranks"):
            try:
                group = get_placement_group(f"{TRAINING_SERVICE_ACTOR_NAME}.{kind}.{namespace or 'default'}")
            except ValueError:
                continue
            remove_placement_group(group)
            removed = True
        return removed

    def shard_set(self, shards: list[Any]) -> TrainingShards:
        """The shard set over `shard_actors`' actors (or local services): a lost shard is fenced
        (its actor killed for good) before its tenants resume elsewhere."""

        def fence(index: int) -> None:
            handle_of(shards[index]).kill(restart=False)  # an in-process shard has no process of its own

        shard_set = TrainingShards(
            shards, group_size=self.group_max, max_tenants_per_shard=self.max_tenants_per_shard, fence=fence
        )
        shard_set.adopt()  # running shards (a restarted Master): their slots stay where they are
        return shard_set


@dataclass(frozen=True)
class InferenceServiceConfig:
    """The Inference Model Service: one service, or with `scaling.max_replicas > 1` a replica set
    (its front, role `inference_router`, creates and owns the replicas, role `inference_service`)."""

    backbone: BackboneSource
    num_threads: int = 1
    database_url: str | None = None  # the store it meters inference usage into (None: no metering)
    placement: DevicePlacement | None = None
    max_resident_serving: int = DEFAULT_MAX_RESIDENT_SERVING
    spill_dir: str | None = None
    max_chunk_samples: int | None = DEFAULT_MAX_CHUNK_SAMPLES
    scaling: ScalingPolicy = field(default_factory=ScalingPolicy)
    replica_resources: RoleResources | None = None
    max_queued_samples_per_tenant: int | None = DEFAULT_MAX_QUEUED_SAMPLES_PER_TENANT

    @classmethod
    def from_settings(cls, settings: Settings) -> InferenceServiceConfig:
        return cls(
            backbone=backbone_source(settings),
            num_threads=settings.torch_threads,
            database_url=settings.resolved_database_url(),
            placement=DevicePlacement.from_settings(settings),
            max_resident_serving=settings.max_resident_serving,
            spill_dir=str(settings.resolved_spill_dir),
            scaling=settings.inference_scaling,
            replica_resources=settings.resources.get("inference_service"),
            max_queued_samples_per_tenant=settings.max_queued_samples_per_tenant,
        )

    @property
    def replicated(self) -> bool:
        return self.scaling.max_replicas > 1

    def service_options(self) -> dict[str, Any]:
        """The `InferenceModelService` keyword arguments (every replica gets the same)."""
        return {
            "num_threads": self.num_threads,
            "database_url": self.database_url,
            "max_chunk_samples": self.max_chunk_samples,
            "placement": self.placement,
            "max_resident_serving": self.max_resident_serving,
            "spill_dir": self.spill_dir,
            "max_queued_samples_per_tenant": self.max_queued_samples_per_tenant,
        }

    def actor_service_options(self) -> dict[str, Any]:
        """`service_options` as actor arguments: the database login by reference (`database_url_ref`)."""
        return {**self.service_options(), "database_url": database_url_ref(self.database_url)}

    def build(self) -> InferenceModelService | InferenceReplicaSet:
        if self.replicated:
            return InferenceReplicaSet(LocalReplicas(self.backbone, self.service_options()), policy=self.scaling)
        return InferenceModelService(self.backbone, **self.service_options())

    def actor(self, *, namespace: str | None = None, detached: bool = False) -> Any:
        """Get or create the named actor. A single service is threaded (many callers block in
        `predict` while its worker batches them); a replica set's front only routes (no CPU)."""
        if not self.replicated:
            return named_actor(
                InferenceModelService,
                INFERENCE_SERVICE_ACTOR_NAME,
                self.backbone,
                namespace=namespace,
                detached=detached,
                num_cpus=1,
                max_concurrency=64,
                **self.actor_service_options(),
            )
        replicas = RayReplicas(
            self.backbone,
            namespace=namespace,
            resources=self.replica_resources or RoleResources(),
            service_kwargs=self.actor_service_options(),
        )
        return named_actor(
            InferenceReplicaSet,
            INFERENCE_SERVICE_ACTOR_NAME,
            replicas,
            namespace=namespace,
            detached=detached,
            num_cpus=0,
            max_concurrency=256,
            role="inference_router",
            policy=self.scaling,
        )


@dataclass(frozen=True)
class EnvironmentServiceConfig:
    """The Environment Service: one service, or with `workers > 1` a pool whose front (role
    `environment_service`) creates and owns the worker actors (role `environment_worker`)."""

    database_url: str | None = None  # the store it meters environment steps into (None: no metering)
    workers: int = 1
    worker_resources: RoleResources | None = None
    service_options: dict[str, Any] = field(default_factory=dict)  # further EnvironmentService arguments
    warm_workers: int = 0  # closed sessions' workers kept for the same tenant and config (per service)
    warm_memory_mib: int = 4096  # ... together at most this resident

    @classmethod
    def from_settings(cls, settings: Settings) -> EnvironmentServiceConfig:
        return cls(
            database_url=settings.resolved_database_url(),
            workers=settings.environment_workers,
            worker_resources=settings.resources.get("environment_worker"),
            warm_workers=settings.environment_warm_workers,
            warm_memory_mib=settings.environment_warm_memory_mib,
        )

    def _service_kwargs(self) -> dict[str, Any]:
        return {
            "database_url": self.database_url,
            "warm_workers": self.warm_workers,
            "warm_memory_bytes": self.warm_memory_mib << 20,
            **self.service_options,
        }

    def _actor_service_kwargs(self) -> dict[str, Any]:
        return {**self._service_kwargs(), "database_url": database_url_ref(self.database_url)}

    def build(self) -> EnvironmentService | EnvironmentPool:
        if self.workers > 1:
            return EnvironmentPool(LocalEnvironmentWorkers(self._service_kwargs()), workers=self.workers)
        return EnvironmentService(**self._service_kwargs())

    def actor(self, *, namespace: str | None = None, detached: bool = False) -> Any:
        """Get or create the named actor: threaded (several tenants' calls side by side), no CPU of its
        own (the simulation runs in the session worker processes)."""
        if self.workers <= 1:
            return named_actor(
                EnvironmentService,
                ENVIRONMENT_SERVICE_ACTOR_NAME,
                namespace=namespace,
                detached=detached,
                num_cpus=0,
                max_concurrency=32,
                **self._actor_service_kwargs(),
            )
        factory = RayEnvironmentWorkers(
            namespace=namespace, resources=self.worker_resources, service_kwargs=self._actor_service_kwargs()
        )
        return named_actor(
            EnvironmentPool,
            ENVIRONMENT_SERVICE_ACTOR_NAME,
            factory,
            namespace=namespace,
            detached=detached,
            num_cpus=0,
            max_concurrency=64,
            workers=self.workers,
        )


@dataclass(frozen=True)
class ProducerServiceConfig:
    """The producer service (issue 40): `replicas` replicas of `ProducerService`, each running the
    data loops (SFT / rollout producers, evaluations, an advantage stage) of the tenants the front
    (`ProducerFront`, in the Master) assigns it."""

    settings: Settings
    replicas: int = 1
    max_concurrent_rollouts: int = 4  # per replica

    @classmethod
    def from_settings(cls, settings: Settings) -> ProducerServiceConfig:
        return cls(
            settings=settings,
            replicas=settings.producer_replicas,
            max_concurrent_rollouts=settings.producer_concurrent_rollouts,
        )

    def build(self, context: ProducerContext) -> ProducerFront:
        """The replicas as objects of this process, over the Master's own store and handles."""
        return ProducerFront(
            [
                service_handle(
                    ProducerService,
                    ProducerService(
                        self.settings, i, context=context, max_concurrent_rollouts=self.max_concurrent_rollouts
                    ),
                )
                for i in range(self.replicas)
            ]
        )

    def actors(self, *, namespace: str | None = None, detached: bool = False) -> list[Any]:
        """Get or create the named replicas (`joynexus.producers-<i>`): threaded (a poll, a weight
        sync and the loops side by side), no CPU of their own unless the role's resources say so.
        Each builds its context in its own process and finds the services by name."""
        return [
            named_actor(
                ProducerService,
                producer_actor_name(i),
                self.settings.for_actors(),  # the database login by reference: arguments are kept in the GCS
                i,
                max_concurrent_rollouts=self.max_concurrent_rollouts,
                namespace=namespace,
                detached=detached,
                max_concurrency=64,
                role="producers",
            )
            for i in range(self.replicas)
        ]
