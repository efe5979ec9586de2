"""Per-tenant rate limits and priority classes of the lower layer (issue 28.6): token buckets of
requests/s and samples/s per tenant (service defaults, per-tenant overrides), 429 `rate_limited`
with Retry-After naming the setting, an in-flight bound, refusals counted in GET /v1/usage, the
Python client's `RateLimited` (with `retry_after`, optionally retried), error frames on the robot
stream, and training calls admitted by tenant priority (spec `scheduling.priority`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from joynexus.api.priority_gate import PriorityGate
from joynexus.api.rate_limits import RATE_LIMITS_ENV, RateLimitSettings, TenantCallLimiter, TenantRateLimits
from joynexus.client import JoyNexusClient, RateLimited, RetryPolicy
from joynexus.protocol.wire import msgpack_loads
from tests.api.conftest import ADMIN_KEY, wire
from tests.api.test_streaming import obs_frame, serving_tenant


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_buckets_refuse_over_the_rate_say_when_and_charge_nothing_for_a_refusal():
    clock = Clock()
    settings = RateLimitSettings(
        default=TenantRateLimits(requests_per_s=2, samples_per_s=10, burst_s=1),
        tenants={"big": TenantRateLimits(samples_per_s=100)},  # overrides only what it names
    )
    limiter = TenantCallLimiter(settings, clock=clock)
    limiter.admit("a", samples=4)
    limiter.admit("a", samples=4)
    with pytest.raises(Exception) as refused:
        limiter.admit("a", samples=1)  # a third request within the second
    error = refused.value
    assert error.status_code == 429 and error.code == "rate_limited" and error.headers == {"Retry-After": "1"}
    assert error.problems[0][0] == "rate_limits.requests_per_s" and "2 requests/s" in error.message
    clock.now += 0.5
    with pytest.raises(Exception) as refused:
        limiter.admit("a", samples=8)  # one request token is back, but only 2 + 5 samples of 8
    assert refused.value.problems[0][0] == "rate_limits.samples_per_s"
    limiter.admit("a", samples=2)  # the refusal above took nothing from either bucket
    assert limiter.throttled("a").model_dump() == {
        "requests_per_s": 1, "samples_per_s": 1, "max_in_flight": 0, "streams": 0
    }  # fmt: skip
    assert settings.for_tenant("big") == TenantRateLimits(requests_per_s=2, samples_per_s=100, burst_s=1)
    limiter.admit("big", samples=90)  # its own bucket; "a" being throttled changes nothing for it
    assert limiter.throttled("big").samples_per_s == 0
    off = TenantCallLimiter(RateLimitSettings(enabled=False, default=TenantRateLimits(requests_per_s=1)), clock=clock)
    for _ in range(10):
        off.admit("a", samples=10_000)


def test_a_call_sent_again_before_its_retry_after_is_refused_on_its_route_only_and_counted():
    clock = Clock()
    limiter = TenantCallLimiter(RateLimitSettings(default=TenantRateLimits(samples_per_s=4, burst_s=2)), clock=clock)
    limiter.admit("a", samples=8, route="/v1/predict")  # the bucket (8) drained
    with pytest.raises(Exception) as refused:
        limiter.admit("a", samples=2, route="/v1/predict")  # 2 samples need 0.5 s more
    assert refused.value.problems[0][0] == "rate_limits.samples_per_s"
    clock.now += 0.25
    with pytest.raises(Exception) as again:
        limiter.refuse_unread("a", "/v1/predict")
    assert again.value.status_code == 429 and again.value.problems[0][0] == "rate_limits.samples_per_s"
    limiter.refuse_unread("a", "/v1/train_batch")  # another route: its own checks decide
    limiter.refuse_unread("b", "/v1/predict")  # another tenant: untouched
    clock.now += 0.25  # the wait it was told has passed
    limiter.refuse_unread("a", "/v1/predict")
    limiter.admit("a", samples=2, route="/v1/predict")
    assert limiter.throttled("a").samples_per_s == 2 and limiter.throttled("b").samples_per_s == 0
    with pytest.raises(Exception) as refused:  # noqa: B017 (ApiError, as above)
        limiter.admit("a", samples=2)  # refused without a route: nothing is remembered
    limiter.refuse_unread("a", "/v1/predict")


def test_a_tenant_told_to_wait_is_refused_before_its_body_is_read(api):
    """A body is parsed and its tensors decoded on the server's event loop, where every tenant's
    calls wait: a call that would be refused again is answered before it is read (a malformed body
    gets 429, not 422), on the refused route only, and once the wait passes the body is read."""
    hasty, other = api.tenant("rl-hasty"), api.tenant("rl-calm")
    limits = RateLimitSettings(tenants={hasty.tenant_id: TenantRateLimits(samples_per_s=4, burst_s=2)})
    with app_client(api, rate_limits=limits) as (app, http):
        batch = wire(hasty.batch(8))
        assert http.post("/v1/train_batch", json=batch, headers=hasty.headers).status_code == 200  # drained
        refused = http.post("/v1/train_batch", json=wire(hasty.batch(2)), headers=hasty.headers)
        assert refused.status_code == 429, refused.text
        malformed = {**hasty.headers, "content-type": "application/json"}
        unread = http.post("/v1/train_batch", content=b"{not json", headers=malformed)
        assert unread.status_code == 429 and unread.json()["code"] == "rate_limited", unread.text
        assert int(unread.headers["retry-after"]) >= 1
        assert http.post("/v1/forward_backward", content=b"{not json", headers=malformed).status_code == 422  # read
        other_malformed = {**other.headers, "content-type": "application/json"}
        assert http.post("/v1/train_batch", content=b"{not json", headers=other_malformed).status_code == 422
        time.sleep(0.6)  # the wait it was told (0.5 s) has passed: read, and found malformed
        assert http.post("/v1/train_batch", content=b"{not json", headers=malformed).status_code == 422
        assert app.state.limiter.throttled(hasty.tenant_id).samples_per_s == 2


def test_rate_limits_from_the_environment_name_the_variable_on_a_bad_value(monkeypatch):
    monkeypatch.setenv(RATE_LIMITS_ENV, '{"default": {"requests_per_s": 50}, "tenants": {"t": {"max_in_flight": 4}}}')
    settings = RateLimitSettings.from_env()
    assert settings.for_tenant("t").max_in_flight == 4 and settings.for_tenant("t").requests_per_s == 50
    monkeypatch.setenv(RATE_LIMITS_ENV, '{"default": {"requests_per_s": -1}}')
    with pytest.raises(ValueError, match=RATE_LIMITS_ENV):
        RateLimitSettings.from_env()


def test_the_priority_gate_lets_the_highest_priority_waiter_in_first():
    gate = PriorityGate(1)
    release, entered = threading.Event(), []
    holder = threading.Thread(target=gate.call, args=(0, release.wait))
    holder.start()
    while gate._inside == 0:
        time.sleep(0.01)
    waiters = []
    for name, priority in (("low-1", -5), ("low-2", -5), ("high", 10), ("mid", 0)):
        waiters.append(threading.Thread(target=gate.call, args=(priority, entered.append, name)))
        waiters[-1].start()
        while gate.waiting() < len(waiters):
            time.sleep(0.01)
    release.set()
    for thread in (holder, *waiters):
        thread.join(10)
    assert entered == ["high", "mid", "low-1", "low-2"]  # by priority, first come first served within one


@contextlib.contextmanager
def app_client(api, **settings) -> Iterator[tuple[object, object]]:
    """A second app over the session's services with these ApiSettings, under a TestClient."""
    from fastapi.testclient import TestClient

    from joynexus.api.app import ApiSettings, create_app

    app = create_app(api.cluster, ApiSettings(**settings), admin_key=ADMIN_KEY)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield app, client


