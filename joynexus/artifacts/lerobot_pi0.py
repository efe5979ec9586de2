"""LeRobot π0 / π0.5 checkpoints in and out of a JoyNexus tenant.

In: `models.action_modules.pi0_checkpoint` reads a ``PI0Policy`` / ``PI05Policy.save_pretrained``
directory; its processor statistics become the tenant's `Normalizer` (`lerobot_pi0_normalizer`).

Out (`write_lerobot_pi0`): a directory ``PI0Policy.from_pretrained`` / ``PI05Policy.from_pretrained``
loads: LeRobot's config (the tenant's real feature shapes, the Gemma variants its shapes are), the
full state dict (the resident PaliGemma + the tenant's expert and projections; the expert's unused
``lm_head`` is written as zeros, since LeRobot's strict load wants it and nothing reads it; the tied
token embeddings under both their names, for the same reason), and
LeRobot's own processor pipelines with the tenant's statistics, their tokenizer the backbone's
(saved as ``paligemma/``: there is no hub here).

`build_lerobot_pi0_checkpoint` makes a lab-style checkpoint with LeRobot's own classes, for tests,
demos and benchmarks; LeRobot's classes need openpi's patched transformers (`openpi_transformers`),
and a size that is not a published Gemma variant is registered in LeRobot's variant table for the
duration (`lerobot_variants`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from safetensors.torch import save_file

from joynexus.data.normalization import Normalizer
from joynexus.models.action_modules.pi0 import GEMMA_VARIANTS
from joynexus.models.action_modules.pi0_checkpoint import LEROBOT_PALIGEMMA_PREFIX, LeRobotPI0, pi0_expert_name

__all__ = [
    "TOKENIZER_DIR",
    "build_lerobot_pi0_checkpoint",
    "gemma_shape",
    "lerobot_pi0_normalizer",
    "lerobot_variants",
    "variant_of",
    "write_lerobot_pi0",
]

TOKENIZER_DIR = "paligemma"


def _lerobot(kind: str) -> tuple[Any, Any, Any, Any]:
    """(modeling module, config class, policy class, processor factory) of LeRobot's ``kind``."""
    if kind == "pi0":
        from lerobot.policies.pi0 import modeling_pi0 as modeling
        from lerobot.policies.pi0 import processor_pi0 as processor
        from lerobot.policies.pi0.configuration_pi0 import PI0Config

        return modeling, PI0Config, modeling.PI0Policy, processor
    if kind == "pi05":
        from lerobot.policies.pi05 import modeling_pi05 as modeling
        from lerobot.policies.pi05 import processor_pi05 as processor
        from lerobot.policies.pi05.configuration_pi05 import PI05Config

        return modeling, PI05Config, modeling.PI05Policy, processor
    raise ValueError(f"kind={kind!r} is not a LeRobot π0 family (pi0, pi05)")


def gemma_shape(text_config: Any) -> tuple[int, int, int, int, int, int]:
    """A Gemma config as LeRobot's variant fields: (width, depth, mlp_dim, heads, kv_heads, head_dim)."""
    c = text_config
    return (
        c.hidden_size,
        c.num_hidden_layers,
        c.intermediate_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
    )


def variant_of(width: int, mlp_dim: int, depth: int, heads: int, kv_heads: int, head_dim: int) -> str:
    """The LeRobot Gemma variant name of a shape; an unpublished shape is refused naming the variants."""
    shape = (width, depth, mlp_dim, heads, kv_heads, head_dim)
    for name, variant in GEMMA_VARIANTS.items():
        if variant == shape:
            return name
    raise ValueError(
        f"(width, depth, mlp_dim, heads, kv_heads, head_dim)={shape} is no LeRobot Gemma variant "
        f"({', '.join(f'{n}: {v}' for n, v in GEMMA_VARIANTS.items())}); LeRobot's π0 cannot load it"
    )


