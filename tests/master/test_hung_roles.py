"""Hung roles (issue 25 item 3), the policy and the Health Manager's use of it, without Ray: a role
whose heartbeat is late past its bound is restarted in place, with backoff, within a budget, then
escalated (reported unhealthy, admission paused) until it answers again."""

from __future__ import annotations

import uuid

import pytest

from joynexus.master.health import HealthManager, HealthOptions
from joynexus.master.hung_roles import HungRoleOptions, RestartPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


OPTIONS = HungRoleOptions(hung_after_s=30, restart_budget=3, restart_window_s=600, backoff_s=5, max_backoff_s=300)


def test_a_role_late_past_its_bound_is_restarted_then_backs_off_then_escalates():
    clock = Clock()
    policy = RestartPolicy(OPTIONS, clock)
    since = clock.now
    assert policy.decide("training", last_ok=clock.now, since=since).action == "ok"
    clock.now += 30  # exactly at the bound: not hung yet
    assert policy.decide("training", last_ok=since, since=since).action == "ok"
    clock.now += 1
    verdict = policy.decide("training", last_ok=since, since=since)
    assert verdict.action == "restart" and verdict.silent_for_s == pytest.approx(31)
    assert policy.record_restart("training") == 1

    # A restarting role gets the whole bound to come back, from its restart on.
    clock.now += 29
    assert policy.decide("training", last_ok=since, since=since).action == "wait"
    clock.now += 2
    assert policy.decide("training", last_ok=since, since=since).action == "restart"
    policy.record_restart("training")
    # Backoff doubles: 5 s after the 1st restart, 10 s after the 2nd, 20 s after the 3rd (capped at 300 s).
    assert [policy.backoff_after(n) for n in (1, 2, 3, 4, 10)] == [5, 10, 20, 40, 300]

    clock.now += 31
    assert policy.decide("training", last_ok=since, since=since).action == "restart"
    policy.record_restart("training")
    clock.now += 31
    verdict = policy.decide("training", last_ok=since, since=since)
    assert verdict.action == "escalate" and "budget is spent (3 restarts in 600 s)" in verdict.reason
    assert policy.escalated() == ["training"]
    assert policy.decide("inference", last_ok=clock.now, since=since).action == "ok"  # roles are separate

    # It answers again: no longer escalated.
    assert policy.decide("training", last_ok=clock.now, since=since).action == "ok"
    assert policy.escalated() == []


def test_backoff_holds_a_restart_back_when_the_bound_is_shorter_than_the_backoff():
    clock = Clock()
    policy = RestartPolicy(HungRoleOptions(hung_after_s=1, backoff_s=5, restart_budget=5), clock)
    since = clock.now
    clock.now += 2
    assert policy.decide("queue", None, since).action == "restart"  # never answered: counted from `since`
    policy.record_restart("queue")
    clock.now += 2  # silent past the bound again, but the 5 s backoff runs
    verdict = policy.decide("queue", None, since)
    assert verdict.action == "wait" and "backoff" in verdict.reason
    clock.now += 3.5
    assert policy.decide("queue", None, since).action == "restart"
    policy.record_restart("queue")
    clock.now += 6  # the second backoff is 10 s
    assert policy.decide("queue", None, since).action == "wait"
    clock.now += 4.5
    assert policy.decide("queue", None, since).action == "restart"


def test_a_role_seen_restarting_is_not_hung_while_it_builds():
    clock = Clock()
    policy = RestartPolicy(OPTIONS, clock)
    since = clock.now
    clock.now += 100
    policy.restarting("training")  # Ray reports it not ALIVE: its constructor (a backbone load) runs
    clock.now += 29
    assert policy.decide("training", last_ok=since, since=since).action == "wait"
    clock.now += 2  # ALIVE and silent past the bound since it was last seen starting
    assert policy.decide("training", last_ok=since, since=since).action == "restart"


