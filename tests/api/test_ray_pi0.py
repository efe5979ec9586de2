"""π0 / π0.5 on the real deployment (issue 44): a Ray deployment whose resident backbone is the tiny
PaliGemma; a LeRobot π0 checkpoint and a π0.5 tenant from its seed become tenants in the resident
Master, are fine-tuned by the Training Model Service actor over the shared prefix, served by the
Inference Model Service actor and evaluated (π0.5, GRPO-style RL tenants are in
`tests/services`) in PushT-reach by the Environment Service actor. Slow: a second Ray deployment."""

from __future__ import annotations

import uuid

import pytest

from joynexus.ops.supervisor import remove_service_actors
from tests.api.conftest import ADMIN_KEY, sample_batch, wire
from tests.api.test_ray_services import RayApi, rl_spec
from tests.helpers import sft_spec, write_dataset_for

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow
BASE_MODEL = "joynexus/paligemma-tiny"


@pytest.fixture(scope="module")
def pi_ray_api(tmp_path_factory) -> RayApi:
    from fastapi.testclient import TestClient

    from joynexus.api.app import ApiSettings, create_app
    from joynexus.connect import connect
    from joynexus.settings import Settings

    started_ray = not ray.is_initialized()
    namespace = f"test-pi0-ray-{uuid.uuid4().hex[:8]}"
    data_dir = tmp_path_factory.mktemp("pi0-ray")
    settings = Settings(data_dir=data_dir, ray_namespace=namespace, torch_threads=1, backbone_preset="paligemma-tiny")
    cluster = None
    try:
        cluster = connect(settings, mode="ray")
        app = create_app(cluster, ApiSettings(stream_poll_s=0.05), admin_key=ADMIN_KEY)
        with TestClient(app, raise_server_exceptions=False) as client:
            yield RayApi(namespace, data_dir, cluster, None, client, None)
    finally:
        if cluster is not None:
            cluster.close()
        if ray.is_initialized():
            remove_service_actors(namespace)
            if started_ray:
                ray.shutdown()


def test_pi0_and_pi05_tenants_train_serve_and_are_evaluated_on_ray(pi_ray_api: RayApi):
    from joynexus.artifacts.lerobot_pi0 import build_lerobot_pi0_checkpoint
    from joynexus.models.backbone import PaliGemmaBackbone

    api = pi_ray_api
    backbone = PaliGemmaBackbone.build_tiny()  # the deployment's preset, same seed: the same weights
    checkpoint = build_lerobot_pi0_checkpoint(
        api.data_dir / "lerobot-pi0", backbone, kind="pi0", camera_keys=["observation.images.top"], state_dim=4,
        action_dim=2, expert=(32, 2, 64, 8, 1, 8), chunk_size=1, n_action_steps=1, num_inference_steps=2,
        max_state_dim=8, max_action_dim=4,
    )  # fmt: skip
    tenants = []
    for kind, module in (
        ("pi0", {"kind": "pi0", "checkpoint": str(checkpoint)}),
        ("pi05", {"kind": "pi05"}),
    ):  # π0.5 from its seed: the gemma_300m width
        spec = sft_spec(
            f"ray-{kind}", api.data_dir / "datasets" / kind, cameras=("top",), action_dim=2, action_chunk=1, jobs=1,
            samples_per_job=8,
        )  # fmt: skip
        spec["base_model"] = BASE_MODEL
        write_dataset_for(spec, episodes=2, length=8)
        spec["action_module"] = module
        spec["environment"] = {**rl_spec("unused")["environment"]}
        tenants.append(api.create_tenant(spec))
    workloads = [api.submit(t, jobs=1) for t in tenants]  # both train at once on the one Training actor
    for tenant, workload_id in zip(tenants, workloads, strict=True):
        workload = api.wait(tenant, workload_id, timeout_s=600)
        assert workload["state"] == "completed" and workload["version"] == 1, workload
    evaluation = api.wait(tenants[0], api.submit(tenants[0], task="eval", episodes=1), timeout_s=600)
    assert evaluation["state"] == "completed" and evaluation["result"]["policy_version"] == 1, evaluation
    for tenant in tenants:
        batch = sample_batch(tenant.spec, 2, seed=4)
        body = {"observations": wire({"images": batch["images"], "state": batch["state"]})}
        response = api.client.post("/v1/predict", json=body, headers=tenant.headers)
        assert response.status_code == 200, response.text
        assert response.json()["policy_version"] == 1
