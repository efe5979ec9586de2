"""Process plumbing shared by services: settings from the environment, local Ray, named actors, and
typed handles that call a service the same way whether it is a local object or a named Ray actor."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field

RAY_NAMESPACE = "joynexus"
HEALTH_GROUP = "health"  # the actor concurrency group that answers heartbeats
S = TypeVar("S")
R = TypeVar("R")


class Settings(BaseModel):
    """Embedded defaults; every production setting is an environment variable, not a code change."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data_dir: Path = Field(default_factory=lambda: Path(os.environ.get("JOYNEXUS_DATA_DIR", "var")).resolve())
    database_url: str | None = Field(default_factory=lambda: os.environ.get("JOYNEXUS_DATABASE_URL"))
    mlflow_tracking_uri: str | None = Field(default_factory=lambda: os.environ.get("JOYNEXUS_MLFLOW_TRACKING_URI"))
    ray_address: str | None = Field(default_factory=lambda: os.environ.get("JOYNEXUS_RAY_ADDRESS"))
    backbone_preset: str = Field(default_factory=lambda: os.environ.get("JOYNEXUS_BACKBONE_PRESET", "tiny"))
    backbone_path: str | None = Field(default_factory=lambda: os.environ.get("JOYNEXUS_BACKBONE_PATH"))
    ray_namespace: str = Field(default_factory=lambda: os.environ.get("JOYNEXUS_RAY_NAMESPACE", RAY_NAMESPACE))
    torch_threads: int = Field(default_factory=lambda: int(os.environ.get("JOYNEXUS_TORCH_THREADS", "1")), ge=1)
    # Object storage: with a bucket, checkpoints go to s3://<bucket>/<prefix>/checkpoints and MLflow
    # artifacts to s3://<bucket>/<prefix>/mlflow; credentials come from the standard AWS chain.
    s3_bucket: str | None = Field(default_factory=lambda: os.environ.get("JOYNEXUS_S3_BUCKET") or None)
    s3_prefix: str = Field(default_factory=lambda: os.environ.get("JOYNEXUS_S3_PREFIX", "").strip("/"))
    s3_endpoint_url: str | None = Field(default_factory=lambda: os.environ.get("JOYNEXUS_S3_ENDPOINT_URL") or None)
    # Prefect's own variable: a server's API URL; none = `joynexus up` starts one on prefect_port.
    prefect_api_url: str | None = Field(default_factory=lambda: os.environ.get("PREFECT_API_URL") or None)
    # Ports of the services `joynexus up` starts on this host (embedded defaults only).
    ray_port: int = Field(default_factory=lambda: int(os.environ.get("JOYNEXUS_RAY_PORT", "6379")), ge=1, le=65535)
    prefect_port: int = Field(
        default_factory=lambda: int(os.environ.get("JOYNEXUS_PREFECT_PORT", "4200")), ge=1, le=65535
    )
    mlflow_port: int = Field(
        default_factory=lambda: int(os.environ.get("JOYNEXUS_MLFLOW_PORT", "5000")), ge=1, le=65535
    )
    # Checkpoint retention of the Training Model Service: the last K versions per tenant plus the
    # registered ones survive each save; JOYNEXUS_CHECKPOINT_KEEP_LAST=none keeps every version.
    checkpoint_keep_last: int | None = Field(
        default_factory=lambda: (
            None
            if (v := os.environ.get("JOYNEXUS_CHECKPOINT_KEEP_LAST", "5").strip()).lower() in {"", "none"}
            else int(v)
        ),
        ge=1,
    )

    def resolved_database_url(self) -> str:
        from joynexus.core.store import sqlite_url

        return self.database_url or sqlite_url(self.data_dir)

    def resolved_mlflow_uri(self) -> str:
        from joynexus.registry import local_tracking_uri

        return self.mlflow_tracking_uri or local_tracking_uri(self.data_dir)

    @property
    def checkpoint_root(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def checkpoint_location(self) -> str:
        """Where the Training Model Service keeps checkpoints: an s3:// URI or a local folder."""
        return self._s3_uri("checkpoints") if self.s3_bucket else str(self.checkpoint_root)

    @property
    def mlflow_artifact_location(self) -> str | None:
        """s3://<bucket>/<prefix>/mlflow when a bucket is configured, else None (the store decides)."""
        return self._s3_uri("mlflow") if self.s3_bucket else None

    def _s3_uri(self, leaf: str) -> str:
        return "/".join(["s3:/", str(self.s3_bucket), *([self.s3_prefix] if self.s3_prefix else []), leaf])


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to a Ray cluster, or start a local one (embedded default) if none is given."""
    import ray

    if ray.is_initialized():
        return
    # Ray 2.60 turns token auth on by default; a local embedded cluster does not need it and would
    # otherwise write ~/.ray/auth_token (STACK.md).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
    else:
        ray.init(
            num_cpus=num_cpus or os.cpu_count(),
            namespace=RAY_NAMESPACE,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )


class ServiceHandle:
    """A service reached the same way whether it is a local object (tests, one process) or a named
    Ray actor (a deployment): attribute calls run the method synchronously and return its result.
    This is the one place that knows the difference; build one with `service_handle`, which types
    it as the service class so call sites are checked like direct calls."""

    __slots__ = ("_target", "_remote", "_timeout_s")

    def __init__(self, target: Any, *, timeout_s: float | None = None):
        if isinstance(target, ServiceHandle):
            target = target._target
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_remote", _is_actor_handle(target))
        object.__setattr__(self, "_timeout_s", timeout_s)

    @property
    def is_remote(self) -> bool:
        return self._remote

    @property
    def target(self) -> Any:
        """The local object or the Ray actor handle behind this handle."""
        return self._target

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        attribute = getattr(self._target, name)
        if not self._remote:
            return attribute
        timeout_s = self._timeout_s

        def remote_call(*args: Any, **kwargs: Any) -> Any:
            import ray
            from ray.exceptions import RayTaskError

            try:
                return ray.get(attribute.remote(*args, **kwargs), timeout=timeout_s)
            except RayTaskError as error:  # the service's own exception, as a local call would raise it
                cause = getattr(error, "cause", None)
                if isinstance(cause, Exception):
                    raise cause from None
                raise

        remote_call.__name__ = name
        return remote_call

    def probe(self, method: str, timeout_s: float) -> Any:
        """Call a cheap, lock-free method (a heartbeat) past whatever the service is busy with: on
        an actor in its own `health` concurrency group, so a long training call does not hide a
        live service; on a local SerializedService, past its lock. Raises on timeout."""
        if self._remote:
            import ray

            call = getattr(self._target, method).options(concurrency_group=HEALTH_GROUP)
            return ray.get(call.remote(), timeout=timeout_s)
        target = self._target.target if isinstance(self._target, SerializedService) else self._target
        return getattr(target, method)()

    def start(self, method: Callable[..., R], *args: Any, **kwargs: Any) -> concurrent.futures.Future[R]:
        """Start `method` (given as the service class's function, e.g. `InferenceModelService.predict`)
        without waiting: a future of its result. Local calls run on a small shared thread pool."""
        if self._remote:
            return getattr(self._target, method.__name__).remote(*args, **kwargs).future()
        return _local_pool().submit(getattr(self._target, method.__name__), *args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:  # a Ray actor handle travels to other Ray processes
        return (ServiceHandle, (self._target,), None)

    def __repr__(self) -> str:
        return f"ServiceHandle({type(self._target).__name__}, remote={self._remote})"


class SerializedService:
    """A local service object behind a lock: one method call at a time, like a Ray actor (the
    Training Model Service in one process is called from the actor loop and API threads)."""

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


def service_handle(cls: type[S], target: Any, *, timeout_s: float | None = None) -> S:
    """`target` (an instance of `cls` or a Ray actor of it) behind a ServiceHandle, typed as `cls`."""
    if isinstance(target, ServiceHandle):
        return cast(S, target)
    return cast(S, ServiceHandle(target, timeout_s=timeout_s))


def handle_of(service: Any) -> ServiceHandle:
    """The ServiceHandle behind a value `service_handle` returned (or a new one around a raw target)."""
    return service if isinstance(service, ServiceHandle) else ServiceHandle(service)


def _is_actor_handle(target: Any) -> bool:
    try:
        from ray.actor import ActorHandle
    except ImportError:  # pragma: no cover - ray is a hard dependency
        return False
    return isinstance(target, ActorHandle)


@functools.cache
def _local_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="service-call")


def named_actor(
    cls: type,
    name: str,
    *args: Any,
    namespace: str | None = None,
    detached: bool = False,
    num_cpus: float = 0,
    max_concurrency: int = 1,
    max_restarts: int = -1,
    **kwargs: Any,
) -> Any:
    """Get the deployment's named actor of `cls`, creating it from `args` / `kwargs` if absent
    (Ray must be initialized). A running actor is reused as it is, so nothing is rebuilt;
    `detached` actors outlive the driver that created them (`joynexus up`).

    A role that dies is restarted in place by Ray (`max_restarts`, -1: always) with the same
    arguments; the Master's Health Manager then restores what it held (paper 4.4). Every actor has
    a one-thread `health` concurrency group, so heartbeats are answered while it is busy."""
    import ray

    return (
        ray.remote(concurrency_groups={HEALTH_GROUP: 1})(cls)  # not an .options() setting in Ray
        .options(
            name=name,
            namespace=namespace,
            get_if_exists=True,
            num_cpus=num_cpus,
            max_concurrency=max_concurrency,
            max_restarts=max_restarts,
            lifetime="detached" if detached else None,
        )
        .remote(*args, **kwargs)
    )


def role_unavailable(error: BaseException) -> bool:
    """True for errors that mean the service behind a handle is gone or restarting (its calls
    fail until it is back), not that the call itself was wrong: callers retry or re-queue."""
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    except ImportError:  # pragma: no cover - ray is a hard dependency
        return False
    return isinstance(error, RayActorError | ActorDiedError | ActorUnavailableError)
