"""Two deployments on one host, different data dirs and port settings, up at once (issue 30): each
Ray head on its own port block (its metrics servers' ports included: neither head's logs say a port
was taken) and worker range, its temp dir under RAY_TMPDIR; both healthy, and `down` of one leaves
the other running."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from joynexus.ops import supervisor as deploy
from joynexus.ops.ray_ports import BLOCK_SIZE
from joynexus.settings import Settings


def _port_block(taken: set[int]) -> int:
    """A base port whose block is free now and outside every block already handed out."""
    while True:
        base = deploy.free_port()
        block = set(range(base, base + BLOCK_SIZE))
        in_use = any(deploy._port_open("127.0.0.1", port) for port in block)
        if base + BLOCK_SIZE <= 65535 and not block & taken and not in_use:
            taken |= block
            return base


def _head_listening_ports(data_dir: Path) -> set[int]:
    """The TCP ports the processes of the Ray head `up` recorded for `data_dir` listen on."""
    import psutil

    state = deploy.read_state(Settings(data_dir=data_dir))
    assert state is not None and state.process("ray") is not None
    ports = set()
    for pid in state.process("ray").session_pids():
        try:
            connections = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        ports |= {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
    assert ports, f"no listening ports found for the head of {data_dir}"
    return ports


@pytest.mark.slow
@pytest.mark.timeout(3600)  # two `up`s, two `down`s: over pytest-timeout's 600 s default
def test_two_deployments_run_side_by_side(tmp_path):
    cli = str(Path(sys.executable).parent / "joynexus")
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("JOYNEXUS_", "PREFECT_", "MLFLOW_"))}
    # Short: Ray's unix socket paths under it must fit 107 bytes (pytest's tmp_path is too deep).
    ray_tmp = Path(tempfile.mkdtemp(prefix="jr", dir="/tmp"))
    base_env.update(RAY_TMPDIR=str(ray_tmp), JOYNEXUS_TORCH_THREADS="1")
    taken: set[int] = set()
    deployments = []
    for name, workers in (("one", "20000-24999"), ("two", "25000-29999")):
        env = dict(base_env)
        env.update(
            JOYNEXUS_DATA_DIR=str(tmp_path / name),
            JOYNEXUS_RAY_PORT=str(_port_block(taken)),
            JOYNEXUS_RAY_WORKER_PORTS=workers,
            JOYNEXUS_PREFECT_PORT=str(deploy.free_port()),
            JOYNEXUS_MLFLOW_PORT=str(deploy.free_port()),
        )
        deployments.append(env)

    def joynexus(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([cli, *args], env=env, capture_output=True, text=True, timeout=1200)

    try:
        for env in deployments:
            up = joynexus(env, "up", "--timeout", "900")  # a loaded CI host: the backbone loads slowly
            assert up.returncode == 0, up.stdout + up.stderr
        for env in deployments:
            status = joynexus(env, "status", "--json")
            report = json.loads(status.stdout)
            assert status.returncode == 0 and all(e["healthy"] for e in report.values()), report
            assert report["ray"]["where"] == f"127.0.0.1:{env['JOYNEXUS_RAY_PORT']}"
        heads = list(ray_tmp.glob("joynexus-ray-*"))
        assert len(heads) == 2  # under RAY_TMPDIR, one each
        for head in heads:  # no port of one head taken by the other (Ray logs it and goes on)
            for log in (head / "session_latest" / "logs").glob("*.log"):
                assert "Address already in use" not in log.read_text(errors="replace"), log
        for env in deployments:  # every port a head's processes listen on is its own
            base, (low, high) = int(env["JOYNEXUS_RAY_PORT"]), map(int, env["JOYNEXUS_RAY_WORKER_PORTS"].split("-"))
            strays = {
                p for p in _head_listening_ports(Path(env["JOYNEXUS_DATA_DIR"])) if not base <= p < base + BLOCK_SIZE
            }
            assert not {p for p in strays if not low <= p <= high}, (env["JOYNEXUS_DATA_DIR"], sorted(strays))
        down = joynexus(deployments[0], "down")
        assert down.returncode == 0, down.stdout + down.stderr
        still = joynexus(deployments[1], "status", "--json")
        assert still.returncode == 0, still.stdout
        assert joynexus(deployments[0], "status", "--json").returncode == 1  # the first is down
    finally:
        for env in deployments:
            joynexus(env, "down")
        shutil.rmtree(ray_tmp, ignore_errors=True)
