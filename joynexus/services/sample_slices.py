"""One sampling call as bounded slices (issue 41.1): `TrainingModelService.sample` repeats each
observation's backbone features once per drawn chunk, and the service runs one call at a time, so
one call of N observations x n chunks held the service (and N x n copies of the features) for as
long as it ran: 512 x 64 chunks, 42.8 s and 1.2 GB, while another tenant's train_batch waited.

`sample_in_slices` sends the call as slices of at most `SAMPLE_SLICE_CHUNKS` chunks (whole
observations: n chunks each), each its own service call: between two slices the service takes the
other tenants' waiting calls (the API passes each slice through the training gate's per-tenant
turns, `joynexus.api.priority_gate`; a future's slices meet other calls at the service's own queue),
and what one call holds on the service at once is one slice's features. The answer is the slices'
answers joined in order.

Randomness: the first slice draws with the call's seed (a call of one slice draws what it drew
before slicing); slice i with a seed derived from it, so the same seed, observations and
parameters still give the same samples. Torch-free: the API imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

__all__ = ["SAMPLE_SLICE_CHUNKS", "SampleVersionChanged", "sample_in_slices", "slice_seed"]

# Chunks one slice draws: a tenth of a second or two of the service on a CPU (the 512 x 64 call
# drew 1.3 ms a chunk), while the features it repeats stay a few MB for the backbones we serve.
SAMPLE_SLICE_CHUNKS = 128
_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive slice indices over the seed space

R = TypeVar("R")


class SampleVersionChanged(ValueError):
    """The tenant's policy changed between two slices of one call (its own optim_step ran
    meanwhile): the samples would mix two versions, so the call is refused as a whole."""


def slice_seed(seed: int, index: int) -> int:
    return int(seed) % 2**63 if index == 0 else (int(seed) + index * _GOLDEN) % 2**63


def _run_now(function: Callable[[], R]) -> R:
    return function()


def sample_in_slices(
    call: Callable[[dict[str, Any]], dict[str, Any]],
    arguments: dict[str, Any],
    *,
    slice_chunks: int = SAMPLE_SLICE_CHUNKS,
    turn: Callable[[Callable[[], dict[str, Any]]], dict[str, Any]] = _run_now,
) -> dict[str, Any]:
    """`call(arguments of one slice)` (the service's `sample`: batch, n, temperature, seed) for each
    slice of `arguments["batch"]`'s observations, each inside `turn` (the caller's place in line);
    the slices' answers joined: actions (N, n, chunk, dim), log_probs (N, n) or None, the version
    they all drew from, seconds summed."""
    if slice_chunks < 1:
        raise ValueError(f"slice_chunks must be >= 1, got {slice_chunks}")
    batch, n = arguments["batch"], int(arguments["n"])
    count = len(batch["task"])
    per_slice = max(1, slice_chunks // max(n, 1))  # whole observations; one at least (n <= 64)
    answers: list[dict[str, Any]] = []
    for index, start in enumerate(range(0, max(count, 1), per_slice)):
        part = {name: column[start : start + per_slice] for name, column in batch.items()}
        sliced = {**arguments, "batch": part, "seed": slice_seed(arguments["seed"], index)}
        answers.append(turn(lambda sliced=sliced: call(sliced)))
    versions = sorted({answer["version"] for answer in answers})
    if len(versions) > 1:
        raise SampleVersionChanged(
            f"the policy changed from version {versions[0]} to {versions[-1]} while this sampling call ran "
            "(an optim_step of yours ran between its slices); sample again"
        )
    first = answers[0]
    log_probs = [answer["log_probs"] for answer in answers]
    return {
        **first,
        "actions": np.concatenate([np.asarray(answer["actions"]) for answer in answers]),
        "log_probs": None if log_probs[0] is None else np.concatenate([np.asarray(p) for p in log_probs]),
        "seed": int(arguments["seed"]),
        "seconds": float(sum(float(answer.get("seconds", 0.0)) for answer in answers)),
        "slices": len(answers),
    }
