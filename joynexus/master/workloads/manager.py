"""Master Service: the workload orchestrator (paper section 4.1.1).

A workload is one run of a tenant's declared task ("train 12 more SFT jobs"). The manager
materializes the roles it needs — for SFT a producer that turns the tenant's dataset into
Training Queue partitions — while ONE shared actor loop consumes every tenant's ready jobs from
the Training Scheduler, so tenants interleave on the single Training Model Service. On
completion the workload checkpoints, exports and registers the tenant's policy in MLflow.

`WorkloadManager` composes collaborators, each an object with its own state and a narrow
interface (as the Training Model Service is composed):

* live.py: `LiveWorkloads`, the workloads running now and those being finished (the one shared state);
* records.py: `WorkloadRecords`, the workload rows and event streams in the store;
* restarts.py: `ServiceWaits`, which errors mean a restarting service, and the bounded wait through one;
* admission.py: `Admission`, submit checks, quotas and the durable admission queue;
* training.py: `TrainingWorkloads`, the training-workload lifecycle (launch, outcomes, finish, publish);
* evaluation.py: `Evaluations`, evaluation workloads (their episodes run on a producer replica);
* promotion.py: `Promoter`, the promotion rule every publish goes through;
* follower.py: `ProducerFollower`, what the producer replicas report, applied;
* roles.py: `RoleSupervisor`, the Master's own threads (actor loop, producer follower, admission tick);
* recovery.py: `Reconciler`, the store brought in line with a Master that (re)starts.

The data work (producers, episodes, measurements, weight moves) runs on the producer replicas
(`deployment.producers`, `services/producers/`).

Durable: the admission queue IS the store (workloads in state `queued`, oldest first), workload
progress and events are rows, so a restarted Master Service continues: `reconcile()` re-queues or
fails the jobs a dead owner held, releases the jobs of workloads that ended, and resumes each
running workload from its recorded progress (or ends it `failed` with the reason it cannot resume).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self

from joynexus.master.errors import AdmissionRefused, UnknownWorkload
from joynexus.master.workloads.admission import Admission
from joynexus.master.workloads.evaluation import Evaluations
from joynexus.master.workloads.follower import ProducerFollower
from joynexus.master.workloads.live import CANCELLED, FINAL_WORKLOAD_STATES, WORKLOAD_FAILED, LiveWorkloads
from joynexus.master.workloads.promotion import Promoter
from joynexus.master.workloads.records import WorkloadRecords
from joynexus.master.workloads.recovery import Reconciler
from joynexus.master.workloads.restarts import ServiceWaits
from joynexus.master.workloads.roles import RoleSupervisor
from joynexus.master.workloads.training import TrainingWorkloads
from joynexus.protocol.schemas import WorkloadInfo

if TYPE_CHECKING:
    from joynexus.core.tenants import Tenant
    from joynexus.master.deployment import Deployment

# Importers of the manager's errors and states find them here.
__all__ = ["FINAL_WORKLOAD_STATES", "AdmissionRefused", "UnknownWorkload", "WorkloadManager"]


class WorkloadManager:
    def __init__(
        self,
        deployment: Deployment,
        *,
        owner: str = "master",
        max_running: int = 8,
        max_failures_per_workload: int = 3,
        admission_check: Callable[[str], None] | None = None,  # raises AdmissionRefused to stop new work
        max_queued: Callable[[str], int | None] | None = None,  # a tenant's limit of waiting workloads
        max_job_attempts: int = 3,  # a job whose lease owner died is re-queued at most this often
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.deployment = deployment
        self.live = LiveWorkloads()
        self.records = WorkloadRecords(deployment.store, self.live, on_event)
        self.waits = ServiceWaits(deployment.creator)
        self.promoter = Promoter(deployment, emit=self.records.emit, through_restarts=self.waits.through)
        parts = (deployment, self.records, self.live, self.waits)
        self.training = TrainingWorkloads(
            *parts, self.promoter, admit=lambda: self.admission.admit(), max_failures=max_failures_per_workload
        )
        self.admission = Admission(
            *parts, launch=self.training.launch, fail=lambda w, why: self.training.finish(w, WORKLOAD_FAILED, why),
            max_running=max_running, check=admission_check, max_queued=max_queued,
        )  # fmt: skip
        self.evaluations = Evaluations(
            deployment, self.records, self.waits, check=self.admission.check,
            publish_weights=self.training.publish_weights,
        )  # fmt: skip
        self.follower = ProducerFollower(
            *parts, training=self.training, evaluations=self.evaluations,
            recover_orphans=lambda: self.roles.recover_orphans(),
        )  # fmt: skip
        self.roles = RoleSupervisor(
            deployment, self.waits, training=self.training, follow=self.follower.step, admit=self.admission.admit,
            producer_restarts=lambda: self.follower.restarts, owner=owner, max_job_attempts=max_job_attempts,
        )  # fmt: skip
        self.reconciler = Reconciler(
            deployment, self.records, training=self.training, evaluations=self.evaluations,
            actor_owner=self.roles.actor_owner, max_job_attempts=max_job_attempts,
        )  # fmt: skip
        deployment.producers.on_move = self.training.on_producer_moved

    # -- what the Master Service sets once its Health Manager runs ---------------------------------
    @property
    def on_unavailable(self) -> Callable[[str], None] | None:
        """Called when a role finds a service down or restarting (the Health Manager checks at once)."""
        return self.waits.on_unavailable

    @on_unavailable.setter
    def on_unavailable(self, listener: Callable[[str], None] | None) -> None:
        self.waits.on_unavailable = listener

    @property
    def admission_paused(self) -> Callable[[], bool] | None:
        """True while admission is paused (a hung role escalated by the Health Manager); queued work waits."""
        return self.admission.paused

    @admission_paused.setter
    def admission_paused(self, paused: Callable[[], bool] | None) -> None:
        self.admission.paused = paused

    # -- lifecycle ----------------------------------------------------------------------------------
    @property
    def actor_owner(self) -> str:
        return self.roles.actor_owner

    def start(self) -> Self:
        """Start the Master's own roles (actor loop, producer follower, admission tick)."""
        self.roles.start()
        return self

    def stop(self, *, cancel_running: bool = True) -> None:
        """Stop the Master's roles. `cancel_running=False` leaves running workloads `running` in the
        store and their producers running on their replicas (a Master restarting follows them again)."""
        for workload in self.live.all():
            if cancel_running:
                self.cancel(workload.workload_id)
            else:
                workload.stop.set()
        self.live.close()
        self.roles.stop()

    def reconcile(self, *, has_partition: Callable[[str], bool] | None = None) -> dict[str, Any]:
        """Bring the store in line with a Master that (re)starts now; call before `start()` (recovery.py)."""
        return self.reconciler.reconcile(has_partition)

    def check_roles(self, stale_after_s: float) -> dict[str, dict[str, Any]]:
        return self.roles.check_roles(stale_after_s)

    def live_owners(self) -> set[str]:
        return self.roles.live_owners()

    # -- workloads ----------------------------------------------------------------------------------
    def submit(self, tenant_id: str, *, jobs: int | None = None, dataset: dict | None = None) -> WorkloadInfo:
        return self.admission.submit(tenant_id, jobs=jobs, dataset=dataset)

    def admit(self) -> None:
        self.admission.admit()

    def evaluate(
        self,
        tenant_id: str,
        *,
        version: int | str = "latest",
        episodes: int = 4,
        environment: dict[str, Any] | None = None,
        suite: list[dict[str, Any]] | None = None,
        videos: int = 0,
    ) -> WorkloadInfo:
        """Start an evaluation workload at ONE policy version (`Evaluations.evaluate`)."""
        return self.evaluations.evaluate(
            tenant_id, version=version, episodes=episodes, environment=environment, suite=suite, videos=videos
        )

    def cancel(self, workload_id: str, tenant_id: str | None = None) -> WorkloadInfo:
        status = self.get(workload_id, tenant_id)
        if status.state in FINAL_WORKLOAD_STATES:
            return status
        self.training.finish(workload_id, CANCELLED, error="cancelled by request")
        return self.get(workload_id)

    def get(self, workload_id: str, tenant_id: str | None = None) -> WorkloadInfo:
        return self.records.get(workload_id, tenant_id)

    def list(self, tenant_id: str | None = None) -> list[WorkloadInfo]:
        return self.records.list(tenant_id)

    def events(self, workload_id: str, after: int = 0, tenant_id: str | None = None) -> list[dict[str, Any]]:
        return self.records.events(workload_id, after, tenant_id)

    def count(self, tenant_id: str, state: str) -> int:
        return self.records.count(tenant_id, state)

    def running_count(self) -> int:
        return self.live.count()

    def wait(self, workload_id: str, timeout_s: float = 3600.0) -> WorkloadInfo:
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.get(workload_id)
            if status.state in FINAL_WORKLOAD_STATES or time.monotonic() >= deadline:
                return status
            self.records.wait_for_change(min(0.5, max(0.0, deadline - time.monotonic())))

    def wait_all(self, workload_ids: list[str], timeout_s: float = 3600.0) -> list[WorkloadInfo]:
        deadline = time.monotonic() + timeout_s
        return [self.wait(w, max(0.0, deadline - time.monotonic())) for w in workload_ids]

    def losses(self, workload_id: str) -> list[float]:
        running = self.live.get(workload_id)
        if running is not None:
            return running.loss_history()
        return [e["loss"] for e in self.events(workload_id) if e["kind"] == "step"]

    # -- weights and promotion ----------------------------------------------------------------------
    def publish_weights(self, tenant_id: str) -> int:
        return self.training.publish_weights(tenant_id)

    def promote(self, tenant_id: str, registry_version: int | None = None, *, measure: bool = True) -> dict[str, Any]:
        return self.promoter.promote(tenant_id, registry_version, measure=measure)

    def measure_version(self, tenant: Tenant, registry_version: int, policy_version: int) -> dict[str, float]:
        return self.promoter.measure_version(tenant, registry_version, policy_version)
