"""Chaos: the control plane survives a crash of the Master Service.

A deployment process is SIGKILLed in the middle of a workload and a new Master Service starts on
the same data dir; or a crashed Master's store state is built directly (a workload `running` with
recorded progress, leases held by a dead owner, a reserved job without data) and a Master starts
on it. The checks are on the store, the policy versions and the weight digests: the admission
queue and workload state survive, running workloads resume, dead leases are re-queued or failed
(bounded), a cancelled workload releases its jobs, no tenant is left blocked by orphan jobs, and
no version number is ever issued again with other weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update

from joynexus.artifacts import CheckpointStore
from joynexus.connect import Cluster, in_process
from joynexus.core.store import ControlPlaneStore, TrainingJobRecord, WorkloadEventRecord, WorkloadRecord, utcnow
from joynexus.master.deployment import Deployment
from joynexus.master.service import MasterService
from joynexus.scheduling.training_scheduler import TERMINAL_STATES, TrainingScheduler
from joynexus.services.producers.sft import SFTProducer
from joynexus.settings import Settings
from tests.helpers import sft_spec, write_dataset_for
from tests.master.chaos_worker import export_digest, weights_digest

REPO = Path(__file__).resolve().parents[2]
FINAL = ("completed", "failed", "cancelled")


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """alpha: jobs of 6 optimizer steps, checkpointed every 3rd job (so some issued versions have
    no checkpoint); beta: another schema, a checkpoint per job."""
    root = tmp_path_factory.mktemp("chaos-datasets")
    alpha = sft_spec("alpha", root / "alpha", jobs=None, samples_per_job=48, microbatch_size=8)
    alpha["training"]["checkpoint_every_jobs"] = 3
    beta = sft_spec(
        "beta", root / "beta", jobs=None, cameras=("top",), image_size=(24, 40), state_dim=6, action_dim=5,
        action_chunk=4, samples_per_job=8, microbatch_size=8,
    )  # fmt: skip
    for i, spec in enumerate((alpha, beta)):
        write_dataset_for(spec, episodes=2, length=12, seed=i)
    return {"alpha": alpha, "beta": beta}


def settings_for(data_dir: Path) -> Settings:
    return Settings(data_dir=data_dir, torch_threads=1)


def wait_all(cluster: Cluster, workload_ids: list[str], *, timeout_s: float = 240.0, observe=None) -> dict[str, Any]:
    """Wait for every workload to end, calling `observe()` between polls; {workload_id: status}."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = {w: cluster.master.get_workload(w) for w in workload_ids}
        if all(s.state in FINAL for s in statuses.values()):
            return statuses
        if time.monotonic() > deadline:
            raise AssertionError(f"workloads not finished after {timeout_s} s: {statuses}")
        if observe is not None:
            observe()
        time.sleep(0.02)


def events(store: ControlPlaneStore, workload_id: str) -> list[tuple[int, str, dict[str, Any]]]:
    query = select(WorkloadEventRecord).where(WorkloadEventRecord.workload_id == workload_id)
    with store.transaction() as s:
        return [(e.seq, e.kind, dict(e.data or {})) for e in s.scalars(query.order_by(WorkloadEventRecord.seq))]


def max_event_seq(store: ControlPlaneStore) -> int:
    with store.transaction() as s:
        return int(s.scalar(select(func.max(WorkloadEventRecord.seq))) or 0)


def jobs_of(scheduler: TrainingScheduler, workload_id: str) -> list[Any]:
    return [j for j in scheduler.jobs() if j.metadata.get("workload_id") == workload_id]


def checkpoint_weights(checkpoints: CheckpointStore, tenant_id: str) -> dict[int, str]:
    return {v: weights_digest(checkpoints.load_tenant(tenant_id, v)[1]) for v in checkpoints.versions(tenant_id)}


def assert_one_weight_per_version(*observations: tuple[str, int, str]) -> None:
    """No version number maps to two different sets of weights, whoever observed it."""
    seen: dict[int, tuple[str, str]] = {}
    for source, version, digest in observations:
        if version in seen:
            first_source, first = seen[version]
            assert digest == first, f"version {version}: {first_source} saw {first[:12]}, {source} saw {digest[:12]}"
        else:
            seen[version] = (source, digest)


