"""VLA tenants (SmolVLA, π0, π0.5) over ONE shared prefix: grouped vs serial, the bare-prefix bound,
memory in float32 and bfloat16.

``--family smolvla`` (the default), at SmolVLA's published dimensions: SmolVLM2-500M (the
``smolvlm-500m`` preset: hidden 960, 15 heads, 5 KV heads) truncated to 16 layers, the action expert at
0.75 width over all 16, chunk 50, 10 Euler steps, random weights. On a CPU the cameras are served at
``--image-size`` (256 px: 16 image tokens per camera after the pixel-shuffle connector; the published
512 px gives 64) with one camera.

- grouped: ONE prefix forward for N tenants x batch 1 (`SmolVLAActionModule.layer_prefixes`, each row's
  state token by its own tenant's ``state_proj``), then each tenant's expert over its row;
- serial: per tenant its own prefix forward and expert, one after another;
- the bare-prefix ratio: N single-row prefix forwards vs one N-row forward (what grouping can save),
  and the bound it implies for the whole predict, (N P1 + N E) / (P_N + N E), with the share reached;
- memory: parameter bytes of one prefix + N experts vs N whole SmolVLA policies (prefix + expert each).

The device is the backbone placement's (``JOYNEXUS_DEVICE``; `benchmarks/gpu_check.py` runs this on
cuda at the published 512 px). Interleaved repeats, medians and min-max printed; ratios are measured
side by side in one run.
``--family pi0`` / ``pi05``: π0's / π0.5's published dimensions (the ``paligemma-3b`` preset: SigLIP
So400m/14 at 224 px, 256 image tokens, Gemma 2B over all 18 layers; the gemma_300m expert, chunk 50,
10 Euler steps); ``--image-size`` is not taken (SigLIP's position table fixes it).
``--quick``: tiny backbone, 2 layers, 2 tenants, 2 repeats (a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from joynexus.models.action_modules import ActionModule, ActionModuleConfig, PrefixRows, build_action_module
from joynexus.models.backbone import PaliGemmaBackbone, ResidentBackbone, TinyBackboneSpec
from joynexus.models.backbone.paligemma import PALIGEMMA_PRESETS


def build(args: argparse.Namespace) -> tuple[Any, list[ActionModule]]:
    if args.family in ("pi0", "pi05"):
        return build_pi0(args)
    spec = TinyBackboneSpec.preset(args.preset).with_overrides(image_size=args.image_size, feature_layers=args.layers)
    backbone = ResidentBackbone.build_tiny(spec)
    geometry = backbone.prefix_geometry
    config = ActionModuleConfig(
        kind="smolvla",
        feature_dim=backbone.hidden_size,
        state_dim=6,
        action_dim=6,
        action_chunk=args.chunk,
        num_steps=args.steps,
        num_vlm_layers=args.layers,
        vlm_num_heads=geometry.num_heads,
        vlm_num_kv_heads=geometry.num_kv_heads,
        vlm_head_dim=geometry.head_dim,
        resize_imgs_with_padding=(backbone.image_size, backbone.image_size),
    )
    modules = []
    for seed in range(args.tenants):
        torch.manual_seed(seed)
        modules.append(build_action_module(config).to(backbone.device).eval())
    return backbone, modules


def build_pi0(args: argparse.Namespace) -> tuple[PaliGemmaBackbone, list[ActionModule]]:
    """π0 / π0.5 tenants over a PaliGemma: the published ``paligemma-3b`` + gemma_300m experts, or tiny."""
    backbone = PaliGemmaBackbone.build_tiny(PALIGEMMA_PRESETS[args.preset])
    geometry = backbone.prefix_geometry
    width, mlp = (1024, 4096) if args.preset == "paligemma-3b" else (32, 64)
    config = ActionModuleConfig(
        kind=args.family,
        feature_dim=backbone.hidden_size,
        state_dim=6,
        action_dim=6,
        action_chunk=args.chunk,
        num_steps=args.steps,
        expert_width=width,
        expert_mlp_dim=mlp,
        image_resolution=backbone.image_size,
        vlm_depth=backbone.num_layers,
        vlm_num_heads=geometry.num_heads,
        vlm_num_kv_heads=geometry.num_kv_heads,
        vlm_head_dim=geometry.head_dim,
    )
    modules = []
    for seed in range(args.tenants):
        torch.manual_seed(seed)
        modules.append(build_action_module(config).to(backbone.device).eval())
    return backbone, modules


def rows(modules: list[ActionModule], side: int, device: torch.device) -> list[PrefixRows]:
    g = torch.Generator().manual_seed(0)
    return [
        PrefixRows(
            m, [[torch.rand(3, side, side, generator=g)]], ["pick up the red cube"], torch.randn(1, 6, device=device)
        )
        for m in modules
    ]


def predict(backbone: Any, members: list[PrefixRows]) -> None:
    """One predict: the members' ONE prefix forward, then each tenant's expert over its rows."""
    _experts_only(members, _prefix_only(backbone, members))


def timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    backbone, modules = build(args)
    members = rows(modules, args.image_size or backbone.image_size, backbone.device)
    n = len(members)
    kept = _prefix_only(backbone, members)
    cases = {
        "grouped": lambda: predict(backbone, members),
        "serial": lambda: [predict(backbone, [m]) for m in members],
        "prefix_batched": lambda: _prefix_only(backbone, members),
        "prefix_serial": lambda: [_prefix_only(backbone, [m]) for m in members],
        "experts": lambda: _experts_only(members, kept),
    }
    for fn in cases.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():  # interleaved: the host's noise hits every case alike
            times[name].append(timed(fn))
    med = {name: statistics.median(v) for name, v in times.items()}
    bound = (med["prefix_serial"] + med["experts"]) / (med["prefix_batched"] + med["experts"])
    speedup = med["serial"] / med["grouped"]
    prefix_params = sum(
        p.numel()
        for name, p in backbone.model.named_parameters()
        if not name.startswith(("text_model.norm", "lm_head", "model.language_model.norm"))
    )
    expert_params = sum(p.numel() for p in modules[0].parameters())
    return {
        "family": args.family,
        "preset": args.preset,
        "image_size": backbone.image_size,
        "image_tokens_per_camera": getattr(backbone, "image_seq_len", None)
        or (backbone.image_size // backbone.model.config.vision_config.patch_size) ** 2,
        "layers": getattr(backbone, "num_layers", args.layers) if args.family != "smolvla" else args.layers,
        "tenants": n,
        "threads": args.threads,
        "times": times,
        "median": med,
        "grouped_speedup": speedup,
        "bare_prefix_ratio": med["prefix_serial"] / med["prefix_batched"],
        "bound": bound,
        "share_of_bound": speedup / bound,
        "prefix_params": prefix_params,
        "expert_params": expert_params,
        "memory_shared_bytes": 4 * (prefix_params + n * expert_params),
        "memory_whole_policies_bytes": 4 * n * (prefix_params + expert_params),
        # per extra tenant: its expert alone here, a whole policy (prefix + expert) for the peer
        "extra_tenant_bytes": {"float32": 4 * expert_params, "bfloat16": 2 * expert_params},
        "extra_policy_bytes": {
            "float32": 4 * (prefix_params + expert_params),
            "bfloat16": 2 * (prefix_params + expert_params),
        },
    }


def _prefix_only(backbone: Any, members: list[PrefixRows]) -> list[Any]:
    """P: the prefix forward alone (what grouping shares)."""
    with torch.inference_mode():
        return type(members[0].module).layer_prefixes(backbone, members)


def _experts_only(members: list[PrefixRows], prefixes: list[Any]) -> None:
    """Each tenant's expert over its kept prefix cache (E: what grouping does not change)."""
    with torch.inference_mode():
        for member, prefix in zip(members, prefixes, strict=True):
            member.module.predict(prefix, member.state, generator=torch.Generator().manual_seed(1))


