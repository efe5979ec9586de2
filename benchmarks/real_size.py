"""Group batching, memory and a one-model-per-tenant peer at a real backbone size, side by side in
one run (issue 23 item 4).

  .venv/bin/python benchmarks/real_size.py [--preset smolvlm-256m] [--image-size 64] [--threads 1]
      [--repeats 7] [--peer-copies 3] [--quick] [--grid [--grid-tenants 2,4,6,8] [--grid-batches 1,2,4,8]]
      [--grid-only [--grid-mixes oft_mlp,flow_matching,lora]] [--grid-results FILE.jsonl] [--out var/benchmarks]

The backbone is a preset at its published dimensions with random weights (compute and memory are the
real ones); ``--image-size`` serves it at a smaller canonical camera side (a CPU cannot run 512 px
in reasonable time; the weights stay the published ones). Tenants are compiled by the real spec
compiler, trained-state exported by the Training Model Service and served by the Inference Model
Service (its `submit -> queue -> execute` path, no worker thread: no GIL contention between
client threads biases either mode; the outside review's M4).

1. Group batching (P1/P2) at 8 tenants x batch 1, for oft_mlp heads, flow_matching heads and a LoRA
   tenant mix (8 tenants, each its own adapter on the shared text model, oft heads): requests/s
   grouped (one execute of the 8 requests) vs serial (8 executes). The bound is measured on the same
   service path (issue 42.2): serial vs ONE fused request per schema carrying every sample (queue,
   pad, forward, decode included), so share = fused / grouped <= 100% up to noise; the bare-backbone
   ratio (8 forwards of batch 1 vs one of batch 8, no queue or decode) is printed beside it as the
   physical limit. ``--grid`` runs the same at N x b (default N in 2,4,6,8, b in 1,2,4,8: issue
   42.3's P1 grid). Medians of interleaved repeats with bootstrap 95% intervals over the repeats.
   ``--grid-only`` runs only the grid and prints it as one table; with ``--grid-results`` every cell
   is appended to that JSON-lines file as it is measured and cells it holds are skipped, so a grid
   that takes hours on a CPU fills over several runs (benchmarks/results/p1_grid_cpu.jsonl).
2. Memory: tensor bytes of one backbone + N tenants (N = 1, 100, 1000) in float32 and bfloat16 vs N
   separate copies of backbone + module. The backbone's float32 bytes and every tenant's module and
   adapter bytes are measured on the real instances; bfloat16 halves the backbone's floating tensors
   (the services keep tenant modules in float32 at either dtype); the N multiples are arithmetic.
3. Peer baseline: one model per tenant. ``--peer-copies`` K tenants each get their own backbone copy
   (built, not extrapolated) and their own head, served one request at a time with the same
   optimised encode (the review's "tuned peer"); interleaved with JoyNexus grouped over the same K
   tenants: requests/s ratio, tensor-bytes ratio, and the measured RSS growth per backbone copy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from group_batching import SCHEMAS, observations, serve  # noqa: E402  (the shared harness pieces)

from joynexus.core.tenants import BackendCapabilities, BaseModelCapabilities  # noqa: E402
from joynexus.master.tenant_creator import SpecCompiler  # noqa: E402
from joynexus.models.backbone import BackboneSource  # noqa: E402
from joynexus.services.inference.service import InferenceModelService  # noqa: E402
from joynexus.services.training.service import TrainingModelService  # noqa: E402
from joynexus.spec import WorkloadSpec  # noqa: E402

TENANTS = 8
MIXES = ("oft_mlp", "flow_matching", "lora")
LORA = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}
MEMORY_N = (1, 100, 1000)
MIB = 2**20


# ---------------------------------------------------------------------------------------- helpers
def tenant_config(name: str, caps: BaseModelCapabilities, kind: str, size: str, seed: int, lora: bool) -> Any:
    """A tenant compiled by the real spec compiler (evaluation-only: no dataset needed)."""
    schema = SCHEMAS[seed % 2]
    spec: dict[str, Any] = {
        "tenant": name,
        "base_model": caps.model_id,
        "task": "eval",
        "action_module": {"kind": kind, "size": size},
        "observation": {**schema, "cameras": list(schema["cameras"]), "image_size": list(schema["image_size"])},
    }
    if lora:
        spec["adapter"] = LORA
    compiled = SpecCompiler(BackendCapabilities.single(caps)).compile(WorkloadSpec.model_validate(spec))
    return compiled.model_copy(update={"seed": seed})


def timed_rounds(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each function per round, in alternation so load drifts hit all alike (one warm-up)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - start)
    return samples


def ratio_ci(num: list[float], den: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """median(num) / median(den), and a bootstrap 95% interval over the paired rounds."""
    point = statistics.median(num) / statistics.median(den)
    rng = random.Random(0)
    n = len(num)
    values = []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        values.append(statistics.median(num[i] for i in idx) / statistics.median(den[i] for i in idx))
    values.sort()
    return point, values[int(0.025 * draws)], values[int(0.975 * draws) - 1]


def fmt(ci: tuple[float, float, float], scale: float = 1.0, unit: str = "x") -> str:
    return f"{scale * ci[0]:.2f}{unit} [{scale * ci[1]:.2f}-{scale * ci[2]:.2f}]"


def tensor_bytes(tensors: Any, as_bfloat16: bool = False) -> int:
    """Bytes of the tensors; ``as_bfloat16``: floating tensors at 2 bytes (what a bfloat16 placement holds)."""
    return sum(t.numel() * (2 if as_bfloat16 and t.is_floating_point() else t.element_size()) for t in tensors)


def backbone_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The base model's parameters and buffers (tenant LoRA tensors excluded)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [t for name, t in named if ".lora_" not in name]


def resident(device: torch.device) -> int:
    """Bytes this process holds where the backbone lives: device memory on a GPU, else RSS."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return psutil.Process().memory_info().rss


