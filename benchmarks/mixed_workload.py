"""Mixed SFT + RL workload, isolated vs together on JoyNexus (the paper's section 5.1: Fig. 9, Table 1).

  .venv/bin/python benchmarks/mixed_workload.py [--quick] [--mode ray|inprocess] [--profile]
                                                [--out var/benchmarks] [--repeats 2]

Deployments (`--mode`): `ray` (default) — the real deployment: the Training Queue, the Training /
Inference Model and Environment Services and the Master Service are Ray actors, each its own process
(`joynexus.connect.ray_cluster`, a fresh namespace and data dir per run, its actors killed after), so
training, inference, simulators and the Master's loops use the cores in parallel; `inprocess` — every
service a local object of this one process (all of them share one interpreter and its GIL).
`--profile`: py-spy samples the Master's process during the (first) together run; the actor-loop
thread's wall time is printed by category (train_job, weight sync, MLflow, store transactions, idle)
in seconds and ms per job.

Tenants (the paper's mix, small): three RL tenants with different rollout cadences — PushT-reach
with 4 envs x 16 steps, PushT-reach with 2 envs x 24 steps, PushT with 4 envs x 12 steps of
2-action chunks (GRPO + PPO, so every rollout makes exactly envs x horizon inference samples and the
work is the same both ways) — and two SFT tenants on a synthetic LeRobot dataset, at a lower priority
(ready RL updates go first at the actor). Together, the actor trains ready jobs of several tenants,
SFT and RL alike, in grouped steps (`train_jobs`: one shared backbone forward per round); the share of
jobs trained grouped and the mean group size are printed. Every tenant: 32x32 top camera, tiny backbone, 1 torch thread,
12 jobs (--quick: 4), checkpoints at the end of its workload (--checkpoint-every N: every N jobs; a
checkpoint per job adds a durable write per job to the one actor loop, the same both ways).

1. Measured on this machine, side by side in one run:
   - isolated: each tenant alone on its own fresh deployment (Training / Inference Model and
     Environment Services, Master Service), one after another;
   - together: every tenant's workload submitted at once on ONE deployment (group batching on: the
     Inference Model Service batches every tenant's requests into shared forwards).
   The same specs and job counts both ways; the work done (jobs, samples trained, inference samples,
   env steps) is checked and printed. `--repeats` pairs alternate their order (isolated first, then
   together first, ...) and the figures pool them (sums of walls and busy seconds).
   Figures:
   - wall: seconds from submitting the workloads to the last matched training update (the last
     `job_completed` event); deployment setup, tenant creation and the export/registration after the
     last update are outside it (the paper: "from the beginning of execution through the completion
     of the last matched training update");
   - training busy: the Training Model Service's `train_job` seconds summed over completed jobs (the
     metered training device-seconds, `MasterService.usage`); inference busy: the Inference Model
     Service's `stats()["busy_seconds"]` (every shared forward and its decodes);
   - utilisation = busy / wall. The isolated row is the mean over the RL tenants' standalone runs (as
     the paper's Table 1: "the mean across the three standalone RL traces"); pooled = sum busy / sum wall
     over every isolated run is printed too;
   - efficiency = isolated time / together time = sum_i wall_i / wall_together: each deployment holds the
     whole machine while it runs, so machine-time is wall time (the paper: isolated GPU time / JoyNexus
     GPU time = 1.39x);
   - device-busy ratio = isolated (training + inference busy) / together (training + inference busy);
     below 1 when busy seconds stretch under contention (a CPU shared by threads and processes), so the
     together utilisation is also given work-normalised: the isolated busy seconds of the same work
     over the together wall;
   - CPU: seconds of the deployment's processes over the window (in process: this process and its
     simulator workers; Ray: each actor's process with the simulator workers it reaped, and the
     driver, printed per process; Ray's own raylet/GCS are not counted), and cores used = CPU / wall
     (this machine's "device" is its CPU, shared with whatever else runs: the load average is printed).
2. Trace-driven simulation of the paper's 8-GPU node, replaying this machine's service times:
   - the trace: each RL tenant's PPO update seconds (its isolated run's `train_job` seconds, one
     device), its simulator's time per policy step (a dedicated rollout through the Environment
     Service: `batch_step` of its envs, chunk included, resets included), its weight-sync time
     (`MasterService.publish_weights`), the SFT tenant's update seconds and its standalone pace (jobs
     submitted per second), and the inference batch-time model time(b) = a + c*b fitted (least squares)
     to shared forwards of b single-observation requests measured on the Inference Model Service;
   - JoyNexus: 2 training GPUs (one actor, data parallel: an update of u device-seconds takes u/2 on
     both), 2 inference GPUs (two batch servers on one FIFO queue: a batch goes when it reaches B
     samples or its oldest request waited T, B and T the service's own), 4 environment GPUs at the
     tenants' own simulator density (no slow-down from sharing); at most 2 outstanding jobs per RL
     tenant, one rollout per tenant and 3 at once, round robin; ready RL updates first, the SFT
     tenant submitting continuously at its pace (prefetch 16) into the actor's idle intervals; one
     update runs to completion once dispatched;
   - isolated: each tenant's standalone 1-1-2 trace (1 training, 1 inference, 2 environment GPUs,
     the paper's baseline), synchronous (rollout, update, weight sync, next rollout), one tenant after
     another; the SFT work JoyNexus did in the matched window is appended as a standalone SFT trace
     at its measured pace (`--isolated-layout 2-2-4` gives each tenant the whole node instead);
   - matched window: J updates per RL tenant (`--sim-jobs`), from the start to the last RL update;
   - GPU time = GPUs held x wall; efficiency = sum_i 4*T_i / (8*T_joynexus); training utilisation =
     training busy GPU-seconds / (training GPUs x wall), inference likewise; isolated rows are the mean
     over the RL traces (Table 1's way);
   - two replays: "service times" (only the model services, simulators and weight sync), and "+ host
     overhead" (each RL job also pays the per-job time the measured isolated run took beyond its
     replayed service times: orchestration, store, tracking; host-side, holding no GPU busy);
   - deterministic: every random draw (which recorded sample a step or update takes) comes from a
     numpy generator seeded by (--seed, tenant), the same draws in both modes.
Printed beside the paper's figures: 1.39x efficiency, training 20.8% -> 41.3%, inference 28.1% -> 37.5%.
JSON with every figure and the trace: <out>/mixed_workload_<mode>.json.

Only light modules are imported at the top: in process, the Environment Service spawns its simulator
workers from this process, and a spawned process imports this script's module again (torch there
cost ~5 s per env session). On Ray the workers are spawned by the Environment Service's actor.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PAPER = {"efficiency": 1.39, "training": (0.208, 0.413), "inference": (0.281, 0.375)}
BASE_MODEL = "joynexus/tiny-smolvlm"
SFT_TENANT = "sft-demos"  # the SFT tenant whose standalone pace the node replay takes
# Two SFT tenants (paper 5.1: several SFT and RL tenants on one node): same demonstrations, their
# own heads, optimizers and learning rates; their jobs group with each other and with RL updates.
SFT_TENANTS = (SFT_TENANT, "sft-demos-b")
OBSERVATION = {"cameras": ["top"], "image_size": [32, 32], "action_dim": 2}


# -- the tenant mix ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RLTenant:
    tenant: str
    task: str
    num_envs: int
    horizon: int
    action_chunk: int
    state_dim: int
    instruction: str
    group_size: int | None = None


RL_TENANTS = (
    RLTenant("rl-reach-4x16", "PushT-reach-v0", 4, 16, 1, 4, "move the pusher to the T-shaped block"),
    RLTenant("rl-reach-2x24", "PushT-reach-v0", 2, 24, 1, 4, "move the pusher to the T-shaped block"),
    RLTenant("rl-pusht-4x12c2", "PushT-v0", 4, 12, 2, 2, "push the T-shaped block onto the target", group_size=2),
)


def rl_spec(t: RLTenant, jobs: int, checkpoint_every: int = 0, model: str = BASE_MODEL) -> dict[str, Any]:
    samples = t.num_envs * t.horizon
    return {
        "tenant": t.tenant,
        "base_model": model,
        "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {**OBSERVATION, "state_dim": t.state_dim, "action_chunk": t.action_chunk,
                        "instruction": t.instruction},
        "environment": {"simulator": "pusht", "task": t.task, "num_envs": t.num_envs, "horizon": t.horizon,
                        "max_episode_steps": 50},
        # GRPO: no critic, so no bootstrap-value requests: exactly envs x horizon inference samples per job.
        "rl": {"advantage": "grpo", "group_size": t.group_size, "ppo_epochs": 2},
        # The paper's JoyNexus settings: two outstanding jobs per RL tenant, RL before SFT at the actor;
        # a staleness bound no job reaches here (drops would change the work; they are counted).
        "scheduling": {"priority": 1, "max_in_flight_jobs": 2, "completion_target": jobs, "max_policy_staleness": 8},
        "training": {"samples_per_job": samples, "microbatch_size": samples // 2, "learning_rate": 5e-5,
                     "checkpoint_every_jobs": checkpoint_every},
    }  # fmt: skip


def sft_spec(
    root: Path, jobs: int, checkpoint_every: int = 0, model: str = BASE_MODEL, tenant: str = SFT_TENANT
) -> dict[str, Any]:
    return {
        "tenant": tenant,
        "base_model": model,
        "task": "sft",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {**OBSERVATION, "state_dim": 4, "action_chunk": 1, "instruction": "move the arm to the target"},
        "dataset": {"root": str(root), "repo_id": "bench/sft-demos"},  # one dataset, two tenants
        "scheduling": {"priority": 0, "max_in_flight_jobs": 16, "completion_target": jobs},  # prefetch 16
        "training": {
            "samples_per_job": 64,
            "microbatch_size": 16,
            "learning_rate": 1e-3 if tenant == SFT_TENANT else 5e-4,
            "checkpoint_every_jobs": checkpoint_every,
        },
    }


def write_sft_dataset(root: Path) -> Path:
    from joynexus.data.lerobot_dataset import write_synthetic_dataset

    if not (root / "meta" / "info.json").exists():
        write_synthetic_dataset(root, "bench/sft-demos", cameras=("top",), image_size=(32, 32), state_dim=4,
                                action_dim=2, num_episodes=6, episode_length=40, task="move the arm to the target",
                                seed=5)  # fmt: skip
    return root


# -- measured runs -------------------------------------------------------------------------------
@dataclass
class TenantWork:
    tenant_id: str
    task: str
    completed_jobs: int
    failed_jobs: int
    dropped_jobs: int
    samples_trained: int
    samples_predicted: int
    env_steps: int
    train_busy_s: float
    update_s: list[float]  # train_job seconds of each completed job
    # Tenants trained with it in one grouped step (the actor loop's `train_jobs`; 1: alone), per job.
    group_sizes: list[int] = field(default_factory=list)

    def work(self) -> tuple[int, int, int, int]:
        """What must be equal both ways."""
        return (self.completed_jobs, self.samples_trained, self.samples_predicted, self.env_steps)


@dataclass
class RunMeasure:
    label: str
    wall_s: float
    train_busy_s: float
    infer_busy_s: float
    infer_batches: int
    infer_samples: int
    tenants: dict[str, TenantWork]
    cpu_s: float  # CPU seconds of the deployment's processes and their simulator workers while the workloads ran
    load_average: tuple[float, float]  # the machine's 1-minute load average at submit and at the end
    cpu_by_process: dict[str, float] = field(default_factory=dict)  # per process (Ray: per actor, driver)
    mode: str = "ray"
    completions_s: dict[str, list[float]] = field(default_factory=dict)  # per tenant: job completion times
    # Environment sessions opened over the window on a fresh simulator process / on a warm one.
    sessions_opened: dict[str, int] = field(default_factory=dict)

    @property
    def cores_used(self) -> float:
        return self.cpu_s / self.wall_s

    @property
    def train_util(self) -> float:
        return self.train_busy_s / self.wall_s

    @property
    def infer_util(self) -> float:
        return self.infer_busy_s / self.wall_s


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


MODES = ("ray", "inprocess")
OPENED = ("fresh", "warm")  # how an environment session started: a new simulator process, or a warm one
# The Ray deployment's named actors, by the role the CPU breakdown names them.
RAY_ACTORS = {
    "master": "joynexus.master",
    "training": "joynexus.training_service",
    "inference": "joynexus.inference_service",
    "environment": "joynexus.environment_service",
    "training_queue": "joynexus.training_queue",
    "producers": "joynexus.producers-0",  # the data loops: rollouts, SFT producers, the advantage stage
}


@dataclass
class OpenDeployment:
    """A fresh deployment as the benchmark drives it: the client's Cluster, a Training Scheduler
    over the deployment's store (read-only use: job states and results), and where CPU is counted."""

    mode: str
    cluster: Any
    scheduler: Any
    pids: dict[str, int]  # role -> process id (in process: this one)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far per process, children reaped by it included (simulator workers)."""
        if self.mode == "inprocess":
            return {"benchmark process": _cpu_seconds()}
        import psutil

        cpu = {"driver": _cpu_seconds()}
        for role, pid in self.pids.items():
            process = psutil.Process(pid)
            t = process.cpu_times()
            cpu[role] = t.user + t.system + t.children_user + t.children_system
            # Its live children too (warm simulator workers outlive their sessions, so they are not
            # reaped by the window's end): otherwise a run that keeps its workers warm counts none of
            # their CPU and a run that stops them counts all of it.
            for child in process.children(recursive=True):
                try:
                    c = child.cpu_times()
                except psutil.Error:  # gone meanwhile: reaped, so in the parent's counters
                    continue
                cpu[role] += c.user + c.system + c.children_user + c.children_system
        return cpu

    def inference_batching(self) -> tuple[int, float]:
        """(B, T) of the Inference Model Service, from its `stats()` (in process or on Ray alike)."""
        stats = self.cluster.inference.stats()
        return int(stats["max_batch_size"]), float(stats["max_wait_s"])


