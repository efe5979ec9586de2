"""Where a data-parallel group's ranks sum gradients (issue 45.2): the hook every update path's clip
calls first (`trainer.clip_gradients` -> `reduce_gradients`), and the weighted all-reduce a rank
installs there (`data_parallel.DataParallelRank`). A process that is no rank has no reducer and
the hook does nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["WeightedAllReduce", "install_gradient_reducer", "reduce_gradients"]

# The reducer `clip_gradients` calls first (None: no data-parallel group in this process).
_REDUCER: Callable[[Any, list[torch.nn.Parameter]], None] | None = None


def install_gradient_reducer(reducer: Callable[[Any, list[torch.nn.Parameter]], None] | None) -> None:
    global _REDUCER
    _REDUCER = reducer


def reduce_gradients(slot: Any, params: list[torch.nn.Parameter]) -> None:
    """Called before a slot's gradients are clipped: a rank of a data-parallel group sums them over
    the group here; anywhere else nothing happens."""
    if _REDUCER is not None:
        _REDUCER(slot, params)


class WeightedAllReduce:
    """A rank's reducer: each stepping tenant's gradients, times its share of the rows (`weights`,
    set for the step), summed over the default process group in one flat buffer; every rank
    reduces the same tenants in the same order. A tenant without a weight takes `default_weight`:
    1/K for a step every rank runs on the same rows (their gradients averaged, so the ranks cannot
    drift apart by floating-point nondeterminism); None leaves its gradients as they are."""

    def __init__(self, default_weight: float | None = None) -> None:
        self.weights: dict[str, float] = {}
        self.default_weight = default_weight

    def __call__(self, slot: Any, params: list[torch.nn.Parameter]) -> None:
        import torch.distributed as dist

        weight = self.weights.get(slot.config.tenant_id, self.default_weight)
        if weight is None:
            return
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads]) * weight
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
