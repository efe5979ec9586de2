"""Evaluation episodes (paper 4.2): a tenant's policy at ONE version, resolved once at the start,
through the Inference Queue and the Environment Service, deterministic actions, episode j always
from seed `environment.seed + 10_000 + j` (the same episodes before and after training). No
training job, no partition, no version change. The producer service runs them (for evaluation
workloads and promotion measurements); the Master only records what they found."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from joynexus.core.tenants import TenantBackendConfig
from joynexus.services.inference.endpoint import InferenceEndpoint
from joynexus.services.producers.evaluation_stats import wilson_interval
from joynexus.services.producers.rollout import EnvGroup, EpisodeStats, predict_many

if TYPE_CHECKING:
    from joynexus.services.environment.sessions import EnvironmentService


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
