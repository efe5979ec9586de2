"""State-only tenants: the backbone forward over the constant instruction vs its kept features,
side by side in one run.

  .venv/bin/python benchmarks/state_only_features.py [--presets tiny smolvlm-256m] [--batch 8] [--calls 20]

A state-only tenant's samples have no camera, so their features depend on the instruction alone
(the base model is frozen): `encode` answers such a batch (one instruction, no adapter) from that
instruction's features, computed once (`TenantAdapterHost.encode`). Printed per backbone preset
(random weights at the preset's dimensions): milliseconds per `encode` of `--batch` image-free
samples through the forward (`_encode_features`) and from the kept features, and the ratio. The
features are checked equal (within float tolerance) before timing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from joynexus.models.backbone import BackboneSource  # noqa: E402

INSTRUCTION = "push the cube to the goal region"


def per_call_ms(call, calls: int) -> float:
    call()  # first-call costs (and the kept features' one forward) are not timed
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "smolvlm-256m"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smoke run: the tiny preset, 3 calls of 2 samples")
    args = parser.parse_args()
    if args.quick:
        args.presets, args.batch, args.calls = ["tiny"], 2, 3
    torch.set_num_threads(args.threads)
    images, instructions = [[]] * args.batch, [INSTRUCTION] * args.batch
    print(f"encode of {args.batch} image-free samples of one instruction, {args.threads} thread(s), ms per call")
    print(f"{'preset':<16} {'parameters':>12} {'forward':>9} {'kept':>7} {'forward / kept':>15}")
    for preset in args.presets:
        backbone = BackboneSource(preset=preset).build()
        with torch.inference_mode():
            forward = backbone._encode_features(images, instructions)
            kept = backbone.encode(images, instructions)
        torch.testing.assert_close(kept.tokens, forward.tokens, atol=1e-4, rtol=1e-4)
        forward_ms = per_call_ms(lambda b=backbone: b._encode_features(images, instructions), args.calls)
        kept_ms = per_call_ms(lambda b=backbone: b.encode(images, instructions), args.calls)
        print(f"{preset:<16} {backbone.parameter_count():>12,} {forward_ms:>9.2f} {kept_ms:>7.3f} "
              f"{forward_ms / kept_ms:>14.0f}x")  # fmt: skip


if __name__ == "__main__":
    main()
