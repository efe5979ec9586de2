"""A capacity model you can check (issue 45.5): jobs/s and requests/s vs GPUs and tenants.

  PYTHONPATH=. .venv/bin/python benchmarks/capacity.py [--mode inprocess|ray] [--costs costs.json]
                                   [--tenants 10,100,300,1000] [--quick]

1. Measure, here, the per-operation costs the model is driven by (tiny backbone unless --costs
   names a JSON file of costs measured elsewhere, e.g. on a GPU run; keys as printed):
   - backbone forward by batch: `encode` of n samples, n in 1..32, fitted as f0 + f1 * n;
   - module step: a grouped step (`train_group`) of 1 and of 8 same-architecture tenants minus its
     forward, fitted as group + step * g (the losses of one architecture batch into one computation);
   - module forward (serving): one tenant's `sample` of a batch minus its forward;
   - store cycle: reserve -> ready -> lease -> complete of one job in the control-plane store;
   - Master per job: the actor loop's own seconds per job (leases, staleness check, completion,
     bookkeeping), its wall minus the service's training seconds, one job at a time;
   - front call: one call through a router object to a replica (a Ray actor round trip in `ray` mode);
   - environment step: one PushT step (state observations).
2. Model, for the paper's 2-2-4 layout scaled (training : inference : environment GPUs = 1 : 1 : 2;
   below 8 GPUs the roles share devices) and each tenant count, every component's capacity:
   - a training shard: g = min(group_max, tenants on it) tenants per grouped step, R rounds per
     job: g / (R * (f0 + f1 * g * mb + group + g * step)) jobs/s; M shards: M times that;
   - the store: one serialized writer (SQLite): 1 / store_cycle jobs/s;
   - the Master: its per-job seconds run in one process (the GIL): 1 / master_job jobs/s;
   - an inference replica: B requests per batch over its tenants: B / (f0 + f1 * B + m * module_fwd)
     requests/s, m = distinct tenants in a batch; I replicas: I times that;
   - the front: 1 / front_call requests/s (one actor every request passes through);
   - the environment: workers_per_gpu simulators per environment GPU: E * w / env_step requests/s.
   jobs/s = min(shards, store, Master); requests/s = min(replicas, front, environment); the
   smallest names the first component to saturate. Linear = M x one shard's jobs/s at the same
   tenants per shard; the model's efficiency is jobs/s / linear.
3. Validate: measure 1- and 2-shard jobs/s here (`TrainingShards` + one loop per shard, real
   jobs), and print the model's prediction for the same runs beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SAMPLES_PER_JOB = 32
MICROBATCH = 8
GROUP_MAX = 8


@dataclass
class Costs:
    forward_f0_s: float  # backbone forward of n samples: f0 + f1 * n
    forward_f1_s: float
    module_step_s: float  # a grouped step's updates (after its forward): module_group_s + module_step_s * g
    module_group_s: float  # ... the part a grouped step pays once, whatever its g tenants
    module_forward_s: float  # one tenant's serving forward on a batch (after the forward)
    store_cycle_s: float  # reserve -> ready -> lease -> complete of one job
    master_job_s: float  # the actor loop's own seconds per job
    front_call_s: float  # one request through the routing front
    env_step_s: float  # one simulator step
    source: str = "measured here"

    def forward(self, n: int) -> float:
        return self.forward_f0_s + self.forward_f1_s * n


def _median_time(fn: Any, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# -- 1. measuring ----------------------------------------------------------------------------
def measure_costs(work: Path, repeats: int, mode: str) -> Costs:
    import torch

    from joynexus.core.store import ControlPlaneStore
    from joynexus.scheduling.training_scheduler import READY, TrainingScheduler

    torch.set_num_threads(1)
    with _training_world(work / "costs", shards=1, tenants=GROUP_MAX, jobs=2 * repeats) as world:
        service, config = world.shards.shard(0), world.producers[0].config
        tenant_id = config.tenant_id
        configs = [p.config for p in world.producers]
        forward = {}
        for n in (1, 32):
            images = [[torch.rand(3, 32, 32)] for _ in range(n)]
            forward[n] = _median_time(lambda images=images, n=n: service.encode(images, ["move"] * n), repeats)
        f1 = (forward[32] - forward[1]) / 31
        f0 = max(0.0, forward[1] - f1)
        batch = _microbatch(config, MICROBATCH)
        # A grouped step of g same-architecture tenants (one forward, their losses batched into one
        # computation, each its own AdamW): its module part for g = 1 and GROUP_MAX, fitted linearly.
        module = {}
        for g in (1, GROUP_MAX):
            group = [(c.tenant_id, _microbatch(c, MICROBATCH)) for c in configs[:g]]
            took = _median_time(lambda group=group: service.train_group(group), repeats)
            module[g] = max(1e-6, took - (f0 + f1 * g * MICROBATCH))
        step = (module[GROUP_MAX] - module[1]) / (GROUP_MAX - 1)
        group_s = max(0.0, module[1] - step)
        # Serving: the tenant module's own forward (`predict`) on a batch's features, what the
        # Inference Model Service runs per tenant after the batch's one backbone forward.
        local = service.target  # the in-process TrainingModelService (behind its lock)
        features = local.encode(*_microbatch_inputs(batch))
        state = torch.as_tensor(batch["state"])
        head = local.slot_table.slot(tenant_id).module
        serve = _median_time(lambda: head.predict(features, state), 10 * repeats)
        # The actor loop's own seconds per job: real jobs, one at a time, wall minus training seconds.
        outcomes, wall = world.run(group_max=1)
        master_job = max(1e-6, (wall - sum(o.metrics["seconds"] for o in outcomes)) / len(outcomes))

    store = ControlPlaneStore(f"sqlite:///{work / 'costs.db'}")
    scheduler = TrainingScheduler(store)
    scheduler.register_policy("cost-a", "sft", max_in_flight=1 << 20)
    cycles = 20 * repeats

    def cycle() -> None:
        job = scheduler.reserve(tenant_id="cost-a", task_type="sft", sample_count=1)
        scheduler.mark(job.job_id, READY)
        leased = scheduler.lease_next(owner="cost")
        scheduler.complete(leased.job_id, {}, owner="cost")

    cycle()
    started = time.perf_counter()
    for _ in range(cycles):
        cycle()
    store_cycle = (time.perf_counter() - started) / cycles
    store.dispose()
    front = _measure_front_call(mode, repeats)
    env_step = _measure_env_step(repeats)
    return Costs(f0, f1, max(step, 1e-6), group_s, max(serve, 1e-6), store_cycle, master_job, front, env_step)


def _microbatch_inputs(batch: dict[str, Any]) -> tuple[list[list[Any]], list[str]]:
    import torch

    return [list(torch.as_tensor(sample).unbind(0)) for sample in batch["images"]], list(batch["task"])


def _microbatch(config: Any, rows: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return {
        "images": rng.random((rows, 1, 3, 32, 32), dtype=np.float32),
        "state": rng.standard_normal((rows, 4)).astype(np.float32),
        "action": rng.uniform(-1, 1, (rows, 1, 2)).astype(np.float32),
        "action_is_pad": np.zeros((rows, 1), dtype=bool),
        "task": ["move"] * rows,
        "tenant_id": [config.tenant_id] * rows,
        "schema_signature": [config.schema_signature] * rows,
    }


def _measure_front_call(mode: str, repeats: int) -> float:
    """One call through a front to a replica: a Ray actor round trip (`ray`), or a local router's
    method call (`inprocess`, what the in-process replica set costs)."""
    if mode == "ray":
        import ray

        from joynexus.actors import init_ray

        init_ray()

        @ray.remote(num_cpus=0)
        class Echo:
            def call(self, x: int) -> int:
                return x

        echo = Echo.remote()
        ray.get(echo.call.remote(0))
        return _median_time(lambda: ray.get(echo.call.remote(1)), 50 * repeats)
    lock = threading.Lock()

    def routed() -> int:
        with lock:  # the front's one routing decision per request
            return 1

    return _median_time(routed, 1000 * repeats)


def _measure_env_step(repeats: int) -> float:
    import numpy as np

    from joynexus.envs.base import build_simulator

    sim = build_simulator({"simulator": "pusht", "task": "PushT-v0", "seed": 0})
    sim.reset()
    action = np.zeros(sim.spec.action_dim, dtype=np.float32)

    def step() -> None:
        if sim.step(action).truncated:
            sim.reset()

    try:
        return _median_time(step, 50 * repeats)
    finally:
        sim.close()


# -- the real runs: 1 and 2 shards -------------------------------------------------------------
class _World:
    def __init__(self, scheduler: Any, shards: Any, producers: list[Any], jobs: int) -> None:
        self.scheduler, self.shards, self.producers, self.jobs = scheduler, shards, producers, jobs

    def run(self, group_max: int) -> tuple[list[Any], float]:
        """Produce every job (ready before the clock starts), then one loop per shard until all end."""
        from joynexus.master.loops.shard_loops import ShardLoops

        for producer in self.producers:
            for _ in range(self.jobs):
                if producer.produce_once() is None:
                    raise RuntimeError("a job was not admitted")
        total = len(self.producers) * self.jobs
        outcomes: list[Any] = []
        loops = ShardLoops(self.scheduler, self.shards, group_max=group_max, on_outcome=outcomes.append)
        started = time.perf_counter()
        loops.start(wait_s=0.02)
        try:
            while len(outcomes) < total:
                if time.perf_counter() - started > 1800:
                    raise TimeoutError(f"{len(outcomes)} of {total} jobs done")
                time.sleep(0.005)
            wall = time.perf_counter() - started
        finally:
            loops.stop()
        bad = [o for o in outcomes if o.state != "completed"]
        if bad:
            raise RuntimeError(f"job {bad[0].job.job_id}: {bad[0].state}: {bad[0].reason}")
        return outcomes, wall


class _training_world:  # noqa: N801 - a context manager used like a function
    """`shards` Training Model Services (in process, or Ray actors with mode "ray"), `tenants` SFT
    tenants with `jobs` jobs each, a scheduler over a fresh store."""

    def __init__(self, work: Path, *, shards: int, tenants: int, jobs: int, mode: str = "inprocess") -> None:
        self.work, self.n_shards, self.tenants, self.jobs, self.mode = work, shards, tenants, jobs, mode
        self._close: list[Any] = []

    def __enter__(self) -> _World:
        from joynexus.actors import SerializedService, service_handle
        from joynexus.core.store import ControlPlaneStore
        from joynexus.core.tenants import BackendCapabilities
        from joynexus.master.tenant_creator import TenantCreator
        from joynexus.models.backbone import BackboneSource
        from joynexus.scheduling.training_queue import TrainingQueue
        from joynexus.scheduling.training_scheduler import TrainingScheduler
        from joynexus.services.producers.sft import SFTProducer
        from joynexus.services.training.service import TrainingModelService
        from joynexus.services.training.shards import TrainingShards

        self.work.mkdir(parents=True, exist_ok=True)
        dataset = _write_dataset(self.work.parent / "dataset")
        if self.mode == "ray":
            import ray

            from joynexus.actors import init_ray
            from joynexus.services.configs import TrainingQueueConfig, TrainingServiceConfig
            from joynexus.settings import Settings

            init_ray()
            settings = Settings(data_dir=self.work, torch_threads=1, training_shards=self.n_shards,
                                ray_namespace=f"capacity-{uuid.uuid4().hex[:8]}")  # fmt: skip
            where = {"namespace": settings.ray_namespace, "detached": False}
            config = TrainingServiceConfig.from_settings(settings)
            queue_actor = TrainingQueueConfig().actor(**where)
            actors = config.shard_actors(queue_actor, **where)
            self._close += [
                lambda: [ray.kill(a) for a in (*actors, queue_actor)],
                lambda: config.remove_shard_group(settings.ray_namespace),
            ]
            queue = service_handle(TrainingQueue, queue_actor)
            shards = config.shard_set(actors)
        else:
            queue = TrainingQueue()
            services = [
                TrainingModelService(BackboneSource(preset="tiny"), self.work / "ckpt", queue=queue, num_threads=1)
                for _ in range(self.n_shards)
            ]
            shards = TrainingShards([SerializedService(s) for s in services], group_size=GROUP_MAX)
        store = ControlPlaneStore(f"sqlite:///{self.work / f'control-{uuid.uuid4().hex[:6]}.db'}")
        self._close.append(store.dispose)
        scheduler = TrainingScheduler(store, release_partition=queue.clear)
        creator = TenantCreator(store, scheduler, BackendCapabilities.single(shards.capabilities()))
        model_id = shards.backbone_info()["model_id"]
        producers = []
        for i in range(self.tenants):
            spec = _tenant_spec(f"cap-{uuid.uuid4().hex[:6]}-{i}", dataset, model_id, self.jobs, seed=i)
            tenant = creator.create(spec)
            shards.add_tenant(tenant.backend_config)
            producers.append(
                SFTProducer.from_dataset(tenant.backend_config, scheduler, queue, dataset, "bench/capacity")
            )
        return _World(scheduler, shards, producers, self.jobs)

    def __exit__(self, *exc: object) -> None:
        for close in reversed(self._close):
            close()


def _tenant_spec(tenant_id: str, dataset: Path, base_model: str, jobs: int, seed: int) -> dict[str, Any]:
    return {
        "tenant": tenant_id, "base_model": base_model, "task": "sft",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {"cameras": ["top"], "image_size": [32, 32], "state_dim": 4, "action_dim": 2,
                        "action_chunk": 1, "instruction": "move the arm to the target"},
        "dataset": {"root": str(dataset), "repo_id": "bench/capacity"},
        "scheduling": {"priority": 0, "max_in_flight_jobs": jobs, "completion_target": jobs},
        "training": {"samples_per_job": SAMPLES_PER_JOB, "microbatch_size": MICROBATCH, "learning_rate": 1e-3,
                     "seed": seed, "checkpoint_every_jobs": 0},
    }  # fmt: skip


def _write_dataset(root: Path) -> Path:
    from joynexus.data.lerobot_dataset import write_synthetic_dataset

    if not (root / "meta" / "info.json").exists():
        write_synthetic_dataset(root, "bench/capacity", cameras=("top",), image_size=(32, 32), state_dim=4,
                                action_dim=2, num_episodes=4, episode_length=40, task="move the arm to the target",
                                seed=7)  # fmt: skip
    return root


# -- 2. the model ----------------------------------------------------------------------------
@dataclass
class Layout:
    gpus: int
    training: int  # shards (one device each)
    inference: int  # replicas
    environment: int  # environment GPUs
    share: float  # fraction of its device each role gets (below 8 GPUs the roles share devices)


def layout_224(gpus: int) -> Layout:
    """The paper's 2-2-4 layout scaled: training : inference : environment = 1 : 1 : 2."""
    training, inference, environment = max(1, gpus // 4), max(1, gpus // 4), max(1, gpus // 2)
    return Layout(gpus, training, inference, environment, min(1.0, gpus / (training + inference + environment)))


def shard_jobs_per_s(costs: Costs, tenants_on_shard: float, group_max: int = GROUP_MAX) -> float:
    g = max(1, min(group_max, math.floor(tenants_on_shard)))
    rounds = SAMPLES_PER_JOB / MICROBATCH
    return g / (rounds * (costs.forward(g * MICROBATCH) + costs.module_group_s + g * costs.module_step_s))


def model(
    costs: Costs,
    layout: Layout,
    tenants: int,
    *,
    batch: int = 32,
    workers_per_gpu: int = 8,
    loop_processes: int = 1,
    store_writers: int = 1,
) -> dict[str, Any]:
    """`loop_processes`: processes the actor loops' per-job work runs in (1: the Master's, today);
    `store_writers`: store cycles that can run at once (1: SQLite's one writer)."""
    per_shard = tenants / layout.training
    shard = shard_jobs_per_s(costs, per_shard) * layout.share
    training = {
        "shards": layout.training * shard,
        "store": store_writers / costs.store_cycle_s,
        "master": loop_processes / costs.master_job_s,
    }
    tenants_per_replica = tenants / layout.inference
    distinct = min(batch, max(1, math.ceil(tenants_per_replica)))
    replica = batch / (costs.forward(batch) + distinct * costs.module_forward_s) * layout.share
    serving = {
        "replicas": layout.inference * replica,
        "front": 1 / costs.front_call_s,
        "environment": layout.environment * workers_per_gpu / costs.env_step_s,
    }
    jobs_bottleneck = min(training, key=training.get)
    requests_bottleneck = min(serving, key=serving.get)
    linear = layout.training * shard
    return {
        "gpus": layout.gpus, "layout": f"{layout.training}-{layout.inference}-{layout.environment}",
        "tenants": tenants, "jobs_per_s": training[jobs_bottleneck], "jobs_bottleneck": jobs_bottleneck,
        "efficiency": training[jobs_bottleneck] / linear, "requests_per_s": serving[requests_bottleneck],
        "requests_bottleneck": requests_bottleneck,
    }  # fmt: skip


def predict_shards(costs: Costs, shards: int, tenants: int, parallel_devices: float) -> float:
    """The model's jobs/s for the validation runs: the shards run side by side on at most
    `parallel_devices` (Ray: one process per shard on this host's cores; in process: one Python
    interpreter for them all), the same store and Master bounds."""
    parallel = min(shards, max(1.0, parallel_devices))
    shard = shard_jobs_per_s(costs, tenants / shards)
    return min(parallel * shard, 1 / costs.store_cycle_s, 1 / costs.master_job_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="inprocess", choices=("inprocess", "ray"))
    parser.add_argument("--costs", type=Path, help="JSON of costs measured elsewhere (skips measuring them here)")
    parser.add_argument("--tenants", default="10,100,300,1000")
    parser.add_argument("--gpus", default="1,2,4,8,16,32,64")
    parser.add_argument("--validate-tenants", type=int, default=8)
    parser.add_argument("--validate-jobs", type=int, default=4, help="jobs per tenant in the 1- and 2-shard runs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("var/benchmarks"))
    parser.add_argument("--quick", action="store_true", help="a smoke run: few repeats, small validation runs")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.validate_tenants, args.validate_jobs = 1, 4, 2
    load_before = os.getloadavg()[0]
    run_dir = (args.out / f"capacity-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="capacity-", dir=run_dir))
    if args.costs:
        costs = Costs(**{**json.loads(args.costs.read_text()), "source": str(args.costs)})
    else:
        costs = measure_costs(work, args.repeats, args.mode)
    print(f"== per-operation costs ({costs.source}, tiny backbone on {os.cpu_count()} CPU cores) ==")
    for name, value in asdict(costs).items():
        if name != "source":
            print(f"  {name:<18} {value * 1e3:10.3f} ms")

    measured = {}
    for shards in (1, 2):
        with _training_world(work / f"validate-{shards}", shards=shards, tenants=args.validate_tenants,
                             jobs=args.validate_jobs, mode=args.mode) as world:  # fmt: skip
            outcomes, wall = world.run(group_max=GROUP_MAX)
        measured[shards] = len(outcomes) / wall
    devices = float(os.cpu_count() or 1) if args.mode == "ray" else 1.0  # in process: one interpreter (GIL)
    print(f"\n== validation: measured here ({args.mode}, {args.validate_tenants} tenants x {args.validate_jobs} jobs, "
          f"load average before {load_before:.1f}, shards side by side on at most {devices:.0f}) ==")  # fmt: skip
    print(f"{'shards':>7} {'measured jobs/s':>16} {'model jobs/s':>13} {'model/measured':>15}")
    for shards, jobs_s in measured.items():
        predicted = predict_shards(costs, shards, args.validate_tenants, devices)
        print(f"{shards:>7} {jobs_s:>16.3f} {predicted:>13.3f} {predicted / jobs_s:>14.2f}x")
    print(f"measured 2 shards / 1 shard: {measured[2] / measured[1]:.2f}x")

    rows = []
    print("\n== model: the 2-2-4 layout scaled (training-inference-environment GPUs) ==")
    print(f"{'GPUs':>5} {'layout':>9} {'tenants':>8} {'jobs/s':>9} {'of linear':>10} {'jobs bound':>11} "
          f"{'requests/s':>11} {'requests bound':>15}")  # fmt: skip
    for gpus in [int(x) for x in args.gpus.split(",")]:
        for tenants in [int(x) for x in args.tenants.split(",")]:
            row = model(costs, layout_224(gpus), tenants)
            rows.append(row)
            print(f"{gpus:>5} {row['layout']:>9} {tenants:>8} {row['jobs_per_s']:>9.2f} {row['efficiency']:>9.0%} "
                  f"{row['jobs_bottleneck']:>11} {row['requests_per_s']:>11.1f} "
                  f"{row['requests_bottleneck']:>15}")  # fmt: skip
    first = next((r for r in rows if r["jobs_bottleneck"] != "shards" and not r.get("plan")), None)
    if first is None:
        print("first jobs/s bottleneck: none up to the largest size (the shards themselves)")
    else:
        print(f"first jobs/s bottleneck: the {first['jobs_bottleneck']} at {first['gpus']} GPUs, "
              f"{first['tenants']} tenants ({first['efficiency']:.0%} of linear)")  # fmt: skip
    # The plan for the first bound: each shard's actor loop in its own process beside its shard
    # (the Master keeps placement and bookkeeping), and a PostgreSQL store with concurrent writers.
    print("\n== the plan: a loop process per shard, a store with 8 concurrent writers ==")
    print(f"{'GPUs':>5} {'layout':>9} {'tenants':>8} {'jobs/s':>9} {'of linear':>10} {'jobs bound':>11}")
    for gpus in (16, 32, 64):
        for tenants in (300, 1000):
            layout = layout_224(gpus)
            row = model(costs, layout, tenants, loop_processes=layout.training, store_writers=8)
            rows.append({**row, "plan": True})
            print(f"{gpus:>5} {row['layout']:>9} {tenants:>8} {row['jobs_per_s']:>9.2f} {row['efficiency']:>9.0%} "
                  f"{row['jobs_bottleneck']:>11}")  # fmt: skip
    (run_dir / "results.json").write_text(
        json.dumps({"costs": asdict(costs), "measured": measured, "model": rows}, indent=2)
    )
    print(f"results: {run_dir / 'results.json'}")


if __name__ == "__main__":
    main()
