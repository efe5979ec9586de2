"""GRPO over groups of attempts from one initial state, and GAE's bootstrap at time-limit
truncation and at the horizon cut (issue 16)."""

from __future__ import annotations

import numpy as np
import pytest

from joynexus.algorithms.rl import attempt_returns, gae, grpo_advantages
from joynexus.services.producers.advantages import compute_advantages
from joynexus.spec import RLSpec


def test_grpo_normalizes_each_group_against_its_own_attempts_only():
    # 4 envs, 2 groups of G=2; one step each, so an attempt's return is its reward.
    rewards = np.array([[1.0, 3.0, 10.0, 10.0]])
    dones = np.ones((1, 4), dtype=bool)
    groups = np.array([[0, 0, 1, 1]])
    adv, ret = grpo_advantages(rewards, dones, groups, eps=0.0)
    np.testing.assert_allclose(ret, rewards)
    np.testing.assert_allclose(adv[0, :2], [-1.0, 1.0], atol=1e-6)  # (r - mean) / std within group 0
    np.testing.assert_array_equal(adv[0, 2:], [0.0, 0.0])  # group 1: equal returns carry no signal


def test_grpo_gives_every_step_of_an_attempt_its_outcome_and_ignores_steps_outside_groups():
    gamma = 0.5
    rewards = np.array([[1.0, 0.0], [1.0, 0.0], [5.0, 2.0]])
    # env 0 ends its first attempt at t=1, then a second attempt (outside the group) runs at t=2.
    dones = np.array([[False, False], [True, False], [False, False]])
    groups = np.array([[0, 0], [0, 0], [-1, 0]])
    adv, ret = grpo_advantages(rewards, dones, groups, gamma=gamma, eps=0.0)
    first = 1.0 + gamma * 1.0
    second = 0.0 + gamma * 0.0 + gamma**2 * 2.0
    np.testing.assert_allclose(ret[:, 1], [second] * 3)
    np.testing.assert_allclose(ret[:2, 0], [first] * 2)
    np.testing.assert_allclose(ret[2, 0], 5.0)
    sign = np.sign(first - second)
    np.testing.assert_allclose(adv[:2, 0], [sign, sign], atol=1e-6)  # two attempts: +-1 after normalizing
    np.testing.assert_allclose(adv[:, 1], [-sign] * 3, atol=1e-6)
    assert adv[2, 0] == 0.0  # not in a group: no advantage


def test_grpo_statistics_weigh_attempts_not_steps():
    # A long attempt (3 steps) and two short ones: the group mean is over 3 returns, not 5 rows.
    rewards = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    dones = np.array([[False, True, True], [False, False, False], [True, False, False]])
    groups = np.array([[0, 0, 0], [0, -1, -1], [0, -1, -1]])
    adv, _ = grpo_advantages(rewards, dones, groups, gamma=1.0, eps=0.0)
    outcomes = np.array([1.0, 2.0, 3.0])
    expected = (outcomes - outcomes.mean()) / outcomes.std()
    np.testing.assert_allclose(adv[0], expected, atol=1e-6)
    np.testing.assert_allclose(adv[1:, 0], [expected[0]] * 2, atol=1e-6)


def test_attempt_returns_restart_after_each_episode_end_and_at_the_horizon():
    rewards = np.array([[1.0], [2.0], [4.0], [8.0]])
    dones = np.array([[False], [True], [False], [False]])
    np.testing.assert_allclose(attempt_returns(rewards, dones, gamma=1.0)[:, 0], [3.0, 3.0, 12.0, 12.0])


def test_gae_bootstraps_a_time_limit_truncation_but_not_a_termination():
    gamma, lam = 0.9, 0.8
    rewards = np.array([[1.0, 1.0]])
    values = np.array([[0.5, 0.5]])
    dones = np.array([[True, True]])
    truncated = np.array([[True, False]])  # env 0 hit the time limit, env 1 terminated
    cut_values = np.array([[2.0, 7.0]])  # V(final observation); env 1's must be ignored
    adv, ret = gae(
        rewards, values, dones, np.zeros(2), gamma=gamma, lam=lam, truncated=truncated, truncation_values=cut_values
    )
    np.testing.assert_allclose(adv[0], [1.0 + gamma * 2.0 - 0.5, 1.0 - 0.5], rtol=1e-6)
    np.testing.assert_allclose(ret, adv + values, rtol=1e-6)


def test_gae_does_not_carry_the_next_episode_across_a_truncation():
    gamma, lam = 0.9, 0.8
    rewards = np.array([[1.0], [0.0], [3.0]])
    values = np.array([[0.2], [0.4], [0.6]])
    dones = np.array([[False], [True], [False]])
    truncated = dones.copy()
    cut_values = np.array([[0.0], [5.0], [0.0]])
    last = np.array([1.5])  # V(s_T) at the horizon cut
    adv, _ = gae(rewards, values, dones, last, gamma=gamma, lam=lam, truncated=truncated, truncation_values=cut_values)
    d2 = 3.0 + gamma * 1.5 - 0.6
    d1 = 0.0 + gamma * 5.0 - 0.4  # bootstrapped from the cut observation, not the reset one
    d0 = 1.0 + gamma * 0.4 - 0.2
    np.testing.assert_allclose(adv[:, 0], [d0 + gamma * lam * d1, d1, d2], rtol=1e-6)


def test_the_advantage_stage_reads_truncation_and_groups_from_the_partition():
    rl = RLSpec(advantage="gae", gamma=0.9, gae_lambda=1.0)
    # time-major rows: t0 (env0, env1), t1 (env0, env1)
    data = {
        "reward": np.array([1.0, 1.0, 1.0, 1.0]),
        "value": np.zeros(4),
        "done": np.array([True, True, False, False]),
        "truncated": np.array([True, False, False, False]),
        "bootstrap_value": np.array([10.0, 10.0, 3.0, 3.0]),  # t0: cut values; t1: V(s_T)
    }
    out = compute_advantages(data, num_envs=2, horizon=2, rl=rl)
    np.testing.assert_allclose(out["advantage"], [1.0 + 0.9 * 10.0, 1.0, 1.0 + 0.9 * 3.0, 1.0 + 0.9 * 3.0])
    # Without the field (an older partition), every episode end is a termination.
    del data["truncated"]
    assert compute_advantages(data, num_envs=2, horizon=2, rl=rl)["advantage"][0] == pytest.approx(1.0)

    grpo = RLSpec(advantage="grpo", gamma=1.0)
    data = {"reward": np.array([1.0, 2.0, 5.0, 5.0]), "done": np.ones(4, dtype=bool), "group": np.array([0, 0, 1, 1])}
    out = compute_advantages(data, num_envs=4, horizon=1, rl=grpo)
    assert out["advantage"][0] < 0 < out["advantage"][1] and list(out["advantage"][2:]) == [0.0, 0.0]
