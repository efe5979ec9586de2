"""Workload orchestrator: shared actor loop, admission queue with positions, cancel, failure
isolation, publication to MLflow and the Inference Model Service."""

from __future__ import annotations

import shutil

import pytest

from joynexus.master.deployment import Deployment
from joynexus.master.workloads.manager import AdmissionRefused, UnknownWorkload, WorkloadManager
from joynexus.settings import Settings
from tests.helpers import TINY_MODEL_ID, sft_spec, write_dataset_for

SHAPES = {
    "alpha": dict(cameras=("front", "wrist"), image_size=(32, 32), state_dim=4, action_dim=3, action_chunk=2),
    "beta": dict(cameras=("top",), image_size=(24, 40), state_dim=6, action_dim=5, action_chunk=4,
                 module="flow_matching"),
}  # fmt: skip


@pytest.fixture(scope="module")
def dataset_roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("wl-datasets")
    specs = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        spec = sft_spec(name, root / name, jobs=3, base_model=TINY_MODEL_ID, **shape)
        write_dataset_for(spec, seed=i)
        specs[name] = spec
    return specs


@pytest.fixture
def deployment(tmp_path, dataset_roots):
    dep = Deployment.in_process(Settings(data_dir=tmp_path / "data", torch_threads=1))
    for spec in dataset_roots.values():
        dep.creator.create(spec)
    yield dep
    dep.shutdown()


def test_workloads_of_two_tenants_run_together_and_publish(deployment):
    manager = WorkloadManager(deployment).start()
    try:
        a = manager.submit("alpha", jobs=2)
        b = manager.submit("beta", jobs=3)
        final = {s.tenant_id: s for s in manager.wait_all([a.workload_id, b.workload_id], timeout_s=300)}
    finally:
        manager.stop()
    assert final["alpha"].state == final["beta"].state == "completed"
    assert (final["alpha"].completed_jobs, final["alpha"].version) == (2, 2)
    assert (final["beta"].completed_jobs, final["beta"].version) == (3, 3)
    assert final["alpha"].registered_version == final["beta"].registered_version == 1
    assert deployment.inference_service.versions("alpha") == [2]  # the trained policy is being served
    assert deployment.queue.partitions() == []
    steps = [e for e in manager.events(a.workload_id) if e["kind"] == "step"]
    assert len(steps) == final["alpha"].optimizer_steps == 4 and [e["seq"] for e in steps] == sorted(
        e["seq"] for e in steps
    )
    with pytest.raises(UnknownWorkload):
        manager.get(a.workload_id, tenant_id="beta")  # another tenant's workload looks missing


def test_a_second_workload_of_a_tenant_waits_with_a_position_then_runs(deployment):
    manager = WorkloadManager(deployment, max_running=1).start()
    try:
        first = manager.submit("alpha", jobs=1)
        second = manager.submit("alpha", jobs=1)
        third = manager.submit("beta", jobs=1)
        assert manager.get(second.workload_id).position == 1 and manager.get(third.workload_id).position == 2
        done = manager.wait_all([first.workload_id, second.workload_id, third.workload_id], timeout_s=300)
    finally:
        manager.stop()
    assert [s.state for s in done] == ["completed"] * 3
    assert done[1].version == 2  # the second continued where the first stopped
    assert done[0].finished_at <= done[1].started_at


def test_a_workload_of_more_jobs_than_the_specs_target_runs_them_all(deployment):
    # The launch re-registers the tenant's training policy with THIS workload's target on top of the
    # jobs completed before; the policy from tenant creation (spec target 3) would stop it at 3.
    manager = WorkloadManager(deployment).start()
    try:
        status = manager.wait(manager.submit("alpha", jobs=4).workload_id, timeout_s=300)
    finally:
        manager.stop()
    assert status.state == "completed" and status.completed_jobs == 4


def test_cancel_stops_a_running_workload_and_releases_its_jobs(deployment):
    manager = WorkloadManager(deployment)  # actor loop not started: jobs stay pending
    queued = manager.submit("beta", jobs=2)
    running = manager.submit("alpha", jobs=50)
    waiting = manager.submit("alpha", jobs=1)
    assert manager.get(waiting.workload_id).state == "queued"
    assert manager.cancel(waiting.workload_id).state == "cancelled"
    status = manager.cancel(running.workload_id)
    assert status.state == "cancelled" and status.error == "cancelled by request"
    alpha_jobs = deployment.scheduler.jobs(tenant_id="alpha")
    assert alpha_jobs and all(j.state == "failed" for j in alpha_jobs)
    assert all(not deployment.queue.has_partition(j.partition_id) for j in alpha_jobs)
    assert manager.get(queued.workload_id).state == "running"  # beta is untouched
    manager.stop()


def test_a_broken_dataset_fails_only_its_own_workload(deployment, tmp_path):
    spec = sft_spec("gamma", tmp_path / "gamma", jobs=2, base_model=TINY_MODEL_ID)
    write_dataset_for(spec)
    deployment.creator.create(spec)
    shutil.rmtree(tmp_path / "gamma" / "data")  # the tenant's data disappears after validation
    manager = WorkloadManager(deployment).start()
    try:
        broken = manager.submit("gamma", jobs=2)
        fine = manager.submit("alpha", jobs=1)
        statuses = manager.wait_all([broken.workload_id, fine.workload_id], timeout_s=300)
    finally:
        manager.stop()
    assert statuses[0].state == "failed" and "gamma" in statuses[0].error
    assert statuses[1].state == "completed"


def test_admission_hooks_and_bad_requests_are_clear(deployment):
    def refuse(tenant_id):
        if tenant_id == "beta":
            raise AdmissionRefused("tenant 'beta' reached its spend cap of 10 device-seconds")

    manager = WorkloadManager(deployment, admission_check=refuse)
    with pytest.raises(AdmissionRefused, match="spend cap"):
        manager.submit("beta", jobs=1)
    with pytest.raises(ValueError, match="jobs"):
        manager.submit("alpha", jobs=0)
    with pytest.raises(KeyError):
        manager.submit("nobody", jobs=1)
    assert manager.list() == []


def test_the_manager_is_composed_of_parts_not_mixed_from_them():
    # Issue 40, item 3: each part is an object with its own state; none shares the manager's `self`.
    import importlib
    import inspect
    import pkgutil

    import joynexus.master.workloads as package

    assert WorkloadManager.__mro__ == (WorkloadManager, object)
    modules = [importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)]
    ours = {
        cls for module in modules for cls in vars(module).values()
        if inspect.isclass(cls) and cls.__module__.startswith(package.__name__)
    }  # fmt: skip
    assert {c.__name__ for c in ours} >= {
        "Admission", "TrainingWorkloads", "Evaluations", "RoleSupervisor", "ProducerFollower", "WorkloadRecords",
        "LiveWorkloads", "ServiceWaits", "Reconciler", "Promoter",
    }  # fmt: skip
    assert not [(c.__name__, b.__name__) for c in ours for b in c.__mro__[1:] if b in ours], "a part inherits another"
