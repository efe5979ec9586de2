"""The main paths on a GPU, beside the CPU in one run (issue 12.1): device placement end to end.

  .venv/bin/python benchmarks/gpu_check.py [--preset small] [--steps 5] [--repeats 5] [--group-batching]
      [--real-size] [--training] [--mixed] [--dry-run] [--results FILE]

1. Which accelerator this process sees (or, clearly, that there is none: then only the CPU path runs
   and the script still exits 0).
2. For each placement -- cpu float32 and bfloat16, with a GPU also cuda float32 and bfloat16 -- a tenant of
   each module kind trains a few SFT steps (finite losses), its export loads into an Inference Model
   Service on the same placement and predicts; a bare backbone forward of 32 samples too. Timings are
   medians of interleaved repeats, printed as ratios against cpu float32 side by side.
3. Checkpoint round trip: written on cuda, resumed on the CPU, trained there, resumed on cuda, with
   the weights and AdamW state bit-identical at each hop (without a GPU: float32 -> bfloat16 ->
   float32 backbones on the CPU, the same checks).
4. `benchmarks/group_batching.py --quick` with JOYNEXUS_DEVICE=cuda (with a GPU; on the CPU only when
   `--group-batching` asks for it: it takes minutes there).
5. `benchmarks/real_size.py --grid` at smolvlm-256m (published dimensions, random weights; more presets
   with --real-size-presets) at the published 512 px with JOYNEXUS_DEVICE=cuda: the P1 grid N x b with
   the same-path bound (issue 42.3); on the CPU only when `--real-size` asks for it, at 64 px, quick.
6. `benchmarks/smolvla_grouped.py`: 8 SmolVLA, then 8 π0 and 8 π0.5 tenants (PaliGemma 3B + Gemma 300M
   experts) over one shared prefix each, at the families' published dimensions (SmolVLA at 512 px) on a
   GPU (grouped vs serial, the bare-prefix bound, memory per extra tenant in float32 and bfloat16);
   `--quick` on the CPU.
7. `benchmarks/training_throughput.py` at smolvlm-256m, 512 px: grouped training vs one at a time at
   2 / 4 / 8 tenants, 3 repeats (issue 42.4; `--training`: its --quick on the CPU).
8. `benchmarks/mixed_workload.py` at smolvlm-256m: the mixed workload together vs isolated, 2 measured
   pairs (issue 42.5; `--mixed`: its --quick on the CPU).
On a GPU the whole script stays under 10 minutes (each part has its share as a timeout; a part past
it is stopped, what it printed kept, and the next runs) and everything printed, this process's and
every part's, goes to ONE results file (`--results`, default var/benchmarks/gpu_check-<time>.txt), so
the first task lent a GPU fills the table in one call. `--dry-run` prints that plan and runs nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from joynexus.core.tenants import BackendCapabilities  # noqa: E402
from joynexus.master.tenant_creator import SpecCompiler  # noqa: E402
from joynexus.models.backbone import BackboneSource
from joynexus.models.placement import DevicePlacement, tensor_devices  # noqa: E402
from joynexus.scheduling.inference_queue import Observation  # noqa: E402
from joynexus.services.inference.service import InferenceModelService  # noqa: E402
from joynexus.services.training.service import TrainingModelService
from joynexus.spec import parse_workload_spec  # noqa: E402

SCHEMA = dict(cameras=["front", "wrist"], image_size=[64, 64], state_dim=8, action_dim=7, action_chunk=4)
KINDS = ("oft_mlp", "flow_matching")
ROWS = 16  # samples per training microbatch and per predict request
REAL_SIZE_PRESETS = ("smolvlm-256m",)  # smolvlm-500m too with --real-size-presets (past the 10 minutes)


def compiled_config(service: TrainingModelService, tenant: str, kind: str) -> Any:
    """A tenant compiled by the real spec compiler (an evaluation spec: no dataset needed), trained as SFT."""
    spec = {
        "tenant": tenant,
        "base_model": service.backbone.model_id,
        "task": "eval",
        "action_module": {"kind": kind, "size": "tiny"},
        "observation": {**SCHEMA, "instruction": "pick up the cube"},
    }
    caps = BackendCapabilities.single(service.capabilities())
    return SpecCompiler(caps).compile(parse_workload_spec(spec)).model_copy(update={"task_type": "sft", "seed": 3})


def sft_batch(config: Any, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    h, w = config.image_size
    return {
        "images": rng.random((ROWS, len(config.cameras), 3, h, w), dtype=np.float32),
        "state": rng.standard_normal((ROWS, config.state_dim)).astype(np.float32),
        "action": rng.uniform(-1, 1, (ROWS, config.action_chunk, config.action_dim)).astype(np.float32),
        "action_is_pad": np.zeros((ROWS, config.action_chunk), dtype=bool),
        "task": ["pick up the cube"] * ROWS,
        "tenant_id": [config.tenant_id] * ROWS,
        "schema_signature": [config.schema_signature] * ROWS,
    }


def observations(config: Any) -> list[Observation]:
    rng = np.random.default_rng(1)
    h, w = config.image_size
    return [
        Observation(
            images=tuple(rng.random((3, h, w), dtype=np.float32) for _ in config.cameras),
            state=rng.standard_normal(config.state_dim).astype(np.float32),
            instruction="pick up the cube",
        )
        for _ in range(ROWS)
    ]


class PlacementRun:
    """One placement's services and tenants; each `round` times one step of every path once."""

    def __init__(self, label: str, placement: DevicePlacement, preset: str, root: Path, steps: int) -> None:
        self.label, self.placement = label, placement
        self.training = TrainingModelService(
            BackboneSource(preset=preset), root / label.replace(" ", "-"), placement=placement
        )
        self.inference = InferenceModelService(BackboneSource(preset=preset), placement=placement, max_wait_ms=1.0)
        slug = label.replace(" ", "-")
        self.configs = {
            kind: compiled_config(self.training, f"{slug}-{kind.replace('_', '-')}", kind) for kind in KINDS
        }
        self.losses: dict[str, list[float]] = {}
        self.times: dict[str, list[float]] = {}
        for kind, config in self.configs.items():
            self.training.add_tenant(config)
            # The SFT steps the check asks for (the first ones also warm the device up).
            self.losses[kind] = [
                self.training.train_batch(config.tenant_id, sft_batch(config, s))["loss"] for s in range(steps)
            ]
            payload = self.training.export_params(config.tenant_id)
            self.inference.load_weights(payload)
            self.inference.predict(config.tenant_id, observations(config))  # warm-up
        g = torch.Generator().manual_seed(0)
        self.images = [[torch.rand(3, 64, 64, generator=g), torch.rand(3, 48, 64, generator=g)] for _ in range(32)]
        self.texts = ["pick up the red cube and place it in the bowl"] * 32
        self.training.encode(self.images, self.texts)  # warm-up

    def round(self, step: int) -> None:
        for kind, config in self.configs.items():
            started = time.perf_counter()
            loss = self.training.train_batch(config.tenant_id, sft_batch(config, 100 + step))["loss"]  # float(): synced
            self._time(f"train step {kind}", started)
            self.losses[kind].append(loss)
            started = time.perf_counter()
            result = self.inference.predict(config.tenant_id, observations(config))  # numpy: synced
            self._time(f"predict {ROWS} {kind}", started)
            assert np.isfinite(result["actions"]).all(), f"{self.label}: non-finite actions"
        started = time.perf_counter()
        features = self.training.encode(self.images, self.texts)
        features.pooled.sum().item()  # wait for the device
        self._time("backbone forward 32", started)

    def _time(self, what: str, started: float) -> None:
        self.times.setdefault(what, []).append(time.perf_counter() - started)

    def close(self) -> None:
        self.inference.close()


