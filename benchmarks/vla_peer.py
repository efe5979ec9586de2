"""JoyNexus against the peer a lab runs today: N fine-tuned checkpoints of one VLA family served as N
tenants of ONE deployment (grouped) vs N LeRobot async-inference `PolicyServer` processes, one
policy each (issue 44, item 2).

  .venv/bin/python benchmarks/vla_peer.py [--tenants 2 4 8] [--rounds 3 --seconds 5] [--size small|published]

Checkpoints: N LeRobot policy directories of the same base (the deployment's backbone), written by
LeRobot's own classes (`build_lerobot_smolvla_checkpoint`: ``SmolVLAPolicy.save_pretrained`` and its
processor pipelines), each with its own expert (drawn from its own seed: what fine-tuning the expert
over a frozen VLM leaves different). A family is its checkpoint builder (`FAMILIES`): SmolVLA, and
π0 (`--family pi0`: `build_lerobot_pi0_checkpoint` over a PaliGemma deployment; LeRobot's servers
run under openpi's transformers patch, `_pi0_policy_server.py`).

Every robot sends ONE observation per request and waits for its chunk (a closed loop, one client
per tenant / server, all at once, in threads of this process). Per system and N: requests/s, p50 /
p99 round trip, resident memory (PSS of every process of the system, from /proc/PID/smaps_rollup,
after the point's rounds), requests/s per GB, and JoyNexus / peer.

- ``joynexus ray`` / ``joynexus in-process``: one deployment, N smolvla tenants created from the
  checkpoints, each robot on its tenant's ``/v1/stream``; the Inference Queue groups concurrent
  requests into one prefix forward + each tenant's expert. Ray: what `joynexus serve` runs, a local
  Ray (its GCS, raylet and dashboard processes and one worker per service actor, all children of the
  API server's process, all counted) started by `connect(mode="ray")`, its workers at niceness 0
  (Ray's default 15 loses the CPU to any other process of a shared host); in-process: the services as
  objects of the API server's process, as `benchmarks/policy_server.py` starts it.
- ``lerobot``: N ``python -m lerobot.async_inference.policy_server`` processes (``inference_latency``
  0, so it never pads a reply), each robot driving its server with LeRobot's own gRPC messages as its
  `RobotClient` does: ``Ready``, ``SendPolicyInstructions`` (policy type, directory, features), then
  per request ``SendObservations`` (a pickled `TimedObservation`, ``must_go``) and ``GetActions``.
- OpenPI-style (``--openpi``, on by default at the small size): the stock ``openpi-client`` against one
  deployment per tenant (what one ``serve_policy.py`` per policy is) vs the one shared deployment.

Systems are measured side by side in two groups (JoyNexus's deployments and the LeRobot peer; then
the OpenPI-style pair): a group's systems are all up while it runs (each holds its memory; an idle
one takes next to no CPU); per N, `--rounds` rounds measure them in turn, the order alternating, so
a shared host's drifting load hits them alike; round trips are pooled over the rounds, PSS read
after. The table comes at the end.
Every server process runs ``--threads`` torch threads (default 1, JoyNexus's own default; a LeRobot
process left alone takes one per core). ``--quick``: the tiny backbone, 2 tenants, the in-process
deployment, one round of 1.5 s (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle  # nosec: LeRobot's own wire format, to our own local servers
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.openpi_latency import observation  # noqa: E402
from benchmarks.policy_server import ADMIN_KEY, start_server  # noqa: E402

TASK = "pick up the red cube"
CAMERA = "front"
STATE_DIM = ACTION_DIM = 6  # an SO-100 arm's joints
STATS = {
    "observation.state": {"mean": [0.1] * STATE_DIM, "std": [1.5] * STATE_DIM},
    "action": {"mean": [0.0] * ACTION_DIM, "std": [2.0] * ACTION_DIM},
}
GIB = 2**30
DEPLOYMENTS = ("ray", "in-process")
JOYNEXUS = tuple(f"joynexus {kind}" for kind in DEPLOYMENTS)


@dataclass(frozen=True)
class Size:
    """A backbone preset and the policy fields that go with it."""

    preset: str
    image_size: int | None  # None: the preset's own
    layers: int | None  # SmolVLA's num_vlm_layers (the backbone is built truncated to them); None: all
    chunk: int = 50  # SmolVLA's chunk_size / n_action_steps
    steps: int = 10  # SmolVLA's Euler steps


SIZES = {
    "tiny": Size("tiny", None, None, chunk=4, steps=3),
    "small": Size("small", None, None),
    "published": Size("smolvlm-500m", 512, 16),  # SmolVLA's: SmolVLM-500M's first 16 layers, 512 px
}


# -- checkpoints ---------------------------------------------------------------------------------
def vlm_layers(size: Size) -> int:
    from joynexus.models.backbone import TinyBackboneSpec
    from joynexus.models.backbone.paligemma import PALIGEMMA_PRESETS

    if size.preset in PALIGEMMA_PRESETS:
        return PALIGEMMA_PRESETS[size.preset].depth
    return size.layers or TinyBackboneSpec.preset(size.preset).text_layers


def write_smolvla_checkpoints(backbone: Any, root: Path, count: int, size: Size) -> list[Path]:
    """`count` LeRobot SmolVLA directories over ``backbone``, each expert from its own seed; one
    ``vlm/`` on disk (the others link to it: LeRobot reads it by path, and it is the same VLM)."""
    from joynexus.artifacts.lerobot_smolvla import VLM_DIR, build_lerobot_smolvla_checkpoint

    side = backbone.image_size
    roots = []
    for i in range(count):
        out = build_lerobot_smolvla_checkpoint(
            root / f"smolvla-{i}",
            backbone,
            camera_shapes={f"observation.images.{CAMERA}": (3, side, side)},
            state_dim=STATE_DIM,
            action_dim=ACTION_DIM,
            stats=STATS,
            seed=100 + i,
            chunk_size=size.chunk,
            n_action_steps=size.chunk,
            num_steps=size.steps,
            num_vlm_layers=vlm_layers(size),
            resize_imgs_with_padding=(side, side),
        )
        if roots:
            shutil.rmtree(out / VLM_DIR)
            (out / VLM_DIR).symlink_to(roots[0] / VLM_DIR, target_is_directory=True)
        roots.append(out)
    return roots


PI0_CONFIG_DIR = "paligemma-config"


def pi0_expert(backbone: Any) -> tuple[int, ...]:
    """π0's published gemma_300m expert over the published PaliGemma; a 32-wide one over a small one."""
    from joynexus.artifacts.lerobot_pi0 import gemma_shape
    from joynexus.models.action_modules.pi0 import GEMMA_VARIANTS

    vlm = gemma_shape(backbone.model.config.text_config)
    if vlm == GEMMA_VARIANTS["gemma_2b"]:
        return GEMMA_VARIANTS["gemma_300m"]
    return (32, vlm[1], 64, *vlm[3:])


