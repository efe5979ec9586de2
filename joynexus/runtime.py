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
from typing import Any, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from joynexus.scheduling.autoscaler import ScalingPolicy

RAY_NAMESPACE = "joynexus"
HEALTH_GROUP = "health"  # the actor concurrency group that answers heartbeats
S = TypeVar("S")
R = TypeVar("R")


ROLES = (
    "master",
    "training_queue",
    "training_service",
    "inference_service",  # each Inference Model Service replica
    "inference_router",  # the replica set in front of them (when there is more than one replica)
    "environment_service",  # the single Environment Service, or the pool's front
    "environment_worker",  # each worker of an Environment Service pool
)
# The named actor each role is created as (replicas and pool workers carry a suffix of their own).
ROLE_OF_ACTOR = {
    "joynexus.master": "master",
    "joynexus.training_queue": "training_queue",
    "joynexus.training_service": "training_service",
    "joynexus.inference_service": "inference_service",
    "joynexus.environment_service": "environment_service",
}


class RoleResources(BaseModel):
    """What one role's actor asks Ray for. None keeps the role's embedded default. `num_gpus` may be
    a fraction below 1 (roles sharing one device, as in the paper's co-location); above 1 Ray needs
    a whole number. `memory` is bytes Ray reserves for the actor (a scheduling constraint, not a
    limit). `resources`: custom resources, e.g. {"joynexus_worker": 0.1} places the role on nodes
    started with that resource."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_cpus: float | None = Field(default=None, ge=0)
    num_gpus: float | None = Field(default=None, ge=0)
    memory: int | None = Field(default=None, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)

    @field_validator("num_gpus")
    @classmethod
    def _whole_above_one(cls, value: float | None) -> float | None:
        if value is not None and value > 1 and not float(value).is_integer():
            raise ValueError("fractional above 1; Ray takes a fraction of a GPU only below 1")
        return value

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if not name or name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name!r} is not a custom resource (use num_cpus / num_gpus / memory)")
            if amount <= 0 or (amount > 1 and not float(amount).is_integer()):
                raise ValueError(f"{name}: {amount} must be > 0, and a whole number above 1")
        return value

    def ray_options(self, *, default_num_cpus: float) -> dict[str, Any]:
        """Keyword arguments of `ActorClass.options` (unset fields: the role's defaults)."""
        options: dict[str, Any] = {"num_cpus": default_num_cpus if self.num_cpus is None else self.num_cpus}
        if self.num_gpus is not None:
            options["num_gpus"] = self.num_gpus
        if self.memory is not None:
            options["memory"] = self.memory
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


def parse_role_resources(value: Any) -> dict[str, RoleResources]:
    """{role: RoleResources} from JSON text or a dict; errors name the role, the field and the value."""
    import json

    where = "JOYNEXUS_RESOURCES_JSON"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object {{role: {{num_cpus, num_gpus, memory, resources}}}}")
    parsed: dict[str, RoleResources] = {}
    for role, spec in value.items():
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r}; roles are {', '.join(ROLES)}")
        if isinstance(spec, RoleResources):
            parsed[role] = spec
            continue
        try:
            parsed[role] = RoleResources.model_validate(spec)
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(part) for part in first["loc"]) or "(value)"
            bad = first.get("input")
            raise ValueError(f"{where}: role {role!r}, field {field}: {first['msg']} (got {bad!r})") from None
    return parsed


def _scaling_policy(text: str) -> Any:
    import json

    from joynexus.scheduling.autoscaler import ScalingPolicy

    where = "JOYNEXUS_INFERENCE_SCALING_JSON"
    try:
        return ScalingPolicy.model_validate(json.loads(text))
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error})") from None
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(value)"
        raise ValueError(f"{where}: field {field}: {first['msg']} (got {first.get('input')!r})") from None


