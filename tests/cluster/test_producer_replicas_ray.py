"""Producer replicas on Ray (issue 40): the data loops run in `joynexus.producers-<i>`, not in the
Master. A Master restarted in place mid-workload does not interrupt a running producer (same
replica, same run of it); a producer replica killed mid-rollout has its tenant's workload moved to
the other replica, and the workload completes with 0 lost or reissued versions.

One deployment with two replicas in a namespace of its own; the kill test runs last (it leaves one
replica). Slow: a Ray deployment with both backbones on a small machine takes a minute to start.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from joynexus.ops.supervisor import remove_service_actors
from tests.api.test_ray_services import rl_spec
from tests.helpers import sft_spec, wait_for, write_dataset_for

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

FINAL = ("completed", "failed", "cancelled")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Any:
    from joynexus.connect import connect
    from joynexus.settings import Settings

    started_ray = not ray.is_initialized()
    namespace = f"test-producers-{uuid.uuid4().hex[:8]}"
    data_dir = tmp_path_factory.mktemp("producers-ray")
    settings = Settings(data_dir=data_dir, ray_namespace=namespace, torch_threads=1, producer_replicas=2)
    cluster = None
    try:
        cluster = connect(settings, mode="ray")
        yield cluster, settings
    finally:
        if cluster is not None:
            cluster.close()
        if ray.is_initialized():
            remove_service_actors(namespace)  # the producer replicas too
            if started_ray:
                ray.shutdown()


def replicas(namespace: str) -> dict[int, Any]:
    found = {}
    for i in range(2):
        try:
            found[i] = ray.get_actor(f"joynexus.producers-{i}", namespace=namespace)
        except ValueError:
            pass
    return found


def placement(namespace: str, workload_id: str) -> tuple[int, dict[str, Any]] | None:
    """(replica, its record of the workload) where the workload runs now."""
    for i, actor in replicas(namespace).items():
        try:
            work = ray.get(actor.work.remote(), timeout=30)
        except Exception:  # a replica being killed
            continue
        if work.get(workload_id, {}).get("state") == "running":
            return i, work[workload_id]
    return None


def master_call(cluster: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """A Master call that waits through the Master's restart in place."""
    deadline = time.monotonic() + 180
    while True:
        try:
            return getattr(cluster.master, method)(*args, **kwargs)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def wait_final(cluster: Any, workload_id: str, timeout_s: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        info = master_call(cluster, "get_workload", workload_id)
        if info.state in FINAL or time.monotonic() > deadline:
            return info
        time.sleep(0.3)


def assert_no_lost_or_reissued_version(cluster: Any, settings: Any, workload_id: str, first: int, jobs: int) -> None:
    """The Training Scheduler's record of the workload's completed jobs: each trained one new
    version, in order, none twice, none skipped, and the slot is at the last of them (a version
    trained for a job that was then trained again would show as a gap and a slot ahead)."""
    from joynexus.core.store import ControlPlaneStore
    from joynexus.scheduling.training_scheduler import TrainingScheduler

    store = ControlPlaneStore(settings.resolved_database_url())
    try:
        jobs_done = TrainingScheduler(store).jobs(states=["completed"])
        done = [j for j in jobs_done if j.metadata.get("workload_id") == workload_id]
    finally:
        store.dispose()
    versions = sorted(int(j.result["version"]) for j in done)
    assert versions == list(range(first + 1, first + jobs + 1)), versions
    tenant_id = master_call(cluster, "get_workload", workload_id).tenant_id
    assert cluster.training.policy_version(tenant_id) == first + jobs


def test_a_master_restart_does_not_interrupt_a_running_producer(deployment):
    cluster, settings = deployment
    namespace = settings.ray_namespace
    spec = sft_spec("pr-sft", settings.data_dir / "datasets" / "pr-sft", jobs=None, samples_per_job=8, max_in_flight=1)
    write_dataset_for(spec, episodes=2, length=8)
    cluster.master.create_tenant(spec)
    jobs = 10
    workload_id = cluster.master.submit_workload("pr-sft", jobs=jobs).workload_id
    replica, before = wait_for(lambda: placement(namespace, workload_id), "the producer on a replica", 120)
    wait_for(lambda: cluster.master.get_workload(workload_id).completed_jobs >= 2, "two jobs trained", 180)

    master = ray.get_actor("joynexus.master", namespace=namespace)
    incarnation = ray.get(master.ping.remote(), timeout=60)["incarnation"]
    ray.kill(master, no_restart=False)  # Ray restarts it in place; it reconciles and follows again
    wait_for(lambda: master_call(cluster, "ping")["incarnation"] != incarnation, "a new Master", 180)
    assert master_call(cluster, "get_workload", workload_id).state == "running"
    still = placement(namespace, workload_id)
    # The same run of the producer on the same replica: the restart did not stop or restart it.
    assert still is not None and still[0] == replica and still[1]["started_at"] == before["started_at"]

    info = wait_final(cluster, workload_id)
    assert info.state == "completed" and info.completed_jobs == jobs, info
    assert_no_lost_or_reissued_version(cluster, settings, workload_id, 0, jobs)
    events = master_call(cluster, "workload_events", workload_id)
    assert any(e["kind"] == "resumed" for e in events) and not any(e["kind"] == "producer_moved" for e in events)


def test_a_killed_producer_replica_moves_its_tenant_with_no_lost_or_reissued_version(deployment):
    from joynexus.core.store import ControlPlaneStore
    from joynexus.scheduling.training_scheduler import TrainingScheduler

    cluster, settings = deployment
    namespace = settings.ray_namespace
    spec = rl_spec("pr-rl")
    spec["scheduling"]["completion_target"] = None
    cluster.master.create_tenant(spec)
    jobs = 6
    workload_id = cluster.master.submit_workload("pr-rl", jobs=jobs).workload_id
    replica, _ = wait_for(lambda: placement(namespace, workload_id), "the rollout producer on a replica", 120)
    wait_for(lambda: cluster.master.get_workload(workload_id).completed_jobs >= 1, "one RL job trained", 180)
    store = ControlPlaneStore(settings.resolved_database_url())
    scheduler = TrainingScheduler(store)
    try:
        # Mid-rollout: the producer holds a reserved job whose trajectory it is collecting.
        wait_for(
            lambda: any(j.metadata.get("workload_id") == workload_id for j in scheduler.jobs(states=["reserved"])),
            "a rollout in progress", 120, poll_s=0.01,
        )  # fmt: skip
        ray.kill(replicas(namespace)[replica], no_restart=True)
        moved = wait_for(lambda: placement(namespace, workload_id), "the workload on the other replica", 120)
        assert moved[0] != replica
        info = wait_final(cluster, workload_id)
        assert info.state == "completed" and info.completed_jobs == jobs, info
        assert_no_lost_or_reissued_version(cluster, settings, workload_id, 0, jobs)
        events = master_call(cluster, "workload_events", workload_id)
        assert [e["replica"] for e in events if e["kind"] == "producer_moved"] == [moved[0]]
        # The job the killed producer was writing was released, not trained: its slot went back.
        released = [j for j in scheduler.jobs(tenant_id="pr-rl") if "replica was lost" in (j.terminal_reason or "")]
        assert len(released) == 1 and released[0].state == "failed"
        health = master_call(cluster, "health")["producers"]
        assert health["healthy"] and "1 of 2 producer replicas answer" in health["detail"]
    finally:
        store.dispose()
