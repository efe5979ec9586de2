"""The Python client against a real uvicorn server: typed results, futures for workloads, sync and
async, retries on transient failures only; and the two examples, end to end."""

from __future__ import annotations

import asyncio
import importlib.util
import pickle
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from joynexus.cli import app as cli_app
from joynexus.client import (
    ApiRequestError,
    AsyncJoyNexusClient,
    ConnectionFailed,
    InvalidArgument,
    InvalidResponse,
    JoyNexusClient,
    JoyNexusError,
    RetryPolicy,
    ServerError,
    SpecFileError,
    WorkloadFailed,
    WorkloadTimeout,
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
        with pytest.raises(WorkloadTimeout) as waited:  # a JoyNexusError and a TimeoutError
            handle.result(timeout=0)
        assert isinstance(waited.value, TimeoutError) and waited.value.code == "workload_timeout"
        handle.cancel()
        with pytest.raises(WorkloadFailed) as caught:
            handle.result(timeout=60)
    assert isinstance(caught.value, JoyNexusError) and caught.value.code.startswith("workload_")
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
        if isinstance(outcome, httpx.Response):
            return outcome
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
    with pytest.raises(ConnectionFailed) as caught:
        client.optim_step()
    assert len(flaky.requests) == 1
    assert caught.value.code == "timeout" and isinstance(caught.value.__cause__, httpx.ReadTimeout)


def test_an_unreachable_server_raises_connection_failed_after_the_retries():
    from tests.api.conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there: a real refused connection
    retry = RetryPolicy(attempts=2, backoff_s=0.001, max_backoff_s=0.002)
    with JoyNexusClient(url, "key", retry=retry) as client:
        with pytest.raises(ConnectionFailed) as caught:
            client.usage()
        with pytest.raises(ConnectionFailed):
            list(client.stream("w-1"))  # never reached: the retry policy, not the reconnect window
    assert caught.value.code == "connection_failed" and caught.value.status_code is None
    assert url in caught.value.message and isinstance(caught.value.__cause__, httpx.ConnectError)

    async def scenario() -> JoyNexusError:
        async with AsyncJoyNexusClient(url, "key", retry=retry) as client:
            try:
                await client.usage()
            except JoyNexusError as error:
                return error
        raise AssertionError("no error")

    assert isinstance(asyncio.run(scenario()), ConnectionFailed)
    copy = pickle.loads(pickle.dumps(caught.value))  # errors cross process boundaries intact
    assert type(copy) is ConnectionFailed and (copy.code, copy.message, str(copy)) == (
        caught.value.code, caught.value.message, str(caught.value))  # fmt: skip


@pytest.mark.parametrize(
    ("status", "cls"), [(404, ApiRequestError), (500, ServerError), (502, ServerError)], ids=["404", "500", "502"]
)
def test_error_answers_that_are_not_json_keep_their_text(status, cls):
    page = httpx.Response(status, text="<html><body><h1>Bad Gateway</h1>\n  nginx</body></html>")
    client, _ = _client([page] * 4)
    with pytest.raises(cls) as caught:
        client.optim_step()
    error = caught.value
    assert error.status_code == status and error.code == "http_error"
    assert error.message == "<html><body><h1>Bad Gateway</h1> nginx</body></html>"
    empty, _ = _client([httpx.Response(status)] * 4)
    with pytest.raises(cls) as caught:
        empty.optim_step()
    assert caught.value.message == httpx.codes.get_reason_phrase(status)


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(200, text="<html>a login page</html>"),
        httpx.Response(200, json={"loss": "not a number"}),
        httpx.Response(200, content=b"\xc1", headers={"content-type": "application/msgpack"}),
    ],
    ids=["html", "wrong-shape", "bad-msgpack"],
)
def test_answers_the_client_cannot_read_raise_invalid_response(answer):
    client, _ = _client([answer])
    with pytest.raises(InvalidResponse) as caught:
        client.optim_step()
    assert caught.value.code == "invalid_response" and "/v1/optim_step" in caught.value.message


