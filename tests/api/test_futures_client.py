"""Issue 28 through the Python clients against a real uvicorn server: `*_async` futures (sync and
asyncio), `sample`, `compute_logprobs`, a failed future raising the blocking call's error; and the
pipelined-loop example end to end."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from joynexus.client import ApiRequestError, AsyncJoyNexusClient, CallFuture, FutureTimeout, JoyNexusClient
from tests.api.test_client import load_example


@pytest.fixture(scope="module")
def rl_keys(api):
    example = load_example("pipelined_loop")
    keys = []
    for name in ("fc-a", "fc-b", "fc-c"):
        created = api.client.post("/v1/admin/tenants", json=example.rl_spec(name), headers=api.admin)
        assert created.status_code == 201, created.text
        keys.append(created.json()["key"]["api_key"])
    return keys


def obs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, 3, 32, 32), dtype=np.float32), rng.uniform(-1, 1, (n, 2)).astype(np.float32)


def test_sync_client_futures_sampling_and_errors(api, live_server, rl_keys):
    images, state = obs(2)
    action = np.zeros((2, 2, 2), np.float32)
    with JoyNexusClient(live_server, rl_keys[0]) as client:
        drawn = client.sample(images, state, n=3, seed=5)
        assert drawn.actions.to_numpy().shape == (2, 3, 2, 2) and drawn.log_probs.to_numpy().shape == (2, 3)
        again = client.sample_async(images, state, n=3, seed=5)
        assert isinstance(again, CallFuture)
        np.testing.assert_array_equal(again.result(timeout=60).actions.to_numpy(), drawn.actions.to_numpy())
        scored = client.compute_logprobs(images, state, action)
        fbs = [client.forward_backward_async(images, state, action) for _ in range(2)]
        step = client.optim_step_async()
        lp = client.compute_logprobs_async(images, state, action)  # after the step: the new version
        assert step.result(timeout=60).microbatches == 2 and step.result().version == 1
        assert [f.result(timeout=60).accumulated_microbatches for f in fbs] == [1, 2] and fbs[0].done()
        assert lp.result(timeout=60).version == 1 and scored.version == 0
        assert not np.allclose(lp.result().log_probs.to_numpy(), scored.log_probs.to_numpy())
        client.load_weights()
        predicted = client.predict_async(images, state, seeds=[1, 2], sample=True).result(timeout=60)
        assert predicted.policy_version == 1 and predicted.log_probs is not None
        failed = client.optim_step_async()  # nothing pending: the blocking call's 409, raised by result()
        with pytest.raises(ApiRequestError) as raised:
            failed.result(timeout=60)
        assert raised.value.status_code == 409 and "forward_backward first" in raised.value.message
        deterministic = JoyNexusClient(live_server, api.tenant("fc-det").api_key)
        with pytest.raises(ApiRequestError) as refused:
            deterministic.sample(np.zeros((1, 2, 3, 32, 32)), np.zeros((1, 4)))
        assert refused.value.status_code == 422 and "'oft_mlp' (stochastic=False)" in refused.value.message
        slow = client.forward_backward_async(*obs(64, 1), np.zeros((64, 2, 2), np.float32))
        with pytest.raises(FutureTimeout):
            slow.result(timeout=0.0)
        slow.result(timeout=60)


def test_async_client_futures(live_server, rl_keys):
    images, state = obs(2)
    action = np.zeros((2, 2, 2), np.float32)

    async def scenario() -> tuple[int, int, tuple[int, ...]]:
        async with AsyncJoyNexusClient(live_server, rl_keys[1]) as client:
            fb = await client.forward_backward_async(images, state, action)
            step = await client.optim_step_async()
            drawn = await (await client.sample_async(images, state, n=2, seed=1)).result(timeout=60)
            scored = await client.compute_logprobs(images, state, action)
            done = await step.result(timeout=60)
            return (await fb.result(timeout=60)).accumulated_microbatches, done.version, (
                drawn.version,
                scored.version,
            )

    assert asyncio.run(scenario()) == (1, 1, (1, 1))


def test_example_pipelined_loop(api, live_server, rl_keys):
    example = load_example("pipelined_loop")
    lines: list[str] = []
    out = example.run(live_server, (rl_keys[2], rl_keys[2]), iterations=3, batch=2, n=2, client_work_ms=5,
                      log=lines.append)  # fmt: skip
    # Both loops stepped (the second continues the first's tenant: versions 1..3 then 4..6).
    assert [h["version"] for h in out["blocking"]["history"]] == [1, 2, 3]
    assert [h["version"] for h in out["pipelined"]["history"]] == [4, 5, 6]
    assert all(h["ratio_mean"] == pytest.approx(1.0, abs=1e-4) for h in out["blocking"]["history"])
    assert out["ratio"] > 0 and any("pipelined / blocking" in line for line in lines)
