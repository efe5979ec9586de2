"""Service location: where a deployment's services are, and typed handles to them.

Every entry point (the tenant API server, the Prefect flows, the CLI, the main job) calls
`connect()` and gets a `Cluster`: a typed handle of the ONE Master Service (tenants, workloads,
admission, usage) and of the execution services (Training / Inference Model Service, Environment
Service, Training Queue) for the lower-layer primitives. Nothing here starts or stops processes
(that is `joynexus.ops.supervisor`).

- Ray mode: a Ray address is known (``JOYNEXUS_RAY_ADDRESS``, or `joynexus up`'s record in the data
  dir), or the caller asks for Ray (the main job starts a local one). The named actors are used as
  they run. Only their supervised creator makes missing ones: `joynexus up` (``detached=True``; on
  Kubernetes the Job `joynexus-services`), or a process that started its own local Ray. A client of
  a deployment's address waits for them and then raises `ServicesNotRunning` (a `RoleUnavailable`:
  the API answers 503) naming what creates them; it never creates them tied to its own lifetime.
- In-process mode: no address and not asked for Ray: the services and the Master Service are local
  objects of this process (tests, `joynexus serve --services in-process`, flows run without a
  deployment).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

from joynexus.actors import EXECUTION_PLANE_ACTORS, SERVICES_CREATOR, ServiceHandle, ServicesNotRunning, service_handle
from joynexus.ops.deployment_state import effective_settings, ray_access
from joynexus.settings import Settings

if TYPE_CHECKING:  # imported where used: a client of a running deployment needs neither torch nor the services
    from joynexus.artifacts import CheckpointStore
    from joynexus.core.store import ControlPlaneStore
    from joynexus.master.service import MasterOptions, MasterService
    from joynexus.protocol.schemas import WorkloadInfo
    from joynexus.scheduling.training_queue import TrainingQueue
    from joynexus.services.environment.service import EnvironmentService
    from joynexus.services.inference.endpoint import InferenceEndpoint
    from joynexus.services.training.service import TrainingModelService

Mode = Literal["auto", "ray", "in-process"]
FINAL_STATES = ("completed", "failed", "cancelled")
SERVICE_ACTOR_NAMES = (*EXECUTION_PLANE_ACTORS, "joynexus.master")  # the order `_running_actors` returns


@dataclass
class Cluster:
    """Typed handles of one deployment's services, as a client sees them, plus this client's own
    connection to the control-plane store (the tenant API server keeps its API keys and metered
    lower-layer usage there)."""

    settings: Settings
    master: MasterService
    training: TrainingModelService
    inference: InferenceEndpoint  # one service or its replica set (`services/inference/endpoint.py`)
    environment: EnvironmentService
    queue: TrainingQueue
    mode: str  # "ray" | "in-process"
    _closers: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _checkpoints: CheckpointStore | None = field(default=None, repr=False)
    _store: ControlPlaneStore | None = field(default=None, repr=False)
    # Whether this process is the services' creator (`joynexus up`, or its own local Ray): only then
    # may it create shared actors (the futures call queue) that are missing.
    creates_services: bool = False

    @property
    def checkpoints(self) -> CheckpointStore:
        """The deployment's checkpoint store (local folder or S3), read-only use by clients."""
        if self._checkpoints is None:
            from joynexus.artifacts.checkpoints import checkpoint_store

            self._checkpoints = checkpoint_store(self.settings)
        return self._checkpoints

    @property
    def store(self) -> ControlPlaneStore:
        """This client's connection to the control-plane store (opened on first use, disposed last
        by `close`)."""
        if self._store is None:
            from joynexus.core.store import ControlPlaneStore

            self._store = ControlPlaneStore(self.settings.resolved_database_url())
            self._closers.insert(0, self._store.dispose)  # closers run in reverse: the store goes last
        return self._store

    def wait_workload(self, workload_id: str, timeout_s: float = 3600.0) -> WorkloadInfo:
        """Wait for a workload to end (or the timeout), in bounded calls to the Master."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            status = self.master.wait_workload(workload_id, max(0.0, min(left, 30.0)))
            if status.state in FINAL_STATES or time.monotonic() >= deadline:
                return status

    def close(self) -> None:
        """Release what this client holds (an in-process deployment's services and threads).
        Resident services of a Ray deployment keep running."""
        closers, self._closers = self._closers, []
        for close in reversed(closers):
            try:
                close()
            except Exception:  # closing is best effort and idempotent
                pass


def connect(
    settings: Settings | None = None,
    *,
    mode: Mode = "auto",
    detached: bool = False,
    options: MasterOptions | None = None,
) -> Cluster:
    """The deployment's services. `auto`: Ray if an address is known, else in process."""
    settings = effective_settings(settings)
    if mode == "in-process" or (mode == "auto" and not settings.ray_address):
        return in_process(settings, options=options)
    return ray_cluster(settings, detached=detached, options=options)


def in_process(settings: Settings | None = None, *, options: MasterOptions | None = None) -> Cluster:
    """Every service and the Master Service as local objects of this process."""
    from joynexus.master.deployment import Deployment
    from joynexus.master.service import MasterService

    settings = settings or Settings()
    deployment = Deployment.in_process(settings)
    master = MasterService(deployment=deployment, options=options)
    cluster = Cluster(
        settings=settings,
        master=master,
        training=deployment.training_service,
        inference=deployment.inference_service,
        environment=deployment.environment_service,
        queue=deployment.queue,
        mode="in-process",
        _checkpoints=deployment.checkpoints,
    )
    cluster._closers.append(master.close)
    return cluster


def ray_cluster(
    settings: Settings,
    *,
    detached: bool = False,
    options: MasterOptions | None = None,
    timeout_s: float = 600.0,
    wait_s: float | None = None,
) -> Cluster:
    """Connect to (or start) Ray and use the deployment's named actors. Missing ones are created only
    by their creator: `detached=True` (`joynexus up`, the services Job) or a process that starts its
    own local Ray (no address). A client of an address waits up to `wait_s` (default `timeout_s`) for
    them, then raises `ServicesNotRunning`."""
    if settings.ray_address:  # the head this data dir's `up` started takes its token (issue 41.14)
        os.environ.update(ray_access(settings))
    creator = detached or not settings.ray_address
    with _create_lock:
        running = None
        if settings.ray_address and (options is None or not creator):
            running = _running_actors(settings, wait_s=0.0 if creator else (timeout_s if wait_s is None else wait_s))
        if running is not None:  # a deployment's actors, found by name: nothing to build, ship or import
            queue, training, inference, environment, master_actor = running
        else:
            from joynexus.master.deployment import create_service_actors
            from joynexus.master.service import master_service_actor

            queue, training, inference, environment = create_service_actors(settings, detached=detached)
            master_actor = master_service_actor(settings, options=options, detached=detached)
            _RESIDENT.append(master_actor)
    ServiceHandle(master_actor, timeout_s=timeout_s).ping()  # waits until it has reconciled and started
    # Typed as the service classes and protocols (TYPE_CHECKING imports): the handles need only the actors.
    return Cluster(
        settings=settings,
        master=service_handle(cast("type[MasterService]", object), master_actor),
        training=service_handle(cast("type[TrainingModelService]", object), training),
        # With replicas, a router of this process sends requests straight to the tenant's replicas.
        inference=service_handle(cast("type[InferenceEndpoint]", object), _inference_endpoint(settings, inference)),
        environment=service_handle(cast("type[EnvironmentService]", object), environment),
        queue=service_handle(cast("type[TrainingQueue]", object), queue),
        mode="ray",
        creates_services=creator,
    )


def _inference_endpoint(settings: Settings, inference: Any) -> Any:
    from joynexus.services.inference.router import inference_endpoint

    replicated = settings.inference_scaling.max_replicas > 1
    return inference_endpoint(inference, replicated=replicated, namespace=settings.ray_namespace)


def _running_actors(settings: Settings, *, wait_s: float = 0.0) -> tuple[Any, Any, Any, Any, Any] | None:
    """(queue, training, inference, environment, master) actor handles of a running deployment at
    `settings.ray_address`, looked up by name. With `wait_s` = 0: None unless all five are there (the
    creator then creates them); else polled that long, then `ServicesNotRunning` naming the missing."""
    import ray

    from joynexus.actors import init_ray

    init_ray(settings.ray_address)
    deadline = time.monotonic() + wait_s
    while True:
        found, missing = [], []
        for name in SERVICE_ACTOR_NAMES:
            try:
                found.append(ray.get_actor(name, namespace=settings.ray_namespace))
            except ValueError:
                missing.append(name)
        if not missing:
            return tuple(found)  # type: ignore[return-value]
        if wait_s <= 0:
            return None
        if time.monotonic() >= deadline:
            raise ServicesNotRunning(
                "the resident services",
                f"{', '.join(missing)} not running at {settings.ray_address} (namespace {settings.ray_namespace}) "
                f"after {wait_s:g} s; clients do not create them: {SERVICES_CREATOR}",
                retry_after_s=10.0,
            )
        time.sleep(min(2.0, max(0.05, deadline - time.monotonic())))


_create_lock = threading.Lock()
_RESIDENT: list[Any] = []  # creating handles of non-detached actors live as long as this driver
_shared_lock = threading.Lock()
_shared: Cluster | None = None


def shared(settings: Settings | None = None) -> Cluster:
    """The process-wide Cluster (created on first use, closed at exit): what flow tasks use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            import atexit

            _shared = connect(settings)
            atexit.register(close_shared)
        return _shared


def use_cluster(cluster: Cluster | None) -> Cluster | None:
    """Make `shared()` return `cluster` (tests); returns the previous one."""
    global _shared
    with _shared_lock:
        previous, _shared = _shared, cluster
    return previous


def close_shared() -> None:
    global _shared
    with _shared_lock:
        cluster, _shared = _shared, None
    if cluster is not None:
        cluster.close()
