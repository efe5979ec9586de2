"""Request and response models of the tenant API, shared by the server and `joynexus.client`.

Light on purpose (pydantic, numpy, msgpack via `wire`): the client imports this module without
torch, FastAPI or the services. Tensors are `wire.Tensor`; module payloads are safetensors bytes
(`wire.WireBytes`). Response models ignore fields they do not know, so an older client keeps
working against a newer server.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from joynexus.protocol.wire import Tensor, WireBytes

PARTITION_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
MAX_SAMPLES_PER_REQUEST = 4096
MAX_INSTRUCTION_CHARS = 512


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore")


# -- errors -----------------------------------------------------------------------------------


class Problem(_Response):
    field: str
    reason: str


class ErrorBody(_Response):
    """Every 4xx / 5xx answer: a machine-readable code, a sentence, and per-field problems."""

    code: str
    message: str
    problems: list[Problem] = []


# -- tenants, keys, quotas (admin) -----------------------------------------------------------------


class TenantInfo(_Response):
    tenant_id: str
    task: str
    base_model: str
    schema_signature: str
    cameras: list[str]
    image_size: tuple[int, int]
    state_dim: int
    action_dim: int
    action_chunk: int
    action_module: dict[str, Any]
    instruction: str
    microbatch_size: int
    stochastic: bool = False  # a Gaussian policy (RL tenants): predict(sample=True), loss="policy_gradient"
    environment: dict[str, Any] | None = None  # the session config of the tenant's declared environment
    status: str = "active"  # "active" | "unhealthy" (its backend slot could not be built; see status_reason)
    status_reason: str | None = None


class TenantDeleted(BaseModel):
    tenant_id: str
    removed: dict[str, str] = Field(description="what was removed (counts) or why a part was not")


class IssueKeyRequest(_Request):
    label: str = Field(default="", max_length=128)


class IssuedKey(_Response):
    """A new API key. `api_key` is shown only in this answer; the server keeps only its hash."""

    key_id: str
    tenant_id: str | None
    role: str
    label: str
    api_key: str


class KeyInfo(_Response):
    key_id: str
    tenant_id: str | None
    role: str
    label: str
    created_at: str
    revoked_at: str | None = None


class TenantCreated(_Response):
    tenant: TenantInfo
    key: IssuedKey | None = None


class QuotaUpdate(_Request):
    """None keeps (or restores) the server default for that limit."""

    max_device_seconds: float | None = Field(default=None, ge=0)
    max_queued_workloads: int | None = Field(default=None, ge=0, le=10_000)
    max_storage_bytes: int | None = Field(default=None, ge=0)


class Quota(_Response):
    max_device_seconds: float | None  # None: no spend cap
    max_queued_workloads: int | None  # None: no bound on waiting workloads
    max_storage_bytes: int | None = None  # None: no quota on checkpoint bytes
    max_running_workloads: int = 1  # per tenant; more wait in the queue with a visible position


# -- usage --------------------------------------------------------------------------------------


class DeviceSeconds(_Response):
    training: float = 0.0
    inference: float = 0.0
    total: float = 0.0


class ThrottleCounts(_Response):
    """The tenant's calls this API server refused with 429 since it started, by the limit that
    refused them (`joynexus.api.rate_limits`; `streams`: `max_streams_per_tenant`)."""

    requests_per_s: int = 0
    samples_per_s: int = 0
    max_in_flight: int = 0
    streams: int = 0


class Usage(_Response):
    tenant_id: str
    device_seconds: DeviceSeconds
    samples_trained: int = 0
    samples_predicted: int = 0
    env_steps: int = 0
    storage_bytes: int = 0  # what quota.max_storage_bytes counts: checkpoints + dataset_bytes
    dataset_bytes: int = 0  # unpacked bytes of the tenant's uploaded datasets (POST /v1/datasets)
    workloads_running: int = 0
    workloads_queued: int = 0
    quota: Quota
    remaining_device_seconds: float | None = None
    throttled: ThrottleCounts = Field(default_factory=ThrottleCounts)  # this API server's 429s


# -- workloads (upper layer) -------------------------------------------------------------------


class WorkloadSubmit(_Request):
    """A workload of the caller's tenant.

    `task` None (or the tenant's own task, "sft" or "rl") trains for `jobs` training jobs; "eval"
    evaluates one policy version (`version`, default the latest served) for `episodes` episodes in
    the tenant's environment (or `environment`). `spec`, when given, must describe the caller's
    tenant with the interface it was created with; its scheduling.completion_target is the
    default for `jobs`."""

    task: str | None = Field(default=None, max_length=16)
    jobs: int | None = Field(default=None, ge=1, le=100_000)
    spec: dict[str, Any] | None = None
    version: int | None = Field(default=None, ge=0)
    episodes: int = Field(default=4, ge=1, le=10_000)
    environment: dict[str, Any] | None = None
    # eval: several entries (partial environments: other tasks, seeds), `episodes` each; and the
    # first `videos` episodes of each entry recorded as mp4 (services/producers/evaluation_report.py).
    suite: list[dict[str, Any]] | None = Field(default=None, min_length=1, max_length=16)
    videos: int = Field(default=0, ge=0, le=8)


class WorkloadInfo(_Response):
    """A workload's state and progress: what the Master Service returns and the API serves."""

    workload_id: str
    tenant_id: str
    task: str
    state: Literal["queued", "running", "completed", "failed", "cancelled"]
    position: int | None = None
    completed_jobs: int = 0
    target_jobs: int = 0
    version: int = 0
    optimizer_steps: int = 0
    last_loss: float | None = None
    registered_version: int | None = None
    # The workload's MLflow run, for the Master's own clients (flows, recipes); not in the API's JSON.
    run_id: str | None = Field(default=None, exclude=True)
    error: str | None = None
    result: dict[str, Any] | None = None  # evaluation: success rate, returns, episode lengths
    dataset_id: str | None = None  # SFT on an upload the workload named (spec dataset.id); None: the tenant's
    created_at: str | None = None
    started_at: str | None = None
    finished_at: str | None = None

    @property
    def done(self) -> bool:
        return self.state in ("completed", "failed", "cancelled")


class WorkloadEvent(BaseModel):
    """A progress or metric event; `kind` says which (queued, started, step, job_completed, ...)."""

    model_config = ConfigDict(extra="allow")

    seq: int
    kind: str
    workload_id: str
    time: float


class WorkloadEvents(_Response):
    workload: WorkloadInfo
    events: list[WorkloadEvent]


# -- versions, checkpoints, export ---------------------------------------------------------------


class Manifest(_Response):
    tenant_id: str
    policy_version: int
    schema_signature: str
    base_model_id: str
    module_kind: str
    module_config: dict[str, Any]
    files: dict[str, str]
    created_at: str
    extra: dict[str, Any]
    digest: str


class CheckpointInfo(_Response):
    """One checkpointed version. `corrupt`: it cannot be exported or loaded, `problem` says why
    (an unreadable manifest, a missing file); the other versions are listed and usable as usual."""

    version: int
    created_at: str
    # The digest of the manifest this version's exports carry: the MLflow registry's manifest_digest
    # tag and an export's X-JoyNexus-Manifest-Digest (one digest to match a version everywhere).
    digest: str
    size_bytes: int
    corrupt: bool = False
    problem: str | None = None
    checkpoint_digest: str | None = None  # the checkpoint's own manifest (it also hashes the checkpoint's files)


class Versions(_Response):
    """`checkpoints` is one page (ascending versions); `next_after` is the `after` of the next
    page, None when this page was the last."""

    training_version: int | None  # None while the tenant's slot is not loaded (unhealthy)
    optimizer_steps: int | None
    checkpoints: list[CheckpointInfo]
    serving_versions: list[int]
    next_after: int | None = None


class DatasetInfo(_Response):
    """A dataset the tenant uploaded (POST /v1/datasets): a spec names it by `dataset.id`."""

    dataset_id: str  # the archive's sha256: also the content digest versions trained on it record
    repo_id: str | None = None
    bytes: int  # unpacked, counted in the tenant's storage quota


class DatasetDeleted(DatasetInfo):
    """An upload deleted (DELETE /v1/datasets/{dataset_id}) and the tenant's storage bytes after."""

    deleted: bool = True
    storage_bytes: int


class VersionDeleted(_Response):
    """A checkpointed version deleted (DELETE /v1/versions/{version}): the bytes it freed and the
    tenant's storage bytes after."""

    version: int
    freed_bytes: int
    storage_bytes: int


class ExportedParams(_Response):
    """A tenant payload: safetensors bytes of the action module, manifest in its metadata."""

    version: int
    manifest: Manifest
    payload: WireBytes


class SaveRequest(_Request):
    include_optim: bool = True


class LoadWeightsRequest(_Request):
    """Install serving weights in the Inference Model Service: `payload` (a tenant payload of the
    caller's tenant, e.g. from export), else the checkpoint `version`, else the current training
    parameters."""

    payload: WireBytes | None = None
    version: int | None = Field(default=None, ge=0)


class LoadWeightsResult(_Response):
    version: int
    serving_versions: list[int]


# -- lower layer: training ----------------------------------------------------------------------


class SampleBatch(_Request):
    """N samples of the caller's schema. Shapes: images (N, cameras, 3, H, W) float in [0, 1] or
    uint8; state (N, state_dim); action (N, action_chunk, action_dim); action_is_pad (N,
    action_chunk) bool; instructions: N strings (blank: the tenant's default instruction)."""

    images: Tensor | None = None  # None (or N x 0 cameras) only for a tenant with no cameras
    state: Tensor
    action: Tensor
    action_is_pad: Tensor | None = None
    instructions: list[str] | None = Field(default=None, max_length=MAX_SAMPLES_PER_REQUEST)


ForwardBackwardLoss = Literal["default", "advantage_weighted", "policy_gradient", "importance_sampling", "ppo_clip"]


class LossConfig(_Request):
    """Parameters of an objective; each loss refuses the ones it does not read."""

    clip_eps: float | None = Field(default=None, gt=0, lt=1, description="ppo_clip: the ratio's clip range")


class ForwardBackwardRequest(SampleBatch):
    """`loss`: "default" (the module's own), "advantage_weighted" (mean of advantages[i] * the
    module's loss on sample i, any module) or "policy_gradient" (-mean of advantages[i] * log
    pi(action_i | obs_i), stochastic modules). The last two need `advantages`, one float per sample.
    "importance_sampling" (-mean of ratio_i * advantages[i], ratio_i = exp(log pi(action_i | obs_i)
    - sampling_logprobs[i])) and "ppo_clip" (the PPO clipped surrogate of that ratio,
    `loss_config.clip_eps`, default 0.2) also need `sampling_logprobs`, one per sample: the
    log-density of each sample's action chunk under the policy that drew it (stochastic modules)."""

    loss: ForwardBackwardLoss = "default"
    advantages: Tensor | None = None
    sampling_logprobs: Tensor | None = None
    loss_config: LossConfig | None = None


class TrainStepResult(_Response):
    loss: float
    version: int
    optimizer_steps: int
    samples: int
    device_seconds: float


class ForwardBackwardResult(_Response):
    loss: float
    samples: int
    accumulated_microbatches: int
    accumulated_samples: int
    version: int
    device_seconds: float


class OptimStepRequest(_Request):
    """This step's AdamW hyperparameters; unset ones keep the tenant's (its spec's learning rate,
    betas (0.9, 0.999), weight decay 0.01, gradient clip norm 1.0). They last for this step only."""

    lr: float | None = Field(default=None, gt=0, le=1)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] | None = None
    weight_decay: float | None = Field(default=None, ge=0, le=1)
    grad_clip: float | None = Field(default=None, gt=0, le=1e4, description="max gradient norm")


