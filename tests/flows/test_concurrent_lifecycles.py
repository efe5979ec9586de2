"""Four tenant lifecycles at once through the `tenant-lifecycle/on-demand` Prefect deployment (no
concurrency limit) against ONE `joynexus up` deployment: every flow run is a client of the resident
Master Service, so the four tenants (four schemas) train on one backbone at the same time, and each
tenant's checkpoints, manifests, registry versions and scheduler jobs are its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
JOBS = 2
# Four tenants, four model-facing interfaces (cameras, image size, state / action dims, chunk,
# action module): four schema signatures on the one resident backbone.
SHAPES = {
    "cc-arm": dict(cameras=("front", "wrist"), image_size=(32, 32), state_dim=4, action_dim=7, action_chunk=2),
    "cc-flow": dict(cameras=("top",), image_size=(24, 40), state_dim=2, action_dim=2, action_chunk=4,
                    module="flow_matching"),
    "cc-biarm": dict(cameras=("l", "r", "c"), image_size=(48, 48), state_dim=14, action_dim=14, action_chunk=1),
    "cc-mono": dict(cameras=("front",), image_size=(32, 32), state_dim=3, action_dim=3, action_chunk=3,
                    module="flow_matching"),
}  # fmt: skip
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _all_overlap(intervals: list[tuple[datetime, datetime]]) -> bool:
    """True when one instant lies inside every interval (all of them ran at the same time)."""
    return max(start for start, _ in intervals) < min(end for _, end in intervals)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_four_lifecycles_at_once_share_one_backbone_and_keep_their_own_versions(tmp_path, monkeypatch):
    import httpx

    from joynexus.ops import supervisor
    from joynexus.ops.supervisor import free_port, spawn_process, stop_process, wait_until
    from joynexus.settings import Settings
    from tests.helpers import sft_spec, write_dataset_for

    for name in list(os.environ):
        if name.startswith(("JOYNEXUS_", "PREFECT_", "MLFLOW_TRACKING")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("JOYNEXUS_TORCH_THREADS", "1")
    settings = Settings(
        data_dir=tmp_path / "data", ray_port=free_port(), prefect_port=free_port(), mlflow_port=free_port()
    )
    specs = {}
    for tenant, shape in SHAPES.items():
        specs[tenant] = sft_spec(tenant, tmp_path / "datasets" / tenant, jobs=JOBS, samples_per_job=64, **shape)
        write_dataset_for(specs[tenant], episodes=2, length=16)

    logs = tmp_path / "logs"
    logs.mkdir()
    started = time.monotonic()
    state = supervisor.up(settings)
    recorded = sorted({pid for p in state.processes for pid in [p.pid, *p.members]})
    api = state.prefect_api_url
    # The worker and its flow-run processes see the deployment as `source <data_dir>/run/env.sh` would.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JOYNEXUS_", "PREFECT_", "MLFLOW_TRACKING"))}
    env.update(state.exports())
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-client"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="2",
        JOYNEXUS_TORCH_THREADS="1",
    )
    prefect = str(Path(sys.executable).parent / "prefect")
    worker = None
    cluster = None
    timings: dict[str, float] = {"up_s": time.monotonic() - started}
    try:

        def prefect_cli(*args: str, timeout: float = 300) -> str:
            done = subprocess.run([prefect, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
            assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            return done.stdout

        prefect_cli("work-pool", "create", "joynexus-process", "--type", "process")
        out = prefect_cli("--no-prompt", "deploy", "--name", "on-demand")  # not `hourly`: no scheduled runs here
        assert "tenant-lifecycle/on-demand" in out, out[-3000:]

        http = httpx.Client(base_url=api.rstrip("/") + "/", timeout=60)
        deployment = http.get("deployments/name/tenant-lifecycle/on-demand").json()
        assert deployment.get("concurrency_limit") is None, deployment.get("concurrency_limit")
        # Four runs queued before the worker starts: its first poll picks them up together.
        run_ids = {}
        for tenant, spec in specs.items():
            created = http.post(
                f"deployments/{deployment['id']}/create_flow_run", json={"parameters": {"spec": spec, "jobs": JOBS}}
            )
            assert created.status_code == 201, created.text
            run_ids[tenant] = created.json()["id"]
        worker = spawn_process("prefect-worker", [prefect, "worker", "start", "--pool", "joynexus-process"], env, logs)

        def runs() -> dict[str, dict]:
            found = http.post("flow_runs/filter", json={"flow_runs": {"id": {"any_": list(run_ids.values())}}})
            by_id = {run["id"]: run for run in found.json()}
            return {tenant: by_id[run_id] for tenant, run_id in run_ids.items()}

        flows_started = time.monotonic()
        wait_until(lambda: all(r["state_type"] in FINAL for r in runs().values()), worker, "four lifecycle runs", 1200)
        timings["flows_s"] = time.monotonic() - flows_started
        final = runs()
        failed = {t: r["state_type"] for t, r in final.items() if r["state_type"] != "COMPLETED"}
        if failed:
            tails = {}
            for tenant in failed:
                found = http.post("logs/filter", json={"logs": {"flow_run_id": {"any_": [run_ids[tenant]]}}})
                tails[tenant] = [entry["message"][-600:] for entry in found.json()][-8:]
            worker_log = Path(worker.log).read_text(errors="replace")[-3000:]
            pytest.fail(f"lifecycle runs not completed: {failed}\n{json.dumps(tails, indent=1)}\n{worker_log}")
        # The four flow runs ran at the same time (no deployment concurrency limit serialised them).
        assert _all_overlap([(_time(r["start_time"]), _time(r["end_time"])) for r in final.values()]), final

        # -- what the Master Service and the resident services saw ------------------------------------
        from joynexus.connect import connect
        from joynexus.core.store import ControlPlaneStore
        from joynexus.registry import ExperimentTracker, registered_model_name
        from joynexus.scheduling.training_scheduler import TrainingScheduler

        cluster = connect(settings)
        assert cluster.mode == "ray"
        workloads = {w.workload_id: w for w in cluster.master.list_workloads()}
        training = {w.tenant_id: w for w in workloads.values() if w.task == "sft"}
        assert set(training) == set(SHAPES) and len(training) == len(workloads) == 4
        for workload in training.values():
            assert workload.state == "completed", workload
            assert (workload.completed_jobs, workload.target_jobs, workload.version) == (JOBS, JOBS, JOBS), workload
            assert workload.registered_version == 1, workload
        # Their training workloads overlapped: one instant where all four were running.
        intervals = [(_time(w.started_at), _time(w.finished_at)) for w in training.values()]
        assert _all_overlap(intervals), {w.tenant_id: (w.started_at, w.finished_at) for w in training.values()}

        # ONE backbone: created once in the Training Model Service, once in the Inference Model Service.
        backbone = cluster.training.backbone_info()
        assert backbone["instances_created"] == 1, backbone
        assert set(SHAPES) <= set(backbone["tenants"])
        inference = cluster.inference.stats()
        assert inference["backbone_instances_created"] == 1, inference
        assert all(JOBS in inference["tenants"][tenant] for tenant in SHAPES), inference["tenants"]

        # Each tenant's versions are its own.
        tracker = ExperimentTracker(state.mlflow_tracking_uri)
        signatures = set()
        for tenant in SHAPES:
            schema_signature = cluster.master.get_tenant(tenant).schema_signature
            signatures.add(schema_signature)
            assert cluster.training.policy_version(tenant) == JOBS
            model = tracker.client.get_registered_model(registered_model_name(tenant))
            assert model.tags["tenant_id"] == tenant
            tags = tracker.model_version_tags(tenant, 1)
            assert tags["tenant_id"] == tenant and tags["policy_version"] == str(JOBS), tags
            assert tags["schema_signature"] == schema_signature
            assert len(tracker.client.search_model_versions(f"name = '{registered_model_name(tenant)}'")) == 1
            _, registered = tracker.fetch_tenant_payload(tenant, version=1)  # verified against its digest tag
            assert (registered.tenant_id, registered.policy_version) == (tenant, JOBS)
            assert registered.schema_signature == schema_signature
            assert tracker.alias_version(tenant, "candidate") == 1 and tracker.alias_version(tenant, "champion") == 1
            checkpoints = cluster.checkpoints
            assert checkpoints.latest_version(tenant) == JOBS
            for version in checkpoints.versions(tenant):
                manifest = checkpoints.read_manifest(tenant, version)
                assert (manifest.tenant_id, manifest.schema_signature) == (tenant, schema_signature), manifest
        assert len(signatures) == 4  # four different schemas

        # No job of one tenant's workload under another tenant.
        store = ControlPlaneStore(settings.resolved_database_url())
        try:
            jobs = TrainingScheduler(store).jobs()
        finally:
            store.dispose()
        assert jobs
        per_workload: dict[str, int] = {}
        for job in jobs:
            workload = workloads[job.metadata["workload_id"]]
            assert workload.tenant_id == job.tenant_id, (job.job_id, job.tenant_id, workload.workload_id)
            per_workload[workload.workload_id] = per_workload.get(workload.workload_id, 0) + (job.state == "completed")
        assert {workloads[w].tenant_id: n for w, n in per_workload.items()} == dict.fromkeys(SHAPES, JOBS)
    finally:
        if cluster is not None:
            import ray

            cluster.close()
            ray.shutdown()
        if worker is not None:
            stop_process(worker)
        down_started = time.monotonic()
        stopped = supervisor.down(settings)
        timings["down_s"] = time.monotonic() - down_started
        print(f"timings: {timings}")
    assert set(stopped) == {"ray", "prefect", "mlflow"}
    time.sleep(1)
    assert [pid for pid in recorded if not _gone(pid)] == []
    for process in state.processes:
        assert process.session_pids() == [], process.name
    if worker is not None:
        assert worker.session_pids() == [], "the Prefect worker left flow-run processes behind"
    assert supervisor.read_state(settings) is None
