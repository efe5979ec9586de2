"""Issue 43.6 on a real local Ray: what `ops/upgrade.py` does around the Master's drain. Every alive
node answers its release (a zero-CPU task pinned to it); every named actor of the deployment's
namespace is killed for good (no restart in place), another namespace's left alone; a driver of the
release the nodes run finds nothing to replace, and one of another release waits for nodes of its
own and names the old ones when its deadline passes."""

from __future__ import annotations

import time
import uuid

import pytest

from joynexus.actors import init_ray
from joynexus.ops.upgrade import kill_named_actors, node_releases, replace_older_release
from joynexus.settings import process_release

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    init_ray(num_cpus=1)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


class Resident:
    def ping(self) -> str:
        return "pong"


def _resident(name: str, namespace: str):
    cls = ray.remote(num_cpus=0, max_restarts=-1)(Resident)
    return cls.options(name=name, namespace=namespace, lifetime="detached").remote()


def test_each_node_reports_the_release_of_its_code(local_ray):
    releases = node_releases()
    assert releases and set(releases.values()) == {process_release()}, releases


def test_the_namespace_s_named_actors_are_killed_for_good_and_only_those(local_ray):
    namespace, other = f"upgrade-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    handles = [_resident("joynexus.master", namespace), _resident("joynexus.environment_service", namespace)]
    kept = _resident("joynexus.master", other)
    ray.get([h.ping.remote() for h in [*handles, kept]])
    assert kill_named_actors(namespace) == ["joynexus.environment_service", "joynexus.master"]
    time.sleep(1.0)  # an actor restarted in place (max_restarts=-1) would be back by name
    for name in ("joynexus.master", "joynexus.environment_service"):
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace=namespace)
    assert ray.get(kept.ping.remote()) == "pong"
    kill_named_actors(other)


def test_a_driver_of_the_running_release_replaces_nothing_and_one_of_another_waits_for_its_nodes(local_ray):
    namespace = f"upgrade-{uuid.uuid4().hex[:8]}"
    stages: list[str] = []
    assert replace_older_release(process_release(), namespace, time.monotonic() + 60, stages.append) is None
    assert stages == []
    with pytest.raises(SystemExit, match="Ray nodes of another release than 9.9.9-next still run"):
        replace_older_release("9.9.9-next", namespace, time.monotonic() + 3, stages.append)
    assert any("waiting for the Ray pods of release 9.9.9-next" in s for s in stages), stages
