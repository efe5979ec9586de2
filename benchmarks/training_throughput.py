"""Training jobs/s, grouped vs one at a time, through the actor loop's real path (issue 25.1).

  PYTHONPATH=. .venv/bin/python benchmarks/training_throughput.py [--tenants 2,4,8] [--jobs 4]
                                   [--group-max 8] [--mode ray|inprocess] [--out var/benchmarks]
                                   [--preset smolvlm-256m --image-size 256] [--repeats 3] [--threads 2]

What runs: one deployment of the training path — `--mode ray` (default, the real deployment): the
Training Queue and the Training Model Service as named Ray actors, each its own process
(`services.configs`, as `create_service_actors` makes them); `inprocess`: local objects — with the
control-plane store, Training Scheduler and tenant creator in this driver, and the Master's
`ActorLoop` driven here (the loop the Master runs, against the same service handles). For each
tenant count N of `--tenants` and each setting — one job at a time (group_max 1, the old loop) and
grouped (`--group-max`) — N fresh SFT tenants (the `--preset` backbone, default tiny; one observation shape and module,
their own seeds) each get `--jobs` jobs produced by the SFT producer into the Training Queue (32
samples per job, microbatch 8) and marked ready BEFORE the clock starts: the figure is the actor
path's throughput with work waiting (leases, `train_job` / `train_jobs` over Ray, completions), not
the producers' pace (the Master's producers read datasets on this same machine).

Figures, per N and setting: wall = seconds of `ActorLoop.step_all` calls until all N x jobs jobs
are terminal; jobs/s = completed jobs / wall; the mean group size of the completed jobs (their
results' `group_size`; 1 for jobs trained alone); ratio grouped / one-at-a-time, side by side in one
run. `--repeats R` runs R pairs per N, alternating which setting goes first, and pools them (all
jobs / all wall). Every job must complete (checked).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SAMPLES_PER_JOB = 32
MICROBATCH = 8


def tenant_spec(tenant_id: str, dataset_root: Path, base_model: str, jobs: int, seed: int) -> dict[str, Any]:
    return {
        "tenant": tenant_id,
        "base_model": base_model,
        "task": "sft",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {"cameras": ["top"], "image_size": [32, 32], "state_dim": 4, "action_dim": 2,
                        "action_chunk": 1, "instruction": "move the arm to the target"},  # fmt: skip
        "dataset": {"root": str(dataset_root), "repo_id": "bench/throughput-demos"},
        "scheduling": {"priority": 0, "max_in_flight_jobs": jobs, "completion_target": jobs},
        "training": {"samples_per_job": SAMPLES_PER_JOB, "microbatch_size": MICROBATCH, "learning_rate": 1e-3,
                     "seed": seed},  # fmt: skip
    }


def write_dataset(root: Path) -> Path:
    from joynexus.data.lerobot_dataset import write_synthetic_dataset

    if not (root / "meta" / "info.json").exists():
        write_synthetic_dataset(root, "bench/throughput-demos", cameras=("top",), image_size=(32, 32), state_dim=4,
                                action_dim=2, num_episodes=4, episode_length=40, task="move the arm to the target",
                                seed=7)  # fmt: skip
    return root


@dataclass
class TrainingPath:
    queue: Any  # TrainingQueue or its Ray handle (behind service_handle)
    service: Any  # TrainingModelService or its Ray handle (behind service_handle)
    scheduler: Any
    creator: Any


@contextlib.contextmanager
def open_training_path(
    mode: str, data_dir: Path, preset: str = "tiny", image_size: int | None = None, threads: int = 1
) -> Iterator[TrainingPath]:
    from joynexus.actors import init_ray, service_handle
    from joynexus.core.store import ControlPlaneStore
    from joynexus.core.tenants import BackendCapabilities
    from joynexus.master.tenant_creator import TenantCreator
    from joynexus.models.backbone import BackboneSource
    from joynexus.scheduling.training_queue import TrainingQueue
    from joynexus.scheduling.training_scheduler import TrainingScheduler
    from joynexus.services.training.service import TrainingModelService
    from joynexus.settings import Settings

    settings = Settings(
        data_dir=data_dir, torch_threads=threads, ray_namespace=f"throughput-{uuid.uuid4().hex[:8]}",
        backbone_preset=preset, backbone_image_size=image_size,
    )  # fmt: skip
    data_dir.mkdir(parents=True, exist_ok=True)
    actors: list[Any] = []
    if mode == "ray":
        import ray

        from joynexus.services.configs import TrainingQueueConfig, TrainingServiceConfig

        config = TrainingServiceConfig.from_settings(settings)
        config.export_endpoint()
        init_ray(settings.ray_address)
        where = {"namespace": settings.ray_namespace, "detached": False}
        queue_actor = TrainingQueueConfig().actor(**where)
        service_actor = config.actor(queue_actor, **where)
        actors = [service_actor, queue_actor]
        queue = service_handle(TrainingQueue, queue_actor)
        service = service_handle(TrainingModelService, service_actor)
    elif mode == "inprocess":
        queue = TrainingQueue()
        source = BackboneSource(preset=preset, image_size=image_size)
        service = TrainingModelService(source, data_dir / "ckpt", queue=queue, num_threads=threads)
    else:
        raise ValueError(f"--mode: expected ray or inprocess, got {mode!r}")
    store = ControlPlaneStore(settings.resolved_database_url())
    scheduler = TrainingScheduler(store, release_partition=queue.clear)
    creator = TenantCreator(store, scheduler, BackendCapabilities.single(service.capabilities()))
    try:
        yield TrainingPath(queue, service, scheduler, creator)
    finally:
        store.dispose()
        for actor in actors:
            ray.kill(actor)


@dataclass
class Measure:
    group_max: int
    tenants: int
    jobs: int
    wall_s: float
    mean_group_size: float

    @property
    def jobs_per_s(self) -> float:
        return self.jobs / self.wall_s


def run_tier(
    path: TrainingPath, dataset: Path, n: int, jobs: int, group_max: int, timeout_s: float, tag: str = ""
) -> Measure:
    """N fresh tenants with `jobs` ready jobs each; the actor loop's wall to finish them all."""
    from joynexus.master.loops.actor_loop import ActorLoop
    from joynexus.services.producers.sft import SFTProducer

    model_id = path.service.backbone_info()["model_id"]
    all_jobs = []
    for i in range(n):
        spec = tenant_spec(f"tp{n}-g{group_max}{tag}-{i}", dataset, model_id, jobs, seed=i)
        tenant = path.creator.create(spec)
        path.service.add_tenant(tenant.backend_config)
        producer = SFTProducer.from_dataset(tenant.backend_config, path.scheduler, path.queue, dataset,
                                            "bench/throughput-demos")  # fmt: skip
        all_jobs += [producer.produce_once() for _ in range(jobs)]
    if any(job is None for job in all_jobs):
        raise RuntimeError(f"tenants={n}: a job was not admitted")
    loop = ActorLoop(path.scheduler, path.service, owner=f"bench-g{group_max}", group_max=group_max)
    outcomes = []
    started = time.perf_counter()
    while len(outcomes) < len(all_jobs):
        outcomes += loop.step_all(wait_s=0.05)
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"tenants={n}, group_max={group_max}: {len(outcomes)} of {len(all_jobs)} jobs done")
    wall = time.perf_counter() - started
    bad = [o for o in outcomes if o.state != "completed"]
    if bad:
        raise RuntimeError(f"tenants={n}, group_max={group_max}: {bad[0].job.job_id} {bad[0].state}: {bad[0].reason}")
    sizes = [int(o.metrics.get("group_size", 1)) for o in outcomes]
    return Measure(group_max, n, len(outcomes), wall, sum(sizes) / len(sizes))


