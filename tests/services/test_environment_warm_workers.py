"""Warm workers of the Environment Service: a closed session's worker process, simulator built,
serves the same tenant's next session of the same config instead of a fresh spawn; never another
tenant's or another config's; bounded in number and time, and giving way to live sessions.

gym-pusht (the cheap real simulator) throughout."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from joynexus.services.environment.service import EnvironmentService, UnknownSession
from tests.helpers import wait_for
from tests.services.test_environment_service import PUSHT, PUSHT_STATE, pid_gone


def exited(pid: int) -> bool:
    """Gone, or a zombie waiting to be reaped (its parent's to do)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def pid_of(service: EnvironmentService, tenant_id: str, session_id: str) -> int:
    return {s["session_id"]: s["pid"] for s in service.sessions(tenant_id)}[session_id]


def test_a_closed_sessions_worker_serves_its_tenants_next_session_of_the_same_config_only():
    with EnvironmentService(warm_workers=2) as service:
        first = service.open_session("tenant-a", "r1", PUSHT_STATE)
        worker = pid_of(service, "tenant-a", first)
        unseeded = service.reset("tenant-a", first)["state"]  # the config's seed: reproducible
        episode = service.reset("tenant-a", first, seed=3)["state"]
        service.step("tenant-a", first, np.zeros(2, np.float32))
        service.close("tenant-a", first)
        assert service.heartbeat()["warm_workers"] == 1 and not pid_gone(worker)

        again = service.open_session("tenant-a", "r2", PUSHT_STATE)
        assert again != first and pid_of(service, "tenant-a", again) == worker  # no new process
        assert service.heartbeat()["sessions_opened"] == {"fresh": 1, "warm": 1}
        with pytest.raises(UnknownSession):  # the closed id stays closed
            service.step("tenant-a", first, np.zeros(2, np.float32))
        with pytest.raises(RuntimeError, match="reset"):  # a new session: reset before it steps
            service.step("tenant-a", again, np.zeros(2, np.float32))
        # as on a fresh worker: the first unseeded reset from the config's seed, a seeded one its own
        np.testing.assert_array_equal(service.reset("tenant-a", again)["state"], unseeded)
        np.testing.assert_array_equal(service.reset("tenant-a", again, seed=3)["state"], episode)
        assert service.heartbeat()["warm_workers"] == 0

        service.close("tenant-a", again)  # warm again, for tenant-a only
        other_tenant = service.open_session("tenant-b", "r1", PUSHT_STATE)
        other_config = service.open_session("tenant-a", "r3", PUSHT)
        tenant_b_worker = pid_of(service, "tenant-b", other_tenant)
        camera_worker = pid_of(service, "tenant-a", other_config)
        assert len({worker, tenant_b_worker, camera_worker}) == 3
        assert service.heartbeat()["warm_workers"] == 1
        assert service.heartbeat()["sessions_opened"] == {"fresh": 3, "warm": 1}

        service.close("tenant-b", other_tenant)
        service.close("tenant-a", other_config)  # a third warm worker: the oldest (the first) stops
        assert service.heartbeat()["warm_workers"] == 2 and pid_gone(worker)
        assert service.close_tenant("tenant-a") == 0  # no live session; its warm worker stopped
        assert service.heartbeat()["warm_workers"] == 1
        assert pid_gone(camera_worker) and not pid_gone(tenant_b_worker)
    assert pid_gone(tenant_b_worker)  # close_all (the context's exit) stopped the rest


def test_warm_workers_expire_fit_their_memory_bound_are_not_reused_dead_and_give_way_to_live_sessions():
    with EnvironmentService(warm_workers=4, warm_ttl_s=1.0, max_sessions=2) as service:
        session = service.open_session("tenant-a", "r1", PUSHT_STATE)
        expiring = pid_of(service, "tenant-a", session)
        service.close("tenant-a", session)
        time.sleep(1.2)
        assert service.heartbeat()["warm_workers"] == 0 and pid_gone(expiring)  # stopped on time

    with EnvironmentService(warm_workers=4, warm_memory_bytes=1 << 20) as service:  # 1 MiB: none fits
        session = service.open_session("tenant-a", "r1", PUSHT_STATE)
        too_big = pid_of(service, "tenant-a", session)
        service.close("tenant-a", session)
        assert service.heartbeat()["warm_workers"] == 0 and pid_gone(too_big)

    with EnvironmentService(warm_workers=4, max_sessions=2) as service:
        session = service.open_session("tenant-a", "r1", PUSHT_STATE)
        dead = pid_of(service, "tenant-a", session)
        service.close("tenant-a", session)
        os.kill(dead, signal.SIGKILL)  # dies while it waits
        wait_for(lambda: exited(dead), "the killed worker exited")
        session = service.open_session("tenant-a", "r2", PUSHT_STATE)
        assert pid_of(service, "tenant-a", session) != dead  # a fresh worker, no error
        service.reset("tenant-a", session, seed=0)
        service.close("tenant-a", session)

        live = [service.open_session("tenant-b", f"r{k}", PUSHT_STATE) for k in range(2)]  # full: 2 live
        assert service.heartbeat()["warm_workers"] == 0  # the warm worker gave way to the second
        assert len(service.sessions("tenant-b")) == 2 and all(service.reset("tenant-b", s, seed=1) for s in live)