@contextlib.contextmanager
def lerobot_variants(kind: str, vlm: Sequence[int], expert: Sequence[int], paligemma_config: Any) -> Iterator[None]:
    """Register a small ``gemma_2b`` (the VLM) and ``gemma_300m`` (the expert) in LeRobot's and our
    variant tables, and have LeRobot build its PaliGemma from ``paligemma_config`` (a small vision
    tower), for the block: the published sizes do not fit a test."""
    from transformers import PaliGemmaForConditionalGeneration

    modeling = _lerobot(kind)[0]
    small = {"gemma_2b": tuple(vlm), "gemma_300m": tuple(expert)}

    def gemma_config(variant: str) -> Any:
        return modeling.GemmaConfig(*small[variant]) if variant in small else original(variant)

    def paligemma(config: Any) -> Any:
        ours = paligemma_config.__class__.from_dict(paligemma_config.to_dict())
        ours.text_config.use_adarms, ours.text_config.adarms_cond_dim = False, None
        return PaliGemmaForConditionalGeneration(ours)

    original = modeling.get_gemma_config
    with (
        mock.patch.object(modeling, "get_gemma_config", gemma_config),
        mock.patch.object(modeling, "PaliGemmaForConditionalGeneration", paligemma),
        mock.patch.dict(GEMMA_VARIANTS, small),
    ):
        yield


def lerobot_pi0_normalizer(checkpoint: LeRobotPI0) -> Normalizer | None:
    """The tenant's normalizer: the checkpoint's processor statistics under its config's modes."""
    return Normalizer.from_lerobot_checkpoint(checkpoint)


def _features(camera_keys: Sequence[str], resolution: int, state_dim: int, action_dim: int) -> tuple[dict, dict]:
    from lerobot.configs.types import FeatureType, PolicyFeature

    inputs = {key: PolicyFeature(FeatureType.VISUAL, (3, resolution, resolution)) for key in camera_keys}
    if state_dim:
        inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (state_dim,))
    return inputs, {"action": PolicyFeature(FeatureType.ACTION, (action_dim,))}


def _save_processors(kind: str, config: Any, root: Path, tokenizer_dir: Path, stats: Mapping | None) -> None:
    """LeRobot's own pipelines of ``kind``, their tokenizer read from ``tokenizer_dir`` (not the hub)."""
    processor = _lerobot(kind)[3]
    step = processor.TokenizerProcessorStep

    def local_tokenizer(**fields: Any) -> Any:
        return step(**{**fields, "tokenizer_name": str(tokenizer_dir.resolve())})

    tensor_stats = None
    if stats:
        tensor_stats = {
            k: {s: torch.tensor(list(v), dtype=torch.float32) for s, v in e.items()} for k, e in stats.items()
        }
    factory = processor.make_pi0_pre_post_processors if kind == "pi0" else processor.make_pi05_pre_post_processors
    with mock.patch.object(processor, "TokenizerProcessorStep", local_tokenizer):
        pre, post = factory(config, dataset_stats=tensor_stats)
    pre.save_pretrained(root)
    post.save_pretrained(root)


def _lerobot_config(kind: str, module_config: Any, inputs: dict, outputs: dict, modes: Mapping[str, str], **more: Any):
    from lerobot.configs.types import NormalizationMode

    cfg = module_config
    config_class = _lerobot(kind)[1]
    return config_class(
        input_features=inputs,
        output_features=outputs,
        chunk_size=cfg.action_chunk,
        n_action_steps=cfg.action_chunk,
        num_inference_steps=cfg.num_steps,
        max_state_dim=cfg.max_state_dim,
        max_action_dim=cfg.max_action_dim,
        tokenizer_max_length=cfg.tokenizer_max_length,
        image_resolution=(cfg.image_resolution, cfg.image_resolution),
        min_period=cfg.min_period,
        max_period=cfg.max_period,
        dtype="float32",
        train_expert_only=True,
        normalization_mapping={
            "VISUAL": NormalizationMode.IDENTITY,
            "STATE": NormalizationMode(modes.get("STATE", "MEAN_STD")),
            "ACTION": NormalizationMode(modes.get("ACTION", "MEAN_STD")),
        },
        **more,
    )


