"""Simulator adapters behind one interface (`SimulatorAdapter`) and their registry.

Importing this package registers the built-in adapters (``maniskill``, ``pusht``) without loading
any simulator: each adapter imports its simulator when it is built.
"""

from joynexus.envs import maniskill as _maniskill  # noqa: F401  (registers "maniskill")
from joynexus.envs import pusht as _pusht  # noqa: F401  (registers "pusht")
from joynexus.envs.base import (
    MAX_IMAGE_PIXELS,
    MAX_IMAGE_SIDE,
    MAX_OBSERVATION_BYTES,
    SIMULATORS,
    AssetDownloadRefused,
    EnvObservation,
    SimulatorAdapter,
    SimulatorConfig,
    SimulatorSpec,
    SimulatorUnavailable,
    StepResult,
    available_simulators,
    build_simulator,
    image_size_problem,
    register_simulator,
    validate_action,
)

__all__ = [
    "MAX_IMAGE_PIXELS",
    "MAX_IMAGE_SIDE",
    "MAX_OBSERVATION_BYTES",
    "SIMULATORS",
    "AssetDownloadRefused",
    "EnvObservation",
    "SimulatorAdapter",
    "SimulatorConfig",
    "SimulatorSpec",
    "SimulatorUnavailable",
    "StepResult",
    "available_simulators",
    "build_simulator",
    "image_size_problem",
    "register_simulator",
    "validate_action",
]
