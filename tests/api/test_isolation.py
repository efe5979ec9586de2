"""Tenant isolation: another tenant's ids answer exactly like missing ones (404, never 403), and two
tenants hammering the API at once get the results they get alone."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from joynexus.actors import handle_of
from joynexus.client import AsyncJoyNexusClient
from tests.api.conftest import wire


def test_another_tenants_ids_look_exactly_like_missing_ones(api):
    owner, intruder = api.tenant("owner"), api.tenant("intruder")
    c = api.client
    workload = c.post("/v1/workloads", json={"jobs": 1}, headers=owner.headers).json()["workload_id"]
    with c.stream("GET", f"/v1/workloads/{workload}/stream", headers=owner.headers) as stream:
        list(stream.iter_lines())  # until the workload ends
    c.post("/v1/train_batch", json=wire(owner.batch(2)), headers=owner.headers)
    c.post("/v1/save", json={}, headers=owner.headers)
    owned_versions = [str(x["version"]) for x in c.get("/v1/versions", headers=owner.headers).json()["checkpoints"]]
    assert owned_versions == ["1", "2"]  # the workload's checkpoint, then the saved train_batch step
    c.post("/v1/queue/partitions/secret", json={"columns": wire({"x": np.ones(2, np.float32)})}, headers=owner.headers)

    def same_as_missing(method: str, path: str, real: str, fake: str, **kwargs) -> None:
        theirs = c.request(method, path.format(real), headers=intruder.headers, **kwargs)
        missing = c.request(method, path.format(fake), headers=intruder.headers, **kwargs)
        assert theirs.status_code == missing.status_code == 404, (path, theirs.text)
        assert theirs.json() == {k: _swap(v, fake, real) for k, v in missing.json().items()}, path

    for method, path in [
        ("GET", "/v1/workloads/{}"),
        ("GET", "/v1/workloads/{}/events"),
        ("GET", "/v1/workloads/{}/stream"),
        ("POST", "/v1/workloads/{}/cancel"),
    ]:
        same_as_missing(method, path, workload, "wl-ffffffffffff")
    for method, path in [("GET", "/v1/checkpoints/{}/manifest"), ("GET", "/v1/versions/{}/export")]:
        for version in owned_versions:
            same_as_missing(method, path, version, "999")
    for method, path, kwargs in [
        ("GET", "/v1/queue/partitions/{}", {}),
        ("DELETE", "/v1/queue/partitions/{}", {}),
        ("POST", "/v1/queue/partitions/{}/get", {"json": {"fields": ["x"], "batch_size": 1}}),
    ]:
        same_as_missing(method, path, "secret", "nothing-here", **kwargs)
    # nothing of the owner's shows up in the intruder's listings, and the owner's things are intact
    assert c.get("/v1/workloads", headers=intruder.headers).json() == []
    assert c.get("/v1/queue/partitions", headers=intruder.headers).json() == []
    assert c.get("/v1/versions", headers=intruder.headers).json()["checkpoints"] == []
    assert c.get(f"/v1/workloads/{workload}", headers=owner.headers).status_code == 200
    assert c.get("/v1/queue/partitions/secret", headers=owner.headers).json()["num_samples"] == 2
    # the same partition NAME is a different partition per tenant
    mine = {"columns": wire({"y": np.zeros(5, np.float32)})}
    c.post("/v1/queue/partitions/secret", json=mine, headers=intruder.headers)
    assert c.get("/v1/queue/partitions/secret", headers=owner.headers).json()["fields"] == ["x"]
    assert c.get("/v1/queue/partitions/secret", headers=intruder.headers).json()["num_samples"] == 5


def _swap(value, fake, real):
    if isinstance(value, str):
        return value.replace(fake, real)
    if isinstance(value, list):
        return [_swap(v, fake, real) for v in value]
    if isinstance(value, dict):
        return {k: _swap(v, fake, real) for k, v in value.items()}
    return value


async def _session(client: AsyncJoyNexusClient, tenant, rounds: int, predict_fanout: int) -> dict:
    """A fixed sequence of lower-layer calls; returns everything it observed."""
    losses = []
    for r in range(rounds):
        batch = tenant.batch(4, seed=r)
        losses.append((await client.train_batch(batch["images"], batch["state"], batch["action"])).loss)
        other = tenant.batch(4, seed=100 + r)
        await client.forward_backward(other["images"], other["state"], other["action"])
        losses.append((await client.optim_step()).loss)
        await client.queue_put("work", {"round": np.full(2, r, np.int64)})
    await client.load_weights()
    obs = tenant.batch(3, seed=999)
    predictions = await asyncio.gather(
        *[client.predict(obs["images"], obs["state"], seeds=[7, 8, 9], timeout_s=60) for _ in range(predict_fanout)]
    )
    rows = await client.queue_get("work", ["round"], 100)
    return {
        "losses": losses,
        "actions": [p.actions.to_numpy() for p in predictions],
        "batch_samples": [p.batch_samples for p in predictions],
        "queue": rows.columns["round"].to_numpy().tolist(),
        "version": (await client.versions()).training_version,
    }


def test_two_tenants_hammering_at_once_get_what_they_get_alone(api, live_server, monkeypatch):
    # a wider batching window than the 5 ms default, so concurrent predicts surely share batches
    monkeypatch.setattr(handle_of(api.cluster.inference).target, "max_wait_s", 0.05)
    solo = {"arm": api.tenant("solo", "arm"), "flow": api.tenant("solo", "flow")}
    pair = {"arm": api.tenant("pair", "arm"), "flow": api.tenant("pair", "flow")}

    async def run(tenants: dict, concurrently: bool) -> dict:
        clients = {k: AsyncJoyNexusClient(live_server, t.api_key) for k, t in tenants.items()}
        try:
            if concurrently:
                results = await asyncio.gather(*[_session(clients[k], tenants[k], 3, 6) for k in tenants])
                return dict(zip(tenants, results, strict=True))
            return {k: await _session(clients[k], tenants[k], 3, 6) for k in tenants}
        finally:
            for client in clients.values():
                await client.aclose()

    alone = asyncio.run(run(solo, concurrently=False))
    together = asyncio.run(run(pair, concurrently=True))
    service = api.cluster.training.target
    for kind in ("arm", "flow"):
        assert together[kind]["losses"] == alone[kind]["losses"], kind  # bit for bit
        assert together[kind]["queue"] == alone[kind]["queue"] == [0, 0, 1, 1, 2, 2]
        assert together[kind]["version"] == alone[kind]["version"] == 6
        mine, reference = (service.tenant_state(t[kind].tenant_id)["module"] for t in (pair, solo))
        assert all(torch.equal(v, reference[k]) for k, v in mine.items()), kind
        for actions in together[kind]["actions"]:
            np.testing.assert_allclose(actions, alone[kind]["actions"][0], rtol=1e-4, atol=1e-5)
    # the concurrent predictions shared backbone batches across requests (and tenants)
    assert max(together["arm"]["batch_samples"] + together["flow"]["batch_samples"]) > 3
