"""State-only tenants (`observation.cameras: []`): the backbone encodes the instruction alone, the
action module gets those features and the robot state; SFT from a camera-less LeRobot dataset,
predict in process and over the API without `images`, and RL in ManiSkill / gym-pusht state obs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from joynexus.master.deployment import Deployment
from joynexus.master.workloads.manager import WorkloadManager
from joynexus.scheduling.inference_queue import Observation
from joynexus.settings import Settings
from joynexus.spec import SpecError, parse_workload_spec
from tests.helpers import TINY_MODEL_ID, sft_spec, write_dataset_for


@pytest.fixture
def dep(tmp_path):
    deployment = Deployment.in_process(Settings(data_dir=tmp_path / "data", torch_threads=1))
    yield deployment
    deployment.shutdown()


def test_encode_takes_samples_without_cameras_alone_and_mixed():
    from joynexus.models.backbone import ResidentBackbone

    backbone = ResidentBackbone.build_tiny()
    text_only = backbone.encode([[], []], ["push the cube", "open the drawer"])
    assert text_only.tokens.shape[0] == 2 and torch.isfinite(text_only.pooled).all()
    mixed = backbone.encode([[torch.rand(3, 40, 40)], []], ["look", "open the drawer"])
    # A camera-less sample gets the same features whether or not it shares a forward with images.
    torch.testing.assert_close(
        mixed.select([1]).trimmed().tokens, text_only.select([1]).trimmed().tokens, atol=1e-4, rtol=1e-4
    )
    with pytest.raises(ValueError, match="expected 0..3"):
        backbone.encode([[torch.rand(3, 8, 8)] * 4], ["too many"])


@pytest.mark.parametrize("family", ["idefics3", "qwen_vl"])
def test_image_free_batches_reuse_each_instructions_features_equal_to_the_forward(family, monkeypatch):
    from joynexus.models.backbone import BackboneSource, ResidentBackbone

    backbone = ResidentBackbone.build_tiny() if family == "idefics3" else BackboneSource(preset="qwen3-vl-tiny").build()
    forwards = []
    encode_features = type(backbone)._encode_features

    def counted(self, images, instructions, adapters=None, *, grad=False):
        forwards.append(len(instructions))
        return encode_features(self, images, instructions, adapters, grad=grad)

    expected = backbone._encode_features([[]] * 3, ["push the cube"] * 3)  # the forward, uncached
    monkeypatch.setattr(type(backbone), "_encode_features", counted)
    first = backbone.encode([[]] * 3, ["push the cube"] * 3)
    again = backbone.encode([[]] * 5, ["push the cube"] * 5)
    assert forwards == [1]  # one single-sample forward, then none
    torch.testing.assert_close(first.tokens, expected.tokens, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(first.pooled, expected.pooled, atol=1e-5, rtol=1e-5)
    assert torch.equal(first.mask, expected.mask) and again.tokens.shape[0] == 5
    assert torch.equal(again.tokens[4], first.tokens[0]) and not again.tokens.requires_grad
    again.tokens.add_(1.0)  # the caller's own copy: the kept features are untouched
    assert torch.equal(backbone.encode([[]], ["push the cube"]).tokens[0], first.tokens[0])
    # Grouped tenants of other instructions: each computed once, rows padded like the forward's.
    texts = ["open the drawer", "push the cube", "put the small red block on the top shelf", "open the drawer"]
    grouped = backbone.encode([[]] * 4, texts)
    assert forwards == [1, 1, 1]  # the two new instructions, one forward each
    reference = encode_features(backbone, [[]] * 4, texts)
    assert torch.equal(grouped.mask, reference.mask)
    torch.testing.assert_close(grouped.tokens, reference.tokens, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grouped.pooled, reference.pooled, atol=1e-5, rtol=1e-5)
    # not from the kept features: a camera, a training forward
    backbone.encode([[torch.rand(3, 40, 40)]], ["push the cube"])
    backbone.encode([[]], ["push the cube"], grad=True)
    assert forwards == [1, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="expected 0..3"):  # checked on the cached path too
        backbone.encode([[torch.rand(3, 8, 8)] * 4], ["too many"])


def test_schema_signature_includes_the_empty_camera_list(tmp_path):
    with_camera = parse_workload_spec(sft_spec("cam", tmp_path / "a"))
    state_only = parse_workload_spec(sft_spec("nocam", tmp_path / "b", cameras=()))
    assert state_only.vla_schema().canonical_form()["cameras"] == []
    assert state_only.vla_schema().signature != with_camera.vla_schema().signature


def test_a_state_only_tenant_trains_sft_to_completion_and_predicts(dep, tmp_path):
    spec = sft_spec("blind", tmp_path / "blind", cameras=(), jobs=2)
    write_dataset_for(spec)
    camera_spec = sft_spec("seeing", tmp_path / "seeing", jobs=2)
    write_dataset_for(camera_spec, seed=1)
    tenant = dep.creator.create(spec)
    assert tenant.backend_config.cameras == ()
    dep.creator.create(camera_spec)
    manager = WorkloadManager(dep).start()
    try:
        runs = [manager.submit("blind", jobs=2), manager.submit("seeing", jobs=2)]
        final = manager.wait_all([r.workload_id for r in runs], timeout_s=300)
    finally:
        manager.stop()
    assert [s.state for s in final] == ["completed", "completed"], [s.error for s in final]
    assert final[0].version == 2
    state = np.linspace(-1, 1, 4).astype(np.float32)
    result = dep.inference_service.predict("blind", [Observation(images=(), state=state, instruction="push")])
    actions = np.asarray(result["actions"])
    assert actions.shape == (1, 2, 3) and np.isfinite(actions).all()
    # Camera and camera-less requests may share one backbone forward: both answered.
    image = np.random.default_rng(0).random((3, 32, 32), dtype=np.float32)
    other = dep.inference_service.predict("seeing", [Observation(images=(image,), state=state)])
    assert np.asarray(other["actions"]).shape == (1, 2, 3)


def test_state_only_rl_in_pusht_runs_a_workload(dep):
    spec = {
        "tenant": "pushblind",
        "base_model": TINY_MODEL_ID,
        "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {"cameras": [], "state_dim": 5, "action_dim": 2, "instruction": "push the T"},
        "environment": {"simulator": "pusht", "task": "PushT-v0", "num_envs": 2, "horizon": 4},
        "rl": {"ppo_epochs": 1},
        "scheduling": {"max_in_flight_jobs": 1, "completion_target": 1},
        "training": {"samples_per_job": 8, "microbatch_size": 4},
    }
    dep.creator.create(spec)
    manager = WorkloadManager(dep).start()
    try:
        run = manager.submit("pushblind", jobs=1)
        (final,) = manager.wait_all([run.workload_id], timeout_s=300)
    finally:
        manager.stop()
    assert final.state == "completed", final.error
    assert final.version == 1
    # RL tenants standardize their state by the rollouts' running statistics (rl.normalize_state,
    # on by default): the job's 8 samples moved them, and the version's checkpoint carries them.
    _, module_state, _ = dep.checkpoints.load_tenant("pushblind")
    assert float(module_state["state_count"]) == 8
    assert module_state["state_mean"].abs().sum() > 0 and module_state["state_var"].shape == (5,)


# Slow (21 s): ManiSkill through the services stays in the default run in
# tests/services/test_environment_service.py and tests/envs/test_adapters.py.
@pytest.mark.slow
def test_state_only_rl_in_maniskill_pushcube(dep):
    from joynexus.envs import build_simulator

    try:
        with build_simulator({"simulator": "maniskill", "task": "PushCube-v1"}) as sim:
            state_dim, action_dim, cameras = sim.spec.state_dim, sim.spec.action_dim, sim.spec.cameras
    except Exception as error:  # no Vulkan device or ManiSkill here
        pytest.skip(f"ManiSkill PushCube-v1 unavailable: {error}")
    assert cameras == ()
    spec = {
        "tenant": "cubeblind",
        "base_model": TINY_MODEL_ID,
        "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {"cameras": [], "state_dim": state_dim, "action_dim": action_dim, "instruction": "push"},
        "environment": {"simulator": "maniskill", "task": "PushCube-v1", "num_envs": 1, "horizon": 4},
        "rl": {"ppo_epochs": 1},
        "scheduling": {"max_in_flight_jobs": 1, "completion_target": 1},
        "training": {"samples_per_job": 4, "microbatch_size": 4},
    }
    dep.creator.create(spec)
    manager = WorkloadManager(dep).start()
    try:
        run = manager.submit("cubeblind", jobs=1)
        (final,) = manager.wait_all([run.workload_id], timeout_s=300)
    finally:
        manager.stop()
    assert final.state == "completed", final.error


def test_a_simulator_rendering_cameras_refuses_a_state_only_tenant_naming_the_field(dep):
    spec = {
        "tenant": "mismatch",
        "base_model": TINY_MODEL_ID,
        "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {"cameras": [], "state_dim": 5, "action_dim": 2},
        "environment": {"simulator": "pusht", "task": "PushT-v0"},
    }
    spec["observation"]["cameras"] = ["top"]  # renders the camera but the state is then 2-d
    with pytest.raises(SpecError) as info:
        dep.creator.create(spec)
    assert "observation.state_dim" in info.value.fields
