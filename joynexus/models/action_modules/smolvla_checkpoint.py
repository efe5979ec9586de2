"""Reading a LeRobot SmolVLA policy directory (``SmolVLAPolicy.save_pretrained`` + its processor
pipelines) into the ``smolvla`` kind's terms, without importing lerobot: the files are JSON and
safetensors. `read_lerobot_smolvla_config` reads no weights (the Master compiles a tenant from it);
`load_expert_state` is what the Training Model Service loads when it builds the tenant's slot.
Writing one: `joynexus.artifacts.lerobot_smolvla`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "LEROBOT_VLM_PREFIX",
    "LeRobotCheckpointError",
    "LeRobotSmolVLA",
    "SHARED_FIELDS",
    "expert_name",
    "load_expert_state",
    "processor_stats",
    "read_policy_config",
    "read_lerobot_smolvla",
]

LEROBOT_VLM_PREFIX = "model.vlm_with_expert.vlm.model."  # the VLM's own names follow it
_EXPERT_PREFIX = "model.vlm_with_expert.lm_expert."
_PROJECTIONS = ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")
# SmolVLAConfig fields our module config takes under the same name.
SHARED_FIELDS = (
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
    module_state: dict[str, Any]  # the tenant-private tensors, under the module's names (None: not read)
    vlm_state: dict[str, Any]  # the VLM part, under the VLM's own names
    camera_keys: list[str]
    state_dim: int
    action_dim: int
    stats: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def module_config_fields(self) -> dict[str, Any]:
        """The smolvla module config's SmolVLA fields, from LeRobot's config."""
        fields = {name: self.config[name] for name in SHARED_FIELDS if name in self.config}
        resize = self.config.get("resize_imgs_with_padding")
        fields["resize_imgs_with_padding"] = tuple(resize) if resize else None
        fields["action_chunk"] = int(self.config["chunk_size"])
        return fields

    def vlm_digest(self) -> str:
        from joynexus.models.backbone.layer_prefix import prefix_weights_digest

        return prefix_weights_digest(self.vlm_state, int(self.config.get("num_vlm_layers", 16)))


def read_lerobot_smolvla(path: str | Path, *, weights: bool = True) -> LeRobotSmolVLA:
    """Read a SmolVLA policy directory (module docstring); errors name the file and what is wrong.
    ``weights=False`` reads the config and statistics only (no torch tensors)."""
    root = Path(path).expanduser()
    config, camera_keys, state_dim, action_dim = read_policy_config(root, ("smolvla",))
    weights_file = root / "model.safetensors"
    module_state: dict[str, Any] = {}
    vlm_state: dict[str, Any] = {}
    if weights:
        module_state, vlm_state = _split_weights(weights_file)
    return LeRobotSmolVLA(
        config=config,
        module_state=module_state,
        vlm_state=vlm_state,
        camera_keys=camera_keys,
        state_dim=state_dim,
        action_dim=action_dim,
        stats=processor_stats(root),
    )


def read_policy_config(root: Path, types: tuple[str, ...]) -> tuple[dict[str, Any], list[str], int, int]:
    """(config.json, camera keys, state dim, action dim) of a LeRobot policy directory whose config
    type is one of ``types``; errors name the file and what is wrong."""
    if not root.is_dir():
        raise LeRobotCheckpointError(f"LeRobot policy directory {str(root)!r} does not exist")
    for needed in (root / "config.json", root / "model.safetensors"):
        if not needed.is_file():
            raise LeRobotCheckpointError(f"LeRobot policy directory {str(root)!r} has no {needed.name}")
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise LeRobotCheckpointError(f"config.json: not readable JSON ({error})") from None
    if not isinstance(config, dict) or config.get("type") not in types:
        found = config.get("type") if isinstance(config, dict) else type(config).__name__
        expected = repr(types[0]) if len(types) == 1 else f"one of {list(types)}"
        raise LeRobotCheckpointError(f"config.json: type={found!r}, expected {expected}")
    features = config.get("input_features") or {}
    camera_keys = [k for k, f in features.items() if f.get("type") == "VISUAL"]
    state = features.get("observation.state")
    action = (config.get("output_features") or {}).get("action")
    if action is None:
        raise LeRobotCheckpointError("config.json: output_features has no 'action'")
    return config, camera_keys, int(state["shape"][0]) if state else 0, int(action["shape"][0])


def _split_weights(weights_file: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    from safetensors.torch import load_file

    try:
        weights = load_file(str(weights_file))
    except Exception as error:  # a truncated or foreign file: named, never a server error
        raise LeRobotCheckpointError(f"model.safetensors: not a readable safetensors file ({error})") from None
    module_state: dict[str, Any] = {}
    vlm_state: dict[str, Any] = {}
    for name, tensor in weights.items():
        if name.startswith(LEROBOT_VLM_PREFIX):
            vlm_state[name[len(LEROBOT_VLM_PREFIX) :]] = tensor
        elif name.startswith(_EXPERT_PREFIX):
            module_state["lm_expert." + name[len(_EXPERT_PREFIX) :]] = tensor
        elif name.startswith("model.") and name.split(".")[1] in _PROJECTIONS:
            module_state[name[len("model.") :]] = tensor
    if not any(k.startswith("lm_expert.") for k in module_state):
        raise LeRobotCheckpointError("model.safetensors: no action expert weights (model.vlm_with_expert.lm_expert.*)")
    return module_state, vlm_state


def expert_name(name: str) -> str:
    """A module tensor's name in a LeRobot SmolVLA state dict."""
    return _EXPERT_PREFIX + name[len("lm_expert.") :] if name.startswith("lm_expert.") else "model." + name


def load_expert_state(path: str | Path, num_layers: int) -> tuple[dict[str, Any], str]:
    """The checkpoint's module tensors and the digest of its VLM's prefix weights."""
    checkpoint = read_lerobot_smolvla(path)
    if int(checkpoint.config.get("num_vlm_layers", num_layers)) != num_layers:
        raise LeRobotCheckpointError(
            f"config.json: num_vlm_layers={checkpoint.config.get('num_vlm_layers')}, the tenant has {num_layers}"
        )
    return checkpoint.module_state, checkpoint.vlm_digest()


def processor_stats(root: Path) -> dict[str, dict[str, list[float]]]:
    """The normalizer step's statistics of ``policy_preprocessor.json`` (feature -> stat -> values)."""
    pipeline = root / "policy_preprocessor.json"
    if not pipeline.is_file():
        return {}
    steps = json.loads(pipeline.read_text()).get("steps", [])
    for step in steps:
        if step.get("registry_name") == "normalizer_processor" and step.get("state_file"):
            from safetensors.numpy import load_file as load_arrays

            try:
                flat = load_arrays(str(root / step["state_file"]))
            except Exception as error:
                raise LeRobotCheckpointError(
                    f"{step['state_file']}: not a readable safetensors file ({error})"
                ) from None
            stats: dict[str, dict[str, list[float]]] = {}
            for name, tensor in flat.items():
                feature, stat = name.rsplit(".", 1)
                stats.setdefault(feature, {})[stat] = [float(v) for v in tensor.reshape(-1)]
            return stats
    return {}