def check_round_trip(root: Path, hops: list[tuple[str, DevicePlacement]], preset: str) -> list[str]:
    """Train on the first placement, then resume from its checkpoint on each next one: weights and
    AdamW state must come back bit-identical, and each hop trains one more step and saves."""
    lines = []
    previous: TrainingModelService | None = None
    config = None
    for index, (label, placement) in enumerate(hops):
        service = TrainingModelService(BackboneSource(preset=preset), root / "round-trip", placement=placement)
        if config is None:
            config = compiled_config(service, "round-trip", "flow_matching")
        resumed = service.add_tenant(config)["resumed"]
        if previous is not None:
            before, after = previous.tenant_state("round-trip"), service.tenant_state("round-trip")
            same = all(torch.equal(before["module"][k], after["module"][k]) for k in before["module"]) and all(
                torch.equal(v, after["optimizer"]["state"][i][k])
                for i, moments in before["optimizer"]["state"].items()
                for k, v in moments.items()
            )
            devices = {p.device.type for p in service._slot("round-trip").module.parameters()}
            lines.append(
                f"  hop {index}: -> {label:<16} resumed={resumed} version={after['version']} "
                f"weights+AdamW bit-identical={same} module on {sorted(devices)}"
            )
            if not (resumed and same):
                raise SystemExit(f"round trip failed at hop {index} ({label})")
        loss = service.train_batch("round-trip", sft_batch(config, index))["loss"]
        if not np.isfinite(loss):
            raise SystemExit(f"round trip: non-finite loss on {label}")
        exported = service.export_params("round-trip")
        assert exported and all(d.type == "cpu" for d in tensor_devices(service.tenant_state("round-trip")))
        service.save(["round-trip"])
        if index == 0:
            lines.append(f"  hop 0: written on {label}")
        previous = service
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="backbone preset (tiny | small)")
    parser.add_argument("--steps", type=int, default=5, help="SFT steps per tenant before timing")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds per placement")
    parser.add_argument("--group-batching", action="store_true", help="also run group_batching.py --quick on the CPU")
    parser.add_argument("--real-size", action="store_true", help="also run real_size.py on the CPU (64 px, --quick)")
    parser.add_argument(
        "--real-size-presets", default=",".join(REAL_SIZE_PRESETS), help="presets part 5 runs (comma-separated)"
    )
    parser.add_argument("--training", action="store_true", help="also run training_throughput.py --quick on the CPU")
    parser.add_argument("--mixed", action="store_true", help="also run mixed_workload.py --quick on the CPU")
    parser.add_argument("--dry-run", action="store_true", help="print what a GPU run would run, run nothing")
    parser.add_argument("--results", type=Path, default=None, help="the one results file (default var/benchmarks/)")
    args = parser.parse_args()
    if args.dry_run:
        dry_run(args)
        return
    torch.set_num_threads(int(os.environ.get("JOYNEXUS_TORCH_THREADS", "1")))
    results = Results(args.results or Path("var/benchmarks") / f"gpu_check-{time.strftime('%Y%m%d-%H%M%S')}.txt")

    gpu = torch.cuda.is_available()
    print(
        f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}, torch threads {torch.get_num_threads()}"
    )
    if gpu:
        print(f"GPU present: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible)")
    else:
        print("NO GPU PRESENT: torch sees no CUDA device here; running the CPU path only (exit 0).")
    placements = [
        ("cpu float32", DevicePlacement(device="cpu")),
        ("cpu bfloat16", DevicePlacement(device="cpu", dtype="bfloat16")),
    ]
    if gpu:
        placements += [
            ("cuda float32", DevicePlacement(device="cuda")),
            ("cuda bfloat16", DevicePlacement(device="cuda", dtype="bfloat16")),
        ]

    with tempfile.TemporaryDirectory(prefix="joynexus-gpu-check-") as tmp:
        root = Path(tmp)
        runs = [PlacementRun(label, placement, args.preset, root, args.steps) for label, placement in placements]
        try:
            for step in range(args.repeats):  # interleaved: drift on a shared machine hits every placement alike
                for run in runs:
                    run.round(step)
        finally:
            for run in runs:
                run.close()

        print(f"\n== paths per placement (backbone preset {args.preset!r}, {ROWS} samples per step / request) ==")
        for run in runs:
            info = run.training.backbone_info()
            print(
                f"{run.label:<14} device={info['device']} ({info['device_name']}) dtype={info['dtype']} "
                f"autocast={info['autocast']}"
            )
            for kind, losses in run.losses.items():
                finite = all(np.isfinite(losses))
                print(
                    f"  {kind:<14} SFT losses {losses[0]:.4f} -> {losses[-1]:.4f} "
                    f"over {len(losses)} steps, finite={finite}"
                )
                if not finite:
                    raise SystemExit(f"{run.label}: non-finite SFT loss for {kind}")

        print("\n== median seconds per operation, and speedup vs cpu float32 (same run, interleaved) ==")
        header = f"{'operation':<28}" + "".join(f"{run.label:>16}{'x cpu':>8}" for run in runs)
        print(header)
        for what in runs[0].times:
            base = statistics.median(runs[0].times[what])
            row = f"{what:<28}"
            for run in runs:
                median = statistics.median(run.times[what])
                row += f"{median:>16.4f}{base / median:>8.2f}"
            print(row)

        print("\n== checkpoint round trip ==")
        if gpu:
            hops = [
                ("cuda float32", DevicePlacement(device="cuda")),
                ("cpu float32", DevicePlacement(device="cpu")),
                ("cuda bfloat16", DevicePlacement(device="cuda", dtype="bfloat16")),
            ]
        else:
            hops = [
                ("cpu float32", DevicePlacement(device="cpu")),
                ("cpu bfloat16", DevicePlacement(device="cpu", dtype="bfloat16")),
                ("cpu float32", DevicePlacement(device="cpu")),
            ]
        for line in check_round_trip(root, hops, args.preset):
            print(line)

    for part in plan(gpu, args):
        if not part.runs:
            print(f"\n({part.name} skipped: {part.skip_reason})")
            continue
        run_part(part, results)
    if not gpu:
        print("\nNO GPU PRESENT: only the CPU path was checked.")
    print(f"\nall of this run's output: {results.path}")
    results.close()


