"""The ``pi05`` action-module kind: OpenPI's π0.5 action expert (LeRobot's ``lerobot.policies.pi05``)
over the same shared PaliGemma prefix as ``pi0``.

π0.5 differs from π0 in three places, all followed here as LeRobot 0.4.4 computes them: the state
enters the prefix as language (each dim, normalized to [-1, 1], discretized into 256 bins:
``"Task: ..., State: 12 200 ...;\\nAction: "``), so the suffix is the action tokens alone; the time
conditions every norm of the expert (adaRMS: scale, shift and a residual gate from
``time_mlp_in/out`` of the sinusoidal embedding) instead of being fused into the action tokens;
and the expert's norms are dense layers (``*.dense.weight/bias``). The prefix is still frozen
computation only, so π0 and π0.5 tenants of one base share ONE prefix forward
(`PI0ActionModule.layer_prefixes`; their rows' prompts differ, the computation does not).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import pydantic
import torch
import torch.nn.functional as F
from torch import nn

from joynexus.models.action_modules.base import ActionModuleConfig, register_action_module
from joynexus.models.action_modules.pi0 import PI0ActionModule, PI0Config
from joynexus.models.action_modules.prefix_flow import sinusoidal_time_embedding

__all__ = ["PI05ActionModule", "PI05Config", "pi05_prompt"]


class PI05Config(PI0Config):
    """π0.5's knobs: π0's, with LeRobot's longer prompt (the state is in it)."""

    tokenizer_max_length: int = pydantic.Field(default=200, ge=1)


def pi05_prompt(task: str, state: torch.Tensor, max_state_dim: int) -> str:
    """LeRobot's `Pi05PrepareStateTokenizerProcessorStep` for one row: the task cleaned, the
    normalized state padded to ``max_state_dim`` and discretized into 256 bins over [-1, 1]."""
    padded = F.pad(state.detach().to("cpu", torch.float32), (0, max_state_dim - state.shape[-1])).numpy()
    bins = np.digitize(padded, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
    cleaned = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {cleaned}, State: {' '.join(map(str, bins))};\nAction: "


@register_action_module("pi05")
class PI05ActionModule(PI0ActionModule):
    """π0.5's tenant-private part: the adaRMS Gemma expert, action projections and time MLP."""

    kind: ClassVar[str] = "pi05"
    config_class: ClassVar[type[ActionModuleConfig]] = PI05Config
    adaptive_norms: ClassVar[bool] = True
    config: PI05Config

    def _build_projections(self, cfg: PI0Config, width: int) -> None:
        self.action_in_proj = nn.Linear(cfg.max_action_dim, width)
        self.action_out_proj = nn.Linear(width, cfg.max_action_dim)
        self.time_mlp_in = nn.Linear(width, width)
        self.time_mlp_out = nn.Linear(width, width)

    def prompts(self, instructions: Sequence[str], state: torch.Tensor) -> list[str]:
        """Each row's task with its discretized state (`pi05_prompt`)."""
        return [pi05_prompt(text, state[b], self.config.max_state_dim) for b, text in enumerate(instructions)]

    def embed_suffix(
        self, x_t: torch.Tensor, time: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(action tokens, one block, the adaRMS condition from the time) (LeRobot's `embed_suffix`)."""
        action = self.action_in_proj(x_t)
        emb = sinusoidal_time_embedding(time, action.shape[-1], self.config.min_period, self.config.max_period)
        cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(emb.to(time.dtype)))))
        starts = torch.zeros(action.shape[:2], dtype=torch.bool, device=action.device)
        starts[:, 0] = True
        return action, starts, cond