def report(result: dict[str, Any]) -> None:
    print(
        f"{result['family']} over {result['preset']}, {result['layers']} layers, {result['image_size']} px "
        f"({result['image_tokens_per_camera']} image tokens/camera, 1 camera), {result['tenants']} tenants x batch 1, "
        f"{result['threads']} thread(s)"
    )
    for name, values in result["times"].items():
        print(
            f"  {name:<15} median {1e3 * result['median'][name]:9.1f} ms"
            f"  (min {1e3 * min(values):.1f}, max {1e3 * max(values):.1f})"
        )
    print(f"  grouped vs serial:         {result['grouped_speedup']:.2f}x")
    print(f"  bare prefix, N rows vs 1:  {result['bare_prefix_ratio']:.2f}x")
    print(
        f"  bound (N P1 + N E)/(P_N + N E): {result['bound']:.2f}x; share reached {100 * result['share_of_bound']:.0f}%"
    )
    gib = 2**30
    print(
        f"  parameters: prefix {result['prefix_params'] / 1e6:.1f}M, "
        f"expert {result['expert_params'] / 1e6:.1f}M per tenant; "
        f"float32 weights: one prefix + {result['tenants']} experts {result['memory_shared_bytes'] / gib:.2f} GiB vs "
        f"{result['tenants']} whole policies {result['memory_whole_policies_bytes'] / gib:.2f} GiB "
        f"({result['memory_whole_policies_bytes'] / result['memory_shared_bytes']:.2f}x)"
    )
    extra, whole = result["extra_tenant_bytes"], result["extra_policy_bytes"]
    print(
        f"  memory per extra tenant: float32 {extra['float32'] / gib:.3f} GiB, "
        f"bfloat16 {extra['bfloat16'] / gib:.3f} GiB "
        f"(a whole policy each: {whole['float32'] / gib:.2f} / {whole['bfloat16'] / gib:.2f} GiB)"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("smolvla", "pi0", "pi05"), default="smolvla")
    parser.add_argument("--preset", default=None, help="default: smolvlm-500m (SmolVLA) / paligemma-3b (π0, π0.5)")
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=16, help="num_vlm_layers (SmolVLA: 16)")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=50)
    parser.add_argument("--steps", type=int, default=10, help="Euler steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny backbone, 2 layers, 2 tenants (a smoke run)")
    args = parser.parse_args(argv)
    pi = args.family in ("pi0", "pi05")
    if args.preset is None:
        args.preset = "paligemma-3b" if pi else "smolvlm-500m"
    if args.quick:
        args.preset = "paligemma-tiny" if pi else "tiny"
        args.image_size, args.layers, args.tenants, args.repeats, args.chunk = None, 2, 2, 2, 4
    result = run(args)
    report(result)
    return result


if __name__ == "__main__":
    main()