# ---------------------------------------------------------------------------------------- parts
def group_batching(
    service: InferenceModelService, names: list[str], lora: bool, repeats: int, batch: int = 1
) -> dict[str, Any]:
    """Part 1 for one tenant mix at len(names) tenants x `batch`: the service grouped vs serial,
    the same-path bound and the bare-backbone bound (the physical limit).

    The same-path bound (issue 42.2) is what grouping could at best give on this very path: the
    serial requests against ONE request per schema carrying all their samples (a fused request:
    the same images, texts and rows through the same submit -> queue -> pad -> forward -> decode,
    but one tenant's head per schema instead of one per tenant). Grouping N tenants can only cost
    more than that, so share = speedup / same-path bound = fused / grouped <= 100% up to noise;
    the bare-backbone ratio (N forwards vs one, no queue, no decode) is printed beside it."""
    rng = np.random.default_rng(0)
    reqs = [(name, observations(i, batch, rng)) for i, name in enumerate(names)]
    fused_by_schema: dict[int, tuple[str, list[Any]]] = {}
    for i, (name, obs) in enumerate(reqs):
        fused_by_schema.setdefault(i % len(SCHEMAS), (name, []))[1].extend(obs)
    fused = list(fused_by_schema.values())
    inputs = [
        ([[torch.as_tensor(img) for img in o.images] for o in obs], [o.instruction for o in obs]) for _, obs in reqs
    ]
    keys = [[service._resolve(name, None).adapter_key] * batch if lora else None for name in names]
    all_images = [imgs for chunk, _ in inputs for imgs in chunk]
    all_text = [t for _, texts in inputs for t in texts]
    all_keys = [k for ks in keys for k in ks] if lora else None
    backbone = service.backbone

    def serial() -> None:
        for r in reqs:
            serve(service, [r])

    def grouped() -> None:
        serve(service, reqs)

    def one_request_per_schema() -> None:
        serve(service, fused)

    def bare_serial() -> None:
        for (imgs, texts), key in zip(inputs, keys, strict=True):
            backbone.encode(imgs, texts, key)

    def bare_group() -> None:
        backbone.encode(all_images, all_text, all_keys)

    t = timed_rounds(
        {"serial": serial, "grouped": grouped, "fused": one_request_per_schema, "bare_serial": bare_serial,
         "bare_group": bare_group},
        repeats,
    )  # fmt: skip
    n = len(names)
    return {
        "tenants": n,
        "batch": batch,
        "grouped_rps": n / statistics.median(t["grouped"]),
        "serial_rps": n / statistics.median(t["serial"]),
        "speedup": ratio_ci(t["serial"], t["grouped"]),
        "bound": ratio_ci(t["serial"], t["fused"]),
        "share": ratio_ci(t["fused"], t["grouped"]),
        "bare_bound": ratio_ci(t["bare_serial"], t["bare_group"]),
        "bare_share": ratio_ci(
            [s / g for s, g in zip(t["serial"], t["grouped"], strict=True)],
            [s / g for s, g in zip(t["bare_serial"], t["bare_group"], strict=True)],
        ),
        "efficiency": ratio_ci(t["bare_group"], t["grouped"]),
        "forward_b1_ms": 1e3 * statistics.median(t["bare_serial"]) / n,
        "forward_b8_ms": 1e3 * statistics.median(t["bare_group"]),
        "grouped_ms": 1e3 * statistics.median(t["grouped"]),
        "serial_ms": 1e3 * statistics.median(t["serial"]),
        "fused_ms": 1e3 * statistics.median(t["fused"]),
        "repeats": repeats,
    }