@dataclass
class Part:
    """One benchmark the script runs in its own process (its memory figures are its own)."""

    name: str
    command: list[str]
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    runs: bool = True
    skip_reason: str = ""


def plan(gpu: bool, args: argparse.Namespace) -> list[Part]:
    """Parts 4-8 with their options on a GPU (`gpu`) or on this CPU. On a GPU they are sized so the
    whole script stays under 10 minutes (issue 42.7): each part has its share as a timeout."""
    here = Path(__file__).parent
    device = {"JOYNEXUS_DEVICE": "cuda" if gpu else "cpu"}
    py = sys.executable
    parts = [
        Part("group_batching.py --quick", [py, str(here / "group_batching.py"), "--quick"], 45, device,
             runs=gpu or args.group_batching, skip_reason="no GPU; pass --group-batching to run it on the CPU"),
    ]  # fmt: skip
    for preset in [p for p in args.real_size_presets.split(",") if p]:
        # Each grid cell is appended to a results file as it is measured, so a part stopped at its
        # share keeps its cells and the next call measures only the missing ones.
        cells = f"var/benchmarks/p1_grid_gpu_{preset}.jsonl"
        sized = (["--image-size", "512", "--grid", "--repeats", "3", "--grid-results", cells] if gpu
                 else ["--image-size", "64", "--quick"])  # fmt: skip
        parts.append(
            Part(f"real_size.py --preset {preset} (P1 grid at 512 px on a GPU, issue 42.3)",
                 [py, str(here / "real_size.py"), "--preset", preset, *sized, "--out",
                  f"var/benchmarks/real-size-{preset}"], 150, device, runs=gpu or args.real_size,
                 skip_reason="no GPU; pass --real-size to run it on the CPU at 64 px")  # fmt: skip
        )
    for family, published in (("smolvla", ["--image-size", "512"]), ("pi0", []), ("pi05", [])):
        sized = [*published, "--repeats", "5"] if gpu else ["--quick"]
        parts.append(
            Part(f"smolvla_grouped.py --family {family} (the VLA families' figures)",
                 [py, str(here / "smolvla_grouped.py"), "--family", family, *sized], 35, device)  # fmt: skip
        )
    trained = (["--preset", "smolvlm-256m", "--image-size", "512", "--tenants", "2,4,8", "--jobs", "4",
                "--repeats", "3"] if gpu else ["--quick"])  # fmt: skip
    parts.append(
        Part("training_throughput.py (grouped training at real size, issue 42.4)",
             [py, str(here / "training_throughput.py"), "--mode", "inprocess", *trained], 90, device,
             runs=gpu or args.training,
             skip_reason="no GPU; pass --training to run its --quick on the CPU")  # fmt: skip
    )
    mixed = ["--preset", "smolvlm-256m", "--repeats", "2", "--quick"] if gpu else ["--quick"]
    parts.append(
        Part("mixed_workload.py (P3 together vs isolated, measured pairs, issue 42.5)",
             [py, str(here / "mixed_workload.py"), "--mode", "inprocess", *mixed], 110, device,
             runs=gpu or args.mixed, skip_reason="no GPU; pass --mixed to run its --quick on the CPU")  # fmt: skip
    )
    return parts


