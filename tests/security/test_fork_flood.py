"""The abuse suite's fork flood (issue 41.3): while one tenant forks itself as fast as it can from
two workers (names that collide between the workers, forks up to the per-owner bound, each fork
deleted again to make room for the next), another tenant's train_batch and predict keep their p99
within the suite's bound (test_victim_latency.py: max(10 x idle p99, idle p99 + 2 s)); every
answer is one a client can act on (201, 409 for a taken name, 429 at the bound, 200 for a delete),
never a 500; and the owner's forks never exceed the bound."""

from __future__ import annotations

import time

from tests.security.conftest import Flood, p99, victim_latencies
from tests.security.test_sampling_flood import _train_latencies
from tests.security.test_victim_latency import SAMPLES, bound


def test_another_tenants_p99_stays_bounded_under_a_fork_flood(api, live_server, victim, attacker, latency_measured):
    answers: dict[int, int] = {}
    most_forks = [0]

    def forking(client, i):
        name = f"{attacker.tenant_id}-ff-{i // 2 % 24}"  # the two workers race for each name
        made = client.post("/v1/fork", json={"new_tenant": name})
        answers[made.status_code] = answers.get(made.status_code, 0) + 1
        listed = client.get("/v1/forks").json()["forks"]
        most_forks[0] = max(most_forks[0], len(listed))
        if made.status_code == 201 and i % 3 == 0:
            gone = client.delete(f"/v1/forks/{name}")
            answers[gone.status_code] = answers.get(gone.status_code, 0) + 1

    _train_latencies(live_server, victim, 3)  # warm the path
    victim_latencies(live_server, victim, 3)
    idle_train = p99(_train_latencies(live_server, victim, SAMPLES))
    idle_predict = p99(victim_latencies(live_server, victim, SAMPLES))
    flood = Flood(live_server, forking, headers=attacker.headers, workers=2)
    with flood:
        time.sleep(0.5)
        loaded_train = p99(_train_latencies(live_server, victim, SAMPLES))
        loaded_predict = p99(victim_latencies(live_server, victim, SAMPLES))
    limit = api.client.get("/v1/forks", headers=attacker.headers).json()["max_forks"]
    report = {
        "train_batch p99 s": f"{idle_train:.3f} idle, {loaded_train:.3f} flooded",
        "predict p99 s": f"{idle_predict:.3f} idle, {loaded_predict:.3f} flooded",
        "answers": answers,
        "most forks at once": most_forks[0],
    }
    assert flood.sent > 0 and not flood.errors, flood.errors[:3]
    assert set(answers) <= {200, 201, 409, 429} and answers.get(201), report
    assert most_forks[0] <= limit, report
    assert loaded_train <= bound(idle_train), report
    assert loaded_predict <= bound(idle_predict), report
    print(report)
