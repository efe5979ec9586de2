"""Issue 26 item 2: abandoned predicts keep no work, and a tenant's queued samples are bounded.

Before the fix a predict that timed out (or whose robot hung up) stayed queued and was computed
anyway: 100 requests with `timeout_s=0.001` left 50,460 queued chunks. Now the request is cancelled
in the service and its chunks leave the Inference Queue at once; measured with the queue's own size
API (`TenantFairQueue.depth(tenant)`)."""

from __future__ import annotations

import http.client
import json
import socket
import time

import httpx
import numpy as np
from websockets.sync.client import connect

from joynexus.protocol.wire import msgpack_dumps, msgpack_loads, tensor
from tests.security.conftest import predict_body, queued_chunks, wait_for

ABANDONED = 20  # requests, each of SAMPLES observations (SAMPLES / 8 chunks)
SAMPLES = 512


def test_predicts_that_time_out_leave_nothing_queued(api, live_server, attacker):
    body = predict_body(attacker, SAMPLES, timeout_s=0.001)
    with httpx.Client(base_url=live_server, headers=attacker.headers, timeout=60) as client:
        for _ in range(ABANDONED):
            response = client.post("/v1/predict", json=body)
            while response.status_code == 429:  # 20 x 512 samples outrun 4,000 samples/s on a quiet host
                time.sleep(float(response.headers.get("Retry-After", "1")))
                response = client.post("/v1/predict", json=body)
            assert response.status_code == 504, response.text
            assert response.json()["problems"] == [{"field": "timeout_s", "reason": "exceeded"}]
    # Each 504 was answered after its request was cancelled: nothing of them waits, none will run.
    assert queued_chunks(api, attacker.tenant_id) == 0
    assert api.cluster.inference.queue.queued_samples(attacker.tenant_id) == 0


def test_a_disconnecting_robot_leaves_nothing_queued(api, live_server, attacker):
    """A robot sends its in-flight limit of large requests and hangs up: the server calls them off."""
    batch = attacker.batch(1024, seed=1)  # 128 chunks per frame, ~3 MB of uint8 images
    frame = {
        "type": "obs",
        "observations": {
            "images": tensor((batch["images"] * 255).astype(np.uint8)).model_dump(),
            "state": tensor(batch["state"]).model_dump(),
        },
    }
    url = live_server.replace("http://", "ws://") + "/v1/stream"
    with connect(url, additional_headers=attacker.headers, max_size=None, open_timeout=30) as ws:
        ready = msgpack_loads(ws.recv(timeout=30))
        assert ready["type"] == "ready"
        for seq in range(ready["limits"]["max_in_flight"]):
            ws.send(msgpack_dumps({**frame, "seq": seq}))
        wait_for(lambda: queued_chunks(api, attacker.tenant_id) > 0, "the robot's requests queued", timeout_s=30)
        served_at_hangup = api.cluster.inference.stats()["samples"]  # only this tenant is busy here
    wait_for(lambda: queued_chunks(api, attacker.tenant_id) == 0, "its queued chunks dropped", timeout_s=10)
    time.sleep(0.3)  # a batch taken before the cancel finishes
    served = api.cluster.inference.stats()["samples"] - served_at_hangup
    # At most the batches the worker took before the cancel: far from the 4,096 samples sent.
    assert served < 1024, f"{served} samples computed for a robot that had hung up"


def test_a_tenants_queued_samples_are_bounded_with_a_clear_429(api, live_server, attacker, victim):
    queue = api.cluster.inference.queue
    default = queue.max_samples_per_tenant
    assert default == api.cluster.settings.max_queued_samples_per_tenant == 16384
    queue.max_samples_per_tenant = 4  # this server's bound, lowered for the test (a real setting)
    try:
        with httpx.Client(base_url=live_server, timeout=60) as client:
            refused = client.post("/v1/predict", json=predict_body(attacker, 8), headers=attacker.headers)
            fine = client.post("/v1/predict", json=predict_body(victim, 1), headers=victim.headers)
    finally:
        queue.max_samples_per_tenant = default
    assert refused.status_code == 429, refused.text
    answer = refused.json()
    assert answer["code"] == "quota_exceeded"
    assert "limit of 4 queued samples per tenant" in answer["message"]
    assert "JOYNEXUS_MAX_QUEUED_SAMPLES_PER_TENANT" in answer["message"]
    assert answer["problems"][0]["field"] == "max_queued_samples_per_tenant"
    assert fine.status_code == 200, fine.text  # the other tenant is not refused


def test_an_http_client_that_hangs_up_leaves_nothing_queued(api, live_server, attacker):
    """A plain HTTP predict whose client closes its connection is called off at the hang-up, not
    at its `timeout_s` (600 s here): its chunks leave the Inference Queue within seconds."""
    host, port = live_server.removeprefix("http://").split(":")
    body = json.dumps(predict_body(attacker, 1024, seed=3, timeout_s=600)).encode()
    headers = {**attacker.headers, "Content-Type": "application/json"}
    connections = []
    served_before = api.cluster.inference.stats()["samples"]
    for _ in range(2):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/predict", body=body, headers=headers)
        connections.append(conn)
    wait_for(lambda: queued_chunks(api, attacker.tenant_id) > 0, "the requests queued", timeout_s=30)
    for conn in connections:
        conn.sock.shutdown(socket.SHUT_RDWR)  # hang up without reading the answer
        conn.close()
    hung_up = time.monotonic()
    wait_for(lambda: queued_chunks(api, attacker.tenant_id) == 0, "the queued chunks dropped", timeout_s=15)
    print(f"queue empty {time.monotonic() - hung_up:.2f} s after the hang-up")
    time.sleep(0.3)  # a batch taken before the cancel finishes
    served = api.cluster.inference.stats()["samples"] - served_before
    assert served < 2048, f"{served} of 2,048 samples computed for clients that had hung up"
    # The server still answers the tenant normally afterwards (its in-flight slots came back).
    with httpx.Client(base_url=live_server, headers=attacker.headers, timeout=60) as client:
        wait_for(
            lambda: client.post("/v1/predict", json=predict_body(attacker, 1)).status_code == 200,
            "a later predict answered",
            timeout_s=30,
        )
