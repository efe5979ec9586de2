"""Tenant density (issue 14.5): bounded resident tenants with LRU paging to disk, in one run.

  .venv/bin/python benchmarks/density.py [--resident 1000] [--registered 10000] [--serving-registered 10000]
                                         [--samples 200] [--max-active 64] [--module-size tiny]
                                         [--out var/benchmarks]

Tiny backbone, the smallest action module (`oft_mlp`, size "tiny": per-tenant Python objects weigh
the most against its tensors), state-only tenants (no camera: the cheapest backbone forward, so a
page-in weighs the most against it). One torch thread.

1. Memory per extra tenant, Training Model Service (resident bound = --resident). Tenants are added
   and each trained one step (so its AdamW moments exist). Between 10% and 100% of the bound, the
   growth per tenant is measured two ways and divided by one tenant's module + optimizer bytes
   (parameters, exp_avg, exp_avg_sq, step counts): (a) tracked tensor bytes, what the residency
   counts (every tensor a resident slot holds: parameters, buffers, gradients, optimizer state);
   (b) process RSS (psutil), which adds Python objects and allocator overhead. Run twice, each in a
   fresh process (so neither reuses memory the other freed): with the default active bound
   (--max-active: all but that many resident slots packed into flat tensors) -- the headline, goal
   <= 1.1x -- and with every resident slot active (module and AdamW as live objects), for comparison.
   Then a packed tenant's first train_batch (materialized from its flat tensors, and the least
   recently used active slot packed when the call returns) vs an active tenant's, interleaved.
2. Registered tenants: tenants are added up to --registered while --resident stay in memory (the
   least recently used are paged out to the spill folder): RSS growth per paged-out tenant (the
   bookkeeping left in memory, less what the resident tier shrinks by: the tenants left resident are
   the new, untrained ones, without AdamW state) and spill bytes per tenant; then a paged-out tenant's first
   train_batch vs a resident tenant's (page-in, plus the page-out, a file write, of the least
   recently used: a training slot changes with every step, so every page-out writes it).
3. Inference Model Service with --serving-registered serving states (payloads in the format
   `export_params` writes) and --resident of them in memory: a paged-out tenant's first predict
   vs a resident tenant's, end to end as a caller sees it, interleaved; at the service's default
   batching wait T (5 ms) and at T = 0 (the worst case for the ratio: nothing hides the page-in).
   A serving state never changes: its file is written once, by load_weights, so a page-out only
   drops it. Goal: median ratio <= 2.

Every figure is a ratio of two things measured side by side in this run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from joynexus.artifacts import TenantManifest, encode_tenant_payload  # noqa: E402
from joynexus.core.tenants import BackendCapabilities, BaseModelCapabilities  # noqa: E402
from joynexus.master.tenant_creator import SpecCompiler  # noqa: E402
from joynexus.models.action_modules import ActionModuleConfig, build_action_module  # noqa: E402
from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.inference_queue import Observation  # noqa: E402
from joynexus.services.inference.service import InferenceModelService  # noqa: E402
from joynexus.services.training.packing import DEFAULT_MAX_ACTIVE_TENANTS  # noqa: E402
from joynexus.services.training.service import TrainingModelService
from joynexus.spec import WorkloadSpec  # noqa: E402

STATE_DIM, ACTION_DIM, CHUNK = 4, 2, 2
INSTRUCTION = "push the block to the goal"


def tenant_config(caps: Any, module_size: str = "tiny") -> Any:
    """One compiled state-only tenant (the real spec compiler); others are copies with their own id and seed."""
    spec = WorkloadSpec.model_validate(
        {
            "tenant": "density-0",
            "base_model": caps.model_id,
            "task": "eval",
            "action_module": {"kind": "oft_mlp", "size": module_size},
            "observation": {
                "cameras": [],
                "image_size": [32, 32],
                "state_dim": STATE_DIM,
                "action_dim": ACTION_DIM,
                "action_chunk": CHUNK,
                "instruction": INSTRUCTION,
            },
        }
    )
    return SpecCompiler(BackendCapabilities.single(caps)).compile(spec).model_copy(update={"task_type": "sft"})


def batch(config: Any, rows: int, rng: np.random.Generator) -> dict[str, Any]:
    return {
        "images": np.zeros((rows, 0, 3, 32, 32), dtype=np.float32),
        "state": rng.standard_normal((rows, STATE_DIM)).astype(np.float32),
        "action": rng.uniform(-1, 1, (rows, CHUNK, ACTION_DIM)).astype(np.float32),
        "action_is_pad": np.zeros((rows, CHUNK), dtype=bool),
        "task": [INSTRUCTION] * rows,
        "tenant_id": [config.tenant_id] * rows,
        "schema_signature": [config.schema_signature] * rows,
    }


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def module_plus_optimizer_bytes(service: TrainingModelService, tenant_id: str) -> int:
    """One trained tenant's parameters + AdamW state (what a slot must hold), in bytes."""
    state = service.tenant_state(tenant_id)
    params = sum(t.numel() * t.element_size() for t in state["module"].values())
    moments = sum(
        t.numel() * t.element_size()
        for per_param in state["optimizer"]["state"].values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor)
    )
    return params + moments


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": 1e3 * statistics.median(ordered),
        "p90_ms": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
        "n": len(ordered),
    }


