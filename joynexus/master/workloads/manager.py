"""Master Service: the workload orchestrator (paper section 4.1.1).

A workload is one run of a tenant's declared task ("train 12 more SFT jobs"). The manager
materializes the roles it needs — for SFT a producer that turns the tenant's dataset into
Training Queue partitions — while ONE shared actor loop consumes every tenant's ready jobs from
the Training Scheduler, so tenants interleave on the single Training Model Service. On
completion the workload checkpoints, exports and registers the tenant's policy in MLflow.

Admission: one running workload per tenant (its training policy has one completion target) and at
most `max_running` overall; further submissions wait in FIFO order with a visible position.

Durable: the admission queue IS the store (workloads in state `queued`, oldest first), workload
progress and events are rows, so a restarted Master Service continues: `reconcile()` re-queues or
fails the jobs a dead owner held, releases the jobs of workloads that ended, and resumes each
running workload from its recorded progress (or ends it `failed` with the reason it cannot resume).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict
from sqlalchemy import func, select

from joynexus.actors import role_unavailable
from joynexus.core.store import WorkloadEventRecord, WorkloadRecord, utcnow
from joynexus.core.tenants import Tenant
from joynexus.master.loops.actor_loop import ActorLoop, ActorOutcome
from joynexus.master.loops.advantage_stage import AdvantageStage
from joynexus.master.loops.rollout import NoServingVersion, RolloutProducer, evaluate_policy
from joynexus.master.loops.sft_producer import SFTProducer
from joynexus.scheduling.training_scheduler import COMPLETED, TERMINAL_STATES
from joynexus.services.environment.service import SessionLimitExceeded
from joynexus.services.training.service import UnknownTenant

log = logging.getLogger(__name__)

QUEUED, RUNNING = "queued", "running"
WORKLOAD_COMPLETED, WORKLOAD_FAILED, CANCELLED = "completed", "failed", "cancelled"
FINAL_WORKLOAD_STATES = frozenset({WORKLOAD_COMPLETED, WORKLOAD_FAILED, CANCELLED})


class WorkloadStatus(BaseModel):
    model_config = ConfigDict(frozen=True)

    workload_id: str
    tenant_id: str
    task: str
    state: str
    position: int | None = None  # 1-based place in the admission queue while queued
    completed_jobs: int = 0
    target_jobs: int = 0
    version: int = 0
    optimizer_steps: int = 0
    last_loss: float | None = None
    registered_version: int | None = None
    run_id: str | None = None
    error: str | None = None
    created_at: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    result: dict[str, Any] | None = None  # evaluation workloads: success rate, returns, lengths


class UnknownWorkload(KeyError):
    def __init__(self, workload_id: str):
        self.workload_id = workload_id
        super().__init__(f"no workload {workload_id!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.workload_id,))


class AdmissionRefused(RuntimeError):
    """Raised by an admission hook to refuse new work (e.g. a spend cap was reached)."""


@dataclass
class _Active:
    workload_id: str
    tenant: Tenant
    target_jobs: int
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    completed_jobs: int = 0
    failed_jobs: int = 0
    optimizer_steps: int = 0
    losses: list[float] = field(default_factory=list)
    version: int = 0
    run_id: str | None = None
    failures: list[str] = field(default_factory=list)
    producer: Any = None
    resumed: bool = False


R = TypeVar("R")
ROLE_NAMES = ("actor_loop", "advantage_stage", "admission")
MAX_OUTAGE_RETRIES = 120  # a producer waits this many seconds at most for a restarting service


@dataclass(eq=False)
class _Role:
    """One of the Master's own roles: a thread that beats on every iteration."""

    name: str
    generation: int
    restarts: int
    stop: threading.Event
    last_reason: str | None = None
    owner: str = ""
    thread: threading.Thread = field(default_factory=threading.Thread)
    beat: float = field(default_factory=time.monotonic)
    error: str | None = None


