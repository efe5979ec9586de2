"""Normalized vs raw SFT on a dataset whose action dimensions are 1,000x apart in scale.

  .venv/bin/python benchmarks/normalization.py [--jobs 40] [--every 5] [--samples 32]

Two tenants on the same LeRobot dataset (tests/data/scaled_dataset.py: action 0 in ~[-1, 1],
action 1 in ~[-500, 1500]), one with LeRobot's default normalization (STATE / ACTION MEAN_STD from
the dataset's meta/stats.json), one raw (IDENTITY), each trained through the real path (SFT
producer -> Training Queue -> actor loop -> Training Model Service, tiny backbone) and evaluated by
an Inference Model Service over every frame of the dataset, in the dataset's units.

Printed side by side, every `--every` jobs: each tenant's training loss (in its own units: the
normalized tenant's loss is of normalized targets, the raw one's of raw units) and its per-dimension
relative error (RMSE / the dimension's std, in dataset units); then the final per-dimension errors
and the ratio raw / normalized.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from joynexus.actors import service_handle  # noqa: E402
from joynexus.core.store import ControlPlaneStore  # noqa: E402
from joynexus.core.tenants import BackendCapabilities  # noqa: E402
from joynexus.master.loops.actor_loop import ActorLoop  # noqa: E402
from joynexus.master.tenant_creator import TenantCreator  # noqa: E402
from joynexus.models.backbone import BackboneSource  # noqa: E402
from joynexus.scheduling.inference_queue import Observation  # noqa: E402
from joynexus.scheduling.training_queue import TrainingQueue  # noqa: E402
from joynexus.scheduling.training_scheduler import COMPLETED, TrainingScheduler  # noqa: E402
from joynexus.services.inference.service import InferenceModelService  # noqa: E402
from joynexus.services.producers.sft import SFTProducer  # noqa: E402
from joynexus.services.training.service import TrainingModelService  # noqa: E402
from tests.data.scaled_dataset import dataset_frames, write_scaled_dataset  # noqa: E402
from tests.helpers import sft_spec  # noqa: E402

TENANTS = {"normalized": {}, "raw": {"STATE": "IDENTITY", "ACTION": "IDENTITY"}}


def relative_errors(predicted: np.ndarray, target: np.ndarray) -> np.ndarray:
    return np.sqrt(((predicted - target) ** 2).mean(0)) / target.std(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--samples", type=int, default=32, help="samples per job (one microbatch)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 jobs of 8 samples per tenant")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.every, args.samples = 2, 1, 8

    tmp = Path(tempfile.mkdtemp(prefix="joynexus-norm-bench-"))
    root = write_scaled_dataset(tmp / "scaled", "bench/scaled")
    states, target = dataset_frames(root)
    print(f"dataset: {len(states)} frames; action std per dim {np.round(target.std(0), 3).tolist()}, "
          f"ratio {target.std(0)[1] / target.std(0)[0]:.0f}x")  # fmt: skip

    queue = TrainingQueue()
    training = TrainingModelService(BackboneSource(preset="tiny"), tmp / "ckpt", queue=queue, num_threads=1)
    inference = InferenceModelService(BackboneSource(preset="tiny"), num_threads=1, max_wait_ms=0.0)
    store = ControlPlaneStore(f"sqlite:///{tmp / 'control.db'}")
    scheduler = TrainingScheduler(store, release_partition=queue.clear)
    creator = TenantCreator(store, scheduler, BackendCapabilities.single(training.capabilities()))
    observations = [Observation(images=(), state=s, instruction="move the arm") for s in states]
    producers, loop = {}, ActorLoop(scheduler, training)
    for name, modes in TENANTS.items():
        spec = sft_spec(
            name, root, base_model=training.backbone.model_id, cameras=(), state_dim=states.shape[1],
            action_dim=target.shape[1], action_chunk=1, jobs=args.jobs, samples_per_job=args.samples,
            microbatch_size=args.samples, lr=args.lr,
        )  # fmt: skip
        spec["dataset"]["repo_id"] = "bench/scaled"
        spec["normalization"] = modes
        spec["training"]["checkpoint_every_jobs"] = 0
        tenant = creator.create(spec)
        training.add_tenant(tenant.backend_config)
        producers[name] = SFTProducer.from_dataset(
            tenant.backend_config, scheduler, service_handle(TrainingQueue, queue), str(root), "bench/scaled"
        )

    header = f"{'job':>4} | " + " | ".join(f"{n:>10} loss  err[0]   err[1]" for n in TENANTS)
    print(header)
    print("-" * len(header))
    final: dict[str, np.ndarray] = {}
    started = time.perf_counter()
    for job in range(1, args.jobs + 1):
        losses = {}
        for name, producer in producers.items():
            producer.produce_once()
            outcome = loop.step()
            assert outcome.state == COMPLETED, outcome
            losses[name] = float(np.mean(outcome.metrics["losses"]))
        if job % args.every and job != args.jobs:
            continue
        cells = []
        for name in TENANTS:
            inference.load_weights(training.export_params(name))
            actions = np.asarray(inference.predict(name, observations)["actions"])[:, 0, :]
            final[name] = errors = relative_errors(actions, target)
            cells.append(f"{losses[name]:>15.4g} {errors[0]:>7.3f} {errors[1]:>8.3f}")
        print(f"{job:>4} | " + " | ".join(cells))
    inference.close()
    store.dispose()
    print(f"\n{args.jobs} jobs per tenant in {time.perf_counter() - started:.1f} s")
    print("final per-dimension relative error (RMSE / std, dataset units):")
    for dim in range(target.shape[1]):
        norm, raw = final["normalized"][dim], final["raw"][dim]
        print(f"  action[{dim}]: normalized {norm:.4f}   raw {raw:.4f}   raw / normalized {raw / norm:.1f}x")


if __name__ == "__main__":
    main()
