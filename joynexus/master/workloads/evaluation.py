"""Evaluation, in ONE home (paper 4.2): episodes through the Inference Queue and the Environment
Service at ONE policy version, resolved once at the start. An evaluation creates no training job
and no partition and never changes the tenant's version.

* `evaluate_policy` runs the episodes (deterministic actions, seeded by episode index);
* `Evaluations` is the part of the workload manager that runs it as an evaluation workload: checks
  the environment, serves the version (from its checkpoint if need be), records the result in the
  store and MLflow, and runs it again whole after a restart of the Master.

Promotion by evaluation results is the Master's rule (promotion.py, over `joynexus.registry.promote`),
run on every publish; `flows/periodic_evaluation.py` evaluates each tenant's champion on a schedule.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError

from joynexus.artifacts import encode_tenant_payload
from joynexus.core.store import WorkloadRecord, utcnow
from joynexus.core.tenants import Tenant, TenantBackendConfig, simulator_config
from joynexus.envs import available_simulators
from joynexus.master.workloads.base import RUNNING, WORKLOAD_COMPLETED, WORKLOAD_FAILED, WorkloadBase
from joynexus.master.workloads.evaluation_report import check_suite, log_report, run_suite, video_workdir
from joynexus.master.workloads.evaluation_stats import (
    SUCCESS_CI_HIGH_METRIC,
    SUCCESS_CI_LOW_METRIC,
    wilson_interval,
)
from joynexus.protocol.schemas import WorkloadInfo
from joynexus.services.inference.endpoint import InferenceEndpoint
from joynexus.services.producers.rollout import EnvGroup, EpisodeStats, predict_many
from joynexus.spec import EnvironmentSpec

if TYPE_CHECKING:  # names the type only: the session module is not needed in the Master
    from joynexus.services.environment.sessions import EnvironmentService

log = logging.getLogger(__name__)


class Evaluations(WorkloadBase):
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
        if self.admission_check is not None:
            self.admission_check(tenant_id)
        if deployment.inference_service.latest_version(tenant_id) is None:
            # Never served yet (e.g. an SFT tenant): serve its current trained state, read-only.
            deployment.training_service.add_tenant(tenant.backend_config)
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
        self._emit(
            workload_id, "started", version=resolved, episodes=episodes, environment=environment, suite=suite,
            videos=videos,
        )  # fmt: skip
        self._start_evaluation(workload_id, tenant_id, resolved, episodes, configs, videos)
        return self.get(workload_id)

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
        threading.Thread(
            target=self._run_evaluation,
            args=(workload_id, tenant_id, resolved, episodes, configs, videos),
            name=f"evaluation-{tenant_id}",
            daemon=True,
        ).start()

    def _run_evaluation(
        self,
        workload_id: str,
        tenant_id: str,
        resolved: int,
        episodes: int,
        configs: list[TenantBackendConfig],
        videos: int = 0,
    ) -> None:
        """The evaluation thread: run the episodes, then record the result (or the failure)."""
        tracker, run_id = self.deployment.tracker, None
        try:
            environment = configs[0].environment.model_dump(mode="json")
            run_id = tracker.start_workload_run(
                tenant_id, workload_id,
                {"policy_version": resolved, "episodes": episodes, "suite_entries": len(configs), "videos": videos,
                 **environment},
                tags={"task": "eval"},
            )  # fmt: skip
            with video_workdir() as workdir:
                # Episodes are seeded by index, so an evaluation cut by a restarting service
                # runs again whole with the same result it would have had.
                def evaluate() -> Any:
                    self._serve_version(tenant_id, resolved)  # a restarted service lost what it served
                    progress = EpisodeProgress(self, workload_id, total=episodes * len(configs))
                    return run_suite(
                        configs, self.deployment.environment_service, self.deployment.inference_service,
                        version=resolved, episodes=episodes, videos=videos, video_dir=Path(workdir),
                        evaluate=progress.wrap(evaluate_policy),
                    )  # fmt: skip

                report = self._through_restarts(evaluate, tenant_id, "evaluation")
                summary = log_report(tracker, run_id, report)
            metrics = {
                "eval/success_rate": summary["success_rate"],
                "eval/mean_return": summary["mean_return"],
                "eval/mean_length": summary["mean_length"],
                SUCCESS_CI_LOW_METRIC: summary["success_ci_low"],
                SUCCESS_CI_HIGH_METRIC: summary["success_ci_high"],
            }
            tracker.log_metrics(run_id, metrics, step=resolved)
            tracker.end_run(run_id, "FINISHED")
            self._emit(workload_id, "evaluated", version=resolved, **metrics)  # a learning signal too
            with self.deployment.store.transaction() as s:
                record = s.get(WorkloadRecord, workload_id)
                record.state, record.finished_at, record.result, record.run_id = (
                    WORKLOAD_COMPLETED, utcnow(), summary, run_id,
                )  # fmt: skip
            self._emit(workload_id, WORKLOAD_COMPLETED, result=summary)
        except Exception as error:
            reason = f"{type(error).__name__}: {error}"
            log.warning("evaluation %s failed: %s", workload_id, reason)
            if run_id is not None:
                tracker.end_run(run_id, "FAILED")
            with self.deployment.store.transaction() as s:
                record = s.get(WorkloadRecord, workload_id)
                record.state, record.finished_at, record.error = WORKLOAD_FAILED, utcnow(), reason
            self._emit(workload_id, WORKLOAD_FAILED, error=reason)

    def _rerun_evaluation(self, workload_id: str) -> None:
        """Run an evaluation a dead Master left `running` again, from what its `started` event says."""
        started = [e for e in self.events(workload_id) if e["kind"] == "started"]
        if not started or "episodes" not in started[-1]:
            raise RuntimeError("its start was not recorded")
        with self.deployment.store.transaction() as s:
            record = s.get(WorkloadRecord, workload_id)
            tenant_id, resolved = record.tenant_id, record.version
        tenant = self.deployment.creator.get(tenant_id)
        videos = int(started[-1].get("videos") or 0)
        configs = self._suite_configs(tenant, started[-1].get("environment"), started[-1].get("suite"), videos)
        self._through_restarts(lambda: self._serve_version(tenant_id, resolved), tenant_id, "serving")
        self._emit(workload_id, "resumed", version=resolved)
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
        """Make `version` servable for the evaluation: served already, or loaded from its checkpoint;
        ValueError("version: ...") naming what exists otherwise."""
        served = self.deployment.inference_service.versions(tenant_id)
        if version in served:
            return
        store = getattr(self.deployment, "checkpoints", None)
        checkpoints = store.versions(tenant_id) if store is not None else []
        if version not in checkpoints:
            raise ValueError(
                f"version: tenant {tenant_id!r} has no policy version {version} (served: {served}, "
                f"checkpoints: {checkpoints})"
            )
        manifest, module_state, _ = self.deployment.checkpoints.load_tenant(tenant_id, version)
        self.deployment.inference_service.load_weights(encode_tenant_payload(module_state, manifest))


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


@dataclass(frozen=True)
class EvaluationResult:
    tenant_id: str
    policy_version: int
    simulator: str
    task: str
    episodes: int
    success_rate: float
    mean_return: float
    mean_length: float
    returns: tuple[float, ...]
    # Per-episode records (in episode order) and the success rate's 95% Wilson interval.
    lengths: tuple[int, ...] = ()
    successes: tuple[bool, ...] = ()
    seeds: tuple[int, ...] = ()
    success_ci: tuple[float, float] = (0.0, 1.0)


class EpisodeProgress:
    """`episode` events over a whole suite (done / total episodes, running success rate): watchers
    see episodes, not jobs. A re-run after a restart starts a new count."""

    def __init__(self, manager: Any, workload_id: str, total: int) -> None:
        self.manager, self.workload_id, self.total = manager, workload_id, total
        self.done_before = self.successes_before = 0

    def wrap(self, evaluate: Callable[..., EvaluationResult]) -> Callable[..., EvaluationResult]:
        def evaluate_entry(*args: Any, **kwargs: Any) -> EvaluationResult:
            last = [0, 0]

            def on_episode(done: int, _entry_total: int, successes: int) -> None:
                last[:] = [done, successes]
                done_all, successes_all = self.done_before + done, self.successes_before + successes
                self.manager._emit(
                    self.workload_id, "episode", done=done_all, total=self.total, success_rate=successes_all / done_all
                )

            result = evaluate(*args, on_episode=on_episode, **kwargs)
            self.done_before += last[0]
            self.successes_before += last[1]
            return result

        return evaluate_entry


def evaluate_policy(
    config: TenantBackendConfig,
    environment: EnvironmentService,
    inference: InferenceEndpoint,
    *,
    version: int | str = "latest",
    episodes: int = 4,
    num_envs: int | None = None,
    seed_offset: int = 10_000,
    on_episode: Callable[[int, int, int], None] | None = None,
    videos: int = 0,
    on_video: Callable[[int, list[np.ndarray]], None] | None = None,
) -> EvaluationResult:
    """Run `episodes` episodes of the tenant's environment task at ONE policy version, resolved
    once here (so a benchmark never mixes revisions while the tenant keeps training).

    Episode j starts from seed environment.seed + seed_offset + j, whatever the policy does, so two
    evaluations of one tenant (before and after training) run the same episodes: env i of the `n`
    sessions runs episodes i, i + n, i + 2n, ... and results are reported in episode order.
    `on_episode(done, episodes, successes)` is called as episodes end (progress for watchers).

    `videos` > 0: episodes 0 .. videos-1 (at most one per session) are recorded through the
    simulator's renderer and handed to `on_video(episode, frames)` as they end."""
    if episodes < 1:
        raise ValueError(f"episodes: expected >= 1, got {episodes}")
    if version == "latest":
        resolved = inference.latest_version(config.tenant_id)
        if resolved is None:
            raise ValueError(f"version: tenant {config.tenant_id!r} has no policy version being served")
    elif isinstance(version, int) and not isinstance(version, bool):
        resolved = version
    else:
        raise ValueError(f"version: expected an int or 'latest', got {version!r}")
    if config.environment is None:
        raise ValueError(f"tenant {config.tenant_id!r} declares no environment to evaluate in")
    n = min(episodes, num_envs or config.environment.num_envs)
    base_seed = config.environment.seed + seed_offset  # env i's first episode: session seed base + i
    finished = [0] * n  # episodes env i has finished; its k-th is episode i + k * n
    quota = [len(range(i, episodes, n)) for i in range(n)]
    results: dict[int, tuple[float, int, bool]] = {}  # episode -> (return, length, success)
    recorded = min(videos, n) if on_video is not None else 0
    envs = EnvGroup(environment, config, f"eval-{uuid.uuid4().hex[:8]}", n, seed_offset=seed_offset, record=recorded)
    try:
        while len(results) < episodes:
            active = [finished[i] < quota[i] for i in range(n)]
            # The episode an env starts after this one ends (unused when its quota is done).
            envs.episode_seeds = [base_seed + i + (finished[i] + 1) * n for i in range(n)]
            running = [i for i in range(n) if active[i]]
            preds = predict_many(
                inference, config.tenant_id, [envs.obs[i] for i in running], policy_version=resolved, sample=False,
                session_ids=[envs.ids[i] for i in running], operation="evaluate",
            )  # fmt: skip
            chunks: list[np.ndarray | None] = [None] * n
            for i, pred in zip(running, preds, strict=True):
                chunks[i] = pred["actions"][0]
            stats = EpisodeStats()
            _, terminated, truncated = envs.act(chunks, stats, active=active)
            ended = [i for i in range(n) if terminated[i] or truncated[i]]  # in the order act() recorded them
            for i, ret, length, success in zip(ended, stats.returns, stats.lengths, stats.successes, strict=True):
                results[i + finished[i] * n] = (ret, length, success)
                if i < recorded and finished[i] == 0 and on_video is not None:  # episode i: its first
                    on_video(i, envs.ended_frames.pop(i, []))
                finished[i] += 1
            if ended and on_episode is not None:
                on_episode(len(results), episodes, sum(1 for _, _, won in results.values() if won))
    finally:
        envs.close()
    return _result(config, int(resolved), [results[j] for j in range(episodes)], base_seed)


def _result(
    config: TenantBackendConfig, version: int, ordered: list[tuple[float, int, bool]], base_seed: int
) -> EvaluationResult:
    """The episodes' (return, length, success), in episode order, as a result with its interval."""
    assert config.environment is not None
    returns = [r for r, _, _ in ordered]
    successes = tuple(bool(s) for _, _, s in ordered)
    return EvaluationResult(
        tenant_id=config.tenant_id,
        policy_version=version,
        simulator=config.environment.simulator,
        task=config.environment.task,
        episodes=len(returns),
        success_rate=float(np.mean(successes)),
        mean_return=float(np.mean(returns)),
        mean_length=float(np.mean([n_ for _, n_, _ in ordered])),
        returns=tuple(returns),
        lengths=tuple(int(n_) for _, n_, _ in ordered),
        successes=successes,
        # Episode j's seed (the first episode of env j % n is its session's own seed).
        seeds=tuple(base_seed + j for j in range(len(ordered))),
        success_ci=wilson_interval(sum(successes), len(successes)),
    )
