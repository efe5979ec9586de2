"""Issue 28.3 and 28.4 through the HTTP API and both Python clients: load_state, fork, the
importance_sampling / ppo_clip losses and per-call AdamW hyperparameters of optim_step; bad input
answers 422 naming the field, and leaves nothing half-made."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from joynexus.artifacts import decode_tenant_payload
from joynexus.client import AsyncJoyNexusClient, InvalidArgument, JoyNexusClient
from tests.api.conftest import wire
from tests.api.test_client import load_example
from tests.helpers import assert_state_equal

LN2 = math.log(2.0)


def slot_state(api, tenant_id):
    return api.cluster.training.target.tenant_state(tenant_id)


def problems(response) -> dict[str, str]:
    return {p["field"]: p["reason"] for p in response.json()["problems"]}


def train(api, t, seed: int) -> dict:
    response = api.client.post("/v1/train_batch", json=wire(t.batch(4, seed=seed)), headers=t.headers)
    assert response.status_code == 200, response.text
    return response.json()


def test_load_state_over_http_and_both_clients(api, live_server):
    t = api.tenant("ls")
    train(api, t, 0), train(api, t, 1)
    assert api.client.post("/v1/save", json={}, headers=t.headers).json()["policy_version"] == 2
    train(api, t, 2)
    api.client.post("/v1/forward_backward", json=wire(t.batch(2)), headers=t.headers)

    rolled = api.client.post("/v1/load_state", json={"version": 2}, headers=t.headers)
    assert rolled.status_code == 200, rolled.text
    assert rolled.json() == {
        "version": 2, "previous_version": 3, "optimizer_restored": True, "optimizer_steps": 2,
        "discarded_microbatches": 1,
    }  # fmt: skip
    _, kept, kept_optimizer = api.cluster.checkpoints.load_tenant(t.tenant_id, 2)
    state = slot_state(api, t.tenant_id)
    assert_state_equal(state["module"], kept, "module")
    assert_state_equal(state["optimizer"]["state"], kept_optimizer["state"], "optimizer")
    assert api.client.get("/v1/versions", headers=t.headers).json()["training_version"] == 2
    assert train(api, t, 3)["version"] == 4  # version numbers are never reused

    missing = api.client.post("/v1/load_state", json={"version": 99}, headers=t.headers)
    assert missing.status_code == 422 and "no checkpoint of version 99" in problems(missing)["version"]
    assert api.client.post("/v1/load_state", json={"version": -1}, headers=t.headers).status_code == 422
    assert api.client.post("/v1/load_state", json={"version": 2}).status_code == 401

    with JoyNexusClient(live_server, t.api_key) as client:
        assert client.load_state(2).version == 2

    async def rollback():
        async with AsyncJoyNexusClient(live_server, t.api_key) as client:
            return await client.load_state(2)

    assert asyncio.run(rollback()).optimizer_restored


def test_fork_over_http_copies_a_version_and_shares_nothing(api):
    source = api.tenant("fk")
    train(api, source, 0)
    api.client.post("/v1/save", json={}, headers=source.headers)
    train(api, source, 1)
    new_id = f"{source.tenant_id}-lr"
    body = {"new_tenant": new_id, "version": 1, "overrides": {"learning_rate": 0.01, "seed": 7}}
    forked = api.client.post("/v1/fork", json=body, headers=source.headers)
    assert forked.status_code == 201, forked.text
    answer = forked.json()
    assert answer["forked_from"] == {"tenant_id": source.tenant_id, "version": 1} and answer["version"] == 0
    fork_headers = {"Authorization": f"Bearer {answer['key']['api_key']}"}
    info = api.client.get("/v1/tenant", headers=fork_headers).json()  # the caller holds the fork's key
    assert info["tenant_id"] == new_id and info["schema_signature"] == answer["tenant"]["schema_signature"]
    assert api.cluster.master.get_tenant(new_id).backend_config.learning_rate == 0.01

    _, kept, kept_optimizer = api.cluster.checkpoints.load_tenant(source.tenant_id, 1)
    state = slot_state(api, new_id)
    assert_state_equal(state["module"], kept, "module")
    assert_state_equal(state["optimizer"]["state"], kept_optimizer["state"], "optimizer")
    assert all(group["lr"] == 0.01 for group in state["optimizer"]["param_groups"])

    # Nothing mutable is shared: a step of either leaves the other's weights and versions alone.
    source_before = slot_state(api, source.tenant_id)
    step = api.client.post("/v1/train_batch", json=wire(source.batch(4, seed=9)), headers=fork_headers).json()
    assert step["version"] == 1
    assert_state_equal(slot_state(api, source.tenant_id), source_before, "source")
    fork_before = slot_state(api, new_id)
    assert train(api, source, 2)["version"] == 3
    assert_state_equal(slot_state(api, new_id), fork_before, "fork")


@pytest.fixture(scope="module")
def fork_source(api):
    source = api.tenant("fkbad")
    train(api, source, 0)
    return source


@pytest.mark.parametrize(
    ("change", "status", "field"),
    [
        ({"overrides": {"learning_rate": 0}}, 422, "overrides.learning_rate"),
        ({"overrides": {"learning_rate": 2.0}}, 422, "overrides.learning_rate"),
        ({"overrides": {"seed": -1}}, 422, "overrides.seed"),
        ({"overrides": {"action_module": {"size": "large"}}}, 422, "overrides.action_module"),
        ({"version": 42}, 422, "version"),
        ({"new_tenant": "Not An Id"}, 422, "new_tenant"),
        ({"new_tenant": "SOURCE"}, 409, "new_tenant"),
    ],
)
def test_bad_forks_name_the_field_and_leave_nothing(api, fork_source, change, status, field):
    source = fork_source
    new_id = f"{source.tenant_id}-x"
    body = {"new_tenant": new_id, **change}
    if body["new_tenant"] == "SOURCE":
        body["new_tenant"] = new_id = source.tenant_id
    answer = api.client.post("/v1/fork", json=body, headers=source.headers)
    assert answer.status_code == status, answer.text
    assert any(name.startswith(field) for name in problems(answer)), answer.text
    if new_id != source.tenant_id:
        assert new_id not in {t.tenant_id for t in api.cluster.master.list_tenants()}
        assert api.cluster.checkpoints.versions(new_id) == []


def test_fork_through_both_clients(api, live_server):
    source = api.tenant("fkc")
    train(api, source, 0)
    with JoyNexusClient(live_server, source.api_key) as client:
        forked = client.fork(f"{source.tenant_id}-seed", seed=3)  # version None: the current one, saved now
        assert forked.forked_from.version == 1 and forked.key is not None
        with JoyNexusClient(live_server, forked.key.api_key) as fork_client:
            assert fork_client.tenant().tenant_id == f"{source.tenant_id}-seed"
        with pytest.raises(InvalidArgument) as caught:
            client.fork(f"{source.tenant_id}-bad", learning_rate=-1.0)
        assert caught.value.problems[0].field == "overrides.learning_rate"  # refused before sending

    async def fork_async():
        async with AsyncJoyNexusClient(live_server, source.api_key) as client:
            return await client.fork(f"{source.tenant_id}-lr", version=1, learning_rate=1e-2)

    assert asyncio.run(fork_async()).tenant.tenant_id == f"{source.tenant_id}-lr"


@pytest.fixture(scope="module")
def rl_tenant(api):
    pytest.importorskip("gym_pusht")  # the RL tenant's environment is checked at creation
    example = load_example("custom_reinforce")
    created = api.client.post("/v1/admin/tenants", json=example.pusht_rl_spec("offpolicy-http"), headers=api.admin)
    assert created.status_code == 201, created.text
    info = created.json()["tenant"]
    rng = np.random.default_rng(0)
    height, width = info["image_size"]
    batch = {
        "images": rng.random((1, len(info["cameras"]), 3, height, width), dtype=np.float32),
        "state": rng.standard_normal((1, info["state_dim"])).astype(np.float32),
        "action": rng.uniform(-1, 1, (1, info["action_chunk"], info["action_dim"])).astype(np.float32),
    }
    return created.json()["key"]["api_key"], batch


def test_off_policy_losses_and_adamw_hyperparameters_through_the_sync_client(live_server, rl_tenant):
    key, batch = rl_tenant
    with JoyNexusClient(live_server, key) as client:
        args = (batch["images"], batch["state"], batch["action"])
        logp = -client.forward_backward(*args, loss="policy_gradient", advantages=[1.0]).loss
        ratio_two = [logp - LN2]
        fb = client.forward_backward(*args, loss="importance_sampling", advantages=[1.0], sampling_logprobs=ratio_two)
        assert fb.loss == pytest.approx(-2.0, abs=1e-4)
        clipped = client.forward_backward(
            *args, loss="ppo_clip", advantages=[1.0], sampling_logprobs=ratio_two, loss_config={"clip_eps": 0.5}
        )
        assert clipped.loss == pytest.approx(-1.5, abs=1e-4) and clipped.accumulated_microbatches == 3
        step = client.optim_step(lr=1e-3, betas=(0.8, 0.99), weight_decay=0.0, grad_clip=0.5)
        assert (step.lr, step.betas, step.weight_decay, step.grad_clip) == (1e-3, (0.8, 0.99), 0.0, 0.5)
        with pytest.raises(InvalidArgument):
            client.optim_step(lr=0.0)  # refused before sending


def test_off_policy_losses_and_adamw_through_the_async_client(live_server, rl_tenant):
    key, batch = rl_tenant

    async def scenario():
        async with AsyncJoyNexusClient(live_server, key) as client:
            args = (batch["images"], batch["state"], batch["action"])
            logp = -(await client.forward_backward(*args, loss="policy_gradient", advantages=[1.0])).loss
            fb = await client.forward_backward(
                *args, loss="ppo_clip", advantages=[-1.0], sampling_logprobs=[logp - LN2]
            )  # the unclipped term: -(-2)
            return fb, await client.optim_step(lr=2e-3)

    fb, step = asyncio.run(scenario())
    assert fb.loss == pytest.approx(2.0, abs=1e-4) and step.lr == 2e-3 and step.grad_clip == 1.0


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/forward_backward", {"loss": "ppo_clip", "advantages": [1.0]}, "sampling_logprobs"),
        ("/v1/forward_backward", {"loss": "default", "sampling_logprobs": [0.0]}, "sampling_logprobs"),
        ("/v1/forward_backward", {"loss": "ppo_clip", "advantages": [1.0], "sampling_logprobs": [0.0],
                                  "loss_config": {"clip_eps": 1.5}}, "loss_config.clip_eps"),
        ("/v1/forward_backward", {"loss": "importance_sampling", "advantages": [1.0], "sampling_logprobs": [0.0],
                                  "loss_config": {"clip_eps": 0.2}}, "loss_config.clip_eps"),
        ("/v1/forward_backward", {"loss": "ppo_clip", "advantages": [1.0], "sampling_logprobs": [0.0, 1.0]},
         "sampling_logprobs"),
        ("/v1/optim_step", {"lr": 5.0}, "lr"),
        ("/v1/optim_step", {"betas": [1.0, 0.5]}, "betas"),
        ("/v1/optim_step", {"weight_decay": 2}, "weight_decay"),
        ("/v1/optim_step", {"grad_clip": 0}, "grad_clip"),
    ],
)  # fmt: skip
def test_bad_loss_and_optimizer_parameters_answer_422_naming_the_field(api, rl_tenant, path, body, field):
    key, batch = rl_tenant
    headers = {"Authorization": f"Bearer {key}"}
    payload = {**wire(batch), **body} if path.endswith("forward_backward") else body
    for name in ("advantages", "sampling_logprobs"):
        if name in payload:
            payload[name] = wire({name: np.asarray(payload[name], dtype=np.float32)})[name]
    answer = api.client.post(path, json=payload, headers=headers)
    assert answer.status_code == 422, answer.text
    assert any(name.startswith(field) for name in problems(answer)), answer.text


def test_export_after_load_state_is_the_kept_version(api):
    t = api.tenant("lsx")
    train(api, t, 0)
    api.client.post("/v1/save", json={}, headers=t.headers)
    train(api, t, 1)
    api.client.post("/v1/load_state", json={"version": 1}, headers=t.headers)
    exported = api.client.get("/v1/versions/1/export", params={"format": "safetensors"}, headers=t.headers)
    tensors, manifest = decode_tenant_payload(exported.content)
    _, kept, _ = api.cluster.checkpoints.load_tenant(t.tenant_id, 1)
    assert manifest.policy_version == 1 and all(torch.equal(v, kept[k]) for k, v in tensors.items())


def test_load_state_and_fork_from_the_cli(api, live_server):
    from typer.testing import CliRunner

    from joynexus.cli import app

    t = api.tenant("lscli")
    train(api, t, 0)
    api.client.post("/v1/save", json={}, headers=t.headers)
    train(api, t, 1)
    env = {"JOYNEXUS_URL": live_server, "JOYNEXUS_API_KEY": t.api_key}
    rolled = CliRunner().invoke(app, ["load-state", "1"], env=env)
    assert rolled.exit_code == 0 and "training slot at version 1 (was 2)" in rolled.output, rolled.output
    missing = CliRunner().invoke(app, ["load-state", "9"], env=env)
    assert missing.exit_code != 0 and "version" in missing.output
    forked = CliRunner().invoke(app, ["fork", f"{t.tenant_id}-cli", "--version", "1", "--lr", "0.02"], env=env)
    assert forked.exit_code == 0 and "API key (shown once): jnx_" in forked.output, forked.output
    assert api.cluster.master.get_tenant(f"{t.tenant_id}-cli").backend_config.learning_rate == 0.02
