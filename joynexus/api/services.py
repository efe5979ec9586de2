"""What the tenant API server talks to: the deployment's ONE Master Service and its execution
services, through the typed handles of a `joynexus.connect.Cluster`, plus the control-plane store
for API keys.

`ApiServices.ray` is the default (`joynexus serve`): the resident named actors of a running
deployment, the Master Service among them, so the server owns no workload state and a restart of
it loses nothing. `ApiServices.in_process` puts every service and the Master in this process (tests,
`joynexus serve --services in-process`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from joynexus.actors import SerializedService, handle_of
from joynexus.artifacts import CheckpointStore
from joynexus.connect import Cluster, connect
from joynexus.core.store import ControlPlaneStore
from joynexus.settings import Settings


def timed_call(target: Any, method: str, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """Call a service method; (result, seconds). A local serialized service reports the time the
    method itself ran (not its wait for the lock); a Ray actor's includes its queue."""
    handle = handle_of(target)
    if isinstance(handle.target, SerializedService):
        return handle.target.call_timed(method, *args, **kwargs)
    started = time.perf_counter()
    result = getattr(handle, method)(*args, **kwargs)
    return result, time.perf_counter() - started


@dataclass
class ApiServices:
    cluster: Cluster
    store: ControlPlaneStore  # this server's connection to the control-plane store (API keys)

    @classmethod
    def from_cluster(cls, cluster: Cluster) -> ApiServices:
        return cls(cluster, ControlPlaneStore(cluster.settings.resolved_database_url()))

    @classmethod
    def in_process(cls, settings: Settings | None = None, **master_options: Any) -> ApiServices:
        """Every service and the Master Service in this process."""
        from joynexus.connect import in_process
        from joynexus.master.service import MasterOptions

        return cls.from_cluster(in_process(settings or Settings(), options=MasterOptions(**master_options)))

    @classmethod
    def ray(cls, settings: Settings | None = None) -> ApiServices:
        """The named actors of the deployment the settings (or `joynexus up`'s record) point at."""
        return cls.from_cluster(connect(settings, mode="ray"))

    @property
    def settings(self) -> Settings:
        return self.cluster.settings

    @property
    def master(self) -> Any:
        return self.cluster.master

    @property
    def training_service(self) -> Any:
        return self.cluster.training

    @property
    def inference_service(self) -> Any:
        return self.cluster.inference

    @property
    def environment_service(self) -> Any:
        return self.cluster.environment

    @property
    def queue(self) -> Any:
        return self.cluster.queue

    @property
    def checkpoints(self) -> CheckpointStore:
        return self.cluster.checkpoints

    def close(self) -> None:
        self.cluster.close()
        self.store.dispose()
