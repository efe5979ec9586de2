"""Environment image-size limits (issue 11): sessions asking for oversized camera images are refused
at open, before a worker starts, naming the field and the limit; workload specs with a simulator
are checked against the same (default) limits. Also the Environment Service's heartbeat.

Real gym-pusht sessions where a worker is needed; `HoldStepAdapter` below blocks a step until told,
so the heartbeat can be asked while a step is provably in flight (workers import this module to
find it)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from joynexus.envs import (
    MAX_IMAGE_PIXELS,
    MAX_IMAGE_SIDE,
    EnvObservation,
    SimulatorAdapter,
    SimulatorSpec,
    StepResult,
    image_size_problem,
    register_simulator,
)
from joynexus.envs.base import observation_bytes
from joynexus.services.environment.service import EnvironmentService, SessionFailed
from joynexus.spec import SpecError, parse_workload_spec


@register_simulator("test_hold_step")
class HoldStepAdapter(SimulatorAdapter):
    """Steps block (the worker's stdin is /dev/null, so it sleeps) until the step times out."""

    def __init__(self, config):
        super().__init__(config)
        self.spec = SimulatorSpec(
            simulator=self.name,
            task=config.task,
            instruction="hold",
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
        return EnvObservation(images={}, state=np.zeros(1, np.float32), instruction="hold")

    def _step(self, action) -> StepResult:
        threading.Event().wait()  # forever: the service times the step out and kills this worker
        raise AssertionError("unreachable")

    def close(self):
        pass


def pusht(image_size, cameras=("top",)) -> dict:
    return {"simulator": "pusht", "task": "PushT-v0", "cameras": list(cameras), "image_size": list(image_size)}


@pytest.fixture
def service():
    svc = EnvironmentService(step_timeout_s=20.0, reset_timeout_s=120.0)
    yield svc
    svc.close_all()


@pytest.mark.parametrize(
    "image_size, cameras, reason",
    [
        ((8, MAX_IMAGE_SIDE + 1), ("top",), r"8x1025 has a side over the limit of 1024 pixels \(max_image_side\)"),
        (
            (2048, 2048),
            (),
            r"2048x2048 has a side over the limit of 1024",
        ),  # state only: the env is still built that size
        ((513, 512), ("top",), r"513x512 is 262656 pixels per camera, over the limit of 262144 \(max_image_pixels\)"),
    ],
    ids=["side", "side-without-cameras", "pixels"],
)
def test_oversized_images_are_refused_at_open_naming_the_field_and_the_limit(service, image_size, cameras, reason):
    with pytest.raises(ValueError, match=r"^config\.image_size: " + reason):
        service.open_session("tenant-a", "r1", pusht(image_size, cameras))
    assert service.sessions("tenant-a") == [] and service.heartbeat()["sessions"] == 0  # no worker started


def test_the_limits_are_configurable_and_an_image_at_the_limit_is_served():
    exact = observation_bytes(1, (96, 128))
    svc = EnvironmentService(max_observation_bytes=exact, max_image_side=128)
    try:
        with pytest.raises(
            ValueError, match=r"^config\.image_size: 1 cameras of 3x104x128 float32 .*max_observation_bytes"
        ):
            svc.open_session("tenant-a", "r1", pusht((104, 128)))
        with pytest.raises(ValueError, match=r"^config\.image_size: 96x130 has a side over the limit of 128"):
            svc.open_session("tenant-a", "r1", pusht((96, 130)))
        sid = svc.open_session("tenant-a", "r1", pusht((96, 128)))  # exactly at the bytes limit: allowed
        image = svc.reset("tenant-a", sid, seed=0)["images"]["top"]
        assert image.shape == (3, 96, 128) and image.dtype == np.float32 and image.nbytes == exact
        # The bytes limit counts cameras: without one, a larger size is within it.
        assert svc.open_session("tenant-a", "r2", pusht((104, 128), cameras=()))
    finally:
        svc.close_all()
    for name in ("max_image_side", "max_image_pixels", "max_observation_bytes"):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got 0"):
            EnvironmentService(**{name: 0})


def test_limit_rule_counts_every_camera_as_float32():
    assert observation_bytes(3, (512, 512)) == 3 * 3 * 512 * 512 * 4
    assert image_size_problem((512, 512), 2) is None  # 6 MiB: within the default 8 MiB
    assert "9 MiB per observation, over the limit of 8 MiB" in image_size_problem((512, 512), 3)
    assert image_size_problem((MAX_IMAGE_PIXELS // 1024, 1024), 1) is None


def rl_spec(image_size, cameras=("top",), environment=True) -> dict:
    spec = {
        "tenant": "pusher",
        "base_model": "joynexus/tiny-smolvlm",
        "task": "rl" if environment else "eval",
        "observation": {"cameras": list(cameras), "image_size": list(image_size), "state_dim": 2, "action_dim": 2},
    }
    if environment:
        spec["environment"] = {"simulator": "pusht", "task": "PushT-v0"}
    return spec


def test_workload_specs_with_a_simulator_are_checked_against_the_limits():
    with pytest.raises(SpecError) as refused:
        parse_workload_spec(rl_spec((600, 600)))
    assert refused.value.fields == ["environment"]
    assert "observation.image_size [600, 600] for the simulator" in str(refused.value)
    assert "over the limit of 262144 (max_image_pixels)" in str(refused.value)
    with pytest.raises(SpecError, match=r"3 cameras of 3x512x512 float32 are 9 MiB .*max_observation_bytes"):
        parse_workload_spec(rl_spec((512, 512), cameras=("a", "b", "c")))
    assert parse_workload_spec(rl_spec((512, 512), cameras=("a", "b"))).environment is not None
    # Without a simulator the images come from the tenant's data: only the observation's own rule holds.
    assert parse_workload_spec(rl_spec((600, 600), environment=False)).observation.image_size == (600, 600)


# -- heartbeat ----------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_heartbeat_answers_while_a_step_runs_and_a_new_instance_has_a_new_incarnation():
    svc = EnvironmentService(step_timeout_s=3.0)
    other = EnvironmentService()
    try:
        beat = svc.heartbeat()
        assert beat == {
            "role": "environment",
            "incarnation": beat["incarnation"],
            "started_at": beat["started_at"],
            "pid": os.getpid(),
            "tenants": [],
            "sessions": 0,
            "warm_workers": 0,
            "sessions_opened": {"fresh": 0, "warm": 0},
        }
        assert len(beat["incarnation"]) == 12 and beat["started_at"] > 0
        assert other.heartbeat()["incarnation"] != beat["incarnation"]

        held = svc.open_session("tenant-b", "r1", {"simulator": "test_hold_step", "task": "hold"})
        svc.open_session("tenant-a", "r1", pusht((32, 32), cameras=()))
        svc.reset("tenant-b", held)
        outcome: list[BaseException] = []

        def step() -> None:
            try:
                svc.step("tenant-b", held, [0.0])
            except BaseException as error:
                outcome.append(error)

        stepping = threading.Thread(target=step)
        stepping.start()
        session = svc._sessions[held]
        while stepping.is_alive() and not session.lock.locked():  # the step holds its session's lock
            threading.Event().wait(0.01)
        assert session.lock.locked()
        answered: list[dict] = []
        probe = threading.Thread(target=lambda: answered.append(svc.heartbeat()))
        probe.start()
        probe.join(timeout=2.0)  # inside the 3 s step that is still running
        assert answered and answered[0]["tenants"] == ["tenant-a", "tenant-b"] and answered[0]["sessions"] == 2
        assert answered[0]["incarnation"] == beat["incarnation"]
        stepping.join(timeout=60)
        assert len(outcome) == 1 and isinstance(outcome[0], SessionFailed), outcome
        assert svc.heartbeat()["sessions"] == 1  # the hung step failed its session, freeing the slot
    finally:
        svc.close_all()
        other.close_all()
