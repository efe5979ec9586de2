"""Weights go from the API server to the Training / Inference Model Services, never through the
Master Service (issue 40): every byte the Master's methods take or return is counted while a tenant
installs foreign weights, rolls its slot back (load_state) and forks a version. The install's upload
goes to the Training Model Service itself; the Master only admits it and has the tenant's producer
replica serve and register the new version. load_state and fork send the Master ids and versions
only; a fork's checkpoint copy is made by the Training Model Service (`fork_checkpoint`), so the
Master's own checkpoint store never reads a tensor either."""

from __future__ import annotations

import base64
import dataclasses
import functools
import inspect
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import BaseModel
from safetensors.torch import save as save_safetensors

from joynexus.models.action_modules import build_action_module
from tests.api.conftest import wire


def payload_bytes(value: Any) -> int:
    """Bytes of the weight-like data in a value: byte strings, arrays and tensors, anywhere in it."""
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(payload_bytes(k) + payload_bytes(v) for k, v in value.items())
    if isinstance(value, list | tuple | set | frozenset):
        return sum(payload_bytes(v) for v in value)
    if isinstance(value, BaseModel):
        return payload_bytes(dict(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return payload_bytes({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    return 0


class MasterByteCounter:
    """Wraps every public method of the Master Service object: (method, bytes in, bytes out) per call."""

    def __init__(self, master: Any, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[tuple[str, int, int]] = []
        for name, _ in inspect.getmembers(type(master), inspect.isfunction):
            if not name.startswith("_"):
                monkeypatch.setattr(master, name, self._counted(name, getattr(master, name)))

    def _counted(self, name: str, method: Any) -> Any:
        @functools.wraps(method)
        def counted(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            self.calls.append((name, payload_bytes([args, kwargs]), payload_bytes(result)))
            return result

        return counted

    def moved(self) -> list[tuple[str, int, int]]:
        return [call for call in self.calls if call[1] or call[2]]


def test_install_weights_load_state_and_fork_pass_no_weight_byte_through_the_master(api, monkeypatch):
    t = api.tenant("bypass")
    module_config = api.cluster.master.get_tenant(t.tenant_id).backend_config.action_module
    torch.manual_seed(5)
    state = build_action_module(module_config).state_dict()
    upload = save_safetensors(state)
    counter = MasterByteCounter(api.cluster.master, monkeypatch)
    master_reads: list[tuple[str, int]] = []  # tensors the Master's own checkpoint store loads
    master_checkpoints = api.cluster.master.deployment.checkpoints
    load_tenant = master_checkpoints.load_tenant
    monkeypatch.setattr(
        master_checkpoints, "load_tenant", lambda tenant_id, version, *a, **k: (
            master_reads.append((tenant_id, version)), load_tenant(tenant_id, version, *a, **k))[1]
    )  # fmt: skip

    installed = api.client.post(
        "/v1/weights/install",
        json={"weights": base64.b64encode(upload).decode(), "source": "hf://lab/bypass@1"},
        headers=t.headers,
    )
    assert installed.status_code == 201, installed.text
    assert installed.json()["version"] == 1
    names = {name for name, _, _ in counter.calls}
    assert {"admit_weights_install", "publish_installed_weights"} <= names  # the Master admitted and recorded it
    # The installed tensors are the training slot's and the served version's.
    served = api.client.post(
        "/v1/predict",
        json={"observations": wire({k: v for k, v in t.batch(1).items() if k != "action"}), "policy_version": 1},
        headers=t.headers,
    )
    assert served.status_code == 200 and served.json()["policy_version"] == 1, served.text
    slot = api.cluster.training.target.tenant_state(t.tenant_id)["module"]
    assert all(torch.equal(slot[name], value) for name, value in state.items())

    step = api.client.post("/v1/train_batch", json=wire(t.batch(4, seed=1)), headers=t.headers)
    assert step.status_code == 200 and step.json()["version"] == 2, step.text
    rolled = api.client.post("/v1/load_state", json={"version": 1}, headers=t.headers)
    assert rolled.status_code == 200 and rolled.json()["version"] == 1, rolled.text
    forked = api.client.post("/v1/fork", json={"new_tenant": f"{t.tenant_id}-f", "version": 1}, headers=t.headers)
    assert forked.status_code == 201, forked.text
    assert {"load_state", "fork_tenant"} <= {name for name, _, _ in counter.calls}

    assert counter.moved() == [], f"weight bytes through the Master's methods: {counter.moved()}"
    assert master_reads == [], f"checkpoint tensors the Master loaded: {master_reads}"
    forked_v0 = api.cluster.training.target.checkpoints.read_manifest(f"{t.tenant_id}-f", 0)
    assert forked_v0.extra["forked_from"] == {"tenant_id": t.tenant_id, "version": 1}
    # The counter sees bytes where they are: the upload is tens of kilobytes.
    assert payload_bytes({"weights": upload}) == len(upload) > 1000