def _pooled(runs: list[Measure]) -> Measure:
    jobs = sum(m.jobs for m in runs)
    size = sum(m.mean_group_size * m.jobs for m in runs) / jobs
    return Measure(runs[0].group_max, runs[0].tenants, jobs, sum(m.wall_s for m in runs), size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", default="2,4,8")
    parser.add_argument("--jobs", type=int, default=4, help="jobs per tenant")
    parser.add_argument("--group-max", type=int, default=8)
    parser.add_argument("--mode", default="ray", choices=("ray", "inprocess"))
    parser.add_argument("--out", type=Path, default=Path("var/benchmarks"))
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--repeats", type=int, default=1, help="pairs per N, alternating which setting goes first")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 tenants, 2 jobs each")
    parser.add_argument("--preset", default="tiny", help="backbone preset (tiny | smolvlm-256m | ...; issue 42.4)")
    parser.add_argument("--image-size", type=int, default=None, help="canonical camera side (default: the preset's)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the Training Model Service")
    args = parser.parse_args()
    if args.quick:
        args.tenants, args.jobs = "2", 2
    counts = [int(x) for x in args.tenants.split(",")]
    run_dir = (args.out / f"training-throughput-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    dataset = write_dataset(run_dir / "dataset")
    results: list[Measure] = []
    with open_training_path(args.mode, run_dir / "deployment", args.preset, args.image_size, args.threads) as path:
        for n in counts:
            for r in range(args.repeats):
                order = (1, args.group_max) if r % 2 == 0 else (args.group_max, 1)
                for group_max in order:
                    m = run_tier(path, dataset, n, args.jobs, group_max, args.timeout, tag=f"r{r}")
                    results.append(m)
                    print(f"group_max={group_max} tenants={n}: {m.jobs} jobs in {m.wall_s:.2f} s = "
                          f"{m.jobs_per_s:.3f} jobs/s, mean group size {m.mean_group_size:.2f}",
                          flush=True)  # fmt: skip
    print(f"\ntraining throughput ({args.mode}, {args.preset} backbone"
          f"{f' at {args.image_size} px' if args.image_size else ''}, {args.threads} torch thread(s), "
          f"{SAMPLES_PER_JOB} samples/job, "
          f"microbatch {MICROBATCH}, {args.jobs} jobs/tenant, load average {os.getloadavg()[0]:.1f})")  # fmt: skip
    print(f"{'tenants':>8} {'1-at-a-time jobs/s':>19} {'grouped jobs/s':>15} {'ratio':>7} {'mean group':>11}")
    for n in counts:  # pooled over repeats: all jobs / all wall
        one = _pooled([m for m in results if m.tenants == n and m.group_max == 1])
        grouped = _pooled([m for m in results if m.tenants == n and m.group_max == args.group_max])
        print(f"{n:>8} {one.jobs_per_s:>19.3f} {grouped.jobs_per_s:>15.3f} "
              f"{grouped.jobs_per_s / one.jobs_per_s:>6.2f}x {grouped.mean_group_size:>11.2f}")  # fmt: skip
    # The one-at-a-time rate is the same work at every tier: its spread says whether the windows
    # were long enough for the ratios to be read across tiers (issue 42.4: within 10%).
    alone = [_pooled([m for m in results if m.tenants == n and m.group_max == 1]).jobs_per_s for n in counts]
    spread = max(alone) / min(alone) - 1
    print(f"one-at-a-time jobs/s across tiers: {min(alone):.3f}-{max(alone):.3f} (spread {100 * spread:.0f}%: "
          f"{'within' if spread <= 0.10 else 'NOT within'} 10%)")  # fmt: skip
    (run_dir / "results.json").write_text(
        json.dumps([{**asdict(m), "jobs_per_s": m.jobs_per_s} for m in results], indent=2)
    )
    print(f"results: {run_dir / 'results.json'}")


if __name__ == "__main__":
    main()
