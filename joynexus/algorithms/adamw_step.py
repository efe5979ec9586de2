"""Per-call AdamW hyperparameters of `optim_step` (issue 28.4), as Tinker's `AdamParams`: the
learning rate, betas, weight decay and gradient-clip norm of ONE step. Unset fields keep the
tenant's own (its spec's learning rate, torch's AdamW betas and weight decay, the clip norm
`train_batch` uses). The override lasts for that one step: the tenant's optimizer is left with its
own values afterwards, so `train_batch` / workloads and later calls without overrides are
unaffected. Bounds are checked here, naming the field, before anything changes."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["ADAMW_STEP_BOUNDS", "ADAMW_STEP_FIELDS", "check_adamw_step", "overridden_groups"]

ADAMW_STEP_FIELDS = ("lr", "betas", "weight_decay", "grad_clip")
# Field -> (low, high, low inclusive, high inclusive); betas: each of the two.
ADAMW_STEP_BOUNDS: dict[str, tuple[float, float, bool, bool]] = {
    "lr": (0.0, 1.0, False, True),
    "betas": (0.0, 1.0, True, False),
    "weight_decay": (0.0, 1.0, True, True),
    "grad_clip": (0.0, 1e4, False, True),
}


def _in_bounds(name: str, value: Any) -> float:
    low, high, low_in, high_in = ADAMW_STEP_BOUNDS[name.split("[")[0]]
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= low if low_in else value > low) and (value <= high if high_in else value < high)
    if not ok:
        interval = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
        raise ValueError(f"{name}: {value!r} must be a number in {interval}")
    return float(value)


def check_adamw_step(params: dict[str, Any] | None) -> dict[str, Any]:
    """The given overrides, checked (unknown fields and out-of-range values raise ValueError naming
    the field); None values are dropped (keep the tenant's own)."""
    checked: dict[str, Any] = {}
    for name, value in (params or {}).items():
        if name not in ADAMW_STEP_FIELDS:
            raise ValueError(f"{name}: not an AdamW step parameter (one of {list(ADAMW_STEP_FIELDS)})")
        if value is None:
            continue
        if name == "betas":
            if not isinstance(value, list | tuple) or len(value) != 2:
                raise ValueError(f"betas: {value!r} must be two numbers [beta1, beta2], each in [0, 1)")
            checked[name] = (_in_bounds("betas[0]", value[0]), _in_bounds("betas[1]", value[1]))
        else:
            checked[name] = _in_bounds(name, value)
    return checked


@contextmanager
def overridden_groups(optimizer: torch.optim.Optimizer, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Within the block, every param group of `optimizer` uses `params`' lr / betas / weight decay;
    afterwards each has its own values back. Yields the values the step uses (the first group's)."""
    keys = [k for k in ("lr", "betas", "weight_decay") if k in params]
    saved = [{k: group[k] for k in keys} for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            for k in keys:
                group[k] = params[k]
        first = optimizer.param_groups[0]
        yield {"lr": float(first["lr"]), "betas": list(first["betas"]), "weight_decay": float(first["weight_decay"])}
    finally:
        for group, values in zip(optimizer.param_groups, saved, strict=True):
            group.update(values)