def interleaved(
    service: TrainingModelService, rng: np.random.Generator, by_id: dict[str, Any], measured: list[Any]
) -> tuple[list[float], list[float]]:
    """First train_batch seconds of each `measured` tenant and, beside it, of the most recently used
    tenant (the reference: resident and active, and it stays so), alternating which goes first.
    Returns (reference seconds, measured seconds)."""
    reference_samples, measured_samples = [], []
    for k, config in enumerate(measured):
        reference = by_id[service._slots.resident_keys()[-1]]
        jobs = [("reference", reference), ("measured", config)]
        for kind, job in jobs if k % 2 else reversed(jobs):
            data = batch(job, 4, rng)
            started = time.perf_counter()
            service.train_batch(job.tenant_id, data)
            (reference_samples if kind == "reference" else measured_samples).append(time.perf_counter() - started)
    return reference_samples, measured_samples


# ------------------------------------------------------------------------------ training service
def in_fresh_process(function: Any, *args: Any) -> Any:
    """`function(*args)` in a new interpreter: its RSS growth is its own, not memory another run freed."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def training_density(args: argparse.Namespace, tmp: Path, max_active: int, memory_only: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    service = TrainingModelService(
        BackboneSource(preset="tiny"),
        tmp / "checkpoints",
        num_threads=1,
        placement="cpu",
        max_resident_tenants=args.resident,
        spill_dir=tmp / "spill",
        max_active_tenants=max_active,
    )
    base = tenant_config(service.capabilities(), args.module_size)
    rng = np.random.default_rng(0)
    configs: list[Any] = []

    def add(count: int, train: bool) -> float:
        started = time.perf_counter()
        for _ in range(count):
            i = len(configs)
            config = base.model_copy(update={"tenant_id": f"density-{i}", "seed": i})
            configs.append(config)
            service.add_tenant(config)
            if train:
                service.train_batch(config.tenant_id, batch(config, 4, rng))
        return (time.perf_counter() - started) / max(count, 1)

    warm = max(1, args.resident // 10)
    add(warm, train=True)
    rss0, tracked0 = rss(), service.residency_stats()["resident_bytes"]
    seconds_per_trained_tenant = add(args.resident - warm, train=True)
    rss1, tracked1 = rss(), service.residency_stats()["resident_bytes"]
    extra = args.resident - warm
    one = module_plus_optimizer_bytes(service, configs[-1].tenant_id)
    memory = {
        "resident_tenants": service.residency_stats()["resident"],
        "max_active_tenants": max_active,
        "active_tenants": len(service._active),
        "module_plus_optimizer_bytes": one,
        "tracked_bytes_per_tenant": (tracked1 - tracked0) / extra,
        "rss_bytes_per_tenant": (rss1 - rss0) / extra,
        "tracked_ratio": (tracked1 - tracked0) / extra / one,
        "rss_ratio": (rss1 - rss0) / extra / one,
        "seconds_per_tenant_add_and_train": seconds_per_trained_tenant,
    }
    if memory_only:
        service._slots.close()
        return {"memory": memory}

    # A packed tenant's first train_batch vs an active one's, interleaved. Packed: resident but not
    # active, never used since it was packed (least recently used first).
    by_id = {c.tenant_id: c for c in configs}
    packed = [c for c in configs if c.tenant_id not in service._active]
    active_samples, packed_samples = interleaved(service, rng, by_id, packed[: args.samples])
    packed_first_step = {
        "packed_tenants": len(packed),
        "active_tenants": len(service._active),
        "active": summary(active_samples),
        "packed_first": summary(packed_samples),
        "median_ratio": statistics.median(packed_samples) / statistics.median(active_samples),
    }

    # The paged-out tenants' growth from here (past the packed-latency runs above). The slots left
    # resident are the new, untrained tenants (no AdamW state yet): the resident tier shrinks meanwhile.
    rss_before = rss()
    seconds_per_registration = add(args.registered - args.resident, train=False)
    stats = service.residency_stats()
    rss2 = rss()
    paged = stats["paged_out"]
    per_paged_out = (rss2 - rss_before) / max(paged, 1)
    registered = {
        "registered_tenants": stats["registered"],
        "resident_tenants": stats["resident"],
        "paged_out_tenants": paged,
        "rss_bytes_per_paged_out_tenant": per_paged_out,
        "rss_per_paged_out_vs_resident_tenant": per_paged_out / max((rss1 - rss0) / extra, 1),
        "spill_bytes_per_paged_out_tenant": stats["spill_bytes"] / max(paged, 1),
        "seconds_per_registration": seconds_per_registration,
    }

    # A paged-out tenant's first train_batch vs a resident one's, interleaved. Resident: the most
    # recently used (the next page-in never evicts it); paged out: never used since its page-out.
    by_id = {c.tenant_id: c for c in configs}
    never_used = [c for c in configs[: args.registered - args.resident] if not service._slots.is_resident(c.tenant_id)]
    resident_samples, paged_samples = interleaved(service, rng, by_id, never_used[: args.samples])
    first_step = {
        "resident": summary(resident_samples),
        "paged_out_first": summary(paged_samples),
        "median_ratio": statistics.median(paged_samples) / statistics.median(resident_samples),
    }
    final = service.residency_stats()
    first_step["page_ins"], first_step["page_outs"] = final["page_ins"], final["page_outs"]
    service._slots.close()
    return {
        "memory": memory,
        "packed_train_batch_latency": packed_first_step,
        "registered": registered,
        "train_batch_latency": first_step,
    }


# ----------------------------------------------------------------------------- inference service
def payload(config: Any, module_config: ActionModuleConfig, seed: int) -> bytes:
    """A tenant's serving payload, in the format `TrainingModelService.export_params` writes."""
    torch.manual_seed(seed)
    module = build_action_module(module_config)
    manifest = TenantManifest(
        tenant_id=config.tenant_id,
        policy_version=1,
        schema_signature=config.schema_signature,
        base_model_id=config.base_model_id,
        module_kind=module_config.kind,
        module_config=module_config.model_dump(mode="json"),
        files={},
        created_at=datetime.now(UTC).isoformat(),
        extra={},
    )
    return encode_tenant_payload({k: v.detach() for k, v in module.state_dict().items()}, manifest)


