"""The services behind the tenant API, local (in-process) or deployed (Ray actors).

`ApiServices` carries the same attributes as `joynexus.master.orchestrator.Deployment` (store,
scheduler, queue, training_service, inference_service, environment_service, creator, tracker)
plus the checkpoint store, so the `WorkloadManager` runs on it unchanged.

`ApiServices.in_process` has every service in this process (what the tests and a single-process
server use); `ApiServices.from_deployment` takes a Ray deployment's. A local Training Model
Service is wrapped in `SerializedService`, which admits one call at a time like a Ray actor does,
because HTTP handlers and the workload actor loop call it from many threads. The Inference Model
Service stays concurrent (its queue batches callers together) and is the metered subclass, so
every prediction carries its share of device time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from joynexus.artifacts import CheckpointStore
from joynexus.core.store import ControlPlaneStore
from joynexus.master.tenant_creator import TenantCreator
from joynexus.runtime import ServiceHandle, Settings
from joynexus.scheduling.training_queue import TrainingQueueClient
from joynexus.scheduling.training_scheduler import TrainingScheduler


class SerializedService:
    """A local service object behind a lock: one method call at a time, like a Ray actor."""

    def __init__(self, target: Any):
        self._target = target
        self._lock = threading.RLock()

    @property
    def target(self) -> Any:
        return self._target

    def call_timed(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, float]:
        """(result, seconds the method itself ran), not counting the wait for the lock."""
        with self._lock:
            started = time.perf_counter()
            result = getattr(self._target, method)(*args, **kwargs)
            return result, time.perf_counter() - started

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._target, name)
        if not callable(attribute):
            return attribute

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attribute(*args, **kwargs)

        return locked


def timed_call(target: Any, method: str, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """Call a service method; (result, seconds). For a Ray actor the seconds include its queue."""
    if isinstance(target, SerializedService):
        return target.call_timed(method, *args, **kwargs)
    started = time.perf_counter()
    result = getattr(ServiceHandle(target), method)(*args, **kwargs)
    return result, time.perf_counter() - started


@dataclass
class ApiServices:
    settings: Settings
    store: ControlPlaneStore
    scheduler: TrainingScheduler
    queue: TrainingQueueClient
    training_service: Any
    inference_service: Any
    creator: TenantCreator
    tracker: Any
    checkpoints: CheckpointStore
    environment_service: Any | None = None
    _closers: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @classmethod
    def in_process(cls, settings: Settings | None = None) -> ApiServices:
        """Every service a local object in this process (`Deployment.in_process`): for tests and
        for a single-process server."""
        from joynexus.master.orchestrator import Deployment

        return cls.from_deployment(Deployment.in_process(settings))

    @classmethod
    def from_deployment(cls, deployment: Any) -> ApiServices:
        """A deployment's services, with this process's metered Inference Model Service in place of
        the deployment's (so every prediction carries its device time), and a local Training Model
        Service serialized like an actor."""
        from joynexus.api.usage import metered_inference_service
        from joynexus.services.training import BackboneSource

        settings = deployment.settings
        source = BackboneSource(
            preset=None if settings.backbone_path else settings.backbone_preset, path=settings.backbone_path
        )
        replaced = deployment.inference_service
        close_replaced = getattr(replaced, "close", None)
        if callable(close_replaced) and not hasattr(close_replaced, "remote"):
            close_replaced()  # a local service's batching worker
        inference = metered_inference_service(source, num_threads=settings.torch_threads)
        deployment.inference_service = inference
        training = deployment.training_service
        if not hasattr(getattr(training, "train_batch", None), "remote"):
            training = SerializedService(training)
        services = cls(
            settings=settings,
            store=deployment.store,
            scheduler=deployment.scheduler,
            queue=deployment.queue,
            training_service=training,
            inference_service=inference,
            creator=deployment.creator,
            tracker=deployment.tracker,
            checkpoints=CheckpointStore(settings.checkpoint_root),
            environment_service=getattr(deployment, "environment_service", None),
        )
        services._closers.append(deployment.shutdown)  # environment sessions, inference worker, store
        return services

    def close(self) -> None:
        closers, self._closers = self._closers, []
        for close in closers:
            try:
                close()
            except Exception:  # closing is best effort and idempotent
                pass
