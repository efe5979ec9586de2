"""Predict fairness across tenants (issue 11), side by side in one run.

  .venv/bin/python benchmarks/predict_fairness.py [--seconds 6] [--big 1024] [--json out.json]

Tenant B sends 1-sample predicts back to back and we take B's latency (p50 / p99, seen by the
caller):
  alone          nobody else sends anything (measured before and after the loaded runs);
  split on       tenant A meanwhile sends --big-sample predicts back to back; the service splits
                 them into chunks of max_chunk_samples and forms batches round-robin across tenants;
  split off      the same with max_chunk_samples=None: each of A's predicts is one backbone forward.
Ratios are loaded / alone. Beside them, what splitting costs tenant A: its samples/s and its own
predict latency, with the same service in both modes.

One Inference Model Service (tiny backbone, its worker thread batching with the deployed defaults
B = 32 / T = 5 ms, 1 torch thread), two tenants of different schemas built by the real spec
compiler, as in benchmarks/group_batching.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from joynexus.core.tenants import BackendCapabilities, BaseModelCapabilities  # noqa: E402
from joynexus.master.tenant_creator import SpecCompiler  # noqa: E402
from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.inference_queue import Observation  # noqa: E402
from joynexus.services.inference.service import DEFAULT_MAX_CHUNK_SAMPLES, InferenceModelService  # noqa: E402
from joynexus.services.training.service import TrainingModelService
from joynexus.spec import WorkloadSpec  # noqa: E402

# A: the bulk tenant (two cameras); B: the interactive one (one camera, another module kind).
SCHEMAS = {
    "bulk-a": dict(cameras=["front", "wrist"], image_size=[32, 32], state_dim=8, action_dim=7, module="oft_mlp"),
    "robot-b": dict(cameras=["top"], image_size=[24, 40], state_dim=4, action_dim=2, module="flow_matching"),
}


def compiled_config(tenant: str, caps: BaseModelCapabilities, schema: dict[str, Any]) -> Any:
    """An evaluation tenant (no dataset needed) compiled by the real spec compiler."""
    spec = WorkloadSpec.model_validate(
        {
            "tenant": tenant,
            "base_model": caps.model_id,
            "task": "eval",
            "action_module": {"kind": schema["module"], "size": "tiny"},
            "observation": {k: schema[k] for k in ("cameras", "image_size", "state_dim", "action_dim")},
        }
    )
    return SpecCompiler(BackendCapabilities.single(caps)).compile(spec)


def observations(tenant: str, n: int, rng: np.random.Generator) -> list[Observation]:
    schema = SCHEMAS[tenant]
    h, w = schema["image_size"]
    return [
        Observation(
            images=tuple(rng.random((3, h, w), dtype=np.float32) for _ in schema["cameras"]),
            state=rng.standard_normal(schema["state_dim"]).astype(np.float32),
            instruction="pick up the cube",
        )
        for _ in range(n)
    ]


def percentiles(latencies: list[float]) -> dict[str, float]:
    return {
        "n": len(latencies),
        "p50_ms": 1e3 * float(np.percentile(latencies, 50)),
        "p99_ms": 1e3 * float(np.percentile(latencies, 99)),
    }


def measure(service: InferenceModelService, seconds: float, big: list[Observation] | None, small) -> dict[str, Any]:
    """B's predict latencies for `seconds`, while A (if `big`) sends its large predicts back to back."""
    stop = threading.Event()
    a_latencies: list[float] = []

    def bulk() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            result = service.predict("bulk-a", big, timeout_s=600)
            a_latencies.append(time.perf_counter() - start)
            assert result["actions"].shape[0] == len(big)

    sender = threading.Thread(target=bulk, daemon=True) if big else None
    if sender is not None:
        sender.start()
        time.sleep(0.5)  # A's requests in the queue before B starts measuring
    b_latencies: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        start = time.perf_counter()
        service.predict("robot-b", small, timeout_s=600)
        b_latencies.append(time.perf_counter() - start)
    elapsed = time.perf_counter() - started
    stop.set()
    if sender is not None:
        sender.join()
    row: dict[str, Any] = {"b": percentiles(b_latencies)}
    if big:
        row["a"] = {
            **percentiles(a_latencies),
            "samples_per_s": len(a_latencies) * len(big) / max(elapsed, 1e-9),
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0, help="measurement window per mode")
    parser.add_argument("--big", type=int, default=1024, help="samples per predict of tenant A")
    parser.add_argument("--batch", type=int, default=32, help="max_batch_size B of the service")
    parser.add_argument("--chunk", type=int, default=DEFAULT_MAX_CHUNK_SAMPLES, help="max_chunk_samples when on")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 s per mode, 128-sample predicts")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.big = 1.0, 128
    torch.set_num_threads(1)  # stable timings, as in group_batching.py

    with tempfile.TemporaryDirectory(prefix="joynexus-fairness-") as tmp:
        trainer = TrainingModelService(BackboneSource(preset="tiny"), Path(tmp) / "ckpt")
        service = InferenceModelService(BackboneSource(preset="tiny"), max_batch_size=args.batch, max_wait_ms=5.0)
        for i, (name, schema) in enumerate(SCHEMAS.items()):
            trainer.add_tenant(compiled_config(name, trainer.capabilities(), schema).model_copy(update={"seed": i}))
            service.load_weights(trainer.export_params(name))
        rng = np.random.default_rng(0)
        big, small = observations("bulk-a", args.big, rng), observations("robot-b", 1, rng)
        service.predict("bulk-a", big[: args.batch])  # warm-up
        service.predict("robot-b", small)
        print(
            f"tenant B: 1-sample predicts; tenant A: {args.big}-sample predicts; B = {args.batch}, "
            f"chunks of {min(args.chunk, args.batch)} when split; {args.seconds:g} s per mode",
            flush=True,
        )
        results: dict[str, Any] = {}
        plan = [("alone", None, None), ("split on", args.chunk, big), ("split off", None, big), ("alone", None, None)]
        alone: list[dict[str, Any]] = []
        for mode, chunk, load in plan:
            service.max_chunk_samples = chunk
            row = measure(service, args.seconds, load, small)
            b = row["b"]
            print(
                f"  {mode:9}: B p50 {b['p50_ms']:8.1f} ms  p99 {b['p99_ms']:8.1f} ms  ({b['n']} predicts)", flush=True
            )
            if mode == "alone":
                alone.append(row)
            else:
                results[mode] = row
        stats = service.stats()
        service.close()

    base = float(np.mean([r["b"]["p50_ms"] for r in alone]))
    base99 = float(np.mean([r["b"]["p99_ms"] for r in alone]))
    results["alone"] = {"b": {"p50_ms": base, "p99_ms": base99, "runs": [r["b"] for r in alone]}}
    print("\nside by side (ratio = loaded / alone; 1.0 = A costs B nothing)")
    header = (
        f"{'mode':>10} | {'B p50 ms':>9} {'ratio':>7} | {'B p99 ms':>9} {'ratio':>7} | "
        f"{'A samples/s':>11} {'A p50 ms':>9}"
    )
    print(header)
    print("-" * len(header))
    print(f"{'alone':>10} | {base:9.1f} {1.0:7.2f} | {base99:9.1f} {1.0:7.2f} | {'-':>11} {'-':>9}")
    for mode in ("split on", "split off"):
        b, a = results[mode]["b"], results[mode]["a"]
        results[mode]["b"]["p50_ratio"] = b["p50_ms"] / base
        results[mode]["b"]["p99_ratio"] = b["p99_ms"] / base99
        print(
            f"{mode:>10} | {b['p50_ms']:9.1f} {b['p50_ms'] / base:7.2f} | {b['p99_ms']:9.1f} "
            f"{b['p99_ms'] / base99:7.2f} | {a['samples_per_s']:11.0f} {a['p50_ms']:9.1f}"
        )
    on, off = results["split on"]["b"]["p50_ms"], results["split off"]["b"]["p50_ms"]
    print(f"\nB's p50 under load, split off / split on: {off / on:.1f}x")
    print(f"service: {stats['batches']} forwards, {stats['split_requests']} split requests, {stats['chunks']} chunks")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"results: {args.json}")


if __name__ == "__main__":
    main()
