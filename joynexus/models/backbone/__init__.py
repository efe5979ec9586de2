"""The resident backbone: its protocol and families (`base`), what families share (`common`), the
Idefics3 / SmolVLM family (`idefics3`), the Qwen3-VL family (`qwen_vl`), the
PaliGemma family of π0 / π0.5 (`paligemma`), the built-in presets and
offline tokenizer (`tiny`), and `BackboneSource` (`source`).

Importing this package registers the built-in families.
"""

import os

# The service must never reach a model hub; set before transformers is imported (by the submodules
# below). Every load also passes ``local_files_only=True``, so this is belt and braces.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from joynexus.models.backbone.base import (  # noqa: E402
    BACKBONE_FAMILIES,
    DEFAULT_FAMILY,
    METADATA_FILE,
    METADATA_FORMAT_VERSION,
    Backbone,
    BackboneFeatures,
    available_backbone_families,
    default_lora_targets,
    family_for_model_type,
    family_for_preset,
    register_backbone_family,
)
from joynexus.models.backbone.idefics3 import SUPPORTED_MODEL_TYPES, ResidentBackbone  # noqa: E402
from joynexus.models.backbone.paligemma import PaliGemmaBackbone, PaliGemmaSpec  # noqa: E402
from joynexus.models.backbone.qwen_vl import QwenVLBackbone, QwenVLSpec  # noqa: E402
from joynexus.models.backbone.source import BackboneSource, checkpoint_family  # noqa: E402
from joynexus.models.backbone.tiny import TinyBackboneSpec  # noqa: E402

__all__ = [
    "BACKBONE_FAMILIES",
    "DEFAULT_FAMILY",
    "METADATA_FILE",
    "METADATA_FORMAT_VERSION",
    "SUPPORTED_MODEL_TYPES",
    "Backbone",
    "BackboneFeatures",
    "BackboneSource",
    "PaliGemmaBackbone",
    "PaliGemmaSpec",
    "QwenVLBackbone",
    "QwenVLSpec",
    "ResidentBackbone",
    "TinyBackboneSpec",
    "available_backbone_families",
    "checkpoint_family",
    "default_lora_targets",
    "family_for_model_type",
    "family_for_preset",
    "register_backbone_family",
]
