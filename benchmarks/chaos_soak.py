"""Chaos soak: many tenants with mixed SFT / RL / eval workloads on the Ray deployment while each
role is SIGKILLed in turn (paper 4.4: a failed role restarts in place and resumes from recorded
progress while the other tenants continue).

  .venv/bin/python benchmarks/chaos_soak.py [--tenants 16] [--minutes 10] [--kill-every-s 45]

Every third tenant is an RL tenant (PushT-reach), the others SFT on a synthetic LeRobot dataset;
after every second training workload a tenant runs a 1-episode evaluation. The roles killed in turn
are the Training Model Service, the Training Queue, the Inference Model Service, the Environment
Service and the Master Service itself (their actor processes, with SIGKILL); Ray restarts each in
place and the Master's Health Manager restores what it held.

Printed: load held (workloads and jobs completed, jobs per minute), faults injected, restarts seen
per role, the longest stall per tenant (time with a running workload and no completed job) next to
its median time per job, and the check that every acknowledged version (the policy version a
workload registered and pinned, with the checkpoint digest read when it was acknowledged) is still
there with that digest. Exit status 1 when an acknowledged version was lost or a workload failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from joynexus.connect import Cluster, ray_cluster  # noqa: E402
from joynexus.master.health import HealthOptions  # noqa: E402
from joynexus.master.service import MasterOptions  # noqa: E402
from joynexus.settings import Settings

KILL_ORDER = ("training_service", "training_queue", "inference_service", "environment_service", "master")
FINAL = ("completed", "failed", "cancelled")


def sft_spec(tenant: str, root: Path) -> dict[str, Any]:
    return {
        "tenant": tenant,
        "base_model": "joynexus/tiny-smolvlm",
        "task": "sft",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {"cameras": ["top"], "image_size": [32, 32], "state_dim": 4, "action_dim": 2,
                        "action_chunk": 1, "instruction": "move the pusher to the T-shaped block"},
        "dataset": {"root": str(root), "repo_id": f"soak/{tenant}"},
        "environment": {"simulator": "pusht", "task": "PushT-reach-v0", "num_envs": 1, "horizon": 8,
                        "max_episode_steps": 8},
        "scheduling": {"max_in_flight_jobs": 1},
        "training": {"samples_per_job": 16, "microbatch_size": 16, "learning_rate": 1e-3},
    }  # fmt: skip


def rl_spec(tenant: str) -> dict[str, Any]:
    return {
        "tenant": tenant,
        "base_model": "joynexus/tiny-smolvlm",
        "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {"cameras": ["top"], "image_size": [32, 32], "state_dim": 4, "action_dim": 2,
                        "action_chunk": 1, "instruction": "move the pusher to the T-shaped block"},
        "environment": {"simulator": "pusht", "task": "PushT-reach-v0", "num_envs": 2, "horizon": 4,
                        "max_episode_steps": 8},
        "rl": {"advantage": "gae", "ppo_epochs": 1, "gamma": 0.95},
        "scheduling": {"max_in_flight_jobs": 1, "max_policy_staleness": 2},
        "training": {"samples_per_job": 8, "microbatch_size": 8, "learning_rate": 5e-5},
    }  # fmt: skip


@dataclass
class TenantLoad:
    tenant_id: str
    task: str
    trained: int = 0  # training workloads completed
    workload: str | None = None
    kind: str = ""
    last_jobs: int = 0
    last_progress: float = 0.0
    job_gaps: list[float] = field(default_factory=list)
    max_stall_s: float = 0.0
    completed_workloads: int = 0
    failed: list[str] = field(default_factory=list)
    acknowledged: dict[int, str] = field(default_factory=dict)  # registered policy version -> digest
    jobs: int = 0


@dataclass
class SoakResult:
    seconds: float
    tenants: list[TenantLoad]
    faults: list[tuple[float, str, int]]
    restarts: dict[str, int]
    control_errors: int
    lost: list[tuple[str, int, str]]

    @property
    def ok(self) -> bool:
        return not self.lost and not any(t.failed for t in self.tenants)


def _retrying(call: Any, errors: list[int]) -> Any:
    """A Master call that may meet the Master restarting: retry for up to three minutes (a restart
    with its restores takes over a minute on a loaded 2-core machine)."""
    deadline = time.monotonic() + 180
    while True:
        try:
            return call()
        except Exception:
            errors[0] += 1
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _pid(cluster: Cluster, role: str) -> int:
    if role == "master":
        return int(cluster.master.ping()["pid"])
    return int(cluster.master.role_beat(role)["pid"])


def run(*, tenants: int, seconds: float, kill_every_s: float, data_dir: Path, jobs_per_workload: int = 3) -> SoakResult:
    from joynexus.data.lerobot_dataset import write_synthetic_dataset

    settings = Settings(data_dir=data_dir, ray_namespace=f"soak-{uuid.uuid4().hex[:8]}", torch_threads=1)
    options = MasterOptions(
        max_running_workloads=tenants, health=HealthOptions(interval_s=0.5), max_failures_per_workload=6
    )
    cluster = ray_cluster(settings, options=options)
    errors = [0]
    loads: list[TenantLoad] = []
    try:
        for i in range(tenants):
            tenant_id = f"soak-{i:02d}"
            if i % 3 == 2:
                spec = rl_spec(tenant_id)
            else:
                root = data_dir / "datasets" / tenant_id
                spec = sft_spec(tenant_id, root)
                write_synthetic_dataset(
                    root, spec["dataset"]["repo_id"], cameras=["top"], image_size=(32, 32), state_dim=4,
                    action_dim=2, num_episodes=2, episode_length=8, seed=i,
                )  # fmt: skip
            cluster.master.create_tenant(spec)
            loads.append(TenantLoad(tenant_id, spec["task"]))
        faults: list[tuple[float, str, int]] = []
        # Restarts as this client sees them: a role's incarnation changing between two looks (a new
        # Master starts its own counts at zero, so the Master's report alone would undercount).
        incarnations: dict[str, str] = {}
        restarts: dict[str, int] = {}

        def observe_restarts() -> None:
            for role, entry in _retrying(cluster.master.health, errors).items():
                current = entry.get("incarnation")
                if current is None:
                    continue
                if role in incarnations and incarnations[role] != current:
                    restarts[role] = restarts.get(role, 0) + 1
                incarnations[role] = current

        started = time.monotonic()
        next_kill = started + kill_every_s
        while True:
            now = time.monotonic()
            running = False
            for load in loads:
                if load.workload is not None:
                    status = _retrying(lambda w=load.workload: cluster.master.get_workload(w), errors)
                    if status.completed_jobs > load.last_jobs:
                        load.job_gaps.append((now - load.last_progress) / (status.completed_jobs - load.last_jobs))
                        load.jobs += status.completed_jobs - load.last_jobs
                        load.last_jobs, load.last_progress = status.completed_jobs, now
                    if load.kind == "train":  # an evaluation has no jobs to complete
                        load.max_stall_s = max(load.max_stall_s, now - load.last_progress)
                    if status.state in FINAL:
                        load.workload = None
                        if status.state != "completed":
                            load.failed.append(f"{status.workload_id} ({load.kind}): {status.error}")
                        else:
                            load.completed_workloads += 1
                            if load.kind == "train":
                                load.trained += 1
                                # Acknowledged: the policy version the Master registered and
                                # pinned at the end of the workload, with its checkpoint digest.
                                for version in cluster.checkpoints.pinned(load.tenant_id) - set(load.acknowledged):
                                    manifest = cluster.checkpoints.read_manifest(load.tenant_id, version)
                                    load.acknowledged[version] = manifest.digest
                    else:
                        running = True
                if load.workload is None and now - started < seconds:
                    if load.trained and load.trained % 2 == 0 and load.kind == "train":
                        status = _retrying(lambda t=load.tenant_id: cluster.master.evaluate(t, episodes=1), errors)
                        load.kind = "eval"
                    else:
                        status = _retrying(
                            lambda t=load.tenant_id: cluster.master.submit_workload(t, jobs=jobs_per_workload), errors
                        )
                        load.kind = "train"
                    load.workload, load.last_jobs, load.last_progress = status.workload_id, 0, now
                    running = True
            observe_restarts()
            if now - started >= seconds and not running:
                break
            if now >= next_kill and now - started < seconds:
                role = KILL_ORDER[len(faults) % len(KILL_ORDER)]
                pid = _retrying(lambda r=role: _pid(cluster, r), errors)
                os.kill(pid, signal.SIGKILL)
                faults.append((now - started, role, pid))
                print(f"[{now - started:6.1f} s] SIGKILL {role} (pid {pid})", flush=True)
                next_kill = now + kill_every_s
            if now - started > seconds + 600:
                raise RuntimeError("workloads did not finish within 10 minutes of the soak's end")
            time.sleep(0.5)
        elapsed = time.monotonic() - started
        time.sleep(3)  # the last kill's restart shows in the next look
        observe_restarts()
        lost = []
        for load in loads:
            present = set(cluster.checkpoints.versions(load.tenant_id))
            for version, digest in load.acknowledged.items():
                if version not in present:
                    lost.append((load.tenant_id, version, "missing"))
                elif cluster.checkpoints.read_manifest(load.tenant_id, version).digest != digest:
                    lost.append((load.tenant_id, version, "digest changed"))
        return SoakResult(elapsed, loads, faults, restarts, errors[0], lost)
    finally:
        cluster.close()
        from joynexus.ops.supervisor import remove_service_actors

        remove_service_actors(settings.ray_namespace)


def print_result(result: SoakResult) -> None:
    jobs = sum(t.jobs for t in result.tenants)
    workloads = sum(t.completed_workloads for t in result.tenants)
    print(f"\nload held: {len(result.tenants)} tenants, {workloads} workloads and {jobs} jobs completed "
          f"in {result.seconds:.0f} s ({60 * jobs / result.seconds:.1f} jobs/min)")  # fmt: skip
    print(f"faults injected: {len(result.faults)} ({', '.join(role for _, role, _ in result.faults)})")
    print("restarts seen: " + ", ".join(f"{role} {n}" for role, n in sorted(result.restarts.items()) if n))
    print(f"control-plane calls retried while the Master restarted: {result.control_errors}")
    print(f"{'tenant':10} {'task':4} {'jobs':>5} {'median s/job':>12} {'max stall s':>11} {'stall/job':>9}")
    for t in result.tenants:
        median = statistics.median(t.job_gaps) if t.job_gaps else float("nan")
        print(f"{t.tenant_id:10} {t.task:4} {t.jobs:5d} {median:12.1f} {t.max_stall_s:11.1f} "
              f"{t.max_stall_s / median if median == median and median else float('nan'):9.1f}")  # fmt: skip
        for failure in t.failed:
            print(f"    failed: {failure}")
    acknowledged = sum(len(t.acknowledged) for t in result.tenants)
    print(f"acknowledged versions: {acknowledged}; lost or changed: {len(result.lost)} {result.lost or ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kill-every-s", type=float, default=45.0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 tenants, 1 minute, a kill every 20 s")
    args = parser.parse_args()
    if args.quick:
        args.tenants, args.minutes, args.kill_every_s = 3, 1.0, 20.0
    with tempfile.TemporaryDirectory(prefix="joynexus-soak-") as tmp:
        seconds = args.minutes * 60
        result = run(tenants=args.tenants, seconds=seconds, kill_every_s=args.kill_every_s, data_dir=Path(tmp))
    print_result(result)
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
