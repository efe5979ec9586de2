"""Environment Service as a pool of workers (issue 12): sessions spread over the workers behind
the EnvironmentService interface, routed by id, tenant isolation kept, batch_step across workers."""

from __future__ import annotations

import numpy as np
import pytest

from joynexus.services.environment.service import (
    EnvironmentPool,
    LocalEnvironmentWorkers,
    SessionLimitExceeded,
    UnknownSession,
)

PUSHT_STATE = {"simulator": "pusht", "task": "PushT-v0"}


@pytest.fixture
def pool():
    pool = EnvironmentPool(LocalEnvironmentWorkers({"max_sessions": 2, "max_sessions_per_tenant": 2}), workers=2)
    yield pool
    pool.close_all()


def test_sessions_spread_over_the_workers_and_step_through_the_pool(pool):
    ids = [pool.open_session("t1", "r1", PUSHT_STATE) for _ in range(3)]
    assert sorted(i.split(":")[0] for i in ids) in (["w0", "w0", "w1"], ["w0", "w1", "w1"])  # least loaded first
    beat = pool.heartbeat()
    assert beat["sessions"] == 3 and [w["sessions"] for w in beat["workers"]] in ([2, 1], [1, 2])
    assert beat["sessions_opened"] == {"fresh": 3, "warm": 0}  # the workers' counts, summed
    assert pool.spec("t1", ids[0])["action_dim"] == 2
    for i, sid in enumerate(ids):
        obs = pool.reset("t1", sid, seed=i)
        assert obs["state"].shape == (5,)
    single = pool.step("t1", ids[0], np.array([0.5, 0.5], np.float32) * 512)
    assert set(single) >= {"observation", "reward", "terminated", "truncated"}
    stepped = pool.batch_step("t1", {sid: np.array([100.0, 200.0], np.float32) for sid in ids} | {"w9:nope": [0, 0]})
    assert list(stepped) == [*ids, "w9:nope"]  # the caller's order
    assert all("reward" in stepped[sid] for sid in ids)
    assert stepped["w9:nope"]["error_type"] == "UnknownSession"
    listed = pool.sessions("t1")
    assert sorted(s["session_id"] for s in listed) == sorted(ids)
    assert {s["steps"] for s in listed if s["session_id"] == ids[0]} == {2}


def test_tenant_isolation_unknown_ids_and_limits_through_the_pool(pool):
    sid = pool.open_session("t1", "r1", PUSHT_STATE)
    with pytest.raises(UnknownSession, match="unknown session"):
        pool.spec("t2", sid)  # someone else's id: the same answer as a missing one
    for bad in ("env-123", "w7:env-123", "wx:env"):
        with pytest.raises(UnknownSession) as caught:
            pool.close("t1", bad)
        assert caught.value.session_id == bad
    pool.close("t1", sid)
    pool.close("t1", sid)  # idempotent for the owner
    with pytest.raises(UnknownSession, match="was closed"):
        pool.reset("t1", sid)
    for _ in range(4):  # two per worker
        pool.open_session("t3", "r", PUSHT_STATE)
    with pytest.raises(SessionLimitExceeded):
        pool.open_session("t3", "r", PUSHT_STATE)
    assert pool.close_tenant("t3") == 4 and pool.sessions("t3") == []
    with pytest.raises(ValueError, match="workers: expected an int >= 1"):
        EnvironmentPool(LocalEnvironmentWorkers(), workers=0)