def test_over_its_rate_a_tenant_gets_429_with_retry_after_and_others_are_not_touched(api):
    slow, other = api.tenant("rl-slow"), api.tenant("rl-other")
    limits = RateLimitSettings(tenants={slow.tenant_id: TenantRateLimits(requests_per_s=1, samples_per_s=4, burst_s=2)})
    with app_client(api, rate_limits=limits) as (_app, http):
        assert [http.get("/v1/queue/partitions", headers=slow.headers).status_code for _ in range(2)] == [200, 200]
        refused = http.get("/v1/queue/partitions", headers=slow.headers)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        body = refused.json()
        assert body["code"] == "rate_limited" and body["problems"][0]["field"] == "rate_limits.requests_per_s"
        for _ in range(5):  # the service default for everyone else
            assert http.get("/v1/queue/partitions", headers=other.headers).status_code == 200

        # the Python client: a typed error carrying retry_after; with retries on, it waits and succeeds
        client = JoyNexusClient("http://testserver", slow.api_key, http=http)
        with pytest.raises(RateLimited) as error:
            client.queue_partitions()
        assert error.value.status_code == 429 and error.value.retry_after >= 1
        retry = RetryPolicy(retry_rate_limited=True)
        patient = JoyNexusClient("http://testserver", slow.api_key, http=http, retry=retry)
        started = time.monotonic()
        assert patient.queue_partitions() == []
        assert time.monotonic() - started >= 0.5  # it waited for the bucket

        # samples/s: 4 samples per second, 8 in the bucket; a train_batch of 8 drains it
        batch = slow.batch(8)
        time.sleep(2.0)  # both buckets full again
        assert client.train_batch(batch["images"], batch["state"], batch["action"]).samples == 8
        with pytest.raises(RateLimited) as error:
            client.train_batch(batch["images"][:2], batch["state"][:2], batch["action"][:2])
        assert error.value.code == "rate_limited" and error.value.problems[0].field == "rate_limits.samples_per_s"

        throttled = client.usage().throttled
        # counted as refused: the raw call, the client's, the patient client's first try; the batch
        assert (throttled.requests_per_s, throttled.samples_per_s) == (3, 1)
        assert JoyNexusClient("http://testserver", other.api_key, http=http).usage().throttled.requests_per_s == 0


