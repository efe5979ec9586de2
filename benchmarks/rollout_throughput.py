"""Rollout throughput per simulator, with and without group-batched inference, side by side.

  .venv/bin/python benchmarks/rollout_throughput.py [--quick]

For each simulator task, RL tenants run rollouts through the real path (Environment Service
sessions in worker processes <-> Inference Queue <-> Inference Model Service) with the Inference
Scheduler grouping requests (B=32, T=5 ms) and serving one request at a time (B=1). Reported:
environment steps per second and the mean physical inference batch. One and two concurrent
tenants, so the grouped run batches across tenants too. 1 torch thread.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from joynexus.master.deployment import Deployment  # noqa: E402
from joynexus.models.backbone import BackboneSource
from joynexus.services.inference.service import InferenceModelService  # noqa: E402
from joynexus.services.producers.rollout import RolloutProducer  # noqa: E402
from joynexus.settings import Settings

TASKS = {
    "pusht PushT-reach-v0 (camera 32x32)": {
        "observation": {"cameras": ["top"], "image_size": [32, 32], "state_dim": 4, "action_dim": 2},
        "environment": {"simulator": "pusht", "task": "PushT-reach-v0"},
    },
    "maniskill PushCube-v1 (camera 32x32)": {
        "observation": {"cameras": ["base_camera"], "image_size": [32, 32], "state_dim": 25, "action_dim": 4},
        "environment": {"simulator": "maniskill", "task": "PushCube-v1", "control_mode": "pd_ee_delta_pos"},
    },
}


def spec(name: str, task: dict, num_envs: int, horizon: int) -> dict:
    return {
        "tenant": name,
        "base_model": "joynexus/tiny-smolvlm",
        "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": task["observation"],
        "environment": {**task["environment"], "num_envs": num_envs, "horizon": horizon},
        "scheduling": {"max_in_flight_jobs": 64},
        "training": {"samples_per_job": num_envs * horizon, "microbatch_size": num_envs * horizon},
    }


def measure(dep: Deployment, tenants: list[str], rollouts: int) -> tuple[float, float]:
    """Env steps/s over `rollouts` rollouts per tenant, all tenants at once; mean inference batch."""
    producers = []
    for name in tenants:
        tenant = dep.creator.get(name)
        dep.training_service.add_tenant(tenant.backend_config)
        dep.inference_service.load_weights(dep.training_service.export_params(name))
        producers.append(
            RolloutProducer(
                tenant.backend_config, dep.scheduler, dep.queue, dep.environment_service, dep.inference_service
            )
        )
    for p in producers:  # sessions open and warm before timing
        p._rollout(0)
    before = dep.inference_service.stats()
    started = time.perf_counter()
    threads = [threading.Thread(target=lambda p=p: [p._rollout(0) for _ in range(rollouts)]) for p in producers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    after = dep.inference_service.stats()
    steps = sum(p.num_envs * p.horizon for p in producers) * rollouts
    batches = after["batches"] - before["batches"]
    mean_batch = (after["samples"] - before["samples"]) / max(1, batches)
    for p in producers:
        p.close()
    return steps / elapsed, mean_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 sessions per tenant, short horizons")
    args = parser.parse_args()
    torch.set_num_threads(1)
    num_envs = 2 if args.quick else 4
    print(f"env steps/s through the service, {num_envs} sessions per tenant, action chunk 1")
    for label, task in TASKS.items():
        horizon = (4 if args.quick else 8) if "maniskill" in label else (8 if args.quick else 32)
        rollouts = 1 if args.quick or "maniskill" in label else 3
        with tempfile.TemporaryDirectory() as tmp:
            dep = Deployment.in_process(Settings(data_dir=Path(tmp), torch_threads=1))
            try:
                for name in ("a", "b"):
                    dep.creator.create(spec(f"{name}-tenant", task, num_envs, horizon))
                results = {}
                for mode, b in (("grouped (B=32, T=5 ms)", 32), ("one at a time (B=1)", 1)):
                    dep.inference_service.close()
                    dep.inference_service = InferenceModelService(
                        BackboneSource(preset="tiny"), max_batch_size=b, max_wait_ms=5.0, num_threads=1
                    )
                    for n in (1, 2):
                        tenants = ["a-tenant", "b-tenant"][:n]
                        results[(mode, n)] = measure(dep, tenants, rollouts)
                print(f"\n{label}")
                for n in (1, 2):
                    g, s = results[("grouped (B=32, T=5 ms)", n)], results[("one at a time (B=1)", n)]
                    print(
                        f"  {n} tenant(s): grouped {g[0]:7.1f} steps/s (mean batch {g[1]:4.1f})   "
                        f"one at a time {s[0]:7.1f} steps/s   -> {g[0] / s[0]:.2f}x"
                    )
            finally:
                dep.shutdown()


if __name__ == "__main__":
    main()
