"""A tiny thread-safe bucket histogram a service keeps and reports in its `stats()`.

Services run in Ray actors, apart from the process that serves `/metrics`, so they cannot share a
prometheus_client registry with it; they keep cumulative bucket counts here and the metrics
collector (`joynexus.ops.metrics`) turns a snapshot into a Prometheus histogram. Observing is a
bisect and two additions under a lock: cheap enough for every served request.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from typing import Any

# Seconds, for request latencies (queue wait + shared forward + decode).
LATENCY_BOUNDS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Samples in one physical (shared) batch.
BATCH_BOUNDS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class BucketHistogram:
    """Counts per upper bound (`le`, inclusive) plus +Inf, a sum and a count."""

    def __init__(self, bounds: Sequence[float]):
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bounds must be strictly increasing, got {list(bounds)}")
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    def snapshot(self) -> dict[str, Any]:
        """Plain data: `buckets` as [[upper bound, cumulative count], ...] ending with +Inf
        (written as the string "+Inf" so the snapshot stays JSON), `sum`, `count`."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, n in zip((*self.bounds, "+Inf"), counts, strict=True):
            cumulative += n
            buckets.append([bound, cumulative])
        return {"buckets": buckets, "sum": total, "count": cumulative}
