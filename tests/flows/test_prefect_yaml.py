"""prefect.yaml declares deployments that Prefect can load: entrypoints import, parameter names and
values fit the flow signatures, a process work pool, the periodic evaluation on a schedule, and
concurrency limits. The slow test deploys them on a real Prefect server and runs one to COMPLETED."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PREFECT_YAML = REPO / "prefect.yaml"


def load_deployments() -> dict[str, dict]:
    config = yaml.safe_load(PREFECT_YAML.read_text())
    return {d["name"]: d for d in config["deployments"]}


def load_flow(entrypoint: str):
    """What a worker does with an entrypoint: load the file as a script, take the attribute."""
    from prefect.flows import load_flow_from_entrypoint

    path, _ = entrypoint.split(":")
    assert (REPO / path).is_file(), f"entrypoint file {path} does not exist"
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        return load_flow_from_entrypoint(entrypoint)
    finally:
        os.chdir(cwd)


def test_entrypoints_import_and_parameters_match_the_flow_signatures():
    from prefect import Flow

    deployments = load_deployments()
    assert set(deployments) == {"on-demand", "hourly", "sweep"}
    expected = {"on-demand": "tenant-lifecycle", "hourly": "periodic-evaluation", "sweep": "sweep"}
    for name, deployment in deployments.items():
        flow = load_flow(deployment["entrypoint"])
        assert isinstance(flow, Flow) and flow.name == expected[name]
        signature = flow.parameters.model_dump()
        assert set(deployment["parameters"]) <= set(signature["properties"]), name
        given_per_run = {"spec", "tenant_id"}  # no default: every run names them
        assert set(signature.get("required", [])) - set(deployment["parameters"]) <= given_per_run
        assert deployment["enforce_parameter_schema"] is True
        for key, value in deployment["parameters"].items():  # each default validates against its type
            per_run = {"spec": _any_spec(), "tenant_id": "t"}
            flow.validate_parameters({**{k: v for k, v in per_run.items() if k in signature["properties"]}, key: value})


def test_work_pool_schedule_and_concurrency():
    deployments = load_deployments()
    for deployment in deployments.values():
        pool = deployment["work_pool"]
        assert pool["name"] == "joynexus-process"
        assert pool["job_variables"]["env"]["RAY_AUTH_MODE"] == "disabled"
    hourly = deployments["hourly"]
    assert hourly["schedules"] == [{"cron": "0 * * * *", "timezone": "UTC", "active": True}]
    assert hourly["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    assert "schedules" not in deployments["on-demand"]
    # Lifecycles of many tenants run at once (clients of the one Master Service): no limit.
    assert "concurrency_limit" not in deployments["on-demand"]


def _any_spec() -> dict:
    from tests.helpers import sft_spec

    return sft_spec("t", "/data/t")


@pytest.mark.slow
def test_prefect_deploy_all_and_a_worker_runs_the_lifecycle_to_completed(tmp_path):
    """`prefect server start` (PREFECT_HOME in tmp, a free port) → work pool → `prefect deploy
    --all` → `prefect worker start` → a lifecycle run of a one-job SFT tenant → COMPLETED."""
    from joynexus.ops.supervisor import free_port, http_ok, spawn_process, stop_process, wait_until
    from tests.helpers import sft_spec, write_dataset_for

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "JOYNEXUS_"))}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect"),
        PREFECT_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        JOYNEXUS_DATA_DIR=str(tmp_path / "data"),
        JOYNEXUS_TORCH_THREADS="1",
    )
    bin_dir = Path(sys.executable).parent
    prefect = str(bin_dir / "prefect")
    logs = tmp_path / "logs"
    logs.mkdir()
    server = spawn_process("prefect-server", [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                           env, logs)  # fmt: skip
    worker = None
    try:
        wait_until(lambda: http_ok(f"{api}/health"), server, "Prefect server", 120)

        def prefect_cli(*args: str, timeout: float = 300) -> str:
            done = subprocess.run([prefect, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
            assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            return done.stdout

        prefect_cli("work-pool", "create", "joynexus-process", "--type", "process")
        out = prefect_cli("--no-prompt", "deploy", "--all")
        assert "tenant-lifecycle/on-demand" in out and "periodic-evaluation/hourly" in out
        worker = spawn_process("prefect-worker", [prefect, "worker", "start", "--pool", "joynexus-process"], env, logs)

        spec = sft_spec("deployed", tmp_path / "dataset", jobs=1, samples_per_job=8)
        write_dataset_for(spec, episodes=2, length=8)
        params = json.dumps({"spec": spec, "jobs": 1})
        out = prefect_cli(
            "deployment", "run", "tenant-lifecycle/on-demand", "--params", params, "--watch",
            "--watch-timeout", "540", timeout=600,
        )  # fmt: skip
        assert "Completed" in out, out[-3000:]
        assert (tmp_path / "data" / "checkpoints" / "tenants" / "deployed").is_dir()
    finally:
        for process in (worker, server):
            if process is not None:
                stop_process(process)
        for process in (worker, server):
            if process is not None:
                assert not process.session_pids(), f"{process.name} left processes behind"