@contextlib.contextmanager
def open_deployment(mode: str, data_dir: Path) -> Iterator[OpenDeployment]:
    """A fresh deployment in `data_dir`, closed after. `ray`: the services and the Master Service as
    Ray actors (each its own process) in a namespace of their own, killed after; `inprocess`: every
    service a local object of this process."""
    from joynexus.settings import Settings

    if mode == "inprocess":
        from joynexus.connect import in_process

        cluster = in_process(Settings(data_dir=data_dir, torch_threads=1))
        try:
            yield OpenDeployment(mode, cluster, cluster.master.deployment.scheduler, {"benchmark": os.getpid()})
        finally:
            cluster.close()
        return
    if mode != "ray":
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    import ray

    from joynexus.connect import ray_cluster
    from joynexus.core.store import ControlPlaneStore
    from joynexus.ops.supervisor import remove_service_actors
    from joynexus.scheduling.training_scheduler import TrainingScheduler

    settings = Settings(data_dir=data_dir, torch_threads=1, ray_namespace=f"mixed-{uuid.uuid4().hex[:8]}")
    store = None
    try:
        cluster = ray_cluster(settings)
        # Each role's process, from its own liveness answer (the Master's is `ping`).
        pids = {
            role: int(ray.get(getattr(ray.get_actor(name, namespace=settings.ray_namespace),
                                      "ping" if role == "master" else "heartbeat").remote(), timeout=60)["pid"])
            for role, name in RAY_ACTORS.items()
        }  # fmt: skip
        # The Master holds the store's writer; the driver only reads job rows (SQLite WAL: readers
        # never block the writer).
        store = ControlPlaneStore(settings.resolved_database_url())
        yield OpenDeployment(mode, cluster, TrainingScheduler(store), pids)
    finally:
        if store is not None:
            store.dispose()
        remove_service_actors(settings.ray_namespace)  # the Master first, then the services


