"""``write_lerobot_policy``: a JoyNexus tenant payload written as a LeRobot policy directory.

The directory is JoyNexus's export (``joynexus.artifacts.exports.export_directory``: the action
module, a LoRA tenant's PEFT adapter, ``joynexus_export.json``) plus what LeRobot reads::

    config.json                      JoyNexusConfig (type "joynexus"): features, camera keys, chunk
    model.safetensors                the tenant's action module, keys ``action_module.*``
    policy_preprocessor.json (+ state files)   LeRobot's processor pipelines
    policy_postprocessor.json
    backbone/                        the base model (JoyNexus backbone directory format), so the
                                     policy runs without JoyNexus services or network

The PEFT adapter's ``base_model_name_or_path`` is this ``backbone/`` folder (absolute path at
export time), so stock peft resolves the base model too.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
from lerobot.utils.constants import ACTION
from safetensors.torch import save_file

from lerobot_policy_joynexus.configuration_joynexus import JoyNexusConfig
from lerobot_policy_joynexus.modeling_joynexus import ACTION_MODULE_PREFIX
from lerobot_policy_joynexus.processor_joynexus import make_joynexus_pre_post_processors

__all__ = ["BACKBONE_DIR", "write_lerobot_policy"]

BACKBONE_DIR = "backbone"


def write_lerobot_policy(
    payload: bytes,
    out_dir: str | Path,
    backbone: Any,
    *,
    camera_keys: Sequence[str],
    state_key: str = "observation.state",
    n_action_steps: int | None = None,
    default_task: str = "",
    noise_seed: int | None = None,
    device: str = "cpu",
    dataset_stats: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """Write ``payload`` (a tenant export payload) as a LeRobot policy directory at ``out_dir``
    (must not exist or be empty). ``backbone``: the base model the tenant was trained on, a
    JoyNexus ``Backbone`` (saved with ``save_pretrained``) or a backbone checkpoint directory
    (copied). ``camera_keys``: LeRobot observation keys in the tenant's camera slot order."""
    from joynexus.artifacts.codec import NORMALIZATION_FILE
    from joynexus.artifacts.exports import ACTION_MODULE_DIR, ACTION_MODULE_WEIGHTS_FILE, ADAPTER_DIR, export_directory
    from joynexus.models.backbone import BackboneSource
    from joynexus.models.placement import DevicePlacement

    root = Path(out_dir).expanduser()
    backbone_dir = root / BACKBONE_DIR
    info = export_directory(payload, root, base_model_path=str(backbone_dir.resolve()))
    if isinstance(backbone, (str, Path)):
        source = Path(backbone).expanduser()
        if not (source / "config.json").is_file():
            raise FileNotFoundError(
                f"backbone: {str(source)!r} is not a backbone checkpoint directory (no config.json)"
            )
        shutil.copytree(source, backbone_dir)
        backbone = BackboneSource(path=str(backbone_dir), preset=None).build(DevicePlacement(device="cpu"))
    else:
        backbone.save_pretrained(backbone_dir)
    if backbone.model_id != info.manifest.base_model_id:
        raise ValueError(
            f"backbone: {backbone.model_id!r} is not the base model {info.manifest.base_model_id!r} "
            f"tenant {info.manifest.tenant_id!r} v{info.manifest.policy_version} was trained on"
        )
    module = info.manifest.module_config
    if module["kind"] in ("smolvla", "pi0", "pi05"):  # LeRobot's own policy type, not a JoyNexus one
        return _write_lerobot_family(module["kind"], root, backbone, camera_keys, device, backbone_dir)
    if len(camera_keys) > backbone.max_images:
        raise ValueError(f"camera_keys: {len(camera_keys)} cameras, the backbone takes at most {backbone.max_images}")
    inputs = {
        key: PolicyFeature(type=FeatureType.VISUAL, shape=(3, *size))
        for key, size in zip(camera_keys, _camera_sizes(info.manifest.extra, len(camera_keys), backbone), strict=True)
    }
    if module["state_dim"] > 0:
        inputs[state_key] = PolicyFeature(type=FeatureType.STATE, shape=(module["state_dim"],))
    # The version's normalizer (action_module/normalization.json): LeRobot's own normalizer steps
    # apply it, so LeRobot's observations and actions are in the dataset's units, as our predict's are.
    normalization_file = root / ACTION_MODULE_DIR / NORMALIZATION_FILE
    mapping = None
    if dataset_stats is None and normalization_file.is_file():
        saved = json.loads(normalization_file.read_text())
        mapping = {feature: NormalizationMode(mode) for feature, mode in saved["modes"].items()}
        dataset_stats = {state_key if key == "observation.state" else key: v for key, v in saved["stats"].items()}
    config = JoyNexusConfig(
        device=device,
        input_features=inputs,
        output_features={ACTION: PolicyFeature(type=FeatureType.ACTION, shape=(module["action_dim"],))},
        chunk_size=module["action_chunk"],
        n_action_steps=n_action_steps or module["action_chunk"],
        camera_keys=list(camera_keys),
        state_key=state_key,
        default_task=default_task,
        noise_seed=noise_seed,
        action_module_dir=ACTION_MODULE_DIR,
        backbone_dir=BACKBONE_DIR,
        adapter_dir=ADAPTER_DIR if (root / ADAPTER_DIR).is_dir() else None,
        tenant_id=info.manifest.tenant_id,
        policy_version=info.manifest.policy_version,
        base_model_id=info.manifest.base_model_id,
        push_to_hub=False,
        **({"normalization_mapping": mapping} if mapping is not None else {}),
    )
    config.validate_features()
    config._save_pretrained(root)
    from safetensors.torch import load_file

    weights = load_file(str(root / ACTION_MODULE_DIR / ACTION_MODULE_WEIGHTS_FILE))
    save_file(
        {ACTION_MODULE_PREFIX + k: v.contiguous() for k, v in weights.items()},
        str(root / "model.safetensors"),
        {"format": "pt"},
    )
    stats = None
    if dataset_stats is not None:
        stats = {
            k: {s: torch.as_tensor(v, dtype=torch.float32) for s, v in d.items()} for k, d in dataset_stats.items()
        }
    preprocessor, postprocessor = make_joynexus_pre_post_processors(config, dataset_stats=stats)
    preprocessor.save_pretrained(root)
    postprocessor.save_pretrained(root)
    return root