def assert_no_dead_owner(cluster: Cluster) -> None:
    """Every job that is not terminal is unleased or leased by THIS Master's actor loop / stage."""
    manager = cluster.master.workloads
    alive = {None, *manager.live_owners()}
    stuck = [
        (j.job_id, j.state, j.lease_owner)
        for j in cluster.master.deployment.scheduler.jobs()
        if j.state not in TERMINAL_STATES and j.lease_owner not in alive
    ]
    assert stuck == [], f"jobs left to a dead owner: {stuck}"


# -- a real SIGKILL -------------------------------------------------------------------------------
def test_sigkill_mid_workload_then_restart_resumes_without_reissuing_a_version(tmp_path, specs):
    data_dir = tmp_path / "data"
    plan = {
        "data_dir": str(data_dir),
        "specs": [specs["alpha"], specs["beta"]],
        # alpha's second workload waits in the admission queue behind its first.
        "workloads": [["alpha", 10], ["alpha", 2], ["beta", 3]],
    }
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    lines: list[dict[str, Any]] = []
    with open(tmp_path / "worker.log", "w") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.master.chaos_worker", str(plan_path)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True,
        )  # fmt: skip

        def read() -> None:
            for line in child.stdout:
                if line.startswith("{"):
                    lines.append(json.loads(line))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 180
            while not any(e["event"] == "submitted" for e in lines):
                assert child.poll() is None, f"the worker exited: {(tmp_path / 'worker.log').read_text()[-3000:]}"
                assert time.monotonic() < deadline, "the worker did not submit its workloads"
                time.sleep(0.05)
            submitted = next(e for e in lines if e["event"] == "submitted")["workloads"]
            a1, a2, b1 = (w["workload_id"] for w in submitted)
            assert [w["state"] for w in submitted] == ["running", "queued", "running"]
            assert submitted[1]["position"] == 1

            # Wait until alpha has completed 4 of its 10 jobs (one checkpoint, at its 3rd job).
            store = ControlPlaneStore(settings_for(data_dir).resolved_database_url())
            completed_alpha = (
                select(func.count())
                .select_from(TrainingJobRecord)
                .where(TrainingJobRecord.tenant_id == "alpha", TrainingJobRecord.state == "completed")
            )
            while True:
                with store.transaction() as s:
                    done = int(s.scalar(completed_alpha) or 0)
                if done >= 4:
                    break
                assert child.poll() is None, f"the worker exited: {(tmp_path / 'worker.log').read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"alpha completed only {done} jobs"
                time.sleep(0.01)
            store.dispose()
            # Freeze it, take what the crashed process leaves behind, then kill it.
            os.kill(child.pid, signal.SIGSTOP)
            checkpoints = CheckpointStore(data_dir / "checkpoints")
            mark = checkpoints.issued_version("alpha")
            pre_manifests = {v: checkpoints.read_manifest("alpha", v).digest for v in checkpoints.versions("alpha")}
            pre_weights = checkpoint_weights(checkpoints, "alpha")
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=60)
            reader.join(timeout=10)
    assert child.returncode == -signal.SIGKILL
    exported = [(e["version"], e["weights"]) for e in lines if e["event"] == "export" and e["tenant_id"] == "alpha"]

    assert mark is not None and mark >= 4 and pre_manifests, (mark, pre_manifests)
    assert 3 in pre_manifests and max(pre_manifests) <= mark
    # Issued is durable BEFORE anything shows a version: nothing the dead process exported is above it.
    assert exported and max(v for v, _ in exported) <= mark

    store = ControlPlaneStore(settings_for(data_dir).resolved_database_url())
    scheduler = TrainingScheduler(store)
    with store.transaction() as s:
        states = {r.workload_id: (r.state, r.completed_jobs) for r in s.scalars(select(WorkloadRecord))}
    assert states[a1][0] == "running" and states[a1][1] >= 2 and states[a2] == ("queued", 0)
    orphans = [j for j in scheduler.jobs() if j.state not in TERMINAL_STATES]
    last_seq = max_event_seq(store)
    store.dispose()

    cluster = in_process(settings_for(data_dir))
    try:
        master = cluster.master
        report = master.last_reconcile
        assert master.ping()["reconciled"] == report
        assert a1 in report["resumed"] and report["failed"] == []
        assert (b1 in report["resumed"]) == (states[b1][0] == "running")
        # The in-process Training Queue died with the process: every job it held data for is released.
        assert report["requeued"] == []
        assert {j.job_id for j in orphans} <= set(report["released"])
        assert_no_dead_owner(cluster)
        sched = master.deployment.scheduler
        for job in orphans:
            after = sched.get(job.job_id)
            assert after.state == "failed" and ("restart" in after.terminal_reason or "gone" in after.terminal_reason)

        seen_after: list[tuple[int, str]] = []

        def observe() -> None:
            seen_after.append(export_digest(cluster.training, "alpha"))

        final = wait_all(cluster, [a1, a2, b1], observe=observe)
        seen_after.append(export_digest(cluster.training, "alpha"))
        assert final[a1].state == "completed" and final[a1].completed_jobs == final[a1].target_jobs == 10
        assert final[a2].state == "completed" and final[a2].completed_jobs == 2
        assert final[b1].state == "completed" and final[b1].completed_jobs == 3

        dep_store = master.deployment.store
        # The queued workload survived the crash in the admission queue and started after the restart,
        # behind alpha's first; its jobs were admitted (the tenant was not blocked by orphans).
        started = [seq for seq, kind, _ in events(dep_store, a2) if kind == "started"]
        assert len(started) == 1 and started[0] > last_seq
        assert final[a2].started_at >= final[a1].finished_at
        assert [j.state for j in jobs_of(sched, a2)].count("completed") == 2
        starts = [kind for _, kind, _ in events(dep_store, a1) if kind in ("started", "resumed")]
        assert starts == ["started", "resumed"]

        # Every version alpha issued after the restart is above the mark taken before the kill.
        issued_after = [
            data["version"]
            for w in (a1, a2)
            for seq, kind, data in events(dep_store, w)
            if kind == "job_completed" and seq > last_seq
        ]
        assert issued_after and min(issued_after) > mark
        post_versions = cluster.checkpoints.versions("alpha")
        assert set(pre_manifests) <= set(post_versions)
        assert all(v > mark for v in set(post_versions) - set(pre_manifests))
        # Versions at or below the mark that show up after the restart are restored checkpoints, as saved.
        assert all(v in pre_weights for v, _ in seen_after if v <= mark)
        assert seen_after[-1][0] == final[a2].version > mark
        # Digests: a checkpoint never changes, and no version number means two sets of weights.
        assert {v: cluster.checkpoints.read_manifest("alpha", v).digest for v in pre_manifests} == pre_manifests
        post_weights = checkpoint_weights(cluster.checkpoints, "alpha")
        assert_one_weight_per_version(
            *(("export before the kill", v, d) for v, d in exported),
            *(("checkpoint before the kill", v, d) for v, d in pre_weights.items()),
            *(("checkpoint after the restart", v, d) for v, d in post_weights.items()),
            *(("export after the restart", v, d) for v, d in seen_after),
        )
        assert_no_dead_owner(cluster)
        assert all(j.state in TERMINAL_STATES for j in sched.jobs())
    finally:
        cluster.close()


