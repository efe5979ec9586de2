"""The deployment's settings: embedded defaults, every production setting an environment variable
(`Settings`), the resources each role asks Ray for (`RoleResources`) and the inference replicas'
scaling policy (`ScalingPolicy`). Nothing here imports the rest of the package at module level."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

RAY_NAMESPACE = "joynexus"

ROLES = (
    "master",
    "training_queue",
    "training_service",
    "inference_service",  # each Inference Model Service replica
    "inference_router",  # the replica set in front of them (when there is more than one replica)
    "environment_service",  # the single Environment Service, or the pool's front
    "environment_worker",  # each worker of an Environment Service pool
    "call_futures",  # the lower layer's call queue every API replica shares (services/call_futures.py)
    "producers",  # each producer replica, where the data loops run (services/producers)
)


# The embedded defaults' locations under the data dir, decided here once (each creates its folder).
def sqlite_url(data_dir: str | Path) -> str:
    """The control-plane store: ``sqlite:///<data_dir>/joynexus.db``."""
    path = Path(data_dir).resolve() / "joynexus.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def local_tracking_uri(data_dir: str | Path) -> str:
    """The MLflow store: ``sqlite:///<data_dir>/mlflow/mlflow.db``."""
    mlflow_dir = Path(data_dir).resolve() / "mlflow"
    mlflow_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{mlflow_dir / 'mlflow.db'}"


def local_artifact_location(data_dir: str | Path) -> str:
    """The MLflow artifact root paired with `local_tracking_uri`: ``<data_dir>/mlflow/artifacts`` as a file URI."""
    path = Path(data_dir).resolve() / "mlflow" / "artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path.as_uri()


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


class ScalingPolicy(BaseModel):
    """Bounds and thresholds of the inference replica set. min == max (the default, 1) is a fixed
    size: no autoscaling, nothing changes for the embedded single-replica run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_replicas: int = Field(default=1, ge=1, le=64)
    max_replicas: int = Field(default=1, ge=1, le=64)
    scale_out_queue_per_replica: float = Field(
        default=8.0, gt=0, description="requests in flight per replica above which a replica is added"
    )
    scale_in_queue_per_replica: float = Field(
        default=1.0, ge=0, description="requests in flight per replica below which one is removed"
    )
    max_p99_latency_s: float | None = Field(
        default=None, gt=0, description="p99 request latency above which a replica is added (None: not used)"
    )
    cooldown_s: float = Field(default=30.0, ge=0, description="no change within this long of the last one")
    interval_s: float = Field(default=1.0, gt=0, description="seconds between autoscaler rounds")
    drain_timeout_s: float = Field(
        default=60.0, gt=0, description="longest wait for a removed replica's requests in flight"
    )
    max_tenants_per_replica: int | None = Field(
        default=None,
        ge=1,
        description="tenants whose serving states one replica holds at most (LRU; None: every replica holds all)",
    )
    hot_tenant_in_flight: float = Field(
        default=8.0, gt=0, description="a tenant's requests in flight per holding replica above which it gets one more"
    )

    @model_validator(mode="after")
    def _bounds(self) -> ScalingPolicy:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        if self.max_tenants_per_replica is not None and self.max_replicas < 2:
            # One replica is the plain service, which holds every tenant: the bound would do nothing.
            raise ValueError(
                f"max_tenants_per_replica ({self.max_tenants_per_replica}) needs max_replicas >= 2 "
                f"(got {self.max_replicas}): a single Inference Model Service holds every tenant"
            )
        if self.scale_in_queue_per_replica >= self.scale_out_queue_per_replica:
            # Equal or crossed thresholds would add and remove a replica on the same load.
            raise ValueError(
                f"scale_in_queue_per_replica ({self.scale_in_queue_per_replica}) must be below "
                f"scale_out_queue_per_replica ({self.scale_out_queue_per_replica})"
            )
        return self

    @property
    def elastic(self) -> bool:
        return self.max_replicas > self.min_replicas


def _scaling_policy(text: str) -> Any:
    import json

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


# The database login never travels as an actor argument (Ray keeps those in the GCS, and with GCS
# fault tolerance in its Redis): an actor gets a reference by name, `secret-ref:<VAR>:<url without
# password>`, and reads the login in its own process, from the file $<VAR>_FILE names (a mounted
# Secret) or from $<VAR>. The redacted URL checks that both ends mean the same database and role.
DATABASE_URL_ENV = "JOYNEXUS_DATABASE_URL"
SECRET_REF_PREFIX = "secret-ref:"


def redact_url(url: str) -> str:
    """`url` without its password (scheme, user, host, port, path and query kept)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    user = parts.netloc.rpartition("@")[0].partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}@{netloc}"))


def url_has_password(url: str) -> bool:
    from urllib.parse import urlsplit

    try:
        return urlsplit(url).password is not None
    except ValueError:  # an unparsable netloc: treat as secret rather than pass it on
        return True