def group_batching_line(mix: str, r: dict[str, Any]) -> str:
    return (
        f"  {mix:13} N={r['tenants']} b={r['batch']}: grouped {r['grouped_rps']:7.2f} req/s vs serial "
        f"{r['serial_rps']:7.2f} req/s: {fmt(r['speedup'])}; same-path bound {fmt(r['bound'])}, share "
        f"{fmt(r['share'], 100, '%')}; bare-backbone bound {fmt(r['bare_bound'])} (share of it "
        f"{fmt(r['bare_share'], 100, '%')}); forward of one request {r['forward_b1_ms']:.1f} ms, of all "
        f"{r['forward_b8_ms']:.1f} ms"
    )


GRID_KEY = ("preset", "image_size", "threads", "module_size", "mix", "tenants", "batch")


def grid_cell_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row[k] for k in GRID_KEY)


def read_grid_results(path: Path | None) -> list[dict[str, Any]]:
    """The cells a `--grid-results` file already holds (one JSON object per line; a torn last line,
    from a run stopped while writing, is ignored and measured again)."""
    if path is None or not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def grid(
    service: InferenceModelService,
    mix: str,
    names: list[str],
    sizes: list[int],
    batches: list[int],
    repeats: int,
    where: dict[str, Any],
    results: Path | None = None,
    done: frozenset[tuple[Any, ...]] = frozenset(),
) -> list[dict[str, Any]]:
    """P1 over the grid (issue 42.3) for one mix: every N x b, each point its own interleaved rounds.

    With `results`, every cell is appended to that file as soon as it is measured; a cell in `done`
    (the keys of the cells the file held when the run began) is not measured again: the grid is
    hours on a CPU, so it fills over several runs (each cell's ratios come from its own interleaved
    rounds, so cells from different runs compare). Returns the cells measured now."""
    rows = []
    for n in sizes:
        for b in batches:
            if grid_cell_key({**where, "mix": mix, "tenants": n, "batch": b}) in done:
                print(f"  {mix:13} N={n} b={b}: in {results} already", flush=True)
                continue
            r = {**where, "mix": mix, **group_batching(service, names[:n], mix == "lora", repeats, b),
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "load_average": os.getloadavg()[0]}  # fmt: skip
            rows.append(r)
            print(group_batching_line(mix, r), flush=True)
            if results is not None:
                results.parent.mkdir(parents=True, exist_ok=True)
                with results.open("a") as f:
                    f.write(json.dumps(r) + "\n")
    return rows


def grid_table(rows: list[dict[str, Any]]) -> list[str]:
    """The P1 grid as a table: one line per mix x N x b with the ratio, the same-path bound, the
    share of it and the bare-backbone ratio, each with its interval."""
    lines = [f"  {'mix':13} {'N':>2} {'b':>2}  {'grouped/serial':>22}  {'same-path bound':>22}  {'share':>22}  "
             f"{'bare-backbone':>22}  load"]  # fmt: skip
    order = {m: i for i, m in enumerate(MIXES)}
    for r in sorted(rows, key=lambda r: (order.get(r["mix"], 9), r["tenants"], r["batch"])):
        lines.append(
            f"  {r['mix']:13} {r['tenants']:>2} {r['batch']:>2}  {fmt(r['speedup']):>22}  {fmt(r['bound']):>22}  "
            f"{fmt(r['share'], 100, '%'):>22}  {fmt(r['bare_bound']):>22}  {r.get('load_average', float('nan')):.1f}"
        )
    return lines


