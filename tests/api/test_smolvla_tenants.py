"""A lab's LeRobot SmolVLA policy through the service (issue 39): LeRobot's own `SmolVLAPolicy`
saved with `save_pretrained` over the deployment's base model -> a JoyNexus tenant (its expert the
tenant's version 0, its processor's statistics the tenant's normalizer) -> predict equal to LeRobot's
`predict_action_chunk` -> trained -> exported -> loaded by LeRobot's `SmolVLAPolicy.from_pretrained`
with its own processor pipelines -> equal actions again. A checkpoint over another base is refused
naming the field, and no tenant is left behind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from joynexus.artifacts.base_model import extract_base_model
from joynexus.artifacts.lerobot_smolvla import build_lerobot_smolvla_checkpoint
from joynexus.models.backbone import BackboneSource, ResidentBackbone
from joynexus.models.placement import DevicePlacement
from joynexus.protocol.wire import Tensor
from tests.api.conftest import TenantHandle, free_port, wire

TASK = "pick up the cube"
CAMERAS = ("front", "wrist")  # the "arm" schema of tests/api/conftest.py: 32 x 32, state 4, action 3, chunk 2
STATS = {
    "observation.state": {"mean": [0.1, -0.2, 0.3, 0.0], "std": [1.5, 0.5, 2.0, 1.0]},
    "action": {"mean": [0.5, -1.0, 0.0], "std": [2.0, 0.25, 1.0]},
}
SMALL = dict(
    chunk_size=2,
    n_action_steps=2,
    num_steps=3,
    num_vlm_layers=2,
    max_state_dim=8,
    max_action_dim=4,
    tokenizer_max_length=16,
    resize_imgs_with_padding=(32, 32),
)
SEED = 5


@pytest.fixture(scope="module")
def base_backbone(api, tmp_path_factory) -> ResidentBackbone:
    caller = api.tenant("svla-base")
    response = api.client.get("/v1/base_model", headers=caller.headers)
    assert response.status_code == 200, response.text
    root = extract_base_model(response.content, tmp_path_factory.mktemp("base") / "backbone")
    return BackboneSource(path=str(root), preset=None).build(DevicePlacement(device="cpu"))


def checkpoint_over(backbone, root: Path, seed: int = 0) -> Path:
    camera_shapes = {f"observation.images.{c}": (3, 32, 32) for c in CAMERAS}
    return build_lerobot_smolvla_checkpoint(
        root, backbone, camera_shapes=camera_shapes, state_dim=4, action_dim=3, stats=STATS, seed=seed, **SMALL
    )


def smolvla_tenant(api, checkpoint: Path) -> tuple[TenantHandle, dict]:
    spec = api.spec("svla", "arm")
    spec["action_module"] = {"kind": "smolvla", "checkpoint": str(checkpoint)}
    response = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    return TenantHandle(spec["tenant"], response.json().get("key", {}).get("api_key", ""), spec), response


def lerobot_actions(root: Path, sample: dict, seeds: list[int], *, select_action: bool = False) -> np.ndarray:
    """LeRobot's own predict: SmolVLAPolicy + its saved processor pipelines, the same x0 per row
    (`select_action`: the chunk played one action per call, as a robot loop and LeRobot's
    `PolicyServer` call it)."""
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action
    from lerobot.processor.pipeline import PolicyProcessorPipeline

    policy = SmolVLAPolicy.from_pretrained(str(root)).eval()
    pre = PolicyProcessorPipeline.from_pretrained(str(root), config_filename="policy_preprocessor.json")
    post = PolicyProcessorPipeline.from_pretrained(
        str(root), config_filename="policy_postprocessor.json",
        to_transition=policy_action_to_transition, to_output=transition_to_policy_action,
    )  # fmt: skip
    n = len(sample["state"])
    observation = {f"observation.images.{c}": torch.from_numpy(sample["images"][:, i]) for i, c in enumerate(CAMERAS)}
    observation |= {"observation.state": torch.from_numpy(sample["state"]), "task": [TASK] * n}
    noise = torch.cat([torch.randn(1, 2, 4, generator=torch.Generator().manual_seed(s)) for s in seeds])
    if select_action:
        policy.reset()
        steps = [post(policy.select_action(pre(dict(observation)), noise=noise)).numpy() for _ in range(2)]
        return np.stack(steps, axis=1)
    return post(policy.predict_action_chunk(pre(observation), noise=noise)).numpy()


def our_actions(api, tenant: TenantHandle, sample: dict, seeds: list[int], version: int | None = None) -> np.ndarray:
    n = len(sample["state"])
    body = {
        "observations": {**wire({"images": sample["images"], "state": sample["state"]}), "instructions": [TASK] * n},
        "seeds": seeds,
    }
    if version is not None:
        body["policy_version"] = version
    response = api.client.post("/v1/predict", json=body, headers=tenant.headers)
    assert response.status_code == 200, response.text
    return Tensor.model_validate(response.json()["actions"]).to_numpy()


def test_a_lerobot_smolvla_checkpoint_becomes_a_tenant_served_as_lerobot_serves_it(api, base_backbone, tmp_path):
    checkpoint = checkpoint_over(base_backbone, tmp_path / "smolvla")
    tenant, response = smolvla_tenant(api, checkpoint)
    assert response.status_code == 201, response.text
    loaded = api.client.post("/v1/weights/load", json={}, headers=tenant.headers)
    assert loaded.status_code == 200 and loaded.json()["version"] == 0, loaded.text  # the checkpoint's expert
    sample = tenant.batch(3, seed=11)
    seeds = [SEED, SEED + 1, SEED + 2]
    ours = our_actions(api, tenant, sample, seeds)
    theirs = lerobot_actions(checkpoint, sample, seeds)
    assert ours.shape == theirs.shape == (3, 2, 3)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_a_trained_smolvla_tenant_exports_what_lerobot_loads_with_equal_actions(api, base_backbone, tmp_path):
    from lerobot_policy_joynexus import write_lerobot_policy

    tenant, response = smolvla_tenant(api, checkpoint_over(base_backbone, tmp_path / "smolvla", seed=3))
    assert response.status_code == 201, response.text
    losses = []
    for step in range(2):
        r = api.client.post("/v1/train_batch", json=wire(tenant.batch(4, seed=step)), headers=tenant.headers)
        assert r.status_code == 200, r.text
        losses.append(r.json()["loss"])
    assert all(np.isfinite(losses))
    version = api.client.post("/v1/weights/load", json={}, headers=tenant.headers).json()["version"]
    exported = api.client.get(f"/v1/versions/{version}/export", headers=tenant.headers)
    assert exported.status_code == 200, exported.text
    out = write_lerobot_policy(
        exported.content, tmp_path / "export", base_backbone, camera_keys=[f"observation.images.{c}" for c in CAMERAS]
    )
    assert (out / "joynexus_export.json").is_file()  # the manifest and digests, as for every export
    sample = tenant.batch(2, seed=21)
    seeds = [SEED, SEED]
    ours = our_actions(api, tenant, sample, seeds, version)
    np.testing.assert_allclose(ours, lerobot_actions(out, sample, seeds), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(ours, lerobot_actions(out, sample, seeds, select_action=True), atol=1e-4, rtol=1e-4)


def test_a_checkpoint_over_another_base_is_refused_naming_the_field(api, tmp_path):
    other = ResidentBackbone.build_tiny(seed=123)
    tenant, response = smolvla_tenant(api, checkpoint_over(other, tmp_path / "other"))
    assert response.status_code == 422, response.text
    assert "action_module" in response.text and "not this deployment's backbone" in response.text
    with pytest.raises(KeyError):  # no half-made tenant
        api.cluster.master.get_tenant(tenant.tenant_id)


def test_a_checkpoint_whose_dims_differ_from_the_spec_is_refused(api, base_backbone, tmp_path):
    camera_shapes = {f"observation.images.{c}": (3, 32, 32) for c in CAMERAS}
    root = build_lerobot_smolvla_checkpoint(
        tmp_path / "wide", base_backbone, camera_shapes=camera_shapes, state_dim=5, action_dim=3, **SMALL
    )
    _, response = smolvla_tenant(api, root)
    assert response.status_code == 422 and "observation.state_dim" in response.text, response.text


def test_the_openpi_endpoint_and_the_policy_stream_serve_a_smolvla_tenant(api, live_server, base_backbone, tmp_path):
    """A robot drives the SmolVLA tenant with the stock openpi client and with the /v1/stream protocol:
    the same actions as predict (and so as LeRobot's)."""
    openpi = pytest.importorskip("openpi_client.websocket_client_policy")
    from tests.api.test_openpi_serving import http_predict, openpi_obs, url
    from tests.api.test_streaming import obs_frame, recv, stream

    tenant, response = smolvla_tenant(api, checkpoint_over(base_backbone, tmp_path / "smolvla", seed=4))
    assert response.status_code == 201, response.text
    assert api.client.post("/v1/weights/load", json={}, headers=tenant.headers).status_code == 200
    policy = openpi.WebsocketClientPolicy(url(live_server), api_key=tenant.api_key)
    for seed in range(2):
        obs = openpi_obs(tenant, seed)
        actions = policy.infer(obs)["actions"]
        assert actions.shape == (2, 3)
        np.testing.assert_allclose(actions, http_predict(api, tenant, obs), rtol=1e-5, atol=1e-5)
    with stream(live_server, tenant.api_key) as ws:
        assert recv(ws)["type"] == "ready"
        ws.send(obs_frame(0, tenant.batch(1, seed=3)))
        answer = recv(ws)
        assert answer["type"] == "actions", answer
        assert Tensor.model_validate(answer["actions"]).to_numpy().shape == (1, 2, 3)


def test_lerobots_async_policy_server_serves_the_export_unchanged(api, base_backbone, tmp_path, monkeypatch):
    """LeRobot's async-inference `PolicyServer` loads the export from the instructions a
    `RobotClient` sends (policy type smolvla, the directory) with its own code, and answers a raw
    robot observation with our predict's actions (the same noise: its policy draws x0 from torch's
    global generator, seeded as our predict seeds its own)."""
    import pickle

    monkeypatch.chdir(tmp_path)  # lerobot's policy-server module opens its log under ./logs when imported
    from lerobot.async_inference.configs import PolicyServerConfig
    from lerobot.async_inference.helpers import RemotePolicyConfig, TimedObservation
    from lerobot.async_inference.policy_server import PolicyServer
    from lerobot.datasets.utils import hw_to_dataset_features
    from lerobot_policy_joynexus import write_lerobot_policy

    tenant, response = smolvla_tenant(api, checkpoint_over(base_backbone, tmp_path / "smolvla", seed=6))
    assert response.status_code == 201, response.text
    version = api.client.post("/v1/weights/load", json={}, headers=tenant.headers).json()["version"]
    exported = api.client.get(f"/v1/versions/{version}/export", headers=tenant.headers)
    out = write_lerobot_policy(
        exported.content, tmp_path / "export", base_backbone, camera_keys=[f"observation.images.{c}" for c in CAMERAS]
    )
    joints = [f"joint{i}.pos" for i in range(4)]
    features = hw_to_dataset_features(
        {**{j: float for j in joints}, **{c: (32, 32, 3) for c in CAMERAS}}, "observation", use_video=False
    )
    server = PolicyServer(PolicyServerConfig(host="127.0.0.1", port=free_port()))  # never bound: called directly

    class Peer:  # the gRPC context: the server only asks who is calling
        @staticmethod
        def peer() -> str:
            return "ipv4:127.0.0.1:1"

    setup = RemotePolicyConfig("smolvla", str(out), features, actions_per_chunk=2, device="cpu")
    server.SendPolicyInstructions(type("Request", (), {"data": pickle.dumps(setup)})(), Peer())

    sample = tenant.batch(1, seed=31)
    images = (sample["images"][0] * 255).round().astype(np.uint8)  # what a camera sends
    raw = {j: float(v) for j, v in zip(joints, sample["state"][0], strict=True)}
    raw |= {c: images[i].transpose(1, 2, 0) for i, c in enumerate(CAMERAS)} | {"task": TASK}
    torch.manual_seed(SEED)
    served = server._predict_action_chunk(TimedObservation(timestamp=0.0, timestep=0, observation=raw))
    theirs = torch.stack([a.get_action() for a in served]).numpy()
    ours = our_actions(api, tenant, {"images": images[None] / 255.0, "state": sample["state"]}, [SEED], version)[0]
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=1e-4)