def run_deployment(
    label: str,
    specs: list[dict[str, Any]],
    data_dir: Path,
    timeout_s: float,
    keep: Any = None,
    mode: str = "ray",
    profile: Path | None = None,
) -> RunMeasure:
    """Create the tenants on a fresh deployment (`mode`), submit every workload at once, wait, and
    read the figures. `keep(deployment)`, if given, runs on the live deployment before it closes
    (the trace calibration uses the together deployment). `profile`: py-spy samples of the Master's
    process over the window, written there (collapsed stacks)."""
    with open_deployment(mode, data_dir) as deployment:
        cluster = deployment.cluster
        master = cluster.master
        tenants = [master.create_tenant(spec) for spec in specs]
        jobs = {spec["tenant"]: spec["scheduling"]["completion_target"] for spec in specs}
        sampler = None if profile is None else start_profile(deployment.pids.get("master", os.getpid()), profile)
        load_start = os.getloadavg()[0]
        cpu_start = deployment.cpu_seconds()
        opened_start = cluster.environment.heartbeat()["sessions_opened"]
        started = time.time()  # event times are wall-clock (time.time) in the store
        submitted = [master.submit_workload(t.tenant_id, jobs=jobs[t.tenant_id]) for t in tenants]
        try:
            for status in submitted:
                final = cluster.wait_workload(status.workload_id, timeout_s)
                if final.state != "completed":
                    raise RuntimeError(f"{label}: workload {final.workload_id} of {final.tenant_id} {final.state}: "
                                       f"{final.error}")  # fmt: skip
            # The producers closed their sessions as their workloads ended: the workers are reaped,
            # so their CPU time is in their parent's children counters (py-spy, a child of this
            # process too, is reaped only after this).
            cpu_end = deployment.cpu_seconds()
            opened_end = cluster.environment.heartbeat()["sessions_opened"]
        finally:
            if sampler is not None:
                stop_profile(sampler)
        cpu_by_process = {k: cpu_end[k] - cpu_start[k] for k in cpu_end}
        timeline = {
            status.tenant_id: sorted(
                event["time"] - started
                for event in master.workload_events(status.workload_id, 0)
                if event["kind"] == "job_completed"
            )
            for status in submitted
        }
        wall = max(t for times in timeline.values() for t in times)
        stats = cluster.inference.stats()
        scheduler = deployment.scheduler
        works: dict[str, TenantWork] = {}
        for tenant in tenants:
            tid = tenant.tenant_id
            usage = master.usage(tid)
            counts = scheduler.counts(tid)
            done = [j for j in scheduler.jobs(tenant_id=tid) if j.state == "completed"]
            works[tid] = TenantWork(
                tenant_id=tid,
                task=tenant.spec.task.value,
                completed_jobs=counts.get("completed", 0),
                failed_jobs=counts.get("failed", 0),
                dropped_jobs=counts.get("dropped", 0),
                samples_trained=usage.samples_trained,
                samples_predicted=usage.samples_predicted,
                env_steps=usage.env_steps,
                train_busy_s=usage.device_seconds.training,
                update_s=[float(j.result["seconds"]) for j in done if j.result],
                group_sizes=[int((j.result or {}).get("group_size", 1)) for j in done],
            )
        measure = RunMeasure(
            label=label,
            wall_s=wall,
            train_busy_s=sum(w.train_busy_s for w in works.values()),
            infer_busy_s=float(stats["busy_seconds"]),
            infer_batches=int(stats["batches"]),
            infer_samples=int(stats["samples"]),
            tenants=works,
            cpu_s=sum(cpu_by_process.values()),
            load_average=(load_start, os.getloadavg()[0]),
            cpu_by_process=cpu_by_process,
            mode=mode,
            completions_s=timeline,
            sessions_opened={how: opened_end[how] - opened_start[how] for how in OPENED},
        )
        if keep is not None:
            keep(deployment)
        return measure


# -- the trace: service times recorded on this machine ----------------------------------------------
def _check_trace(where: str, *series: tuple[float, ...]) -> None:
    """A replay draws from recorded samples: each series needs one, and times are not negative."""
    for name, values in zip(("env_step_s", "update_s") if len(series) == 2 else ("update_s",), series, strict=True):
        if len(values) == 0:
            raise ValueError(f"{where}.{name}: no recorded samples to replay")
        if min(values) < 0:
            raise ValueError(f"{where}.{name}: recorded times must be >= 0, got {min(values)}")


@dataclass(frozen=True)
class RLTrace:
    tenant_id: str
    samples_per_step: int  # envs: one single-observation request per env per policy step
    steps_per_rollout: int  # horizon (policy steps)
    env_step_s: tuple[float, ...]  # simulator seconds per policy step (all envs, chunk and resets included)
    update_s: tuple[float, ...]  # PPO update seconds on one device
    sync_s: float  # training -> inference weight sync
    overhead_s: float = 0.0  # host time per job beyond the service times (the "+ host overhead" replay)

    def __post_init__(self) -> None:
        _check_trace(f"rl[{self.tenant_id}]", self.env_step_s, self.update_s)
        for name in ("samples_per_step", "steps_per_rollout"):
            if getattr(self, name) < 1:
                raise ValueError(f"rl[{self.tenant_id}].{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("sync_s", "overhead_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"rl[{self.tenant_id}].{name}: must be >= 0 seconds, got {getattr(self, name)}")


@dataclass(frozen=True)
class SFTTrace:
    update_s: tuple[float, ...]  # update seconds on one device
    interval_s: float  # the tenant's standalone pace: one job submitted every interval_s

    def __post_init__(self) -> None:
        _check_trace("sft", self.update_s)
        if not self.interval_s >= 0:
            raise ValueError(f"sft.interval_s: must be >= 0 seconds, got {self.interval_s}")


@dataclass(frozen=True)
class NodeTrace:
    batch_a_s: float  # inference batch time = a + c * samples
    batch_c_s: float
    max_batch: int  # B: a batch goes at B samples ...
    max_wait_s: float  # ... or when its oldest request waited T
    rl: tuple[RLTrace, ...]
    sft: SFTTrace | None

    def batch_s(self, samples: int) -> float:
        return self.batch_a_s + self.batch_c_s * samples

    def with_overheads(self, overheads: dict[str, float]) -> NodeTrace:
        rl = tuple(RLTrace(**{**asdict(r), "overhead_s": overheads.get(r.tenant_id, 0.0)}) for r in self.rl)
        return NodeTrace(self.batch_a_s, self.batch_c_s, self.max_batch, self.max_wait_s, rl, self.sft)


