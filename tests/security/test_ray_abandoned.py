"""Issue 26 item 2 on the Ray deployment (`connect(mode="ray")`, what `joynexus serve` uses): the
API's timeouts and a robot's hang-up cancel the request inside the resident Inference Model Service
actor (the hang-up's cancel goes through the actor's `health` concurrency group, past the predicts
that hold its threads), and the actor's queue holds nothing of them. Slow: it starts Ray."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid

import httpx
import numpy as np
import pytest
from websockets.sync.client import connect

from joynexus.protocol.wire import msgpack_dumps, msgpack_loads, tensor
from tests.api.conftest import ADMIN_KEY, free_port
from tests.helpers import TINY_MODEL_ID, wait_for

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow
SCHEMA = dict(cameras=["top"], image_size=[24, 40], state_dim=4, action_dim=2)


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory):
    """A uvicorn API server over a Ray deployment in a namespace of its own; yields (url, cluster)."""
    import uvicorn

    from joynexus.api.app import ApiSettings, create_app
    from joynexus.connect import connect as connect_cluster
    from joynexus.ops.supervisor import remove_service_actors
    from joynexus.settings import Settings

    started_ray = not ray.is_initialized()
    namespace = f"test-abuse-ray-{uuid.uuid4().hex[:8]}"
    settings = Settings(data_dir=tmp_path_factory.mktemp("abuse-ray"), ray_namespace=namespace, torch_threads=1)
    cluster = None
    try:
        cluster = connect_cluster(settings, mode="ray")
        app = create_app(cluster, ApiSettings(), admin_key=ADMIN_KEY)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_for(lambda: server.started, "uvicorn to start", timeout_s=60)
        yield f"http://127.0.0.1:{server.config.port}", cluster
        server.should_exit = True
        thread.join(timeout=30)
    finally:
        if cluster is not None:
            cluster.close()
        if ray.is_initialized():
            remove_service_actors(namespace)
            if started_ray:
                ray.shutdown()


def queue_depth(cluster) -> int:
    return cluster.inference.stats()["queue_depth"]


def observations(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 255, (n, 1, 3, 24, 40), dtype=np.uint8)
    state = rng.standard_normal((n, 4)).astype(np.float32)
    return {"images": tensor(images), "state": tensor(state)}


def test_abandoned_predicts_and_streams_leave_nothing_queued_on_ray(ray_server):
    url, cluster = ray_server
    spec = {
        "tenant": "ray-attacker",
        "base_model": TINY_MODEL_ID,
        "task": "eval",
        "action_module": {"kind": "flow_matching", "size": "tiny"},
        "observation": SCHEMA,
    }
    with httpx.Client(base_url=url, timeout=120) as client:
        created = client.post("/v1/admin/tenants", json=spec, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert created.status_code == 201, created.text
        headers = {"Authorization": f"Bearer {created.json()['key']['api_key']}"}
        assert client.post("/v1/weights/load", json={}, headers=headers).status_code == 200
        obs = {k: v.model_dump(mode="json") for k, v in observations(512, 0).items()}
        for _ in range(10):
            response = client.post("/v1/predict", json={"observations": obs, "timeout_s": 0.001}, headers=headers)
            assert response.status_code == 504, response.text
        assert queue_depth(cluster) == 0

    frame = {"type": "obs", "observations": {k: v.model_dump() for k, v in observations(2048, 1).items()}}
    with connect(url.replace("http://", "ws://") + "/v1/stream", additional_headers=headers, max_size=None) as ws:
        limits = msgpack_loads(ws.recv(timeout=60))["limits"]
        for seq in range(limits["max_in_flight"]):
            ws.send(msgpack_dumps({**frame, "seq": seq}))
        wait_for(lambda: queue_depth(cluster) > 0, "the robot's requests queued in the actor", timeout_s=60)
    started = time.monotonic()
    wait_for(lambda: queue_depth(cluster) == 0, "the actor's queue emptied by the cancels", timeout_s=5)
    with contextlib.suppress(Exception):
        print(f"queue empty {time.monotonic() - started:.2f} s after the hang-up")
