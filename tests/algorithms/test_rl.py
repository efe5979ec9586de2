"""RL estimators against hand-computed values, and the PPO objective's clipping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from joynexus.algorithms.rl import discounted_returns, gae, grpo_advantages, ppo_loss


def test_gae_matches_a_hand_computation_and_stops_at_episode_ends():
    rewards = np.array([[1.0], [0.0], [2.0]])
    values = np.array([[0.5], [0.4], [0.3]])
    dones = np.array([[False], [True], [False]])
    last = np.array([1.0])
    adv, ret = gae(rewards, values, dones, last, gamma=0.9, lam=0.8)
    d2 = 2.0 + 0.9 * 1.0 - 0.3
    d1 = 0.0 - 0.4  # episode ended at t=1: no bootstrap, no carry from t=2
    d0 = 1.0 + 0.9 * 0.4 - 0.5
    expected = np.array([[d0 + 0.9 * 0.8 * d1], [d1], [d2]])
    np.testing.assert_allclose(adv, expected, rtol=1e-6)
    np.testing.assert_allclose(ret, expected + values, rtol=1e-6)


def test_lambda_one_gae_equals_discounted_returns_minus_values_without_bootstrap():
    rng = np.random.default_rng(0)
    rewards = rng.standard_normal((6, 3))
    values = rng.standard_normal((6, 3))
    dones = np.zeros((6, 3), dtype=bool)
    dones[-1] = True
    adv, _ = gae(rewards, values, dones, np.zeros(3), gamma=0.95, lam=1.0)
    np.testing.assert_allclose(adv, discounted_returns(rewards, dones, gamma=0.95) - values, rtol=1e-5, atol=1e-6)


def test_grpo_normalizes_within_the_group_of_environments():
    rewards = np.array([[1.0, 0.0, 0.0, 3.0]])
    dones = np.ones((1, 4), dtype=bool)
    adv, ret = grpo_advantages(rewards, dones)
    np.testing.assert_allclose(ret, rewards)
    assert adv.mean() == pytest.approx(0.0, abs=1e-6) and adv.std() == pytest.approx(1.0, abs=1e-4)
    assert adv[0, 3] > adv[0, 0] > adv[0, 1]


def test_ppo_clips_the_ratio_and_adds_the_value_loss():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 1.5, 0.5, 1.0]))
    adv = torch.tensor([1.0, -1.0, 1.0, 0.0])
    out = ppo_loss(new, old, adv, normalize_advantages=False, clip=0.2)
    # min(r*A, clip(r)*A): 1.2 (clipped), -1.5, 0.5, 0.0
    assert out.policy.item() == pytest.approx(-(1.2 - 1.5 + 0.5 + 0.0) / 4, rel=1e-6)
    assert out.clip_fraction.item() == pytest.approx(0.75)
    with_value = ppo_loss(
        new, old, adv, values=torch.ones(4), returns=torch.zeros(4), normalize_advantages=False, value_coef=0.5
    )
    assert with_value.value.item() == pytest.approx(0.5)
    assert with_value.total.item() == pytest.approx(out.policy.item() + 0.25)


def test_the_decoupled_objective_clips_around_the_proximal_policy_and_weights_by_staleness():
    behavior = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    proximal = torch.log(torch.tensor([0.5, 1.0, 0.25, 0.5]))  # the learner moved on from the behavior
    new = proximal + torch.log(torch.tensor([1.5, 1.1, 1.0, 0.5]))
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0])
    out = ppo_loss(new, proximal, adv, normalize_advantages=False, clip=0.2, behavior_log_prob=behavior)
    # ratios to the proximal policy 1.5 (clipped to 1.2), 1.1, 1.0, 0.5; weights proximal / behavior 1, 2, 0.5, 1
    assert out.policy.item() == pytest.approx(-(1.2 * 1 + 1.1 * 2 - 1.0 * 0.5 + 0.5 * 1) / 4, rel=1e-6)
    assert out.clip_fraction.item() == pytest.approx(0.5)
    # On-policy data (proximal == behavior): exactly plain PPO, value and gradient.
    theta = new.clone().requires_grad_(True)
    plain = ppo_loss(theta, behavior, adv, normalize_advantages=False)
    plain.total.backward()
    plain_grad = theta.grad.clone()
    theta.grad = None
    decoupled = ppo_loss(theta, behavior, adv, normalize_advantages=False, behavior_log_prob=behavior)
    decoupled.total.backward()
    assert decoupled.total.item() == pytest.approx(plain.total.item())
    torch.testing.assert_close(theta.grad, plain_grad)
    # A sample the learner finds far likelier than its behavior policy did counts at most the cap.
    capped = ppo_loss(
        torch.zeros(1), torch.zeros(1), torch.ones(1), normalize_advantages=False,
        behavior_log_prob=torch.tensor([-10.0]), behavior_weight_cap=5.0,
    )  # fmt: skip
    assert capped.policy.item() == pytest.approx(-5.0)
