"""Issue 26 item 6 on the robot paths: while a role is away (the Inference Model Service actor
restarting, a new deployment coming up), `/v1/stream` answers an `unavailable` error frame with
`retry_after_s` and `/v1/openpi` an `unavailable` error text, as HTTP answers 503 + Retry-After:
never `internal`, and the connection stays open for the next request once the role is back.

The role is taken away by making the in-process deployment's Inference Model Service raise what
a Ray handle raises while its actor restarts (`ActorUnavailableError`) or what the role lookup
raises while a deployment is replaced (`RoleUnavailable`)."""

from __future__ import annotations

import numpy as np
import pytest
from websockets.sync.client import connect

from joynexus.actors import RoleUnavailable
from joynexus.protocol.wire import msgpack_dumps, msgpack_loads, tensor
from tests.security.conftest import serving_tenant

ray_exceptions = pytest.importorskip("ray.exceptions")

AWAY = {
    "actor restarting": lambda: ray_exceptions.ActorUnavailableError("the actor is restarting", None),
    "deployment replaced": lambda: RoleUnavailable("inference", "a new deployment is coming up", retry_after_s=5),
}


@pytest.fixture(scope="module")
def robot(api):
    return serving_tenant(api, "robot")


@pytest.fixture
def role_away(api, monkeypatch):
    """`away(kind)` makes the Inference Model Service's predict raise that error; `back()` undoes it."""
    service = api.cluster.inference.target  # the in-process service object behind the handle
    served = service.predict

    class Switch:
        def away(self, kind: str) -> None:
            def unavailable(*_args, **_kwargs):
                raise AWAY[kind]()

            monkeypatch.setattr(service, "predict", unavailable)

        def back(self) -> None:
            monkeypatch.setattr(service, "predict", served)

    return Switch()


def obs_frame(robot, seq: int) -> bytes:
    batch = robot.batch(1, seed=seq)
    observations = {
        "images": tensor((batch["images"] * 255).astype(np.uint8)).model_dump(),
        "state": tensor(batch["state"]).model_dump(),
    }
    return msgpack_dumps({"type": "obs", "seq": seq, "observations": observations})


@pytest.mark.parametrize("kind, retry_after_s", [("actor restarting", 2.0), ("deployment replaced", 5.0)])
def test_the_policy_stream_answers_unavailable_frames_while_a_role_is_away(
    live_server, robot, role_away, kind, retry_after_s
):
    url = live_server.replace("http://", "ws://") + "/v1/stream"
    with connect(url, additional_headers=robot.headers, open_timeout=30) as ws:
        assert msgpack_loads(ws.recv(timeout=30))["type"] == "ready"
        role_away.away(kind)
        ws.send(obs_frame(robot, 1))
        frame = msgpack_loads(ws.recv(timeout=30))
        assert frame["type"] == "error" and frame["seq"] == 1, frame
        assert frame["code"] == "unavailable", frame
        assert frame["retry_after_s"] == retry_after_s
        assert "restarting" in frame["message"]
        role_away.back()
        ws.send(obs_frame(robot, 2))  # the same connection, the role back
        answer = msgpack_loads(ws.recv(timeout=30))
        assert answer["type"] == "actions" and answer["seq"] == 2, answer


def test_the_openpi_endpoint_answers_unavailable_while_a_role_is_away(live_server, robot, role_away):
    openpi_client = pytest.importorskip("openpi_client.websocket_client_policy")
    policy = openpi_client.WebsocketClientPolicy(
        host=live_server.replace("http://", "ws://") + "/v1/openpi", api_key=robot.api_key
    )
    batch = robot.batch(1, seed=5)
    images = (batch["images"][0] * 255).round().astype(np.uint8)
    cameras = robot.spec["observation"]["cameras"]
    obs = {"images": {c: images[i].transpose(1, 2, 0) for i, c in enumerate(cameras)}, "state": batch["state"][0]}
    role_away.away("actor restarting")
    with pytest.raises(RuntimeError) as refused:
        policy.infer(obs)
    text = str(refused.value)
    assert "unavailable:" in text and "restarting" in text and "retry after 2 s" in text, text
    assert "internal" not in text
    role_away.back()
    answer = policy.infer(obs)  # the same connection
    assert answer["actions"].shape[0] >= 1 and np.isfinite(answer["actions"]).all()