def write_pi0_checkpoints(backbone: Any, root: Path, count: int, size: Size) -> list[Path]:
    """`count` LeRobot π0 directories over ``backbone``'s PaliGemma (`build_lerobot_pi0_checkpoint`:
    LeRobot's own ``PI0Policy.save_pretrained`` and its processor pipelines), each expert from its own
    seed; the PaliGemma's config beside them for the peer's servers (`_pi0_policy_server.py`)."""
    from joynexus.artifacts.lerobot_pi0 import build_lerobot_pi0_checkpoint

    backbone.model.config.save_pretrained(root / PI0_CONFIG_DIR)
    return [
        build_lerobot_pi0_checkpoint(
            root / f"pi0-{i}",
            backbone,
            kind="pi0",
            camera_keys=[f"observation.images.{CAMERA}"],
            state_dim=STATE_DIM,
            action_dim=ACTION_DIM,
            expert=pi0_expert(backbone),
            stats=STATS,
            seed=100 + i,
            chunk_size=size.chunk,
            n_action_steps=size.chunk,
            num_inference_steps=size.steps,
        )  # fmt: skip
        for i in range(count)
    ]


def pi0_server(root: Path, backbone: Any) -> tuple[list[str], dict[str, str]]:
    """LeRobot's PolicyServer under openpi's transformers patch, small variants registered when the
    shapes are not LeRobot's published ones."""
    from joynexus.artifacts.lerobot_pi0 import gemma_shape
    from joynexus.models.action_modules.pi0 import GEMMA_VARIANTS

    script = str(Path(__file__).with_name("_pi0_policy_server.py"))
    if gemma_shape(backbone.model.config.text_config) == GEMMA_VARIANTS["gemma_2b"]:
        return [script], {}
    env = {
        "JOYNEXUS_PI0_PALIGEMMA": str(root / PI0_CONFIG_DIR),
        "JOYNEXUS_PI0_EXPERT": ",".join(str(v) for v in pi0_expert(backbone)),
    }
    return [script], env