class Results:
    """One results file: this process's output and every part's, as it comes (a tee)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("w", buffering=1)
        self._stdout = sys.stdout
        sys.stdout = self

    def write(self, text: str) -> int:
        self._stdout.write(text)
        self._file.write(text)
        return len(text)

    def flush(self) -> None:
        self._stdout.flush()
        self._file.flush()

    def close(self) -> None:
        sys.stdout = self._stdout
        self._file.close()


def run_part(part: Part, results: Results) -> None:
    """Run one part, its output into the results file; a part past its share of the 10 minutes is
    stopped and reported (what it printed stays), and the next part runs."""
    shown = " ".join(part.command[2:])
    env = ", ".join(f"{k}={v}" for k, v in part.env.items())
    print(f"\n== {part.name}: {Path(part.command[1]).name} {shown} ({env}; at most {part.timeout_s:.0f} s) ==",
          flush=True)  # fmt: skip
    started = time.perf_counter()
    process = subprocess.Popen(part.command, env={**os.environ, **part.env}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    timer = threading.Timer(part.timeout_s, process.kill)
    timer.start()
    try:
        for line in process.stdout:
            results.write(line)
        code = process.wait()
    finally:
        timer.cancel()
    took = time.perf_counter() - started
    if code != 0:
        if took >= part.timeout_s:
            print(f"  -> {part.name}: stopped at its {part.timeout_s:.0f} s share (what it printed is above)")
            return
        raise SystemExit(f"{part.name} failed with exit code {code}")
    print(f"  -> {part.name}: {took:.0f} s")


def dry_run(args: argparse.Namespace) -> None:
    """What the script runs on a GPU, part by part, with each part's share of the 10 minutes."""
    parts = plan(True, args)
    print("dry run: on a GPU this script runs parts 1-3 in this process (placements, checkpoint round trip), then:")
    for part in parts:
        print(f"  {part.timeout_s:4.0f} s  {part.name}:\n          {' '.join(part.command[1:])}")
    total = sum(p.timeout_s for p in parts)
    print(f"parts 4-8 at most {total:.0f} s in all (the script under 10 minutes with parts 1-3); one results file")


if __name__ == "__main__":
    main()
