"""Tenant-scoped operations of the API: every method takes the caller's tenant and reaches only
that tenant's slot, versions, checkpoints, serving states, queue partitions, sessions and workloads.

The HTTP layer (`joynexus.api.routers`) stays thin: it authenticates, then calls one method here.
The gateway checks request tensors against the tenant's schema (field, expected shape, received
shape), adds the tenant and schema annotations itself (a client never names a tenant), meters
usage, applies quotas, and turns service exceptions into `ApiError`s. Whatever an id of another
tenant would reach raises the same `NotFound` as an id that does not exist.

`ApiGateway` is a facade: it builds one object per concern, each holding its own state and the
typed handles it needs (nothing else), and forwards each call to it. The objects, one module each:

| module | object | what |
|---|---|---|
| `directory.py` | `TenantDirectory` | the caller's tenant (the Master's answer, cached briefly) |
| `admission.py` | `Admission` | spend cap and storage quota before new work |
| `tenants.py` | `TenantAdmin` | create / delete / purge a tenant; `tenant_info` |
| `workloads.py` | `Workloads` | submit (training or eval), follow, cancel workloads |
| `versions.py` | `Versions` | versions, checkpoint manifests, exports, save, load_weights and its payload checks |
| `training.py` | `TrainingCalls` | train_batch, forward_backward, optim_step (metered); `timed_call` |
| `sampling.py` | `Sampling` | sample, compute_logprobs (metered) |
| `inference.py` | `Inference` | predict through the shared Inference Queue, its cancellation |
| `queue.py` | `TenantQueues` | Training Queue partitions, bounded per tenant |
| `environment.py` | `Sessions` | environment sessions |
| `foreign.py` | `ForeignWeights` | install foreign weights (tenant or admin) |
| `evaluations.py` | `Evaluations` | evaluation declarations |
| `state_control.py` | `StateControl` | load_state, fork (issue 28.3) |
| `call_futures.py` | `CallQueue` | futures of lower-layer calls (per-tenant ordered queue) |
| `health.py` | | the deployment's health per role |
| `tensors.py`, `service_errors.py` | | request tensors against the schema; service exceptions as API errors |
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from joynexus.api.auth import ApiKeyStore
from joynexus.api.gateway.admission import Admission
from joynexus.api.gateway.call_futures import CallQueue
from joynexus.api.gateway.directory import TenantDirectory
from joynexus.api.gateway.environment import Sessions
from joynexus.api.gateway.evaluations import Evaluations
from joynexus.api.gateway.foreign import ForeignWeights
from joynexus.api.gateway.health import deployment_health
from joynexus.api.gateway.inference import Inference
from joynexus.api.gateway.limits import ApiLimits
from joynexus.api.gateway.queue import TenantQueues
from joynexus.api.gateway.sampling import Sampling
from joynexus.api.gateway.state_control import StateControl
from joynexus.api.gateway.tenants import TenantAdmin, tenant_info
from joynexus.api.gateway.training import TrainingCalls, timed_call
from joynexus.api.gateway.versions import Versions, manifest_model
from joynexus.api.gateway.workloads import Workloads
from joynexus.artifacts import TenantManifest
from joynexus.connect import Cluster
from joynexus.core.metering import UsageMeter
from joynexus.core.serving_sets import ServingSetStore
from joynexus.core.tenants import Tenant
from joynexus.master.usage import UsageLedger
from joynexus.protocol import sampling_schemas as ss
from joynexus.protocol import schemas as s
from joynexus.protocol import state_control as sc
from joynexus.spec import WorkloadSpec


class ApiGateway:
    """Every tenant-scoped operation of the API over one deployment; each call is one line to the
    object of its concern (module docstring). `cluster`, `master`, `ledger` stay public: routers
    read the settings, admin quotas and storage numbers from them."""

    def __init__(self, cluster: Cluster, keys: ApiKeyStore, ledger: UsageLedger, *, limits: ApiLimits | None = None):
        self.cluster, self.master, self.keys, self.ledger = cluster, cluster.master, keys, ledger
        self.limits = limits = limits or ApiLimits()
        # Lower-layer training calls are metered like the services meter theirs: batched rows.
        self.meter = meter = UsageMeter(cluster.store)
        training, inference, checkpoints = cluster.training, cluster.inference, cluster.checkpoints
        self.directory = directory = TenantDirectory(cluster.master)
        self.admission = admission = Admission(ledger)
        self.queues = TenantQueues(cluster.queue, directory, limits)
        self.tenant_admin = TenantAdmin(cluster.master, directory, self.queues)
        self.workloads = Workloads(cluster.master, directory)
        self.policy_versions = Versions(training, inference, checkpoints, directory, admission, ledger)
        self.training = TrainingCalls(training, directory, admission, meter, limits)
        self.sampling = Sampling(training, directory, admission, meter, limits)
        self.inference = Inference(inference, checkpoints, ServingSetStore(cluster.store), directory, admission, limits)
        self.env_sessions = Sessions(cluster.environment, directory, admission)
        self.foreign = ForeignWeights(cluster.master, training, directory, admission)
        self.evaluations = Evaluations(cluster.master)
        self.state_control = StateControl(cluster.master, directory, admission, keys)
        self.futures = CallQueue(cluster, self.training, self.sampling, self.inference, directory, admission, meter)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to start: the Master Service owns workloads, slots and admission."""

    def stop(self) -> None:
        """Close this gateway's own call queue, write the metered lower-layer usage (the Master owns
        everything else)."""
        self.futures.close()
        self.meter.try_flush()

    # -- tenants, usage, health -----------------------------------------------------------------
    def tenant(self, tenant_id: str, *, healthy: bool = True) -> Tenant:
        return self.directory.tenant(tenant_id, healthy=healthy)

    def tenants(self) -> list[Tenant]:
        return self.directory.tenants()

    def usage(self, tenant_id: str) -> s.Usage:
        self.meter.flush()  # read-your-writes, as the Master does for the services' meters
        return self.master.usage(tenant_id)

    def health(self, timeout_s: float = 5.0) -> s.Health:
        return deployment_health(self.master, timeout_s)

    def create_tenant(self, spec: WorkloadSpec) -> Tenant:
        return self.tenant_admin.create(spec)

    def delete_tenant(self, tenant_id: str, delete_artifacts: bool) -> dict[str, Any]:
        return self.tenant_admin.delete(tenant_id, delete_artifacts)

    def purge_tenant_artifacts(self, tenant_id: str) -> dict[str, Any]:
        return self.tenant_admin.purge_artifacts(tenant_id)

    # -- workloads --------------------------------------------------------------------------------
    def submit_workload(self, tenant_id: str, request: s.WorkloadSubmit) -> s.WorkloadInfo:
        return self.workloads.submit(tenant_id, request)

    def workload(self, tenant_id: str, workload_id: str) -> s.WorkloadInfo:
        return self.workloads.get(tenant_id, workload_id)

    def list_workloads(self, tenant_id: str) -> list[s.WorkloadInfo]:
        return self.workloads.list_workloads(tenant_id)

    def cancel_workload(self, tenant_id: str, workload_id: str) -> s.WorkloadInfo:
        return self.workloads.cancel(tenant_id, workload_id)

    def workload_events(self, tenant_id: str, workload_id: str, after: int) -> s.WorkloadEvents:
        return self.workloads.events(tenant_id, workload_id, after)

    # -- versions and weights ---------------------------------------------------------------------
    def versions(self, tenant_id: str, after: int | None = None, limit: int = 100) -> s.Versions:
        return self.policy_versions.list_versions(tenant_id, after, limit)

    def checkpoint_manifest(self, tenant_id: str, version: int) -> s.Manifest:
        return self.policy_versions.checkpoint_manifest(tenant_id, version)

    def export(self, tenant_id: str, version: int | None = None) -> tuple[bytes, TenantManifest]:
        return self.policy_versions.export(tenant_id, version)

    def delete_version(self, tenant_id: str, version: int) -> s.VersionDeleted:
        return self.policy_versions.delete_version(tenant_id, version)

    def save(self, tenant_id: str, include_optim: bool) -> s.Manifest:
        return self.policy_versions.save(tenant_id, include_optim)

    def load_weights(self, tenant_id: str, request: s.LoadWeightsRequest) -> s.LoadWeightsResult:
        return self.policy_versions.load_weights(tenant_id, request)

    def install_weights(
        self, tenant_id: str, request: s.InstallWeightsRequest, installed_by: str
    ) -> s.InstalledWeights:
        return self.foreign.install(tenant_id, request, installed_by)

    def load_state(self, tenant_id: str, request: sc.LoadStateRequest) -> sc.LoadStateResult:
        return self.state_control.load_state(tenant_id, request)

    def fork(self, tenant_id: str, request: sc.ForkRequest, key_id: str) -> sc.TenantForked:
        return self.state_control.fork(tenant_id, request, key_id)

    def forks(self, tenant_id: str) -> sc.ForkList:
        return self.state_control.forks(tenant_id)

    def delete_fork(self, tenant_id: str, fork_tenant_id: str) -> dict:
        return self.state_control.delete_fork(tenant_id, fork_tenant_id)

    # -- lower-layer calls ------------------------------------------------------------------------
    def train_batch(self, tenant_id: str, batch: s.SampleBatch) -> s.TrainStepResult:
        return self.training.train_batch(tenant_id, batch)

    def forward_backward(self, tenant_id: str, request: s.ForwardBackwardRequest) -> s.ForwardBackwardResult:
        return self.training.forward_backward(tenant_id, request)

    def optim_step(self, tenant_id: str, request: s.OptimStepRequest | None = None) -> s.OptimStepResult:
        return self.training.optim_step(tenant_id, request)

    def sample(self, tenant_id: str, request: ss.SampleRequest, *, turn: Any = None) -> ss.SampleResult:
        return self.sampling.sample(tenant_id, request, turn=turn)

    def compute_logprobs(self, tenant_id: str, request: ss.ComputeLogprobsRequest) -> ss.ComputeLogprobsResult:
        return self.sampling.compute_logprobs(tenant_id, request)

    def predict(self, tenant_id: str, request: s.PredictRequest, request_key: str | None = None) -> s.PredictResult:
        return self.inference.predict(tenant_id, request, request_key)

    def cancel_predict(self, tenant_id: str, request_key: str) -> bool:
        return self.inference.cancel(tenant_id, request_key)

    def submit_call(self, tenant_id: str, kind: str, request: BaseModel | None) -> ss.FutureInfo:
        return self.futures.submit(tenant_id, kind, request)

    def collect_call(self, tenant_id: str, future_id: str, wait_s: float) -> tuple[ss.FutureInfo, BaseModel | None]:
        return self.futures.collect(tenant_id, future_id, wait_s)

    def forget_call_futures(self) -> None:
        self.futures.forget()

    # -- Training Queue partitions ----------------------------------------------------------------
    def queue_put(self, tenant_id: str, name: str, request: s.QueuePut) -> s.PartitionInfo:
        return self.queues.put(tenant_id, name, request)

    def queue_get(self, tenant_id: str, name: str, request: s.QueueGet) -> s.QueueBatch:
        return self.queues.get(tenant_id, name, request)

    def queue_clear(self, tenant_id: str, name: str) -> s.Cleared:
        return self.queues.clear(tenant_id, name)

    def queue_list(self, tenant_id: str) -> list[s.PartitionInfo]:
        return self.queues.list_partitions(tenant_id)

    def queue_describe(self, tenant_id: str, name: str) -> s.PartitionInfo:
        return self.queues.describe_partition(tenant_id, name)

    # -- environment sessions ---------------------------------------------------------------------
    def open_session(self, tenant_id: str, request: s.SessionOpen) -> s.SessionInfo:
        return self.env_sessions.open(tenant_id, request)

    def sessions(self, tenant_id: str) -> s.SessionList:
        return self.env_sessions.list_sessions(tenant_id)

    def reset_session(self, tenant_id: str, session_id: str, request: s.EnvReset) -> s.EnvResult:
        return self.env_sessions.reset(tenant_id, session_id, request)

    def step_session(self, tenant_id: str, session_id: str, request: s.EnvStep) -> s.EnvResult:
        return self.env_sessions.step(tenant_id, session_id, request)

    def close_session(self, tenant_id: str, session_id: str) -> s.Cleared:
        return self.env_sessions.close(tenant_id, session_id)

    # -- evaluation declarations ------------------------------------------------------------------
    def declare_evaluation(self, request: s.EvaluationDeclare) -> s.EvaluationDeclaration:
        return self.evaluations.declare(request)

    def evaluation(self, declaration_id: str, tenant_id: str | None) -> s.EvaluationDeclaration:
        return self.evaluations.get(declaration_id, tenant_id)


__all__ = ["ApiGateway", "ApiLimits", "manifest_model", "tenant_info", "timed_call"]
