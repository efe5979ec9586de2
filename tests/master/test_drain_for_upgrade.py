"""Issue 43.6: what an upgrade does to the Master and the services, in one process: the old Master
drains (admission paused, loops stopped, every tenant checkpointed; `ops/upgrade.py` then kills the
actors), a new Master over new services on the same store and checkpoints restores each tenant at
the version it had, admits what was submitted meanwhile and trains on from there: no version lost."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers import sft_spec, write_dataset_for


@pytest.mark.slow  # two Masters train in turn: ~25 s on the shared 2-core host
def test_a_drained_master_s_successor_restores_every_tenant_and_admits_what_waited(tmp_path: Path) -> None:
    from joynexus.master.deployment import Deployment
    from joynexus.master.service import MasterService
    from joynexus.settings import Settings

    spec = sft_spec("alpha", tmp_path / "dataset", jobs=1)
    write_dataset_for(spec)
    old = Settings(data_dir=tmp_path / "data", torch_threads=1, release="0.1.0")
    master = MasterService(deployment=Deployment.in_process(old))
    try:
        master.deployment.creator.create(spec)
        first = master.workloads.wait(master.submit_workload("alpha", jobs=1).workload_id, 120)
        assert first.state == "completed"
        assert master.ping()["release"] == "0.1.0" and not master.ping()["draining"]
        report = master.drain()
        assert report["checkpointed"] == {"alpha": first.version} and report["leased_jobs_left"] == []
        waiting = master.submit_workload("alpha", jobs=1)  # a tenant's call during the drain: queued
        time.sleep(1.0)
        assert master.get_workload(waiting.workload_id).state == "queued" and master.ping()["draining"]
    finally:
        master.close()  # the old actors killed
    new = old.model_copy(update={"release": "0.2.0"})
    successor = MasterService(deployment=Deployment.in_process(new))  # the new code's services, same store
    try:
        assert successor.ping()["release"] == "0.2.0"
        assert successor.deployment.training_service.policy_version("alpha") == first.version  # restored
        done = successor.workloads.wait(waiting.workload_id, 120)
        assert done.state == "completed" and done.version > first.version
        assert first.version in successor.deployment.checkpoints.versions("alpha")
    finally:
        successor.close()
