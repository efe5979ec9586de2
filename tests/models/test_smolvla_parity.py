"""The ``smolvla`` kind against LeRobot's own SmolVLA (lerobot 0.4.4) as the oracle.

A SmolVLA policy is built by LeRobot's ``SmolVLAConfig`` / ``SmolVLAPolicy`` at small dimensions
over a small local SmolVLM directory (the resident backbone saved), saved with LeRobot's
``save_pretrained`` and its processor pipelines, and read back as a JoyNexus module. For the same
weights, inputs and noise, predict (over ONE prefix forward shared with another SmolVLA checkpoint),
the training loss and the expert's gradients equal LeRobot's, within float32 tolerance
(``ATOL``/``RTOL``: LeRobot and we run the same float32 ops, in a different association order).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from joynexus.artifacts.lerobot_smolvla import build_lerobot_smolvla_checkpoint, lerobot_normalizer
from joynexus.models.action_modules import ActionModuleConfig, build_action_module
from joynexus.models.action_modules.smolvla import SmolVLAActionModule, SmolVLARows
from joynexus.models.action_modules.smolvla_checkpoint import LeRobotCheckpointError, read_lerobot_smolvla
from joynexus.models.backbone import ResidentBackbone

ATOL, RTOL = 1e-5, 1e-4
CAMERAS = {"observation.images.top": (3, 32, 32), "observation.images.wrist": (3, 24, 32)}
STATE_DIM, ACTION_DIM = 3, 2
STATS = {
    "observation.state": {"mean": [0.1, -0.2, 0.3], "std": [1.5, 0.5, 2.0]},
    "action": {"mean": [0.5, -1.0], "std": [2.0, 0.25]},
}
SMALL = dict(
    chunk_size=4,
    n_action_steps=4,
    num_steps=3,
    max_state_dim=6,
    max_action_dim=5,
    num_vlm_layers=2,
    tokenizer_max_length=16,
    resize_imgs_with_padding=(32, 32),
)


def smolvla_module(checkpoint, backbone: ResidentBackbone) -> SmolVLAActionModule:
    geometry = backbone.prefix_geometry
    config = ActionModuleConfig(
        kind="smolvla",
        feature_dim=backbone.hidden_size,
        state_dim=checkpoint.state_dim,
        action_dim=checkpoint.action_dim,
        vlm_num_heads=geometry.num_heads,
        vlm_num_kv_heads=geometry.num_kv_heads,
        vlm_head_dim=geometry.head_dim,
        base_digest=checkpoint.vlm_digest(),
        **checkpoint.module_config_fields(),
    )
    module = build_action_module(config)
    module.load_state_dict(checkpoint.module_state, strict=True)
    return module.eval()


@pytest.fixture(scope="module")
def backbone() -> ResidentBackbone:
    return ResidentBackbone.build_tiny()


@pytest.fixture(scope="module")
def checkpoints(backbone, tmp_path_factory):
    """Two SmolVLA checkpoints of the same base (different experts), as LeRobot writes them."""
    out = []
    for seed in (0, 1):
        root = tmp_path_factory.mktemp(f"smolvla{seed}")
        build_lerobot_smolvla_checkpoint(
            root, backbone, camera_shapes=CAMERAS, state_dim=STATE_DIM, action_dim=ACTION_DIM, stats=STATS,
            seed=seed, **SMALL,
        )
        out.append(root)
    return out


def lerobot_policy(root):
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.processor.pipeline import PolicyProcessorPipeline

    policy = SmolVLAPolicy.from_pretrained(str(root)).eval()
    pre = PolicyProcessorPipeline.from_pretrained(str(root), config_filename="policy_preprocessor.json")
    post = PolicyProcessorPipeline.from_pretrained(
        str(root), config_filename="policy_postprocessor.json",
        to_transition=__import__("lerobot.processor.converters", fromlist=["x"]).policy_action_to_transition,
        to_output=__import__("lerobot.processor.converters", fromlist=["x"]).transition_to_policy_action,
    )
    return policy, pre, post


def observations(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {
        "observation.images.top": torch.rand(n, *CAMERAS["observation.images.top"], generator=g),
        "observation.images.wrist": torch.rand(n, *CAMERAS["observation.images.wrist"], generator=g),
        "observation.state": torch.randn(n, STATE_DIM, generator=g),
        "task": ["pick up the red cube", "open the top drawer and look inside"][:n],
    }


def rows_of(module, obs, normalizer) -> SmolVLARows:
    n = obs["observation.state"].shape[0]
    images = [[obs["observation.images.top"][i], obs["observation.images.wrist"][i]] for i in range(n)]
    state = torch.as_tensor(normalizer.normalize_state(obs["observation.state"].numpy()))
    return SmolVLARows(module=module, images=images, instructions=list(obs["task"]), state=state)


def test_a_lerobot_checkpoint_reads_as_the_tenant_module_and_its_normalizer(backbone, checkpoints):
    checkpoint = read_lerobot_smolvla(checkpoints[0])
    assert checkpoint.camera_keys == list(CAMERAS)
    assert (checkpoint.state_dim, checkpoint.action_dim) == (STATE_DIM, ACTION_DIM)
    # The VLM part is the resident backbone's prefix, bit for bit.
    assert checkpoint.vlm_digest() == backbone.prefix_digest(2)
    module = smolvla_module(checkpoint, backbone)
    assert module.config.action_chunk == 4 and module.config.expert_hidden_size == 48
    normalizer = lerobot_normalizer(checkpoint)
    assert normalizer.stats["action"]["std"] == pytest.approx([2.0, 0.25])
    assert normalizer.modes["STATE"] == "MEAN_STD"


def test_predict_in_one_grouped_prefix_equals_lerobots_predict_action_chunk(backbone, checkpoints):
    modules, oracles = [], []
    for root in checkpoints:
        checkpoint = read_lerobot_smolvla(root)
        modules.append((smolvla_module(checkpoint, backbone), lerobot_normalizer(checkpoint)))
        oracles.append(lerobot_policy(root))
    obs = [observations(2, seed=3), observations(1, seed=4)]
    noise = [torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(9)), torch.randn(1, 4, 5)]
    # ONE prefix forward for both tenants' rows (different experts, state tokens and instructions).
    prefixes = SmolVLAActionModule.layer_prefixes(
        backbone, [rows_of(m, o, norm) for (m, norm), o in zip(modules, obs, strict=True)]
    )
    for (module, normalizer), (policy, pre, post), o, prefix, x0 in zip(
        modules, oracles, obs, prefixes, noise, strict=True
    ):
        state = torch.as_tensor(normalizer.normalize_state(o["observation.state"].numpy()))
        ours = normalizer.unnormalize_action(module.predict(prefix, state, noise=x0).numpy())
        batch = pre({**{k: v.clone() if torch.is_tensor(v) else v for k, v in o.items()}})
        theirs = post(policy.predict_action_chunk(batch, noise=x0.clone())).numpy()
        np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=RTOL)
        assert np.abs(theirs).max() > 1e-2  # not trivially zero


def test_the_training_loss_and_expert_gradients_equal_lerobots_forward(backbone, checkpoints):
    root = checkpoints[0]
    checkpoint = read_lerobot_smolvla(root)
    module, normalizer = smolvla_module(checkpoint, backbone), lerobot_normalizer(checkpoint)
    policy, pre, _ = lerobot_policy(root)
    obs = observations(2, seed=5)
    actions = torch.randn(2, 4, ACTION_DIM, generator=torch.Generator().manual_seed(6))
    noise = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(7))
    time = torch.tensor([0.3, 0.85])

    policy.train()
    batch = pre({**obs, "action": actions.clone()})
    theirs, _ = policy.forward(batch, noise=noise.clone(), time=time.clone())
    theirs.backward()

    module.train()
    prefix = SmolVLAActionModule.layer_prefixes(backbone, [rows_of(module, obs, normalizer)], grad=True)[0]
    state = torch.as_tensor(normalizer.normalize_state(obs["observation.state"].numpy()))
    target = torch.as_tensor(normalizer.normalize_action(actions.numpy()))
    ours = module.loss(prefix, state, target, noise=noise, time=time)
    ours.backward()
    assert math.isclose(float(ours), float(theirs), rel_tol=RTOL, abs_tol=ATOL)

    lerobot_params = dict(policy.named_parameters())
    compared = 0
    for name, param in module.named_parameters():
        theirs_name = (
            "model.vlm_with_expert." + name if name.startswith("lm_expert.") else "model." + name
        )
        reference = lerobot_params[theirs_name].grad
        if reference is None:
            assert param.grad is None or not param.grad.any(), name
            continue
        torch.testing.assert_close(param.grad, reference, atol=ATOL, rtol=1e-3, msg=name)
        compared += 1
    # The state token's projection learns through the frozen prefix, as in LeRobot.
    assert module.state_proj.weight.grad is not None and module.state_proj.weight.grad.abs().sum() > 0
    assert compared >= 20
    assert all(p.grad is None for p in backbone.model.parameters())


def test_a_checkpoint_over_another_base_has_another_digest(backbone, tmp_path):
    other = ResidentBackbone.build_tiny(seed=1)
    root = build_lerobot_smolvla_checkpoint(
        tmp_path / "other", other, camera_shapes=CAMERAS, state_dim=STATE_DIM, action_dim=ACTION_DIM, **SMALL
    )
    assert read_lerobot_smolvla(root).vlm_digest() != backbone.prefix_digest(2)
    with pytest.raises(LeRobotCheckpointError, match="type='act'"):
        (tmp_path / "act").mkdir()
        (tmp_path / "act" / "config.json").write_text('{"type": "act"}')
        (tmp_path / "act" / "model.safetensors").write_bytes(b"")
        read_lerobot_smolvla(tmp_path / "act")
