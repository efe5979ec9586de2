"""A vectorized environment session: `SimulatorConfig.num_envs` simulator instances of one task in
ONE Environment Service worker process, stepped together by one call (one pipe round trip and one
process instead of N).

ManiSkill's CPU backend (``physx_cpu``) refuses ``num_envs > 1`` in one scene ("If you want to do
CPU sim backends and have environment vectorization you must use multi-processing across CPUs",
mani_skill/envs/sapien_env.py); its ``physx_cuda`` backend batches environments on a GPU. On these
CPU machines the slots are separate simulator instances inside the worker, stepped in turn: what is
saved is the per-session process, its pipe round trip and its scheduling. Slot j of a session
seeded s starts from seed s + j, as session j of a non-vectorized group seeded s + j would, so a
rollout sees the same episodes either way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from joynexus.envs.base import EnvObservation, SimulatorConfig, StepResult, build_simulator

__all__ = ["MAX_VECTOR_ENVS", "VectorSimulator"]

MAX_VECTOR_ENVS = 64


class VectorSimulator:
    """`num_envs` adapters of one config (slot j seeded config.seed + j), addressed by slot."""

    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self.adapters = []
        try:
            for slot in range(config.num_envs):
                one = config.model_copy(update={"num_envs": 1, "seed": config.seed + slot})
                self.adapters.append(build_simulator(one))
        except BaseException:
            self.close()
            raise
        self.spec = self.adapters[0].spec

    def spec_dict(self) -> dict[str, Any]:
        return {**self.spec.to_dict(), "num_envs": len(self.adapters)}

    def _adapter(self, slot: Any) -> Any:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < len(self.adapters):
            raise ValueError(f"slot: expected an int in 0..{len(self.adapters) - 1}, got {slot!r}")
        return self.adapters[slot]

    def reset(self, slot: int, seed: int | None = None) -> EnvObservation:
        return self._adapter(slot).reset(seed)

    def renew(self) -> None:
        for adapter in self.adapters:
            adapter.renew()

    def step_many(self, actions: dict[int, np.ndarray]) -> dict[int, dict[str, Any]]:
        """Each slot's step result (as a dict), or {"error", "error_type"} for a slot whose
        simulator raised: the other slots still step."""
        out: dict[int, dict[str, Any]] = {}
        for slot, action in actions.items():
            try:
                result: StepResult = self._adapter(int(slot)).step(action)
                out[int(slot)] = result.to_dict()
            except Exception as exc:
                out[int(slot)] = {"error": str(exc), "error_type": type(exc).__name__}
        return out

    def close(self) -> None:
        for adapter in self.adapters:
            try:
                adapter.close()
            except Exception:
                pass
        self.adapters = []
