"""Evaluation, in ONE home (paper 4.2): episodes through the Inference Queue and the Environment
Service at ONE policy version, resolved once at the start. An evaluation creates no training job
and no partition and never changes the tenant's version.

* `services.producers.evaluation.evaluate_policy` runs the episodes (deterministic actions, seeded
  by episode index) on the tenant's producer replica;
* `Evaluations` is the part of the workload manager that runs it as an evaluation workload: checks
  the environment, has the version served (from its checkpoint if need be), starts the episodes on
  the replica, records the result in the store and MLflow, and runs it again whole after a restart.

Promotion by evaluation results is the Master's rule (promotion.py, over `joynexus.registry.promote`),
run on every publish; `flows/periodic_evaluation.py` evaluates each tenant's champion on a schedule.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from joynexus.core.store import WorkloadRecord, utcnow
from joynexus.core.tenants import Tenant, TenantBackendConfig, simulator_config
from joynexus.envs import available_simulators
from joynexus.master.tenant_slots import ensure_slot
from joynexus.master.workloads.live import FINAL_WORKLOAD_STATES, RUNNING, WORKLOAD_COMPLETED, WORKLOAD_FAILED
from joynexus.master.workloads.records import WorkloadRecords
from joynexus.master.workloads.restarts import ServiceWaits
from joynexus.protocol.schemas import WorkloadInfo
from joynexus.services.producers.evaluation_report import check_suite
from joynexus.services.producers.evaluation_stats import SUCCESS_CI_HIGH_METRIC, SUCCESS_CI_LOW_METRIC
from joynexus.spec import EnvironmentSpec

if TYPE_CHECKING:
    from joynexus.master.deployment import Deployment

log = logging.getLogger(__name__)


class Evaluations:
    """Evaluation workloads: rows and events through `records`, waits through restarting services
    with `waits`; `check(tenant_id)` is admission's spend check, `publish_weights(tenant_id)` serves
    a tenant's current trained state (one never served yet is evaluated so)."""

    def __init__(
        self,
        deployment: Deployment,
        records: WorkloadRecords,
        waits: ServiceWaits,
        *,
        check: Callable[[str], None],
        publish_weights: Callable[[str], int],
    ):
        self.deployment = deployment
        self._records, self._waits = records, waits
        self._check, self._publish_weights = check, publish_weights

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
        """Start an evaluation workload (paper 4.2): episodes through the Inference Queue and the
        Environment Service at ONE policy version, resolved once at the start. No training job,
        no partition, no version change. `environment` overrides the tenant's declared one; a
        `suite` (partial environments laid over it: other tasks, other seeds) runs `episodes` in
        each entry; the first `videos` episodes of each entry are recorded (`evaluation_report`)."""
        deployment = self.deployment
        tenant = deployment.creator.get(tenant_id)
        configs = self._suite_configs(tenant, environment, suite, videos)
        if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
            raise ValueError(f"episodes: expected an int >= 1, got {episodes!r}")
        if version != "latest" and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"version: expected a policy version (an int >= 0) or 'latest', got {version!r}")
        self._check(tenant_id)
        if deployment.inference_service.latest_version(tenant_id) is None:
            # Never served yet (e.g. an SFT tenant): serve its current trained state, read-only.
            ensure_slot(deployment.training_service, tenant)
            self._publish_weights(tenant_id)
        resolved = deployment.inference_service.latest_version(tenant_id) if version == "latest" else version
        if resolved is None:
            raise ValueError(f"version: tenant {tenant_id!r} has no policy version being served")
        self._serve_version(tenant_id, resolved)
        workload_id = f"ev-{uuid.uuid4().hex[:12]}"
        with deployment.store.transaction() as s:
            s.add(
                WorkloadRecord(
                    workload_id=workload_id, tenant_id=tenant_id, task="eval", state=RUNNING, target_jobs=0,
                    version=resolved, started_at=utcnow(),
                )
            )  # fmt: skip
        self._records.emit(
            workload_id, "started", version=resolved, episodes=episodes, environment=environment, suite=suite,
            videos=videos,
        )  # fmt: skip
        self._start_evaluation(workload_id, tenant_id, resolved, episodes, configs, videos)
        return self._records.get(workload_id)

    def _suite_configs(
        self, tenant: Tenant, environment: dict[str, Any] | None, suite: Any, videos: Any
    ) -> list[TenantBackendConfig]:
        """One checked backend config per suite entry (the entry's fields over `environment`, or
        over the tenant's declared environment)."""
        entries = check_suite(suite, videos)
        if entries == [{}]:
            return [self._evaluation_config(tenant, environment)]
        declared = tenant.backend_config.environment
        base = environment if environment is not None else (declared.model_dump() if declared else {})
        configs = []
        for i, entry in enumerate(entries):
            try:
                configs.append(self._evaluation_config(tenant, {**base, **entry}))
            except ValueError as error:
                raise ValueError(f"suite[{i}].{error}") from None
        return configs

    def _start_evaluation(
        self,
        workload_id: str,
        tenant_id: str,
        resolved: int,
        episodes: int,
        configs: list[TenantBackendConfig],
        videos: int = 0,
    ) -> None:
        """Open the evaluation's MLflow run and start its episodes on the tenant's producer replica;
        the producer follower records the result (`on_report`)."""
        environment = configs[0].environment.model_dump(mode="json")
        run_id = self.deployment.tracker.start_workload_run(
            tenant_id, workload_id,
            {"policy_version": resolved, "episodes": episodes, "suite_entries": len(configs), "videos": videos,
             **environment},
            tags={"task": "eval"},
        )  # fmt: skip
        with self.deployment.store.transaction() as s:
            s.get(WorkloadRecord, workload_id).run_id = run_id
        # Episodes are seeded by index, so an evaluation cut by a restarting service (or moved off a
        # replica that died) runs again whole with the same result it would have had.
        self.deployment.producers.start_evaluation(
            workload_id, tenant_id, version=resolved, episodes=episodes,
            configs=[c.model_dump(mode="json") for c in configs], videos=videos, run_id=run_id,
        )  # fmt: skip

    def on_report(self, workload_id: str, report: dict[str, Any]) -> None:
        """An evaluation's replica finished it: record the result (or the failure) once."""
        tracker = self.deployment.tracker
        with self.deployment.store.transaction() as s:
            record = s.get(WorkloadRecord, workload_id)
            done = record is None or record.state in FINAL_WORKLOAD_STATES
            run_id, resolved = (None, None) if record is None else (record.run_id, record.version)
        if done:  # recorded already (a Master before this one), or gone: the replica may forget it
            self.deployment.producers.stop_workload(workload_id)
            return
        if report["state"] == "completed":
            summary = report["result"]
            metrics = {
                "eval/success_rate": summary["success_rate"],
                "eval/mean_return": summary["mean_return"],
                "eval/mean_length": summary["mean_length"],
                SUCCESS_CI_LOW_METRIC: summary["success_ci_low"],
                SUCCESS_CI_HIGH_METRIC: summary["success_ci_high"],
            }
            if run_id is not None:
                tracker.log_metrics(run_id, metrics, step=resolved)
                tracker.end_run(run_id, "FINISHED")
            self._records.emit(workload_id, "evaluated", version=resolved, **metrics)  # a learning signal too
            with self.deployment.store.transaction() as s:
                record = s.get(WorkloadRecord, workload_id)
                record.state, record.finished_at, record.result = WORKLOAD_COMPLETED, utcnow(), summary
            self._records.emit(workload_id, WORKLOAD_COMPLETED, result=summary)
        else:
            reason = report["error"] or "the evaluation failed"
            log.warning("evaluation %s failed: %s", workload_id, reason)
            if run_id is not None:
                tracker.end_run(run_id, "FAILED")
            with self.deployment.store.transaction() as s:
                record = s.get(WorkloadRecord, workload_id)
                record.state, record.finished_at, record.error = WORKLOAD_FAILED, utcnow(), reason
            self._records.emit(workload_id, WORKLOAD_FAILED, error=reason)
        self.deployment.producers.stop_workload(workload_id)

    def rerun(self, workload_id: str) -> None:
        """Run an evaluation a dead Master left `running` again, from what its `started` event says."""
        started = [e for e in self._records.events(workload_id) if e["kind"] == "started"]
        if not started or "episodes" not in started[-1]:
            raise RuntimeError("its start was not recorded")
        with self.deployment.store.transaction() as s:
            record = s.get(WorkloadRecord, workload_id)
            tenant_id, resolved = record.tenant_id, record.version
        tenant = self.deployment.creator.get(tenant_id)
        videos = int(started[-1].get("videos") or 0)
        configs = self._suite_configs(tenant, started[-1].get("environment"), started[-1].get("suite"), videos)
        self._waits.through(lambda: self._serve_version(tenant_id, resolved), tenant_id, "serving")
        self._records.emit(workload_id, "resumed", version=resolved)
        self._start_evaluation(workload_id, tenant_id, resolved, int(started[-1]["episodes"]), configs, videos)

    def _evaluation_config(self, tenant: Tenant, environment: dict[str, Any] | None) -> TenantBackendConfig:
        """The tenant's backend config with the environment to evaluate in, checked before anything
        starts: the simulator is registered, the task exists, and the simulator renders the cameras
        and gives the state / action dims the tenant's schema needs (an environment other than the
        one the tenant creator probed at creation is probed here). ValueError("field: reason")."""
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
        config = config.model_copy(update={"environment": spec})
        probe = getattr(getattr(self.deployment.creator, "compiler", None), "environment_probe", None)
        if probe is not None:
            _check_probed(config, spec, probe)
        return config

    def _serve_version(self, tenant_id: str, version: int) -> None:
        """Make `version` servable (served, or loaded from its checkpoint by the tenant's producer
        replica); ValueError("version: ...") naming what exists otherwise."""
        self.deployment.producers.serve_version(tenant_id, version)


def _check_probed(config: TenantBackendConfig, spec: EnvironmentSpec, probe: Any) -> None:
    """Probe the simulator of an environment other than the tenant's: it must accept the task and
    render the cameras, state and action dims the tenant's schema needs."""
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