class OptimStepResult(_Response):
    loss: float
    grad_norm: float
    microbatches: int
    samples: int
    optimizer_steps: int
    version: int
    device_seconds: float
    lr: float | None = None  # the hyperparameters this step used
    betas: tuple[float, float] | None = None
    weight_decay: float | None = None
    grad_clip: float | None = None


# -- lower layer: inference -----------------------------------------------------------------------


class ObservationBatch(_Request):
    """N observations: images (N, cameras, 3, H, W) float in [0, 1] or uint8, state (N, state_dim)."""

    images: Tensor | None = None  # None (or N x 0 cameras) only for a tenant with no cameras
    state: Tensor
    # None: the tenant's own instruction (its spec's observation.instruction) for every sample.
    instructions: list[str] | None = Field(default=None, max_length=MAX_SAMPLES_PER_REQUEST)


class PredictRequest(_Request):
    observations: ObservationBatch
    policy_version: int | None = Field(default=None, ge=0)  # None: the latest served version
    # One per observation: the noise a flow-matching module starts from. None: deterministic (the same
    # observation gives the same actions); pass seeds to draw other actions.
    seeds: list[int] | None = Field(default=None, max_length=MAX_SAMPLES_PER_REQUEST)
    session_id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)
    sample: bool = False  # draw from the tenant's Gaussian policy (stochastic modules) and return log_probs
    timeout_s: float = Field(default=60.0, gt=0, le=600)


