"""Usage metering inside the shared services: the Inference Model Service records device time per
request, the Environment Service env steps per tenant, whoever calls them (tenant API, RL rollouts,
evaluations), so every use is counted once, where it happens.

`UsageMeter.record` is called on hot paths (every inference batch, every env step), so it only adds
to in-memory totals per (tenant, category, operation); a daemon thread writes them to the
control-plane store (`usage_records`) every `flush_interval_s`, and `flush()` / `close()` write at
once. A failed write keeps the amounts for the next try. A Ray actor gets the database URL (a plain
string) and builds its own meter with `UsageMeter.from_url`.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import weakref

from joynexus.core.store import ControlPlaneStore, UsageRecord
from joynexus.settings import resolve_database_url

log = logging.getLogger(__name__)

TRAINING, INFERENCE, ENVIRONMENT = "training", "inference", "environment"
CATEGORIES = frozenset((TRAINING, INFERENCE, ENVIRONMENT))

# Column widths of UsageRecord: a longer value would fail every later flush on PostgreSQL, so it is
# refused at record() time instead.
_MAX_TENANT_ID, _MAX_OPERATION = 64, 32

_Key = tuple[str, str, str]  # (tenant_id, category, operation)


def split_group_seconds(seconds: float, samples_per_member: list[int]) -> list[float]:
    """A grouped batch's time split by each member's share of its samples."""
    total = sum(samples_per_member)
    if total <= 0:
        return [0.0 for _ in samples_per_member]
    return [seconds * n / total for n in samples_per_member]


class _Totals:
    __slots__ = ("device_seconds", "samples", "env_steps")

    def __init__(self, device_seconds: float = 0.0, samples: int = 0, env_steps: int = 0) -> None:
        self.device_seconds, self.samples, self.env_steps = device_seconds, samples, env_steps

    def add(self, other: _Totals) -> None:
        self.device_seconds += other.device_seconds
        self.samples += other.samples
        self.env_steps += other.env_steps

    def as_dict(self) -> dict[str, float | int]:
        return {"device_seconds": self.device_seconds, "samples": self.samples, "env_steps": self.env_steps}


class UsageMeter:
    """Aggregates usage in memory and writes it to the control-plane store in the background."""

    def __init__(
        self,
        store: ControlPlaneStore,
        *,
        flush_interval_s: float = 1.0,
        owns_store: bool = False,
        start: bool = True,
    ) -> None:
        if flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be > 0, got {flush_interval_s}")
        self.store = store
        self.flush_interval_s = float(flush_interval_s)
        self._owns_store = owns_store
        self._lock = threading.Lock()  # guards _pending; held only for dict updates
        self._flush_lock = threading.Lock()  # one writer at a time, so flush() returning means written
        self._pending: dict[_Key, _Totals] = {}
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        # Daemon threads die at interpreter exit: write what is left first. A weak reference, so the
        # hook does not keep a dropped meter alive.
        self._atexit = functools.partial(_flush_at_exit, weakref.ref(self))
        atexit.register(self._atexit)
        if start:
            self._thread = threading.Thread(target=self._run, name="usage-meter-flush", daemon=True)
            self._thread.start()

    @classmethod
    def from_url(cls, url: str, *, flush_interval_s: float = 1.0, start: bool = True) -> UsageMeter:
        """A meter on its own ControlPlaneStore (SQLite or PostgreSQL URL), closed with the meter."""
        return cls(ControlPlaneStore(url), flush_interval_s=flush_interval_s, owns_store=True, start=start)

    # -- recording ------------------------------------------------------------------------------
    def record(
        self,
        tenant_id: str,
        category: str,
        operation: str,
        *,
        device_seconds: float = 0.0,
        samples: int = 0,
        env_steps: int = 0,
    ) -> None:
        """Add to the tenant's totals; written to the store by the next flush. Never does I/O."""
        if category not in CATEGORIES:
            raise ValueError(f"category {category!r}: expected one of {sorted(CATEGORIES)}")
        if not isinstance(tenant_id, str) or not 0 < len(tenant_id) <= _MAX_TENANT_ID:
            raise ValueError(f"tenant_id: expected a string of 1..{_MAX_TENANT_ID} characters, got {tenant_id!r}")
        if not isinstance(operation, str) or not 0 < len(operation) <= _MAX_OPERATION:
            raise ValueError(f"operation: expected a string of 1..{_MAX_OPERATION} characters, got {operation!r}")
        amount = _Totals(max(0.0, float(device_seconds)), max(0, int(samples)), max(0, int(env_steps)))
        if not (amount.device_seconds or amount.samples or amount.env_steps):
            return
        key = (tenant_id, category, operation)
        with self._lock:
            totals = self._pending.get(key)
            if totals is None:
                self._pending[key] = amount
            else:
                totals.add(amount)

    def pending(self) -> dict[_Key, dict[str, float | int]]:
        """Amounts recorded but not yet written, per (tenant_id, category, operation)."""
        with self._lock:
            return {key: totals.as_dict() for key, totals in self._pending.items()}

    # -- writing --------------------------------------------------------------------------------
    def flush(self) -> int:
        """Write every pending amount now, one row per (tenant, category, operation); returns the
        number of rows written. On failure the amounts stay pending and the error is raised."""
        with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, {}
            if not batch:
                return 0
            try:
                with self.store.transaction() as session:
                    session.add_all(
                        UsageRecord(
                            tenant_id=tenant_id,
                            category=category,
                            operation=operation,
                            device_seconds=totals.device_seconds,
                            samples=totals.samples,
                            env_steps=totals.env_steps,
                        )
                        for (tenant_id, category, operation), totals in batch.items()
                    )
            except BaseException:
                self._restore(batch)
                raise
            return len(batch)

    def _restore(self, batch: dict[_Key, _Totals]) -> None:
        with self._lock:
            for key, totals in batch.items():
                held = self._pending.get(key)
                if held is None:
                    self._pending[key] = totals
                else:
                    held.add(totals)

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            self.try_flush()

    def try_flush(self) -> bool:
        """flush(), logging a failure instead of raising (the amounts stay pending); True if written."""
        try:
            self.flush()
        except Exception as error:  # the store is down: keep the amounts, try again next interval
            log.warning("usage meter: flush to the control-plane store failed, will retry: %s", error)
            return False
        return True

    def close(self) -> None:
        """Stop the background thread and write what is pending (a failure is logged, not raised).
        Amounts recorded after close wait for an explicit flush()."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.flush_interval_s))
        self.try_flush()
        atexit.unregister(self._atexit)
        if self._owns_store:
            self.store.dispose()

    def __enter__(self) -> UsageMeter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _flush_at_exit(ref: weakref.ref[UsageMeter]) -> None:
    meter = ref()
    if meter is not None and not meter._closed:
        meter.try_flush()


def build_meter(meter: UsageMeter | None, database_url: str | None) -> tuple[UsageMeter | None, bool]:
    """A service's meter from its constructor arguments: the given meter, or one on `database_url`
    (for a Ray actor, which gets a plain string). Returns (meter, owned by the service)."""
    if meter is not None and database_url is not None:
        raise ValueError("pass either meter or database_url, not both")
    if database_url is not None:  # a reference by name in an actor (settings.database_url_ref)
        return UsageMeter.from_url(resolve_database_url(database_url) or database_url), True
    return meter, False
