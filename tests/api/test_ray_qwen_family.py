"""The Qwen3-VL backbone family on the real deployment: `joynexus serve`'s default Ray mode with
``JOYNEXUS_BACKBONE_PRESET=qwen3-vl-tiny`` (the settings' ``backbone_preset``) builds the `qwen_vl`
family inside the service actors; a LoRA tenant trains (SFT) and predicts over HTTP. Slow: a Ray
deployment of its own (the in-process path is in tests/models/test_qwen_vl_backbone.py)."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.api.conftest import ADMIN_KEY, sample_batch, wire
from tests.helpers import sft_spec, write_dataset_for

ray = pytest.importorskip("ray")
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.mark.slow
def test_a_lora_tenant_trains_and_predicts_on_the_qwen_family_on_ray(tmp_path):
    from fastapi.testclient import TestClient

    from joynexus.api.app import ApiSettings, create_app
    from joynexus.connect import connect
    from joynexus.ops.supervisor import remove_service_actors
    from joynexus.settings import Settings

    started_ray = not ray.is_initialized()
    namespace = f"test-qwen-ray-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        data_dir=tmp_path / "data", ray_namespace=namespace, torch_threads=1, backbone_preset="qwen3-vl-tiny"
    )
    cluster = None
    try:
        cluster = connect(settings, mode="ray")
        app = create_app(cluster, ApiSettings(stream_poll_s=0.05), admin_key=ADMIN_KEY)
        with TestClient(app, raise_server_exceptions=False) as client:
            spec = sft_spec("ray-qwen", tmp_path / "dataset", jobs=1, base_model="joynexus/qwen3-vl-tiny")
            spec["adapter"] = {"kind": "lora", "rank": 4, "target_modules": ["q_proj", "v_proj"]}
            write_dataset_for(spec, episodes=2, length=12)
            created = client.post("/v1/admin/tenants", json=spec, headers=ADMIN)
            assert created.status_code == 201, created.text
            headers = {"Authorization": f"Bearer {created.json()['key']['api_key']}"}
            submitted = client.post("/v1/workloads", json={"jobs": 1}, headers=headers)
            assert submitted.status_code == 202, submitted.text
            url = f"/v1/workloads/{submitted.json()['workload_id']}"
            deadline = time.monotonic() + 300
            while (info := client.get(url, headers=headers).json())["state"] not in ("completed", "failed"):
                assert time.monotonic() < deadline, info
                time.sleep(0.2)
            assert info["state"] == "completed", info
            batch = sample_batch(spec, 2, seed=3)
            body = {"observations": wire({"images": batch["images"], "state": batch["state"]})}
            predicted = client.post("/v1/predict", json=body, headers=headers)
            assert predicted.status_code == 200, predicted.text
            assert predicted.json()["policy_version"] == 1
            training = ray.get_actor("joynexus.training_service", namespace=namespace)
            info = ray.get(training.backbone_info.remote(), timeout=60)
            assert info["model_id"] == "joynexus/qwen3-vl-tiny" and info["instances_created"] == 1, info
    finally:
        if cluster is not None:
            cluster.close()
        if ray.is_initialized():
            remove_service_actors(namespace)
            if started_ray:
                ray.shutdown()