def _write_lerobot_family(
    kind: str, root: Path, backbone: Any, camera_keys: Sequence[str], device: str, backbone_dir: Path
) -> Path:
    """A SmolVLA / π0 / π0.5 tenant's export: LeRobot's ``SmolVLAPolicy`` / ``PI0Policy`` /
    ``PI05Policy.from_pretrained`` loads it, beside JoyNexus's own files (manifest, digests, action
    module)."""
    from joynexus.artifacts.codec import NORMALIZATION_FILE
    from joynexus.artifacts.exports import ACTION_MODULE_DIR, load_action_module
    from joynexus.data.normalization import Normalizer

    normalization_file = root / ACTION_MODULE_DIR / NORMALIZATION_FILE
    normalizer = None
    if normalization_file.is_file():
        normalizer = Normalizer.from_dict(json.loads(normalization_file.read_text()))
    module = load_action_module(root)
    if kind == "smolvla":
        from joynexus.artifacts.lerobot_smolvla import write_lerobot_smolvla

        return write_lerobot_smolvla(
            root, module, backbone, camera_keys=camera_keys, normalizer=normalizer, vlm_dir=backbone_dir, device=device
        )
    from joynexus.artifacts.lerobot_pi0 import write_lerobot_pi0

    return write_lerobot_pi0(root, module, backbone, camera_keys=camera_keys, normalizer=normalizer, device=device)


def _camera_sizes(extra: Mapping[str, Any], cameras: int, backbone: Any) -> list[tuple[int, int]]:
    """(height, width) of each camera as the tenant trained on it (the manifest's `observation`):
    LeRobot resizes frames to what a config declares, and the backbone's square tile side would
    have them differ from the frames the service sees. A version saved before manifests carried
    it declares the tile side, as exports did."""
    observation = extra.get("observation")
    if isinstance(observation, Mapping) and len(observation.get("image_size") or ()) == 2:
        height, width = (int(side) for side in observation["image_size"])
        return [(height, width)] * cameras
    side = int(backbone.image_size)
    return [(side, side)] * cameras
