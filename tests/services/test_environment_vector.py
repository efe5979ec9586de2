"""Vectorized environment sessions (`envs.vector`): one Environment Service worker holds several
environments, addressed "<session>#<slot>" and stepped together by one `batch_step` message; slot j
of a session seeded s runs the episodes a plain session seeded s + j runs; rollouts with
environment.envs_per_worker > 1 run on such sessions."""

from __future__ import annotations

import numpy as np
import pytest

from joynexus.services.environment.service import EnvironmentService, UnknownSession
from tests.services.test_rl_loop import dep, parts, rl_spec  # noqa: F401  (dep: the fixture)

PUSHT_STATE = {"simulator": "pusht", "task": "PushT-v0"}


@pytest.fixture(scope="module")
def service():
    svc = EnvironmentService(max_sessions=8, max_sessions_per_tenant=8)
    yield svc
    svc.close_all()


def test_a_vectorized_session_steps_its_slots_as_plain_sessions_would(service):
    vector = service.open_session("t", "r", {**PUSHT_STATE, "seed": 5, "num_envs": 3})
    plain = [service.open_session("t", "r", {**PUSHT_STATE, "seed": 5 + j}) for j in range(3)]
    slots = [f"{vector}#{j}" for j in range(3)]
    assert len(service.sessions("t")) == 4 and service.spec("t", slots[0])["num_envs"] == 3  # ONE worker for 3
    for a, b in zip(slots, plain, strict=True):
        np.testing.assert_array_equal(service.reset("t", a)["state"], service.reset("t", b)["state"])
    rng = np.random.default_rng(0)
    for _ in range(3):
        actions = [rng.uniform(0, 512, 2).astype(np.float32) for _ in range(3)]
        # One call mixes slots of the vectorized session and plain sessions.
        step = {**dict(zip(slots, actions, strict=True)), **dict(zip(plain, actions, strict=True))}
        out = service.batch_step("t", step)
        assert list(out) == slots + plain
        for a, b in zip(slots, plain, strict=True):
            np.testing.assert_allclose(out[a]["observation"]["state"], out[b]["observation"]["state"], rtol=1e-6)
            assert out[a]["reward"] == pytest.approx(out[b]["reward"])
    single = service.step("t", slots[1], np.array([100.0, 100.0], np.float32))
    assert set(single) >= {"observation", "reward", "terminated"}
    service.close("t", slots[0])  # closes the whole session; its other slots are gone too
    with pytest.raises(UnknownSession):
        service.reset("t", slots[2])
    for sid in plain:
        service.close("t", sid)


def test_slots_are_checked_with_clear_errors(service):
    vector = service.open_session("t2", "r", {**PUSHT_STATE, "num_envs": 2})
    with pytest.raises(ValueError, match=r"holds 2 environments; address one as"):
        service.reset("t2", vector)
    with pytest.raises(ValueError, match=r"slot 2 of .* holds slots 0\.\.1"):
        service.reset("t2", f"{vector}#2")
    service.reset("t2", f"{vector}#0")
    out = service.batch_step("t2", {f"{vector}#0": np.zeros(2, np.float32), f"{vector}#1": np.zeros(2, np.float32)})
    assert "observation" in out[f"{vector}#0"] and "reset()" in out[f"{vector}#1"]["error"]  # slot 1 never reset
    with pytest.raises(UnknownSession):
        service.reset("someone-else", f"{vector}#0")
    service.close("t2", vector)


def test_a_rollout_runs_on_vectorized_sessions(dep):  # noqa: F811
    spec = rl_spec("vectorized")
    spec["environment"].update({"num_envs": 3, "envs_per_worker": 2})
    spec["training"] = {"samples_per_job": 18, "microbatch_size": 9}
    dep.creator.create(spec)
    _, producer, stage, actor = parts(dep, "vectorized")
    try:
        job = producer.produce_once()
        assert dep.queue.describe(job.partition_id)["num_samples"] == 18
        workers = dep.environment_service.sessions("vectorized")
        assert len(workers) == 2  # envs 0-1 in one worker, env 2 in another
        assert producer._envs.ids[0].endswith("#0") and producer._envs.ids[1].endswith("#1")
        stage.step()
        assert actor.step().state == "completed"
    finally:
        producer.close()
    assert dep.environment_service.sessions("vectorized") == []
