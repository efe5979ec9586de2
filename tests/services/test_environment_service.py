"""Environment Service: sessions in their own worker processes, tenant isolation, failure isolation.

Real simulators throughout (gym-pusht is the cheap one; ManiSkill3 where it matters), except
`HangOnStepAdapter` below, which is broken on purpose. The service's workers import this module to
find it (spawned workers re-import an adapter's defining module by name).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from joynexus.envs import AssetDownloadRefused, EnvObservation, SimulatorAdapter, SimulatorSpec, StepResult
from joynexus.envs.base import register_simulator
from joynexus.services.environment.service import (
    EnvironmentService,
    SessionFailed,
    SessionLimitExceeded,
    UnknownSession,
)
from joynexus.services.environment.worker import pack_message, unpack_message

PUSHT = {"simulator": "pusht", "task": "PushT-v0", "cameras": ["top"]}
PUSHT_STATE = {"simulator": "pusht", "task": "PushT-v0"}
HANG = {"simulator": "test_hang_on_step", "task": "hang"}


@register_simulator("test_hang_on_step")
class HangOnStepAdapter(SimulatorAdapter):
    """Purposely broken: builds and resets fine, then hangs on every step, like a wedged simulator."""

    def __init__(self, config):
        super().__init__(config)
        self.spec = SimulatorSpec(
            simulator=self.name,
            task=config.task,
            instruction="wait forever",
            cameras=(),
            image_size=config.image_size,
            state_dim=1,
            action_dim=1,
            action_low=(-1.0,),
            action_high=(1.0,),
            max_episode_steps=10,
            reward_mode="dense",
        )

    def _reset(self, seed):
        return EnvObservation(images={}, state=np.zeros(1, np.float32), instruction=self.spec.instruction)

    def _step(self, action) -> StepResult:
        time.sleep(3600)
        raise AssertionError("unreachable")

    def close(self):
        pass


@pytest.fixture
def service():
    svc = EnvironmentService(step_timeout_s=20.0, reset_timeout_s=120.0)
    yield svc
    svc.close_all()


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def check_obs(obs: dict, state_dim: int, cameras=("top",), size=(64, 64)) -> None:
    assert sorted(obs["images"]) == sorted(cameras)
    for image in obs["images"].values():
        assert image.dtype == np.float32 and image.shape == (3, *size)
        assert 0.0 <= image.min() and image.max() <= 1.0
    assert obs["state"].dtype == np.float32 and obs["state"].shape == (state_dim,)
    assert isinstance(obs["instruction"], str) and obs["instruction"]


def check_step(result: dict, state_dim: int, **kw) -> None:
    check_obs(result["observation"], state_dim, **kw)
    assert isinstance(result["reward"], float)
    assert all(isinstance(result[k], bool) for k in ("terminated", "truncated", "success"))
    assert isinstance(result["info"], dict)


# --------------------------------------------------------------------------------------------- #
def test_two_tenants_run_side_by_side_and_are_isolated(service):
    a = service.open_session("tenant-a", "rollout-1", PUSHT)
    b = service.open_session("tenant-b", "rollout-7", PUSHT_STATE)
    assert service.spec("tenant-a", a)["instruction"] == "push the T-shaped block onto the target"
    assert service.spec("tenant-b", b)["state_dim"] == 5

    results: dict[str, list] = {}

    def drive(tenant: str, sid: str, state_dim: int, cameras) -> None:
        check_obs(service.reset(tenant, sid, seed=1), state_dim, cameras)
        results[tenant] = [service.step(tenant, sid, [200.0 + i, 300.0]) for i in range(10)]

    threads = [
        threading.Thread(target=drive, args=("tenant-a", a, 2, ("top",))),
        threading.Thread(target=drive, args=("tenant-b", b, 5, ())),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results["tenant-a"]) == len(results["tenant-b"]) == 10
    for r in results["tenant-a"]:
        check_step(r, 2)
    for r in results["tenant-b"]:
        check_step(r, 5, cameras=())

    # Tenant B sees tenant A's session exactly as it sees an id that never existed.
    missing = "env-0123456789abcdef0123456789abcdef"
    for call in (
        lambda sid: service.step("tenant-b", sid, [1.0, 2.0]),
        lambda sid: service.reset("tenant-b", sid),
        lambda sid: service.spec("tenant-b", sid),
        lambda sid: service.close("tenant-b", sid),
    ):
        with pytest.raises(UnknownSession) as foreign:
            call(a)
        with pytest.raises(UnknownSession) as absent:
            call(missing)
        assert str(foreign.value).replace(a, "<id>") == str(absent.value).replace(missing, "<id>")
    assert service.batch_step("tenant-b", {a: [1.0, 2.0]})[a]["error_type"] == "UnknownSession"
    assert [s["session_id"] for s in service.sessions("tenant-b")] == [b]
    assert [s["session_id"] for s in service.sessions("tenant-a")] == [a]
    assert service.sessions("tenant-c") == []
    check_step(service.step("tenant-a", a, [10.0, 10.0]), 2)  # B's attempts did not touch A's session


def test_killed_worker_fails_only_its_session(service):
    doomed = service.open_session("tenant-a", "r1", PUSHT_STATE)
    survivor = service.open_session("tenant-a", "r2", PUSHT_STATE)
    for sid in (doomed, survivor):
        service.reset("tenant-a", sid)
    pid = {s["session_id"]: s["pid"] for s in service.sessions("tenant-a")}[doomed]
    assert pid != os.getpid()
    os.kill(pid, signal.SIGKILL)

    with pytest.raises(SessionFailed, match="simulator worker exited with code -9") as err:
        service.step("tenant-a", doomed, [1.0, 2.0])
    assert err.value.session_id == doomed and "code -9" in err.value.reason
    assert pid_gone(pid)
    check_step(service.step("tenant-a", survivor, [5.0, 6.0]), 5, cameras=())  # unaffected

    # The failure is remembered for the owner (and listed with its reason), the slot is free.
    with pytest.raises(SessionFailed, match="code -9"):
        service.reset("tenant-a", doomed)
    listed = {s["session_id"]: s for s in service.sessions("tenant-a")}
    assert listed[doomed]["state"] == "failed" and "code -9" in listed[doomed]["reason"]
    assert listed[survivor]["state"] == "ready"
    with pytest.raises(UnknownSession):  # still invisible to others
        service.step("tenant-b", doomed, [1.0, 2.0])
    service.close("tenant-a", doomed)
    service.close("tenant-a", doomed)  # idempotent
    assert [s["session_id"] for s in service.sessions("tenant-a")] == [survivor]


@pytest.mark.timeout(120)
def test_hung_worker_times_out_is_reaped_and_batch_step_isolates_it():
    svc = EnvironmentService(step_timeout_s=1.0, reset_timeout_s=60.0)
    try:
        hung = svc.open_session("tenant-a", "r1", HANG)
        healthy = svc.open_session("tenant-a", "r2", PUSHT_STATE)
        svc.reset("tenant-a", hung)
        svc.reset("tenant-a", healthy)
        pid = {s["session_id"]: s["pid"] for s in svc.sessions("tenant-a")}[hung]

        # batch_step: all actions go out, then replies come back under one deadline.
        start = time.monotonic()
        out = svc.batch_step("tenant-a", {hung: [0.5], healthy: [100.0, 100.0], "env-nope": [0.0]})
        assert time.monotonic() - start < 10
        assert list(out) == [hung, healthy, "env-nope"]
        assert out[hung]["error_type"] == "SessionFailed"
        assert "step timed out after 1 s" in out[hung]["error"]
        check_step(out[healthy], 5, cameras=())
        assert out["env-nope"]["error_type"] == "UnknownSession"
        assert pid_gone(pid)  # killed and reaped, not a zombie

        # a hang on a plain step: same reason, and the service carries on
        hung2 = svc.open_session("tenant-a", "r3", HANG)
        svc.reset("tenant-a", hung2)
        with pytest.raises(SessionFailed, match=r"step timed out after 1 s"):
            svc.step("tenant-a", hung2, [0.0])
        check_step(svc.step("tenant-a", healthy, [1.0, 1.0]), 5, cameras=())
        assert [s["state"] for s in svc.sessions("tenant-a")] == ["ready", "failed", "failed"]
    finally:
        svc.close_all()


@register_simulator("test_slow_start")
class SlowStartAdapter(HangOnStepAdapter):
    """Builds slowly, like a simulator importing itself and building its scenes on a busy host."""

    def __init__(self, config):
        time.sleep(2.0)
        super().__init__(config)


def test_a_simulator_startup_gets_its_own_timeout_not_the_resets():
    svc = EnvironmentService(step_timeout_s=5.0, reset_timeout_s=0.5, startup_timeout_s=120.0)
    try:  # a spawn, imports and a 2 s build: far past the reset timeout, well within the startup one
        sid = svc.open_session("tenant-a", "slow", {"simulator": "test_slow_start", "task": "slow"})
        assert svc.spec("tenant-a", sid)["state_dim"] == 1
    finally:
        svc.close_all()
    quick = EnvironmentService(step_timeout_s=5.0, reset_timeout_s=120.0, startup_timeout_s=0.5)
    try:
        with pytest.raises(SessionFailed, match="simulator startup timed out"):
            quick.open_session("tenant-a", "slow", {"simulator": "test_slow_start", "task": "slow"})
    finally:
        quick.close_all()


def test_bad_actions_are_rejected_and_the_session_survives(service):
    sid = service.open_session("tenant-a", "r1", PUSHT_STATE)
    with pytest.raises(RuntimeError, match="reset"):
        service.step("tenant-a", sid, [1.0, 2.0])
    service.reset("tenant-a", sid)
    for bad, got in [
        ([1.0, 2.0, 3.0], r"got shape \(3,\)"),
        ([[1.0, 2.0]], r"got shape \(1, 2\)"),
        ([1.0, float("nan")], "non-finite"),
        (np.array([np.inf, 0.0]), "non-finite"),
        (["left", "up"], "not numeric"),
        (None, r"got shape \(\)"),
    ]:
        with pytest.raises(ValueError, match=r"action: expected .*\(2,\).*" + got):
            service.step("tenant-a", sid, bad)
    out = service.batch_step("tenant-a", {sid: [1.0]})
    assert out[sid]["error_type"] == "ValueError" and "action" in out[sid]["error"]
    with pytest.raises(ValueError, match="seed"):
        service.reset("tenant-a", sid, seed=-1)
    check_step(service.step("tenant-a", sid, np.array([1.0, 2.0], dtype=np.float32)), 5, cameras=())


def test_batch_step_steps_several_sessions(service):
    sids = [service.open_session("tenant-a", f"r{i}", PUSHT) for i in range(3)]
    for sid in sids:
        service.reset("tenant-a", sid, seed=0)
    for _ in range(3):
        out = service.batch_step("tenant-a", {sid: [256.0, 256.0] for sid in sids})
        assert list(out) == sids
        for result in out.values():
            check_step(result, 2)
    # same seed, same actions -> same observations: sessions do not share state
    first = out[sids[0]]["observation"]["state"]
    for sid in sids[1:]:
        np.testing.assert_array_equal(out[sid]["observation"]["state"], first)
    assert {s["steps"] for s in service.sessions("tenant-a")} == {3}


def test_session_limits():
    svc = EnvironmentService(max_sessions=2, max_sessions_per_tenant=1)
    try:
        svc.open_session("tenant-a", "r1", PUSHT_STATE)
        with pytest.raises(SessionLimitExceeded, match="tenant 'tenant-a' already has 1 sessions"):
            svc.open_session("tenant-a", "r2", PUSHT_STATE)
        b = svc.open_session("tenant-b", "r1", PUSHT_STATE)
        with pytest.raises(SessionLimitExceeded, match="max_sessions=2"):
            svc.open_session("tenant-c", "r1", PUSHT_STATE)
        svc.close("tenant-b", b)  # frees the slot
        svc.open_session("tenant-c", "r1", PUSHT_STATE)
    finally:
        svc.close_all()


def test_open_session_validates_before_starting_a_worker(service):
    with pytest.raises(ValueError, match="simulator='isaac'.*allowed simulators"):
        service.open_session("tenant-a", "r1", {"simulator": "isaac", "task": "x"})
    with pytest.raises(ValueError, match="tenant_id"):
        service.open_session("", "r1", PUSHT)
    # a config error found by the adapter, in the worker, comes back as a ValueError
    with pytest.raises(ValueError, match="cameras"):
        service.open_session("tenant-a", "r1", {**PUSHT, "cameras": ["wrist"]})
    assert service.sessions("tenant-a") == []


def test_close_is_idempotent_and_close_all_stops_every_worker(service):
    a = service.open_session("tenant-a", "r1", PUSHT_STATE)
    b = service.open_session("tenant-b", "r1", PUSHT_STATE)
    pids = [s["pid"] for t in ("tenant-a", "tenant-b") for s in service.sessions(t)]
    service.close("tenant-a", a)
    service.close("tenant-a", a)
    with pytest.raises(UnknownSession, match="was closed"):
        service.step("tenant-a", a, [1.0, 1.0])
    with pytest.raises(UnknownSession, match="unknown session"):  # B never owned it
        service.close("tenant-b", a)
    service.close_all()
    assert service.sessions("tenant-a") == service.sessions("tenant-b") == []
    assert all(pid_gone(pid) for pid in pids)
    with pytest.raises(UnknownSession):
        service.reset("tenant-b", b)


@pytest.mark.timeout(180)
def test_maniskill_sessions_and_asset_refusal_through_the_service(service):
    sid = service.open_session(
        "tenant-a", "r1", {"simulator": "maniskill", "task": "PushCube-v1", "cameras": ["base_camera"]}
    )
    spec = service.spec("tenant-a", sid)
    assert spec["instruction"] == "push the cube to the goal region" and spec["action_dim"] == 8
    check_obs(service.reset("tenant-a", sid), spec["state_dim"], ("base_camera",))
    for _ in range(3):
        check_step(service.step("tenant-a", sid, np.zeros(8)), spec["state_dim"], cameras=("base_camera",))

    # Refused in the worker (stdin is /dev/null there) with a clear error, and the slot is freed.
    start = time.monotonic()
    with pytest.raises(AssetDownloadRefused, match="PickSingleYCB-v1.*needs an asset download"):
        service.open_session("tenant-a", "r2", {"simulator": "maniskill", "task": "PickSingleYCB-v1"})
    assert time.monotonic() - start < 60
    assert [s["session_id"] for s in service.sessions("tenant-a")] == [sid]


def test_errors_and_wire_codec_round_trip():
    import pickle

    for exc in (UnknownSession("env-1"), UnknownSession("env-1", closed=True), SessionFailed("env-2", "why")):
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is type(exc) and str(again) == str(exc)
    refused = AssetDownloadRefused("maniskill", "PickSingleYCB-v1", ["ycb"])
    assert str(pickle.loads(pickle.dumps(refused))) == str(refused)

    msg = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": [1, 2.5, None, True, "x"], "c": {"d": np.bool_(1)}}
    out = unpack_message(pack_message(msg))
    np.testing.assert_array_equal(out["a"], msg["a"])
    assert out["a"].dtype == np.float32 and out["b"] == [1, 2.5, None, True, "x"] and out["c"] == {"d": True}
    with pytest.raises(TypeError):
        pack_message({"f": lambda: 0})
    with pytest.raises(TypeError):
        pack_message(np.array([object()]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_environment_service_as_a_named_ray_actor():
    ray = pytest.importorskip("ray")
    from joynexus.services.configs import EnvironmentServiceConfig

    ray.init(num_cpus=2, include_dashboard=False, namespace="joynexus-env-test")
    try:
        actor = EnvironmentServiceConfig(service_options={"step_timeout_s": 20.0}).actor(namespace="joynexus-env-test")
        again = EnvironmentServiceConfig().actor(namespace="joynexus-env-test")
        assert actor._actor_id == again._actor_id  # get-or-create
        a, b = ray.get(
            [actor.open_session.remote("tenant-a", "r1", PUSHT), actor.open_session.remote("tenant-b", "r1", PUSHT)]
        )
        ray.get([actor.reset.remote("tenant-a", a), actor.reset.remote("tenant-b", b)])
        ra, rb = ray.get([actor.step.remote("tenant-a", a, [1.0, 2.0]), actor.step.remote("tenant-b", b, [3.0, 4.0])])
        check_step(ra, 2)
        check_step(rb, 2)
        with pytest.raises(UnknownSession):
            ray.get(actor.step.remote("tenant-b", a, [1.0, 2.0]))
        ray.get(actor.close_all.remote())
    finally:
        ray.shutdown()
