"""RL rollout producer (paper Fig. 6 left, Appendix A.4) and the environment sessions it acts in.

The producer records the tenant's current serving version, reserves an RL job (sample count =
envs x horizon), runs the rollout — every env step's observation goes through the Inference Queue,
where it is group-batched with other tenants' requests — writes the trajectory partition with
tenant, schema and behavior-version annotations, and marks it for the advantage stage.

Evaluation (`joynexus.master.workloads.evaluation`) runs episodes in the same `EnvGroup`. Handles are
typed with the services' interfaces (`InferenceEndpoint` imports no model stack).
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from joynexus.actors import handle_of
from joynexus.core.tenants import TenantBackendConfig, simulator_config
from joynexus.envs.base import unit_to_bounds
from joynexus.scheduling.inference_queue import Observation
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import NEEDS_ADVANTAGES, TrainingJob, TrainingScheduler
from joynexus.services.inference.endpoint import InferenceEndpoint
from joynexus.services.producers.base import Producer
from joynexus.spec import MAX_ENVIRONMENT_SEED

if TYPE_CHECKING:  # the session class only names the type: its module is not needed at run time
    from joynexus.services.environment.sessions import EnvironmentService


def predict_many(
    inference: InferenceEndpoint,
    tenant_id: str,
    observations: list[Observation],
    *,
    policy_version: int | None,
    sample: bool,
    session_ids: list[str] | None = None,
    operation: str = "rollout",
) -> list[dict[str, Any]]:
    """One request per observation, all in flight at once, so the Inference Scheduler can batch
    them with each other and with other tenants' requests. `operation` names the use in the
    service's metering ("rollout", "evaluate")."""
    sessions = session_ids or [None] * len(observations)
    request = {"policy_version": policy_version, "sample": sample, "operation": operation}
    handle = handle_of(inference)
    # In process the service's own queue hands out the futures (`locally`): no thread per request.
    futures = [
        handle.start(InferenceEndpoint.predict, tenant_id, [obs], locally=InferenceEndpoint.submit, session_id=sid,
                     **request)
        for obs, sid in zip(observations, sessions, strict=True)
    ]  # fmt: skip
    return [f.result(timeout=180) for f in futures]


def to_observation(raw: dict[str, Any], cameras: tuple[str, ...], instruction: str) -> Observation:
    images = raw.get("images") or {}
    missing = [c for c in cameras if c not in images]
    if missing:
        raise ValueError(f"observation: the simulator did not render cameras {missing}; it gave {sorted(images)}")
    return Observation(
        images=tuple(np.asarray(images[c], dtype=np.float32) for c in cameras),
        state=np.asarray(raw["state"], dtype=np.float32),
        instruction=raw.get("instruction") or instruction,
    )


class NoServingVersion(RuntimeError):
    """Rollouts need a served version of the tenant's policy and none is (e.g. the Inference Model
    Service restarted in place): publish one and try again."""


@dataclass
class EpisodeStats:
    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    successes: list[bool] = field(default_factory=list)
    # Simulator steps taken so far (finished episodes or not; never drained): rollout progress in steps.
    env_steps: int = 0

    def drain(self) -> dict[str, float]:
        """Summary of the episodes finished since the last drain, then forget them."""
        summary = self.summary()
        self.returns, self.lengths, self.successes = [], [], []
        return summary

    def summary(self) -> dict[str, float]:
        if not self.returns:
            return {"episodes": 0, "env_steps": self.env_steps}
        return {
            "episodes": len(self.returns),
            "env_steps": self.env_steps,
            "mean_return": float(np.mean(self.returns)),
            "success_rate": float(np.mean(self.successes)),
            "mean_length": float(np.mean(self.lengths)),
        }


