"""Exports leave JoyNexus (issue 24.3): a trained tenant's version, exported with the base model
the API serves (GET /v1/base_model), loads with LeRobot's own code through the
`lerobot_policy_joynexus` plugin (register_third_party_plugins, PreTrainedPolicy.from_pretrained,
make_policy, make_pre_post_processors) and its actions on LeRobot's observation dict equal our
predict within 1e-4; LeRobot's env path (gym-pusht: rollout in-process, `lerobot-eval`) runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("lerobot_policy_joynexus", reason="the LeRobot plugin is installed by scripts/bootstrap")

from lerobot.configs.policies import PreTrainedConfig  # noqa: E402
from lerobot.policies.factory import get_policy_class, make_policy, make_pre_post_processors  # noqa: E402
from lerobot.utils.import_utils import register_third_party_plugins  # noqa: E402

from joynexus.artifacts.base_model import extract_base_model  # noqa: E402
from joynexus.protocol.wire import Tensor  # noqa: E402
from tests.api.conftest import wire  # noqa: E402
from tests.helpers import sft_spec, write_dataset_for  # noqa: E402

SEED = 7  # the flow expert's noise: JoyNexus predict seeds=[SEED] * N, the export's noise_seed=SEED
TASK = "pick up the cube"


@pytest.fixture(scope="module")
def base_model_dir(api, tmp_path_factory) -> Path:
    """The deployment's base model, downloaded as a tenant would."""
    caller = api.tenant("lr-base")
    response = api.client.get("/v1/base_model", headers=caller.headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-tar"
    return extract_base_model(response.content, tmp_path_factory.mktemp("base") / "backbone")


def _train_and_export(api, tenant) -> tuple[int, bytes]:
    for step in range(2):
        r = api.client.post("/v1/train_batch", json=wire(tenant.batch(4, seed=step)), headers=tenant.headers)
        assert r.status_code == 200, r.text
    version = api.client.post("/v1/weights/load", json={}, headers=tenant.headers).json()["version"]
    exported = api.client.get(f"/v1/versions/{version}/export", headers=tenant.headers)
    assert exported.status_code == 200, exported.text
    return version, exported.content


def _lerobot_policy(out: Path) -> tuple[Any, Any, Any]:
    """What LeRobot's own scripts do with --policy.path=out (plugins discovered by name)."""
    register_third_party_plugins()
    config = PreTrainedConfig.from_pretrained(out)
    assert config.type == "joynexus"
    config.pretrained_path = out
    policy = get_policy_class(config.type).from_pretrained(out, config=config)
    pre, post = make_pre_post_processors(config, pretrained_path=str(out))
    return policy, pre, post


LORA = {"kind": "lora", "rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


def _tenant(api, case: str) -> Any:
    from tests.api.conftest import TenantHandle

    if case != "lora":
        return api.tenant("lr", case)
    spec = {**api.spec("lr-lora", "arm"), "adapter": LORA}
    r = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert r.status_code == 201, r.text
    return TenantHandle(spec["tenant"], r.json()["key"]["api_key"], spec)


# oft_mlp on two cameras; flow_matching on one; oft_mlp with a LoRA adapter on the backbone
@pytest.mark.parametrize("shape", ["arm", "flow", "lora"])
def test_lerobot_loads_an_export_and_matches_our_predict(api, base_model_dir, tmp_path, shape):
    from lerobot_policy_joynexus import write_lerobot_policy

    tenant = _tenant(api, shape)
    version, payload = _train_and_export(api, tenant)
    cameras = tenant.spec["observation"]["cameras"]
    out = write_lerobot_policy(
        payload,
        tmp_path / "export",
        base_model_dir,
        camera_keys=[f"observation.images.{c}" for c in cameras],
        default_task=TASK,
        noise_seed=SEED,
    )
    sample = tenant.batch(3, seed=11)
    n = len(sample["state"])
    body = {
        "observations": {**wire({"images": sample["images"], "state": sample["state"]}), "instructions": [TASK] * n},
        "seeds": [SEED] * n,
        "policy_version": version,
    }
    r = api.client.post("/v1/predict", json=body, headers=tenant.headers)
    assert r.status_code == 200, r.text
    ours = Tensor.model_validate(r.json()["actions"]).to_numpy()

    if shape == "lora":  # stock peft finds the base model the adapter names: the export's backbone/
        peft_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
        assert Path(peft_config["base_model_name_or_path"]) == (out / "backbone").resolve()
    policy, pre, post = _lerobot_policy(out)
    assert policy.config.policy_version == version and policy.config.tenant_id == tenant.tenant_id
    height, width = tenant.spec["observation"]["image_size"]  # issue 41.12: the tenant's, not the backbone's tile
    assert {tuple(policy.config.input_features[f"observation.images.{c}"].shape) for c in cameras} == {
        (3, height, width)
    }
    observation = {f"observation.images.{c}": torch.from_numpy(sample["images"][:, i]) for i, c in enumerate(cameras)}
    observation |= {"observation.state": torch.from_numpy(sample["state"]), "task": [TASK] * n}
    chunk = post(policy.predict_action_chunk(pre(observation))).cpu().numpy()  # un-normalized: dataset units
    difference = float(np.abs(chunk - ours).max())
    print(f"{shape}: max |LeRobot - JoyNexus predict| = {difference:.3e}")
    assert chunk.shape == ours.shape and difference <= 1e-4
    policy.reset()
    for step in range(ours.shape[1]):  # select_action plays the chunk, one action per call
        action = post(policy.select_action(pre(observation)))
        np.testing.assert_allclose(action.numpy(), ours[:, step], atol=1e-4)


@pytest.fixture(scope="module")
def pusht_export(api, base_model_dir, tmp_path_factory) -> Path:
    """A tenant shaped like gym-pusht (one camera, 2-D state and action), trained and exported."""
    from lerobot_policy_joynexus import write_lerobot_policy

    from tests.api.conftest import TenantHandle

    root = tmp_path_factory.mktemp("pusht")
    spec = sft_spec("lr-pusht", root / "data", cameras=("top",), image_size=(48, 48), state_dim=2, action_dim=2,
                    action_chunk=4)  # fmt: skip
    write_dataset_for(spec, episodes=2, length=8)
    r = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert r.status_code == 201, r.text
    tenant = TenantHandle(spec["tenant"], r.json()["key"]["api_key"], spec)
    _, payload = _train_and_export(api, tenant)
    return write_lerobot_policy(payload, root / "export", base_model_dir, camera_keys=["observation.image"])


def test_lerobot_env_path_runs_an_export_in_pusht(pusht_export):
    """LeRobot's rollout loop (env observation -> preprocess_observation -> task -> processors ->
    select_action -> env.step) with make_policy on gym-pusht, in-process and short."""
    from lerobot.envs.configs import PushtEnv
    from lerobot.envs.factory import make_env, make_env_pre_post_processors
    from lerobot.scripts.lerobot_eval import rollout

    register_third_party_plugins()
    env_cfg = PushtEnv(episode_length=6, observation_height=48, observation_width=48)
    config = PreTrainedConfig.from_pretrained(pusht_export)
    config.pretrained_path = pusht_export
    policy = make_policy(config, env_cfg=env_cfg)
    pre, post = make_pre_post_processors(config, pretrained_path=str(pusht_export))
    env_pre, env_post = make_env_pre_post_processors(env_cfg=env_cfg, policy_cfg=config)
    envs = make_env(env_cfg, n_envs=1)
    env = next(iter(next(iter(envs.values())).values()))
    try:
        result = rollout(env, policy, env_pre, env_post, pre, post, seeds=[0])
    finally:
        env.close()
    assert result["action"].shape == (1, 6, 2) and torch.isfinite(result["action"]).all()
    assert result["done"][0, -1]


@pytest.mark.slow  # a fresh interpreter importing LeRobot + gym-pusht: ~1 min on two shared cores
def test_lerobot_eval_cli_runs_an_export_in_pusht(pusht_export, tmp_path):
    out = tmp_path / "eval"
    command = [
        str(Path(sys.executable).with_name("lerobot-eval")),
        f"--policy.path={pusht_export}",
        "--policy.device=cpu",
        "--env.type=pusht",
        "--env.episode_length=8",
        "--env.observation_height=48",
        "--env.observation_width=48",
        "--eval.n_episodes=1",
        "--eval.batch_size=1",
        f"--output_dir={out}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "MUJOCO_GL": "egl"})
    assert done.returncode == 0, done.stderr[-4000:]
    info = json.loads((out / "eval_info.json").read_text())
    assert info["overall"]["n_episodes"] == 1
