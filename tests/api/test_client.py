"""The Python client against a real uvicorn server: typed results, futures for workloads, sync and
async, retries on transient failures only; and the two examples, end to end."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from joynexus.client import (
    ApiRequestError,
    AsyncJoyNexusClient,
    JoyNexusClient,
    RetryPolicy,
    ServerError,
    WorkloadFailed,
)
from joynexus.protocol import schemas as s
from tests.api.conftest import ADMIN_KEY

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_sync_client_lower_and_upper_layer(api, live_server):
    t = api.tenant("client")
    with JoyNexusClient(live_server, t.api_key) as client:
        info = client.tenant()
        assert isinstance(info, s.TenantInfo) and info.cameras == ["front", "wrist"]
        batch = t.batch(4)
        step = client.train_batch(batch["images"], batch["state"], batch["action"])
        assert isinstance(step, s.TrainStepResult) and step.version == 1
        fb = client.forward_backward(batch["images"], batch["state"], batch["action"])
        assert fb.accumulated_microbatches == 1
        assert client.optim_step().version == 2
        assert client.load_weights().serving_versions == [2]
        prediction = client.predict(batch["images"], batch["state"])
        assert prediction.actions.to_numpy().shape == (4, 2, 3) and prediction.policy_version == 2

        handle = client.submit(jobs=1)
        assert handle.progress().workload_id == handle.workload_id
        kinds = [event.kind for event in handle.events()]
        assert kinds[0] == "queued" and "job_completed" in kinds
        final = handle.result(timeout=60)
        assert final.state == "completed" and final.version == 3  # +1 per completed job

        payload = client.export(final.version)
        from joynexus.artifacts import decode_tenant_payload

        assert decode_tenant_payload(payload)[1].policy_version == 3
        assert client.usage().samples_trained == 4 + 4 + 16
        with pytest.raises(ApiRequestError) as caught:
            client.train_batch(batch["images"][:, :1], batch["state"], batch["action"])
        assert caught.value.status_code == 422 and caught.value.problems[0].field == "images.shape"


def test_a_cancelled_workload_raises_from_result(api, live_server):
    t = api.tenant("client-cancel", jobs=50)
    with JoyNexusClient(live_server, t.api_key, wire="json") as client:
        handle = client.submit(jobs=50)
        handle.cancel()
        with pytest.raises(WorkloadFailed) as caught:
            handle.result(timeout=60)
    # "failed" too: the WorkloadManager can record a producer's error racing the cancel (reported)
    assert caught.value.status.state in ("cancelled", "failed")


def test_async_client_runs_calls_concurrently(api, live_server):
    t = api.tenant("client-async", "flow")

    async def scenario():
        async with AsyncJoyNexusClient(live_server, t.api_key) as client:
            batch = t.batch(2)
            await client.train_batch(batch["images"], batch["state"], batch["action"])
            await client.load_weights()
            results = await asyncio.gather(
                *[client.predict(batch["images"], batch["state"], seeds=[i, i + 1]) for i in range(8)]
            )
            handle = await client.submit(jobs=1)
            kinds = [event.kind async for event in handle.events()]
            return results, await handle.result(timeout=60), kinds

    results, final, kinds = asyncio.run(scenario())
    assert all(r.actions.to_numpy().shape == (2, 4, 5) for r in results)
    assert final.state == "completed" and "job_completed" in kinds


class _Flaky:
    """An httpx transport answering from a script, recording what it was sent."""

    def __init__(self, script):
        self.script, self.requests = list(script), []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        outcome = self.script.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        status, body = outcome
        return httpx.Response(status, json=body)


def _client(script, **kwargs):
    flaky = _Flaky(script)
    http = httpx.Client(base_url="http://test", transport=httpx.MockTransport(flaky))
    retry = RetryPolicy(attempts=4, backoff_s=0.001, max_backoff_s=0.002)
    return JoyNexusClient("http://test", "key", http=http, retry=retry, **kwargs), flaky


OK = {"loss": 0.5, "grad_norm": 1.0, "microbatches": 1, "samples": 2, "optimizer_steps": 1, "version": 1,
      "device_seconds": 0.1}  # fmt: skip
ERROR = {"code": "x", "message": "m", "problems": []}


def test_transient_failures_are_retried_with_the_same_idempotency_key():
    client, flaky = _client([(503, ERROR), httpx.ConnectError("refused"), (502, ERROR), (200, OK)])
    assert client.optim_step().version == 1
    assert len(flaky.requests) == 4
    assert len({r.headers["idempotency-key"] for r in flaky.requests}) == 1


@pytest.mark.parametrize("status", [400, 401, 404, 409, 422, 429])
def test_client_errors_are_never_retried(status):
    client, flaky = _client([(status, ERROR), (200, OK)])
    with pytest.raises(ApiRequestError) as caught:
        client.optim_step()
    assert caught.value.status_code == status and len(flaky.requests) == 1


def test_a_500_is_not_retried_and_a_persistent_503_gives_up():
    client, flaky = _client([(500, ERROR)])
    with pytest.raises(ServerError):
        client.optim_step()
    assert len(flaky.requests) == 1
    client, flaky = _client([(503, ERROR)] * 4)
    with pytest.raises(ServerError):
        client.optim_step()
    assert len(flaky.requests) == 4


def test_read_timeouts_are_not_retried():
    client, flaky = _client([httpx.ReadTimeout("slow"), (200, OK)])
    with pytest.raises(httpx.ReadTimeout):
        client.optim_step()
    assert len(flaky.requests) == 1


def test_example_sft_upper_layer(api, live_server):
    example = load_example("sft_upper_layer")
    root = example.write_demo_dataset(api.data_dir / "example-sft")
    spec = example.demo_spec("example-sft", root, jobs=2)
    lines: list[str] = []
    out = example.run(live_server, jobs=2, admin_key=ADMIN_KEY, spec=spec, log=lines.append)
    assert out["workload"].state == "completed" and out["actions"].shape == (2, 2, 3)
    assert out["usage"].device_seconds.training > 0 and any("job 2/2" in line for line in lines)


def test_example_custom_reinforce(api, live_server):
    example = load_example("custom_reinforce")
    created = api.client.post("/v1/admin/tenants", json=example.pusht_rl_spec("example-rl"), headers=api.admin)
    assert created.status_code == 201, created.text
    key = created.json()["key"]["api_key"]
    out = example.run(live_server, key, iterations=2, episodes=2, horizon=8, microbatch=6, log=lambda _: None)
    assert [h["version"] for h in out["history"]] == [1, 2]
    assert all(h["samples"] == 16 and np.isfinite(h["mean_return"]) for h in out["history"])
    # The Environment Service meters steps itself and writes them within a second (batched).
    with JoyNexusClient(live_server, key) as client:
        deadline = time.monotonic() + 10
        while client.usage().env_steps < 32 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.usage().env_steps == 32


def test_an_evaluation_workload_of_an_rl_tenant(api, live_server):
    example = load_example("custom_reinforce")
    spec = example.pusht_rl_spec("eval-rl")
    spec["environment"]["max_episode_steps"] = 8
    created = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    with JoyNexusClient(live_server, created.json()["key"]["api_key"]) as client:
        info = client.tenant()
        assert info.stochastic and info.environment["simulator"] == "pusht"
        final = client.evaluate(episodes=2).result(timeout=120)
        assert final.task == "eval" and final.result["episodes"] == 2 and "success_rate" in final.result
        assert client.versions().training_version == 0  # evaluation never trains


def test_the_client_pages_through_versions(api, live_server, monkeypatch):
    import joynexus.client as client_module

    t = api.tenant("client-pages")
    with JoyNexusClient(live_server, t.api_key) as client:
        for _ in range(3):  # checkpoints of versions 0..3
            client.save(include_optim=False)
            batch = t.batch(2)
            client.train_batch(batch["images"], batch["state"], batch["action"])
        client.save(include_optim=False)
        page = client.versions(limit=3)
        assert [c.version for c in page.checkpoints] == [0, 1, 2] and page.next_after == 2
        rest = client.versions(after=page.next_after, limit=3)
        assert [c.version for c in rest.checkpoints] == [3] and rest.next_after is None
        monkeypatch.setattr(client_module, "VERSIONS_PAGE", 3)  # without a limit: every page, merged
        merged = client.versions()
        assert [c.version for c in merged.checkpoints] == [0, 1, 2, 3] and merged.next_after is None
        assert merged.training_version == 3 and [c.version for c in client.versions(after=1).checkpoints] == [2, 3]

    async def scenario() -> list[int]:
        async with AsyncJoyNexusClient(live_server, t.api_key) as client:
            return [c.version for c in (await client.versions()).checkpoints]

    assert asyncio.run(scenario()) == [0, 1, 2, 3]
