"""The main paths on a GPU, beside the CPU in one run (issue 12.1): device placement end to end.

  .venv/bin/python benchmarks/gpu_check.py [--preset small] [--steps 5] [--repeats 5] [--group-batching]

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
5. `benchmarks/real_size.py` at each real-size preset (smolvlm-256m, smolvlm-500m: published dimensions,
   random weights) at their published 512 px with JOYNEXUS_DEVICE=cuda, so the first run on a GPU
   reports them (on the CPU only when `--real-size` asks for it, at 64 px).
6. `benchmarks/smolvla_grouped.py`: 8 SmolVLA, then 8 π0 and 8 π0.5 tenants (PaliGemma 3B + Gemma 300M
   experts) over one shared prefix each, at the families' published dimensions (SmolVLA at 512 px) on a
   GPU (grouped vs serial, the bare-prefix bound, memory per extra tenant in float32 and bfloat16);
   `--quick` on the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
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
REAL_SIZE_PRESETS = ("smolvlm-256m", "smolvlm-500m")


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
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("JOYNEXUS_TORCH_THREADS", "1")))

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

    if gpu or args.group_batching:
        device = "cuda" if gpu else "cpu"
        print(f"\n== benchmarks/group_batching.py --quick with JOYNEXUS_DEVICE={device} ==", flush=True)
        script = Path(__file__).with_name("group_batching.py")
        env = {**os.environ, "JOYNEXUS_DEVICE": device}
        done = subprocess.run([sys.executable, str(script), "--quick"], env=env, check=False)
        if done.returncode != 0:
            raise SystemExit(f"group_batching.py --quick failed with exit code {done.returncode}")
    else:
        print("\n(group_batching.py --quick skipped: no GPU; pass --group-batching to run it on the CPU)")
    if gpu or args.real_size:
        run_real_size(gpu, [p for p in args.real_size_presets.split(",") if p])
    else:
        print("(real_size.py skipped: no GPU; pass --real-size to run it on the CPU at 64 px)")
    run_smolvla(gpu)
    if not gpu:
        print("\nNO GPU PRESENT: only the CPU path was checked.")


def run_real_size(gpu: bool, presets: list[str]) -> None:
    """Part 5: benchmarks/real_size.py per real-size preset, in its own process (its memory figures
    are its own), at 512 px on a GPU and 64 px (quick) on the CPU."""
    device = "cuda" if gpu else "cpu"
    script = Path(__file__).with_name("real_size.py")
    env = {**os.environ, "JOYNEXUS_DEVICE": device}
    for preset in presets:
        command = [sys.executable, str(script), "--preset", preset, "--out", f"var/benchmarks/real-size-{preset}"]
        command += ["--image-size", "512"] if gpu else ["--image-size", "64", "--quick"]
        print(f"\n== benchmarks/real_size.py --preset {preset} with JOYNEXUS_DEVICE={device} ==", flush=True)
        done = subprocess.run(command, env=env, check=False)
        if done.returncode != 0:
            raise SystemExit(f"real_size.py --preset {preset} failed with exit code {done.returncode}")


def run_smolvla(gpu: bool) -> None:
    """Part 6: benchmarks/smolvla_grouped.py for SmolVLA, π0 and π0.5 (8 tenants over one prefix each:
    grouped vs serial, the bound, memory per extra tenant in float32 and bfloat16) at the published
    dimensions on a GPU (SmolVLA at 512 px); their --quick on the CPU."""
    device = "cuda" if gpu else "cpu"
    script = Path(__file__).with_name("smolvla_grouped.py")
    for family, published in (("smolvla", ["--image-size", "512"]), ("pi0", []), ("pi05", [])):
        sized = [*published, "--repeats", "5"] if gpu else ["--quick"]
        command = [sys.executable, str(script), "--family", family, *sized]
        shown = " ".join(command[2:])
        print(f"\n== benchmarks/smolvla_grouped.py {shown} with JOYNEXUS_DEVICE={device} ==", flush=True)
        done = subprocess.run(command, env={**os.environ, "JOYNEXUS_DEVICE": device}, check=False)
        if done.returncode != 0:
            raise SystemExit(f"smolvla_grouped.py --family {family} failed with exit code {done.returncode}")


if __name__ == "__main__":
    main()
