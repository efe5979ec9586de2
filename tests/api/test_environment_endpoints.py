"""Environment sessions over HTTP (gym-pusht, a real simulator in its own worker process)."""

from __future__ import annotations

import numpy as np

from joynexus.protocol.wire import Tensor
from tests.api.conftest import wire

PUSHT = {"simulator": "pusht", "task": "PushT-v0", "cameras": ["top"], "image_size": [32, 32], "max_episode_steps": 5}


def test_session_reset_step_close_and_isolation(api):
    owner, intruder = api.tenant("env"), api.tenant("env-other")
    c = api.client
    opened = c.post("/v1/env/sessions", json={"config": PUSHT, "rollout_id": "r1"}, headers=owner.headers)
    assert opened.status_code == 201, opened.text
    session_id, spec = opened.json()["session_id"], opened.json()["spec"]
    assert (spec["action_dim"], spec["cameras"]) == (2, ["top"])
    early = c.post(
        f"/v1/env/sessions/{session_id}/step", json=wire({"action": np.zeros(2, np.float32)}), headers=owner.headers
    )
    assert early.status_code == 409 and "reset" in early.json()["message"]

    obs = c.post(f"/v1/env/sessions/{session_id}/reset", json={"seed": 3}, headers=owner.headers).json()["data"]
    assert Tensor.model_validate(obs["images"]["top"]).to_numpy().shape == (3, 32, 32)
    step = wire({"action": np.array([256.0, 256.0], np.float32)})
    for _ in range(5):
        result = c.post(f"/v1/env/sessions/{session_id}/step", json=step, headers=owner.headers).json()["data"]
    assert result["truncated"] is True and isinstance(result["reward"], float)
    bad = c.post(
        f"/v1/env/sessions/{session_id}/step", json=wire({"action": np.zeros(3, np.float32)}), headers=owner.headers
    )
    assert bad.status_code == 422 and "action" in bad.json()["message"]

    # another tenant: the same 404 as for an id that never existed, and nothing listed
    for method, path, body in [
        ("POST", "/v1/env/sessions/{}/reset", {}),
        ("POST", "/v1/env/sessions/{}/step", step),
        ("DELETE", "/v1/env/sessions/{}", None),
    ]:
        theirs = c.request(method, path.format(session_id), json=body, headers=intruder.headers)
        missing = c.request(method, path.format("env-0000"), json=body, headers=intruder.headers)
        assert theirs.status_code == missing.status_code == 404
        assert theirs.json()["message"].replace(session_id, "X") == missing.json()["message"].replace("env-0000", "X")
    assert c.get("/v1/env/sessions", headers=intruder.headers).json() == {"sessions": []}
    listed = c.get("/v1/env/sessions", headers=owner.headers).json()["sessions"]
    assert [(s["session_id"], s["steps"], s["rollout_id"]) for s in listed] == [(session_id, 5, "r1")]

    assert c.delete(f"/v1/env/sessions/{session_id}", headers=owner.headers).json() == {"cleared": True}
    assert c.post(f"/v1/env/sessions/{session_id}/reset", json={}, headers=owner.headers).status_code == 404
    assert c.get("/v1/usage", headers=owner.headers).json()["env_steps"] == 5


def test_bad_session_configs_are_422(api):
    t = api.tenant("env-bad")
    c = api.client
    r = c.post("/v1/env/sessions", json={"config": {"simulator": "doom", "task": "e1m1"}}, headers=t.headers)
    assert r.status_code == 422 and "doom" in r.json()["message"]
    r = c.post("/v1/env/sessions", json={"config": {**PUSHT, "task": "PushZ-v9"}}, headers=t.headers)
    assert r.status_code == 422 and "PushZ-v9" in r.json()["message"]
    r = c.post("/v1/env/sessions", json={"config": PUSHT, "rollout_id": "a/b"}, headers=t.headers)
    assert r.status_code == 422
