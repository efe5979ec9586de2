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
# The settings a test does not give come from these: a shell's values could make a refusal pass.
PORT_SETTINGS = ("JOYNEXUS_RAY_PORT", "JOYNEXUS_RAY_WORKER_PORTS", "JOYNEXUS_PREFECT_PORT", "JOYNEXUS_MLFLOW_PORT")


@pytest.fixture(autouse=True)
def _nothing_starts(monkeypatch):
    """A refusal that fails to happen must fail the test, not start a real deployment it leaves behind."""
    for name in PORT_SETTINGS:
        monkeypatch.delenv(name, raising=False)

    def refuse(name, *args, **kwargs):
        raise AssertionError(f"up started {name}: nothing should start here")

    monkeypatch.setattr(deploy, "spawn_process", refuse)


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


def test_two_deployments_on_one_host_share_no_port_and_no_dir(tmp_path, monkeypatch):
    """What lets two deployments run side by side (the slow tests/deploy/test_side_by_side.py starts
    two): every port `up` makes the Ray head, Prefect and MLflow listen on, from the `ray start`
    options and the head's environment, and every folder it writes, differ between them."""
    monkeypatch.setenv("RAY_TMPDIR", "/tmp")
    spawned: dict[str, dict[str, tuple[list[str], dict[str, str]]]] = {}

    def record(name, argv, env, run_dir, url=None):
        spawned.setdefault(str(run_dir), {})[name] = (argv, env)

    monkeypatch.setattr(deploy, "spawn_process", record)
    one = Settings(data_dir=tmp_path / "one", ray_port=30000, ray_worker_ports="20000-24999",
                   prefect_port=31000, mlflow_port=31001)  # fmt: skip
    two = Settings(data_dir=tmp_path / "two", ray_port=30010, ray_worker_ports="25000-29999",
                   prefect_port=31002, mlflow_port=31003)  # fmt: skip
    listens, workers = {}, {}
    for settings in (one, two):
        folder = deploy.run_dir(settings)
        folder.mkdir(parents=True)
        for start in (deploy._start_ray_head, deploy._start_mlflow, deploy._start_prefect):
            start(settings, folder, [], lambda message: None)
        (ray_argv, ray_env), (mlflow_argv, _), (prefect_argv, _) = spawned[str(folder)].values()
        options = dict(a.removeprefix("--").split("=", 1) for a in ray_argv if a.startswith("--") and "=" in a)
        ports = {int(v) for k, v in options.items() if (k == "port" or k.endswith("-port")) and "worker" not in k}
        ports |= {int(ray_env[variable]) for variable in ("DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT")}
        assert ports == set(range(settings.ray_port, settings.ray_port + BLOCK_SIZE))  # the whole block, no more
        ports |= {int(argv[argv.index("--port") + 1]) for argv in (mlflow_argv, prefect_argv)}
        listens[settings.data_dir] = ports
        workers[settings.data_dir] = set(range(int(options["min-worker-port"]), int(options["max-worker-port"]) + 1))
        assert options["temp-dir"] == str(deploy._ray_temp_dir(settings))
    assert not listens[one.data_dir] & listens[two.data_dir]
    assert not workers[one.data_dir] & workers[two.data_dir]
    assert not (listens[one.data_dir] | listens[two.data_dir]) & (workers[one.data_dir] | workers[two.data_dir])
    assert deploy._ray_temp_dir(one) != deploy._ray_temp_dir(two)
    tokens = [spawned[str(deploy.run_dir(s))]["ray"][1]["RAY_AUTH_TOKEN_PATH"] for s in (one, two)]
    assert tokens[0] != tokens[1]  # a token per data dir, in its run dir
    assert [str(deploy.run_dir(s)) for s in (one, two)] == [t.rsplit("/", 1)[0] for t in tokens]
    assert spawned[str(deploy.run_dir(one))]["mlflow"][0] != spawned[str(deploy.run_dir(two))]["mlflow"][0]