def lerobot_server(root: Path, backbone: Any) -> tuple[list[str], dict[str, str]]:
    return ["-m", "lerobot.async_inference.policy_server"], {}


@dataclass(frozen=True)
class Family:
    """What the benchmark needs of a VLA family: LeRobot's policy type, the JoyNexus module kind,
    a checkpoint builder (backbone, folder, count, size) -> directories, its sizes (backbone presets)
    and how LeRobot's PolicyServer for it is started (checkpoint folder, backbone) -> (args, env)."""

    policy_type: str
    module_kind: str
    write_checkpoints: Callable[[Any, Path, int, Size], list[Path]]
    sizes: dict[str, Size]
    server: Callable[[Path, Any], tuple[list[str], dict[str, str]]] = lerobot_server


PI0_SIZES = {
    "tiny": Size("paligemma-tiny", None, None, chunk=4, steps=3),
    "small": Size("paligemma-tiny", None, None),
    "published": Size("paligemma-3b", None, None),  # π0's: PaliGemma 3B (SigLIP at 224 px, Gemma 2B) + Gemma 300M
}
FAMILIES = {
    "smolvla": Family("smolvla", "smolvla", write_smolvla_checkpoints, SIZES),
    "pi0": Family("pi0", "pi0", write_pi0_checkpoints, PI0_SIZES, pi0_server),
}


# -- processes and their memory ------------------------------------------------------------------
def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Ray's raylet and workers are children of the driver)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def pss_by_process(pids: list[int]) -> dict[str, int]:
    """Proportional set size of the processes and their descendants, per command name: shared
    pages (torch's libraries) split among the processes mapping them, so a sum counts each once."""
    total: dict[str, int] = {}
    for pid in {p for root in pids for p in process_tree(root)}:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        pss = next(int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith("Pss:"))
        total[name] = total.get(name, 0) + pss
    return total


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "JOYNEXUS_TORCH_THREADS": str(threads)}


def deployment_settings(size: Size, data_dir: Path, threads: int) -> dict[str, str]:
    """The environment a JoyNexus deployment of this size reads its Settings from."""
    env = {"JOYNEXUS_DATA_DIR": str(data_dir), "JOYNEXUS_BACKBONE_PRESET": size.preset, "JOYNEXUS_DEVICE": "cpu"}
    if size.image_size:
        env["JOYNEXUS_BACKBONE_IMAGE_SIZE"] = str(size.image_size)
    if size.layers:
        env["JOYNEXUS_BACKBONE_FEATURE_LAYERS"] = str(size.layers)
    return {**env, **thread_env(threads)}


def _serve(env: dict[str, str], deployment: str, conn: Any) -> None:
    """A spawned child: one JoyNexus deployment behind uvicorn until the parent closes the pipe."""
    os.environ.update(env)
    if deployment == "ray":
        _serve_ray(conn)
        return
    cluster, server, url, thread = start_server(Path(env["JOYNEXUS_DATA_DIR"]))
    conn.send(url)
    conn.recv()  # blocks until the parent says stop (or goes away)
    server.should_exit = True
    thread.join(timeout=30)
    cluster.close()


def _serve_ray(conn: Any) -> None:
    import uvicorn

    from joynexus.api.app import ApiSettings, create_app
    from joynexus.connect import connect
    from joynexus.settings import Settings

    # Ray starts its workers at niceness 15; on a host shared with other work (this benchmark's
    # peers at 0, other sessions' tests) that hands them the CPU. A dedicated host runs nothing else:
    # 0 puts the service actors on equal terms with the peer's processes.
    os.environ.setdefault("RAY_worker_niceness", "0")
    cluster = connect(Settings(), mode="ray")  # starts a local Ray: its processes are this one's children
    app = create_app(cluster, ApiSettings(), admin_key=ADMIN_KEY)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    conn.send(f"http://127.0.0.1:{port}")
    conn.recv()
    server.should_exit = True
    thread.join(timeout=30)
    cluster.close()
    import ray

    ray.shutdown()


