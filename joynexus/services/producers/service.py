"""The producer service (issue 40): one replica of the role that does a deployment's data work, so
the Master stays a control plane. A replica runs, for the tenants assigned to it (`front.py`):

* each training workload's producer (SFT demonstrations or RL rollouts), waiting through restarting
  services and starting a failed rollout over, up to the workload's failure budget;
* evaluation episodes and promotion measurements (`evaluation.py`, `heldout.py`);
* the weight moves: training -> inference syncs, serving a checkpointed version, the publish of
  a finished workload (checkpoint, export, serve, register in MLflow, pin) and of foreign weights
  the API installed (serve, register with their provenance, pin);
* an advantage stage (every replica leases from the one Training Scheduler; leases are rows).

Observations, dataset frames, partitions and weight payloads go between the services and this
process only. The Master starts and stops work here and follows it with `poll()` (states, events,
reasons), which is all it records. A replica keeps running what it was given when the Master
restarts; a new Master finds it through `poll()`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from joynexus.actors import role_unavailable
from joynexus.artifacts import decode_tenant_payload, encode_tenant_payload
from joynexus.core.tenants import TenantBackendConfig
from joynexus.scheduling.training_scheduler import CHANGE_POLL_S
from joynexus.services.environment.service import SessionLimitExceeded
from joynexus.services.producers.advantages import AdvantageStage
from joynexus.services.producers.base import Producer
from joynexus.services.producers.context import ProducerContext
from joynexus.services.producers.evaluation import EvaluationResult, evaluate_policy
from joynexus.services.producers.evaluation_report import log_report, run_suite, video_workdir
from joynexus.services.producers.evaluation_stats import SUCCESS_CI_HIGH_METRIC, SUCCESS_CI_LOW_METRIC
from joynexus.services.producers.rollout import NoServingVersion, RolloutProducer
from joynexus.services.producers.sft import SFTProducer
from joynexus.services.training.errors import UnknownTenant
from joynexus.settings import Settings
from joynexus.spec import DatasetSpec, PromotionMetric

log = logging.getLogger(__name__)

PRODUCER_ACTOR_PREFIX = "joynexus.producers"  # replica i is the named actor "joynexus.producers-<i>"
MAX_OUTAGE_RETRIES = 120  # a producer waits this many seconds at most for a restarting service
SUCCESS_METRIC = "eval/success_rate"
# Work states a replica reports: running; then produced (an SFT / RL producer covered its target),
# completed (an evaluation, with its result) or failed (with the reason).
RUNNING, PRODUCED, COMPLETED, FAILED = "running", "produced", "completed", "failed"
R = TypeVar("R")


def producer_actor_name(replica: int) -> str:
    return f"{PRODUCER_ACTOR_PREFIX}-{replica}"


@dataclass(eq=False)
class _Work:
    """One workload this replica runs: its request (what `start_*` was given), thread and outcome."""

    workload_id: str
    tenant_id: str
    kind: str  # "sft", "rl" or "eval"
    request: dict[str, Any]
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    producer: Producer | None = None
    state: str = RUNNING
    error: str | None = None
    result: dict[str, Any] | None = None
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # not yet handed to the Master
    waits: int = 0  # times it waited for a restarting service
    started_at: float = field(default_factory=time.time)  # this run of it on this replica


class ProducerService:
    def __init__(
        self,
        settings: Settings,
        replica: int = 0,
        *,
        context: ProducerContext | None = None,
        max_concurrent_rollouts: int = 4,
    ):
        self.ctx = context if context is not None else ProducerContext.from_settings(settings)
        self.replica = replica
        self.incarnation = uuid.uuid4().hex[:12]
        self.owner = f"producers-{replica}-{self.incarnation}"
        self._lock = threading.RLock()
        self._work: dict[str, _Work] = {}
        self._rollout_slots = threading.BoundedSemaphore(max_concurrent_rollouts)
        self._stop = threading.Event()
        self._stage = AdvantageStage(
            self.ctx.scheduler, self.ctx.queue, lambda t: self.ctx.tenant(t).backend_config, owner=self.stage_owner
        )
        # Started once a Master follows this replica (its first poll or start), not at build time:
        # a deployment built for a test of its parts runs no loop of its own.
        self._stage_thread = threading.Thread(target=self._run_stage, name=f"advantages-{replica}", daemon=True)

    def _ensure_stage(self) -> None:
        with self._lock:
            if self._stage_thread.ident is None and not self._stop.is_set():
                self._stage_thread.start()

    @property
    def stage_owner(self) -> str:
        return f"{self.owner}/advantages"

    def heartbeat(self) -> dict[str, Any]:
        with self._lock:
            running = sum(1 for w in self._work.values() if w.state == RUNNING)
        return {
            "replica": self.replica, "incarnation": self.incarnation, "pid": os.getpid(), "running": running,
            "advantage_stage": self._stage_thread.is_alive(),
        }  # fmt: skip

    # -- work the Master starts and stops -----------------------------------------------------------
    def start_workload(
        self,
        workload_id: str,
        tenant_id: str,
        *,
        task: str,
        dataset: dict[str, Any] | None = None,
        max_failures: int = 3,
    ) -> str:
        """Run the workload's producer here (idempotent: one already running keeps running, so a
        restarted Master that asks again does not interrupt it). Returns this replica's owner."""
        request = {"task": task, "dataset": dataset, "max_failures": max_failures}
        work = _Work(workload_id, tenant_id, task, request)
        with self._lock:
            existing = self._work.get(workload_id)
            if existing is not None and existing.state == RUNNING:
                return self.owner
        # Built before this call returns, so a dataset that cannot be opened fails the start itself.
        work.producer = self._producer(work)
        return self._start(work, self._produce)

    def start_evaluation(
        self,
        workload_id: str,
        tenant_id: str,
        *,
        version: int,
        episodes: int,
        configs: list[dict[str, Any]],
        videos: int = 0,
        run_id: str | None = None,
    ) -> str:
        """Run an evaluation's episodes here (idempotent like `start_workload`); its result, or why
        it failed, comes back through `poll()`."""
        request = {"version": version, "episodes": episodes, "configs": configs, "videos": videos, "run_id": run_id}
        return self._start(_Work(workload_id, tenant_id, "eval", request), self._evaluate)

    def _start(self, work: _Work, target: Callable[[_Work], None]) -> str:
        self._ensure_stage()
        with self._lock:
            existing = self._work.get(work.workload_id)
            if existing is not None and existing.state == RUNNING:
                return self.owner
            self._work[work.workload_id] = work
            work.thread = threading.Thread(
                target=self._guarded, args=(work, target), name=f"{work.kind}-{work.tenant_id}", daemon=True
            )
        work.thread.start()
        return self.owner

    def stop_workload(self, workload_id: str, timeout_s: float = 120.0) -> None:
        """Stop the workload's producer (it finishes the job it is writing) and forget the workload."""
        with self._lock:
            work = self._work.pop(workload_id, None)
        if work is None:
            return
        work.stop.set()
        if work.thread is not None and work.thread is not threading.current_thread():
            work.thread.join(timeout=timeout_s)

    def poll(self) -> dict[str, Any]:
        """What the Master follows: this replica, its lease owners, and per workload its state,
        error, result, the events since the last poll and its request (so a new Master, or a move
        to another replica, can start it again)."""
        self._ensure_stage()
        report: dict[str, Any] = {}
        with self._lock:
            for work in self._work.values():
                events, work.events = work.events, []
                report[work.workload_id] = {
                    "tenant_id": work.tenant_id, "kind": work.kind, "state": work.state, "error": work.error,
                    "result": work.result, "events": events, "waits": work.waits, "request": work.request,
                    "started_at": work.started_at,
                }  # fmt: skip
        return {
            "replica": self.replica,
            "incarnation": self.incarnation,
            "owners": [self.owner, self.stage_owner],
            "work": report,
        }

    def work(self) -> dict[str, dict[str, Any]]:
        """What runs here, read-only (no events drained): per workload its tenant, kind, state and
        when this run of it started on this replica (operators, tests)."""
        with self._lock:
            return {
                w.workload_id: {"tenant_id": w.tenant_id, "kind": w.kind, "state": w.state, "started_at": w.started_at}
                for w in self._work.values()
            }

    def rollout_stats(self, workload_id: str) -> dict[str, float]:
        """The workload's rollout episodes since the last call (drained), for its learning metrics."""
        with self._lock:
            work = self._work.get(workload_id)
        producer = work.producer if work is not None else None
        return producer.stats.drain() if isinstance(producer, RolloutProducer) else {}

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            ids = list(self._work)
        for workload_id in ids:
            self.stop_workload(workload_id, timeout_s=30)

    # -- the loops ----------------------------------------------------------------------------------
    def _guarded(self, work: _Work, target: Callable[[_Work], None]) -> None:
        try:
            target(work)
        except Exception as error:  # building the producer failed, or the evaluation did
            work.state, work.error = FAILED, f"{type(error).__name__}: {error}"
            log.warning("workload %s failed on replica %s: %s", work.workload_id, self.replica, work.error)

    def _producer(self, work: _Work) -> Producer:
        tenant = self.ctx.tenant(work.tenant_id)
        metadata: dict[str, Any] = {"workload_id": work.workload_id}
        if work.kind == "rl":
            self._through_restarts(lambda: self.publish_weights(work.tenant_id), work.tenant_id, "weight sync")
            return RolloutProducer(
                tenant.backend_config, self.ctx.scheduler, self.ctx.queue, self.ctx.environment_service,
                self.ctx.inference_service, job_metadata=metadata, rollout_slots=self._rollout_slots,
            )  # fmt: skip
        named = work.request.get("dataset")
        dataset = DatasetSpec.model_validate(named) if named else tenant.spec.dataset
        assert dataset is not None and dataset.root is not None
        dataset = self._local_upload(dataset, work.tenant_id)
        if dataset.sha256:  # each job says which data it holds: the versions it trains record it
            metadata["dataset_sha256"] = dataset.sha256
        return SFTProducer.from_dataset(
            tenant.backend_config, self.ctx.scheduler, self.ctx.queue, dataset.root, dataset.repo_id,
            job_metadata=metadata, validation_episodes=dataset.validation_episodes,
        )  # fmt: skip

    def _local_upload(self, dataset: DatasetSpec, tenant_id: str) -> DatasetSpec:
        """An uploaded dataset (`dataset.id`) on this replica's disk: the Master resolved it on its
        own pod, and a replica on another Ray node fetches it from the shared uploads into its own
        data dir (data/shared_uploads.py), checked against the same digest."""
        root = Path(str(dataset.root))
        if dataset.id is None or root.exists():
            return dataset
        from joynexus.data.sources import resolve_dataset

        # <datasets>/tenants/<owner>/<id>: a fork trains on its source tenant's uploads
        owner = root.parent.name if root.parent.parent.name == "tenants" else tenant_id
        return resolve_dataset(dataset, owner, self.ctx.settings)

    def _produce(self, work: _Work) -> None:
        """Run the producer, waiting through restarting services, and start it over after a failed
        rollout, up to the workload's failure budget."""
        assert work.producer is not None
        failures = outages = 0
        while not work.stop.is_set():
            try:
                work.producer.run(work.stop)
                if not work.stop.is_set():
                    work.state = PRODUCED  # the last jobs train, then the Master ends the workload
                return
            except Exception as error:
                if work.stop.is_set():
                    return  # the workload is ending; its jobs were released under it
                if self._must_wait(error, work.tenant_id) and outages < MAX_OUTAGE_RETRIES:
                    outages += 1
                    self._wait_for_service(work, error)
                    continue
                # A failed rollout (a crashed simulator worker) failed only its own job; the
                # producer starts over with fresh sessions, up to the failure budget.
                failures += 1
                reason = f"producer: {type(error).__name__}: {error}"
                log.warning("workload %s: %s", work.workload_id, reason)
                with self._lock:
                    work.events.append(("producer_failed", {"reason": reason}))
                if failures >= int(work.request.get("max_failures", 3)) or work.kind != "rl":
                    work.state, work.error = FAILED, reason
                    return

    def _wait_for_service(self, work: _Work, error: Exception) -> None:
        if work.kind == "rl":  # a restarted Inference Model Service may have lost the rollouts' version
            try:
                if self.ctx.inference_service.latest_version(work.tenant_id) is None:
                    self.publish_weights(work.tenant_id)
            except Exception:  # still away: the next wait tries again
                pass
        with self._lock:
            work.waits += 1
        log.warning("workload %s: producer waits for a restarting service: %s", work.workload_id, error)
        work.stop.wait(1.0)

    def _run_stage(self) -> None:
        while not self._stop.is_set():
            try:
                self._stage.step_or_wait(CHANGE_POLL_S)
            except Exception as error:  # a service away: its leases are taken back; try again soon
                log.warning("advantage stage of replica %s: %s: %s", self.replica, type(error).__name__, error)
                self._stop.wait(1.0)

    def _evaluate(self, work: _Work) -> None:
        request, tenant_id = work.request, work.tenant_id
        configs = [TenantBackendConfig.model_validate(c) for c in request["configs"]]
        version, episodes, videos = int(request["version"]), int(request["episodes"]), int(request["videos"])
        total = episodes * len(configs)
        counted = [0, 0]  # episodes and successes of the entries done so far

        def entry(*args: Any, **kwargs: Any) -> EvaluationResult:
            def on_episode(done: int, _entry_total: int, successes: int) -> None:
                done_all, won = counted[0] + done, counted[1] + successes
                with self._lock:
                    work.events.append(("episode", {"done": done_all, "total": total, "success_rate": won / done_all}))

            result = evaluate_policy(*args, on_episode=on_episode, **kwargs)
            counted[0] += result.episodes
            counted[1] += sum(result.successes)
            return result

        with video_workdir() as workdir:

            def run() -> Any:
                counted[:] = [0, 0]  # a run again after a restarting service starts a new count
                self.serve_version(tenant_id, version)  # a restarted service lost what it served
                return run_suite(
                    configs, self.ctx.environment_service, self.ctx.inference_service, version=version,
                    episodes=episodes, videos=videos, video_dir=Path(workdir), evaluate=entry,
                )  # fmt: skip

            report = self._through_restarts(run, tenant_id, "evaluation")
            summary = log_report(self.ctx.tracker, request["run_id"], report) if request.get("run_id") else {}
            if not summary:
                summary = report.summary()
        work.result, work.state = summary, COMPLETED

    # -- weights: they move between the services and this process only ------------------------------
    def publish_weights(self, tenant_id: str) -> int:
        """Training -> inference weight sync of the tenant's current version (paper A.1). A version
        served without a checkpoint is checkpointed first: what was served is served again after a
        restart (`master/serving_restore.py`), also once the slot has trained past it."""
        training = self.ctx.training_service
        payload = training.export_params(tenant_id)
        _, manifest = decode_tenant_payload(payload)
        if manifest.policy_version not in self.ctx.checkpoints.versions(tenant_id):
            training.save([tenant_id], True)
        return int(self.ctx.inference_service.load_weights(payload)["version"])

    def serve_version(self, tenant_id: str, version: int, *, from_slot: bool = False) -> None:
        """Make `version` servable: served already, or loaded from its checkpoint (`from_slot`: or
        the training slot's own weights when it is at that version without a checkpoint: a
        lower-layer load of the current version); ValueError("version: ...") naming what exists."""
        inference = self.ctx.inference_service
        served = inference.versions(tenant_id)
        if version in served:
            return
        checkpoints = self.ctx.checkpoints.versions(tenant_id)
        if version not in checkpoints and from_slot and self.ctx.training_service.policy_version(tenant_id) == version:
            inference.load_weights(self.ctx.training_service.export_params(tenant_id))
            return
        if version not in checkpoints:
            raise ValueError(
                f"version: tenant {tenant_id!r} has no policy version {version} (served: {served}, "
                f"checkpoints: {checkpoints})"
            )
        manifest, module_state, _ = self.ctx.checkpoints.load_tenant(tenant_id, version)
        inference.load_weights(encode_tenant_payload(module_state, manifest))

    def publish_trained(self, tenant_id: str, run_id: str | None) -> int:
        """A finished workload's publish: checkpoint, export, serve and register the tenant's policy
        as trained (MLflow), and pin the registered version against retention. Returns the registry
        version."""
        training = self.ctx.training_service

        def checkpoint_and_export() -> bytes:
            training.save([tenant_id], True)
            return training.export_params(tenant_id)

        payload = self._through_restarts(checkpoint_and_export, tenant_id, "publishing")
        _, manifest = decode_tenant_payload(payload)
        self._through_restarts(lambda: self.ctx.inference_service.load_weights(payload), tenant_id, "serving")
        assert run_id is not None, "a workload that trained has an MLflow run"
        registered = self.ctx.tracker.register_tenant_payload(
            run_id=run_id, tenant_id=tenant_id, payload=payload, manifest=manifest
        )
        # A registered version outlives checkpoint retention: the pin is durable under the tenant's prefix.
        self.ctx.checkpoints.pin(tenant_id, manifest.policy_version)
        return int(registered)

    def publish_installed(self, tenant_id: str, version: int, provenance: dict[str, str]) -> dict[str, Any]:
        """Foreign weights the API installed in the training slot as `version`: serve them and register
        them in MLflow with their provenance (`foreign_weights.publish_installed`)."""
        from joynexus.services.producers.foreign_weights import publish_installed

        return publish_installed(self.ctx, tenant_id, version, provenance)

    def measure(self, tenant_id: str, policy_version: int) -> dict[str, float]:
        """The tenant's promotion metric of one version: simulator success (an evaluation at that
        version) or the held-out loss; the Master logs it on the registered version."""
        tenant = self.ctx.tenant(tenant_id)
        metric = tenant.spec.promotion_metric()
        if metric is None:
            raise ValueError(f"promotion.metric: tenant {tenant_id!r} declares none it can be measured by")
        inference = self.ctx.inference_service

        def run() -> dict[str, float]:
            self.serve_version(tenant_id, policy_version)
            if metric is PromotionMetric.HELDOUT_LOSS:
                from joynexus.services.producers.heldout import heldout_loss

                return heldout_loss(tenant, inference, policy_version).metrics()
            result = evaluate_policy(
                tenant.backend_config, self.ctx.environment_service, inference, version=policy_version,
                episodes=tenant.spec.promotion.eval_episodes,
            )  # fmt: skip
            return {
                SUCCESS_METRIC: result.success_rate,
                SUCCESS_CI_LOW_METRIC: result.success_ci[0],
                SUCCESS_CI_HIGH_METRIC: result.success_ci[1],
                "eval/mean_return": result.mean_return,
                "eval/mean_length": result.mean_length,
            }

        return self._through_restarts(run, tenant_id, "promotion measurement")

    # -- tenant creation: the spec compiler imports the model stack, so it runs here ---------------
    def compile_tenant(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Check and compile a workload spec (`SpecCompiler`) against the resident backbone's
        capabilities and the simulators the Environment Service runs; the backend config as JSON,
        or SpecError naming every bad field."""
        from joynexus.core.tenants import BackendCapabilities, BaseModelCapabilities
        from joynexus.services.producers.spec_compiler import SpecCompiler
        from joynexus.spec import WorkloadSpec

        caps = self.ctx.training_service.capabilities()
        fields = {name: getattr(caps, name) for name in BaseModelCapabilities.__dataclass_fields__}
        env = self.ctx.environment_service

        def probe(config: dict[str, Any]) -> dict[str, Any]:
            session = env.open_session("joynexus-probe", "spec-check", config)
            try:
                return env.spec("joynexus-probe", session)
            finally:
                env.close("joynexus-probe", session)

        compiler = SpecCompiler(BackendCapabilities.single(BaseModelCapabilities(**fields)), environment_probe=probe)
        return compiler.compile(WorkloadSpec.model_validate(spec)).model_dump(mode="json")

    # -- services that restart in place -------------------------------------------------------------
    def _must_wait(self, error: BaseException, tenant_id: str) -> bool:
        """Wait and try again (not a failure of the work): a service restarting, or full, or back
        without the tenant's slot or served version yet (the Master's Health Manager restores them)."""
        if isinstance(error, SessionLimitExceeded | NoServingVersion) or role_unavailable(error):
            return True
        if isinstance(error, UnknownTenant):
            try:
                self.ctx.tenant(tenant_id)
                return True
            except KeyError:
                return False
        return False

    def _through_restarts(self, call: Callable[[], R], tenant_id: str, what: str, wait_s: float = 120.0) -> R:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return call()
            except Exception as error:
                if not self._must_wait(error, tenant_id) or time.monotonic() > deadline:
                    raise
                log.warning("%s of tenant %s waits for a restarting service: %s", what, tenant_id, error)
                time.sleep(1.0)