# -- crashed states built directly ----------------------------------------------------------------
def _dead_master_jobs(dep: Deployment, spec: dict[str, Any], workload_id: str) -> SFTProducer:
    """What the dead Master's SFT producer had: a policy without a bound and a producer of the workload."""
    tenant = dep.creator.get(spec["tenant"])
    dep.scheduler.register_policy(spec["tenant"], "sft", max_in_flight=8, completion_target=None)
    return SFTProducer.from_dataset(
        tenant.backend_config, dep.scheduler, dep.queue, spec["dataset"]["root"], spec["dataset"]["repo_id"],
        job_metadata={"workload_id": workload_id},
    )  # fmt: skip


def _add_workload(dep: Deployment, workload_id: str, tenant_id: str, state: str, target: int, **progress: Any) -> None:
    with dep.store.transaction() as s:
        s.add(
            WorkloadRecord(
                workload_id=workload_id, tenant_id=tenant_id, task="sft", state=state, target_jobs=target,
                started_at=utcnow() if state != "queued" else None, **progress,
            )
        )  # fmt: skip
    time.sleep(0.01)  # created_at orders the admission queue


def test_leases_of_a_dead_owner_are_requeued_with_bounded_retries_when_the_queue_survived(tmp_path, specs):
    """As in a Ray deployment, where the Training Queue actor outlives the Master: a dead owner's
    leased job whose partition survived is re-queued (keeping its place) and trained; one that was
    re-queued too often fails; a reserved job without data and a job of an ended workload are released."""
    dep = Deployment.in_process(settings_for(tmp_path / "data"))
    dep.creator.create(specs["alpha"])
    producer = _dead_master_jobs(dep, specs["alpha"], "wl-running")
    first, second, third = (producer.produce_once() for _ in range(3))
    dead = "master-dead0000/actor"
    assert dep.scheduler.lease_next(owner=dead).job_id == first.job_id
    assert dep.scheduler.lease_next(owner=dead).job_id == second.job_id
    with dep.store.transaction() as s:  # `second` was already re-queued max_job_attempts (3) times
        s.execute(update(TrainingJobRecord).where(TrainingJobRecord.job_id == second.job_id).values(attempts=3))
    unwritten = dep.scheduler.reserve(
        tenant_id="alpha", task_type="sft", sample_count=48, metadata={"workload_id": "wl-running"}
    )
    ended = _dead_master_jobs(dep, specs["alpha"], "wl-cancelled").produce_once()
    _add_workload(dep, "wl-cancelled", "alpha", "cancelled", 5)
    _add_workload(dep, "wl-running", "alpha", "running", 3)

    master = MasterService(deployment=dep)
    try:
        report = master.last_reconcile
        assert report["requeued"] == [first.job_id]
        assert {second.job_id, unwritten.job_id, ended.job_id} <= set(report["released"])
        assert report["resumed"] == ["wl-running"] and report["failed"] == []
        sched = dep.scheduler
        assert "retries exhausted (4 > 3)" in sched.get(second.job_id).terminal_reason
        assert sched.get(unwritten.job_id).state == "failed"
        assert sched.get(ended.job_id).state == "failed" and not dep.queue.has_partition(ended.partition_id)
        assert dead not in {j.lease_owner for j in sched.jobs() if j.state not in TERMINAL_STATES}

        status = master.workloads.wait("wl-running", 120)
        assert status.state == "completed" and status.completed_jobs == 3
        requeued = sched.get(first.job_id)
        assert (requeued.state, requeued.attempts, requeued.ready_seq) == ("completed", 1, first.ready_seq)
        assert sched.get(third.job_id).state == "completed"
        assert all(j.state in TERMINAL_STATES for j in sched.jobs())
        assert dep.queue.partitions() == []
    finally:
        master.close()


