"""Here or on Ray, in one place (issue 40, item 3): what differs between a local service and a named
Ray actor is asked of its `ServiceHandle` (`joynexus.actors`), never branched on by its callers."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future

import pytest

from joynexus.actors import ActorName, SerializedService, ServiceHandle, handle_of


class Echo:
    """A stand-in service with the shapes the helpers serve: a blocking call, one that hands out a
    future itself, a lock-free heartbeat and a close."""

    def __init__(self) -> None:
        self.closed = 0
        self.submitted: list[tuple] = []
        self.incarnation = uuid.uuid4().hex

    def predict(self, x: int, *, scale: int = 1) -> int:
        return x * scale

    def submit(self, x: int, *, scale: int = 1) -> Future:
        self.submitted.append((x, scale))
        done: Future = Future()
        done.set_result(-x * scale)  # told apart from predict's answer
        return done

    def submissions(self) -> int:
        return len(self.submitted)

    def cancel(self, tenant_id: str, key: str) -> bool:
        return key == "known"

    def heartbeat(self) -> dict:
        return {"incarnation": self.incarnation, "closed": self.closed}

    def close(self) -> None:
        self.closed += 1


def test_a_local_service_answers_the_questions_here():
    echo = Echo()
    handle = handle_of(echo)
    assert not handle.is_remote
    assert handle.start(Echo.predict, 3, scale=2).result(5) == 6  # on the local pool
    assert handle.start(Echo.predict, 3, locally=Echo.submit, scale=2).result(5) == -6  # its own future
    assert echo.submitted == [(3, 2)]
    assert handle.probe("cancel", 1.0, "acme", "known") is True
    assert handle.probe("cancel", 1.0, "acme", "other", wait=False) is False  # a local call always answers
    assert handle.restarting() is False
    assert not handle.restartable_in_place and handle.kill(restart=True) is False
    assert handle.constructor_argument("joynexus.echo", "ns") is echo  # itself, not its name
    assert handle.close_here() is True and echo.closed == 1
    # Behind a SerializedService's lock: the probe goes past the lock, close_here through it.
    locked = handle_of(SerializedService(Echo()))
    assert locked.probe("heartbeat", 1.0)["closed"] == 0 and locked.close_here() is True
    assert locked.probe("heartbeat", 1.0)["closed"] == 1


@pytest.mark.slow  # a Ray cluster in the test process: ~10-20 s
def test_a_ray_actor_answers_the_same_questions_on_ray():
    ray = pytest.importorskip("ray")
    from joynexus.actors import init_ray, named_actor

    init_ray(num_cpus=1)
    name, namespace = f"joynexus.echo-{uuid.uuid4().hex[:8]}", f"test-{uuid.uuid4().hex[:8]}"
    actor = named_actor(Echo, name, namespace=namespace, max_concurrency=2)
    handle = ServiceHandle(actor, timeout_s=60)
    try:
        assert handle.is_remote
        first = handle.heartbeat()["incarnation"]
        # On an actor `locally` is not used: the named method runs there.
        assert handle.start(Echo.predict, 3, locally=Echo.submit, scale=2).result(60) == 6
        assert handle.submissions() == 0
        assert handle.probe("cancel", 60.0, "acme", "known") is True
        assert handle.probe("cancel", 60.0, "acme", "known", wait=False) is None  # sent, not waited for
        assert handle.constructor_argument(name, namespace) == ActorName(name, namespace)
        assert handle.close_here() is False and handle.heartbeat()["closed"] == 0  # its life is its cluster's
        assert handle.restartable_in_place and handle.kill(restart=True) is True
        deadline = time.monotonic() + 60
        while True:  # Ray starts it again in place, under the same name: a new incarnation answers
            try:
                beat = ServiceHandle(ray.get_actor(name, namespace=namespace), timeout_s=10).heartbeat()
                if beat["incarnation"] != first:
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline, "the killed actor was not restarted in place"
            time.sleep(0.5)
        assert handle.restarting() is False
    finally:
        ray.kill(actor, no_restart=True)
