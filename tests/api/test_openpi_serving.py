"""/v1/openpi through a real uvicorn server, driven by the stock openpi client from PyPI
(`openpi_client.websocket_client_policy.WebsocketClientPolicy`, unchanged)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed

from joynexus.protocol import openpi_wire
from joynexus.protocol.wire import Tensor
from tests.api.conftest import ADMIN_KEY, wire

openpi_client = pytest.importorskip(
    "openpi_client.websocket_client_policy", reason="openpi-client is not installed (scripts/bootstrap installs it)"
)
WebsocketClientPolicy = openpi_client.WebsocketClientPolicy


def url(live_server: str) -> str:
    return live_server.replace("http://", "ws://") + "/v1/openpi"


def serving_tenant(api, prefix: str, shape: str = "arm"):
    t = api.tenant(prefix, shape)
    api.client.post("/v1/train_batch", json=wire(t.batch(2)), headers=t.headers)
    loaded = api.client.post("/v1/weights/load", json={}, headers=t.headers)
    assert loaded.status_code == 200, loaded.text
    return t


def openpi_obs(t, seed: int) -> dict:
    """One observation in openpi's convention: HWC uint8 images per camera, a flat state, a prompt."""
    batch = t.batch(1, seed=seed)
    images = (batch["images"][0] * 255).round().astype(np.uint8)  # (cameras, 3, H, W)
    cameras = t.spec["observation"]["cameras"]
    return {
        "images": {c: images[i].transpose(1, 2, 0) for i, c in enumerate(cameras)},
        "state": batch["state"][0],
        "prompt": "pick up the cube",
        "seed": seed,
    }


def http_predict(api, t, obs: dict) -> np.ndarray:
    cameras = t.spec["observation"]["cameras"]
    images = np.stack([obs["images"][c].transpose(2, 0, 1) for c in cameras])[None]
    body = {
        "observations": {**wire({"images": images, "state": obs["state"][None]}), "instructions": [obs["prompt"]]},
        "seeds": [obs["seed"]],
    }
    response = api.client.post("/v1/predict", json=body, headers=t.headers)
    assert response.status_code == 200, response.text
    return Tensor.model_validate(response.json()["actions"]).to_numpy()[0]


@pytest.fixture(scope="module")
def tenants(api):
    return serving_tenant(api, "openpi-arm"), serving_tenant(api, "openpi-flow", "flow")


def test_two_tenants_at_once_get_their_metadata_and_the_actions_of_predict(api, live_server, tenants):
    results: dict[str, list] = {}
    errors: list[BaseException] = []

    def robot(t) -> None:
        try:
            policy = WebsocketClientPolicy(url(live_server), api_key=t.api_key)
            answers = [(obs, policy.infer(obs)) for obs in (openpi_obs(t, seed) for seed in range(4))]
            results[t.tenant_id] = [policy.get_server_metadata(), answers]
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=robot, args=(t,)) for t in tenants]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    for t in tenants:
        metadata, answers = results[t.tenant_id]
        obs_spec = t.spec["observation"]
        assert metadata["protocol"] == "openpi" and metadata["tenant_id"] == t.tenant_id
        assert metadata["cameras"] == list(obs_spec["cameras"]) and metadata["state_dim"] == obs_spec["state_dim"]
        assert metadata["limits"]["max_connections_per_tenant"] >= 1
        for obs, answer in answers:
            actions = answer["actions"]
            assert isinstance(actions, np.ndarray) and actions.dtype == np.float32
            assert actions.shape == (obs_spec["action_chunk"], obs_spec["action_dim"])
            assert answer["policy_version"] == 1 and answer["server_timing"]["infer_ms"] > 0
            np.testing.assert_allclose(actions, http_predict(api, t, obs), rtol=1e-5, atol=1e-6)


def test_a_bad_key_or_the_admin_key_is_refused(live_server, tenants):
    for key in ("jnx_0000000000000000_" + "x" * 43, ADMIN_KEY):
        with pytest.raises(ConnectionClosed) as info:
            WebsocketClientPolicy(url(live_server), api_key=key)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1008


def test_a_bad_observation_gets_a_clear_error_and_the_connection_continues(live_server, tenants):
    arm = tenants[0]
    policy = WebsocketClientPolicy(url(live_server), api_key=arm.api_key)
    good = openpi_obs(arm, 0)
    bad_cases = {
        "state: expected shape (4,), got (7,)": {**good, "state": np.zeros(7, np.float32)},
        "images.wrist: missing": {**good, "images": {"front": good["images"]["front"]}},
        "images.front: expected shape (32, 32, 3) or (3, 32, 32), got (16, 16, 3)": {
            **good,
            "images": {**good["images"], "front": np.zeros((16, 16, 3), np.uint8)},
        },
        "unknown keys ['joints']": {**good, "joints": np.zeros(3)},
    }
    for expected, obs in bad_cases.items():
        with pytest.raises(RuntimeError) as info:
            policy.infer(obs)
        assert "invalid_input" in str(info.value) and expected in str(info.value), str(info.value)
    with pytest.raises(RuntimeError, match="state"):  # the gateway's own checks answer too (non-finite)
        policy.infer({**good, "state": np.full(4, np.nan, np.float32)})
    assert policy.infer(good)["actions"].shape == (2, 3)  # the connection still serves


def test_the_wire_refuses_dtypes_off_the_allow_list():
    from joynexus.protocol.wire import WireError

    packed = openpi_wire.pack({"x": np.arange(3, dtype=np.float32)})
    assert np.array_equal(openpi_wire.unpack(packed)["x"], np.arange(3, dtype=np.float32))
    evil = openpi_wire.pack({"x": {b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "O", b"shape": [1]}})
    with pytest.raises(WireError, match="not accepted"):
        openpi_wire.unpack(evil)
    short = openpi_wire.pack({"x": {b"__ndarray__": True, b"data": b"\0" * 3, b"dtype": "<f4", b"shape": [1]}})
    with pytest.raises(WireError, match="needs 4"):
        openpi_wire.unpack(short)


def test_openpis_own_host_and_port_form_connects_at_the_default_path(api, live_server, tenants):
    """Issue 41.8: `WebsocketClientPolicy(host=, port=)` appends no path; it got a bare HTTP 403."""
    t = tenants[0]
    host, port = live_server.removeprefix("http://").rsplit(":", 1)
    policy = WebsocketClientPolicy(host=host, port=int(port), api_key=t.api_key)
    assert policy.get_server_metadata()["tenant_id"] == t.tenant_id
    obs = openpi_obs(t, 3)
    np.testing.assert_allclose(policy.infer(obs)["actions"], http_predict(api, t, obs), rtol=1e-5, atol=1e-6)


def test_a_missing_key_is_refused_at_once_naming_api_key(live_server, tenants):
    """Issue 41.9: refused after auth_timeout_s (10 s) while a wrong key took milliseconds."""
    import time

    started = time.monotonic()
    with pytest.raises(ConnectionClosed) as info:
        WebsocketClientPolicy(url(live_server))
    assert time.monotonic() - started < 3.0
    assert info.value.rcvd is not None and info.value.rcvd.code == 1008 and "api_key=" in info.value.rcvd.reason
