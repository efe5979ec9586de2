"""Autoscaler policy for the Inference Model Service replicas (paper 4.5: elastic inference).

Pure decisions, no I/O: `Autoscaler.decide(signals, now)` turns the load the replica set measured
(requests in flight over its replicas, p99 latency of recent requests) into a desired replica count
within [min_replicas, max_replicas]. Scale out when the queue per replica or the p99 latency is
above its bound; scale in when both are well below; never change again within `cooldown_s` of the
last change (bounds violations are corrected at once). The replica set
(`joynexus.services.inference.replicas`) carries the decision out: a new replica gets every
published version before it takes traffic, a removed one is drained first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from joynexus.settings import ScalingPolicy


@dataclass(frozen=True)
class LoadSignals:
    """What the replica set measured: active replicas, requests in flight over them, p99 latency
    of requests finished in the last window (None when none finished)."""

    replicas: int
    in_flight: int
    p99_latency_s: float | None = None

    @property
    def queue_per_replica(self) -> float:
        return self.in_flight / max(self.replicas, 1)


@dataclass(frozen=True)
class ScalingDecision:
    desired: int
    reason: str

    def changes(self, current: int) -> bool:
        return self.desired != current


class Autoscaler:
    """Cooldown state around the policy; one decision per round."""

    def __init__(self, policy: ScalingPolicy):
        self.policy = policy
        self._last_change: float | None = None

    def decide(self, signals: LoadSignals, now: float) -> ScalingDecision:
        p, n = self.policy, signals.replicas
        if n < p.min_replicas:
            return self._changed(ScalingDecision(p.min_replicas, f"{n} replicas is below min_replicas"), now)
        if n > p.max_replicas:
            return self._changed(ScalingDecision(p.max_replicas, f"{n} replicas is above max_replicas"), now)
        if self._last_change is not None and now - self._last_change < p.cooldown_s:
            return ScalingDecision(n, "cooldown")
        q, p99 = signals.queue_per_replica, signals.p99_latency_s
        slow = p.max_p99_latency_s is not None and p99 is not None and p99 > p.max_p99_latency_s
        if (q > p.scale_out_queue_per_replica or slow) and n < p.max_replicas:
            # Enough replicas for the queue at the scale-out threshold, at least one more.
            wanted = max(n + 1, math.ceil(signals.in_flight / p.scale_out_queue_per_replica))
            why = f"p99 {p99:.3f} s > {p.max_p99_latency_s} s" if slow else f"{q:.1f} requests in flight per replica"
            return self._changed(ScalingDecision(min(p.max_replicas, wanted), why), now)
        fast = p.max_p99_latency_s is None or p99 is None or p99 < p.max_p99_latency_s / 2
        if q < p.scale_in_queue_per_replica and fast and n > p.min_replicas:
            return self._changed(ScalingDecision(n - 1, f"{q:.1f} requests in flight per replica"), now)
        return ScalingDecision(n, "steady")

    def _changed(self, decision: ScalingDecision, now: float) -> ScalingDecision:
        self._last_change = now
        return decision

    def note_change(self, now: float) -> None:
        """An operator's explicit scale also starts the cooldown."""
        self._last_change = now