class EnvGroup:
    """A tenant's `n` environment sessions with their running episodes."""

    def __init__(
        self,
        env: EnvironmentService,
        config: TenantBackendConfig,
        rollout_id: str,
        n: int,
        seed_offset: int = 0,
        record: int = 0,
    ):
        self.env, self.config = env, config
        self.ids: list[str] = []
        # Evaluation videos: sessions i < `record` attach the renderer's frame to every observation;
        # `frames[i]` collects env i's running episode, `ended_frames[i]` its last finished one.
        self.frames: dict[int, list[np.ndarray]] = {}
        self.ended_frames: dict[int, list[np.ndarray]] = {}
        # All n sessions start at once: each is a worker process that imports and builds its
        # simulator (~0.7 s of CPU for gym-pusht), so one after another they made a rollout's start
        # n times that long; the service opens sessions concurrently (its own lock per session).
        # environment.envs_per_worker > 1: envs i .. i+k-1 are the slots of ONE vectorized session
        # (`envs.vector`, seeded like k sessions), addressed "<session>#<slot>".
        per = config.environment.envs_per_worker if config.environment is not None else 1
        sims = [simulator_config(config, seed_offset=seed_offset + i) for i in range(0, n, per)]
        for first, sim in zip(range(0, n, per), sims, strict=True):
            sim["record_frames"] = first < record
            sim["num_envs"] = min(per, n - first)
        with ThreadPoolExecutor(max_workers=len(sims), thread_name_prefix=f"open-{config.tenant_id}") as pool:
            futures = [pool.submit(env.open_session, config.tenant_id, rollout_id, sim) for sim in sims]
        opened = [f.result() for f in futures if f.exception() is None]
        # In env order when all opened (seeds follow the index); closed on failure.
        self.ids = [
            sid if sim["num_envs"] == 1 else f"{sid}#{slot}"
            for sid, sim in zip(opened, sims, strict=False)
            for slot in range(sim["num_envs"])
        ]
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:
            self.close()
            raise failed
        spec = env.spec(config.tenant_id, self.ids[0])
        # Policies act in [-1, 1] per action dimension; the simulator's own bounds may differ
        # (gym-pusht takes pixel targets in [0, 512]), so actions are mapped affinely.
        self.low = np.asarray(spec["action_low"], dtype=np.float32)
        self.high = np.asarray(spec["action_high"], dtype=np.float32)
        self.obs = [self._obs(env.reset(config.tenant_id, sid), i) for i, sid in enumerate(self.ids)]
        self.episode_return = [0.0] * n
        self.episode_length = [0] * n
        # Per env, the seed its next episodes start from (None: the simulator's own RNG stream);
        # GRPO sets one seed per group so a group's attempts start from the same state.
        self.episode_seeds: list[int | None] = [None] * n
        # Per env whose episode ended in the last act(): the observation it ended at (before the reset).
        self.final_obs: dict[int, Observation] = {}

    def reset_all(self, seeds: list[int | None]) -> None:
        """Start a fresh episode in every env (an unfinished one is dropped, not counted), env i
        from seeds[i]; later episodes of env i start from the same seed."""
        self.episode_seeds = list(seeds)
        for i, sid in enumerate(self.ids):
            self.frames.pop(i, None)
            self.obs[i] = self._obs(self.env.reset(self.config.tenant_id, sid, seed=seeds[i]), i)
            self.episode_return[i], self.episode_length[i] = 0.0, 0

    def _obs(self, raw: dict[str, Any], i: int) -> Observation:
        if raw.get("frame") is not None:
            self.frames.setdefault(i, []).append(np.asarray(raw["frame"]))
        return to_observation(raw, self.config.cameras, self.config.instruction)

    def act(
        self, chunks: list[np.ndarray | None], stats: EpisodeStats, active: list[bool] | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Execute each env's action chunk open-loop (stopping at an episode end); returns each
        env's summed reward, whether its episode terminated, and whether it was truncated (a time
        limit: not a termination). Ended episodes are reset; `final_obs` keeps where they ended.
        Envs with `active[i]` False do not step (their chunk may be None)."""
        n = len(self.ids)
        rewards, done = np.zeros(n, dtype=np.float32), np.zeros(n, dtype=bool)
        terminated, truncated = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        idle = np.zeros(n, dtype=bool) if active is None else ~np.asarray(active, dtype=bool)
        self.final_obs = {}
        success = [False] * n
        chunk_len = next(c for c, off in zip(chunks, idle, strict=True) if not off).shape[0]
        for k in range(chunk_len):
            live = {self.ids[i]: self.to_env_action(chunks[i][k]) for i in range(n) if not (done[i] or idle[i])}
            if not live:
                break
            results = self.env.batch_step(self.config.tenant_id, live)
            for i, sid in enumerate(self.ids):
                if sid not in results:
                    continue
                result = results[sid]
                if "error" in result:
                    raise RuntimeError(f"environment session {sid} failed: {result['error']}")
                rewards[i] += float(result["reward"])
                self.episode_length[i] += 1
                stats.env_steps += 1
                success[i] = success[i] or bool(result.get("success"))
                if result["terminated"] or result["truncated"]:
                    done[i] = True
                    terminated[i] = bool(result["terminated"])
                    truncated[i] = not terminated[i]  # a success on the last allowed step is a termination
                self.obs[i] = self._obs(result["observation"], i)
        for i in np.flatnonzero(~idle):
            self.episode_return[i] += float(rewards[i])
            if done[i]:
                stats.returns.append(self.episode_return[i])
                stats.lengths.append(self.episode_length[i])
                stats.successes.append(success[i])
                self.episode_return[i], self.episode_length[i] = 0.0, 0
                self.final_obs[i] = self.obs[i]
                if i in self.frames:
                    self.ended_frames[i] = self.frames.pop(i)
                reset = self.env.reset(self.config.tenant_id, self.ids[i], seed=self.episode_seeds[i])
                self.obs[i] = self._obs(reset, i)
        return rewards, terminated, truncated

    def to_env_action(self, action: np.ndarray) -> np.ndarray:
        return unit_to_bounds(action, self.low, self.high)

    def close(self) -> None:
        for sid in self.ids:
            try:
                self.env.close(self.config.tenant_id, sid)
            except Exception:  # a failed session is already gone
                pass
        self.ids = []


class RolloutProducer(Producer):
    task_type = "rl"

    def __init__(
        self,
        config: TenantBackendConfig,
        scheduler: TrainingScheduler,
        queue: TrainingQueue,
        environment: EnvironmentService,  # the service or its handle (local or a Ray actor)
        inference: InferenceEndpoint,
        *,
        job_metadata: dict[str, Any] | None = None,
        rollout_slots: threading.Semaphore | None = None,  # the global concurrent-rollout limit
    ):
        if config.environment is None or config.rl is None:
            raise ValueError(f"tenant {config.tenant_id!r} is not an RL tenant (no environment / rl section)")
        self.config = config
        self.scheduler, self.queue = scheduler, queue
        self.env, self.inference = environment, inference
        self.job_metadata = dict(job_metadata or {})
        self.rollout_slots = rollout_slots
        self.num_envs = config.environment.num_envs
        self.horizon = config.environment.horizon
        # GRPO: num_envs = groups x group_size; every rollout resets a group's envs from one seed.
        self.grpo = config.rl.advantage == "grpo"
        self.group_size = config.rl.group_size or self.num_envs
        if self.grpo and (self.group_size < 2 or self.num_envs % self.group_size):
            raise ValueError(
                f"rl.group_size: {self.group_size} must be >= 2 and divide environment.num_envs ({self.num_envs})"
            )
        self.rollouts = 0  # rollouts produced by this producer (GRPO draws fresh group seeds per rollout)
        self._envs: EnvGroup | None = None
        self.stats = EpisodeStats()

    def produce_once(self) -> TrainingJob | None:
        cfg = self.config
        version = self.inference.latest_version(cfg.tenant_id)
        if version is None:
            raise NoServingVersion(f"tenant {cfg.tenant_id!r} has no policy version being served; publish one first")
        job = self.scheduler.reserve(
            tenant_id=cfg.tenant_id,
            task_type="rl",
            sample_count=self.num_envs * self.horizon,
            behavior_policy_version=version,
            producer_role="rollout",
            consumer_role="actor",
            metadata={
                **self.job_metadata,
                "schema_signature": cfg.schema_signature,
                "num_envs": self.num_envs,
                "horizon": self.horizon,
            },
        )
        if job is None:
            return None
        # Read again once admitted: a job that completed between the first read and the reservation
        # (freeing the slot this one took) published its update first, and the rollout should act
        # with it rather than start a version behind.
        admitted_with = version
        version = max(version, self.inference.latest_version(cfg.tenant_id) or version)
        try:
            if self.rollout_slots is not None:
                self.rollout_slots.acquire()
            try:
                data = self._rollout(version)
            finally:
                if self.rollout_slots is not None:
                    self.rollout_slots.release()
            self.queue.put(
                job.partition_id,
                data,
                annotations={
                    "tenant_id": cfg.tenant_id,
                    "schema_signature": cfg.schema_signature,
                    "behavior_policy_version": version,
                },
            )
        except Exception as error:
            self.queue.clear(job.partition_id)
            self.scheduler.fail(job.job_id, f"rollout: {type(error).__name__}: {error}")
            self.close()  # sessions may be broken; the next rollout opens fresh ones
            raise
        moved = None if version == admitted_with else version
        return self.scheduler.mark(job.job_id, NEEDS_ADVANTAGES, behavior_policy_version=moved)

    def _rollout(self, version: int) -> dict[str, Any]:
        cfg = self.config
        if self._envs is None:
            self._envs = EnvGroup(self.env, cfg, f"{cfg.tenant_id}-{uuid.uuid4().hex[:8]}", self.num_envs)
        envs = self._envs
        env_group = np.arange(self.num_envs) // self.group_size
        if self.grpo:  # a group's G envs start from the same state, fresh states every rollout
            envs.reset_all([self._group_seed(int(g)) for g in env_group])
        first_attempt = np.ones(self.num_envs, dtype=bool)
        self.rollouts += 1
        columns: dict[str, list[Any]] = {k: [] for k in ("images", "state", "action", "log_prob", "value", "reward")}
        for name in ("done", "terminated", "truncated", "group"):
            columns[name] = []
        # bootstrap[t, i] = V(s_{t+1}) where GAE needs it: at a time-limit truncation (the observation
        # the episode was cut at) and after the horizon (where each env stands); 0 elsewhere.
        bootstrap = np.zeros((self.horizon, self.num_envs), dtype=np.float32)
        has_critic = False
        for t in range(self.horizon):
            preds = predict_many(
                self.inference, cfg.tenant_id, envs.obs, policy_version=version, sample=True, session_ids=envs.ids
            )
            has_critic = preds[0]["values"] is not None
            for obs, pred in zip(envs.obs, preds, strict=True):
                # A state-only tenant (no cameras) stores a (0, 3, 1, 1) placeholder per sample.
                columns["images"].append(np.stack(obs.images) if obs.images else np.zeros((0, 3, 1, 1), np.float32))
                columns["state"].append(obs.state)
                columns["action"].append(pred["actions"][0])
                columns["log_prob"].append(float(pred["log_probs"][0]))
                if pred.get("chains") is not None:  # a flow head's density is over its denoising chain
                    columns.setdefault("chain", []).append(pred["chains"][0])
                columns["value"].append(float(pred["values"][0]) if has_critic else 0.0)
            rewards, terminated, truncated = envs.act([p["actions"][0] for p in preds], self.stats)
            done = terminated | truncated
            columns["reward"].extend(rewards.tolist())
            columns["done"].extend(done.tolist())
            columns["terminated"].extend(terminated.tolist())
            columns["truncated"].extend(truncated.tolist())
            # GRPO compares each env's first attempt in its group; later attempts had less horizon left.
            columns["group"].extend(np.where(first_attempt, env_group, -1).tolist() if self.grpo else [-1] * len(done))
            first_attempt &= ~done
            cut = [i for i in range(self.num_envs) if truncated[i]]
            if has_critic and cut:
                values = predict_many(
                    self.inference, cfg.tenant_id, [envs.final_obs[i] for i in cut], policy_version=version,
                    sample=False,
                )  # fmt: skip
                bootstrap[t, cut] = [float(p["values"][0]) for p in values]
        if has_critic:  # the value of where each env stands after the horizon (ended ones: unused)
            last = predict_many(self.inference, cfg.tenant_id, envs.obs, policy_version=version, sample=False)
            live = ~np.asarray(columns["done"][-self.num_envs :], dtype=bool)
            bootstrap[-1, live] = np.asarray([float(p["values"][0]) for p in last], dtype=np.float32)[live]
        n = self.num_envs * self.horizon
        chunk = cfg.action_chunk
        data = {
            "images": np.stack(columns["images"]).astype(np.float32),
            "state": np.stack(columns["state"]).astype(np.float32).reshape(n, cfg.state_dim),
            "action": np.stack(columns["action"]).astype(np.float32),
            "action_is_pad": np.zeros((n, chunk), dtype=bool),
            "log_prob": np.asarray(columns["log_prob"], dtype=np.float32),
            "value": np.asarray(columns["value"], dtype=np.float32),
            "reward": np.asarray(columns["reward"], dtype=np.float32),
            "done": np.asarray(columns["done"], dtype=bool),  # the episode ended (either way): env reset after it
            "terminated": np.asarray(columns["terminated"], dtype=bool),
            "truncated": np.asarray(columns["truncated"], dtype=bool),  # a time limit: bootstrapped, not terminal
            "group": np.asarray(columns["group"], dtype=np.int64),  # GRPO group id; -1: in no group
            "bootstrap_value": bootstrap.reshape(-1),
            "task": [cfg.instruction] * n,
            # Every sample carries its tenant, schema and behavior version (paper A.4).
            "tenant_id": [cfg.tenant_id] * n,
            "schema_signature": [cfg.schema_signature] * n,
            "behavior_policy_version": np.full(n, version, dtype=np.int64),
        }
        if "chain" in columns:  # (n, K+1, chunk, A): what the PPO update rescores (models.action_modules.flow_rl)
            data["chain"] = np.stack(columns["chain"]).astype(np.float32)
        return data

    def _group_seed(self, group: int) -> int:
        """The initial-state seed of a GRPO group in this rollout: fixed by the environment seed,
        the rollout's index and the group, and spread over the seed range (evaluation episodes
        use environment.seed + 10_000 + i, which these practically never hit)."""
        base = self.config.environment.seed
        state = np.random.SeedSequence([base, self.rollouts, group]).generate_state(1, np.uint32)[0]
        return int(state) % MAX_ENVIRONMENT_SEED

    def close(self) -> None:
        if self._envs is not None:
            self._envs.close()
            self._envs = None