def tenant_bytes(service: InferenceModelService, name: str) -> int:
    """A serving tenant's own tensors: its module (parameters and buffers) and its LoRA adapter."""
    state = service._resolve(name, None)
    own = tensor_bytes([*state.module.parameters(), *state.module.buffers()])
    return own + (tensor_bytes(state.adapter_state.values()) if state.adapter_state else 0)


def memory(service: InferenceModelService, tenants: dict[str, list[str]]) -> dict[str, Any]:
    """Part 2: one backbone + N tenants vs N copies of backbone + module, per dtype and tenant mix."""
    tensors = backbone_tensors(service.backbone.model)
    backbone = {"float32": tensor_bytes(tensors), "bfloat16": tensor_bytes(tensors, as_bfloat16=True)}
    per_tenant = {mix: statistics.mean(tenant_bytes(service, n) for n in names) for mix, names in tenants.items()}
    rows = []
    for dtype, bb in backbone.items():
        for mix, t in per_tenant.items():
            for n in MEMORY_N:
                shared, separate = bb + n * t, n * (bb + t)
                rows.append(
                    {"dtype": dtype, "mix": mix, "n": n, "shared_bytes": shared, "separate_bytes": separate,
                     "ratio": separate / shared}
                )  # fmt: skip
    return {"backbone_bytes": backbone, "tenant_bytes": per_tenant, "rows": rows}


def peer(
    source: BackboneSource, service: InferenceModelService, names: list[str], copies: int, repeats: int
) -> dict[str, Any]:
    """Part 3: each of `copies` tenants its own backbone copy and head, served one at a time, vs
    JoyNexus grouped over the same tenants and requests, interleaved."""
    names = names[:copies]
    rng = np.random.default_rng(7)
    reqs = [(name, observations(i, 1, rng)) for i, name in enumerate(names)]
    device = service.backbone.device
    before = resident(device)
    own = [source.build(placement=service.backbone.placement) for _ in names]  # the same seed: the same weights
    rss_per_copy = (resident(device) - before) / len(own)
    heads = [service._resolve(name, None).module for name in names]
    prepared = [
        ([[torch.as_tensor(img) for img in o.images] for o in obs], [o.instruction for o in obs],
         torch.stack([torch.as_tensor(o.state) for o in obs]).to(device))  # as the service does
        for _, obs in reqs
    ]  # fmt: skip

    def one_model_per_tenant() -> None:
        with torch.inference_mode():
            for backbone, head, (imgs, texts, state) in zip(own, heads, prepared, strict=True):
                head.predict(backbone.encode(imgs, texts).trimmed(), state)

    def joynexus_grouped() -> None:
        serve(service, reqs)

    t = timed_rounds({"peer": one_model_per_tenant, "grouped": joynexus_grouped}, repeats)
    bb = tensor_bytes(backbone_tensors(service.backbone.model))
    heads_bytes = sum(tenant_bytes(service, n) for n in names)
    peer_bytes = sum(tensor_bytes(backbone_tensors(b.model)) for b in own) + heads_bytes
    joynexus_bytes = bb + heads_bytes
    own.clear()  # the copies go before the caller measures anything else
    return {
        "copies": len(names),
        "peer_rps": len(names) / statistics.median(t["peer"]),
        "grouped_rps": len(names) / statistics.median(t["grouped"]),
        "throughput_ratio": ratio_ci(t["peer"], t["grouped"]),
        "peer_bytes": peer_bytes,
        "joynexus_bytes": joynexus_bytes,
        "memory_ratio": peer_bytes / joynexus_bytes,
        "rss_per_copy_bytes": rss_per_copy,
        "repeats": repeats,
    }


