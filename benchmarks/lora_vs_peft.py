"""Our grouped LoRA forward against the stock PEFT one, side by side in one run (issue 46.3).

  .venv/bin/python benchmarks/lora_vs_peft.py [--preset tiny|small|smolvlm-256m] [--adapters 8]
                                              [--rows 4] [--rank 8] [--repeats 5] [--quick]

One frozen SmolVLM-class model (a random-weight preset of the backbone, one 32x32 camera and an
instruction per sample), `--adapters` LoRA adapters of the same rank and targets (the text model's
q/k/v/o projections), the same weights in both paths (ours copied into PEFT's), the same samples:
`--rows` per adapter, one mixed batch of adapters x rows.

- stock: `peft.get_peft_model` on a copy of the same Hugging Face model, one adapter per tenant
  (`add_adapter`), and PEFT's mixed-adapter forward `model(..., adapter_names=[one per sample])`
  on inputs built once outside the timed region (stock gets its token ids and pixels for free);
- ours: `Backbone.encode(images, instructions, adapters=[tenant per sample])` (`joynexus.models
  .adapters`: peft's LoRA layers routed by forward pre-hooks), which also builds the prompts and
  pixels, runs the vision tower on real camera slots only, and returns masked, pooled features.

Each path is timed mixed (one forward of every adapter's rows) and one adapter at a time (a forward
per adapter over its own rows); the speed-up = one-at-a-time / mixed. Heads off: the backbone
forward only. With heads: then each tenant's own oft_mlp head predicts on its rows (the same heads,
the same features' shapes, in both paths). Timings are medians of `--repeats` interleaved repeats
(the two paths alternate, so load drifts hit both). The features of the two paths are compared
(max |diff|) to show they compute the same thing.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from joynexus.models.action_modules import ActionModuleConfig, build_action_module  # noqa: E402
from joynexus.models.adapters import LoraAdapterConfig  # noqa: E402
from joynexus.models.backbone import BackboneFeatures, BackboneSource  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
INSTRUCTIONS = ("pick up the cube", "push the block to the goal", "open the top drawer and put the cup inside")


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build(preset: str, adapters: int, rank: int, seed: int):
    """Our backbone with `adapters` random (non-zero) adapters, and the stock PEFT model over a copy
    of the same Hugging Face model with the same adapter weights."""
    from peft import get_peft_model

    torch.manual_seed(seed)
    backbone = BackboneSource(preset=preset).build()
    stock_base = copy.deepcopy(backbone.model)  # before any adapter is injected into ours
    config = LoraAdapterConfig(rank=rank, alpha=2.0 * rank, target_modules=TARGETS)
    keys = [f"tenant-{i}" for i in range(adapters)]
    for i, key in enumerate(keys):
        backbone.adapters.add(key, config, seed=seed + i)
        # peft starts B at zero (a no-op adapter); a trained adapter is not one.
        state = {k: v + 0.02 * torch.randn_like(v) for k, v in backbone.adapters.state_dict(key).items()}
        backbone.adapters.load_state_dict(key, state)
    # The text model's projections only (the vision tower has q/k/v projections too; ours has no adapter there).
    peft_config = config.peft_config()
    peft_config.target_modules = rf".*text_model.*\.({'|'.join(TARGETS)})"
    stock = get_peft_model(stock_base, peft_config, adapter_name="a0")
    for i in range(1, adapters):
        stock.add_adapter(f"a{i}", peft_config)
    with torch.no_grad():
        params = dict(stock.named_parameters())
        for i, key in enumerate(keys):
            for name, value in backbone.adapters.state_dict(key).items():
                # ours: layers.0.self_attn.q_proj.lora_A.weight; peft's: ...text_model.layers.0...lora_A.a0.weight
                head, kind, leaf = name.rsplit(".", 2)
                params[f"base_model.model.text_model.{head}.{kind}.a{i}.{leaf}"].copy_(value)
    stock.eval()
    return backbone, stock, keys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="backbone preset (tiny, small, smolvlm-256m, ...)")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4, help="samples per adapter")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny preset, 4 adapters x 2 rows, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.adapters, args.rows, args.repeats = "tiny", 4, 2, 3
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    backbone, stock, keys = build(args.preset, args.adapters, args.rank, args.seed)
    n = args.adapters * args.rows
    gen = torch.Generator().manual_seed(args.seed)
    images = [[torch.rand(3, 32, 32, generator=gen)] for _ in range(n)]
    instructions = [INSTRUCTIONS[i % len(INSTRUCTIONS)] for i in range(n)]
    owner = [keys[i // args.rows] for i in range(n)]
    rows = {key: list(range(k * args.rows, (k + 1) * args.rows)) for k, key in enumerate(keys)}
    states = torch.randn(n, 4, generator=gen)
    heads = {
        key: build_action_module(
            ActionModuleConfig(kind="oft_mlp", feature_dim=backbone.hidden_size, state_dim=4, action_dim=3,
                               action_chunk=2, size="tiny")
        ).eval()
        for key in keys
    }  # fmt: skip

    # The stock model's inputs, built once (the backbone's own prompt and pixel layout, so that both
    # paths see the same tokens and images).
    input_ids, attention_mask = backbone._input_ids(images, instructions)
    pixels, _ = backbone._canonicalize(images)
    stock_names = [f"a{keys.index(key)}" for key in owner]

    def stock_forward(index: list[int]) -> BackboneFeatures:
        with torch.inference_mode():
            out = stock(
                input_ids=input_ids[index], attention_mask=attention_mask[index], pixel_values=pixels[index],
                adapter_names=[stock_names[i] for i in index], use_cache=False, return_dict=True,
            )  # fmt: skip
            mask = attention_mask[index].bool()
            tokens = out.last_hidden_state.float() * mask.unsqueeze(-1)
            return BackboneFeatures(tokens, mask, tokens.sum(1) / mask.sum(1, keepdim=True))

    def ours_forward(index: list[int]) -> BackboneFeatures:
        return backbone.encode([images[i] for i in index], [instructions[i] for i in index], [owner[i] for i in index])

    def with_heads(forward: Callable[[list[int]], BackboneFeatures], one_at_a_time: bool) -> None:
        with torch.inference_mode():
            if one_at_a_time:
                for key, index in rows.items():
                    heads[key].predict(forward(index), states[index])
                return
            features = forward(list(range(n)))
            for key, index in rows.items():
                heads[key].predict(features.select(index).trimmed(), states[index])

    def heads_off(forward: Callable[[list[int]], BackboneFeatures], one_at_a_time: bool) -> None:
        if one_at_a_time:
            for index in rows.values():
                forward(index)
        else:
            forward(list(range(n)))

    everyone = list(range(n))
    diff = (stock_forward(everyone).tokens - ours_forward(everyone).tokens).abs().max().item()
    base = backbone.encode(images, instructions, [None] * n).tokens
    moved = (ours_forward(everyone).tokens - base).abs().max().item()
    print(f"LoRA: {args.adapters} adapters (rank {args.rank}, {', '.join(TARGETS)}) x {args.rows} rows on "
          f"{backbone.model_id} ({args.preset}, hidden {backbone.hidden_size}); {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
    print(f"features stock vs ours: max |diff| {diff:.2e} (the adapters move them by up to {moved:.2e})")

    table = {}
    for label, run in (("heads off", heads_off), ("with heads", with_heads)):
        for _ in range(3):  # warm-up: the first calls of each shape run several times slower (kernel choice, caches)
            for forward in (stock_forward, ours_forward):
                run(forward, False), run(forward, True)
        timings: dict[tuple[str, bool], list[float]] = {}
        for _ in range(args.repeats):  # interleaved: both paths see the same load drift
            for path, forward in (("stock PEFT", stock_forward), ("ours", ours_forward)):
                for serial in (False, True):
                    timings.setdefault((path, serial), []).append(_median_s(lambda f=forward, s=serial: run(f, s), 1))
        table[label] = {
            path: (statistics.median(timings[(path, False)]), statistics.median(timings[(path, True)]))
            for path in ("stock PEFT", "ours")
        }
    print(
        f"\n{'':<12}{'path':<12}{'mixed ms':>10}{'1-at-a-time ms':>16}{'speed-up':>10}{'ours / stock (mixed time)':>28}"
    )
    for label, paths in table.items():
        stock_mixed = paths["stock PEFT"][0]
        for path, (mixed, serial) in paths.items():
            relative = f"{mixed / stock_mixed:.2f}x" if path == "ours" else ""
            print(f"{label:<12}{path:<12}{1000 * mixed:10.1f}{1000 * serial:16.1f}{serial / mixed:9.2f}x{relative:>28}")
    ours_off, stock_off = table["heads off"]["ours"], table["heads off"]["stock PEFT"]
    print(f"\nheads off: speed-up ours {ours_off[1] / ours_off[0]:.2f}x vs stock {stock_off[1] / stock_off[0]:.2f}x; "
          f"mixed forward ours / stock {ours_off[0] / stock_off[0]:.2f}x the time")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