def fit_affine(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """Least-squares time(b) = a + c*b; returns (a, c, r^2)."""
    b = np.asarray([p[0] for p in points], dtype=float)
    t = np.asarray([p[1] for p in points], dtype=float)
    c, a = np.polyfit(b, t, 1)
    residual = float(np.sum((t - (a + c * b)) ** 2))
    total = float(np.sum((t - t.mean()) ** 2)) or 1.0
    return float(max(a, 0.0)), float(max(c, 0.0)), 1.0 - residual / total


def measure_batch_model(cluster: Any, tenant_id: str, repeats: int, max_batch: int) -> dict[str, Any]:
    """Shared-forward time of b single-observation requests (the rollout pattern), read as the
    Inference Model Service's busy-seconds delta of a round that formed exactly one batch."""
    from joynexus.scheduling.inference_queue import Observation
    from joynexus.services.producers.rollout import predict_many

    rng = np.random.default_rng(0)
    config = cluster.master.get_tenant(tenant_id).backend_config
    sizes = [b for b in (1, 2, 4, 6, 8, 12, 16, 24, 32) if b <= max_batch]
    samples: dict[int, list[float]] = {b: [] for b in sizes}
    for round_index in range(repeats + 1):  # round 0 warms up and is not kept
        for b in sizes:
            obs = [
                Observation(
                    images=tuple(rng.random((3, *config.image_size), dtype=np.float32) for _ in config.cameras),
                    state=rng.uniform(-1, 1, config.state_dim).astype(np.float32),
                    instruction=config.instruction,
                )
                for _ in range(b)
            ]
            before = cluster.inference.stats()
            predict_many(cluster.inference, tenant_id, obs, policy_version=None, sample=True)
            after = cluster.inference.stats()
            if round_index and after["batches"] - before["batches"] == 1:  # one shared forward: its time
                samples[b].append(after["busy_seconds"] - before["busy_seconds"])
    points = [(b, statistics.median(v)) for b, v in samples.items() if v]
    if len(points) < 2:
        raise RuntimeError("inference calibration: fewer than two batch sizes formed a single batch")
    a, c, r2 = fit_affine(points)
    return {"a_s": a, "c_s": c, "r2": r2, "points": points}


def measure_env_steps(cluster: Any, tenant_id: str, rollouts: int) -> list[float]:
    """Simulator seconds per policy step of a tenant's rollout: its envs stepped together through
    the Environment Service (`batch_step`), chunk-length steps per policy step, ended episodes reset."""
    from joynexus.core.tenants import simulator_config

    config = cluster.master.get_tenant(tenant_id).backend_config
    env = cluster.environment
    n, horizon, chunk = config.environment.num_envs, config.environment.horizon, config.action_chunk
    rng = np.random.default_rng(1)
    ids = [env.open_session(tenant_id, "trace", simulator_config(config, seed_offset=i)) for i in range(n)]
    try:
        spec = env.spec(tenant_id, ids[0])
        low, high = np.asarray(spec["action_low"]), np.asarray(spec["action_high"])
        for sid in ids:
            env.reset(tenant_id, sid)
        times = []
        for _policy_step in range(rollouts * horizon):
            start = time.perf_counter()
            for _env_step in range(chunk):
                actions = {sid: rng.uniform(low, high).astype(np.float32) for sid in ids}
                results = env.batch_step(tenant_id, actions)
                for sid, result in results.items():
                    if "error" in result:
                        raise RuntimeError(f"env session {sid}: {result['error']}")
                    if result["terminated"] or result["truncated"]:
                        env.reset(tenant_id, sid)
            times.append(time.perf_counter() - start)
        return times
    finally:
        for sid in ids:
            env.close(tenant_id, sid)


def record_trace(
    deployment: OpenDeployment, isolated: dict[str, RunMeasure], batch_repeats: int, env_rollouts: int
) -> tuple[NodeTrace, dict[str, Any]]:
    """The node trace from the isolated runs (update seconds, the SFT pace) and dedicated
    calibrations on the live together deployment (batch model, simulator steps, weight sync)."""
    cluster = deployment.cluster
    stats = cluster.inference.stats()
    max_batch, max_wait = deployment.inference_batching()
    model = measure_batch_model(cluster, RL_TENANTS[0].tenant, batch_repeats, max_batch)
    rl = []
    for t in RL_TENANTS:
        syncs = []
        for _ in range(3):
            start = time.perf_counter()
            cluster.master.publish_weights(t.tenant)
            syncs.append(time.perf_counter() - start)
        rl.append(
            RLTrace(
                tenant_id=t.tenant,
                samples_per_step=t.num_envs,
                steps_per_rollout=t.horizon,
                env_step_s=tuple(measure_env_steps(cluster, t.tenant, env_rollouts)),
                update_s=tuple(isolated[t.tenant].tenants[t.tenant].update_s),
                sync_s=statistics.median(syncs),
            )
        )
    sft_run = isolated[SFT_TENANT]
    sft_work = sft_run.tenants[SFT_TENANT]
    sft = SFTTrace(update_s=tuple(sft_work.update_s), interval_s=sft_run.wall_s / sft_work.completed_jobs)
    trace = NodeTrace(model["a_s"], model["c_s"], max_batch, max_wait, tuple(rl), sft)
    return trace, {"batch_model": model, "inference_batches_before_calibration": stats["batches"]}


# -- the discrete-event simulation of a node ---------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    training: int
    inference: int
    environment: int

    @property
    def gpus(self) -> int:
        return self.training + self.inference + self.environment

    @classmethod
    def parse(cls, text: str) -> Layout:
        parts = text.split("-")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"layout: expected three positive GPU counts like 2-2-4, got {text!r}")
        return cls(*(int(p) for p in parts))

    def __str__(self) -> str:
        return f"{self.training}-{self.inference}-{self.environment}"


@dataclass
class SimResult:
    wall_s: float
    layout: str
    train_busy_s: float  # GPU-seconds
    infer_busy_s: float  # GPU-seconds
    rl_updates: dict[str, int]
    sft_jobs: int
    batches: int
    batch_samples: int
    layout_gpus: int = 0
    per_tenant_wall_s: dict[str, float] = field(default_factory=dict)

    @property
    def gpu_seconds(self) -> float:
        return self.layout_gpus * self.wall_s


class _Plan:
    """Per tenant, the recorded samples each job and step uses: drawn once from a generator seeded
    by (seed, tenant), so a tenant's work is the same draws whichever mode replays it."""

    def __init__(self, trace: NodeTrace, seed: int) -> None:
        self.trace, self.seed = trace, seed
        self._env: dict[tuple[int, int], np.ndarray] = {}
        self._update: dict[int, np.ndarray] = {}
        self._sft: np.ndarray | None = None

    def env_steps(self, tenant: int, job: int) -> np.ndarray:
        key = (tenant, job)
        if key not in self._env:
            r = self.trace.rl[tenant]
            rng = np.random.default_rng([self.seed, tenant, job, 0])
            self._env[key] = rng.choice(np.asarray(r.env_step_s), size=r.steps_per_rollout)
        return self._env[key]

    def update(self, tenant: int, job: int) -> float:
        if tenant not in self._update:
            r = self.trace.rl[tenant]
            self._update[tenant] = np.random.default_rng([self.seed, tenant, 1]).choice(np.asarray(r.update_s), 4096)
        return float(self._update[tenant][job % 4096])

    def sft_update(self, job: int) -> float:
        if self._sft is None:
            assert self.trace.sft is not None
            self._sft = np.random.default_rng([self.seed, 10_000]).choice(np.asarray(self.trace.sft.update_s), 4096)
        return float(self._sft[job % 4096])


