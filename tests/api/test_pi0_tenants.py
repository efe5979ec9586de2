"""A lab's LeRobot π0 / π0.5 policy through the service (issue 44), on a deployment whose resident
backbone is PaliGemma: LeRobot's own `PI0Policy` / `PI05Policy` saved with `save_pretrained` over
the deployment's base -> a JoyNexus tenant (its expert version 0, its processor's statistics the
tenant's normalizer: MEAN_STD for π0, QUANTILES for π0.5) -> predict equal to LeRobot's
`predict_action_chunk` with its own processor pipelines -> trained -> exported -> loaded by LeRobot's
`from_pretrained` -> equal actions again. LeRobot's classes run on openpi's patched transformers
(`openpi_transformers`) with small Gemma variants registered (`lerobot_variants`)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch

from joynexus.artifacts.base_model import extract_base_model
from joynexus.artifacts.lerobot_pi0 import build_lerobot_pi0_checkpoint, gemma_shape, lerobot_variants
from joynexus.artifacts.openpi_transformers import openpi_transformers
from joynexus.models.backbone import BackboneSource, PaliGemmaBackbone
from joynexus.models.placement import DevicePlacement
from tests.api.conftest import ADMIN_KEY, ApiWorld, TenantHandle, wire
from tests.api.test_smolvla_tenants import TASK, our_actions  # the same robot request (one task, pinned seeds)

CAMERAS = ("front", "wrist")  # the "arm" schema: 32 x 32 frames (LeRobot and we resize them to 28), state 4, action 3
EXPERT = (32, 2, 64, 8, 1, 8)  # width, depth, mlp_dim, heads, kv_heads, head_dim (the tiny PaliGemma's attention)
STATS = {
    "observation.state": {
        "mean": [0.1, -0.2, 0.3, 0.0],
        "std": [1.5, 0.5, 2.0, 1.0],
        "q01": [-2.0, -1.0, -3.0, -2.5],
        "q99": [2.0, 1.5, 3.0, 2.5],
    },
    "action": {"mean": [0.5, -1.0, 0.0], "std": [2.0, 0.25, 1.0], "q01": [-1.0, -2.0, -1.5], "q99": [1.0, 2.0, 1.5]},
}
BASE_MODEL = "joynexus/paligemma-tiny"
# Float32 through LeRobot's pipelines and ours in a different association order; measured max |diff| 2.5e-4
# on unnormalized actions of magnitude ~3 (π0.5, three Euler steps).
ATOL = RTOL = 5e-4
SMALL = dict(chunk_size=2, n_action_steps=2, num_inference_steps=3, max_state_dim=8, max_action_dim=4)


@pytest.fixture(scope="module")
def pi_api(tmp_path_factory) -> ApiWorld:
    """An in-process deployment over the tiny PaliGemma preset, behind the API."""
    from fastapi.testclient import TestClient

    from joynexus.api.app import ApiSettings, create_app
    from joynexus.connect import in_process
    from joynexus.settings import Settings

    data_dir = tmp_path_factory.mktemp("pi-api")
    cluster = in_process(Settings(data_dir=data_dir, backbone_preset="paligemma-tiny"))
    app = create_app(cluster, ApiSettings(stream_poll_s=0.05), admin_key=ADMIN_KEY)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield ApiWorld(app, client, cluster, data_dir)
    cluster.close()


@pytest.fixture(scope="module")
def base_backbone(pi_api, tmp_path_factory) -> PaliGemmaBackbone:
    spec = pi_spec(pi_api, "pi-base")
    made = pi_api.client.post("/v1/admin/tenants", json=spec, headers=pi_api.admin)
    assert made.status_code == 201, made.text
    caller = TenantHandle(spec["tenant"], made.json()["key"]["api_key"], spec)
    response = pi_api.client.get("/v1/base_model", headers=caller.headers)
    assert response.status_code == 200, response.text
    root = extract_base_model(response.content, tmp_path_factory.mktemp("pi-base") / "backbone")
    backbone = BackboneSource(path=str(root), preset=None).build(DevicePlacement(device="cpu"))
    assert isinstance(backbone, PaliGemmaBackbone)
    return backbone


def small_lerobot(kind: str, backbone: PaliGemmaBackbone) -> contextlib.AbstractContextManager:
    return lerobot_variants(kind, gemma_shape(backbone.model.config.text_config), EXPERT, backbone.model.config)


def checkpoint_over(kind: str, backbone: PaliGemmaBackbone, root: Path, seed: int = 0) -> Path:
    return build_lerobot_pi0_checkpoint(
        root, backbone, kind=kind, camera_keys=[f"observation.images.{c}" for c in CAMERAS], state_dim=4,
        action_dim=3, expert=EXPERT, stats=STATS, seed=seed, **SMALL,
    )  # fmt: skip


def pi_spec(world: ApiWorld, prefix: str) -> dict:
    spec = world.spec(prefix, "arm")
    spec["base_model"] = BASE_MODEL
    return spec


def pi_tenant(world: ApiWorld, kind: str, checkpoint: Path) -> tuple[TenantHandle, object]:
    spec = pi_spec(world, kind)
    spec["action_module"] = {"kind": kind, "checkpoint": str(checkpoint)}
    response = world.client.post("/v1/admin/tenants", json=spec, headers=world.admin)
    return TenantHandle(spec["tenant"], response.json().get("key", {}).get("api_key", ""), spec), response


def lerobot_actions(kind: str, root: Path, backbone, sample: dict, seeds: list[int]) -> np.ndarray:
    """LeRobot's own predict: the policy's `from_pretrained` and its saved processor pipelines, the
    same x0 per row."""
    from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action
    from lerobot.processor.pipeline import PolicyProcessorPipeline

    from joynexus.artifacts.lerobot_pi0 import _lerobot

    policy_class = _lerobot(kind)[2]
    with openpi_transformers(), small_lerobot(kind, backbone):
        policy = policy_class.from_pretrained(str(root)).eval()
        pre = PolicyProcessorPipeline.from_pretrained(str(root), config_filename="policy_preprocessor.json")
        post = PolicyProcessorPipeline.from_pretrained(
            str(root), config_filename="policy_postprocessor.json",
            to_transition=policy_action_to_transition, to_output=transition_to_policy_action,
        )  # fmt: skip
        n = len(sample["state"])
        obs = {f"observation.images.{c}": torch.from_numpy(sample["images"][:, i]) for i, c in enumerate(CAMERAS)}
        obs |= {"observation.state": torch.from_numpy(sample["state"]), "task": [TASK] * n}
        noise = torch.cat([torch.randn(1, 2, 4, generator=torch.Generator().manual_seed(s)) for s in seeds])
        return post(policy.predict_action_chunk(pre(obs), noise=noise)).numpy()


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_a_lerobot_checkpoint_becomes_a_tenant_served_as_lerobot_serves_it(kind, pi_api, base_backbone, tmp_path):
    checkpoint = checkpoint_over(kind, base_backbone, tmp_path / kind)
    tenant, response = pi_tenant(pi_api, kind, checkpoint)
    assert response.status_code == 201, response.text
    loaded = pi_api.client.post("/v1/weights/load", json={}, headers=tenant.headers)
    assert loaded.status_code == 200 and loaded.json()["version"] == 0, loaded.text
    # states inside the quantile range: LeRobot's π0.5 discretizes them into its prompt
    sample = tenant.batch(3, seed=11)
    sample["state"] = np.clip(sample["state"], -0.9, 0.9)
    seeds = [5, 6, 7]
    ours = our_actions(pi_api, tenant, sample, seeds)
    theirs = lerobot_actions(kind, checkpoint, base_backbone, sample, seeds)
    assert ours.shape == theirs.shape == (3, 2, 3)
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_a_trained_tenant_exports_what_lerobot_loads_with_equal_actions(kind, pi_api, base_backbone, tmp_path):
    from lerobot_policy_joynexus import write_lerobot_policy

    tenant, response = pi_tenant(pi_api, kind, checkpoint_over(kind, base_backbone, tmp_path / kind, seed=3))
    assert response.status_code == 201, response.text
    losses = []
    for step in range(2):
        r = pi_api.client.post("/v1/train_batch", json=wire(tenant.batch(4, seed=step)), headers=tenant.headers)
        assert r.status_code == 200, r.text
        losses.append(r.json()["loss"])
    assert all(np.isfinite(losses))
    version = pi_api.client.post("/v1/weights/load", json={}, headers=tenant.headers).json()["version"]
    assert version >= 1
    exported = pi_api.client.get(f"/v1/versions/{version}/export", headers=tenant.headers)
    assert exported.status_code == 200, exported.text
    with small_lerobot(kind, base_backbone):
        out = write_lerobot_policy(
            exported.content, tmp_path / "export", base_backbone,
            camera_keys=[f"observation.images.{c}" for c in CAMERAS],
        )  # fmt: skip
    assert (out / "joynexus_export.json").is_file()
    sample = tenant.batch(2, seed=21)
    sample["state"] = np.clip(sample["state"], -0.9, 0.9)
    ours = our_actions(pi_api, tenant, sample, [5, 5], version)
    np.testing.assert_allclose(ours, lerobot_actions(kind, out, base_backbone, sample, [5, 5]), atol=ATOL, rtol=RTOL)


def test_a_checkpoint_over_another_paligemma_is_refused_and_leaves_no_tenant(pi_api, tmp_path):
    other = PaliGemmaBackbone.build_tiny(seed=123)
    tenant, response = pi_tenant(pi_api, "pi0", checkpoint_over("pi0", other, tmp_path / "other"))
    assert response.status_code == 422, response.text
    assert "action_module" in response.text and "not this deployment's backbone" in response.text
    with pytest.raises(KeyError):
        pi_api.cluster.master.get_tenant(tenant.tenant_id)


def test_a_pi05_checkpoint_asked_for_as_pi0_is_refused_naming_the_kind(pi_api, base_backbone, tmp_path):
    _, response = pi_tenant(pi_api, "pi0", checkpoint_over("pi05", base_backbone, tmp_path / "pi05"))
    assert response.status_code == 422 and "action_module.kind" in response.text, response.text


def test_one_batch_of_pi0_pi05_and_another_family_equals_each_served_alone(pi_api, base_backbone, tmp_path):
    """Requests of a π0 and a π0.5 tenant (LeRobot checkpoints of one base) and an oft_mlp tenant in
    ONE Inference Model Service batch: the π0 / π0.5 rows share the PaliGemma prefix path, the oft rows
    the token forward, and each π request's actions equal LeRobot's."""
    from joynexus.scheduling.inference_queue import Observation

    kinds = ("pi0", "pi05")
    roots = [checkpoint_over(kind, base_backbone, tmp_path / kind, seed=10 + i) for i, kind in enumerate(kinds)]
    tenants = []
    for kind, root in zip(kinds, roots, strict=True):
        tenant, response = pi_tenant(pi_api, kind, root)
        assert response.status_code == 201, response.text
        tenants.append(tenant)
    spec = pi_spec(pi_api, "pi-oft")
    made = pi_api.client.post("/v1/admin/tenants", json=spec, headers=pi_api.admin)
    assert made.status_code == 201, made.text
    other = TenantHandle(spec["tenant"], made.json()["key"]["api_key"], spec)
    for t in (*tenants, other):
        assert pi_api.client.post("/v1/weights/load", json={}, headers=t.headers).status_code == 200
    sample = tenants[0].batch(1, seed=41)
    sample["state"] = np.clip(sample["state"], -0.9, 0.9)
    obs = [Observation(images=list(sample["images"][0]), state=sample["state"][0], instruction=TASK)]
    service = pi_api.cluster.inference
    for _ in range(5):  # the worker collects what is queued within its wait: usually all three
        futures = [service.submit(t.tenant_id, obs, seeds=[5]) for t in (*tenants, other)]
        results = [f.result(timeout=60) for f in futures]
        if {r["batch_samples"] for r in results} == {3}:
            break
    assert {r["batch_samples"] for r in results} == {3}, "the three requests never shared a batch"
    for kind, root, result in zip(kinds, roots, results[:2], strict=True):
        theirs = lerobot_actions(kind, root, base_backbone, sample, [5])
        np.testing.assert_allclose(result["actions"], theirs, atol=ATOL, rtol=RTOL)
    assert np.asarray(results[2]["actions"]).shape == (1, 2, 3)