def test_a_stream_event_that_is_not_json_raises_invalid_response():
    stream = httpx.Response(
        200, text="event: message\ndata: not json\n\n", headers={"content-type": "text/event-stream"}
    )
    client, _ = _client([stream])
    with pytest.raises(InvalidResponse):
        list(client.stream("w-1"))


def test_bad_arguments_are_refused_before_anything_is_sent(tmp_path):
    client, flaky = _client([])
    with pytest.raises(InvalidArgument) as caught:
        client.submit(jobs=0)
    assert caught.value.problems[0].field == "jobs" and isinstance(caught.value, ValueError)
    with pytest.raises(InvalidArgument) as caught:
        client.train_batch([[[[[0.5]]]]], [[1.0, 2.0], [3.0]], [[[0.0]]])  # ragged state
    assert caught.value.problems[0].field == "state" and "rectangular" in caught.value.problems[0].reason
    with pytest.raises(InvalidArgument) as caught:
        client.train_batch([[[[["x"]]]]], [[1.0]], [[[0.0]]])
    assert caught.value.problems[0].field == "images"
    with pytest.raises(InvalidArgument) as caught:
        client.train_batch([[[[[300]]]]], [[1.0]], [[[0.0]]])  # integer images are uint8
    assert caught.value.problems[0].field == "images" and "[0, 255]" in caught.value.problems[0].reason
    with pytest.raises(InvalidArgument) as caught:
        client.queue_put("p", {"reward": [1.0, 2.0]})
    assert caught.value.problems[0].field == "columns.reward"
    with pytest.raises(InvalidArgument) as caught:
        client.create_tenant({"tenant": "t", "dataset": {"root": Path("/data")}})  # msgpack cannot carry a Path
    assert caught.value.problems[0].field == "body"
    broken = tmp_path / "spec.yaml"
    broken.write_text("tenant: a\n  task: sft\n")
    with pytest.raises(SpecFileError) as caught:
        client.submit(broken)
    assert (caught.value.line, caught.value.column) == (2, 7) and caught.value.message.startswith(f"{broken}:2:7: ")
    with pytest.raises(SpecFileError, match="cannot be read"):
        client.create_tenant(tmp_path / "missing.yaml")
    with pytest.raises(InvalidArgument) as caught:
        JoyNexusClient("127.0.0.1:8765", "key")  # no scheme
    assert caught.value.problems[0].field == "base_url"
    assert flaky.requests == []


def test_plain_lists_are_sent_with_the_dtype_each_field_expects(api, live_server):
    t = api.tenant("client-lists")
    batch = t.batch(3)
    with JoyNexusClient(live_server, t.api_key) as client:
        step = client.train_batch(batch["images"].tolist(), batch["state"].tolist(), batch["action"].tolist(),
                                  action_is_pad=[[0, 0], [0, 1], [0, 0]])  # fmt: skip
        assert step.version == 1 and step.samples == 3
        client.load_weights()
        arrays = client.predict(batch["images"], batch["state"]).actions.to_numpy()
        lists = client.predict(batch["images"].tolist(), batch["state"].tolist()).actions.to_numpy()
        np.testing.assert_array_equal(lists, arrays)
        # Integer images are uint8 in [0, 255]: the server scales them as it scales a uint8 array.
        pixels = np.random.default_rng(0).integers(0, 256, size=batch["images"].shape)
        as_uint8 = client.predict(pixels.astype(np.uint8), batch["state"]).actions.to_numpy()
        as_list = client.predict(pixels.tolist(), batch["state"]).actions.to_numpy()
        np.testing.assert_array_equal(as_list, as_uint8)


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
    # `workload eval --watch` counts episodes (not `0/? jobs`) with the running success rate
    env = {"JOYNEXUS_URL": live_server, "JOYNEXUS_API_KEY": created.json()["key"]["api_key"], "COLUMNS": "200"}
    watched = CliRunner().invoke(cli_app, ["workload", "eval", "--episodes", "2", "--watch"], env=env)
    assert watched.exit_code == 0, watched.output
    assert "2/2 episodes" in watched.output and "success" in watched.output and "jobs" not in watched.output


def test_the_client_pages_through_versions(api, live_server, monkeypatch):
    import joynexus.client.calls as client_module

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