def serving_latency(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    service = InferenceModelService(
        BackboneSource(preset="tiny"),
        num_threads=1,
        placement="cpu",
        max_resident_serving=args.resident,
        spill_dir=tmp / "spill",
    )
    base = tenant_config(BaseModelCapabilities.of_backbone(service.backbone), args.module_size)
    module_config = ActionModuleConfig.model_validate(base.action_module)
    started = time.perf_counter()
    names = []
    for i in range(args.serving_registered):
        config = base.model_copy(update={"tenant_id": f"serve-{i}", "seed": i})
        service.load_weights(payload(config, module_config, seed=i))
        names.append(config.tenant_id)
    seconds_per_load = (time.perf_counter() - started) / args.serving_registered
    stats = service.residency_stats()
    rng = np.random.default_rng(1)
    never_used = [n for n in names if not service._serving.is_resident((n, 1))]

    def observation() -> list[Observation]:
        return [Observation(images=(), state=rng.standard_normal(STATE_DIM).astype(np.float32))]

    results: dict[str, Any] = {
        "registered_serving_states": stats["registered"],
        "resident_serving_states": stats["resident"],
        "seconds_per_load_weights": seconds_per_load,
        # every serving state has its file (written once, at load), resident or not
        "spill_bytes_per_serving_state": stats["spill_bytes"] / max(stats["registered"], 1),
    }
    for _ in range(5):  # warm-up of the backbone and the worker
        service.predict(names[-1], observation())
    half = min(args.samples, len(never_used) // 2)
    for label, wait_s in (("default_T", service.max_wait_s), ("T0", 0.0)):
        service.max_wait_s = wait_s  # the worker reads it per batch: same service, same states
        todo = never_used[:half] if label == "default_T" else never_used[half : 2 * half]
        resident_samples, paged_samples = [], []
        for k, tenant in enumerate(todo):
            resident_tenant = service._serving.resident_keys()[-1][0]  # most recently used: stays resident
            jobs = [("resident", resident_tenant), ("paged", tenant)]
            for kind, name in jobs if k % 2 else reversed(jobs):
                obs = observation()
                began = time.perf_counter()
                service.predict(name, obs)
                (resident_samples if kind == "resident" else paged_samples).append(time.perf_counter() - began)
        results[label] = {
            "max_wait_ms": 1e3 * wait_s,
            "resident": summary(resident_samples),
            "paged_out_first": summary(paged_samples),
            "median_ratio": statistics.median(paged_samples) / statistics.median(resident_samples),
            "p90_ratio": summary(paged_samples)["p90_ms"] / summary(resident_samples)["p90_ms"],
        }
    final = service.residency_stats()
    results["page_ins"], results["page_outs"], results["files_written"] = (
        final["page_ins"],
        final["page_outs"],
        final["files_written"],
    )
    service.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resident", type=int, default=1000, help="resident tenant slots / serving states")
    parser.add_argument("--registered", type=int, default=10_000, help="tenants added to the Training Model Service")
    parser.add_argument("--serving-registered", type=int, default=10_000, help="serving states loaded for inference")
    parser.add_argument("--samples", type=int, default=200, help="latency pairs per measurement")
    parser.add_argument(
        "--max-active", type=int, default=DEFAULT_MAX_ACTIVE_TENANTS, help="active training slots (the rest packed)"
    )
    parser.add_argument("--module-size", default="tiny", choices=["tiny", "small", "base"], help="action module size")
    parser.add_argument("--out", type=Path, default=None, help="folder for density.json")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 16 resident of 32 registered tenants, 5 latency pairs"
    )
    args = parser.parse_args()
    if args.quick:
        args.resident, args.registered, args.serving_registered, args.samples, args.max_active = 16, 32, 32, 5, 4
    if not 1 <= args.resident < min(args.registered, args.serving_registered):
        parser.error("--resident must be >= 1 and below --registered and --serving-registered")
    if not 1 <= args.max_active < args.resident:
        parser.error("--max-active must be >= 1 and below --resident")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="joynexus-density-") as tmp:
        started = time.perf_counter()
        training = in_fresh_process(training_density, args, Path(tmp) / "training", args.max_active, False)
        # Every resident slot active: the memory a slot costs without packing.
        all_active = in_fresh_process(training_density, args, Path(tmp) / "all-active", args.resident, True)
        training["memory_all_active"] = all_active["memory"]
        inference = serving_latency(args, Path(tmp) / "inference")
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "training": training, "inference": inference}
    report["seconds"] = time.perf_counter() - started
    print(json.dumps(report, indent=2))
    mem, reg, lat = training["memory"], training["registered"], training["train_batch_latency"]
    active, packed = training["memory_all_active"], training["packed_train_batch_latency"]
    print("\n== tenant density ==")
    print(f"module + optimizer of one tenant:        {mem['module_plus_optimizer_bytes'] / 1024:.1f} KiB")
    print(
        f"memory per extra resident tenant, {mem['active_tenants']} of {mem['resident_tenants']} active: "
        f"{mem['rss_ratio']:.3f}x process RSS (goal <= 1.1x), {mem['tracked_ratio']:.3f}x tracked tensors"
    )
    print(
        f"memory per extra ACTIVE tenant (all {active['resident_tenants']} active): "
        f"{active['rss_ratio']:.3f}x process RSS, {active['tracked_ratio']:.3f}x tracked tensors"
    )
    print(f"first train_batch packed / active:        {packed['median_ratio']:.2f}x (median)")
    print(f"resident / registered tenants (training): {reg['resident_tenants']} / {reg['registered_tenants']}")
    print(f"RSS per paged-out tenant vs resident:     {reg['rss_per_paged_out_vs_resident_tenant']:.3f}x")
    print(f"first train_batch paged-out / resident:   {lat['median_ratio']:.2f}x (median)")
    print(
        f"resident / registered serving states:    {inference['resident_serving_states']} / "
        f"{inference['registered_serving_states']}"
    )
    for label in ("default_T", "T0"):
        row = inference[label]
        print(
            f"first predict paged-out / resident, T={row['max_wait_ms']:.0f} ms: {row['median_ratio']:.2f}x median, "
            f"{row['p90_ratio']:.2f}x p90  (goal <= 2x)"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "density.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
