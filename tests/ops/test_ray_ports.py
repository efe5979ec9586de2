"""Every Ray port `joynexus up` uses is chosen together and checked before anything starts (issue 30):
a block from JOYNEXUS_RAY_PORT outside Ray's worker range, refused with the setting to change;
RAY_TMPDIR is where the head's temp dir goes (refused when too long for its unix sockets)."""

from __future__ import annotations

import socket

import pytest

from joynexus.ops import supervisor as deploy
from joynexus.ops.ray_ports import BLOCK_SIZE, RAY_PORT_ROLES, ray_ports
from joynexus.settings import Settings

EXTERNAL = ("JOYNEXUS_RAY_ADDRESS", "JOYNEXUS_MLFLOW_TRACKING_URI", "PREFECT_API_URL")


def test_the_head_pins_every_port_in_one_block_outside_the_worker_range(tmp_path):
    ports = ray_ports(Settings(data_dir=tmp_path, ray_port=6379))
    assert list(ports.ports.values()) == list(range(6379, 6379 + len(RAY_PORT_ROLES)))
    argv = ports.argv()
    for option in ("port", "node-manager-port", "object-manager-port", "ray-client-server-port",
                   "dashboard-agent-grpc-port", "dashboard-agent-listen-port", "metrics-export-port",
                   "runtime-env-agent-port"):  # fmt: skip
        assert sum(a.startswith(f"--{option}=") for a in argv) == 1, option
    assert "--min-worker-port=10002" in argv and "--max-worker-port=19999" in argv
    # Ray's dashboard head and autoscaler serve metrics on fixed ports (44227, 44217) unless told:
    # the rest of the block, through the head's environment.
    assert ports.env == {"DASHBOARD_METRIC_PORT": "6387", "AUTOSCALER_METRIC_PORT": "6388"}
    assert BLOCK_SIZE == len(RAY_PORT_ROLES) + len(ports.env) == 10
    moved = ray_ports(Settings(data_dir=tmp_path, ray_port=16379, ray_worker_ports="20000-29999"))
    assert moved.ports["port"] == 16379 and "--min-worker-port=20000" in moved.argv()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"ray_port": 16379}, "JOYNEXUS_RAY_PORT=16379"),  # inside Ray's default worker range
        ({"ray_port": 9998}, "JOYNEXUS_RAY_PORT=9998"),  # its block reaches into the range
        ({"ray_port": 65530}, "JOYNEXUS_RAY_PORT=65530"),
        ({"ray_port": 7000, "prefect_port": 7009}, "JOYNEXUS_PREFECT_PORT=7009"),  # the autoscaler's metrics
        ({"ray_worker_ports": "lots"}, "JOYNEXUS_RAY_WORKER_PORTS"),
        ({"ray_worker_ports": "30000-20000"}, "JOYNEXUS_RAY_WORKER_PORTS"),
        ({"ray_port": 7000, "prefect_port": 7003}, "JOYNEXUS_PREFECT_PORT=7003"),
        ({"mlflow_port": 12000}, "JOYNEXUS_MLFLOW_PORT=12000"),
    ],
)
def test_up_refuses_ray_ports_that_collide_naming_the_setting(tmp_path, monkeypatch, fields, named):
    for name in EXTERNAL:
        monkeypatch.delenv(name, raising=False)
    settings = Settings(data_dir=tmp_path, **{"prefect_port": deploy.free_port(), **fields})
    with pytest.raises(deploy.DeployError, match=named.split("=")[0]) as caught:
        deploy.up(settings)
    assert named in str(caught.value)
    assert deploy.read_state(settings) is None and list((tmp_path / "run").iterdir()) == []  # nothing started


def test_up_refuses_a_ray_port_block_another_process_listens_in(tmp_path, monkeypatch):
    for name in EXTERNAL:
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        base = taken - 3  # the Ray Client server's port of this block is the one in use
        settings = Settings(
            data_dir=tmp_path, ray_port=base, mlflow_port=deploy.free_port(), prefect_port=deploy.free_port()
        )
        with pytest.raises(deploy.DeployError, match=f"JOYNEXUS_RAY_PORT={base}") as caught:
            deploy.up(settings)
    assert f"{taken} (Ray Client server)" in str(caught.value)
    assert deploy.read_state(settings) is None


def test_the_head_temp_dir_goes_under_ray_tmpdir(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "ray-tmp"))
    one, two = Settings(data_dir=tmp_path / "a"), Settings(data_dir=tmp_path / "b")
    assert deploy._ray_temp_dir(one).parent == tmp_path / "ray-tmp"
    assert deploy._ray_temp_dir(one) != deploy._ray_temp_dir(two)  # one per data dir


def test_up_refuses_a_ray_tmpdir_too_long_for_rays_sockets_naming_the_setting(tmp_path, monkeypatch):
    for name in EXTERNAL:
        monkeypatch.delenv(name, raising=False)
    deep = tmp_path / ("d" * 60)
    monkeypatch.setenv("RAY_TMPDIR", str(deep))
    settings = Settings(data_dir=tmp_path / "data", mlflow_port=deploy.free_port(), prefect_port=deploy.free_port())
    with pytest.raises(deploy.DeployError, match="RAY_TMPDIR=") as caught:
        deploy.up(settings)
    assert "107-byte unix socket limit" in str(caught.value)
    assert deploy.read_state(settings) is None and not deep.exists()  # nothing started
    monkeypatch.setenv("RAY_TMPDIR", "/tmp")
    deploy._refuse_long_ray_temp_dir(settings)  # the usual place fits
