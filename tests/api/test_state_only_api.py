"""A state-only tenant (`observation.cameras: []`) over the tenant API: train and predict with no
`images` field (or an empty camera axis); a camera tenant still has to send its images."""

from __future__ import annotations

import numpy as np

from joynexus.protocol.wire import Tensor
from tests.api.conftest import wire
from tests.helpers import sft_spec, write_dataset_for


def test_a_state_only_tenant_trains_and_predicts_without_images(api):
    spec = sft_spec("blind-api", api.data_dir / "datasets" / "blind-api", cameras=(), jobs=2)
    write_dataset_for(spec, episodes=2, length=12)
    created = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert created.status_code == 201, created.text
    headers = {"Authorization": f"Bearer {created.json()['key']['api_key']}"}
    rng = np.random.default_rng(0)
    state = rng.standard_normal((3, 4)).astype(np.float32)
    action = np.tanh(rng.standard_normal((3, 2, 3))).astype(np.float32)
    step = api.client.post("/v1/train_batch", json=wire({"state": state, "action": action}), headers=headers)
    assert step.status_code == 200, step.text
    assert api.client.post("/v1/weights/load", json={}, headers=headers).json()["version"] == 1
    r = api.client.post("/v1/predict", json={"observations": wire({"state": state})}, headers=headers)
    assert r.status_code == 200, r.text
    actions = Tensor.model_validate(r.json()["actions"]).to_numpy()
    assert actions.shape == (3, 2, 3) and np.isfinite(actions).all()
    empty = np.zeros((3, 0, 3, 32, 32), dtype=np.float32)
    same = api.client.post(
        "/v1/predict", json={"observations": wire({"images": empty, "state": state})}, headers=headers
    )
    assert same.status_code == 200, same.text
    np.testing.assert_allclose(Tensor.model_validate(same.json()["actions"]).to_numpy(), actions, atol=1e-5)


def test_a_camera_tenant_without_images_is_told_the_field(api):
    t = api.tenant("needs-images")
    r = api.client.post("/v1/predict", json={"observations": wire({"state": t.batch(2)["state"]})}, headers=t.headers)
    assert r.status_code == 422
    assert any(p["field"] == "images" for p in r.json()["problems"]), r.text