def database_url_ref(url: str | None, name: str = DATABASE_URL_ENV) -> str | None:
    """What an actor gets for the database URL `url`: `url` itself when it carries no password (a
    SQLite file, a socket login), else a reference by name that `resolve_database_url` reads in the
    actor's own process (its pod mounts the login; docs/deployment.md, Credentials)."""
    if url is None or url.startswith(SECRET_REF_PREFIX) or not url_has_password(url):
        return url
    return f"{SECRET_REF_PREFIX}{name}:{redact_url(url)}"


def database_url_from_env(name: str = DATABASE_URL_ENV) -> str | None:
    """The login this process holds by name: the file $<name>_FILE names, else $<name> (None: neither)."""
    path = os.environ.get(f"{name}_FILE", "").strip()
    if path:
        try:
            return Path(path).read_text().strip() or None
        except OSError as error:
            raise ValueError(f"{name}_FILE: cannot read {path}: {error.strerror}") from None
    return os.environ.get(name) or None


def resolve_database_url(value: str | None) -> str | None:
    """A database URL or a reference (`database_url_ref`) to the login this process holds."""
    if value is None or not value.startswith(SECRET_REF_PREFIX):
        return value
    name, _, expected = value.removeprefix(SECRET_REF_PREFIX).partition(":")
    url = database_url_from_env(name)
    if url is None:
        raise ValueError(
            f"{name}: the database login {expected} reaches this process by name, not as an argument, and "
            f"neither {name}_FILE nor {name} is set here (mount the Secret in this Ray pod)"
        )
    if redact_url(url) != expected:
        raise ValueError(f"{name}: this process holds the login {redact_url(url)}, its creator meant {expected}")
    return url


def process_release() -> str:
    """The release of this process's code: JOYNEXUS_RELEASE (the image tag on a cluster), else the
    installed package's version."""
    return os.environ.get("JOYNEXUS_RELEASE", "").strip() or _package_version()


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("joynexus")
    except PackageNotFoundError:
        return "dev"


def _env_optional_int(name: str) -> int | None:
    """An optional integer environment variable (unset or empty: None); a bad value's error names it."""
    text = os.environ.get(name, "").strip()
    return None if not text else _env_int(name, 0)


