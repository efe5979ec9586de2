"""RL for the flow-matching expert (`models.action_modules.flow_rl`, ReinFlow-style noise injection):
the sampled chain's log-probability is the sum of its Gaussian transitions (checked against an
independent recomputation step by step), the grouped kernel samples what the per-tenant module
samples, and PPO on the chain's density moves the policy toward a higher reward."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from joynexus.algorithms.rl import ppo_loss
from joynexus.models.action_modules import build_action_module
from joynexus.models.action_modules.flow_rl import NOISE_STD_MAX, NOISE_STD_MIN
from joynexus.models.backbone import BackboneFeatures
from joynexus.models.module_batching import gather_inputs, group_sample, stack_parameters, unpad_actions

STATE, ACT, CHUNK, STEPS = 3, 2, 4, 5


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _flow(seed: int = 0, **overrides: object):
    torch.manual_seed(seed)
    fields = dict(kind="flow_matching", feature_dim=32, state_dim=STATE, action_dim=ACT, action_chunk=CHUNK,
                  size="tiny", num_inference_steps=STEPS, stochastic=True)  # fmt: skip
    fields.update(overrides)
    return build_action_module(fields)


def _features(batch: int, seed: int, dim: int = 32) -> BackboneFeatures:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(batch, 6, dim, generator=g)
    mask = torch.ones(batch, 6, dtype=torch.bool)
    mask[0, 4:] = False  # one row with padding tokens
    return BackboneFeatures(tokens=tokens, mask=mask, pooled=tokens.mean(dim=1))


def test_a_sampled_chains_log_prob_is_the_sum_of_its_gaussian_transitions() -> None:
    module = _flow()
    features, state = _features(3, seed=1), torch.randn(3, STATE)
    noise = torch.randn(3, *module.sample_noise_shape(), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        actions, log_prob, chain = module.sample_policy(features, state, noise)
        rescored, entropy = module.record_log_prob(features, state, chain)
    assert chain.shape == (3, STEPS + 1, CHUNK, ACT)
    torch.testing.assert_close(actions, chain[:, -1])
    torch.testing.assert_close(chain[:, 0], noise[:, 0])  # x_0 is the drawn noise itself
    # Independently: each transition's mean from the module's own forward (its velocity), each
    # step's std from the noise net, densities from torch.distributions.
    expected = torch.distributions.Normal(0.0, 1.0).log_prob(chain[:, 0]).sum(dim=(-1, -2))
    expected_entropy = torch.zeros(3)
    dt = 1.0 / STEPS
    with torch.no_grad():
        for k in range(STEPS):
            velocity = module(chain[:, k], torch.full((3,), k * dt), features, state)
            std = module.noise_std(features, state, k * dt).expand(3, CHUNK, ACT)
            assert bool(((std >= NOISE_STD_MIN) & (std <= NOISE_STD_MAX)).all())
            step = torch.distributions.Normal(chain[:, k] + dt * velocity, std)
            expected += step.log_prob(chain[:, k + 1]).sum(dim=(-1, -2))
            expected_entropy += step.entropy().sum(dim=(-1, -2))
    torch.testing.assert_close(log_prob, expected, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(rescored, expected, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(entropy, expected_entropy, rtol=1e-4, atol=1e-3)
    # The chain is not a deterministic Euler integration: the injected noise moved it.
    assert not torch.allclose(actions, module.predict(features, state, num_steps=STEPS), atol=1e-3)


def test_the_grouped_kernel_samples_the_chains_the_module_samples() -> None:
    # Two tenants of one architecture, with different action dims (padded in the group).
    modules = [_flow(seed=3), _flow(seed=4, action_dim=ACT + 1)]
    features = _features(4, seed=5)
    states = [torch.randn(2, STATE), torch.randn(2, STATE)]
    noises = [torch.randn(2, *m.sample_noise_shape()) for m in modules]
    inputs = gather_inputs(features, [[0, 1], [2, 3]], states)
    padded = torch.stack([torch.nn.functional.pad(n, (0, ACT + 1 - n.shape[-1])) for n in noises])
    with torch.no_grad():
        actions, log_probs, chains = group_sample(modules, stack_parameters(modules), inputs, padded)
        own = unpad_actions(modules, inputs, actions)
        for g, module in enumerate(modules):
            rows = features.select([2 * g, 2 * g + 1])
            want_actions, want_log_prob, want_chain = module.sample_policy(rows, states[g], noises[g])
            torch.testing.assert_close(own[g], want_actions, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(log_probs[g], want_log_prob, rtol=1e-4, atol=1e-2)
            torch.testing.assert_close(chains[g, :, :, :, : module.config.action_dim], want_chain, rtol=1e-4, atol=1e-4)


def test_ppo_on_the_chain_density_changes_the_policy_and_raises_a_tiny_reward() -> None:
    """A contextual bandit: reward = -|action - target|^2 over the chunk; PPO (clipped surrogate on
    the chain's log-prob ratio) from the recorded chains raises the mean reward of fresh samples."""
    module = _flow(seed=6)
    features, state = _features(16, seed=7), torch.zeros(16, STATE)
    target = torch.tensor([0.6, -0.4])
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}

    def rollout(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        noise = torch.randn(16, *module.sample_noise_shape(), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            actions, log_prob, chain = module.sample_policy(features, state, noise)
        return -(actions - target).pow(2).sum(dim=(-1, -2)), log_prob, chain

    start = torch.stack([rollout(1000 + i)[0].mean() for i in range(3)]).mean()
    for iteration in range(40):
        reward, old_log_prob, chain = rollout(iteration)
        advantages = reward - reward.mean()
        for _ in range(2):
            new_log_prob, entropy = module.record_log_prob(features, state, chain)
            loss = ppo_loss(new_log_prob, old_log_prob, advantages, entropy=entropy, clip=0.2).total
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
    end = torch.stack([rollout(1000 + i)[0].mean() for i in range(3)]).mean()
    changed = [k for k, v in module.state_dict().items() if not torch.equal(v, before[k])]
    assert any(k.startswith("noise_net.") for k in changed) and any(k.startswith("velocity_out.") for k in changed)
    assert end > start + 0.4 * abs(float(start)), (float(start), float(end))  # measured: -12.0 -> -3.9


def test_a_deterministic_flow_head_has_no_chain_density_and_says_so() -> None:
    module = _flow(stochastic=False)
    with pytest.raises(RuntimeError, match="stochastic=False"):
        module.noise_std(_features(1, seed=0), torch.zeros(1, STATE), 0.0)
    with pytest.raises(RuntimeError, match="denoising chain"):
        _flow().action_distribution(_features(1, seed=0), torch.zeros(1, STATE))
    with pytest.raises(ValueError, match=r"chain: expected shape \(1, 6, 4, 2\)"):
        _flow().record_log_prob(_features(1, seed=0), torch.zeros(1, STATE), torch.zeros(1, 5, 4, 2))
