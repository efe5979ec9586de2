"""A SmolVLA tenant learns by RL through the flow-RL path (issue 39.2): its rollouts sample
LeRobot's Euler steps with learned Gaussian noise injected (the chain recorded by the Inference
Model Service), GRPO advantages, and PPO rescoring the chain in the Training Model Service over the
prefix cache. On the first, on-policy job the learner's log-probabilities are the ones the policy
acted with."""

from __future__ import annotations

import numpy as np
import torch

from joynexus.models.action_modules import ActionModuleConfig, build_action_module
from joynexus.models.action_modules.smolvla import SmolVLAActionModule, SmolVLARows
from joynexus.models.backbone import ResidentBackbone
from joynexus.scheduling.training_scheduler import COMPLETED
from joynexus.services.training.trainer import SlotTrainer
from tests.services.test_rl_loop import dep, parts, rl_spec  # noqa: F401  (dep: the fixture)


def test_the_chain_density_of_a_sample_is_the_one_rescored_and_reaches_the_state_token():
    backbone = ResidentBackbone.build_tiny()
    geometry = backbone.prefix_geometry
    module = build_action_module(
        ActionModuleConfig(
            kind="smolvla", feature_dim=64, state_dim=2, action_dim=2, action_chunk=3, stochastic=True,
            num_steps=4, num_vlm_layers=2, max_state_dim=4, max_action_dim=3, vlm_num_heads=geometry.num_heads,
            vlm_num_kv_heads=geometry.num_kv_heads, vlm_head_dim=geometry.head_dim, resize_imgs_with_padding=(32, 32),
        )  # fmt: skip
    )
    rows = SmolVLARows(module, [[torch.rand(3, 32, 32)], []], ["push the block", "push"], torch.randn(2, 2))
    with torch.no_grad():
        prefix = SmolVLAActionModule.layer_prefixes(backbone, [rows])[0]
        noise = torch.randn(2, *module.sample_noise_shape(), generator=torch.Generator().manual_seed(0))
        actions, density, chain = module.sample_policy(prefix, rows.state, noise)
    assert actions.shape == (2, 3, 2) and chain.shape == (2, 5, 3, 3)
    torch.testing.assert_close(chain[:, -1, :, :2], actions)
    prefix = SmolVLAActionModule.layer_prefixes(backbone, [rows], grad=True)[0]
    rescored, entropy = module.record_log_prob(prefix, rows.state, chain)
    torch.testing.assert_close(rescored, density, atol=1e-4, rtol=1e-5)
    rescored.sum().backward()
    assert module.log_std.grad is not None and module.state_proj.weight.grad.abs().sum() > 0
    assert entropy.shape == (2,)


def test_an_rl_smolvla_tenant_trains_on_its_own_rollouts_in_pusht(dep, monkeypatch):  # noqa: F811
    proximal: list[np.ndarray] = []
    compute = SlotTrainer._proximal_log_probs

    def recording(self, queue, slot, job, fields, cache):
        out = compute(self, queue, slot, job, fields, cache)
        proximal.append(out.cpu().numpy())
        return out

    monkeypatch.setattr(SlotTrainer, "_proximal_log_probs", recording)
    spec = rl_spec("smolvla-rl", staleness=1, advantage="grpo", jobs=1)
    spec["action_module"] = {"kind": "smolvla"}
    spec["rl"].update(off_policy_correction="decoupled", group_size=2)
    dep.creator.create(spec)
    _, producer, stage, actor = parts(dep, "smolvla-rl")
    try:
        job = producer.produce_once()
        stage.step()
        meta = dep.queue.get_meta(job.partition_id, ["log_prob", "chain"], 12, "test-read")
        data = dep.queue.get_data(meta)
        behavior = np.asarray(data["log_prob"], dtype=np.float32)
        assert np.asarray(data["chain"]).shape[1:] == (11, 1, 32)  # K + 1 steps of (chunk, max_action_dim)
        assert actor.step().state == COMPLETED
    finally:
        producer.close()
    np.testing.assert_allclose(proximal[0], behavior, atol=1e-3)
    assert dep.training_service.policy_version("smolvla-rl") == 1
