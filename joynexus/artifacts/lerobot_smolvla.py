"""LeRobot SmolVLA checkpoints in and out of a JoyNexus tenant.

In: a directory written by ``SmolVLAPolicy.save_pretrained`` (``config.json`` of type ``smolvla``,
``model.safetensors``) with its processor pipelines (``policy_preprocessor.json`` and the
normalizer's state file). Its VLM part must be the resident backbone's prefix (checked by the
digest of the weights the prefix reads); the expert and projections become the tenant's initial
version under their own names; the normalizer's statistics become the tenant's `Normalizer`.
Reading needs no lerobot import: the files are JSON and safetensors.

Out: a directory ``SmolVLAPolicy.from_pretrained`` loads with LeRobot's own processor pipelines: its
config (the tenant's real feature shapes), the full state dict (the resident VLM's prefix layers +
the tenant's module) and the pipelines made by LeRobot's ``make_smolvla_pre_post_processors`` with
the tenant's statistics. LeRobot builds SmolVLA over ``vlm_model_name``, a VLM directory; the export
carries the backbone's own as ``vlm/`` and names it by absolute path, so it loads without a hub.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from joynexus.data.normalization import Normalizer
from joynexus.models.backbone.layer_prefix import prefix_weights_digest

__all__ = [
    "LEROBOT_VLM_PREFIX",
    "LeRobotSmolVLA",
    "VLM_DIR",
    "build_lerobot_smolvla_checkpoint",
    "read_lerobot_smolvla",
    "write_lerobot_smolvla",
]

LEROBOT_VLM_PREFIX = "model.vlm_with_expert.vlm.model."  # the VLM's own names follow it
_EXPERT_PREFIX = "model.vlm_with_expert.lm_expert."
_PROJECTIONS = ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")
VLM_DIR = "vlm"
# SmolVLAConfig fields our module config takes under the same name.
_SHARED_FIELDS = (
    "max_state_dim",
    "max_action_dim",
    "num_steps",
    "num_vlm_layers",
    "num_expert_layers",
    "self_attn_every_n_layers",
    "expert_width_multiplier",
    "attention_mode",
    "min_period",
    "max_period",
    "tokenizer_max_length",
    "add_image_special_tokens",
)


class LeRobotCheckpointError(ValueError):
    """A LeRobot policy directory that cannot become a tenant; the message names the file or field."""


@dataclass(frozen=True)
class LeRobotSmolVLA:
    """What a SmolVLA policy directory holds, in JoyNexus terms."""

    config: dict[str, Any]  # LeRobot's config.json
    module_state: dict[str, torch.Tensor]  # the tenant-private tensors, under the module's names
    vlm_state: dict[str, torch.Tensor]  # the VLM part, under the VLM's own names
    camera_keys: list[str]
    state_dim: int
    action_dim: int
    stats: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def module_config_fields(self) -> dict[str, Any]:
        """The smolvla module config's SmolVLA fields, from LeRobot's config."""
        fields = {name: self.config[name] for name in _SHARED_FIELDS if name in self.config}
        resize = self.config.get("resize_imgs_with_padding")
        fields["resize_imgs_with_padding"] = tuple(resize) if resize else None
        fields["action_chunk"] = int(self.config["chunk_size"])
        return fields

    def vlm_digest(self) -> str:
        return prefix_weights_digest(self.vlm_state, int(self.config.get("num_vlm_layers", 16)))

    def normalizer(self) -> Normalizer | None:
        modes = {k: str(v) for k, v in (self.config.get("normalization_mapping") or {}).items()}
        if not self.stats:
            return None
        dims = {"STATE": self.state_dim, "ACTION": self.action_dim}
        return Normalizer.from_stats(modes, self.stats, dims, source="lerobot-processor")


def read_lerobot_smolvla(path: str | Path) -> LeRobotSmolVLA:
    """Read a SmolVLA policy directory (module docstring); errors name the file and what is wrong."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise LeRobotCheckpointError(f"LeRobot policy directory {str(root)!r} does not exist")
    config_file, weights_file = root / "config.json", root / "model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise LeRobotCheckpointError(f"LeRobot policy directory {str(root)!r} has no {needed.name}")
    config = json.loads(config_file.read_text())
    if config.get("type") != "smolvla":
        raise LeRobotCheckpointError(f"config.json: type={config.get('type')!r}, expected 'smolvla'")
    features = config.get("input_features") or {}
    camera_keys = [k for k, f in features.items() if f.get("type") == "VISUAL"]
    state = features.get("observation.state")
    action = (config.get("output_features") or {}).get("action")
    if action is None:
        raise LeRobotCheckpointError("config.json: output_features has no 'action'")
    weights = load_file(str(weights_file))
    module_state: dict[str, torch.Tensor] = {}
    vlm_state: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.startswith(LEROBOT_VLM_PREFIX):
            vlm_state[name[len(LEROBOT_VLM_PREFIX) :]] = tensor
        elif name.startswith(_EXPERT_PREFIX):
            module_state["lm_expert." + name[len(_EXPERT_PREFIX) :]] = tensor
        elif name.startswith("model.") and name.split(".")[1] in _PROJECTIONS:
            module_state[name[len("model.") :]] = tensor
    if not any(k.startswith("lm_expert.") for k in module_state):
        raise LeRobotCheckpointError("model.safetensors: no action expert weights (model.vlm_with_expert.lm_expert.*)")
    return LeRobotSmolVLA(
        config=config,
        module_state=module_state,
        vlm_state=vlm_state,
        camera_keys=camera_keys,
        state_dim=int(state["shape"][0]) if state else 0,
        action_dim=int(action["shape"][0]),
        stats=_processor_stats(root),
    )