class PredictResult(_Response):
    policy_version: int
    actions: Tensor  # (N, action_chunk, action_dim) float32
    values: Tensor | None = None
    log_probs: Tensor | None = None  # (N,) with sample=True
    batch_samples: int  # samples in the shared backbone batch this request rode in (all tenants)
    device_seconds: float  # this request's share of that batch's time


# -- lower layer: Training Queue ----------------------------------------------------------------

Column = Tensor | list[str]


class QueuePut(_Request):
    """Columns with one row per sample (tensors or lists of strings). Without `indices` the rows
    are appended; with `indices` (from a get) they are derived fields written back at those rows."""

    columns: dict[str, Column] = Field(min_length=1, max_length=64)
    indices: list[int] | None = Field(default=None, max_length=1 << 20)
    task_name: str = Field(default="api", pattern=r"^[A-Za-z0-9._-]{1,64}$")


class QueueGet(_Request):
    fields: list[str] = Field(min_length=1, max_length=64)
    batch_size: int = Field(ge=1, le=MAX_SAMPLES_PER_REQUEST)
    task_name: str = Field(default="train", pattern=r"^[A-Za-z0-9._-]{1,64}$")


class QueueBatch(_Response):
    partition: str
    task_name: str
    indices: list[int]
    columns: dict[str, Column]
    exhausted: bool = False  # True: no unconsumed samples were left for task_name


