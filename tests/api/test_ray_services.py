"""The tenant API on the Ray serving path that `joynexus serve` uses by default (`connect(mode="ray")`):
the workloads run in the ONE resident Master Service actor `joynexus.master`, predictions are
answered by the resident Inference Model Service actor, metering is written by the services
themselves, and two API servers over the same deployment share one Master without leasing jobs.

Everything lives in a namespace of its own, so named actors of other tests in the same Ray never
collide; the module kills its actors at the end (and stops Ray if it started it).
"""

from __future__ import annotations

import gc
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from joynexus.ops.supervisor import SERVICE_ACTORS, remove_service_actors
from tests.api.conftest import ADMIN_KEY, sample_batch, wire
from tests.helpers import TINY_MODEL_ID, sft_spec, write_dataset_for

ray = pytest.importorskip("ray")

FINAL = ("completed", "failed", "cancelled")
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def rl_spec(tenant: str) -> dict[str, Any]:
    """PPO on gym-pusht PushT-reach (recipes/main_job.py reach_rl_spec), as small as it gets."""
    return {
        "tenant": tenant,
        "base_model": TINY_MODEL_ID,
        "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {
            "cameras": ["top"],
            "image_size": [32, 32],
            "state_dim": 4,
            "action_dim": 2,
            "action_chunk": 1,
            "instruction": "move the pusher to the T-shaped block",
        },
        "environment": {
            "simulator": "pusht",
            "task": "PushT-reach-v0",
            "num_envs": 2,
            "horizon": 4,
            "max_episode_steps": 6,
        },
        "rl": {"advantage": "gae", "ppo_epochs": 1, "gamma": 0.95},
        "scheduling": {"max_in_flight_jobs": 1, "completion_target": 1, "max_policy_staleness": 1},
        "training": {"samples_per_job": 8, "microbatch_size": 8, "learning_rate": 5e-5},
    }


@dataclass
class Tenant:
    tenant_id: str
    api_key: str
    spec: dict[str, Any]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