def _processor_stats(root: Path) -> dict[str, dict[str, list[float]]]:
    """The normalizer step's statistics of ``policy_preprocessor.json`` (feature -> stat -> values)."""
    pipeline = root / "policy_preprocessor.json"
    if not pipeline.is_file():
        return {}
    steps = json.loads(pipeline.read_text()).get("steps", [])
    for step in steps:
        if step.get("registry_name") == "normalizer_processor" and step.get("state_file"):
            flat = load_file(str(root / step["state_file"]))
            stats: dict[str, dict[str, list[float]]] = {}
            for name, tensor in flat.items():
                feature, stat = name.rsplit(".", 1)
                stats.setdefault(feature, {})[stat] = [float(v) for v in tensor.reshape(-1)]
            return stats
    return {}


def write_lerobot_smolvla(
    out_dir: str | Path,
    module: torch.nn.Module,
    backbone: Any,
    *,
    camera_shapes: Mapping[str, Sequence[int]],
    normalizer: Normalizer | None,
    device: str = "cpu",
) -> Path:
    """Write a tenant's SmolVLA module over ``backbone`` as a LeRobot policy directory (module
    docstring). ``camera_shapes``: LeRobot camera key -> the tenant's (3, H, W), in slot order."""
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig as LeRobotSmolVLAConfig
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

    cfg = module.config
    root = Path(out_dir).expanduser()
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"export directory {str(root)!r} exists and is not empty")
    root.mkdir(parents=True, exist_ok=True)
    vlm_dir = root / VLM_DIR
    backbone.save_pretrained(vlm_dir)
    inputs = {key: PolicyFeature(FeatureType.VISUAL, tuple(shape)) for key, shape in camera_shapes.items()}
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
        **{name: getattr(cfg, name) for name in _SHARED_FIELDS},
    )
    lerobot_config._save_pretrained(root)
    state = {LEROBOT_VLM_PREFIX + name: t for name, t in _vlm_prefix_state(backbone, cfg.num_vlm_layers).items()}
    for name, tensor in module.state_dict().items():
        prefix = _EXPERT_PREFIX + name[len("lm_expert.") :] if name.startswith("lm_expert.") else "model." + name
        state[prefix] = tensor
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
    from joynexus.models.backbone.layer_prefix import prefix_weight_names

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
