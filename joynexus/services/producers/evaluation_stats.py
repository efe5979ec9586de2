"""The statistics of decision-grade evaluation: a success rate is reported with its 95% Wilson score
interval (Wilson 1927), and the champion rule compares intervals, not single means.

Why Wilson: evaluations here are small (4..100 episodes) and success rates sit near 0 or 1, where the
normal ("Wald") interval collapses to zero width (0/4 gives [0, 0]) and the Wilson interval does not
(0/4 gives [0, 0.49]); it is what the RL-evaluation literature recommends for binomial success
(Agarwal et al. 2021, "Deep RL at the Edge of the Statistical Precipice", argue for intervals over
point estimates).

The champion rule (`joynexus.master.workloads.promotion`): a candidate is promoted only when the
LOWER bound of its success interval beats the champion's measured success rate (its point estimate)
by more than `promotion.min_improvement`. A lucky run of few episodes no longer displaces a champion:
at 4 episodes a candidate needs 4/4 (lower bound 0.51) to beat a 1/4 champion, and at 50 episodes
30/50 (0.46) beats a 0.40 champion while 25/50 (0.37) does not.
"""

from __future__ import annotations

import math

__all__ = ["SUCCESS_CI_HIGH_METRIC", "SUCCESS_CI_LOW_METRIC", "Z_95", "wilson_interval"]

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile
SUCCESS_CI_LOW_METRIC = "eval/success_ci_low"
SUCCESS_CI_HIGH_METRIC = "eval/success_ci_high"


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion: (low, high) within [0, 1]. No trials
    gives the uninformative (0, 1)."""
    if trials < 0 or not 0 <= successes <= max(trials, 0):
        raise ValueError(f"successes/trials: expected 0 <= successes <= trials, got {successes}/{trials}")
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    z2 = z * z
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
    # The exact ends at 0 / n and n / n (floating point leaves them ~1e-17 off).
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


# The held-out loss of a dataset-only tenant (heldout.py): the promotion metric without a simulator.
HELDOUT_METRIC = "eval/heldout_loss"