class WorkloadManager:
    def __init__(
        self,
        deployment: Any,  # joynexus.master.deployment.Deployment or anything with the same attributes
        *,
        owner: str = "master",
        max_running: int = 8,
        max_failures_per_workload: int = 3,
        max_concurrent_rollouts: int = 4,
        admission_check: Callable[[str], None] | None = None,  # raises AdmissionRefused to stop new work
        max_queued: Callable[[str], int | None] | None = None,  # a tenant's limit of waiting workloads
        max_job_attempts: int = 3,  # a job whose lease owner died is re-queued at most this often
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.dep = deployment
        self.owner = owner  # lease owner prefix of this Master's actor loop and advantage stage
        self.max_running = max_running
        self.max_failures = max_failures_per_workload
        self.admission_check = admission_check
        self.max_queued = max_queued
        self.max_job_attempts = max_job_attempts
        self.on_event = on_event
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._active: dict[str, _Active] = {}
        self._stop = threading.Event()
        self._roles: dict[str, _Role] = {}  # the Master's own roles, restartable in place
        self._admission = threading.RLock()  # reentrant: a launch that fails finishes, which admits
        self._producer_restarts = 0
        # Called when a role finds a service down or restarting (the Health Manager checks at once).
        self.on_unavailable: Callable[[str], None] | None = None
        self._rollout_slots = threading.BoundedSemaphore(max_concurrent_rollouts)
        # Workloads being finished (publish, export) -> their tenant: the tenant's next workload
        # waits until its policy is published, so it never trains under a concurrent export.
        self._finishing: dict[str, str] = {}

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> WorkloadManager:
        """Start the Master's own roles (actor loop, advantage stage, admission), each a thread that
        beats on every iteration; `check_roles` restarts one that died or stopped beating."""
        for name in ROLE_NAMES:
            with self._lock:
                running = name in self._roles and self._roles[name].thread.is_alive()
            if not running:
                self._start_role(name)
        return self

    def _start_role(self, name: str, *, reason: str | None = None) -> None:
        with self._lock:
            previous = self._roles.get(name)
            generation = previous.generation + 1 if previous is not None else 0
            restarts = previous.restarts + (1 if reason else 0) if previous is not None else 0
            role = _Role(name, generation, restarts, threading.Event(), last_reason=reason)
            owner = self._role_owner(name, generation)
            if name == "actor_loop":
                actor = ActorLoop(
                    self.dep.scheduler, self.dep.training_service, owner=owner, on_outcome=self._on_outcome,
                    on_unavailable=self.on_unavailable, max_attempts=self.max_job_attempts,
                    service_restarting=self._service_restarting, retired=role.stop,
                )  # fmt: skip
                step: Callable[[], Any] = lambda: actor.step(0.2)  # noqa: E731
            elif name == "advantage_stage":
                stage = AdvantageStage(
                    self.dep.scheduler,
                    self.dep.queue,
                    lambda tenant_id: self.dep.creator.get(tenant_id).backend_config,
                    owner=owner,
                )

                def step() -> None:
                    if stage.step() is None:
                        role.stop.wait(0.05)
            else:

                def step() -> None:
                    try:
                        self._admit()
                    except Exception:  # a store hiccup: the next tick tries again
                        log.exception("admission tick failed")
                    # Admit on a timer too, not only on submit/finish: the queue is the store, so
                    # work queued by another path (a restart, a raced finish) starts within a second.
                    role.stop.wait(1.0)

            role.owner = owner
            role.thread = threading.Thread(target=self._run_role, args=(role, step), name=name, daemon=True)
            self._roles[name] = role
        role.thread.start()

    def _role_owner(self, name: str, generation: int) -> str:
        base = {"actor_loop": self.actor_owner, "advantage_stage": self.stage_owner}.get(name, f"{self.owner}/{name}")
        return base if generation == 0 else f"{base}#{generation}"

    def _run_role(self, role: _Role, step: Callable[[], Any]) -> None:
        """A role's loop: beat, do one step. An exception ends the thread (the Health Manager sees it
        dead and restarts it in place); a role replaced while hung exits when it wakes up."""
        try:
            while not self._stop.is_set() and not role.stop.is_set():
                role.beat = time.monotonic()
                step()
        except Exception as error:
            role.error = f"{type(error).__name__}: {error}"
            log.exception("role %s died", role.name)

    def _tenant_exists(self, tenant_id: str) -> bool:
        try:
            self.dep.creator.get(tenant_id)
            return True
        except KeyError:
            return False

    def live_owners(self) -> set[str]:
        """The lease owners of this Master's current roles."""
        with self._lock:
            return {role.owner for role in self._roles.values()}

    def check_roles(self, stale_after_s: float) -> dict[str, dict[str, Any]]:
        """Restart in place each role that died, or stopped beating for `stale_after_s` (a hung
        thread cannot be killed: a replacement with a new lease owner takes over, the hung one's
        leases are re-queued, and whatever it finishes later is refused as a lost lease). Returns
        each role's health, producers of running workloads included."""
        now = time.monotonic()
        restart: list[tuple[str, str]] = []
        with self._lock:
            if self._stop.is_set():
                return {}
            for name, role in self._roles.items():
                if not role.thread.is_alive():
                    restart.append((name, f"died: {role.error or 'the thread ended'}"))
                elif now - role.beat > stale_after_s:
                    restart.append((name, f"no heartbeat for {now - role.beat:.0f} s"))
        for name, reason in restart:
            log.warning("restarting role %s in place: %s", name, reason)
            with self._lock:
                self._roles[name].stop.set()
            self._start_role(name, reason=reason)
        if any("heartbeat" in reason for _, reason in restart):
            self.dep.scheduler.recover_orphans(
                self.live_owners(), has_partition=self.dep.queue.has_partition, max_attempts=self.max_job_attempts
            )
        report: dict[str, dict[str, Any]] = {}
        with self._lock:
            for name, role in self._roles.items():
                report[name] = {
                    "healthy": role.thread.is_alive() and now - role.beat <= stale_after_s,
                    "last_beat_s": round(now - role.beat, 3),
                    "restarts": role.restarts,
                    "detail": role.last_reason or f"owner {role.owner}",
                }
            producers = [
                (a.workload_id, a.threads) for a in self._active.values() if a.workload_id not in self._finishing
            ]
        alive = sum(1 for _, threads in producers if any(t.is_alive() for t in threads))
        report["producers"] = {
            "healthy": alive == len(producers),
            "restarts": self._producer_restarts,
            "detail": f"{alive} of {len(producers)} running workloads have a live producer",
        }
        return report

    @property
    def actor_owner(self) -> str:
        return f"{self.owner}/actor"

    @property
    def stage_owner(self) -> str:
        return f"{self.owner}/advantages"

    def stop(self, *, cancel_running: bool = True) -> None:
        """Stop the actor loop and advantage stage. `cancel_running=False` leaves running workloads
        `running` in the store (a Master shutting down for a restart resumes them)."""
        with self._lock:
            active = list(self._active.values())
        for entry in active:
            if cancel_running:
                self.cancel(entry.workload_id)
            else:
                entry.stop.set()
        self._stop.set()
        for entry in active:  # producers finish the job they are writing; the next Master resumes the rest
            for thread in entry.threads:
                if thread is not threading.current_thread():
                    thread.join(timeout=60)
        with self._lock:
            roles = list(self._roles.values())
        for role in roles:
            role.stop.set()
            if role.thread is not threading.current_thread():
                role.thread.join(timeout=60)

    def reconcile(self, *, has_partition: Callable[[str], bool] | None = None) -> dict[str, Any]:
        """Bring the store in line with a Master that (re)starts now (paper 4.4: restart from
        recorded progress). Call before `start()`. Leases held by another owner (a dead Master's
        actor loop or advantage stage) are re-queued or failed with bounded retries; jobs of
        workloads that ended are released; jobs a dead producer was still writing are failed; each
        running training workload resumes from its recorded progress, or ends `failed` with the
        reason; an evaluation interrupted midway ends `failed` (it is cheap to submit again)."""
        has_partition = has_partition or self.dep.queue.has_partition
        report: dict[str, Any] = {"requeued": [], "released": [], "resumed": [], "failed": []}
        recovered = self.dep.scheduler.recover_orphans(
            {self.actor_owner, self.stage_owner}, has_partition=has_partition, max_attempts=self.max_job_attempts
        )
        report["requeued"] = [j.job_id for j in recovered if j.state not in TERMINAL_STATES]
        report["released"] = [j.job_id for j in recovered if j.state in TERMINAL_STATES]
        with self.dep.store.transaction() as s:
            states = {r.workload_id: (r.state, r.task) for r in s.scalars(select(WorkloadRecord))}
        for job in self.dep.scheduler.jobs():
            if job.state in TERMINAL_STATES:
                continue
            workload_id = job.metadata.get("workload_id")
            state, _task = states.get(workload_id, (None, None))
            reason = None
            if state != RUNNING:
                reason = f"workload {workload_id} is {state or 'unknown'}"
            elif job.state == "reserved":
                reason = "its producer stopped with the previous Master Service before the data was written"
            elif not has_partition(job.partition_id):
                reason = "its partition was lost with the Training Queue"
            if reason is not None:
                self.dep.scheduler.abandon(job.job_id, f"reconciled after a restart: {reason}")
                report["released"].append(job.job_id)
        for workload_id, (state, task) in states.items():
            if state != RUNNING:
                continue
            if task == "eval":
                try:  # an evaluation is cheap and its episodes are seeded by index: run it again whole
                    self._rerun_evaluation(workload_id)
                    report["resumed"].append(workload_id)
                except Exception as error:
                    reason = f"interrupted by a restart of the Master Service and cannot run again: {error}"
                    self._fail_record(workload_id, reason)
                    report["failed"].append(workload_id)
                continue
            try:
                self._resume(workload_id)
                report["resumed"].append(workload_id)
            except Exception as error:
                log.exception("workload %s cannot resume", workload_id)
                self._fail_record(workload_id, f"cannot resume after a restart: {type(error).__name__}: {error}")
                report["failed"].append(workload_id)
        return report

    def _resume(self, workload_id: str) -> None:
        with self.dep.store.transaction() as s:
            record = s.get(WorkloadRecord, workload_id)
            target, completed, version, steps, run_id, tenant_id = (
                record.target_jobs, record.completed_jobs, record.version, record.optimizer_steps, record.run_id,
                record.tenant_id,
            )  # fmt: skip
        # The scheduler is the truth for jobs: the dead Master may have completed one whose progress
        # row it did not write yet; counting from the record alone would train one job too many.
        done = sum(
            1
            for job in self.dep.scheduler.jobs(tenant_id=tenant_id, states=[COMPLETED])
            if job.metadata.get("workload_id") == workload_id
        )
        completed = max(completed, done)
        tenant = self.dep.creator.get(tenant_id)
        if getattr(tenant, "status", "active") != "active":
            raise RuntimeError(f"tenant {tenant_id!r} is {tenant.status}: {getattr(tenant, 'status_reason', '')}")
        active = _Active(workload_id, tenant, target, resumed=True)
        active.completed_jobs, active.version, active.optimizer_steps, active.run_id = completed, version, steps, run_id
        with self._lock:
            self._active[workload_id] = active
        if completed >= target:
            self._finish(workload_id, WORKLOAD_COMPLETED)
            return
        try:
            self._launch(active)
        except Exception:
            with self._lock:
                self._active.pop(workload_id, None)
            raise

    def _fail_record(self, workload_id: str, reason: str) -> None:
        with self.dep.store.transaction() as s:
            record = s.get(WorkloadRecord, workload_id)
            record.state, record.error, record.finished_at = WORKLOAD_FAILED, reason, utcnow()
        self._emit(workload_id, WORKLOAD_FAILED, error=reason)

    def admit(self) -> None:
        """Start queued workloads while capacity allows (also after a restart)."""
        self._admit()

    def running_count(self) -> int:
        with self._lock:
            return len(self._active)

    def count(self, tenant_id: str, state: str) -> int:
        return self._count(tenant_id, state)

    def publish_weights(self, tenant_id: str) -> int:
        return self._publish_weights(tenant_id)

    def _count(self, tenant_id: str, state: str) -> int:
        query = select(func.count()).where(WorkloadRecord.tenant_id == tenant_id, WorkloadRecord.state == state)
        with self.dep.store.transaction() as s:
            return int(s.scalar(query) or 0)

    # -- API --------------------------------------------------------------------------------
    def submit(self, tenant_id: str, *, jobs: int | None = None) -> WorkloadStatus:
        """Queue a workload running the tenant's declared task for `jobs` training jobs (default:
        the spec's completion target)."""
        tenant = self.dep.creator.get(tenant_id)
        task = tenant.spec.task.value
        if task not in ("sft", "rl"):
            raise ValueError(
                f"task: tenant {tenant_id!r} is a {task!r} tenant; training workloads run 'sft' or 'rl' tenants "
                "(evaluate any tenant with evaluate())"
            )
        target = jobs if jobs is not None else tenant.spec.scheduling.completion_target
        if target is None or target < 1:
            raise ValueError("jobs: give the number of training jobs (>= 1); the spec has no completion_target")
        if self.admission_check is not None:
            self.admission_check(tenant_id)
        workload_id = f"wl-{uuid.uuid4().hex[:12]}"
        if self.max_queued is not None:
            limit = self.max_queued(tenant_id)
            queued = self._count(tenant_id, QUEUED)
            if limit is not None and queued >= limit:
                raise AdmissionRefused(
                    f"{queued} workloads of tenant {tenant_id!r} are already waiting (quota.max_queued_workloads = "
                    f"{limit}); wait for one to start or cancel one"
                )
        with self.dep.store.transaction() as s:
            s.add(
                WorkloadRecord(
                    workload_id=workload_id, tenant_id=tenant_id, task=task, state=QUEUED, target_jobs=target
                )
            )
        self._emit(workload_id, "queued", target_jobs=target)
        self._admit()
        return self.get(workload_id)

    def evaluate(
        self,
        tenant_id: str,
        *,
        version: int | str = "latest",
        episodes: int = 4,
        environment: dict[str, Any] | None = None,
    ) -> WorkloadStatus:
        """Start an evaluation workload (paper 4.2): episodes through the Inference Queue and the
        Environment Service at ONE policy version, resolved once at the start. No training job,
        no partition, no version change. `environment` overrides the tenant's declared one."""
        tenant = self.dep.creator.get(tenant_id)
        config = self._evaluation_config(tenant, environment)
        if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
            raise ValueError(f"episodes: expected an int >= 1, got {episodes!r}")
        if version != "latest" and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"version: expected a policy version (an int >= 0) or 'latest', got {version!r}")
        if self.admission_check is not None:
            self.admission_check(tenant_id)
        if self.dep.inference_service.latest_version(tenant_id) is None:
            # Never served yet (e.g. an SFT tenant): serve its current trained state, read-only.
            self.dep.training_service.add_tenant(tenant.backend_config)
            self._publish_weights(tenant_id)
        resolved = self.dep.inference_service.latest_version(tenant_id) if version == "latest" else version
        if resolved is None:
            raise ValueError(f"version: tenant {tenant_id!r} has no policy version being served")
        self._serve_version(tenant_id, resolved)
        workload_id = f"ev-{uuid.uuid4().hex[:12]}"
        with self.dep.store.transaction() as s:
            s.add(
                WorkloadRecord(
                    workload_id=workload_id, tenant_id=tenant_id, task="eval", state=RUNNING, target_jobs=0,
                    version=resolved, started_at=utcnow(),
                )
            )  # fmt: skip
        self._emit(workload_id, "started", version=resolved, episodes=episodes, environment=environment)
        self._start_evaluation(workload_id, tenant_id, resolved, episodes, config)
        return self.get(workload_id)

    def _start_evaluation(self, workload_id: str, tenant_id: str, resolved: int, episodes: int, config: Any) -> None:
        def run() -> None:
            run_id = None
            try:
                run_id = self.dep.tracker.start_workload_run(
                    tenant_id,
                    workload_id,
                    {"policy_version": resolved, "episodes": episodes, **config.environment},
                    tags={"task": "eval"},
                )

                # Episodes are seeded by index, so an evaluation cut by a restarting service
                # runs again whole with the same result it would have had.
                def evaluate() -> Any:
                    self._serve_version(tenant_id, resolved)  # a restarted service lost what it served
                    return evaluate_policy(
                        config, self.dep.environment_service, self.dep.inference_service, version=resolved,
                        episodes=episodes,
                    )  # fmt: skip

                result = self._through_restarts(evaluate, tenant_id, "evaluation")
                metrics = {
                    "eval/success_rate": result.success_rate,
                    "eval/mean_return": result.mean_return,
                    "eval/mean_length": result.mean_length,
                }
                self.dep.tracker.log_metrics(run_id, metrics, step=resolved)
                self.dep.tracker.end_run(run_id, "FINISHED")
                self._emit(workload_id, "evaluated", version=resolved, **metrics)  # a learning signal too
                summary = {**dataclasses.asdict(result), "returns": list(result.returns)}
                with self.dep.store.transaction() as s:
                    record = s.get(WorkloadRecord, workload_id)
                    record.state, record.finished_at, record.result, record.run_id = (
                        WORKLOAD_COMPLETED,
                        utcnow(),
                        summary,
                        run_id,
                    )
                self._emit(workload_id, WORKLOAD_COMPLETED, result=summary)
            except Exception as error:
                reason = f"{type(error).__name__}: {error}"
                log.warning("evaluation %s failed: %s", workload_id, reason)
                if run_id is not None:
                    self.dep.tracker.end_run(run_id, "FAILED")
                with self.dep.store.transaction() as s:
                    record = s.get(WorkloadRecord, workload_id)
                    record.state, record.finished_at, record.error = WORKLOAD_FAILED, utcnow(), reason
                self._emit(workload_id, WORKLOAD_FAILED, error=reason)

        threading.Thread(target=run, name=f"evaluation-{tenant_id}", daemon=True).start()

    def _rerun_evaluation(self, workload_id: str) -> None:
        """Run an evaluation a dead Master left `running` again, from what its `started` event says."""
        started = [e for e in self.events(workload_id) if e["kind"] == "started"]
        if not started or "episodes" not in started[-1]:
            raise RuntimeError("its start was not recorded")
        with self.dep.store.transaction() as s:
            tenant_id, resolved = (lambda r: (r.tenant_id, r.version))(s.get(WorkloadRecord, workload_id))
        tenant = self.dep.creator.get(tenant_id)
        config = self._evaluation_config(tenant, started[-1].get("environment"))
        self._through_restarts(lambda: self._serve_version(tenant_id, resolved), tenant_id, "serving")
        self._emit(workload_id, "resumed", version=resolved)
        self._start_evaluation(workload_id, tenant_id, resolved, int(started[-1]["episodes"]), config)

    def _evaluation_config(self, tenant: Tenant, environment: dict[str, Any] | None) -> Any:
        """The tenant's backend config with the environment to evaluate in, checked before anything
        starts: the simulator is registered, the task exists, and the simulator renders the cameras
        and gives the state / action dims the tenant's schema needs (an environment other than the
        one the tenant creator probed at creation is probed here). ValueError("field: reason")."""
        from pydantic import ValidationError

        from joynexus.core.tenants import simulator_config
        from joynexus.envs import available_simulators
        from joynexus.spec import EnvironmentSpec

        config = tenant.backend_config
        if environment is None:
            if config.environment is None:
                raise ValueError(f"environment: tenant {tenant.tenant_id!r} declares none; pass one to evaluate in")
            return config  # probed when the tenant was created
        if not isinstance(environment, dict):
            raise ValueError(f"environment: expected a mapping (simulator, task, ...), not {type(environment)}")
        try:
            spec = EnvironmentSpec(**environment)
        except ValidationError as error:
            item = error.errors()[0]
            where = ".".join(str(part) for part in item["loc"])
            raise ValueError(f"environment.{where}: {item['msg']}") from None
        if spec.simulator not in available_simulators():
            raise ValueError(
                f"environment.simulator: {spec.simulator!r} is not a registered simulator; known: "
                f"{available_simulators()}"
            )
        config = config.model_copy(update={"environment": spec.model_dump(mode="json")})
        probe = getattr(getattr(self.dep.creator, "compiler", None), "environment_probe", None)
        if probe is None:
            return config
        try:
            sim = probe(simulator_config(config))
        except Exception as error:  # the adapter refused: a bad task, cameras it cannot render, ...
            text = (str(error).strip().splitlines() or [type(error).__name__])[0]
            field = next(
                (f for f in ("cameras", "control_mode", "reward_mode", "max_episode_steps") if text.startswith(f)),
                "task",
            )
            raise ValueError(f"environment.{field}: {text}") from None
        if tuple(sim["cameras"]) != tuple(config.cameras):
            raise ValueError(
                f"environment.cameras: the tenant's schema needs cameras {list(config.cameras)}, "
                f"{spec.simulator}/{spec.task} renders {list(sim['cameras'])}"
            )
        for name, ours in (("state_dim", config.state_dim), ("action_dim", config.action_dim)):
            if int(sim[name]) != ours:
                raise ValueError(
                    f"environment.task: {spec.simulator}/{spec.task} gives {name} {sim[name]}, "
                    f"the tenant's schema needs {ours}"
                )
        return config

    def _serve_version(self, tenant_id: str, version: int) -> None:
        """Make `version` servable for the evaluation: served already, or loaded from its checkpoint;
        ValueError("version: ...") naming what exists otherwise."""
        served = self.dep.inference_service.versions(tenant_id)
        if version in served:
            return
        store = getattr(self.dep, "checkpoints", None)
        checkpoints = store.versions(tenant_id) if store is not None else []
        if version not in checkpoints:
            raise ValueError(
                f"version: tenant {tenant_id!r} has no policy version {version} (served: {served}, "
                f"checkpoints: {checkpoints})"
            )
        from joynexus.artifacts import encode_tenant_payload

        manifest, module_state, _ = self.dep.checkpoints.load_tenant(tenant_id, version)
        self.dep.inference_service.load_weights(encode_tenant_payload(module_state, manifest))

    def get(self, workload_id: str, tenant_id: str | None = None) -> WorkloadStatus:
        with self.dep.store.transaction() as s:
            record = s.get(WorkloadRecord, workload_id)
            if record is None or (tenant_id is not None and record.tenant_id != tenant_id):
                raise UnknownWorkload(workload_id)  # another tenant's id looks exactly like a missing one
            return self._status(record, s)

    def list(self, tenant_id: str | None = None) -> list[WorkloadStatus]:
        query = select(WorkloadRecord).order_by(WorkloadRecord.created_at)
        if tenant_id is not None:
            query = query.where(WorkloadRecord.tenant_id == tenant_id)
        with self.dep.store.transaction() as s:
            return [self._status(r, s) for r in s.scalars(query)]

    def cancel(self, workload_id: str, tenant_id: str | None = None) -> WorkloadStatus:
        status = self.get(workload_id, tenant_id)
        if status.state in FINAL_WORKLOAD_STATES:
            return status
        self._finish(workload_id, CANCELLED, error="cancelled by request")
        return self.get(workload_id)

    def events(self, workload_id: str, after: int = 0, tenant_id: str | None = None) -> list[dict[str, Any]]:
        self.get(workload_id, tenant_id)
        query = (
            select(WorkloadEventRecord)
            .where(WorkloadEventRecord.workload_id == workload_id, WorkloadEventRecord.seq > after)
            .order_by(WorkloadEventRecord.seq)
        )
        with self.dep.store.transaction() as s:
            return [_event_dict(r) for r in s.scalars(query)]

    def wait(self, workload_id: str, timeout_s: float = 3600.0) -> WorkloadStatus:
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.get(workload_id)
            if status.state in FINAL_WORKLOAD_STATES or time.monotonic() >= deadline:
                return status
            with self._changed:
                self._changed.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))

    def wait_all(self, workload_ids: list[str], timeout_s: float = 3600.0) -> list[WorkloadStatus]:
        deadline = time.monotonic() + timeout_s
        return [self.wait(w, max(0.0, deadline - time.monotonic())) for w in workload_ids]

    def losses(self, workload_id: str) -> list[float]:
        with self._lock:
            active = self._active.get(workload_id)
            if active is not None:
                return list(active.losses)
        return [e["loss"] for e in self.events(workload_id) if e["kind"] == "step"]

    # -- internals --------------------------------------------------------------------------
    def _status(self, record: WorkloadRecord, session: Any) -> WorkloadStatus:
        position = None
        if record.state == QUEUED:
            ahead = select(func.count()).where(
                WorkloadRecord.state == QUEUED, WorkloadRecord.created_at < record.created_at
            )
            position = int(session.scalar(ahead) or 0) + 1  # the caller's transaction: one at a time
        with self._lock:
            active = self._active.get(record.workload_id)
        live = {}
        if active is not None:
            live = {
                "completed_jobs": active.completed_jobs,
                "version": active.version,
                "optimizer_steps": active.optimizer_steps,
                "last_loss": active.losses[-1] if active.losses else None,
                "run_id": active.run_id,
            }
        base = {
            "workload_id": record.workload_id,
            "tenant_id": record.tenant_id,
            "task": record.task,
            "state": record.state,
            "position": position,
            "completed_jobs": record.completed_jobs,
            "target_jobs": record.target_jobs,
            "version": record.version,
            "optimizer_steps": record.optimizer_steps,
            "last_loss": record.last_loss,
            "registered_version": record.registered_version,
            "run_id": record.run_id,
            "error": record.error,
            "created_at": _iso(record.created_at),
            "started_at": _iso(record.started_at),
            "finished_at": _iso(record.finished_at),
            "result": record.result,
        }
        return WorkloadStatus(**{**base, **live})

    def _emit(self, workload_id: str, kind: str, **data: Any) -> None:
        self._emit_many(workload_id, [(kind, data)])

    def _emit_many(self, workload_id: str, events: list[tuple[str, dict[str, Any]]]) -> None:
        """Append events (kind, data) to the workload's stream in ONE transaction (a job's step
        events come together)."""
        now = time.time()
        with self.dep.store.transaction() as s:
            record = s.get(WorkloadRecord, workload_id)
            tenant_id = record.tenant_id if record is not None else ""
            rows = [
                WorkloadEventRecord(
                    workload_id=workload_id, tenant_id=tenant_id, kind=kind, data=_jsonable(data), time=now
                )
                for kind, data in events
            ]
            s.add_all(rows)
            s.flush()
            emitted = [_event_dict(row) for row in rows]
        with self._lock:
            self._changed.notify_all()
        if self.on_event is not None:
            for event in emitted:
                self.on_event(event)

    def _admit(self) -> None:
        """Start queued workloads in FIFO order while capacity allows (skipping tenants that
        already run one, without letting them lose their place). One admission at a time: a
        submit returns after a launch in progress (the timer's) has marked its workload running."""
        with self._admission:
            self._admit_unlocked()

    def _admit_unlocked(self) -> None:
        to_start = []
        waiting = select(WorkloadRecord).where(WorkloadRecord.state == QUEUED).order_by(WorkloadRecord.created_at)
        with self.dep.store.transaction() as s:
            queued = [(r.workload_id, r.tenant_id, r.target_jobs) for r in s.scalars(waiting)]
        # Store reads happen before taking self._lock, never under it: readers hold a transaction
        # while they take the lock (_status), so the other order would deadlock on SQLite.
        tenants: dict[str, Tenant] = {}
        for tenant_id in {tenant_id for _, tenant_id, _ in queued}:
            try:
                tenants[tenant_id] = self.dep.creator.get(tenant_id)
            except KeyError:  # deleted meanwhile
                pass
        with self._lock:
            if self._stop.is_set():
                return
            running_tenants = {a.tenant.tenant_id for a in self._active.values()} | set(self._finishing.values())
            for workload_id, tenant_id, target in queued:
                if len(self._active) + len(to_start) >= self.max_running:
                    break
                if tenant_id in running_tenants or workload_id in self._active or workload_id in self._finishing:
                    continue
                tenant = tenants.get(tenant_id)
                if tenant is None:
                    continue
                running_tenants.add(tenant_id)
                to_start.append(workload_id)
                self._active[workload_id] = _Active(workload_id, tenant, target)
        for workload_id in to_start:
            active = self._active[workload_id]
            try:
                self._launch(active)
            except Exception as error:
                if self._service_restarting(error, active.tenant.tenant_id) and not active.threads:
                    # A service it needs is restarting in place: it stays queued, in its place; the
                    # admission tick starts it again once the service is back.
                    log.warning("workload %s waits for a restarting service: %s", workload_id, error)
                    with self._lock:
                        self._active.pop(workload_id, None)
                    if self.on_unavailable is not None:
                        self.on_unavailable(f"launch: {type(error).__name__}")
                    continue
                log.exception("workload %s failed to start", workload_id)
                self._finish(workload_id, WORKLOAD_FAILED, error=f"start: {type(error).__name__}: {error}")

    def _must_wait(self, error: BaseException, tenant_id: str) -> bool:
        """Wait and try again (not a failure of the work): a service restarting, or full."""
        if isinstance(error, SessionLimitExceeded) or self._service_restarting(error, tenant_id):
            return True
        # A restarted Inference Model Service serves nothing until versions are published again.
        return isinstance(error, NoServingVersion)

    def _service_restarting(self, error: BaseException, tenant_id: str) -> bool:
        """A service is gone or restarting in place (its call failed), or it is back without the
        tenant's slot yet (the Health Manager restores slots on its next round)."""
        if role_unavailable(error):
            return True
        return isinstance(error, UnknownTenant) and self._tenant_exists(tenant_id)

    def _through_restarts(self, call: Callable[[], R], tenant_id: str, what: str, wait_s: float = 120.0) -> R:
        """`call()`, waited through a restart in place of the service it calls (bounded)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return call()
            except Exception as error:
                if not self._must_wait(error, tenant_id) or time.monotonic() > deadline:
                    raise
                log.warning("%s of tenant %s waits for a restarting service: %s", what, tenant_id, error)
                if self.on_unavailable is not None:
                    self.on_unavailable(f"{what}: {type(error).__name__}")
                time.sleep(1.0)

    def _launch(self, active: _Active) -> None:
        dep, tenant = self.dep, active.tenant
        slot = dep.training_service.add_tenant(tenant.backend_config)
        active.version = slot["version"]
        done = dep.scheduler.counts(tenant.tenant_id).get(COMPLETED, 0)
        sched = tenant.spec.scheduling
        # The policy's completion target covers exactly this workload's remaining jobs on top of
        # every completed one (a resumed workload has some of its own among them already).
        dep.scheduler.register_policy(
            tenant.tenant_id,
            tenant.spec.task.value,
            priority=sched.priority,
            max_in_flight=sched.max_in_flight_jobs,
            completion_target=done + active.target_jobs - active.completed_jobs,
            max_policy_staleness=sched.max_policy_staleness,
        )
        if active.run_id is None:
            active.run_id = dep.tracker.start_workload_run(
                tenant.tenant_id,
                active.workload_id,
                _run_params(tenant, active.target_jobs),
                tags={"task": tenant.spec.task.value},
            )
        with dep.store.transaction() as s:
            record = s.get(WorkloadRecord, active.workload_id)
            record.state, record.run_id = RUNNING, active.run_id
            record.started_at = record.started_at or utcnow()
        if tenant.spec.task.value == "rl":
            self._publish_weights(tenant.tenant_id)  # rollouts act with the current version
            producer: Any = RolloutProducer(
                tenant.backend_config,
                dep.scheduler,
                dep.queue,
                dep.environment_service,
                dep.inference_service,
                job_metadata={"workload_id": active.workload_id},
                rollout_slots=self._rollout_slots,
            )
        else:
            assert tenant.spec.dataset is not None
            producer = SFTProducer.from_dataset(
                tenant.backend_config,
                dep.scheduler,
                dep.queue,
                tenant.spec.dataset.root,
                tenant.spec.dataset.repo_id,
                job_metadata={"workload_id": active.workload_id},
            )

        def produce() -> None:
            failures = outages = 0
            while not active.stop.is_set():
                try:
                    producer.run(active.stop)
                    return
                except Exception as error:
                    if active.stop.is_set():
                        return  # the workload is ending; its jobs were released under it
                    if self._must_wait(error, tenant.tenant_id) and outages < MAX_OUTAGE_RETRIES:
                        # A service it writes to (Training Queue, Environment, Inference) is
                        # restarting in place or full: not the workload's fault, so not on its
                        # failure budget. A restarted Inference Model Service may have lost the
                        # version the rollouts act with: serve the current one again.
                        outages += 1
                        if kind == "rollout":
                            with contextlib.suppress(Exception):
                                if self.dep.inference_service.latest_version(tenant.tenant_id) is None:
                                    self._publish_weights(tenant.tenant_id)
                        with self._lock:
                            self._producer_restarts += 1
                        log.warning(
                            "workload %s: producer waits for a restarting service: %s", active.workload_id, error
                        )
                        if self.on_unavailable is not None:
                            self.on_unavailable(f"producer: {type(error).__name__}")
                        active.stop.wait(1.0)
                        continue
                    # A failed rollout (e.g. a crashed simulator worker) failed only its own job;
                    # the producer starts over with fresh sessions, up to the failure budget.
                    failures += 1
                    reason = f"producer: {type(error).__name__}: {error}"
                    log.warning("workload %s: %s", active.workload_id, reason)
                    self._emit(active.workload_id, "producer_failed", reason=reason)
                    if failures >= self.max_failures or tenant.spec.task.value != "rl":
                        self._finish(active.workload_id, WORKLOAD_FAILED, error=reason)
                        return

        kind = "rollout" if tenant.spec.task.value == "rl" else "sft"
        thread = threading.Thread(target=produce, name=f"{kind}-producer-{tenant.tenant_id}", daemon=True)
        active.threads.append(thread)
        active.producer = producer
        self._emit(active.workload_id, "resumed" if active.resumed else "started", version=active.version)
        thread.start()

    def _publish_weights(self, tenant_id: str) -> int:
        """Training -> inference weight sync (paper A.1): the only cross-queue dependency."""
        payload = self.dep.training_service.export_params(tenant_id)
        return self.dep.inference_service.load_weights(payload)["version"]

    def _on_outcome(self, outcome: ActorOutcome) -> None:
        workload_id = outcome.job.metadata.get("workload_id")
        with self._lock:
            active = self._active.get(workload_id)
        if active is None:
            return  # a job of a cancelled or finished workload
        finish: tuple[str, str | None] | None = None
        with self._lock:
            if outcome.state == COMPLETED and outcome.metrics is not None:
                first = active.optimizer_steps
                losses = outcome.metrics["losses"]
                active.losses.extend(losses)
                active.optimizer_steps += len(losses)
                active.completed_jobs += 1
                active.version = outcome.metrics["version"]
            else:
                active.failed_jobs += 1
                active.failures.append(outcome.reason or outcome.state)
            if active.completed_jobs >= active.target_jobs:
                finish = (WORKLOAD_COMPLETED, None)
            elif active.failed_jobs >= self.max_failures:
                finish = (WORKLOAD_FAILED, f"{active.failed_jobs} training jobs failed; last: {active.failures[-1]}")
        if outcome.state == COMPLETED and outcome.metrics is not None:
            steps = [(first + i + 1, loss) for i, loss in enumerate(losses)]
            self._emit_many(workload_id, [("step", {"step": step, "loss": loss}) for step, loss in steps])
            # One MLflow batch per job (each batch is a store transaction on the actor loop's time).
            points = [("train/loss", loss, step) for step, loss in steps]
            points += [
                ("policy_version", active.version, active.optimizer_steps),
                ("jobs_completed", active.completed_jobs, active.optimizer_steps),
            ]
            if outcome.job.task_type == "rl":
                self._publish_weights(active.tenant.tenant_id)  # later rollouts act with the update
                rollout = active.producer.stats.drain() if active.producer is not None else {}
                rl_metrics = {**outcome.metrics.get("rl_stats", {})}
                if rollout.get("episodes"):
                    rl_metrics.update({f"rollout/{k}": v for k, v in rollout.items() if k != "episodes"})
                points += [(key, value, active.optimizer_steps) for key, value in rl_metrics.items()]
                self._emit(workload_id, "rl_update", version=active.version, **rl_metrics)
            self.dep.tracker.log_metric_points(active.run_id, points)
            self._emit(
                workload_id, "job_completed", job_id=outcome.job.job_id, version=active.version,
                completed_jobs=active.completed_jobs, target_jobs=active.target_jobs,
            )  # fmt: skip
        else:
            self._emit(workload_id, "job_failed", job_id=outcome.job.job_id, reason=outcome.reason)
        self._persist_progress(active)
        if finish is not None:
            self._finish(workload_id, *finish)

    def _persist_progress(self, active: _Active) -> None:
        with self.dep.store.transaction() as s:
            record = s.get(WorkloadRecord, active.workload_id)
            record.completed_jobs = active.completed_jobs
            record.version = active.version
            record.optimizer_steps = active.optimizer_steps
            record.last_loss = active.losses[-1] if active.losses else None

    def _finish(self, workload_id: str, state: str, error: str | None = None) -> None:
        with self._lock:
            if workload_id in self._finishing:
                return  # another path (a cancel, the last job, a failing producer) is finishing it
            active = self._active.pop(workload_id, None)
            self._finishing[workload_id] = active.tenant.tenant_id if active is not None else ""
        try:
            self._finish_unguarded(workload_id, active, state, error)
        finally:
            with self._lock:
                self._finishing.pop(workload_id, None)
        self._admit()

    def _finish_unguarded(self, workload_id: str, active: _Active | None, state: str, error: str | None) -> None:
        if active is None and self.get(workload_id).state in FINAL_WORKLOAD_STATES:
            return  # finished already
        registered = None
        if active is not None:
            active.stop.set()
            # Let a producer finish the job it is writing, so none is marked ready after the release.
            for thread in active.threads:
                if thread is not threading.current_thread():
                    thread.join(timeout=120)
            self._release_pending_jobs(active, reason=error or state)
            if active.completed_jobs:
                try:
                    registered = self._publish(active)
                except Exception as publish_error:  # the training happened; say what failed after it
                    log.exception("publishing workload %s failed", workload_id)
                    state, error = WORKLOAD_FAILED, f"export/register: {type(publish_error).__name__}: {publish_error}"
            if active.run_id is not None:
                self.dep.tracker.end_run(active.run_id, "FINISHED" if state == WORKLOAD_COMPLETED else "FAILED")
            self._persist_progress(active)
        with self.dep.store.transaction() as s:
            record = s.get(WorkloadRecord, workload_id)
            if record is not None and record.state not in FINAL_WORKLOAD_STATES:
                record.state, record.error, record.finished_at = state, error, utcnow()
                record.registered_version = registered
        self._emit(workload_id, state, error=error, registered_version=registered)

    def _release_pending_jobs(self, active: _Active, reason: str) -> None:
        """Fail the workload's jobs that the actor has not leased yet (clearing their partitions)."""
        for job in self.dep.scheduler.jobs(tenant_id=active.tenant.tenant_id):
            if job.metadata.get("workload_id") != active.workload_id or job.state in TERMINAL_STATES:
                continue
            try:  # a leased job too: the actor's outcome for it is then refused and ignored
                self.dep.scheduler.abandon(job.job_id, f"workload {active.workload_id} ended: {reason}")
            except Exception:  # it finished concurrently
                pass

    def _publish(self, active: _Active) -> int:
        """Checkpoint, export and register the tenant's policy as trained by this workload."""
        from joynexus.artifacts import decode_tenant_payload

        tenant_id = active.tenant.tenant_id
        training = self.dep.training_service

        def checkpoint_and_export() -> bytes:
            training.save([tenant_id], True)
            return training.export_params(tenant_id)

        payload = self._through_restarts(checkpoint_and_export, tenant_id, "publishing")
        _, manifest = decode_tenant_payload(payload)
        inference = getattr(self.dep, "inference_service", None)
        if inference is not None:  # serve what was just trained
            self._through_restarts(lambda: inference.load_weights(payload), tenant_id, "serving")
        registered = self.dep.tracker.register_tenant_payload(
            run_id=active.run_id, tenant_id=tenant_id, payload=payload, manifest=manifest
        )
        # A registered version outlives checkpoint retention (the Training Model Service prunes
        # all but the last K and the pinned versions); the pin is durable under the tenant's prefix.
        checkpoints = getattr(self.dep, "checkpoints", None)
        if checkpoints is not None:
            checkpoints.pin(tenant_id, manifest.policy_version)
        return registered


