"""Garbage-collector pauses of a serving process (issue 17).

A serving process (the API server, the Inference Model Service's actor) holds a large heap of
long-lived objects after startup: torch, transformers, SQLAlchemy, pydantic models, the backbone's
modules (~800k tracked objects with the tiny backbone). CPython's full (generation 2) collection
walks every one of them while holding the interpreter lock, which stalls the event loop, every
worker thread and the batching worker at once: ~350-420 ms on this machine, often enough to be
the p99 of the policy stream at 32 robots (every request in flight waits it out).

`freeze_startup_heap()` collects once and then moves what survives into the permanent generation
(`gc.freeze()`), so later collections only walk objects created after startup. Objects frozen are
never reclaimed by the cycle collector (reference counting still frees them), which is why it is
done once per process, after startup, on an already collected heap.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time

log = logging.getLogger("joynexus.core.heap")

GC_FREEZE_ENV = "JOYNEXUS_GC_FREEZE"  # "0" turns it off (e.g. to look for leaks with gc.garbage)

_lock = threading.Lock()
_frozen_pid: int | None = None


def freeze_startup_heap() -> int:
    """Collect, then freeze the surviving heap; once per process (later calls, and calls with
    JOYNEXUS_GC_FREEZE=0, do nothing). Returns the number of objects frozen by this call."""
    global _frozen_pid
    if os.environ.get(GC_FREEZE_ENV, "1").strip().lower() in {"0", "false", "no", "off"}:
        return 0
    with _lock:
        if _frozen_pid == os.getpid():  # a forked child has a heap of its own to freeze
            return 0
        _frozen_pid = os.getpid()
        started = time.perf_counter()
        gc.collect()
        before = gc.get_freeze_count()
        gc.freeze()
        frozen = gc.get_freeze_count() - before
    log.info("froze %d startup objects out of garbage collection in %.2f s", frozen, time.perf_counter() - started)
    return frozen


def in_ray_actor_process() -> bool:
    """Whether this process is a Ray actor's own (a service built as a named actor), not a driver
    that builds services in its own process (tests, the in-process API server)."""
    ray = sys.modules.get("ray")  # never import Ray just to ask
    if ray is None or not ray.is_initialized():
        return False
    try:
        return ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # a driver, or a Ray without this API: not an actor process
        return False


__all__ = ["GC_FREEZE_ENV", "freeze_startup_heap", "in_ray_actor_process"]
