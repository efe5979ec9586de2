"""LeRobot SmolVLA checkpoints in and out of a JoyNexus tenant.

In: `models.action_modules.smolvla_checkpoint` reads a ``SmolVLAPolicy.save_pretrained`` directory;
`lerobot_normalizer` makes its processor's statistics the tenant's `Normalizer`.

Out: a directory ``SmolVLAPolicy.from_pretrained`` loads with LeRobot's own processor pipelines: its
config (the tenant's real feature shapes), the full state dict (the resident VLM's prefix layers +
the tenant's module) and the pipelines made by LeRobot's ``make_smolvla_pre_post_processors`` with
the tenant's statistics. LeRobot builds SmolVLA over ``vlm_model_name``, a VLM directory; the export
carries the backbone's own as ``vlm/`` and names it by absolute path, so it loads without a hub.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from joynexus.data.normalization import Normalizer
from joynexus.models.action_modules.smolvla_checkpoint import (
    LEROBOT_VLM_PREFIX,
    SHARED_FIELDS,
    LeRobotSmolVLA,
    expert_name,
)
from joynexus.models.backbone.layer_prefix import prefix_weight_names

__all__ = ["VLM_DIR", "build_lerobot_smolvla_checkpoint", "lerobot_normalizer", "write_lerobot_smolvla"]

VLM_DIR = "vlm"


def lerobot_normalizer(checkpoint: LeRobotSmolVLA) -> Normalizer | None:
    """The tenant's normalizer: the checkpoint's processor statistics under its config's modes."""
    return Normalizer.from_lerobot_checkpoint(checkpoint)


def write_lerobot_smolvla(
    out_dir: str | Path,
    module: torch.nn.Module,
    backbone: Any,
    *,
    camera_keys: Sequence[str],
    normalizer: Normalizer | None,
    vlm_dir: str | Path | None = None,
    device: str = "cpu",
) -> Path:
    """Write a tenant's SmolVLA module over ``backbone`` as a LeRobot policy directory (module
    docstring), beside whatever ``out_dir`` already holds (JoyNexus's own export files).
    ``camera_keys``: LeRobot camera keys in the tenant's slot order; ``vlm_dir``: the backbone's
    directory when the caller saved it already (else it is saved as ``vlm/``)."""
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig as LeRobotSmolVLAConfig
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

    cfg = module.config
    root = Path(out_dir).expanduser()
    if (root / "config.json").exists():
        raise FileExistsError(f"export directory {str(root)!r} already holds a config.json")
    root.mkdir(parents=True, exist_ok=True)
    if vlm_dir is None:
        vlm_dir = root / VLM_DIR
        backbone.save_pretrained(vlm_dir)
    vlm_dir = Path(vlm_dir)
    # SmolVLA resizes every camera (with padding) to resize_imgs_with_padding: the shapes it declares.
    width, height = cfg.resize_imgs_with_padding or (backbone.image_size, backbone.image_size)
    inputs = {key: PolicyFeature(FeatureType.VISUAL, (3, height, width)) for key in camera_keys}
    if cfg.state_dim:
        inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (cfg.state_dim,))
    modes = dict(normalizer.modes) if normalizer is not None else {"STATE": "IDENTITY", "ACTION": "IDENTITY"}
    lerobot_config = LeRobotSmolVLAConfig(
        input_features=inputs,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (cfg.action_dim,))},
        chunk_size=cfg.action_chunk,
        n_action_steps=cfg.action_chunk,
        vlm_model_name=str(vlm_dir.resolve()),
        load_vlm_weights=False,  # from_pretrained loads every weight from model.safetensors
        resize_imgs_with_padding=cfg.resize_imgs_with_padding,
        normalization_mapping={
            "VISUAL": NormalizationMode.IDENTITY,
            "STATE": NormalizationMode(modes.get("STATE", "IDENTITY")),
            "ACTION": NormalizationMode(modes.get("ACTION", "IDENTITY")),
        },
        device=device,
        **{name: getattr(cfg, name) for name in SHARED_FIELDS},
    )
    lerobot_config.validate_features()
    lerobot_config._save_pretrained(root)
    state = {LEROBOT_VLM_PREFIX + name: t for name, t in _vlm_prefix_state(backbone, cfg.num_vlm_layers).items()}
    for name, tensor in module.state_dict().items():
        state[expert_name(name)] = tensor
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(root / "model.safetensors"))
    stats = None
    if normalizer is not None and normalizer.stats:
        stats = {key: {k: torch.tensor(v) for k, v in entry.items()} for key, entry in normalizer.stats.items()}
    pre, post = make_smolvla_pre_post_processors(lerobot_config, dataset_stats=stats)
    pre.save_pretrained(root)
    post.save_pretrained(root)
    return root


def _vlm_prefix_state(backbone: Any, num_layers: int) -> dict[str, torch.Tensor]:
    """The resident VLM's weights a truncated LeRobot VLM holds (the first layers, not the rest)."""
    base = backbone.base_state_dict()
    kept = set(prefix_weight_names(list(base), num_layers))
    kept.update(n for n in base if n.startswith("text_model.norm."))
    return {name: base[name] for name in sorted(kept)}


def build_lerobot_smolvla_checkpoint(
    out_dir: str | Path,
    backbone: Any,
    *,
    camera_shapes: Mapping[str, Sequence[int]],
    state_dim: int,
    action_dim: int,
    stats: Mapping[str, Mapping[str, Sequence[float]]] | None = None,
    seed: int = 0,
    **smolvla_fields: Any,
) -> Path:
    """A SmolVLA policy directory as a lab brings one, made by LeRobot's own classes: a
    ``SmolVLAPolicy`` over ``backbone`` (saved as its ``vlm_model_name`` directory, its weights
    copied into the policy's VLM), the expert drawn from ``seed``, saved with ``save_pretrained``
    and LeRobot's processor pipelines. For tests, demos and benchmarks (no hub here)."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig as LeRobotSmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

    root = Path(out_dir).expanduser()
    vlm_dir = root / VLM_DIR
    backbone.save_pretrained(vlm_dir)
    inputs = {key: PolicyFeature(FeatureType.VISUAL, tuple(shape)) for key, shape in camera_shapes.items()}
    if state_dim:
        inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (state_dim,))
    fields = {"device": "cpu", "load_vlm_weights": False, **smolvla_fields}
    config = LeRobotSmolVLAConfig(
        input_features=inputs,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (action_dim,))},
        vlm_model_name=str(vlm_dir.resolve()),
        **fields,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = SmolVLAPolicy(config)
    vlm = policy.model.vlm_with_expert.get_vlm_model()
    missing, unexpected = vlm.load_state_dict(_vlm_prefix_state(backbone, config.num_vlm_layers), strict=False)
    if unexpected:
        raise ValueError(f"the backbone's weights do not fit LeRobot's SmolVLM: unexpected {unexpected[:3]}")
    policy.save_pretrained(root)
    tensor_stats = None
    if stats is not None:
        tensor_stats = {
            k: {s: torch.tensor(list(v), dtype=torch.float32) for s, v in e.items()} for k, e in stats.items()
        }
    pre, post = make_smolvla_pre_post_processors(config, dataset_stats=tensor_stats)
    pre.save_pretrained(root)
    post.save_pretrained(root)
    return root