@dataclass
class RayApi:
    namespace: str
    data_dir: Path
    cluster: Any  # server 1's joynexus.connect.Cluster
    cluster2: Any  # server 2's, over the same deployment
    client: Any  # TestClient of server 1
    client2: Any  # TestClient of server 2

    def actor(self, name: str) -> Any:
        return ray.get_actor(name, namespace=self.namespace)

    def master_ping(self) -> dict[str, Any]:
        return ray.get(self.actor("joynexus.master").ping.remote(), timeout=60)

    def create_tenant(self, spec: dict[str, Any], client: Any = None) -> Tenant:
        response = (client or self.client).post("/v1/admin/tenants", json=spec, headers=ADMIN)
        assert response.status_code == 201, response.text
        return Tenant(spec["tenant"], response.json()["key"]["api_key"], spec)

    def submit(self, tenant: Tenant, client: Any = None, **body: Any) -> str:
        response = (client or self.client).post("/v1/workloads", json=body, headers=tenant.headers)
        assert response.status_code == 202, response.text
        return response.json()["workload_id"]

    def wait(self, tenant: Tenant, workload_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            response = self.client.get(f"/v1/workloads/{workload_id}", headers=tenant.headers)
            assert response.status_code == 200, response.text
            info = response.json()
            if info["state"] in FINAL or time.monotonic() > deadline:
                return info
            time.sleep(0.2)

    def usage(self, tenant: Tenant) -> dict[str, Any]:
        response = self.client.get("/v1/usage", headers=tenant.headers)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture(scope="module")
def ray_api(tmp_path_factory) -> RayApi:
    from fastapi.testclient import TestClient

    from joynexus.api.app import ApiSettings, create_app
    from joynexus.connect import connect
    from joynexus.settings import Settings

    started_ray = not ray.is_initialized()  # other modules init and shut down their own Ray
    namespace = f"test-api-ray-{uuid.uuid4().hex[:8]}"
    data_dir = tmp_path_factory.mktemp("api-ray")
    settings = Settings(data_dir=data_dir, ray_namespace=namespace, torch_threads=1)
    api_settings = ApiSettings(stream_poll_s=0.05)
    cluster = cluster2 = None
    try:
        cluster = connect(settings, mode="ray")  # starts a local Ray here if none runs
        cluster2 = connect(settings, mode="ray")  # a second API server over the same deployment
        app = create_app(cluster, api_settings, admin_key=ADMIN_KEY)
        app2 = create_app(cluster2, api_settings, admin_key=ADMIN_KEY)
        with (
            TestClient(app, raise_server_exceptions=False) as client,
            TestClient(app2, raise_server_exceptions=False) as client2,
        ):
            yield RayApi(namespace, data_dir, cluster, cluster2, client, client2)
    finally:
        for each in (cluster, cluster2):
            if each is not None:
                each.close()
        if ray.is_initialized():
            remove_service_actors(namespace)
            if started_ray:
                ray.shutdown()


@dataclass
class Trained:
    sft: Tenant
    rl: Tenant
    sft_workload: dict[str, Any]
    rl_workload: dict[str, Any]
    evaluation: dict[str, Any]
    predicted: dict[str, Any]
    inference_before: dict[str, Any]
    inference_after: dict[str, Any]


@pytest.fixture(scope="module")
def trained(ray_api: RayApi) -> Trained:
    """An SFT and an RL tenant, trained side by side through HTTP; an evaluation; a prediction."""
    spec = sft_spec("ray-sft", ray_api.data_dir / "datasets" / "ray-sft", jobs=1, samples_per_job=16)
    write_dataset_for(spec, episodes=2, length=12)
    sft = ray_api.create_tenant(spec)
    rl = ray_api.create_tenant(rl_spec("ray-rl"))

    sft_id = ray_api.submit(sft, jobs=1)
    rl_id = ray_api.submit(rl, jobs=1)
    sft_workload = ray_api.wait(sft, sft_id)
    rl_workload = ray_api.wait(rl, rl_id)
    evaluation = ray_api.wait(rl, ray_api.submit(rl, task="eval", episodes=1))

    inference = ray_api.actor("joynexus.inference_service")
    before = ray.get(inference.stats.remote(), timeout=60)
    batch = sample_batch(sft.spec, 2, seed=3)
    body = {"observations": wire({"images": batch["images"], "state": batch["state"]})}
    response = ray_api.client.post("/v1/predict", json=body, headers=sft.headers)
    assert response.status_code == 200, response.text
    after = ray.get(inference.stats.remote(), timeout=60)
    return Trained(sft, rl, sft_workload, rl_workload, evaluation, response.json(), before, after)


def test_the_api_runs_on_ray_in_its_own_namespace(ray_api: RayApi):
    from joynexus.actors import handle_of

    for name in SERVICE_ACTORS:
        assert ray_api.actor(name) is not None  # named actors live in the settings' namespace
    named = ray.util.list_named_actors(all_namespaces=True)
    masters = [a for a in named if a["name"] == "joynexus.master" and a["namespace"] == ray_api.namespace]
    assert len(masters) == 1
    for cluster in (ray_api.cluster, ray_api.cluster2):
        assert cluster.mode == "ray"
        for service in (cluster.master, cluster.training, cluster.inference):
            assert handle_of(service).is_remote


def test_sft_and_rl_workloads_ran_in_the_one_resident_master(ray_api: RayApi, trained: Trained):
    from joynexus.core.store import ControlPlaneStore
    from joynexus.master.workloads.manager import WorkloadManager
    from joynexus.scheduling.training_scheduler import TrainingScheduler

    assert trained.sft_workload["state"] == "completed", trained.sft_workload
    assert trained.rl_workload["state"] == "completed", trained.rl_workload
    assert trained.sft_workload["version"] == trained.rl_workload["version"] == 1
    assert trained.evaluation["state"] == "completed", trained.evaluation
    assert trained.evaluation["task"] == "eval" and trained.evaluation["result"]["episodes"] == 1
    assert trained.evaluation["result"]["policy_version"] == 1

    ping = ray_api.master_ping()
    assert ping["running_workloads"] == 0 and ping["tenants"] >= 2 and not ping["unhealthy_tenants"]
    # Both servers reach the same incarnation of the Master: the actor, not a copy in this process.
    assert ray_api.cluster.master.ping()["incarnation"] == ray_api.cluster2.master.ping()["incarnation"]
    assert ray_api.cluster.master.ping()["incarnation"] == ping["incarnation"]
    # Every training job was leased and completed by that Master's actor loop.
    store = ControlPlaneStore(ray_api.cluster.settings.resolved_database_url())
    try:
        scheduler = TrainingScheduler(store)
        for tenant in (trained.sft, trained.rl):
            jobs = scheduler.jobs(tenant_id=tenant.tenant_id)
            assert [job.state for job in jobs] == ["completed"]
            assert {job.lease_owner for job in jobs} == {f"master-{ping['incarnation']}/actor"}
    finally:
        store.dispose()
    # The RL workload's and the evaluation's simulator workers wait warm in the Environment Service
    # actor for that tenant's next sessions (their sessions are closed).
    beat = ray_api.cluster.environment.heartbeat()
    assert beat["sessions"] == 0 and beat["warm_workers"] >= 1, beat
    # The server process holds no WorkloadManager of this deployment (nor an actor loop).
    local = [
        o for o in gc.get_objects() if type(o) is WorkloadManager and o.deployment.settings.data_dir == ray_api.data_dir
    ]
    assert local == []


def test_the_master_is_a_control_plane_after_tenants_sft_rl_and_an_evaluation(ray_api: RayApi, trained: Trained):
    """Issue 40's behaviour guard (placed right after the fixture's work, before the tests of other
    paths): two tenant creations, an SFT workload, an RL workload and an evaluation ran through the
    Ray deployment, and the Master's process has imported neither the model stack (torch,
    transformers, lerobot) nor a simulator (mani_skill, gymnasium), nor the modules that build
    observations, batches or weight payloads: a tensor unpickled there would have imported torch.
    The data work ran in a producer replica's process."""
    assert trained.sft_workload["state"] == trained.rl_workload["state"] == trained.evaluation["state"] == "completed"
    master = ray.get(ray_api.actor("joynexus.master").process_report.remote(), timeout=60)
    assert master["heavy_modules"] == [] and master["data_modules"] == [], master
    replica = ray.get(ray_api.actor("joynexus.producers-0").heartbeat.remote(), timeout=60)
    assert replica["pid"] != master["pid"] and replica["advantage_stage"]


def test_predict_is_answered_by_the_resident_inference_service(trained: Trained):
    from joynexus.protocol.wire import Tensor

    body = trained.predicted
    assert body["policy_version"] == 1  # the SFT workload published its version to the inference actor
    assert Tensor.model_validate(body["actions"]).to_numpy().shape == (2, 2, 3)
    assert np.isfinite(Tensor.model_validate(body["actions"]).to_numpy()).all()
    before, after = trained.inference_before, trained.inference_after
    assert after["requests"] >= before["requests"] + 1 and after["samples"] >= before["samples"] + 2
    assert after["tenants"][trained.sft.tenant_id] == [1]
    assert trained.rl.tenant_id in after["tenants"]  # rollouts and the evaluation rode the same service
    assert after["backbone_instances_created"] == 1  # one backbone in the actor for every tenant


def test_the_policy_stream_is_served_by_the_resident_inference_service(ray_api: RayApi, trained: Trained):
    """/v1/stream on the API's default (Ray) path: robots of two tenants on one server get their
    chunks from the resident Inference Model Service actor."""
    from joynexus.protocol.wire import Tensor, msgpack_dumps, msgpack_loads, tensor

    inference = ray_api.actor("joynexus.inference_service")
    before = ray.get(inference.stats.remote(), timeout=60)
    batch = sample_batch(trained.sft.spec, 1, seed=5)
    frame = {
        "type": "obs",
        "seq": 7,
        "observations": {"images": tensor(batch["images"]).model_dump(), "state": tensor(batch["state"]).model_dump()},
    }
    with ray_api.client.websocket_connect("/v1/stream", headers=trained.sft.headers) as ws:
        ready = msgpack_loads(ws.receive_bytes())
        assert ready["type"] == "ready" and ready["tenant"]["tenant_id"] == trained.sft.tenant_id
        ws.send_bytes(msgpack_dumps(frame))
        answer = msgpack_loads(ws.receive_bytes())
    assert answer["type"] == "actions" and answer["seq"] == 7 and answer["policy_version"] == 1, answer
    actions = Tensor.model_validate(answer["actions"]).to_numpy()
    assert actions.shape == (1, 2, 3) and np.isfinite(actions).all()
    after = ray.get(inference.stats.remote(), timeout=60)
    assert after["requests"] >= before["requests"] + 1  # answered by the actor, not in this process


def test_metering_is_written_by_the_services(ray_api: RayApi, trained: Trained):
    rl = ray_api.usage(trained.rl)
    # Rollouts and the evaluation went straight to the resident services, never through the API.
    assert rl["env_steps"] > 0 and rl["device_seconds"]["inference"] > 0, rl
    assert rl["device_seconds"]["training"] > 0 and rl["samples_trained"] == 8, rl
    sft = ray_api.usage(trained.sft)
    assert sft["device_seconds"]["inference"] > 0 and sft["samples_predicted"] >= 2, sft
    assert sft["device_seconds"]["training"] > 0 and sft["samples_trained"] == 16, sft
    assert sft["env_steps"] == 0
    # The second server reads the same ledger.
    other = ray_api.client2.get("/v1/usage", headers=trained.sft.headers).json()
    assert other["samples_predicted"] == sft["samples_predicted"]


def test_two_api_servers_share_the_workloads_and_neither_leases_jobs(ray_api: RayApi):
    spec = sft_spec("ray-shared", ray_api.data_dir / "datasets" / "ray-shared", jobs=50, samples_per_job=16)
    write_dataset_for(spec, episodes=2, length=12)
    tenant = ray_api.create_tenant(spec, client=ray_api.client2)  # created through server 2
    workload_id = ray_api.submit(tenant, jobs=50)  # submitted through server 1

    seen = ray_api.client2.get(f"/v1/workloads/{workload_id}", headers=tenant.headers)
    assert seen.status_code == 200 and seen.json()["workload_id"] == workload_id
    listed = ray_api.client2.get("/v1/workloads", headers=tenant.headers).json()
    assert [w["workload_id"] for w in listed] == [workload_id]
    deadline = time.monotonic() + 30
    while ray_api.master_ping()["running_workloads"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray_api.master_ping()["running_workloads"] == 1  # the resident Master runs it

    cancelled = ray_api.client2.post(f"/v1/workloads/{workload_id}/cancel", headers=tenant.headers)
    assert cancelled.status_code == 200, cancelled.text
    final = ray_api.wait(tenant, workload_id, timeout_s=60)  # read back through server 1
    # "failed" too: a producer's error can race the cancel (see tests/api/test_client.py)
    assert final["state"] in ("cancelled", "failed") and final["completed_jobs"] < 50, final
    assert ray_api.master_ping()["running_workloads"] == 0
    for cluster in (ray_api.cluster, ray_api.cluster2):
        assert not hasattr(cluster, "workloads")


def test_predict_on_ray_answers_in_the_datasets_units(ray_api: RayApi):
    """Normalization on the Ray path: a tenant whose action dimensions are 1,000x apart trains one
    job in normalized units; the resident Inference Model Service answers in the dataset's units
    (each dimension near the data by its own scale), and the version's registry tags name the modes."""
    from joynexus.data.normalization import compute_stats
    from joynexus.protocol.wire import Tensor
    from joynexus.registry import ExperimentTracker
    from joynexus.settings import local_tracking_uri
    from tests.data.scaled_dataset import dataset_frames, write_scaled_dataset

    root = write_scaled_dataset(ray_api.data_dir / "datasets" / "ray-units", "test/ray-units", episodes=2, length=10)
    spec = sft_spec("ray-units", root, cameras=(), state_dim=4, action_dim=2, action_chunk=1, jobs=1)
    spec["dataset"]["repo_id"] = "test/ray-units"
    tenant = ray_api.create_tenant(spec)
    assert ray_api.wait(tenant, ray_api.submit(tenant, jobs=1))["state"] == "completed"

    states, actions = dataset_frames(root)
    body = {"observations": wire({"state": states[:4]})}
    response = ray_api.client.post("/v1/predict", json=body, headers=tenant.headers)
    assert response.status_code == 200, response.text
    predicted = Tensor.model_validate(response.json()["actions"]).to_numpy()[:, 0, :]
    stats = compute_stats(root)["action"]
    mean, std = np.asarray(stats["mean"]), np.asarray(stats["std"])
    assert (np.abs(predicted - mean) < 4 * std).all(), (predicted, mean, std)  # each dim on its own scale
    assert (np.abs(predicted[:, 1]) > 50).all() and (np.abs(predicted[:, 0]) < 5).all(), predicted
    tags = ExperimentTracker(local_tracking_uri(ray_api.data_dir)).model_version_tags("ray-units", 1)
    assert tags["normalization.action"] == "MEAN_STD" and tags["normalization.source"] == "meta/stats.json", tags
    assert actions.std(0)[1] > 300 * actions.std(0)[0]


def test_openpi_clients_and_foreign_weights_run_on_the_resident_services(ray_api: RayApi, trained: Trained):
    """Issue 24.4 / 24.5 on the Ray path: /v1/openpi answered by the resident Inference Model
    Service; foreign weights sent by the API server to the training actor as a new version
    (checkpointed), admitted by the Master actor and served and registered in MLflow (source /
    sha256) by the tenant's producer replica; an evaluation declaration's comparison table written
    by the Master actor."""
    import base64
    import hashlib

    import torch
    from safetensors.torch import save as save_safetensors
    from starlette.websockets import WebSocketDisconnect

    from joynexus.models.action_modules import build_action_module
    from joynexus.protocol import openpi_wire
    from joynexus.registry import ExperimentTracker

    sft = trained.sft
    batch = sample_batch(sft.spec, 1, seed=5)
    obs = {"images": {"front": (batch["images"][0, 0] * 255).astype(np.uint8)}, "state": batch["state"][0]}
    with ray_api.client.websocket_connect("/v1/openpi", headers={"Authorization": f"Api-Key {sft.api_key}"}) as ws:
        assert openpi_wire.unpack(ws.receive_bytes())["tenant_id"] == sft.tenant_id
        ws.send_bytes(openpi_wire.pack(obs))
        answer = openpi_wire.unpack(ws.receive_bytes())
    assert answer["actions"].shape == (2, 3) and answer["policy_version"] == 1, answer
    with pytest.raises(WebSocketDisconnect) as refused:
        with ray_api.client.websocket_connect("/v1/openpi", headers={"Authorization": "Api-Key nope"}) as ws:
            ws.receive_bytes()
    assert refused.value.code == 1008

    torch.manual_seed(3)
    module_config = ray_api.cluster.master.get_tenant(sft.tenant_id).backend_config.action_module
    weights = save_safetensors(build_action_module(module_config).state_dict())
    body = {"weights": base64.b64encode(weights).decode(), "source": "s3://elsewhere/policy.safetensors"}
    response = ray_api.client.post("/v1/weights/install", json=body, headers=sft.headers)
    assert response.status_code == 201, response.text
    installed = response.json()
    assert installed["version"] == 2 and installed["sha256"] == hashlib.sha256(weights).hexdigest()
    assert 2 in ray_api.client.get("/v1/versions", headers=sft.headers).json()["serving_versions"]
    tracker = ExperimentTracker(ray_api.cluster.settings.resolved_mlflow_uri())
    tags = tracker.model_version_tags(sft.tenant_id, installed["registered_version"])
    assert tags["source"] == body["source"] and tags["sha256"] == installed["sha256"]

    declared = ray_api.client.post(
        "/v1/admin/evaluations",
        json={"targets": [{"tenant_id": trained.rl.tenant_id}], "episodes": 1, "name": "ray"},
        headers=ADMIN,
    )
    assert declared.status_code == 202, declared.text
    declaration = declared.json()
    deadline = time.monotonic() + 120
    while declaration["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.2)
        declaration = ray_api.client.get(f"/v1/evaluations/{declaration['declaration_id']}", headers=ADMIN).json()
    assert declaration["state"] == "completed", declaration
    (row,) = declaration["table"]
    assert row["tenant_id"] == trained.rl.tenant_id and row["state"] == "completed" and row["episodes"] == 1
    assert declaration["run_id"] and tracker.client.list_artifacts(declaration["run_id"])


def test_tenant_and_version_lifecycle_on_the_resident_master(ray_api: RayApi):
    """Issue 26 on the Ray path: a corrupt version flagged and 409, a version deleted, a retired id
    refused (the Master actor's TenantIdRetired / TenantNotDeleted arrive as 409s) and purged, and
    per-workload event numbers."""
    spec = sft_spec("ray-life", ray_api.data_dir / "datasets" / "ray-life", jobs=1, samples_per_job=8)
    write_dataset_for(spec, episodes=2, length=12)
    t = ray_api.create_tenant(spec)
    client = ray_api.client
    for seed in (1, 2, 3):
        batch = wire(sample_batch(spec, 2, seed))
        assert client.post("/v1/train_batch", json=batch, headers=t.headers).status_code == 200
        assert client.post("/v1/save", json={}, headers=t.headers).status_code == 200
    manifest = ray_api.data_dir / "checkpoints" / "tenants" / t.tenant_id / "v000002" / "manifest.json"
    manifest.write_bytes(b"{")
    listed = {c["version"]: c for c in client.get("/v1/versions", headers=t.headers).json()["checkpoints"]}
    assert listed[2]["corrupt"] and not listed[1]["corrupt"]
    assert client.get("/v1/versions/2/export", headers=t.headers).status_code == 409
    assert client.delete("/v1/versions/1", headers=t.headers).status_code == 200

    workload_id = ray_api.submit(t, jobs=50)
    assert client.post(f"/v1/workloads/{workload_id}/cancel", headers=t.headers).status_code == 200
    assert ray_api.wait(t, workload_id)["state"] == "cancelled"
    events = client.get(f"/v1/workloads/{workload_id}/events", headers=t.headers).json()["events"]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))

    path = f"/v1/admin/tenants/{t.tenant_id}"
    assert client.delete(f"{path}/artifacts", headers=ADMIN).status_code == 409  # it still exists
    assert client.delete(path, headers=ADMIN).status_code == 200
    refused = client.post("/v1/admin/tenants", json=spec, headers=ADMIN)
    assert refused.status_code == 409 and "cannot be reused" in refused.json()["problems"][0]["reason"]
    assert client.delete(f"{path}/artifacts", headers=ADMIN).status_code == 200
    ray_api.create_tenant(spec)


def test_an_upload_a_spec_names_is_resolved_and_trained_on_by_the_resident_master(ray_api: RayApi):
    """Issue 24 on the Ray path: a tenant uploads a dataset to the API server; the Master actor
    resolves the workload's `dataset.id` to the stored copy (another id: 422 naming it), trains on
    it, and the checkpoint's manifest records its digest; the usage ledger counts the upload."""
    from tests.helpers import tar_dataset

    spec = sft_spec("ray-upload", ray_api.data_dir / "datasets" / "ray-upload", jobs=1, samples_per_job=8)
    write_dataset_for(spec, episodes=2, length=8)
    tenant = ray_api.create_tenant(spec)
    other = sft_spec("ray-upload-src", ray_api.data_dir / "datasets" / "ray-upload-src")
    write_dataset_for(other, episodes=2, length=6, seed=3)
    archive = tar_dataset(Path(other["dataset"]["root"]), gz=False)
    uploaded = ray_api.client.post("/v1/datasets?repo_id=team/ray", content=archive, headers=tenant.headers)
    assert uploaded.status_code == 201, uploaded.text
    dataset_id = uploaded.json()["dataset_id"]
    assert ray_api.usage(tenant)["dataset_bytes"] == uploaded.json()["bytes"]

    unknown = {**spec, "dataset": {"id": "1" * 64, "repo_id": "team/ray"}}
    refused = ray_api.client.post("/v1/workloads", json={"jobs": 1, "spec": unknown}, headers=tenant.headers)
    assert refused.status_code == 422 and refused.json()["problems"][0]["field"] == "spec.dataset.id", refused.text
    named = {**spec, "dataset": {"id": dataset_id, "repo_id": "team/ray"}}
    info = ray_api.wait(tenant, ray_api.submit(tenant, jobs=1, spec=named))
    assert info["state"] == "completed" and info["dataset_id"] == dataset_id, info
    manifest = ray_api.client.get(f"/v1/checkpoints/{info['version']}/manifest", headers=tenant.headers).json()
    assert manifest["extra"]["dataset_sha256"] == dataset_id, manifest["extra"]


def test_state_control_and_off_policy_losses_run_on_the_resident_services(ray_api: RayApi, trained: Trained):
    """Issue 28.3/28.4 on the Ray path: load_state and fork go through the resident Master actor to
    the Training Model Service actor; ppo_clip and per-step AdamW through the actor too."""
    sft, client = trained.sft, ray_api.client
    kept = client.get("/v1/versions", headers=sft.headers).json()["checkpoints"][-1]["version"]
    stepped = client.post("/v1/train_batch", json=wire(sample_batch(sft.spec, 4, seed=1)), headers=sft.headers)
    assert stepped.status_code == 200 and stepped.json()["version"] > kept
    rolled = client.post("/v1/load_state", json={"version": kept}, headers=sft.headers)
    assert rolled.status_code == 200, rolled.text
    assert rolled.json()["version"] == kept and rolled.json()["optimizer_restored"]

    body = {"new_tenant": "ray-sft-fork", "version": kept, "overrides": {"learning_rate": 0.01}}
    forked = client.post("/v1/fork", json=body, headers=sft.headers)
    assert forked.status_code == 201, forked.text
    fork_headers = {"Authorization": f"Bearer {forked.json()['key']['api_key']}"}
    versions = client.get("/v1/versions", headers=fork_headers).json()
    assert versions["training_version"] == 0 and [c["version"] for c in versions["checkpoints"]] == [0]
    assert client.post("/v1/fork", json=body, headers=sft.headers).status_code == 409  # the id is taken now

    rl = trained.rl
    batch = wire(sample_batch(rl.spec, 1, seed=2))
    pg = client.post(
        "/v1/forward_backward", json={**batch, "loss": "policy_gradient", "advantages": wire({"a": np.ones(1)})["a"]},
        headers=rl.headers,
    )  # fmt: skip
    assert pg.status_code == 200, pg.text
    ratio_two = np.asarray([-pg.json()["loss"] - np.log(2.0)], dtype=np.float32)
    clipped = client.post(
        "/v1/forward_backward",
        json={**batch, "loss": "ppo_clip", "advantages": wire({"a": np.ones(1)})["a"],
              "sampling_logprobs": wire({"s": ratio_two})["s"]},
        headers=rl.headers,
    )  # fmt: skip
    assert clipped.status_code == 200 and abs(clipped.json()["loss"] + 1.2) < 1e-3, clipped.text
    step = client.post("/v1/optim_step", json={"lr": 1e-4, "grad_clip": 0.5}, headers=rl.headers)
    assert step.status_code == 200 and step.json()["lr"] == 1e-4 and step.json()["grad_clip"] == 0.5


def test_futures_and_sampling_run_on_the_shared_call_queue_actor(ray_api: RayApi, trained: Trained):
    """Issue 28 on the Ray path: a tenant's futures go to the deployment's ONE `joynexus.call_futures`
    actor, so calls submitted through two API servers run in order and either server collects them;
    sampling runs on the resident Training Model Service; the futures' training time is metered."""
    from joynexus.protocol.wire import Tensor

    sft, rl = trained.sft, trained.rl
    version = ray_api.client.get("/v1/versions", headers=sft.headers).json()["training_version"]
    before = ray_api.usage(sft)["device_seconds"]["training"]
    batch = wire(sample_batch(sft.spec, 2, seed=9))
    first = ray_api.client.post("/v1/futures/forward_backward", json=batch, headers=sft.headers)
    second = ray_api.client2.post("/v1/futures/forward_backward", json=batch, headers=sft.headers)
    step = ray_api.client.post("/v1/futures/optim_step", headers=sft.headers)
    assert [r.status_code for r in (first, second, step)] == [202, 202, 202], step.text
    done = ray_api.client2.get(f"/v1/futures/{step.json()['future_id']}", params={"wait_s": 60}, headers=sft.headers)
    assert done.status_code == 200, done.text
    # both microbatches (submitted through two servers) went into the one step; a new version
    assert done.json()["microbatches"] == 2 and done.json()["version"] > version
    again = ray_api.client.get(f"/v1/futures/{second.json()['future_id']}", headers=sft.headers)
    assert again.json()["accumulated_microbatches"] == 2
    named = ray.util.list_named_actors(all_namespaces=True)
    assert [a for a in named if a["name"] == "joynexus.call_futures" and a["namespace"] == ray_api.namespace]

    obs = sample_batch(rl.spec, 2, seed=1)
    body = {"observations": wire({"images": obs["images"], "state": obs["state"]}), "n": 2, "seed": 4}
    sampled = ray_api.client2.post("/v1/futures/sample", json=body, headers=rl.headers).json()
    drawn = ray_api.client.get(f"/v1/futures/{sampled['future_id']}", params={"wait_s": 60}, headers=rl.headers)
    blocking = ray_api.client.post("/v1/sample", json=body, headers=rl.headers)
    assert drawn.status_code == 200 and blocking.status_code == 200, (drawn.text, blocking.text)
    actions = Tensor.model_validate(drawn.json()["actions"]).to_numpy()
    np.testing.assert_array_equal(actions, Tensor.model_validate(blocking.json()["actions"]).to_numpy())
    assert actions.shape == (2, 2, 1, 2) and drawn.json()["log_probs"] is not None
    deadline = time.monotonic() + 10  # the actor's meter writes within a second or so
    while ray_api.usage(sft)["device_seconds"]["training"] <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_api.usage(sft)["device_seconds"]["training"] > before


@pytest.mark.slow  # its own tenant's RL workload and evaluation on the Ray services (~1-2 min)
def test_a_flow_matching_rl_tenant_trains_and_is_evaluated_with_a_video_on_ray(ray_api: RayApi):
    """Issue 27: a flow head learns by RL (its noise-injected chain recorded by the rollout in the
    Master actor, rescored by PPO in the Training Model Service actor) and an evaluation suite of two
    seeds reports intervals and logs an mp4 from the Environment Service actor's renderer."""
    spec = rl_spec("ray-flow")
    spec["action_module"] = {"kind": "flow_matching", "size": "tiny"}
    spec["rl"]["advantage"] = "grpo"
    flow = ray_api.create_tenant(spec)
    workload = ray_api.wait(flow, ray_api.submit(flow, jobs=1), timeout_s=600)
    assert workload["state"] == "completed", workload
    suite = [{"seed": 1}, {"seed": 2}]
    evaluation = ray_api.wait(flow, ray_api.submit(flow, task="eval", episodes=1, suite=suite, videos=1), timeout_s=600)
    assert evaluation["state"] == "completed", evaluation
    result = evaluation["result"]
    assert result["policy_version"] == 1 and len(result["suite"]) == 2 and len(result["videos"]) == 2
    assert 0.0 <= result["success_ci_low"] <= result["success_rate"] <= result["success_ci_high"] <= 1.0


def test_a_lerobot_smolvla_tenant_trains_serves_and_is_evaluated_on_ray(ray_api: RayApi):
    """Issue 39 on the real deployment: a LeRobot SmolVLA checkpoint (LeRobot's own classes over the
    deployment's tiny VLM) becomes a tenant in the resident Master, its expert is fine-tuned by the
    Training Model Service actor over the shared prefix, served by the Inference Model Service actor
    and evaluated in PushT-reach by the Environment Service actor."""
    from joynexus.artifacts.lerobot_smolvla import build_lerobot_smolvla_checkpoint
    from joynexus.models.backbone import ResidentBackbone

    cameras = {"observation.images.top": (3, 32, 32)}
    small = dict(chunk_size=1, n_action_steps=1, num_steps=2, num_vlm_layers=2, max_state_dim=8, max_action_dim=4)
    checkpoint = build_lerobot_smolvla_checkpoint(
        ray_api.data_dir / "lerobot-smolvla", ResidentBackbone.build_tiny(), camera_shapes=cameras, state_dim=4,
        action_dim=2, tokenizer_max_length=16, resize_imgs_with_padding=(32, 32), **small,
    )  # fmt: skip
    spec = sft_spec(
        "ray-smolvla", ray_api.data_dir / "datasets" / "ray-smolvla", cameras=("top",), action_dim=2, action_chunk=1,
        jobs=1, samples_per_job=8,
    )  # fmt: skip
    write_dataset_for(spec, episodes=2, length=8)
    spec["action_module"] = {"kind": "smolvla", "checkpoint": str(checkpoint)}
    spec["environment"] = rl_spec("unused")["environment"]
    tenant = ray_api.create_tenant(spec)
    workload = ray_api.wait(tenant, ray_api.submit(tenant, jobs=1), timeout_s=600)
    assert workload["state"] == "completed" and workload["version"] == 1, workload
    evaluation = ray_api.wait(tenant, ray_api.submit(tenant, task="eval", episodes=1), timeout_s=600)
    assert evaluation["state"] == "completed" and evaluation["result"]["policy_version"] == 1, evaluation
    batch = sample_batch(spec, 2, seed=4)
    body = {"observations": wire({"images": batch["images"], "state": batch["state"]})}
    response = ray_api.client.post("/v1/predict", json=body, headers=tenant.headers)
    assert response.status_code == 200, response.text
    assert response.json()["policy_version"] == 1
