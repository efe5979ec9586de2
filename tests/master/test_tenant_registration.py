"""One tenant registration path (issue 40, item 3): a tenant's training policy is registered and its
slot created ONCE, at its creation; its workloads only set their completion target and use the slot."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from joynexus.master.deployment import Deployment
from joynexus.master.service import MasterService
from joynexus.master.workloads.manager import WorkloadManager
from joynexus.scheduling.training_scheduler import TrainingScheduler
from joynexus.services.training.service import TrainingModelService
from joynexus.settings import Settings
from tests.helpers import sft_spec, write_dataset_for


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Calls of `register_policy` and `add_tenant` per (call, tenant)."""
    calls: Counter = Counter()
    register, add = TrainingScheduler.register_policy, TrainingModelService.add_tenant

    def register_policy(self, tenant_id, *args, **kwargs):
        calls["register_policy", tenant_id] += 1
        return register(self, tenant_id, *args, **kwargs)

    def add_tenant(self, config, *args, **kwargs):
        calls["add_tenant", config.tenant_id] += 1
        return add(self, config, *args, **kwargs)

    monkeypatch.setattr(TrainingScheduler, "register_policy", register_policy)
    monkeypatch.setattr(TrainingModelService, "add_tenant", add_tenant)
    return calls


def test_a_tenant_is_registered_once_through_creation_and_two_workloads(tmp_path: Path, counted: Counter) -> None:
    spec = sft_spec("alpha", tmp_path / "dataset", jobs=1)
    write_dataset_for(spec)
    master = MasterService(deployment=Deployment.in_process(Settings(data_dir=tmp_path / "data", torch_threads=1)))
    try:
        master.create_tenant(spec)
        assert counted == {("register_policy", "alpha"): 1, ("add_tenant", "alpha"): 1}
        first = master.workloads.wait(master.submit_workload("alpha", jobs=1).workload_id, 120)
        second = master.workloads.wait(master.submit_workload("alpha", jobs=1).workload_id, 120)
        assert (first.state, second.state) == ("completed", "completed")
        assert second.version > first.version
        # Each workload set its own target on the policy registered at creation: nothing registered again.
        assert counted == {("register_policy", "alpha"): 1, ("add_tenant", "alpha"): 1}
        policy = master.deployment.scheduler.policy("alpha", "sft")
        assert policy.completion_target == 2  # the second workload's job on top of the first's
    finally:
        master.close()


def test_a_workload_creates_the_slot_of_a_tenant_made_by_the_creator_alone(tmp_path: Path, counted: Counter) -> None:
    # `TenantCreator.create` alone (tests, benchmarks) registers the policy; the first launch adds the slot.
    spec = sft_spec("beta", tmp_path / "dataset", jobs=1)
    write_dataset_for(spec)
    dep = Deployment.in_process(Settings(data_dir=tmp_path / "data", torch_threads=1))
    manager = WorkloadManager(dep).start()
    try:
        dep.creator.create(spec)
        assert counted == {("register_policy", "beta"): 1}
        done = manager.wait(manager.submit("beta", jobs=1).workload_id, 120)
        assert done.state == "completed"
        assert counted == {("register_policy", "beta"): 1, ("add_tenant", "beta"): 1}
    finally:
        manager.stop()
        dep.shutdown()