@dataclass
class Deployment:
    """A JoyNexus deployment in its own process."""

    url: str
    process: Any
    conn: Any
    tenants: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def launch(cls, env: dict[str, str], deployment: str = "in-process") -> Deployment:
        """Start its process; `ready` waits for its URL (several start side by side)."""
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(env, deployment, child), daemon=False)
        process.start()
        return cls("", process, parent)

    def ready(self) -> Deployment:
        if not self.conn.poll(900):
            raise RuntimeError("the JoyNexus deployment did not start in 900 s")
        self.url = self.conn.recv()
        return self

    def add_tenant(self, name: str, model_id: str, family: Family, checkpoint: Path, side: int, chunk: int) -> None:
        import httpx

        spec = {
            "tenant": name,
            "base_model": model_id,
            "task": "eval",
            "action_module": {"kind": family.module_kind, "checkpoint": str(checkpoint)},
            "observation": {
                "cameras": [CAMERA],
                "image_size": [side, side],
                "state_dim": STATE_DIM,
                "action_dim": ACTION_DIM,
                "action_chunk": chunk,
                "instruction": TASK,
            },
        }
        with httpx.Client(base_url=self.url, timeout=900) as http:
            created = http.post("/v1/admin/tenants", json=spec, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            if created.status_code != 201:
                raise RuntimeError(f"tenant {name}: {created.status_code} {created.text}")
            key = created.json()["key"]["api_key"]
            http.post("/v1/weights/load", json={}, headers={"Authorization": f"Bearer {key}"}).raise_for_status()
        schema = {"cameras": [CAMERA], "image_size": [side, side], "state_dim": STATE_DIM}
        self.tenants.append({"api_key": key, "schema": schema})

    def stop(self) -> None:
        try:
            self.conn.send("stop")
        except OSError:  # it is gone already
            pass
        self.process.join(timeout=120)
        if self.process.is_alive():
            self.process.kill()


def peer_port() -> int:
    """A free port above the kernel's ephemeral range: gRPC servers bind with SO_REUSEPORT, so a
    port a Ray process (ours or another's) takes from that range meanwhile would be shared with it."""
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    rng = np.random.default_rng()
    for _ in range(100):
        port = int(rng.integers(high + 1, 65536)) if high < 65000 else int(rng.integers(1024, low))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port for a PolicyServer")


class PeerServer:
    """One LeRobot async-inference PolicyServer process, as its docs start it."""

    def __init__(self, cwd: Path, threads: int, command: list[str], env: dict[str, str]) -> None:
        self.port = peer_port()
        cwd.mkdir(parents=True, exist_ok=True)  # the module opens ./logs at import: a folder of its own
        args = ["--host=127.0.0.1", f"--port={self.port}", "--inference_latency=0", "--obs_queue_timeout=60"]
        self.process = subprocess.Popen(
            [sys.executable, *command, *args],
            cwd=cwd,
            env={**os.environ, **thread_env(threads), **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


# -- robots ---------------------------------------------------------------------------------------
class StreamRobot:
    """A robot on a tenant's /v1/stream: one obs frame, wait for its actions."""

    def __init__(self, url: str, tenant: dict[str, Any]) -> None:
        from websockets.sync.client import connect

        from joynexus.protocol.wire import msgpack_dumps, msgpack_loads

        self.dumps, self.loads = msgpack_dumps, msgpack_loads
        self.obs = observation(tenant["schema"], np.random.default_rng(0))[1]
        headers = {"Authorization": f"Bearer {tenant['api_key']}"}
        self.ws = connect(url.replace("http://", "ws://") + "/v1/stream", additional_headers=headers, max_size=None)
        self.loads(self.ws.recv())  # ready
        self.seq = 0
        self.batch_samples: list[int] = []  # samples of the service batch each answer rode in

    def request(self) -> None:
        self.seq += 1
        self.ws.send(self.dumps({"type": "obs", "seq": self.seq, "observations": self.obs}))
        answer = self.loads(self.ws.recv())
        if answer["type"] != "actions":
            raise RuntimeError(answer)
        self.batch_samples.append(answer["batch_samples"])

    def close(self) -> None:
        self.ws.close()


class OpenPIRobot:
    """A robot with the stock openpi client on a tenant's /v1/openpi."""

    def __init__(self, url: str, tenant: dict[str, Any]) -> None:
        from openpi_client.websocket_client_policy import WebsocketClientPolicy

        self.obs = observation(tenant["schema"], np.random.default_rng(0))[0]
        self.policy = WebsocketClientPolicy(url.replace("http://", "ws://") + "/v1/openpi", api_key=tenant["api_key"])

    def request(self) -> None:
        self.policy.infer(self.obs)

    def close(self) -> None:
        self.policy._ws.close()


class LeRobotRobot:
    """A robot speaking LeRobot's async-inference gRPC protocol to its own PolicyServer, message
    for message as `lerobot.async_inference.robot_client.RobotClient` sends them."""

    def __init__(self, port: int, family: Family, checkpoint: Path, side: int, chunk: int) -> None:
        import grpc
        from lerobot.async_inference.helpers import RemotePolicyConfig
        from lerobot.datasets.utils import hw_to_dataset_features
        from lerobot.transport import services_pb2, services_pb2_grpc
        from lerobot.transport.utils import grpc_channel_options

        self.pb2 = services_pb2
        joints = [f"joint{i}.pos" for i in range(STATE_DIM)]
        features = hw_to_dataset_features(
            {**{j: float for j in joints}, CAMERA: (side, side, 3)}, "observation", use_video=False
        )
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", grpc_channel_options())
        grpc.channel_ready_future(self.channel).result(timeout=300)
        self.stub = services_pb2_grpc.AsyncInferenceStub(self.channel)
        self.stub.Ready(services_pb2.Empty())
        setup = RemotePolicyConfig(family.policy_type, str(checkpoint), features, actions_per_chunk=chunk, device="cpu")
        self.stub.SendPolicyInstructions(services_pb2.PolicySetup(data=pickle.dumps(setup)))
        openpi = observation(
            {"cameras": [CAMERA], "image_size": [side, side], "state_dim": STATE_DIM}, np.random.default_rng(0)
        )[0]
        self.raw = {j: float(v) for j, v in zip(joints, openpi["state"], strict=True)}
        self.raw |= {CAMERA: openpi["images"][CAMERA], "task": TASK}
        self.timestep = 0

    def request(self) -> None:
        from lerobot.async_inference.helpers import TimedObservation
        from lerobot.transport.utils import send_bytes_in_chunks

        self.timestep += 1
        obs = TimedObservation(timestamp=time.time(), timestep=self.timestep, observation=self.raw, must_go=True)
        self.stub.SendObservations(send_bytes_in_chunks(pickle.dumps(obs), self.pb2.Observation, silent=True))
        actions = self.stub.GetActions(self.pb2.Empty())
        if not actions.data or not pickle.loads(actions.data):  # nosec: our own server's reply
            raise RuntimeError("the PolicyServer answered no actions")

    def close(self) -> None:
        self.channel.close()


def closing(robots: list[Any]) -> None:
    for robot in robots:
        robot.close()


def closed_loop(robots: list[Any], warmup_s: float, seconds: float) -> dict[str, Any]:
    """Every robot in its own thread sends one request after another; requests that end inside the
    window (after the warm-up) are counted, their round trips kept."""
    start = threading.Barrier(len(robots) + 1)
    done: list[list[tuple[float, float]]] = [[] for _ in robots]
    failures: list[BaseException] = []
    window: dict[str, float] = {}

    def drive(robot: Any, out: list[tuple[float, float]]) -> None:
        start.wait()
        try:
            while time.perf_counter() < window["t1"]:
                began = time.perf_counter()
                robot.request()
                out.append((began, time.perf_counter()))
        except BaseException as error:  # reported by the caller: a failed robot is a failed point
            failures.append(error)

    threads = [threading.Thread(target=drive, args=(r, out), daemon=True) for r, out in zip(robots, done, strict=True)]
    for thread in threads:
        thread.start()
    now = time.perf_counter()
    window.update(t0=now + warmup_s, t1=now + warmup_s + seconds)
    start.wait()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(f"{len(failures)} robot(s) failed") from failures[0]
    inside = [(b, e) for out in done for b, e in out if window["t0"] <= e <= window["t1"]]
    return {"seconds": seconds, "latencies_ms": [1000.0 * (e - b) for b, e in inside]}


# -- the systems ----------------------------------------------------------------------------------
@dataclass
class Setup:
    args: argparse.Namespace
    family: Family
    size: Size
    checkpoints: list[Path]
    model_id: str
    side: int
    tmp: Path
    server: tuple[list[str], dict[str, str]] = ([], {})  # the family's PolicyServer command and environment

    def deployment(self, name: str, deployment: str = "in-process") -> Deployment:
        """A deployment launched (not yet ready)."""
        return Deployment.launch(deployment_settings(self.size, self.tmp / name, self.args.threads), deployment)

    def tenant(self, deployment: Deployment, i: int) -> None:
        deployment.add_tenant(f"robot-{i}", self.model_id, self.family, self.checkpoints[i], self.side, self.size.chunk)


class Shared:
    """N tenants of ONE JoyNexus deployment, robots of one protocol (fresh per round); `owner`: it
    stops the deployment (two protocols may share one)."""

    def __init__(self, name: str, setup: Setup, deployment: Deployment, robot: type, owner: bool = True) -> None:
        self.name, self.setup, self.deployment, self.robot, self.owner = name, setup, deployment, robot, owner

    def grow(self, n: int) -> None:
        while len(self.deployment.tenants) < n:
            self.setup.tenant(self.deployment, len(self.deployment.tenants))

    def robots(self, n: int) -> list[Any]:
        return [self.robot(self.deployment.url, t) for t in self.deployment.tenants[:n]]

    def release(self, robots: list[Any]) -> None:
        closing(robots)

    def pids(self, n: int) -> list[int]:
        return [self.deployment.process.pid]

    def stop(self) -> None:
        if self.owner:
            self.deployment.stop()


class LeRobotPeer:
    """N PolicyServer processes, one policy each; each robot set up once (one policy load per server)."""

    name = "lerobot"

    def __init__(self, setup: Setup) -> None:
        self.setup, self.servers, self.clients = setup, [], []

    def grow(self, n: int) -> None:
        setup = self.setup
        while len(self.servers) < n:
            command, env = setup.server
            cwd = setup.tmp / f"lerobot-{len(self.servers)}"
            self.servers.append(PeerServer(cwd, setup.args.threads, command, env))
        while len(self.clients) < n:
            i = len(self.clients)
            port, checkpoint = self.servers[i].port, setup.checkpoints[i]
            self.clients.append(LeRobotRobot(port, setup.family, checkpoint, setup.side, setup.size.chunk))

    def robots(self, n: int) -> list[Any]:
        return self.clients[:n]

    def release(self, robots: list[Any]) -> None:
        pass

    def pids(self, n: int) -> list[int]:
        return [s.process.pid for s in self.servers[:n]]

    def stop(self) -> None:
        closing(self.clients)
        for server in self.servers:
            server.stop()


class OpenPIPerTenant:
    """One JoyNexus deployment per tenant (what one openpi serve_policy.py per policy is)."""

    name = "openpi per tenant"

    def __init__(self, setup: Setup) -> None:
        self.setup, self.deployments = setup, []

    def grow(self, n: int) -> None:
        started = [self.setup.deployment(f"openpi-{i}") for i in range(len(self.deployments), n)]
        self.deployments += started  # launched side by side, then each given its tenant
        for deployment in started:
            self.setup.tenant(deployment.ready(), self.deployments.index(deployment))

    def robots(self, n: int) -> list[Any]:
        return [OpenPIRobot(d.url, d.tenants[0]) for d in self.deployments[:n]]

    def release(self, robots: list[Any]) -> None:
        closing(robots)

    def pids(self, n: int) -> list[int]:
        return [d.process.pid for d in self.deployments[:n]]

    def stop(self) -> None:
        for deployment in self.deployments:
            deployment.stop()


def system_groups(setup: Setup) -> list[list[Any]]:
    """The systems, in groups measured side by side: JoyNexus's deployments with the LeRobot peer,
    then the OpenPI-style pair (one shared deployment vs one per tenant). A group's systems are all
    up while it runs (each holding its memory), and stopped before the next group starts: all at
    once would not fit a small host at 8 tenants."""
    args = setup.args
    shared_openpi = args.openpi and "in-process" in args.deployments
    first: list[Any] = []
    try:
        for kind in args.deployments:
            deployment = setup.deployment(f"joynexus-{kind}", kind).ready()
            owner = not (shared_openpi and kind == "in-process")  # the OpenPI group's shared side stops it
            first.append(Shared(f"joynexus {kind}", setup, deployment, StreamRobot, owner))
            if not owner:
                openpi_shared = Shared("openpi shared", setup, deployment, OpenPIRobot)
        first.append(LeRobotPeer(setup))
    except BaseException:
        stop_all(first)
        raise
    if not args.openpi:
        return [first]
    return [first, [openpi_shared, OpenPIPerTenant(setup)]] if shared_openpi else [first, [OpenPIPerTenant(setup)]]


def stop_all(systems: list[Any]) -> None:
    for system in systems:
        system.stop()


def point(systems: list[Any], n: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every system at N tenants, in `--rounds` rounds that alternate their order (a shared host's
    load drifts over minutes: each round hits every system alike); round trips pooled, PSS after."""
    for system in systems:
        system.grow(n)
    pooled: dict[str, dict[str, Any]] = {s.name: {"seconds": 0.0, "latencies_ms": [], "batches": []} for s in systems}
    for r in range(args.rounds):
        for system in systems if r % 2 == 0 else systems[::-1]:
            robots = system.robots(n)
            try:
                got = closed_loop(robots, args.warmup, args.seconds)
                pooled[system.name]["batches"] += [b for robot in robots for b in getattr(robot, "batch_samples", [])]
            finally:
                system.release(robots)
            pooled[system.name]["seconds"] += got["seconds"]
            pooled[system.name]["latencies_ms"] += got["latencies_ms"]
    return [summary(system.name, n, pooled[system.name], system.pids(n)) for system in systems]


def summary(system: str, n: int, pooled: dict[str, Any], pids: list[int]) -> dict[str, Any]:
    latencies = pooled["latencies_ms"]
    if not latencies:
        raise RuntimeError(f"{system}: no request completed inside its windows")
    row: dict[str, Any] = {
        "system": system,
        "tenants": n,
        "requests": len(latencies),
        "requests_per_s": len(latencies) / pooled["seconds"],
        "p50_ms": float(np.percentile(latencies, 50)),
        "p99_ms": float(np.percentile(latencies, 99)),
        "pss_by_process": pss_by_process(pids),
    }
    row["pss_gib"] = sum(row["pss_by_process"].values()) / GIB
    row["per_gib"] = row["requests_per_s"] / row["pss_gib"]
    # JoyNexus's stream reports the service batch each answer rode in (the warm-up's answers too).
    row["batch_samples"] = float(np.mean(pooled["batches"])) if pooled["batches"] else None
    largest = sorted(row["pss_by_process"].items(), key=lambda item: -item[1])[:4]
    print(
        f"  {system:<22} {n} tenant(s): {row['requests_per_s']:7.2f} req/s, p50 {row['p50_ms']:8.1f} ms, "
        f"p99 {row['p99_ms']:8.1f} ms, PSS {row['pss_gib']:.2f} GiB "
        f"({', '.join(f'{name} {size / GIB:.2f}' for name, size in largest)})",
        flush=True,
    )
    return row


def report(rows: list[dict[str, Any]], setup: Setup) -> None:
    args, size = setup.args, setup.size
    print(
        f"\n{setup.family.policy_type} over {size.preset} ({vlm_layers(size)} layers), {setup.side} px, 1 camera, "
        f"state {STATE_DIM}, chunk {size.chunk}, {size.steps} Euler steps; torch threads {args.threads} per process, "
        f"{os.cpu_count()} CPU core(s); {args.rounds} x {args.seconds:g} s windows (each after "
        f"{args.warmup:g} s) per point"
    )
    header = (
        f"{'tenants':>7} {'system':<22} {'req/s':>8} {'p50 ms':>9} {'p99 ms':>9} {'PSS GiB':>8} {'req/s/GiB':>10} "
        f"{'batch':>6}"
    )
    print(header)
    print("-" * len(header))
    by = {(r["system"], r["tenants"]): r for r in rows}
    for n in args.tenants:
        for system in (*JOYNEXUS, "lerobot", "openpi shared", "openpi per tenant"):
            if (r := by.get((system, n))) is not None:
                print(
                    f"{n:>7} {system:<22} {r['requests_per_s']:>8.2f} {r['p50_ms']:>9.1f} {r['p99_ms']:>9.1f} "
                    f"{r['pss_gib']:>8.2f} {r['per_gib']:>10.2f} "
                    + (f"{r['batch_samples']:>6.2f}" if r["batch_samples"] is not None else f"{'-':>6}")
                )
    print("(batch: mean samples of the Inference Model Service batch each JoyNexus answer rode in)\n")
    for n in args.tenants:
        for system in JOYNEXUS:
            ours, peer = by.get((system, n)), by.get(("lerobot", n))
            if ours and peer:
                speed = ours["requests_per_s"] / peer["requests_per_s"]
                print(
                    f"{n} tenants: {system} / lerobot requests/s {speed:.2f}x, "
                    f"PSS {ours['pss_gib'] / peer['pss_gib']:.2f}x, "
                    f"requests/s per GiB {ours['per_gib'] / peer['per_gib']:.2f}x"
                )
        shared, apart = by.get(("openpi shared", n)), by.get(("openpi per tenant", n))
        if shared and apart:
            ratio = shared["per_gib"] / apart["per_gib"]
            print(f"{n} tenants: openpi shared / per tenant requests/s per GiB {ratio:.2f}x")


def prepare(args: argparse.Namespace, tmp: Path) -> Setup:
    """The deployment's backbone (built here as the deployment builds it) and N checkpoints over it."""
    import torch

    from joynexus.models.placement import DevicePlacement
    from joynexus.services.configs import backbone_source
    from joynexus.settings import Settings

    family = FAMILIES[args.family]
    size = family.sizes[args.size]
    if args.image_size:
        size = Size(size.preset, args.image_size, size.layers, size.chunk, size.steps)
    settings = Settings(
        data_dir=tmp / "prepare",
        backbone_preset=size.preset,
        backbone_image_size=size.image_size,
        backbone_feature_layers=size.layers,
    )
    torch.set_num_threads(args.threads)
    backbone = backbone_source(settings).build(DevicePlacement(device="cpu"))
    checkpoints = family.write_checkpoints(backbone, tmp / "checkpoints", max(args.tenants), size)
    server = family.server(tmp / "checkpoints", backbone)
    return Setup(args, family, size, checkpoints, backbone.model_id, backbone.image_size, tmp, server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--image-size", type=int, default=None, help="override the size's camera side")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="smolvla")
    parser.add_argument("--seconds", type=float, default=5.0, help="measurement window per round")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each window")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per point, the systems' order alternating")
    # 1: JoyNexus's own default (JOYNEXUS_TORCH_THREADS); each peer process gets the same.
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every server process")
    parser.add_argument(
        "--deployments", nargs="+", choices=DEPLOYMENTS, default=list(DEPLOYMENTS), help="JoyNexus deployments to run"
    )
    parser.add_argument("--openpi", action=argparse.BooleanOptionalAction, default=None, help="default: small sizes")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny backbone, 2 tenants, 2 s windows")
    args = parser.parse_args()
    if args.quick:
        args.size, args.tenants, args.seconds, args.warmup, args.rounds = "tiny", [2], 1.5, 0.5, 1
        args.deployments = ["in-process"]
    args.tenants = sorted(set(args.tenants))
    if args.openpi is None:
        args.openpi = args.size != "published" and "in-process" in args.deployments
    with tempfile.TemporaryDirectory(prefix="joynexus-vla-peer-") as tmp:
        setup = prepare(args, Path(tmp))
        groups, rows = system_groups(setup), []
        try:
            for group in groups:
                try:
                    rows += [row for n in args.tenants for row in point(group, n, args)]
                finally:
                    stop_all(group)
        except BaseException:
            stop_all([system for group in groups for system in group])  # stopping twice is harmless
            raise
    report(rows, setup)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