def test_a_simulated_crash_resumes_from_the_store_never_reissues_versions_and_cancel_releases(tmp_path, specs):
    """The dead Master trained 4 jobs of a 6-job workload (checkpoint at v3), trained a 5th (v5
    issued and exported) but died before completing it, and left a ready job; a second workload of
    alpha and one of beta were waiting. A new process on the same data dir resumes and finishes all
    of it, numbering after v5; then a cancelled workload releases its jobs and the next one runs."""
    settings = settings_for(tmp_path / "data")
    dep = Deployment.in_process(settings)
    for spec in specs.values():
        dep.creator.create(spec)
    dep.training_service.add_tenant(dep.creator.get("alpha").backend_config)
    producer = _dead_master_jobs(dep, specs["alpha"], "wl-crashed")
    dead = "master-dead0000/actor"
    for _ in range(4):
        producer.produce_once()
        job = dep.scheduler.lease_next(owner=dead)
        dep.scheduler.complete(job.job_id, dep.training_service.train_job(job), owner=dead)
    producer.produce_once()
    in_training = dep.scheduler.lease_next(owner=dead)
    assert dep.training_service.train_job(in_training)["version"] == 5  # trained, never completed
    exported_v5 = export_digest(dep.training_service, "alpha")
    ready = producer.produce_once()
    _add_workload(dep, "wl-crashed", "alpha", "running", 6, completed_jobs=4, version=4, optimizer_steps=24)
    _add_workload(dep, "wl-next", "alpha", "queued", 1)
    _add_workload(dep, "wl-beta", "beta", "queued", 2)
    checkpoints = dep.checkpoints
    assert (checkpoints.versions("alpha"), checkpoints.issued_version("alpha")) == ([3], 5)
    pre_weights = checkpoint_weights(checkpoints, "alpha")
    pre_digest = checkpoints.read_manifest("alpha", 3).digest
    last_seq = max_event_seq(dep.store)
    dep.shutdown()  # the process is gone: its Training Queue and slots with it

    cluster = in_process(settings)
    try:
        master, sched = cluster.master, cluster.master.deployment.scheduler
        report = master.last_reconcile
        assert report["resumed"] == ["wl-crashed"] and report["failed"] == [] and report["requeued"] == []
        assert {in_training.job_id, ready.job_id} <= set(report["released"])
        assert "is lost" in sched.get(in_training.job_id).terminal_reason
        assert_no_dead_owner(cluster)
        resumed = [d for _, kind, d in events(master.deployment.store, "wl-crashed") if kind == "resumed"]
        assert resumed == [{"version": 3}]  # restored from the LATEST checkpoint

        seen_after: list[tuple[int, str]] = []
        final = wait_all(
            cluster, ["wl-crashed", "wl-next", "wl-beta"], observe=lambda: seen_after.append(
                export_digest(cluster.training, "alpha"))
        )  # fmt: skip
        seen_after.append(export_digest(cluster.training, "alpha"))
        assert [final[w].state for w in ("wl-crashed", "wl-next", "wl-beta")] == ["completed"] * 3
        assert (final["wl-crashed"].completed_jobs, final["wl-next"].completed_jobs) == (6, 1)
        assert final["wl-beta"].completed_jobs == 2
        issued_after = [
            d["version"]
            for w in ("wl-crashed", "wl-next")
            for seq, kind, d in events(master.deployment.store, w)
            if kind == "job_completed" and seq > last_seq
        ]
        assert sorted(issued_after) == [6, 7, 8]  # 4 and 5 were issued by the dead process: skipped
        assert final["wl-next"].version == 8 and cluster.checkpoints.issued_version("alpha") == 8
        assert not {4, 5} & set(cluster.checkpoints.versions("alpha"))
        assert cluster.checkpoints.read_manifest("alpha", 3).digest == pre_digest
        post_weights = checkpoint_weights(cluster.checkpoints, "alpha")
        assert_one_weight_per_version(
            ("export before the crash", *exported_v5),
            *(("checkpoint before the crash", v, d) for v, d in pre_weights.items()),
            *(("checkpoint after the restart", v, d) for v, d in post_weights.items()),
            *(("export after the restart", v, d) for v, d in seen_after),
        )
        assert all(v == 3 or v > 5 for v, _ in seen_after)

        # A cancelled workload (in this fresh Master) releases its jobs; the tenant's next one runs.
        big = master.submit_workload("alpha", jobs=500)
        deadline = time.monotonic() + 60
        while not jobs_of(sched, big.workload_id):
            assert time.monotonic() < deadline, "the workload got no jobs"
            time.sleep(0.01)
        assert master.cancel_workload(big.workload_id).state == "cancelled"
        big_jobs = jobs_of(sched, big.workload_id)
        assert big_jobs and all(sched.get(j.job_id).state in TERMINAL_STATES for j in big_jobs)
        assert not any(cluster.queue.has_partition(j.partition_id) for j in big_jobs)
        after = master.submit_workload("alpha", jobs=1)
        done = cluster.wait_workload(after.workload_id, 120)
        assert done.state == "completed" and done.completed_jobs == 1
        assert [j.state for j in jobs_of(sched, after.workload_id)] == ["completed"]
        assert all(j.state in TERMINAL_STATES for j in sched.jobs())
        assert_no_dead_owner(cluster)
    finally:
        cluster.close()