def _env_int(name: str, default: int) -> int:
    """An integer environment variable; a bad value's error names the variable."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {text!r}") from None


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
    # Device placement of the model services (joynexus.models.placement.DevicePlacement): "auto" takes
    # a GPU when the service's process sees one, else the CPU; dtype is the backbone's.
    device: str = Field(
        default_factory=lambda: os.environ.get("JOYNEXUS_DEVICE", "auto").strip().lower(),
        pattern=r"^(auto|cpu|cuda(:(0|[1-9][0-9]*))?)$",
        validate_default=True,  # defaults come from the environment: check them like given values
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default_factory=lambda: os.environ.get("JOYNEXUS_DTYPE", "float32").strip().lower(), validate_default=True
    )
    autocast: bool = Field(
        default_factory=lambda: os.environ.get("JOYNEXUS_AUTOCAST", "1").strip().lower(), validate_default=True
    )
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
    # Tenant density (issue 14): Training Model Service tenant slots and Inference Model Service
    # serving states (one per tenant and version) kept in memory; the least recently used beyond these
    # page out to a local folder (JOYNEXUS_SPILL_DIR, default <data_dir>/spill) and back on next use.
    max_resident_tenants: int = Field(
        default_factory=lambda: _env_int("JOYNEXUS_MAX_RESIDENT_TENANTS", 256), ge=1, validate_default=True
    )
    max_resident_serving: int = Field(
        default_factory=lambda: _env_int("JOYNEXUS_MAX_RESIDENT_SERVING", 1024), ge=1, validate_default=True
    )
    # Of the resident training slots, how many keep their module and optimizer as live objects (vLLM's
    # max_loras); the least recently used others are packed into flat tensors (~10% less memory each).
    max_active_tenants: int = Field(
        default_factory=lambda: _env_int("JOYNEXUS_MAX_ACTIVE_TENANTS", 64), ge=1, validate_default=True
    )
    spill_dir: Path | None = Field(
        default_factory=lambda: Path(v).resolve() if (v := os.environ.get("JOYNEXUS_SPILL_DIR", "").strip()) else None
    )

    # Ray resources per role (issue 12): JSON {role: {num_cpus, num_gpus, memory, resources}}, e.g.
    # '{"inference_service": {"num_gpus": 0.25}, "training_service": {"num_gpus": 0.5}}' to co-locate
    # roles on one device as the paper does; custom resources place a role on chosen nodes. A role
    # left out keeps its embedded default (what a 2-core laptop starts with).
    resources: dict[str, RoleResources] = Field(
        default_factory=lambda: parse_role_resources(os.environ.get("JOYNEXUS_RESOURCES_JSON") or "{}")
    )
    # Inference Model Service replicas (joynexus.scheduling.autoscaler.ScalingPolicy as JSON, e.g.
    # '{"min_replicas": 1, "max_replicas": 3}'); the default is one replica and no autoscaling.
    inference_scaling: ScalingPolicy = Field(
        default_factory=lambda: _scaling_policy(os.environ.get("JOYNEXUS_INFERENCE_SCALING_JSON") or "{}")
    )
    # Environment Service workers: >1 spreads sessions over that many worker actors (Ray-scheduled,
    # so across nodes); 1 is the single Environment Service actor.
    environment_workers: int = Field(
        default_factory=lambda: int(os.environ.get("JOYNEXUS_ENVIRONMENT_WORKERS", "1")), ge=1, le=256
    )

    @field_validator("resources", mode="before")
    @classmethod
    def _check_resources(cls, value: Any) -> Any:
        if isinstance(value, dict) and all(isinstance(v, RoleResources) for v in value.values()):
            return value
        return parse_role_resources(value)

    def resolved_database_url(self) -> str:
        from joynexus.core.store import sqlite_url

        return self.database_url or sqlite_url(self.data_dir)

    def resolved_mlflow_uri(self) -> str:
        from joynexus.registry import local_tracking_uri

        return self.mlflow_tracking_uri or local_tracking_uri(self.data_dir)

    @property
    def resolved_spill_dir(self) -> Path:
        """Where the model services page tenants out to: JOYNEXUS_SPILL_DIR or <data_dir>/spill."""
        return self.spill_dir or self.data_dir / "spill"

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
        from ray.util.client.common import ClientActorHandle
    except ImportError:  # pragma: no cover - ray is a hard dependency
        return False
    # A driver connected through the Ray Client (ray://head:10001, as a pod outside the cluster)
    # holds ClientActorHandles: the same calls, a different class.
    return isinstance(target, ActorHandle | ClientActorHandle)


@functools.cache
def _local_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="service-call")


_placement: dict[str, RoleResources] = {}
_placement_lock = threading.Lock()


def configure_placement(resources: dict[str, RoleResources]) -> None:
    """The deployment's resources per role, for every actor this process creates from now on
    (`create_service_actors` sets it from `Settings.resources`; the service factories then need no
    parameter of their own)."""
    with _placement_lock:
        _placement.clear()
        _placement.update(resources)


def role_resources(role: str) -> RoleResources:
    """The configured resources of `role` (an empty spec: the role's defaults)."""
    with _placement_lock:
        return _placement.get(role, RoleResources())


def named_actor(
    cls: type,
    name: str,
    *args: Any,
    namespace: str | None = None,
    detached: bool = False,
    num_cpus: float = 0,
    max_concurrency: int = 1,
    max_restarts: int = -1,
    role: str | None = None,
    ray_resources: RoleResources | None = None,
    get_if_exists: bool = True,
    scheduling_strategy: str | None = None,
    **kwargs: Any,
) -> Any:
    """Get the deployment's named actor of `cls`, creating it from `args` / `kwargs` if absent
    (Ray must be initialized). A running actor is reused as it is, so nothing is rebuilt;
    `detached` actors outlive the driver that created them (`joynexus up`).

    A role that dies is restarted in place by Ray (`max_restarts`, -1: always) with the same
    arguments; the Master's Health Manager then restores what it held (paper 4.4). Every actor has
    a one-thread `health` concurrency group, so heartbeats are answered while it is busy.

    Resources: the configured `RoleResources` of `role` (default: the role the actor name stands
    for, `ROLE_OF_ACTOR`), or an explicit `ray_resources`, replace `num_cpus` where set and add GPUs,
    memory and custom resources."""
    import ray

    role = role or ROLE_OF_ACTOR.get(name)
    if ray_resources is None:
        ray_resources = role_resources(role) if role else RoleResources()
    return (
        ray.remote(concurrency_groups={HEALTH_GROUP: 1})(cls)  # not an .options() setting in Ray
        .options(
            name=name,
            namespace=namespace,
            get_if_exists=get_if_exists,
            max_concurrency=max_concurrency,
            max_restarts=max_restarts,
            lifetime="detached" if detached else None,
            **ray_resources.ray_options(default_num_cpus=num_cpus),
            **({"scheduling_strategy": scheduling_strategy} if scheduling_strategy else {}),
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