def simulate(
    trace: NodeTrace,
    layout: Layout,
    *,
    rl_tenants: list[int],
    jobs: int,
    sft_jobs: int | None = None,
    sft_continuous: bool = False,
    max_outstanding: int = 2,
    max_rollouts: int = 3,
    sft_prefetch: int = 16,
    seed: int = 0,
) -> SimResult:
    """Replay the trace on `layout`: the RL tenants `rl_tenants` (indices into trace.rl) make `jobs`
    updates each; the SFT tenant runs `sft_jobs` jobs, or with `sft_continuous` submits at its pace
    until the last RL update (the matched window). Returns when the window ends."""
    plan = _Plan(trace, seed)
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(at: float, kind: str, data: Any = None) -> None:
        nonlocal seq
        heapq.heappush(events, (at, seq, kind, data))
        seq += 1

    n_rl = len(rl_tenants)
    started = [0] * n_rl
    in_rollout = [False] * n_rl
    outstanding = [0] * n_rl  # rollouts begun whose update is not trained and synced yet
    done = [0] * n_rl
    step = [0] * n_rl
    pending = [0] * n_rl  # requests of the current step not served yet
    job_of = [0] * n_rl
    finished_at: dict[str, float] = {}
    active_rollouts = 0
    rr = 0  # round-robin start of rollout admission
    queue: deque[tuple[int, float]] = deque()  # (tenant slot, enqueue time), one sample each
    free_servers = layout.inference
    wake_at: float | None = None
    ready: deque[tuple[int, int]] = deque()  # RL updates ready for the actor, FIFO
    actor_busy = False
    sft_buffer = sft_made = sft_started = sft_done = 0
    sft_limit = None if sft_continuous else (sft_jobs or 0)
    producer_on = False
    train_busy = infer_busy = 0.0
    batches = batch_samples = 0
    end: float | None = None

    def want_sft() -> bool:
        return trace.sft is not None and (sft_continuous or sft_made < (sft_limit or 0))

    def start_producer(now: float) -> None:
        nonlocal producer_on
        if not producer_on and want_sft() and sft_buffer < sft_prefetch:
            producer_on = True
            push(now + trace.sft.interval_s, "sft_made")  # type: ignore[union-attr]

    def start_rollouts(now: float) -> None:
        nonlocal active_rollouts, rr
        for k in range(n_rl):
            i = (rr + k) % n_rl
            if active_rollouts >= max_rollouts:
                break
            if in_rollout[i] or outstanding[i] >= max_outstanding or started[i] >= jobs:
                continue
            in_rollout[i] = True
            job_of[i], step[i] = started[i], 0
            started[i] += 1
            outstanding[i] += 1
            active_rollouts += 1
            rr = (i + 1) % n_rl
            submit_step(i, now)

    def submit_step(i: int, now: float) -> None:
        n = trace.rl[rl_tenants[i]].samples_per_step
        pending[i] = n
        queue.extend((i, now) for _ in range(n))
        dispatch(now)

    def dispatch(now: float) -> None:
        nonlocal free_servers, wake_at, infer_busy, batches, batch_samples
        while free_servers and queue:
            if len(queue) < trace.max_batch and now < queue[0][1] + trace.max_wait_s - 1e-12:
                due = queue[0][1] + trace.max_wait_s
                if wake_at is None or wake_at > due or wake_at <= now:
                    wake_at = due
                    push(due, "wake")
                return
            members = [queue.popleft() for _ in range(min(trace.max_batch, len(queue)))]
            seconds = trace.batch_s(len(members))
            free_servers -= 1
            infer_busy += seconds
            batches += 1
            batch_samples += len(members)
            push(now + seconds, "batch_done", [m[0] for m in members])

    def try_actor(now: float) -> None:
        nonlocal actor_busy, sft_buffer, sft_started, train_busy
        if actor_busy:
            return
        if ready:
            i, job = ready.popleft()
            seconds = plan.update(rl_tenants[i], job)
            data: tuple[Any, ...] = ("rl", i)
        elif sft_buffer > 0:
            sft_buffer -= 1
            seconds = plan.sft_update(sft_started)
            sft_started += 1
            data = ("sft", None)
            start_producer(now)
        else:
            return
        actor_busy = True
        train_busy += seconds  # data parallel: `training` GPUs for seconds / training each
        push(now + seconds / layout.training, "update_done", data)

    def check_end(now: float) -> bool:
        nonlocal end
        rl_done = all(d >= jobs for d in done)
        sft_ok = sft_continuous or sft_limit is None or sft_done >= sft_limit or trace.sft is None
        if rl_done and sft_ok:
            end = now
        return end is not None

    start_producer(0.0)
    start_rollouts(0.0)
    if check_end(0.0):
        events.clear()
    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "wake":
            if wake_at is not None and now >= wake_at:
                wake_at = None
            dispatch(now)
        elif kind == "batch_done":
            free_servers += 1
            for i in data:
                pending[i] -= 1
                if pending[i] == 0:  # every env's action is back: the simulators step
                    push(now + float(plan.env_steps(rl_tenants[i], job_of[i])[step[i]]), "env_done", i)
            dispatch(now)
        elif kind == "env_done":
            i = data
            step[i] += 1
            if step[i] < trace.rl[rl_tenants[i]].steps_per_rollout:
                submit_step(i, now)
            else:  # the partition is written; advantages and bookkeeping (host) before it is ready
                in_rollout[i] = False
                active_rollouts -= 1
                push(now + trace.rl[rl_tenants[i]].overhead_s, "ready", (i, job_of[i]))
                start_rollouts(now)
        elif kind == "ready":
            ready.append(data)
            try_actor(now)
        elif kind == "update_done":
            actor_busy = False
            what, i = data
            if what == "rl":
                done[i] += 1
                if done[i] >= jobs:
                    finished_at[trace.rl[rl_tenants[i]].tenant_id] = now
                push(now + trace.rl[rl_tenants[i]].sync_s, "synced", i)
            else:
                sft_done += 1
            if check_end(now):
                break
            try_actor(now)
        elif kind == "synced":
            outstanding[data] -= 1
            start_rollouts(now)
        elif kind == "sft_made":
            producer_on = False
            sft_buffer += 1
            sft_made += 1
            start_producer(now)
            try_actor(now)
    if end is None:
        raise RuntimeError("simulation ended before the matched work was done (a deadlock in the replay)")
    return SimResult(
        wall_s=end,
        layout=str(layout),
        train_busy_s=train_busy,
        infer_busy_s=infer_busy,
        rl_updates={trace.rl[rl_tenants[i]].tenant_id: done[i] for i in range(n_rl)},
        sft_jobs=sft_done,
        batches=batches,
        batch_samples=batch_samples,
        layout_gpus=layout.gpus,
        per_tenant_wall_s=finished_at,
    )


@dataclass
class NodeComparison:
    replay: str
    joynexus: SimResult
    isolated: list[SimResult]  # one per RL tenant, then the SFT trace
    isolated_layout: str

    @property
    def isolated_gpu_seconds(self) -> float:
        return sum(r.gpu_seconds for r in self.isolated)

    @property
    def efficiency(self) -> float:
        return self.isolated_gpu_seconds / self.joynexus.gpu_seconds

    def utilisation(self, which: str) -> tuple[float, float]:
        """(isolated: mean over the RL traces, JoyNexus) as in Table 1."""
        key, gpus = ("train_busy_s", "training") if which == "training" else ("infer_busy_s", "inference")
        node = Layout.parse(self.isolated_layout)
        rl_runs = [r for r in self.isolated if r.rl_updates]
        isolated = statistics.mean(getattr(r, key) / (getattr(node, gpus) * r.wall_s) for r in rl_runs)
        together_layout = Layout.parse(self.joynexus.layout)
        return isolated, getattr(self.joynexus, key) / (getattr(together_layout, gpus) * self.joynexus.wall_s)

    def summary(self) -> dict[str, Any]:
        train, infer = self.utilisation("training"), self.utilisation("inference")
        sft_run = next((r for r in self.isolated if not r.rl_updates), None)
        # Conservative reading: the appended SFT work charged its training GPU only, not a 1-1-2 unit.
        rl_only = sum(r.gpu_seconds for r in self.isolated if r.rl_updates)
        sft_train_only = sft_run.train_busy_s if sft_run is not None else 0.0
        return {
            "replay": self.replay,
            "isolated_layout": self.isolated_layout,
            "efficiency": self.efficiency,
            "gpu_time_reduction": 1.0 - 1.0 / self.efficiency,
            "efficiency_sft_training_gpu_only": (rl_only + sft_train_only) / self.joynexus.gpu_seconds,
            "training_utilisation": {"isolated": train[0], "joynexus": train[1], "ratio": train[1] / train[0]},
            "inference_utilisation": {"isolated": infer[0], "joynexus": infer[1], "ratio": infer[1] / infer[0]},
            "joynexus": asdict(self.joynexus),
            "isolated": [asdict(r) for r in self.isolated],
            "joynexus_mean_batch_samples": self.joynexus.batch_samples / max(1, self.joynexus.batches),
        }


def compare_on_node(
    trace: NodeTrace, *, jobs: int, seed: int, replay: str, isolated_layout: Layout = Layout(1, 1, 2)
) -> NodeComparison:
    """JoyNexus on 2-2-4 (the matched window) vs each tenant's standalone trace, one after another."""
    all_rl = list(range(len(trace.rl)))
    together = simulate(trace, Layout(2, 2, 4), rl_tenants=all_rl, jobs=jobs, sft_continuous=trace.sft is not None,
                        max_outstanding=2, max_rollouts=3, seed=seed)  # fmt: skip
    isolated = [
        simulate(trace, isolated_layout, rl_tenants=[i], jobs=jobs, max_outstanding=1, max_rollouts=1, seed=seed)
        for i in all_rl
    ]
    if trace.sft is not None and together.sft_jobs:
        isolated.append(simulate(trace, isolated_layout, rl_tenants=[], jobs=0, sft_jobs=together.sft_jobs, seed=seed))
    return NodeComparison(replay, together, isolated, str(isolated_layout))


def host_overheads(trace: NodeTrace, isolated: dict[str, RunMeasure], seed: int) -> dict[str, float]:
    """Per RL job, the time the measured isolated run took beyond its replayed service times: the
    same DES on this machine's shape (one training and one inference device, two outstanding jobs,
    as the measured specs) without overhead, and the measured wall minus that, per job."""
    out: dict[str, float] = {}
    for i, r in enumerate(trace.rl):
        measured = isolated[r.tenant_id]
        jobs = measured.tenants[r.tenant_id].completed_jobs
        replay = simulate(trace, Layout(1, 1, 1), rl_tenants=[i], jobs=jobs, max_outstanding=2, max_rollouts=1,
                          seed=seed)  # fmt: skip
        out[r.tenant_id] = max(0.0, (measured.wall_s - replay.wall_s) / jobs)
    return out


# -- reporting -------------------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


Pair = tuple[dict[str, RunMeasure], RunMeasure]  # (isolated run per tenant, together run) of one repeat


