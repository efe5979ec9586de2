"""Reading a LeRobot π0 / π0.5 policy directory (``PI0Policy`` / ``PI05Policy.save_pretrained`` and
its processor pipelines) into the ``pi0`` / ``pi05`` kinds' terms. With ``weights=False`` nothing but
JSON is read (the Master compiles a tenant from it): the expert's width and MLP come from the
safetensors header's shapes, so a checkpoint of any Gemma variant is read as it is. Writing one:
`joynexus.artifacts.lerobot_pi0`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from joynexus.models.action_modules.smolvla_checkpoint import (
    LeRobotCheckpointError,
    processor_stats,
    read_policy_config,
)

__all__ = [
    "LEROBOT_PALIGEMMA_PREFIX",
    "LeRobotPI0",
    "pi0_expert_name",
    "read_lerobot_pi0",
]

LEROBOT_PALIGEMMA_PREFIX = "model.paligemma_with_expert.paligemma."  # PaliGemmaForConditionalGeneration's names follow
_EXPERT_PREFIX = "model.paligemma_with_expert.gemma_expert."
_PROJECTIONS = (
    "state_proj",
    "action_in_proj",
    "action_out_proj",
    "action_time_mlp_in",
    "action_time_mlp_out",
    "time_mlp_in",
    "time_mlp_out",
)
_KINDS = ("pi0", "pi05")


@dataclass(frozen=True)
class LeRobotPI0:
    """What a π0 / π0.5 policy directory holds, in JoyNexus terms."""

    kind: str  # "pi0" or "pi05" (LeRobot's config type)
    config: dict[str, Any]
    shapes: dict[str, list[int]]  # every tensor's shape (from the safetensors header)
    module_state: dict[str, Any]  # the tenant-private tensors under the module's names (empty: not read)
    vlm_state: dict[str, Any]  # PaliGemma under its own names (empty: not read)
    camera_keys: list[str]
    state_dim: int
    action_dim: int
    stats: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def module_config_fields(self) -> dict[str, Any]:
        """The pi0 / pi05 module config's fields from LeRobot's config and the expert's shapes."""
        c = self.config
        up = self.shapes.get(_EXPERT_PREFIX + "model.layers.0.mlp.up_proj.weight")
        if up is None:
            raise LeRobotCheckpointError("model.safetensors: no gemma expert MLP (gemma_expert.model.layers.0.mlp)")
        resolution = c.get("image_resolution") or [224, 224]
        return {
            "action_chunk": int(c["chunk_size"]),
            "num_steps": int(c.get("num_inference_steps", 10)),
            "max_state_dim": int(c.get("max_state_dim", 32)),
            "max_action_dim": int(c.get("max_action_dim", 32)),
            "tokenizer_max_length": int(c.get("tokenizer_max_length", 48 if self.kind == "pi0" else 200)),
            "min_period": float(c.get("min_period", 4e-3)),
            "max_period": float(c.get("max_period", 4.0)),
            "image_resolution": int(resolution[0]),
            "expert_width": int(up[1]),
            "expert_mlp_dim": int(up[0]),
        }

    def vlm_digest(self, depth: int) -> str:
        from joynexus.models.backbone.layer_prefix import prefix_weights_digest
        from joynexus.models.backbone.paligemma import PALIGEMMA_PREFIX_WEIGHTS

        return prefix_weights_digest(self.vlm_state, depth, PALIGEMMA_PREFIX_WEIGHTS)


def _header_shapes(weights_file: Path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors file's JSON header (no tensor read)."""
    try:
        with weights_file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as error:
        raise LeRobotCheckpointError(f"model.safetensors: not a readable safetensors file ({error})") from None
    return {name: list(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def read_lerobot_pi0(path: str | Path, *, weights: bool = True) -> LeRobotPI0:
    """Read a π0 / π0.5 policy directory; errors name the file and what is wrong."""
    root = Path(path).expanduser()
    config, camera_keys, state_dim, action_dim = read_policy_config(root, _KINDS)
    weights_file = root / "model.safetensors"
    shapes = _header_shapes(weights_file)
    if not any(name.startswith(_EXPERT_PREFIX) for name in shapes):
        raise LeRobotCheckpointError(f"model.safetensors: no action expert weights ({_EXPERT_PREFIX}*)")
    module_state: dict[str, Any] = {}
    vlm_state: dict[str, Any] = {}
    if weights:
        module_state, vlm_state = _split_weights(weights_file)
    return LeRobotPI0(
        kind=config["type"],
        config=config,
        shapes=shapes,
        module_state=module_state,
        vlm_state=vlm_state,
        camera_keys=camera_keys,
        state_dim=state_dim,
        action_dim=action_dim,
        stats=processor_stats(root),
    )


def _split_weights(weights_file: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    from safetensors.torch import load_file

    try:
        weights = load_file(str(weights_file))
    except Exception as error:  # a truncated or foreign file: named, never a server error
        raise LeRobotCheckpointError(f"model.safetensors: not a readable safetensors file ({error})") from None
    module_state: dict[str, Any] = {}
    vlm_state: dict[str, Any] = {}
    for name, tensor in weights.items():
        if name.startswith(LEROBOT_PALIGEMMA_PREFIX):
            vlm_state[name[len(LEROBOT_PALIGEMMA_PREFIX) :]] = tensor
        elif name.startswith(_EXPERT_PREFIX + "model."):  # the expert's lm_head is never read
            module_state["gemma_expert." + name[len(_EXPERT_PREFIX) :]] = tensor
        elif name.startswith("model.") and name.split(".")[1] in _PROJECTIONS:
            module_state[name[len("model.") :]] = tensor
    # PaliGemma ties its token embeddings to lm_head; safetensors keeps one name of a shared tensor.
    embed = "model.language_model.embed_tokens.weight"
    if embed not in vlm_state and "lm_head.weight" in vlm_state:
        vlm_state[embed] = vlm_state["lm_head.weight"]
    return module_state, vlm_state


def pi0_expert_name(name: str) -> str:
    """A module tensor's name in a LeRobot π0 / π0.5 state dict."""
    if name.startswith("gemma_expert."):
        return _EXPERT_PREFIX + name[len("gemma_expert.") :]
    return "model." + name