# ---------------------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else args.repeats
    copies = min(args.peer_copies, 2) if args.quick else args.peer_copies
    module_size = "tiny" if args.quick else args.module_size
    load_before = os.getloadavg()
    source = BackboneSource(preset=args.preset, image_size=args.image_size)
    spec = source.preset_spec()
    tmp = Path(tempfile.mkdtemp(prefix="joynexus-real-size-"))
    started = time.perf_counter()
    trainer = TrainingModelService(source, tmp / "ckpt")
    service = InferenceModelService(source, start_worker=False, max_batch_size=10_000)
    build_s = (time.perf_counter() - started) / 2
    caps = trainer.capabilities()
    params = service.backbone.parameter_count()
    print(
        f"== {args.preset}: {params:,} parameters as built (Idefics3Model, no LM head; "
        f"{params + (spec.vocab_size or len(service.backbone.tokenizer)) * spec.text_hidden_size:,} with an untied LM "
        f"head), image {spec.image_size} px ({spec.image_seq_len} tokens per camera; published grid "
        f"{spec.grid_image_size} px), torch threads {torch.get_num_threads()}, build {build_s:.1f} s per backbone, "
        f"load average before {load_before[0]:.2f}",
        flush=True,
    )

    def add(mix: str, offset: int) -> list[str]:
        names = []
        kind = "oft_mlp" if mix == "lora" else mix
        for i in range(TENANTS):
            name = f"{mix.replace('_', '-')}-{i}"
            trainer.add_tenant(tenant_config(name, caps, kind, module_size, offset + i, lora=mix == "lora"))
            service.load_weights(trainer.export_params(name))
            names.append(name)
        return names

    tenants: dict[str, list[str]] = {}
    results: dict[str, Any] = {}
    mixes = [m for m in MIXES if m in args.grid_mixes.split(",")] if args.grid_only else list(MIXES)
    sizes, batches = [int(v) for v in args.grid_tenants.split(",")], [int(v) for v in args.grid_batches.split(",")]
    if max(sizes) > TENANTS:
        raise SystemExit(f"--grid-tenants: at most {TENANTS} tenants per mix, got {max(sizes)}")
    if not mixes:
        raise SystemExit(f"--grid-mixes: expected some of {','.join(MIXES)}, got {args.grid_mixes!r}")
    where = {"preset": args.preset, "image_size": spec.image_size, "threads": torch.get_num_threads(),
             "module_size": module_size}  # fmt: skip
    # The cells of this preset, side, threads and module size the results file already holds.
    saved = [r for r in read_grid_results(args.grid_results) if all(r.get(k) == v for k, v in where.items())]
    done = frozenset(grid_cell_key(r) for r in saved)
    grid_rows: list[dict[str, Any]] = []
    if not args.grid_only:
        print(f"\n== 1. group batching, {TENANTS} tenants x batch 1 (medians of {repeats} interleaved rounds, 95% CI)")
    for offset, mix in enumerate(MIXES):
        if mix not in mixes:
            continue
        # LoRA tenants last: once an adapter is on the backbone every forward is routed through them,
        # so each mix's points (and its grid) are measured before the next mix's tenants come in.
        tenants[mix] = add(mix, 100 * offset)
        if not args.grid_only:
            r = results[mix] = group_batching(service, tenants[mix], mix == "lora", repeats)
            print(group_batching_line(mix, r), flush=True)
        if args.grid or args.grid_only:
            print(f"\n== 1b. P1 grid, {mix}: N in {sizes} x b in {batches} (medians of {repeats} interleaved rounds, "
                  "95% CI)")  # fmt: skip
            grid_rows += grid(service, mix, tenants[mix], sizes, batches, repeats, where, args.grid_results, done)
    if args.grid_only:
        service.close()
        rows = saved + grid_rows  # the file's earlier cells and this run's (never one of those again)
        print(f"\n== P1 grid table: {args.preset} @ {spec.image_size} px ({spec.image_seq_len} image tokens per "
              f"camera), {torch.get_num_threads()} thread(s), {module_size} modules: {len(rows)} cells"
              + (f" ({len(saved)} from earlier runs of {args.grid_results})" if args.grid_results else ""))  # fmt: skip
        print("\n".join(grid_table(rows)))
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "real_size_grid.json"
        path.write_text(json.dumps({**where, "grid": rows}, indent=2))
        print(f"\nall figures: {path}")
        return {**where, "grid": rows}
    mem = memory(service, tenants)
    print("\n== 2. memory: one backbone + N tenants vs N separate copies of backbone + module (tensor bytes)")
    print(
        f"  backbone float32 {mem['backbone_bytes']['float32'] / MIB:.1f} MiB (measured), bfloat16 "
        f"{mem['backbone_bytes']['bfloat16'] / MIB:.1f} MiB; per tenant (measured, float32): "
        + ", ".join(f"{mix} {b / MIB:.3f} MiB" for mix, b in mem["tenant_bytes"].items())
    )
    for row in mem["rows"]:
        print(
            f"  {row['dtype']:8} {row['mix']:13} N={row['n']:<5} shared {row['shared_bytes'] / MIB:10.1f} MiB  "
            f"separate {row['separate_bytes'] / MIB:12.1f} MiB  ratio {row['ratio']:7.1f}x"
        )

    print(f"\n== 3. peer: one model per tenant ({copies} real backbone copies, one request at a time)")
    p = peer(source, service, tenants["oft_mlp"], copies, repeats)
    print(
        f"  {p['copies']} tenants x batch 1, oft heads: JoyNexus grouped {p['grouped_rps']:.2f} req/s vs one model "
        f"per tenant {p['peer_rps']:.2f} req/s: {fmt(p['throughput_ratio'])}; tensor bytes "
        f"{p['peer_bytes'] / MIB:.1f} vs {p['joynexus_bytes'] / MIB:.1f} MiB: {p['memory_ratio']:.2f}x; "
        f"measured {'GPU memory' if service.backbone.device.type == 'cuda' else 'RSS'} growth per backbone copy "
        f"{p['rss_per_copy_bytes'] / MIB:.1f} MiB"
    )
    service.close()
    load_after = os.getloadavg()

    oft = results["oft_mlp"]
    per_extra = mem["tenant_bytes"]["oft_mlp"]
    print("\n== table (issue 23): preset | parameters | forward b1 / b8 ms | grouped/serial | share of the same-path "
          "bound | memory per extra tenant | vs one-model-per-tenant (throughput, memory)")  # fmt: skip
    print(
        f"  {args.preset} @ {spec.image_size}px, {torch.get_num_threads()} thread(s) | {params:,} | "
        f"{oft['forward_b1_ms']:.1f} / {oft['forward_b8_ms']:.1f} | "
        + ", ".join(f"{m} {results[m]['speedup'][0]:.2f}x" for m in MIXES)
        + " | "
        + ", ".join(f"{m} {100 * results[m]['share'][0]:.0f}%" for m in MIXES)
        + f" | {per_extra / MIB:.3f} MiB (oft), {mem['tenant_bytes']['lora'] / MIB:.3f} MiB (lora) | "
        f"{p['throughput_ratio'][0]:.2f}x, {p['memory_ratio']:.2f}x at {p['copies']} tenants"
    )
    print(f"  load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1-minute; this host's cores: "
          f"{os.cpu_count()})")  # fmt: skip
    report = {
        "preset": args.preset,
        "image_size": spec.image_size,
        "threads": torch.get_num_threads(),
        "parameters": params,
        "module_size": module_size,
        "load_average": {"before": load_before[0], "after": load_after[0]},
        "group_batching": results,
        "grid": grid_rows,
        "memory": mem,
        "peer": p,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "real_size.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\nall figures: {path}")
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smolvlm-256m", help="backbone preset (smolvlm-256m | smolvlm-500m | ...)")
    parser.add_argument("--image-size", type=int, default=None, help="canonical camera side (default: the preset's)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timed rounds")
    parser.add_argument("--peer-copies", type=int, default=3, help="real backbone copies of the peer baseline")
    parser.add_argument("--module-size", default="small", help="action module size preset (the spec default)")
    parser.add_argument("--quick", action="store_true", help="3 rounds, 2 peer copies, tiny heads (a smoke run)")
    parser.add_argument("--grid", action="store_true", help="also part 1 over N x b (issue 42.3's P1 grid)")
    parser.add_argument("--grid-tenants", default="2,4,6,8", help="the grid's tenant counts (at most 8)")
    parser.add_argument("--grid-batches", default="1,2,4,8", help="the grid's per-request batch sizes")
    parser.add_argument("--grid-only", action="store_true", help="only the grid (no parts 1-3): fills --grid-results")
    parser.add_argument("--grid-mixes", default=",".join(MIXES), help="with --grid-only: the mixes to measure")
    parser.add_argument(
        "--grid-results", type=Path, default=None,
        help="a JSON-lines file: every grid cell is appended as measured, cells it holds are skipped (resumable)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("var/benchmarks"))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
