"""The producer front's placement rules (issue 40), over replicas that keep their work in memory the
way `ProducerService` reports it: a tenant goes to the least loaded live replica and stays there;
a replica that stops answering, or answers as a new incarnation without its work, has its
workloads moved (the Master's `on_move` first); a new front learns what runs from the replicas, so
nothing starts twice. (The real replicas on Ray: tests/cluster/test_producer_replicas_ray.py.)"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from joynexus.actors import RoleUnavailable
from joynexus.services.producers.front import NoProducerReplica, ProducerFront


class Replica:
    """The part of ProducerService's interface the front calls, with its report's shape."""

    def __init__(self, index: int):
        self.index, self.dead = index, False
        self.incarnation = uuid.uuid4().hex
        self.work: dict[str, dict[str, Any]] = {}
        self.starts: list[str] = []

    def _alive(self) -> None:
        if self.dead:
            raise RoleUnavailable(f"producers-{self.index}", "gone", 1.0)

    def restart(self) -> None:  # what Ray's restart in place leaves: a new life, no work
        self.incarnation, self.work = uuid.uuid4().hex, {}

    def start_workload(self, workload_id: str, tenant_id: str, **request: Any) -> str:
        self._alive()
        self.starts.append(workload_id)
        self.work.setdefault(workload_id, {"tenant_id": tenant_id, "kind": request["task"], "request": request})
        return f"owner-{self.index}"

    def stop_workload(self, workload_id: str) -> None:
        self._alive()
        self.work.pop(workload_id, None)

    def publish_weights(self, tenant_id: str) -> int:
        self._alive()
        return self.index

    def poll(self) -> dict[str, Any]:
        self._alive()
        report = {
            w: {**entry, "state": "running", "error": None, "result": None, "events": [], "waits": 0}
            for w, entry in self.work.items()
        }
        return {"replica": self.index, "incarnation": self.incarnation, "owners": [f"o{self.index}"], "work": report}


@pytest.fixture
def replicas() -> list[Replica]:
    return [Replica(0), Replica(1)]


def test_tenants_go_to_the_least_loaded_replica_and_stay_there(replicas):
    front = ProducerFront(replicas)
    assert front.start_workload("w1", "a", task="sft") == 0
    assert front.start_workload("w2", "b", task="sft") == 1
    assert front.start_workload("w3", "a", task="sft") == 0  # sticky: a's second workload, a's replica
    assert front.publish_weights("b") == 1
    assert front.live_owners() == {"o0", "o1"}  # learned when the front first asked (its sync)
    # What `joynexus status` shows of each replica (the Master's `producers` role row).
    health = front.health()
    assert [(r["replica"], r["tenants"], r["workloads"]) for r in health["replicas"]] == [
        (0, ["a"], ["w1", "w3"]),
        (1, ["b"], ["w2"]),
    ]
    assert "(#0: 1 tenants, 2 workloads; #1: 1 tenants, 1 workloads)" in health["detail"]


def test_a_dead_replicas_workloads_move_once_after_on_move(replicas):
    front = ProducerFront(replicas)
    moved: list[tuple[str, str, set[str]]] = []
    front.on_move = lambda w, t, lost: moved.append((w, t, lost))
    front.start_workload("w1", "a", task="rl")
    front.start_workload("w2", "b", task="sft")
    front.poll()
    replicas[0].dead = True
    reports = front.poll()
    assert moved == [("w1", "a", {"o0"})] and reports["w1"]["moved_to"] == 1
    assert replicas[1].work.keys() == {"w1", "w2"} and front.take_lost_owners() == {"o0"}
    assert front.publish_weights("a") == 1  # the tenant follows its work
    front.poll()
    assert len(moved) == 1 and replicas[1].starts.count("w1") == 1  # moved once, not every round
    assert front.health()["healthy"] and "1 of 2" in front.health()["detail"]
    assert "#0 gone: 0 tenants, 0 workloads; #1: 2 tenants, 2 workloads" in front.health()["detail"]
    replicas[1].dead = True
    with pytest.raises(NoProducerReplica):
        front.start_workload("w4", "c", task="sft")


def test_a_replica_restarted_in_place_without_its_work_has_it_started_again(replicas):
    front = ProducerFront(replicas)
    front.start_workload("w1", "a", task="sft")
    front.poll()
    replicas[0].restart()
    reports = front.poll()
    assert reports["w1"]["moved_to"] == 1 and "w1" in replicas[1].work
    assert front.take_lost_owners() == {"o0"}


def test_a_stopped_workload_is_not_moved(replicas):
    front = ProducerFront(replicas)
    front.start_workload("w1", "a", task="sft")
    front.stop_workload("w1")
    replicas[0].dead = True
    assert "w1" not in front.poll() and replicas[1].starts == []


def test_a_new_front_learns_the_running_work_and_starts_nothing_twice(replicas):
    first = ProducerFront(replicas)
    first.start_workload("w1", "a", task="sft")
    first.start_workload("w2", "b", task="sft")
    again = ProducerFront(replicas)  # a restarted Master's
    assert again.running_workloads() == {"w1", "w2"}
    assert again.start_workload("w2", "b", task="sft") == 1  # where it runs, not the least loaded
    assert again.poll().keys() == {"w1", "w2"} and [r.starts for r in replicas] == [["w1"], ["w2", "w2"]]