def _event_dict(record: WorkloadEventRecord) -> dict[str, Any]:
    return {
        "seq": record.seq, "workload_id": record.workload_id, "kind": record.kind, "time": record.time,
        **(record.data or {}),
    }  # fmt: skip


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    """Event data as JSON the store keeps (numpy scalars and tuples become plain values)."""
    import json

    return json.loads(json.dumps(data, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def _run_params(tenant: Tenant, jobs: int) -> dict[str, Any]:
    cfg = tenant.backend_config
    return {
        "tenant_id": cfg.tenant_id,
        "base_model_id": cfg.base_model_id,
        "schema_signature": cfg.schema_signature,
        "cameras": ",".join(cfg.cameras),
        "image_size": "x".join(str(s) for s in cfg.image_size),
        "state_dim": cfg.state_dim,
        "action_dim": cfg.action_dim,
        "action_chunk": cfg.action_chunk,
        "action_module": cfg.action_module["kind"],
        "action_module_size": cfg.action_module.get("size"),
        "learning_rate": cfg.learning_rate,
        "microbatch_size": cfg.microbatch_size,
        "samples_per_job": cfg.samples_per_job,
        "jobs": jobs,
        "max_in_flight_jobs": tenant.spec.scheduling.max_in_flight_jobs,
        "priority": tenant.spec.scheduling.priority,
    }