def test_the_robot_stream_answers_an_observation_over_the_rate_with_an_error_frame(api):
    robot = serving_tenant(api, "rl-robot")
    limits = RateLimitSettings(tenants={robot.tenant_id: TenantRateLimits(requests_per_s=1, burst_s=1)})
    with app_client(api, rate_limits=limits) as (app, http):
        with http.websocket_connect("/v1/stream", headers=robot.headers) as ws:
            assert msgpack_loads(ws.receive_bytes())["type"] == "ready"
            ws.send_bytes(obs_frame(0, robot.batch(1)))
            assert msgpack_loads(ws.receive_bytes())["type"] == "actions"
            ws.send_bytes(obs_frame(1, robot.batch(1)))
            frame = msgpack_loads(ws.receive_bytes())
            assert frame["type"] == "error" and frame["code"] == "rate_limited" and frame["seq"] == 1
            assert frame["retry_after_s"] >= 1 and frame["problems"][0]["field"] == "rate_limits.requests_per_s"
        assert app.state.limiter.throttled(robot.tenant_id).requests_per_s == 1


def _tenant_with_priority(api, prefix: str, priority: int):
    spec = api.spec(prefix)
    spec["scheduling"]["priority"] = priority
    created = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert created.status_code == 201, created.text
    return {"Authorization": f"Bearer {created.json()['key']['api_key']}"}, spec


def test_training_calls_wait_for_the_training_service_by_tenant_priority_within_the_in_flight_bound(api):
    low, spec = _tenant_with_priority(api, "prio-low", -10)
    high, _ = _tenant_with_priority(api, "prio-high", 50)
    limits = RateLimitSettings(tenants={spec["tenant"]: TenantRateLimits(max_in_flight=2)})
    from tests.api.conftest import sample_batch

    batch = wire(sample_batch(spec, 2, 0))
    with app_client(api, rate_limits=limits, training_call_slots=1) as (app, http):
        gate: PriorityGate = app.state.training_gate
        release = threading.Event()
        holder = threading.Thread(target=gate.call, args=(100, release.wait))  # a call already inside
        holder.start()
        finished: list[str] = []

        def step(name: str, headers: dict) -> None:
            response = http.post("/v1/train_batch", json=batch, headers=headers)
            assert response.status_code == 200, response.text
            finished.append(name)

        callers = []
        for name, headers in (("low-1", low), ("low-2", low), ("high", high)):
            callers.append(threading.Thread(target=step, args=(name, headers)))
            callers[-1].start()
            deadline = time.monotonic() + 30
            while gate.waiting() < len(callers):
                assert time.monotonic() < deadline, "the call did not reach the gate"
                time.sleep(0.02)
        over = http.post("/v1/train_batch", json=batch, headers=low)  # a third of its calls at once
        release.set()
        for thread in (holder, *callers):
            thread.join(60)
    assert over.status_code == 429 and over.json()["code"] == "too_many_in_flight"
    assert over.json()["problems"][0]["field"] == "rate_limits.max_in_flight" and over.headers["retry-after"]
    assert finished == ["high", "low-1", "low-2"]  # the later high-priority call went first


def test_futures_and_sampling_pay_the_same_samples_per_s_bucket_as_the_blocking_calls(api):
    """Issue 41.2: eight futures of 4,096 samples were all accepted where blocking calls of that size
    were refused after two. Every route doing the same work pays the same bucket: a future when it
    is submitted, a sample its observations x n chunks."""
    from tests.api.test_sampling_and_futures import observations, stochastic_tenant

    sft, rl = api.tenant("rl-fut"), stochastic_tenant(api, "rl-samp")
    small = TenantRateLimits(samples_per_s=4, burst_s=2)  # 8 samples in the bucket, 4 back per second
    limits = RateLimitSettings(tenants={sft.tenant_id: small, rl.tenant_id: small})
    with app_client(api, rate_limits=limits) as (app, http):
        batch = wire(sft.batch(8))
        assert http.post("/v1/futures/forward_backward", json=batch, headers=sft.headers).status_code == 202
        for route in ("/v1/futures/forward_backward", "/v1/forward_backward", "/v1/futures/compute_logprobs"):
            refused = http.post(route, json=wire(sft.batch(2)), headers=sft.headers)
            assert refused.status_code == 429, (route, refused.text)
            assert refused.json()["problems"][0]["field"] == "rate_limits.samples_per_s"
        # 2 observations x n=4 are 8 samples: the whole bucket, for the blocking call and the future
        sampled = http.post("/v1/sample", json={"observations": observations(rl, 2), "n": 4}, headers=rl.headers)
        assert sampled.status_code == 200, sampled.text
        for route in ("/v1/futures/sample", "/v1/futures/predict"):
            refused = http.post(route, json={"observations": observations(rl, 1)}, headers=rl.headers)
            assert refused.status_code == 429 and refused.json()["code"] == "rate_limited", (route, refused.text)
        assert app.state.limiter.throttled(rl.tenant_id).samples_per_s == 2
