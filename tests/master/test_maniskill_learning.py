"""State-only ManiSkill PushCube learns through the services with the tuned spec
(examples/specs/tuned/pushcube_state.yaml): the Master's workloads roll out in the Environment
Service, train PPO on the Training Model Service and evaluate the served version on fixed seeds.

Default suite: the tuned spec's knobs. Slow (ManiSkill worker processes start four times: the
creator's probe, two evaluations and the workload; about a minute on an idle 2-core host, over ten
under load): a few PPO updates raise the deterministic policy's dense return over the initial
policy's on the same evaluation episodes (it fails when the updates do not help), and the tuned
budget (80 jobs per seed) lifts the success rate from the initial policy's 0% to at least 40%
averaged over three seeds (the measured level is ~70%)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from joynexus.actors import handle_of
from joynexus.master.deployment import Deployment
from joynexus.master.workloads.manager import WorkloadManager
from joynexus.settings import Settings

TUNED = Path(__file__).resolve().parents[2] / "examples" / "specs" / "tuned" / "pushcube_state.yaml"
TUNED_JOBS = 80  # the stated budget: 32k environment steps per seed


def _maniskill_or_skip() -> None:
    from joynexus.envs import build_simulator

    try:
        with build_simulator({"simulator": "maniskill", "task": "PushCube-v1"}):
            pass
    except Exception as error:  # no Vulkan device or ManiSkill here
        pytest.skip(f"ManiSkill PushCube-v1 unavailable: {error}")


def tuned_spec(tenant: str, **environment: Any) -> dict[str, Any]:
    spec = yaml.safe_load(TUNED.read_text())
    spec["tenant"] = tenant
    spec["environment"].update(environment)
    env = spec["environment"]
    spec["training"]["samples_per_job"] = env["num_envs"] * env["horizon"]
    spec["training"]["microbatch_size"] = min(spec["training"]["microbatch_size"], spec["training"]["samples_per_job"])
    return spec


@pytest.fixture
def manager(tmp_path):
    _maniskill_or_skip()
    dep = Deployment.in_process(Settings(data_dir=tmp_path / "data", torch_threads=1))
    # A loaded CI host can take minutes to start a worker that imports ManiSkill and builds its scenes.
    handle_of(dep.environment_service).target.reset_timeout_s = 900.0
    handle_of(dep.environment_service).target.startup_timeout_s = 900.0
    manager = WorkloadManager(dep).start()
    yield manager
    manager.stop()
    dep.shutdown()


def _evaluate(manager: WorkloadManager, tenant: str, episodes: int) -> dict[str, Any]:
    status = manager.wait(manager.evaluate(tenant, episodes=episodes).workload_id, 900)
    assert status.state == "completed", status.error
    return status.result


def _train(manager: WorkloadManager, tenant: str, jobs: int) -> None:
    status = manager.wait(manager.submit(tenant, jobs=jobs).workload_id, 3600)
    assert status.state == "completed", status.error


def test_the_tuned_spec_is_state_only_dense_reward_end_effector_control():
    spec = yaml.safe_load(TUNED.read_text())
    env = spec["environment"]
    assert spec["observation"]["cameras"] == [] and spec["rl"]["advantage"] == "gae"
    assert (env["reward_mode"], env["control_mode"]) == ("normalized_dense", "pd_ee_delta_pos")
    assert env["envs_per_worker"] == env["num_envs"]  # one simulator worker per rollout
    assert spec["training"]["samples_per_job"] == env["num_envs"] * env["horizon"]


@pytest.mark.slow
def test_a_few_ppo_updates_raise_pushcube_dense_return_over_the_initial_policy(manager):
    spec = tuned_spec("cube-learns", num_envs=4, envs_per_worker=4, horizon=25, seed=3)
    manager.deployment.creator.create(spec)
    before = _evaluate(manager, "cube-learns", episodes=4)
    _train(manager, "cube-learns", jobs=5)  # 500 environment steps
    after = _evaluate(manager, "cube-learns", episodes=4)
    # Same 4 episodes (seeded), deterministic actions: the return moves only through the updates.
    assert after["mean_return"] > before["mean_return"] + 0.15, (before["mean_return"], after["mean_return"])


@pytest.mark.slow
@pytest.mark.timeout(3600)  # three tenants x 80 jobs: ~15 minutes on 2 idle cores
def test_the_tuned_budget_reaches_the_stated_pushcube_success(manager):
    """The stated budget (docs/rl_tuning.md): one 80-job workload (32k environment steps) per seed,
    three seeds at once, deterministic success on 32 seeded episodes. Over six seeds the tuned spec
    reaches ~70% there (single seeds 56-94%), from 0% for the initial policy; the test holds the mean
    of seeds 0-2 to at least 40%, so it fails when learning breaks, not on a run of unlucky seeds
    (one 32-episode evaluation's 95% interval is ~30 points wide)."""
    seeds = (0, 1, 2)
    for seed in seeds:
        spec = tuned_spec(f"cube-succeeds-{seed}", seed=seed)
        spec["training"]["seed"] = seed
        manager.deployment.creator.create(spec)
    runs = [manager.submit(f"cube-succeeds-{seed}", jobs=TUNED_JOBS).workload_id for seed in seeds]
    for status in manager.wait_all(runs, timeout_s=3600):
        assert status.state == "completed", status.error
    rates = [_evaluate(manager, f"cube-succeeds-{seed}", episodes=32)["success_rate"] for seed in seeds]
    assert sum(rates) / len(rates) >= 0.4, rates


def test_the_main_jobs_maniskill_tenant_is_the_tuned_spec():
    from joynexus.spec import parse_workload_spec
    from recipes.main_job import cube_rl_spec

    spec = parse_workload_spec(cube_rl_spec("some/model", jobs=7))
    tuned = parse_workload_spec(TUNED)
    assert (spec.tenant, spec.base_model, spec.scheduling.completion_target) == ("cube-pusher-rl", "some/model", 7)
    assert (spec.environment, spec.rl, spec.training, spec.observation) == (
        tuned.environment, tuned.rl, tuned.training, tuned.observation,
    )  # fmt: skip
