"""The rollout producer records what GRPO and GAE need (issue 16): a GRPO group's envs start from
ONE seed and carry their group id; a time-limit truncation is recorded apart from a termination,
with V of the observation it was cut at; `rl.group_size` is checked when the tenant is created;
GRPO logs no value loss; evaluations run the same episodes whatever the policy."""

from __future__ import annotations

import numpy as np
import pytest

from joynexus.master.deployment import Deployment
from joynexus.master.loops.actor_loop import ActorLoop
from joynexus.services.producers.advantages import AdvantageStage
from joynexus.services.producers.evaluation import evaluate_policy
from joynexus.services.producers.rollout import RolloutProducer
from joynexus.settings import Settings
from joynexus.spec import SpecError
from tests.helpers import TINY_MODEL_ID


def spec(tenant: str, *, advantage: str, num_envs: int, horizon: int, **extra) -> dict:
    rl = {"advantage": advantage, "ppo_epochs": 1, **extra.pop("rl", {})}
    return {
        "tenant": tenant,
        "base_model": TINY_MODEL_ID,
        "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {"cameras": ["top"], "image_size": [32, 32], "state_dim": 4, "action_dim": 2},
        "environment": {"simulator": "pusht", "task": "PushT-reach-v0", "num_envs": num_envs, "horizon": horizon,
                        **extra.pop("environment", {})},
        "rl": rl,
        "scheduling": {"max_in_flight_jobs": 2, "completion_target": 4},
        "training": {"samples_per_job": num_envs * horizon, "microbatch_size": num_envs * horizon},
    }  # fmt: skip


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    deployment = Deployment.in_process(Settings(data_dir=tmp_path_factory.mktemp("groups"), torch_threads=1))
    yield deployment
    deployment.shutdown()


def producer_of(dep, tenant_id: str) -> RolloutProducer:
    tenant = dep.creator.get(tenant_id)
    dep.training_service.add_tenant(tenant.backend_config)
    dep.inference_service.load_weights(dep.training_service.export_params(tenant_id))
    return RolloutProducer(
        tenant.backend_config, dep.scheduler, dep.queue, dep.environment_service, dep.inference_service
    )


def columns(dep, job, names):
    meta = dep.queue.get_meta(job.partition_id, names, job.sample_count, "test-read")
    return dep.queue.get_data(meta)


def test_a_grpo_group_starts_from_one_seed_and_carries_its_id(dep):
    dep.creator.create(spec("grouped", advantage="grpo", num_envs=4, horizon=3, rl={"group_size": 2}))
    producer = producer_of(dep, "grouped")
    try:
        job = producer.produce_once()
        data = columns(dep, job, ("state", "group", "done"))
        state = np.asarray(data["state"]).reshape(3, 4, 4)
        groups = np.asarray(data["group"]).reshape(3, 4)
        np.testing.assert_array_equal(groups[0], [0, 0, 1, 1])
        np.testing.assert_array_equal(state[0, 0], state[0, 1])  # same initial state within a group
        np.testing.assert_array_equal(state[0, 2], state[0, 3])
        assert not np.array_equal(state[0, 0], state[0, 2])  # another group, another state
        second = columns(dep, producer.produce_once(), ("state",))
        assert not np.array_equal(np.asarray(second["state"])[0], state[0, 0])  # fresh states per rollout
        stage = AdvantageStage(dep.scheduler, dep.queue, lambda t: dep.creator.get(t).backend_config)
        assert stage.step().state == "ready"
        outcome = ActorLoop(dep.scheduler, dep.training_service).step()
        assert outcome.state == "completed"
        assert "rl/value_loss" not in outcome.metrics["rl_stats"]  # GRPO has no critic: nothing to log
        assert "rl/clip_fraction" in outcome.metrics["rl_stats"]
    finally:
        producer.close()


def test_a_time_limit_is_recorded_as_truncation_with_the_value_of_where_it_was_cut(dep):
    dep.creator.create(spec("cut", advantage="gae", num_envs=2, horizon=5, environment={"max_episode_steps": 2}))
    producer = producer_of(dep, "cut")
    try:
        job = producer.produce_once()
        data = columns(dep, job, ("done", "terminated", "truncated", "bootstrap_value", "value"))
        done, truncated = np.asarray(data["done"]).reshape(5, 2), np.asarray(data["truncated"]).reshape(5, 2)
        terminated = np.asarray(data["terminated"]).reshape(5, 2)
        bootstrap = np.asarray(data["bootstrap_value"]).reshape(5, 2)
        assert truncated[1].all() and truncated[3].all()  # cut at every 2nd step (no success that fast)
        np.testing.assert_array_equal(done, truncated | terminated)
        assert not (truncated & terminated).any()
        assert (bootstrap[truncated] != 0).all()  # V(s_cut) from the critic
        assert (bootstrap[[0, 2]] == 0).all()  # nothing needed mid-episode
        assert (bootstrap[4] != 0).all()  # the horizon cut: V(s_T)
    finally:
        producer.close()


@pytest.mark.parametrize(
    ("rl", "environment", "field"),
    [
        ({"advantage": "grpo", "group_size": 3}, {"num_envs": 4}, "rl.group_size"),
        ({"advantage": "gae", "group_size": 2}, {"num_envs": 4}, "rl.group_size"),
        ({"advantage": "grpo"}, {"num_envs": 1}, "environment.num_envs"),
    ],
)
def test_group_size_is_checked_at_creation_naming_the_field(dep, rl, environment, field):
    rl = dict(rl)
    bad = spec("bad-groups", advantage=rl.pop("advantage"), num_envs=environment["num_envs"], horizon=2, rl=rl)
    with pytest.raises(SpecError) as error:
        dep.creator.create(bad)
    assert field in error.value.fields


def test_evaluation_runs_the_same_episodes_whatever_the_policy_does(dep):
    dep.creator.create(spec("judged-twice", advantage="gae", num_envs=2, horizon=2))
    producer_of(dep, "judged-twice").close()
    config = dep.creator.get("judged-twice").backend_config
    short = config.model_copy(update={"environment": config.environment.model_copy(update={"max_episode_steps": 4})})
    first = evaluate_policy(short, dep.environment_service, dep.inference_service, episodes=3, num_envs=2)
    one_env = evaluate_policy(short, dep.environment_service, dep.inference_service, episodes=3, num_envs=1)
    # episode j has seed base + j however the envs split them (float noise of the batch shape aside)
    assert first.returns == pytest.approx(one_env.returns, rel=1e-6, abs=1e-6)