def test_the_budget_counts_restarts_in_a_sliding_window():
    clock = Clock()
    policy = RestartPolicy(HungRoleOptions(hung_after_s=1, backoff_s=0, restart_budget=1, restart_window_s=60), clock)
    since = clock.now
    clock.now += 2
    assert policy.decide("env", None, since).action == "restart"
    policy.record_restart("env")
    clock.now += 2
    assert policy.decide("env", None, since).action == "escalate"
    clock.now += 60  # the restart left the window: one more is allowed
    assert policy.decide("env", None, since).action == "restart"


class HangableService:
    """A service whose heartbeat can hang (raise as a timed-out probe would); `restart` is what Ray
    does after `ray.kill(no_restart=False)`: a fresh incarnation that answers."""

    def __init__(self) -> None:
        self.incarnation = uuid.uuid4().hex[:8]
        self.hung = False
        self.restarts = 0

    def heartbeat(self) -> dict:
        if self.hung:
            raise TimeoutError("heartbeat timed out")
        return {"incarnation": self.incarnation, "started_at": 0.0}

    def restart(self, stay_hung: bool) -> None:
        self.restarts += 1
        self.incarnation = uuid.uuid4().hex[:8]
        self.hung = stay_hung


def _manager(service: HangableService, *, stay_hung: bool, restored: list[str]) -> HealthManager:
    options = HealthOptions(
        interval_s=60,  # rounds are driven by the test (`check`)
        hung=HungRoleOptions(hung_after_s=0.05, restart_budget=2, restart_window_s=600, backoff_s=0.0),
    )
    return HealthManager(
        {"training_service": service},
        check_roles=lambda stale: {},
        on_restart=lambda role, previous, beat: restored.append(role) or "restored",
        options=options,
        kill=lambda role, target: target.restart(stay_hung),
    )


def test_the_health_manager_restarts_a_hung_service_in_place_and_restores_it():
    import time

    service, restored = HangableService(), []
    health = _manager(service, stay_hung=False, restored=restored)
    health.check()
    assert health.report()["training_service"]["healthy"]
    service.hung = True
    health.check()  # silent, but not past its bound yet
    assert service.restarts == 0 and not health.report()["training_service"]["healthy"]
    time.sleep(0.08)
    health.check()
    entry = health.report()["training_service"]
    assert service.restarts == 1 and entry["hung_restarts"] == 1 and "killed for a restart" in entry["detail"]
    health.check()  # the new incarnation answers: restored as after any restart in place
    entry = health.report()["training_service"]
    assert entry["healthy"] and entry["restarts"] == 1 and restored == ["training_service"]
    assert health.escalated() == {}


def test_a_service_that_stays_hung_is_escalated_once_its_budget_is_spent_and_pauses_admission():
    import time

    service, restored = HangableService(), []
    health = _manager(service, stay_hung=True, restored=restored)
    health.check()
    service.hung = True
    for _ in range(6):
        time.sleep(0.08)
        health.check()
    assert service.restarts == 2  # the budget
    entry = health.report()["training_service"]
    assert not entry["healthy"] and entry["detail"].startswith("escalated: hung")
    assert "training_service" in health.escalated()

    service.hung = False  # it comes back by itself: escalation lifts
    health.check()
    assert health.escalated() == {} and health.report()["training_service"]["healthy"]


def test_the_master_refuses_new_work_while_a_role_is_escalated(tmp_path):
    from joynexus.connect import in_process
    from joynexus.master.errors import AdmissionRefused
    from joynexus.settings import Settings
    from tests.helpers import sft_spec, write_dataset_for

    cluster = in_process(Settings(data_dir=tmp_path / "data", torch_threads=1))
    try:
        master = cluster.master
        spec = sft_spec("paused", tmp_path / "ds", jobs=1)
        write_dataset_for(spec, episodes=2, length=8)
        master.create_tenant(spec)
        state = master.health_manager._services["training_queue"]
        state.escalated = "hung: silent 31 s and its restart budget is spent (3 restarts in 600 s)"
        with pytest.raises(AdmissionRefused, match="admission paused: role training_queue is hung"):
            master.submit_workload("paused", jobs=1)
        assert master.workloads.admission_paused() is True
        assert not master.health()["training_queue"]["healthy"]
        state.escalated = None
        assert master.workloads.admission_paused() is False
    finally:
        cluster.close()