def test_a_job_taken_back_from_a_replaced_owner_is_read_from_its_start(tmp_path, specs):
    """A loop replaced as hung may still be reading its job's partition (slow, not dead): whatever it
    consumed, the job re-queued for the replacement trains on every sample of its partition, not on
    what the retired reader left (it failed with "holds no samples" when the cursor was shared)."""
    dep = Deployment.in_process(settings_for(tmp_path / "data"))
    try:
        dep.creator.create(specs["alpha"])
        dep.training_service.add_tenant(dep.creator.get("alpha").backend_config)
        producer = _dead_master_jobs(dep, specs["alpha"], "wl-replaced")
        producer.produce_once()
        retired, replacement = "master-0/actor-retired", "master-0/actor-replacement"
        job = dep.scheduler.lease_next(owner=retired)
        first = dep.training_service.train_job(job)  # the retired loop read the whole partition
        (requeued,) = dep.scheduler.recover_orphans([replacement], has_partition=dep.queue.has_partition)
        assert requeued.attempts == 1 and requeued.state == "ready"
        again = dep.scheduler.lease_next(owner=replacement)
        assert again.job_id == job.job_id
        second = dep.training_service.train_job(again)
        assert second["samples"] == first["samples"] == job.sample_count
        dep.scheduler.complete(again.job_id, {"samples": second["samples"]}, owner=replacement)
        assert dep.scheduler.get(job.job_id).state == "completed"
    finally:
        dep.shutdown()