class Settings(BaseModel):
    """Embedded defaults; every production setting is an environment variable, not a code change."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data_dir: Path = Field(default_factory=lambda: Path(os.environ.get("JOYNEXUS_DATA_DIR", "var")).resolve())
    database_url: str | None = Field(default_factory=database_url_from_env)
    # The release these settings' code belongs to (the image tag on a cluster, set by render-deployment):
    # the services Job compares it with the running Master's to drain and replace them (ops/upgrade.py).
    release: str = Field(default_factory=process_release)
    mlflow_tracking_uri: str | None = Field(default_factory=lambda: os.environ.get("JOYNEXUS_MLFLOW_TRACKING_URI"))
    ray_address: str | None = Field(default_factory=lambda: os.environ.get("JOYNEXUS_RAY_ADDRESS"))
    backbone_preset: str = Field(default_factory=lambda: os.environ.get("JOYNEXUS_BACKBONE_PRESET", "tiny"))
    backbone_path: str | None = Field(default_factory=lambda: os.environ.get("JOYNEXUS_BACKBONE_PATH"))
    # Preset overrides: the canonical camera side (a multiple of the preset's patch*scale_factor, e.g.
    # 64 or 128 for smolvlm-256m on a CPU) and SmolVLA's features from the first K text layers.
    backbone_image_size: int | None = Field(
        default_factory=lambda: _env_optional_int("JOYNEXUS_BACKBONE_IMAGE_SIZE"), ge=1, validate_default=True
    )
    backbone_feature_layers: int | None = Field(
        default_factory=lambda: _env_optional_int("JOYNEXUS_BACKBONE_FEATURE_LAYERS"), ge=1, validate_default=True
    )

    # The model id a plain Hugging Face checkpoint directory is served under (tenants name it as their
    # base_model); unset: its config.json's `_name_or_path`, else the directory's path.
    backbone_id: str | None = Field(default_factory=lambda: os.environ.get("JOYNEXUS_BACKBONE_ID") or None)
    ray_namespace: str = Field(default_factory=lambda: os.environ.get("JOYNEXUS_RAY_NAMESPACE", RAY_NAMESPACE))
    # Admin dataset paths (spec dataset.root) must lie under one of these (os.pathsep-separated
    # absolute paths; joynexus.data.sources); blank: any path. S3 datasets go to data_dir/datasets.
    dataset_roots: str = Field(default_factory=lambda: os.environ.get("JOYNEXUS_DATASET_ROOTS", ""))
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
    # The ports Ray's workers bind on ("min-max"), for the Ray head `joynexus up` starts; its own
    # ports (JOYNEXUS_RAY_PORT and the 9 above it) must lie outside (joynexus/ops/ray_ports.py).
    ray_worker_ports: str = Field(default_factory=lambda: os.environ.get("JOYNEXUS_RAY_WORKER_PORTS", "10002-19999"))
    # Where the Ray head `joynexus up` starts listens: 127.0.0.1 (loopback only), or an address of this
    # host to let other hosts reach it (Ray then listens on every interface); token auth is on either
    # way (joynexus/ops/ray_access.py).
    ray_bind: str = Field(default_factory=lambda: os.environ.get("JOYNEXUS_RAY_BIND", "127.0.0.1"))
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
    # Grouped training (paper 5.2): how many tenants' ready jobs the actor loop trains in one group
    # (one shared backbone forward per round); 1 trains one job at a time.
    training_group_max: int = Field(
        default_factory=lambda: _env_int("JOYNEXUS_TRAINING_GROUP_MAX", 8), ge=1, validate_default=True
    )
    spill_dir: Path | None = Field(
        default_factory=lambda: Path(v).resolve() if (v := os.environ.get("JOYNEXUS_SPILL_DIR", "").strip()) else None
    )
    # Training Model Service shards (issue 45): M services, each its own backbone on its own device
    # (a bundle of one placement group in Ray), each holding a subset of the tenants; 1 is one service.
    training_shards: int = Field(
        default_factory=lambda: _env_int("JOYNEXUS_TRAINING_SHARDS", 1), ge=1, le=1024, validate_default=True
    )
    # Ranks of each Training Model Service (issue 45.2, the paper's data-parallel layout): K > 1 runs
    # the service (or each shard) as one logical service over K rank actors, each its own backbone on
    # its own bundle (the training role's resources each: with num_gpus 1, K devices per service), every
    # SFT microbatch split by rows and the gradients all-reduced (gloo on CPUs, NCCL on GPUs).
    training_data_parallel: int = Field(
        default_factory=lambda: _env_int("JOYNEXUS_TRAINING_DATA_PARALLEL", 1), ge=1, le=64, validate_default=True
    )
    # Check that every rank holds the same tenant state after every N-th training call (0: never).
    training_data_parallel_verify_every: int = Field(
        default_factory=lambda: _env_int("JOYNEXUS_TRAINING_DATA_PARALLEL_VERIFY_EVERY", 1),
        ge=0,
        validate_default=True,
    )
    # Tenants one shard may hold (None: no bound but the memory of its residency tiers).
    max_tenants_per_shard: int | None = Field(
        default_factory=lambda: _env_optional_int("JOYNEXUS_MAX_TENANTS_PER_SHARD"), ge=1, validate_default=True
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
    # Producer service replicas (issue 40): the data loops (SFT / rollout producers, evaluations,
    # advantage stages) run in this many `joynexus.producers-<i>` actors, tenants spread by load.
    producer_replicas: int = Field(
        default_factory=lambda: _env_int("JOYNEXUS_PRODUCER_REPLICAS", 1), ge=1, le=64, validate_default=True
    )
    # Rollouts one producer replica runs at once (the rest wait for a slot).
    producer_concurrent_rollouts: int = Field(
        default_factory=lambda: _env_int("JOYNEXUS_PRODUCER_CONCURRENT_ROLLOUTS", 4), ge=1, validate_default=True
    )
    # Environment Service workers: >1 spreads sessions over that many worker actors (Ray-scheduled,
    # so across nodes); 1 is the single Environment Service actor.
    environment_workers: int = Field(
        default_factory=lambda: int(os.environ.get("JOYNEXUS_ENVIRONMENT_WORKERS", "1")), ge=1, le=256
    )
    # Environment Service worker processes kept warm (simulator built) after their session closed,
    # for the same tenant's next session of the same config: every workload and evaluation opens
    # fresh sessions, and a ManiSkill worker's start costs 5-16 CPU s. Per Environment Service
    # (each pool worker has its own); 0 turns it off.
    environment_warm_workers: int = Field(
        default_factory=lambda: _env_int("JOYNEXUS_ENVIRONMENT_WARM_WORKERS", 8), ge=0, le=256, validate_default=True
    )
    # ... and together at most this much resident memory (a ManiSkill worker of 8 PushCube
    # environments holds ~0.9 GiB); the oldest warm worker stops first.
    environment_warm_memory_mib: int = Field(
        default_factory=lambda: _env_int("JOYNEXUS_ENVIRONMENT_WARM_MEMORY_MIB", 4096), ge=0, validate_default=True
    )
    # Samples one tenant may have waiting in the Inference Queue (issue 26): a request that would pass
    # it is refused (429 naming this setting); abandoned requests leave the queue, so only live ones count.
    max_queued_samples_per_tenant: int = Field(
        default_factory=lambda: _env_int("JOYNEXUS_MAX_QUEUED_SAMPLES_PER_TENANT", 16384), ge=1, validate_default=True
    )

    @field_validator("resources", mode="before")
    @classmethod
    def _check_resources(cls, value: Any) -> Any:
        if isinstance(value, dict) and all(isinstance(v, RoleResources) for v in value.values()):
            return value
        return parse_role_resources(value)

    def resolved_database_url(self) -> str:
        return resolve_database_url(self.database_url) or sqlite_url(self.data_dir)

    def for_actors(self) -> Settings:
        """These settings as an actor's argument: a database login by reference, never its password."""
        return self.model_copy(update={"database_url": database_url_ref(self.database_url)})

    def resolved_mlflow_uri(self) -> str:
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