def measured_summary(pairs: list[Pair]) -> dict[str, Any]:
    """The measured figures pooled over the repeats: sums of walls and busy seconds, so a repeat
    that met a busier machine weighs by its length rather than skewing a ratio of ratios."""
    iso_runs = [r for isolated, _ in pairs for r in isolated.values()]
    tog_runs = [together for _, together in pairs]
    iso_wall, tog_wall = sum(r.wall_s for r in iso_runs), sum(r.wall_s for r in tog_runs)

    def total(runs: list[RunMeasure], key: str) -> float:
        return sum(getattr(r, key) for r in runs)

    def rl_mean(key: str) -> float:  # Table 1's isolated row: the mean over the RL tenants' runs
        return statistics.mean(
            sum(getattr(iso[t.tenant], key) for iso, _ in pairs) / sum(iso[t.tenant].wall_s for iso, _ in pairs)
            for t in RL_TENANTS
        )

    work = [
        {
            tid: {"isolated": list(iso[tid].tenants[tid].work()), "together": list(tog.tenants[tid].work())}
            for tid in iso
        }
        for iso, tog in pairs
    ]
    iso_busy = total(iso_runs, "train_busy_s") + total(iso_runs, "infer_busy_s")
    tog_busy = total(tog_runs, "train_busy_s") + total(tog_runs, "infer_busy_s")
    return {
        "repeats": len(pairs),
        "isolated_wall_s": iso_wall,
        "together_wall_s": tog_wall,
        "efficiency": iso_wall / tog_wall,
        "efficiency_per_repeat": [sum(r.wall_s for r in iso.values()) / tog.wall_s for iso, tog in pairs],
        "device_busy_ratio": iso_busy / tog_busy,
        "training_busy_s": {"isolated": total(iso_runs, "train_busy_s"), "together": total(tog_runs, "train_busy_s")},
        "inference_busy_s": {"isolated": total(iso_runs, "infer_busy_s"), "together": total(tog_runs, "infer_busy_s")},
        "cpu_s": {"isolated": total(iso_runs, "cpu_s"), "together": total(tog_runs, "cpu_s")},
        # Per process (Ray: each actor with the simulator workers it reaped, and the driver).
        "cpu_by_process_s": {
            "isolated": _sum_by_key(r.cpu_by_process for r in iso_runs),
            "together": _sum_by_key(r.cpu_by_process for r in tog_runs),
        },
        "cores_used": {
            "isolated": total(iso_runs, "cpu_s") / iso_wall,
            "together": total(tog_runs, "cpu_s") / tog_wall,
        },
        "training_utilisation": {
            "isolated_rl_mean": rl_mean("train_busy_s"),
            "isolated_pooled": total(iso_runs, "train_busy_s") / iso_wall,
            "together": total(tog_runs, "train_busy_s") / tog_wall,
            # The same work at its standalone speed over the together wall: on a shared CPU a busy
            # second stretches under contention, so busy / wall alone overstates what was done.
            "together_work_normalised": total(iso_runs, "train_busy_s") / tog_wall,
        },
        "inference_utilisation": {
            "isolated_rl_mean": rl_mean("infer_busy_s"),
            "isolated_pooled": total(iso_runs, "infer_busy_s") / iso_wall,
            "together": total(tog_runs, "infer_busy_s") / tog_wall,
            "together_work_normalised": total(iso_runs, "infer_busy_s") / tog_wall,
        },
        "inference_mean_batch": {
            "isolated": total(iso_runs, "infer_samples") / max(1, total(iso_runs, "infer_batches")),
            "together": total(tog_runs, "infer_samples") / max(1, total(tog_runs, "infer_batches")),
        },
        "work": work,
        "same_work": all(w["isolated"] == w["together"] for repeat in work for w in repeat.values()),
        "dropped_or_failed_jobs": {
            "isolated": sum(w.dropped_jobs + w.failed_jobs for r in iso_runs for w in r.tenants.values()),
            "together": sum(w.dropped_jobs + w.failed_jobs for r in tog_runs for w in r.tenants.values()),
        },
        "sessions_opened": {
            "isolated": _sum_by_key(r.sessions_opened for r in iso_runs),
            "together": _sum_by_key(r.sessions_opened for r in tog_runs),
        },
        "load_average": {
            "isolated": [r.load_average for r in iso_runs],
            "together": [r.load_average for r in tog_runs],
        },
    }


# -- where the actor loop's time goes (py-spy samples of the Master's process) ----------------------------
PROFILE_RATE_HZ = 100
# (category, what a sample's stack contains), first match wins: the bookkeeping after a job first
# (it runs inside `TrainingWorkloads.on_outcome`), then the loop's own calls. "train_job" and "policy_version" are
# told apart by the line of the ActorLoop step they are called from (a Ray call's frame is the handle's).
ACTOR_LOOP_CATEGORIES = (
    ("weight sync (export_params + load_weights)", "TrainingWorkloads.publish_weights"),
    ("MLflow logging", "ExperimentTracker."),
    ("events (store transaction)", "WorkloadRecords.emit_many"),
    ("workload progress row (store transaction)", "_persist_progress"),
    ("other outcome bookkeeping", "TrainingWorkloads.on_outcome"),
    ("complete (store transaction)", "TrainingScheduler.complete"),
    ("lease_next (store transaction)", "TrainingScheduler.lease_next"),
    ("waiting for a ready job (idle)", "TrainingScheduler.wait_for_ready"),
)


def start_profile(pid: int, out: Path) -> Any:
    """py-spy sampling `pid` (every thread, idle ones too, without pausing it) until stop_profile."""
    import shutil
    import subprocess

    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    command = [exe, "record", "--pid", str(pid), "--rate", str(PROFILE_RATE_HZ), "--idle", "--threads",
               "--nonblocking", "--format", "raw", "--output", str(out)]  # fmt: skip
    sampler = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # attached before the window opens
    if sampler.poll() is not None:
        raise RuntimeError(f"--profile: py-spy exited at once: {sampler.stderr.read() if sampler.stderr else ''}")
    return sampler


def stop_profile(sampler: Any) -> None:
    import signal

    sampler.send_signal(signal.SIGINT)  # py-spy writes its samples on Ctrl-C
    sampler.wait(timeout=60)


def _step_call_lines() -> dict[int, str]:
    """Lines of the ActorLoop steps that call the Training Model Service, read from this tree's source
    (`train_jobs`, a grouped step, counts as training too)."""
    source = Path(__file__).resolve().parents[1] / "joynexus" / "master" / "loops" / "actor_loop.py"
    lines: dict[int, str] = {}
    for number, line in enumerate(source.read_text().splitlines(), start=1):
        if "self.service.train_job(" in line or "self.service.train_jobs(" in line:
            lines[number] = "train_job (the Training Model Service training)"
        elif "self.service.policy_version(" in line:
            lines[number] = "policy_version call"
    return lines


def actor_loop_breakdown(profile: Path, jobs: int) -> dict[str, Any]:
    """The actor-loop thread's wall time by category, from py-spy's collapsed stacks: seconds and
    milliseconds per completed job. Samples are taken at PROFILE_RATE_HZ, idle ones included."""
    import re

    step_line = re.compile(r"ActorLoop\.(?:step|step_all|_single|_group) \([^)]*actor_loop\.py:(\d+)\)")
    call_lines = _step_call_lines()
    samples: dict[str, int] = {}
    total = 0
    for line in profile.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        thread = stack.split(";", 1)[0]  # "thread (tid): name"
        if not count_text.isdigit() or not (thread.endswith(": actor_loop") or "ActorLoop." in stack):
            continue
        count = int(count_text)
        total += count
        category = next((name for name, marker in ACTOR_LOOP_CATEGORIES if marker in stack), None)
        if category is None:
            lines = [int(n) for n in step_line.findall(stack)]
            category = next((call_lines[n] for n in lines if n in call_lines), "other (the loop itself)")
        samples[category] = samples.get(category, 0) + count
    if total == 0:
        raise RuntimeError(f"--profile: no actor-loop samples in {profile}")
    seconds = {k: v / PROFILE_RATE_HZ for k, v in sorted(samples.items(), key=lambda kv: -kv[1])}
    return {
        "profile": str(profile),
        "rate_hz": PROFILE_RATE_HZ,
        "actor_loop_seconds": total / PROFILE_RATE_HZ,
        "completed_jobs": jobs,
        "seconds": seconds,
        "share": {k: v / (total / PROFILE_RATE_HZ) for k, v in seconds.items()},
        "ms_per_job": {k: 1000 * v / max(1, jobs) for k, v in seconds.items()},
    }