def write_lerobot_pi0(
    out_dir: str | Path,
    module: torch.nn.Module,
    backbone: Any,
    *,
    camera_keys: Sequence[str],
    normalizer: Normalizer | None,
    device: str = "cpu",
) -> Path:
    """Write a tenant's pi0 / pi05 module over ``backbone`` as a LeRobot policy directory (module
    docstring), beside whatever ``out_dir`` already holds."""
    cfg, kind = module.config, module.kind
    root = Path(out_dir).expanduser()
    if (root / "config.json").exists():
        raise FileExistsError(f"export directory {str(root)!r} already holds a config.json")
    geometry = backbone.prefix_geometry
    shape = (geometry.num_heads, geometry.num_kv_heads, geometry.head_dim)
    paligemma_variant = variant_of(
        geometry.hidden_size, backbone.model.config.text_config.intermediate_size, cfg.vlm_depth, *shape
    )
    expert_variant = variant_of(cfg.expert_width, cfg.expert_mlp_dim, cfg.vlm_depth, *shape)
    root.mkdir(parents=True, exist_ok=True)
    backbone.tokenizer.save_pretrained(root / TOKENIZER_DIR)
    modes = dict(normalizer.modes) if normalizer is not None else {"STATE": "IDENTITY", "ACTION": "IDENTITY"}
    inputs, outputs = _features(camera_keys, cfg.image_resolution, cfg.state_dim, cfg.action_dim)
    config = _lerobot_config(
        kind,
        cfg,
        inputs,
        outputs,
        modes,
        paligemma_variant=paligemma_variant,
        action_expert_variant=expert_variant,
        device=device,
    )
    config.validate_features()
    config._save_pretrained(root)
    base = backbone.base_state_dict()
    embed, head = base.get("model.language_model.embed_tokens.weight"), base.get("lm_head.weight")
    if embed is not None and head is not None and embed.data_ptr() == head.data_ptr():
        # Tied, but written under both names: LeRobot's strict load wants both (its own save keeps one
        # and then fails to load it back).
        base["lm_head.weight"] = head.clone()
    state = {LEROBOT_PALIGEMMA_PREFIX + name: t for name, t in base.items()}
    for name, tensor in module.state_dict().items():
        if name != "log_std":  # the RL step std is ours; LeRobot's π0 has none
            state[pi0_expert_name(name)] = tensor
    vocab = backbone.model.config.text_config.vocab_size
    state[pi0_expert_name("gemma_expert.lm_head.weight")] = torch.zeros(vocab, cfg.expert_width)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(root / "model.safetensors"))
    _save_processors(kind, config, root, root / TOKENIZER_DIR, normalizer.stats if normalizer is not None else None)
    return root


def build_lerobot_pi0_checkpoint(
    out_dir: str | Path,
    backbone: Any,
    *,
    kind: str,
    camera_keys: Sequence[str],
    state_dim: int,
    action_dim: int,
    expert: Sequence[int],
    stats: Mapping[str, Mapping[str, Sequence[float]]] | None = None,
    seed: int = 0,
    **fields: Any,
) -> Path:
    """A π0 / π0.5 policy directory as a lab brings one, made by LeRobot's own classes: a
    ``PI0Policy`` / ``PI05Policy`` over ``backbone``'s PaliGemma (its weights copied in; train-expert-only
    fine-tuning keeps them), the expert (``expert``: width, depth, mlp_dim, heads, kv_heads, head_dim)
    drawn from ``seed``, saved with ``save_pretrained`` and LeRobot's processor pipelines."""
    from joynexus.artifacts.openpi_transformers import openpi_transformers

    vlm = gemma_shape(backbone.model.config.text_config)
    root = Path(out_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    backbone.tokenizer.save_pretrained(root / TOKENIZER_DIR)
    _, config_class, policy_class, _ = _lerobot(kind)
    inputs, outputs = _features(camera_keys, backbone.image_size, state_dim, action_dim)
    resolution = (backbone.image_size, backbone.image_size)
    config = config_class(
        input_features=inputs,
        output_features=outputs,
        image_resolution=resolution,
        dtype="float32",
        train_expert_only=True,
        device="cpu",
        **fields,
    )
    with openpi_transformers(), lerobot_variants(kind, vlm, expert, backbone.model.config):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            policy = policy_class(config)
        policy.model.paligemma_with_expert.paligemma.load_state_dict(backbone.base_state_dict())
        policy.save_pretrained(root)
    _restore_tied_embeddings(root / "model.safetensors")
    _save_processors(kind, config, root, root / TOKENIZER_DIR, stats)
    return root


def _restore_tied_embeddings(weights_file: Path) -> None:
    """Write PaliGemma's tied token embeddings under their own name too: published π0 checkpoints
    carry both, and LeRobot 0.4.4's ``save_pretrained`` keeps one, after which its own strict
    ``from_pretrained`` fails (and silently returns random weights)."""
    from safetensors.torch import load_file

    state = load_file(str(weights_file))
    embed = LEROBOT_PALIGEMMA_PREFIX + "model.language_model.embed_tokens.weight"
    head = LEROBOT_PALIGEMMA_PREFIX + "lm_head.weight"
    if embed not in state and head in state:
        state[embed] = state[head].clone()
        save_file(state, str(weights_file), {"format": "pt"})
