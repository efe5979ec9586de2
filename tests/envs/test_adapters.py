"""Simulator adapters, in this process, on the real simulators (gym-pusht, ManiSkill3 on the CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pydantic
import pytest

from joynexus.envs import (
    AssetDownloadRefused,
    EnvObservation,
    SimulatorAdapter,
    SimulatorConfig,
    StepResult,
    available_simulators,
    build_simulator,
    register_simulator,
)


def check_observation(obs: EnvObservation, spec, cameras: tuple[str, ...]) -> None:
    assert isinstance(obs, EnvObservation)
    assert obs.instruction == spec.instruction and obs.instruction
    assert obs.state.dtype == np.float32 and obs.state.shape == (spec.state_dim,)
    assert np.isfinite(obs.state).all()
    assert sorted(obs.images) == sorted(cameras)
    h, w = spec.image_size
    for image in obs.images.values():
        assert image.dtype == np.float32 and image.shape == (3, h, w)
        assert 0.0 <= image.min() and image.max() <= 1.0
        assert image.max() > image.min()  # something was rendered


def check_step(result: StepResult, spec, cameras: tuple[str, ...]) -> None:
    check_observation(result.observation, spec, cameras)
    assert isinstance(result.reward, float) and np.isfinite(result.reward)
    for flag in (result.terminated, result.truncated, result.success):
        assert isinstance(flag, bool)
    json.dumps(result.info)  # JSON-able scalars only
    assert all(isinstance(v, bool | int | float | str) for v in result.info.values())


# --------------------------------------------------------------------------------------------- #
# registry and config
# --------------------------------------------------------------------------------------------- #
def test_registry_lists_the_builtin_simulators():
    assert {"maniskill", "pusht"} <= set(available_simulators())


def test_unknown_simulator_names_the_field_the_value_and_the_allowed_names():
    with pytest.raises(ValueError) as err:
        SimulatorConfig(simulator="isaac", task="x")
    text = str(err.value)
    assert "simulator" in text and "'isaac'" in text and "maniskill" in text and "pusht" in text
    with pytest.raises(ValueError, match="simulator='isaac'"):
        build_simulator({"simulator": "isaac", "task": "x"})


def test_config_is_frozen_strict_and_has_small_image_defaults():
    config = SimulatorConfig(simulator="pusht", task="PushT-v0")
    assert config.image_size == (64, 64) and config.cameras == () and config.seed == 0
    with pytest.raises(pydantic.ValidationError):
        SimulatorConfig(simulator="pusht", task="PushT-v0", render_everything=True)
    with pytest.raises(pydantic.ValidationError):
        config.seed = 3
    with pytest.raises(pydantic.ValidationError, match="reward_mode"):
        SimulatorConfig(simulator="pusht", task="PushT-v0", reward_mode="shaped")
    with pytest.raises(pydantic.ValidationError, match="twice"):
        SimulatorConfig(simulator="pusht", task="PushT-v0", cameras=["top", "top"])


def test_register_simulator_rejects_non_adapters_and_name_clashes():
    with pytest.raises(TypeError):
        register_simulator("bogus")(object)

    class Other(SimulatorAdapter):  # never built
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_simulator("pusht")(Other)


# --------------------------------------------------------------------------------------------- #
# gym-pusht
# --------------------------------------------------------------------------------------------- #
def test_pusht_state_only():
    with build_simulator({"simulator": "pusht", "task": "PushT-v0", "seed": 3}) as sim:
        spec = sim.spec
        assert (spec.state_dim, spec.action_dim, spec.cameras) == (5, 2, ())
        assert spec.instruction == "push the T-shaped block onto the target"
        assert spec.action_low == (0.0, 0.0) and spec.action_high == (512.0, 512.0)
        first = sim.reset()
        check_observation(first, spec, ())
        for _ in range(3):
            check_step(sim.step(np.array([256.0, 256.0])), spec, ())
        # the first unseeded reset uses the config's seed; an explicit seed reproduces it
        again = sim.reset(seed=3)
        np.testing.assert_array_equal(first.state, again.state)


def test_pusht_with_camera_non_square_images_and_horizon():
    config = {"simulator": "pusht", "task": "PushT-v0", "cameras": ["top"], "image_size": [48, 80]}
    with build_simulator({**config, "max_episode_steps": 3, "reward_mode": "sparse"}) as sim:
        assert sim.spec.state_dim == 2 and sim.spec.image_size == (48, 80)
        check_observation(sim.reset(), sim.spec, ("top",))
        results = [sim.step(np.array([100.0, 400.0], dtype=np.float32)) for _ in range(3)]
        for r in results:
            check_step(r, sim.spec, ("top",))
            assert r.reward in (0.0, 1.0)  # sparse
        assert [r.truncated for r in results] == [False, False, True]
        assert results[-1].info["elapsed_steps"] == 3


def test_pusht_rejects_bad_settings_and_actions():
    with pytest.raises(ValueError, match="cameras"):
        build_simulator({"simulator": "pusht", "task": "PushT-v0", "cameras": ["wrist"]})
    with pytest.raises(ValueError, match="task"):
        build_simulator({"simulator": "pusht", "task": "PushX-v0"})
    with build_simulator({"simulator": "pusht", "task": "PushT-v0"}) as sim:
        with pytest.raises(RuntimeError, match="reset"):
            sim.step(np.zeros(2))
        sim.reset()
        with pytest.raises(ValueError, match=r"action: .*\(2,\).*got shape \(3,\)"):
            sim.step(np.zeros(3))
        with pytest.raises(ValueError, match="action: .*non-finite"):
            sim.step(np.array([1.0, np.inf]))
        sim.step(np.array([1e6, -5.0]))  # out of bounds: clipped, not an error


# --------------------------------------------------------------------------------------------- #
# ManiSkill3 (CPU physics, lavapipe rendering)
# --------------------------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "task, instruction",
    [("PushCube-v1", "push the cube to the goal region"), ("PickCube-v1", "pick up the red cube")],
)
def test_maniskill_state_and_one_camera(task, instruction):
    config = {"simulator": "maniskill", "task": task, "cameras": ["base_camera"], "seed": 1}
    with build_simulator(config) as sim:
        spec = sim.spec
        assert spec.instruction.startswith(instruction)
        assert spec.image_size == (64, 64) and spec.cameras == ("base_camera",)
        assert spec.action_dim == 8 and spec.max_episode_steps == 50  # pd_joint_delta_pos, task horizon
        assert spec.reward_mode == "normalized_dense"
        check_observation(sim.reset(), spec, ("base_camera",))
        rng = np.random.default_rng(0)
        for _ in range(3):
            result = sim.step(rng.uniform(-1, 1, spec.action_dim))
            check_step(result, spec, ("base_camera",))
            assert "success" in result.info


def test_maniskill_state_only_control_and_reward_modes():
    config = {"simulator": "maniskill", "task": "PushCube-v1", "control_mode": "pd_ee_delta_pose"}
    with build_simulator({**config, "reward_mode": "sparse", "max_episode_steps": 2}) as sim:
        spec = sim.spec
        assert spec.cameras == () and spec.action_dim == 7 and spec.control_mode == "pd_ee_delta_pose"
        assert spec.state_dim > 25  # state-only sessions get privileged object poses too
        first = sim.reset()
        check_observation(first, spec, ())
        results = [sim.step(np.zeros(7)) for _ in range(2)]
        for r in results:
            check_step(r, spec, ())
            assert r.reward in (0.0, 1.0)
        assert results[-1].truncated
        np.testing.assert_allclose(sim.reset(seed=0).state, first.state)  # config seed 0 reproduces
    with pytest.raises(ValueError, match="control_mode='fly'"):
        build_simulator({**config, "control_mode": "fly"})
    with pytest.raises(ValueError, match="not a ManiSkill task"):
        build_simulator({"simulator": "maniskill", "task": "FlyToMoon-v1"})


def test_maniskill_asset_check_uses_maniskill_registry():
    from mani_skill.utils import assets

    from joynexus.envs.maniskill import missing_assets

    assert missing_assets("PushCube-v1") == [] and missing_assets("StackCube-v1") == []
    if assets.is_data_source_downloaded("ycb"):
        pytest.skip("YCB assets are installed on this machine")
    assert missing_assets("PickSingleYCB-v1") == ["ycb"]


def test_maniskill_download_prompt_raises_instead_of_reading_stdin():
    """Belt and braces: even a build that skipped the pre-check cannot reach ManiSkill's (y|n) prompt."""
    from mani_skill.utils import assets
    from mani_skill.utils.registration import REGISTERED_ENVS

    from joynexus.envs.maniskill import no_asset_prompts

    if assets.is_data_source_downloaded("ycb"):
        pytest.skip("YCB assets are installed on this machine")
    with pytest.raises(AssetDownloadRefused, match="PickSingleYCB-v1"), no_asset_prompts("PickSingleYCB-v1"):
        REGISTERED_ENVS["PickSingleYCB-v1"].make(num_envs=1, sim_backend="physx_cpu")


@pytest.mark.timeout(120)
def test_tasks_needing_assets_are_refused_without_prompting():
    """In a fresh process whose stdin is an open pipe nobody writes to: a (y|n) prompt would block
    until the timeout, so finishing at all proves there was none."""
    script = textwrap.dedent(
        """
        from joynexus.envs import AssetDownloadRefused, build_simulator
        for task in ["PickSingleYCB-v1", "ReplicaCAD_SceneManipulation-v1"]:
            try:
                build_simulator({"simulator": "maniskill", "task": task})
            except AssetDownloadRefused as exc:
                print("REFUSED", exc)
            else:
                print("BUILT", task)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"building an asset-needing task blocked (a download prompt?): {out.decode()[-2000:]}")
    text = out.decode()
    assert proc.returncode == 0, text
    assert "(y|n)" not in text and "BUILT" not in text, text
    refusals = [line for line in text.splitlines() if line.startswith("REFUSED")]
    assert len(refusals) == 2, text
    assert "PickSingleYCB-v1" in refusals[0] and "needs an asset download" in refusals[0] and "ycb" in refusals[0]
    assert "ReplicaCAD_SceneManipulation-v1" in refusals[1] and "needs an asset download" in refusals[1]
