"""Tenant-scoped operations of the API: every method takes the caller's tenant and reaches only
that tenant's slot, versions, checkpoints, serving states, queue partitions, sessions and workloads.

The HTTP layer (`joynexus.api.routers`) stays thin: it authenticates, then calls one method here.
The gateway checks request tensors against the tenant's schema (field, expected shape, received
shape), adds the tenant and schema annotations itself (a client never names a tenant), meters
usage, applies quotas, and turns service exceptions into `ApiError`s. Whatever an id of another
tenant would reach raises the same `NotFound` as an id that does not exist.

| module | what |
|---|---|
| `base.py` | the shared state (the typed `connect.Cluster`, keys, ledger, meter, limits), tenant lookup, admission |
| `tenants.py` | create / delete a tenant; `tenant_info` |
| `workloads.py` | submit (training or eval), follow, cancel workloads |
| `versions.py` | versions, checkpoint manifests, exports, save, load_weights and its payload checks |
| `training.py` | train_batch, forward_backward, optim_step (metered); `timed_call` |
| `inference.py` | predict through the shared Inference Queue |
| `queue.py` | Training Queue partitions |
| `environment.py` | environment sessions |
| `tensors.py` | request tensors against the tenant's schema; results onto the wire |
| `foreign.py` | install foreign weights (tenant or admin), evaluation declarations |
| `service_errors.py` | service exceptions as API errors |
| `state_control.py` | load_state, fork (issue 28.3) |
| `call_futures.py` | sample, compute_logprobs; futures of lower-layer calls (per-tenant ordered queue) |
"""

from __future__ import annotations

from joynexus.api.gateway.base import ApiLimits
from joynexus.api.gateway.call_futures import FutureOperations
from joynexus.api.gateway.environment import EnvironmentOperations
from joynexus.api.gateway.foreign import ForeignOperations
from joynexus.api.gateway.inference import InferenceOperations
from joynexus.api.gateway.queue import QueueOperations
from joynexus.api.gateway.state_control import StateControlOperations
from joynexus.api.gateway.tenants import TenantOperations, tenant_info
from joynexus.api.gateway.training import TrainingPrimitives, timed_call
from joynexus.api.gateway.versions import VersionOperations, manifest_model
from joynexus.api.gateway.workloads import WorkloadOperations


class ApiGateway(
    TenantOperations,
    WorkloadOperations,
    VersionOperations,
    TrainingPrimitives,
    InferenceOperations,
    QueueOperations,
    EnvironmentOperations,
    ForeignOperations,
    StateControlOperations,
    FutureOperations,
):
    """Every tenant-scoped operation of the API over one deployment (`GatewayBase` holds the state)."""


__all__ = ["ApiGateway", "ApiLimits", "manifest_model", "tenant_info", "timed_call"]
