"""Environment throughput: N environments as N sessions (one worker process each) vs ONE vectorized
session (N environments in one worker, `joynexus.envs.vector`), side by side in one run.

  .venv/bin/python benchmarks/env_vectorized.py [--envs 8] [--steps 200] [--rollouts 2]

1. Environment Service alone: `batch_step` over the N environments with random actions, steps/s.
2. Rollouts through the service (RolloutProducer: Inference Queue <-> Inference Model Service <->
   Environment Service) of an RL tenant with environment.envs_per_worker = 1 vs N, env steps/s.

Tasks: gym-pusht PushT-v0 state-only, and ManiSkill PushCube-v1 state-only when its assets are
installed. On CPU the vectorized session steps its environments in turn inside one process
(ManiSkill's physx_cpu allows one environment per scene): what it saves is N-1 processes and their
pipe round trips, which is what the ratio measures on this machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from joynexus.actors import handle_of  # noqa: E402
from joynexus.master.deployment import Deployment  # noqa: E402
from joynexus.services.environment.sessions import EnvironmentService  # noqa: E402
from joynexus.services.producers.rollout import RolloutProducer  # noqa: E402
from joynexus.settings import Settings  # noqa: E402

TASKS = {
    "pusht PushT-v0 (state)": {
        "sim": {"simulator": "pusht", "task": "PushT-v0"},
    },
    "maniskill PushCube-v1 (state)": {
        "sim": {"simulator": "maniskill", "task": "PushCube-v1", "control_mode": "pd_ee_delta_pos"},
    },
}


def service_steps_per_s(
    service: EnvironmentService, sim: dict, envs: int, per_worker: int, steps: int
) -> tuple[float, dict]:
    """Env steps/s of `batch_step` over `envs` environments, `per_worker` per session; the spec."""
    ids: list[str] = []
    for first in range(0, envs, per_worker):
        count = min(per_worker, envs - first)
        sid = service.open_session("bench", "bench", {**sim, "seed": first, "num_envs": count})
        ids += [sid] if count == 1 else [f"{sid}#{slot}" for slot in range(count)]
    try:
        for sid in ids:
            service.reset("bench", sid)
        spec = service.spec("bench", ids[0])
        dim = int(spec["action_dim"])
        rng = np.random.default_rng(0)
        started = time.perf_counter()
        for _ in range(steps):
            results = service.batch_step("bench", {sid: rng.uniform(-1, 1, dim).astype(np.float32) for sid in ids})
            for sid, result in results.items():
                if "error" in result:
                    raise RuntimeError(result["error"])
                if result["terminated"] or result["truncated"]:
                    service.reset("bench", sid)
        return envs * steps / (time.perf_counter() - started), spec
    finally:
        for sid in {sid.partition("#")[0] for sid in ids}:
            service.close("bench", sid)


def rollout_steps_per_s(
    dep: Deployment, name: str, task: dict, sim_spec: dict, envs: int, per_worker: int, rollouts: int
) -> float:
    spec = {
        "tenant": name, "base_model": "joynexus/tiny-smolvlm", "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {"cameras": [], "state_dim": sim_spec["state_dim"], "action_dim": sim_spec["action_dim"]},
        "environment": {**task["sim"], "num_envs": envs, "horizon": 16, "envs_per_worker": per_worker},
        "scheduling": {"max_in_flight_jobs": 64},
        "training": {"samples_per_job": envs * 16, "microbatch_size": envs * 16},
    }  # fmt: skip
    tenant = dep.creator.create(spec)
    dep.training_service.add_tenant(tenant.backend_config)
    dep.inference_service.load_weights(dep.training_service.export_params(name))
    producer = RolloutProducer(
        tenant.backend_config, dep.scheduler, dep.queue, dep.environment_service, dep.inference_service
    )
    try:
        producer.produce_once()  # opens the sessions (not timed)
        started = time.perf_counter()
        for _ in range(rollouts):
            producer.produce_once()
        return rollouts * envs * 16 / (time.perf_counter() - started)
    finally:
        producer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--tasks", nargs="*", default=list(TASKS))
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 environments, 5 steps, 1 rollout")
    args = parser.parse_args()
    if args.quick:
        args.envs, args.steps, args.rollouts = 2, 5, 1
    torch.set_num_threads(1)
    n = args.envs
    print(f"{n} environments; {args.steps} service steps each; {args.rollouts} rollouts of horizon 16")
    with tempfile.TemporaryDirectory() as tmp:
        dep = Deployment.in_process(Settings(data_dir=Path(tmp), torch_threads=1))
        # A simulator's start on a shared, loaded machine can take minutes: allow it (not timed).
        handle_of(dep.environment_service).target.reset_timeout_s = 900
        handle_of(dep.environment_service).target.startup_timeout_s = 900
        try:
            for label in args.tasks:
                task = TASKS[label]
                service = EnvironmentService(
                    max_sessions=64, max_sessions_per_tenant=64, reset_timeout_s=900, startup_timeout_s=900
                )
                try:
                    one, sim_spec = service_steps_per_s(service, task["sim"], n, 1, args.steps)
                    vec, _ = service_steps_per_s(service, task["sim"], n, n, args.steps)
                finally:
                    service.close_all()
                print(f"{label}  Environment Service batch_step: {n} sessions x 1 env {one:8.1f} steps/s | "
                      f"1 session x {n} envs {vec:8.1f} steps/s | ratio {vec / one:.2f}x")  # fmt: skip
                key = label.split()[0]
                r_one = rollout_steps_per_s(dep, f"{key}-one", task, sim_spec, n, 1, args.rollouts)
                r_vec = rollout_steps_per_s(dep, f"{key}-vec", task, sim_spec, n, n, args.rollouts)
                print(f"{label}  rollout through the services:   1 env/worker  {r_one:8.1f} steps/s | "
                      f"{n} envs/worker {r_vec:8.1f} steps/s | ratio {r_vec / r_one:.2f}x")  # fmt: skip
        finally:
            dep.shutdown()


if __name__ == "__main__":
    main()