class PartitionInfo(_Response):
    partition: str
    num_samples: int
    fields: list[str]
    cursors: dict[str, int] = {}
    bytes: int = 0


class Cleared(_Response):
    cleared: bool


# -- lower layer: environment sessions ----------------------------------------------------------


class SessionOpen(_Request):
    config: dict[str, Any] = Field(default_factory=dict)
    rollout_id: str = Field(default="api", pattern=r"^[A-Za-z0-9._:-]{1,128}$")


class SessionInfo(_Response):
    """An environment session of the caller's tenant. `spec` (on open) is the session's interface:
    cameras, image_size, state_dim, action_dim, action bounds, max_episode_steps, instruction."""

    session_id: str
    rollout_id: str | None = None
    simulator: str | None = None
    task: str | None = None
    state: str | None = None  # ready | failed
    reason: str | None = None
    steps: int = 0
    episodes: int = 0
    spec: dict[str, Any] | None = None


class SessionList(_Response):
    sessions: list[SessionInfo]


class EnvReset(_Request):
    seed: int | None = Field(default=None, ge=0, lt=2**63)


class EnvStep(_Request):
    action: Tensor


class EnvResult(_Response):
    """What the environment returned, with arrays as tensors; `data` keeps every field."""

    data: dict[str, Any]


API_VERSION = "1"


class RoleHealth(_Response):
    healthy: bool
    incarnation: str | None = None  # a service's current life; a restart in place makes a new one
    last_beat_s: float | None = None  # seconds since its last heartbeat
    restarts: int = 0
    hung_restarts: int = 0  # kills of a hung service for a restart in place
    detail: str = ""


class Health(_Response):
    status: str  # ok | degraded (a role is down or restoring) | down (the Master does not answer)
    version: str
    roles: dict[str, RoleHealth] = {}


# -- foreign weights and evaluation declarations (issue 24.5) -----------------------------------


class InstallWeightsRequest(_Request):
    """Weights trained elsewhere for the tenant: `weights` is a safetensors file of the tenant's
    state dict (the names, shapes and float dtypes of its action module, as `params/export`
    gives them); `config`, when given, is the action-module config they were trained with (each
    field must equal the tenant's); `source` says where they come from (MLflow tag `source`)."""

    weights: WireBytes
    source: str = Field(min_length=1, max_length=512)
    config: dict[str, Any] | None = None


class InstalledWeights(_Response):
    tenant_id: str
    version: int  # the tenant's new policy version (served and checkpointed)
    registered_version: int  # the MLflow registered-model version
    sha256: str  # of the uploaded bytes (MLflow tag `sha256`)
    source: str
    installed_by: str  # "tenant" or "admin"
    manifest_digest: str


class EvaluationTarget(_Request):
    tenant_id: str = Field(max_length=64)
    version: int | None = Field(default=None, ge=0)  # None: the latest served version, resolved once


class EvaluationDeclare(_Request):
    """An evaluation declaration (paper 4.2): each target evaluated on its tenant's simulator with
    the same seeded episodes; one comparison table in MLflow when all have ended."""

    targets: list[EvaluationTarget] = Field(min_length=1, max_length=32)
    episodes: int = Field(default=4, ge=1, le=1000)
    name: str = Field(default="", max_length=128)
    environment: dict[str, Any] | None = None  # one simulator for every target; None: each tenant's own
    suite: list[dict[str, Any]] | None = Field(default=None, min_length=1, max_length=16)  # as WorkloadSubmit's
    videos: int = Field(default=0, ge=0, le=8)


class EvaluationDeclaration(_Response):
    declaration_id: str
    name: str = ""
    state: Literal["running", "completed", "failed"]
    targets: list[dict[str, Any]]  # {tenant_id, version (resolved), workload_id}
    table: list[dict[str, Any]] | None = None  # one row per target once completed
    run_id: str | None = None  # the MLflow run holding comparison.json
    error: str | None = None
    created_at: str | None = None
    finished_at: str | None = None