def print_breakdown(breakdown: dict[str, Any], together: RunMeasure) -> None:
    print(f"\nwhere the actor loop's time goes ({together.mode}, together run, py-spy at {breakdown['rate_hz']} Hz, "
          f"{breakdown['actor_loop_seconds']:.1f} s sampled, {breakdown['completed_jobs']} jobs):")  # fmt: skip
    for name, secs in breakdown["seconds"].items():
        share, per_job = _pct(breakdown["share"][name]), breakdown["ms_per_job"][name]
        print(f"  {name:<48}{secs:8.2f} s {share:>7} {per_job:8.1f} ms/job")
    cpu = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(together.cpu_by_process.items(), key=lambda kv: -kv[1]))
    print(f"  CPU by process over the window: {cpu}")


def _sum_by_key(dicts: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def print_measured(pairs: list[Pair], summary: dict[str, Any]) -> None:
    print("\n1. measured on this machine (one deployment = the machine; isolated runs one after another)")
    print(f"{'run':<30}{'wall s':>8}{'train busy':>11}{'infer busy':>11}{'train util':>11}{'infer util':>11}"
          f"{'mean b':>7}{'cores':>7}{'load':>11}")  # fmt: skip
    for k, (isolated, together) in enumerate(pairs):
        for r in [*isolated.values(), together]:
            mean_batch = r.infer_samples / max(1, r.infer_batches)
            load = f"{r.load_average[0]:.1f}-{r.load_average[1]:.1f}"
            utils = f"{_pct(r.train_util):>11}{_pct(r.infer_util):>11}"
            print(f"{f'#{k} {r.label}':<30}{r.wall_s:8.2f}{r.train_busy_s:11.2f}{r.infer_busy_s:11.2f}"
                  f"{utils}{mean_batch:7.2f}{r.cores_used:7.2f}{load:>11}")  # fmt: skip
    s = summary
    print("work per tenant (jobs, samples trained, inference samples, env steps), isolated | together:")
    for k, repeat in enumerate(s["work"]):
        for tid, w in repeat.items():
            mark = "same" if w["isolated"] == w["together"] else "DIFFERENT"
            print(f"  #{k} {tid:<20}{str(tuple(w['isolated'])):>26} | {str(tuple(w['together'])):<26} {mark}")
    print(f"dropped or failed jobs: isolated {s['dropped_or_failed_jobs']['isolated']}, "
          f"together {s['dropped_or_failed_jobs']['together']}")  # fmt: skip
    tu, iu, cores = s["training_utilisation"], s["inference_utilisation"], s["cores_used"]
    per_repeat = ", ".join(f"{e:.2f}x" for e in s["efficiency_per_repeat"])
    print(f"efficiency (sum isolated walls / together wall, {s['repeats']} repeat(s) pooled): "
          f"{s['isolated_wall_s']:.2f} s / {s['together_wall_s']:.2f} s = {s['efficiency']:.2f}x "
          f"(per repeat {per_repeat}; paper 1.39x, goal >= 1.5x)")  # fmt: skip
    print(f"device-busy ratio (isolated / together, training + inference busy): {s['device_busy_ratio']:.2f}x")
    print(f"CPU: isolated {s['cpu_s']['isolated']:.1f} s ({cores['isolated']:.2f} cores on average), together "
          f"{s['cpu_s']['together']:.1f} s ({cores['together']:.2f} cores) of {os.cpu_count()}")  # fmt: skip
    for side in ("isolated", "together"):
        by_process = sorted(s["cpu_by_process_s"][side].items(), key=lambda kv: -kv[1])
        print(f"  {side} CPU by process: " + ", ".join(f"{k} {v:.1f} s" for k, v in by_process))
    # sum(wall_iso) / wall_tog = (CPU_iso / cores_iso) / (CPU_tog / cores_tog): which factor moved.
    cpu_ratio = s["cpu_s"]["isolated"] / s["cpu_s"]["together"]
    print(f"  efficiency = CPU-seconds ratio {cpu_ratio:.2f} x cores-used ratio "
          f"{cores['together'] / cores['isolated']:.2f} (together / isolated)")  # fmt: skip
    print(f"training utilisation: isolated (RL mean) {_pct(tu['isolated_rl_mean'])} -> together "
          f"{_pct(tu['together'])} = {tu['together'] / tu['isolated_rl_mean']:.2f}x   (pooled isolated "
          f"{_pct(tu['isolated_pooled'])}; paper 20.8% -> 41.3% = 1.99x)")  # fmt: skip
    print(f"inference utilisation: isolated (RL mean) {_pct(iu['isolated_rl_mean'])} -> together "
          f"{_pct(iu['together'])} = {iu['together'] / iu['isolated_rl_mean']:.2f}x   (pooled isolated "
          f"{_pct(iu['isolated_pooled'])}; paper 28.1% -> 37.5% = 1.33x)")  # fmt: skip
    normalised = f"training {_pct(tu['together_work_normalised'])}, inference {_pct(iu['together_work_normalised'])}"
    print(
        f"together utilisation work-normalised (the same work's standalone busy seconds / together wall): {normalised}"
    )
    mb = s["inference_mean_batch"]
    print(f"inference mean batch: isolated {mb['isolated']:.2f} samples, together {mb['together']:.2f}")
    opened = ", ".join(f"{side} {int(n.get('fresh', 0))} / {int(n.get('warm', 0))}"
                       for side, n in s["sessions_opened"].items())  # fmt: skip
    print(f"environment sessions opened on a fresh simulator process / a warm one: {opened}")


def print_node(comparisons: list[NodeComparison]) -> None:
    print("\n2. trace-driven simulation of the paper's 8-GPU node (JoyNexus 2-2-4 vs standalone traces)")
    print(f"{'replay':<18}{'isolated':>9}{'efficiency':>11}{'(SFT 1 GPU)':>12}{'GPU-time -':>11}"
          f"{'training util':>24}{'inference util':>24}{'SFT jobs':>9}")  # fmt: skip
    for c in comparisons:
        s = c.summary()
        tu, iu = s["training_utilisation"], s["inference_utilisation"]
        train = f"{_pct(tu['isolated'])} -> {_pct(tu['joynexus'])} {tu['ratio']:4.2f}x"
        infer = f"{_pct(iu['isolated'])} -> {_pct(iu['joynexus'])} {iu['ratio']:4.2f}x"
        print(f"{c.replay:<18}{c.isolated_layout:>9}{s['efficiency']:10.2f}x{s['efficiency_sft_training_gpu_only']:11.2f}x"
              f"{_pct(s['gpu_time_reduction']):>11}{train:>24}{infer:>24}{c.joynexus.sft_jobs:9d}")  # fmt: skip
    train = f"{_pct(0.208)} -> {_pct(0.413)} 1.99x"
    infer = f"{_pct(0.281)} -> {_pct(0.375)} 1.33x"
    print(f"{'paper (4B, 90 min)':<18}{'1-1-2':>9}{PAPER['efficiency']:10.2f}x{'-':>12}{_pct(0.283):>11}"
          f"{train:>24}{infer:>24}{'-':>9}")  # fmt: skip
    print("(SFT 1 GPU): the appended SFT work charged its training GPU only instead of a 1-1-2 unit")


def print_trace(trace: NodeTrace, calibration: dict[str, Any]) -> None:
    m = calibration["batch_model"]
    print(f"\ntrace: inference batch time = {1000 * trace.batch_a_s:.2f} ms + {1000 * trace.batch_c_s:.3f} ms x b "
          f"(r^2 {m['r2']:.3f}; B={trace.max_batch}, T={1000 * trace.max_wait_s:.0f} ms)")  # fmt: skip
    for r in trace.rl:
        print(f"  {r.tenant_id:<18} {r.samples_per_step} envs x {r.steps_per_rollout} steps: env step "
              f"{1000 * statistics.median(r.env_step_s):.1f} ms, update {1000 * statistics.median(r.update_s):.0f} ms, "
              f"sync {1000 * r.sync_s:.0f} ms, host overhead/job {1000 * r.overhead_s:.0f} ms")  # fmt: skip
    if trace.sft is not None:
        print(
            f"  {SFT_TENANT:<18} update {1000 * statistics.median(trace.sft.update_s):.0f} ms, "
            f"one job per {1000 * trace.sft.interval_s:.0f} ms standalone"
        )


# -- the command -------------------------------------------------------------------------------------------
def measure_pair(
    specs: list[dict[str, Any]],
    work_dir: Path,
    timeout_s: float,
    *,
    together_first: bool,
    calibrate: Any = None,
    mode: str = "ray",
    profile: Path | None = None,
) -> Pair:
    """One isolated sequence and one together run, on fresh deployments of `mode`; the order
    alternates between repeats (A B, B A, ...) so a drift of the machine's load hits both sides alike.
    `calibrate(deployment, isolated)` runs on the live together deployment (it needs the isolated
    runs); `profile`: py-spy samples of the Master's process during the together run."""
    isolated: dict[str, RunMeasure] = {}
    together: RunMeasure | None = None

    def run_isolated() -> None:
        for spec in specs:
            tid = spec["tenant"]
            with tempfile.TemporaryDirectory(prefix=f"iso-{tid}-", dir=work_dir) as tmp:
                isolated[tid] = run_deployment(f"isolated {tid}", [spec], Path(tmp), timeout_s, mode=mode)
            print(f"  isolated {tid}: {isolated[tid].wall_s:.2f} s", flush=True)

    def run_together() -> None:
        nonlocal together
        keep = None if calibrate is None else (lambda deployment: calibrate(deployment, isolated))
        with tempfile.TemporaryDirectory(prefix="together-", dir=work_dir) as tmp:
            together = run_deployment(
                "together (JoyNexus)", specs, Path(tmp), timeout_s, keep=keep, mode=mode, profile=profile
            )
        finished = ", ".join(f"{tid} {times[-1]:.1f} s" for tid, times in together.completions_s.items() if times)
        print(f"  together: {together.wall_s:.2f} s (last update per tenant: {finished})", flush=True)
        sizes = [n for work in together.tenants.values() for n in work.group_sizes]
        grouped = sum(1 for n in sizes if n > 1)
        print(
            f"  together: {grouped} of {len(sizes)} jobs trained in grouped steps (JOYNEXUS_TRAINING_GROUP_MAX; "
            f"mean group size {sum(sizes) / max(1, len(sizes)):.2f}; SFT and RL jobs group)",
            flush=True,
        )

    for run in (run_together, run_isolated) if together_first else (run_isolated, run_together):
        run()
    assert together is not None
    return isolated, together


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run: 4 jobs per tenant, one repeat, short replay")
    parser.add_argument("--out", type=Path, default=Path("var/benchmarks"))
    parser.add_argument("--rl-jobs", type=int, default=None, help="PPO updates per RL tenant (default 12; quick 4)")
    parser.add_argument("--sft-jobs", type=int, default=None, help="SFT jobs (default 12; quick 4)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="isolated/together pairs, order alternated (2; quick 1)"
    )
    parser.add_argument("--sim-jobs", type=int, default=None, help="replayed updates per RL tenant (200; quick 50)")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="training.checkpoint_every_jobs of every tenant (0: at the end of the workload only)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--isolated-layout", default="1-1-2", help="standalone GPUs per tenant (paper: 1-1-2)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="ray",
        help="ray: the services and the Master as Ray actors, each its own process (default); "
        "inprocess: every service a local object of this one process",
    )
    parser.add_argument(
        "--preset", default="tiny", help="backbone preset every deployment serves (tiny; smolvlm-256m: issue 42.5)"
    )
    parser.add_argument("--image-size", type=int, default=None, help="canonical camera side (default: the preset's)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="sample the Master's process with py-spy during the first together run and print where the "
        "actor loop's time per job goes",
    )
    args = parser.parse_args()  # fmt: skip
    for name in ("rl_jobs", "sft_jobs", "sim_jobs", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every: must be >= 0, got {args.checkpoint_every}")
    try:
        isolated_layout = Layout.parse(args.isolated_layout)
    except ValueError as error:
        parser.error(f"--isolated-layout: {error}")
    rl_jobs = args.rl_jobs or (4 if args.quick else 12)
    sft_jobs = args.sft_jobs or (4 if args.quick else 12)
    repeats = args.repeats or (1 if args.quick else 2)
    sim_jobs = args.sim_jobs or (50 if args.quick else 200)
    # Every deployment (in this process or its Ray actors) reads the backbone from the environment
    # (Settings); the tenants name the model id that backbone is served under.
    os.environ["JOYNEXUS_BACKBONE_PRESET"] = args.preset
    if args.image_size:
        os.environ["JOYNEXUS_BACKBONE_IMAGE_SIZE"] = str(args.image_size)
    from joynexus.models.backbone import BackboneSource
    from joynexus.models.backbone.tiny import spec_model_id

    model = spec_model_id(BackboneSource(preset=args.preset, image_size=args.image_size).preset_spec(), seed=0)

    print(f"mixed SFT + RL ({args.mode} deployments, {model}): {len(RL_TENANTS)} RL tenants x {rl_jobs} PPO updates, "
          f"{len(SFT_TENANTS)} SFT tenants x {sft_jobs} jobs, {repeats} isolated/together pair(s); load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    recorded: dict[str, Any] = {}
    profile_path = args.out / f"mixed_workload_master_{args.mode}.pyspy.txt" if args.profile else None

    def calibrate(deployment: OpenDeployment, isolated: dict[str, RunMeasure]) -> None:
        recorded["isolated"] = dict(isolated)
        recorded["trace"], recorded["calibration"] = record_trace(
            deployment, isolated, batch_repeats=3 if args.quick else 5, env_rollouts=1 if args.quick else 2
        )

    pairs: list[Pair] = []
    with tempfile.TemporaryDirectory(prefix="mixed-workload-") as tmp:
        sft_root = write_sft_dataset(Path(tmp) / "datasets" / "sft-demos")
        specs = [rl_spec(t, rl_jobs, args.checkpoint_every, model=model) for t in RL_TENANTS]
        specs += [
            sft_spec(sft_root, sft_jobs, args.checkpoint_every, model=model, tenant=tenant) for tenant in SFT_TENANTS
        ]
        for k in range(repeats):
            # The trace is recorded in the first repeat, where the isolated runs come first.
            pairs.append(measure_pair(specs, Path(tmp), args.timeout, together_first=k % 2 == 1,
                                      calibrate=calibrate if k == 0 else None, mode=args.mode,
                                      profile=profile_path if k == 0 else None))  # fmt: skip
    if args.mode == "ray":
        import ray

        ray.shutdown()
    summary = measured_summary(pairs)
    print_measured(pairs, summary)
    breakdown = None
    if profile_path is not None:
        together = pairs[0][1]
        jobs_done = sum(w.completed_jobs for w in together.tenants.values())
        breakdown = actor_loop_breakdown(profile_path, jobs_done)
        print_breakdown(breakdown, together)

    trace: NodeTrace = recorded["trace"]
    with_overhead = trace.with_overheads(host_overheads(trace, recorded["isolated"], args.seed))
    comparisons = [
        compare_on_node(trace, jobs=sim_jobs, seed=args.seed, replay="service times", isolated_layout=isolated_layout),
        compare_on_node(with_overhead, jobs=sim_jobs, seed=args.seed, replay="+ host overhead",
                        isolated_layout=isolated_layout),
    ]  # fmt: skip
    print_trace(with_overhead, recorded["calibration"])
    print_node(comparisons)

    measured_eff = summary["efficiency"]
    verdict = lambda x: "holds" if x >= 1.5 else "does NOT hold"  # noqa: E731
    print(f"\ngoal >= 1.5x: measured {measured_eff:.2f}x ({verdict(measured_eff)}); simulated node "
          + ", ".join(f"{c.replay} {c.efficiency:.2f}x ({verdict(c.efficiency)})" for c in comparisons))  # fmt: skip
    result = {
        "config": {"mode": args.mode, "rl_tenants": [asdict(t) for t in RL_TENANTS], "rl_jobs": rl_jobs,
                   "sft_jobs": sft_jobs,
                   "repeats": repeats, "sim_jobs": sim_jobs, "seed": args.seed,
                   "checkpoint_every": args.checkpoint_every, "isolated_layout": str(isolated_layout),
                   "cpu_count": os.cpu_count()},
        "paper": PAPER,
        "measured": summary,
        "measured_runs": [{r.label: asdict(r) for r in [*iso.values(), tog]} for iso, tog in pairs],
        "trace": asdict(with_overhead),
        "calibration": recorded["calibration"],
        "node": [c.summary() for c in comparisons],
        "goal_1_5x": {"measured": measured_eff >= 1.5, **{c.replay: c.efficiency >= 1.5 for c in comparisons}},
        "actor_loop_profile": breakdown,
    }  # fmt: skip
    path = args.out / f"mixed_workload_{args.mode}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"all figures: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