def test_one_batch_of_two_smolvla_checkpoints_and_another_family_equals_each_served_alone(api, base_backbone, tmp_path):
    """Requests of two SmolVLA tenants (different LeRobot checkpoints of one base) and an oft_mlp
    tenant in ONE Inference Model Service batch: the SmolVLA rows share one prefix forward, the
    oft rows the token forward, and each SmolVLA request's actions equal LeRobot's."""
    from joynexus.scheduling.inference_queue import Observation

    roots = [checkpoint_over(base_backbone, tmp_path / f"smolvla{i}", seed=10 + i) for i in range(2)]
    tenants = []
    for root in roots:
        tenant, response = smolvla_tenant(api, root)
        assert response.status_code == 201, response.text
        tenants.append(tenant)
    other = api.tenant("svla-oft", "arm")
    for t in (*tenants, other):
        assert api.client.post("/v1/weights/load", json={}, headers=t.headers).status_code == 200
    sample = tenants[0].batch(1, seed=41)
    obs = [Observation(images=list(sample["images"][0]), state=sample["state"][0], instruction=TASK)]
    service = api.cluster.inference
    for _ in range(5):  # the service's worker collects what is queued within its wait: usually all three
        futures = [service.submit(t.tenant_id, obs, seeds=[SEED]) for t in (*tenants, other)]
        results = [f.result(timeout=60) for f in futures]
        if {r["batch_samples"] for r in results} == {3}:
            break
    assert {r["batch_samples"] for r in results} == {3}, "the three requests never shared a batch"
    for root, result in zip(roots, results, strict=False):
        np.testing.assert_allclose(result["actions"], lerobot_actions(root, sample, [SEED]), atol=1e-4, rtol=1e-4)
    assert np.asarray(results[2]["actions"]).shape == (1, 2, 3)
