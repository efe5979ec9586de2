"""A user's own Hugging Face checkpoint directory as the resident backbone (`JOYNEXUS_BACKBONE_PATH`,
nothing of JoyNexus in it): a tenant is created on its model id, trains SFT and is served through the
tenant API, on the API's default deployment (the Ray services, `connect(mode="ray")`) and in process."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from joynexus.settings import Settings
from tests.api.conftest import ADMIN_KEY, sample_batch, wire
from tests.helpers import sft_spec, write_dataset_for
from tests.hf_checkpoint import HF_MODEL_ID, write_plain_hf_checkpoint

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _sft_then_predict(cluster: Any, data_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from joynexus.api.app import ApiSettings, create_app

    info = cluster.training.backbone_info()
    assert info["model_id"] == HF_MODEL_ID  # the checkpoint's own id: tenants name it as base_model
    spec = sft_spec("hf-dir-sft", data_dir / "datasets" / "hf", base_model=HF_MODEL_ID, jobs=1, samples_per_job=16)
    spec["observation"]["instruction"] = "pick up the red cube"
    write_dataset_for(spec, episodes=2, length=12)
    app = create_app(cluster, ApiSettings(stream_poll_s=0.05), admin_key=ADMIN_KEY)
    with TestClient(app, raise_server_exceptions=False) as client:
        created = client.post("/v1/admin/tenants", json=spec, headers=ADMIN)
        assert created.status_code == 201, created.text
        headers = {"Authorization": f"Bearer {created.json()['key']['api_key']}"}
        submitted = client.post("/v1/workloads", json={"jobs": 1}, headers=headers)
        assert submitted.status_code == 202, submitted.text
        workload_id = submitted.json()["workload_id"]
        deadline = time.monotonic() + 120
        while (status := client.get(f"/v1/workloads/{workload_id}", headers=headers).json())["state"] not in (
            "completed",
            "failed",
            "cancelled",
        ):
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        assert status["state"] == "completed", status
        assert status["version"] == 1
        batch = sample_batch(spec, 2, seed=5)
        body = {"observations": wire({"images": batch["images"], "state": batch["state"]})}
        predicted = client.post("/v1/predict", json=body, headers=headers)
        assert predicted.status_code == 200, predicted.text
        result = predicted.json()
        assert result["policy_version"] == 1
        assert result["actions"]["shape"] == [2, 2, 3]  # (batch, chunk, action_dim)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_plain_hf_checkpoint(tmp_path_factory.mktemp("hf-backbone") / "smolvlm-tiny")


def test_sft_and_predict_in_process_on_a_plain_hf_directory(checkpoint: Path, tmp_path: Path) -> None:
    from joynexus.connect import in_process

    cluster = in_process(Settings(data_dir=tmp_path, backbone_path=str(checkpoint)))
    try:
        _sft_then_predict(cluster, tmp_path)
    finally:
        cluster.close()


@pytest.mark.slow  # a deployment of its own (the backbone is per deployment): Ray actors start and load it
def test_sft_and_predict_on_the_ray_services_on_a_plain_hf_directory(checkpoint: Path, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    from joynexus.connect import connect
    from joynexus.ops.supervisor import remove_service_actors

    started_ray = not ray.is_initialized()
    namespace = f"test-hf-dir-{uuid.uuid4().hex[:8]}"
    settings = Settings(data_dir=tmp_path, backbone_path=str(checkpoint), ray_namespace=namespace, torch_threads=1)
    cluster = None
    try:
        cluster = connect(settings, mode="ray")  # the backbone is loaded inside the service actors
        _sft_then_predict(cluster, tmp_path)
    finally:
        if cluster is not None:
            cluster.close()
        if ray.is_initialized():
            remove_service_actors(namespace)
            if started_ray:
                ray.shutdown()
