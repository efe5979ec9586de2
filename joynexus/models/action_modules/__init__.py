"""Tenant-private action modules: the shared base and registry (`base`), one file per kind.

Importing this package registers the built-in kinds (``oft_mlp``, ``flow_matching``, ``smolvla``,
``pi0``, ``pi05``).
"""

from joynexus.models.action_modules.base import (
    ACTION_MODULES,
    SIZE_PRESETS,
    ActionModule,
    ActionModuleConfig,
    PrefixRows,
    SizePreset,
    available_action_modules,
    build_action_module,
    by_prefix_layout,
    register_action_module,
    uses_layer_prefix,
)
from joynexus.models.action_modules.flow_matching import (
    FlowMatchingActionModule,
    FlowMatchingConfig,
    timestep_embedding,
)
from joynexus.models.action_modules.oft_mlp import OFTMLPActionModule
from joynexus.models.action_modules.pi0 import PI0ActionModule, PI0Config
from joynexus.models.action_modules.pi05 import PI05ActionModule, PI05Config
from joynexus.models.action_modules.smolvla import SmolVLAActionModule, SmolVLAConfig

__all__ = [
    "ACTION_MODULES",
    "SIZE_PRESETS",
    "ActionModule",
    "ActionModuleConfig",
    "FlowMatchingActionModule",
    "FlowMatchingConfig",
    "OFTMLPActionModule",
    "PI05ActionModule",
    "PI05Config",
    "PI0ActionModule",
    "PI0Config",
    "PrefixRows",
    "SizePreset",
    "SmolVLAActionModule",
    "SmolVLAConfig",
    "available_action_modules",
    "build_action_module",
    "by_prefix_layout",
    "register_action_module",
    "timestep_embedding",
    "uses_layer_prefix",
]
