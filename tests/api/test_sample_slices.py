"""Issue 41.1: one sampling call reaches the Training Model Service in bounded slices (at most
`ApiLimits.sample_slice_chunks` = 128 chunks each, blocking or as a future), so what it holds on the
service at once and how long it holds it are one slice's; each slice takes its own turn at the
training gate, where tenants take turns within a priority. Fails on the main of 2026-12-07 (checked:
one service call of 1,024 chunks; the gate first come first served, so a tenant with calls waiting
went before another tenant's later call)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from joynexus.api.priority_gate import PriorityGate
from joynexus.services.sample_slices import SAMPLE_SLICE_CHUNKS, SampleVersionChanged, sample_in_slices
from tests.api.test_sampling_and_futures import array, collect, observations, stochastic_tenant


@pytest.fixture
def service_calls(api, monkeypatch):
    """Chunks of each `TrainingModelService.sample` call (the real method runs)."""
    service = api.cluster.training.target.target  # the service object behind its lock
    real = service.sample
    calls: list[int] = []

    def counted(tenant_id, batch, n=1, temperature=1.0, seed=0):
        calls.append(len(batch["task"]) * n)
        return real(tenant_id, batch, n, temperature, seed)

    monkeypatch.setattr(service, "sample", counted)
    return calls


def test_a_1024_chunk_call_reaches_the_service_in_slices_of_128_and_answers_whole(api, service_calls):
    t = stochastic_tenant(api, "slices")
    body = {"observations": observations(t, 16), "n": 64, "seed": 5}
    first = api.client.post("/v1/sample", json=body, headers=t.headers)
    assert first.status_code == 200, first.text
    assert service_calls == [SAMPLE_SLICE_CHUNKS] * 8  # 16 x 64 chunks, two observations a slice
    actions, log_probs = array(first.json(), "actions"), array(first.json(), "log_probs")
    assert actions.shape[:2] == (16, 64) and log_probs.shape == (16, 64) and np.isfinite(log_probs).all()
    assert len({tuple(np.round(a.ravel(), 5)) for a in actions[:, 0]}) > 1  # slices drew with their own seeds
    again = api.client.post("/v1/sample", json=body, headers=t.headers).json()
    assert np.array_equal(array(again, "actions"), actions)  # the same seed, the same samples
    service_calls.clear()
    submitted = api.client.post("/v1/futures/sample", json=body, headers=t.headers)
    assert submitted.status_code == 202, submitted.text
    done = collect(api, t, submitted.json()["future_id"])
    assert done.status_code == 200, done.text
    assert service_calls == [SAMPLE_SLICE_CHUNKS] * 8
    assert np.array_equal(array(done.json(), "actions"), actions)


def test_a_call_of_one_slice_draws_what_it_drew_unsliced(api, service_calls):
    t = stochastic_tenant(api, "one-slice")
    body = {"observations": observations(t, 2), "n": 3, "seed": 11}
    answer = api.client.post("/v1/sample", json=body, headers=t.headers).json()
    assert service_calls == [6] and answer["seed"] == 11


def test_slices_drawn_from_two_versions_are_refused_as_a_whole():
    def call(arguments):
        return {"actions": np.zeros((len(arguments["batch"]["task"]), 1, 1, 1)), "log_probs": None,
                "version": 1 if arguments["seed"] == 3 else 2, "seconds": 0.1}  # fmt: skip

    batch = {"task": ["x"] * 4, "state": np.zeros((4, 2))}
    with pytest.raises(SampleVersionChanged, match="from version 1 to 2"):
        sample_in_slices(call, {"batch": batch, "n": 1, "temperature": 1.0, "seed": 3}, slice_chunks=2)
    whole = sample_in_slices(call, {"batch": batch, "n": 1, "temperature": 1.0, "seed": 3}, slice_chunks=4)
    assert whole["actions"].shape == (4, 1, 1, 1) and whole["slices"] == 1


def test_tenants_take_turns_at_the_training_gate_within_a_priority():
    """One place; the attacker has three calls waiting when the victim's arrives: the victim goes
    second, not fourth (a sampling call's slices re-enter like separate calls)."""
    gate = PriorityGate(1)
    order: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(10)

    threads = [threading.Thread(target=gate.call, args=(0, hold), kwargs={"tenant": "attacker"})]
    threads[0].start()
    holding.wait(10)
    for name in ("attacker", "attacker", "attacker", "victim"):
        waiting = gate.waiting()
        thread = threading.Thread(target=gate.call, args=(0, order.append, name), kwargs={"tenant": name})
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 10
        while gate.waiting() == waiting and time.monotonic() < deadline:  # queued in this order
            time.sleep(0.01)
    release.set()
    for thread in threads:
        thread.join(10)
    assert order == ["attacker", "victim", "attacker", "attacker"]
    gate.call(5, order.append, "urgent", tenant="other")  # an idle gate lets anyone in at once
    assert order[-1] == "urgent"
