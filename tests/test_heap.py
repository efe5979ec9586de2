"""`freeze_startup_heap`: the startup heap leaves the cycle collector once per process, so a later
full collection walks only what was made after startup (issue 17: a ~0.4 s stall of the serving
process otherwise). Run in fresh interpreters: freezing is process-wide and once per process."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import gc, json
from joynexus.core.heap import freeze_startup_heap, in_ray_actor_process
kept = [[i] for i in range(50_000)]  # long-lived container objects, tracked by the collector
frozen = freeze_startup_heap()
count = gc.get_freeze_count()
again = freeze_startup_heap()
garbage = [[i] for i in range(1_000)]  # made after the freeze: still collected as usual
gc.collect()
print(json.dumps({"frozen": frozen, "count": count, "again": again, "after": gc.get_freeze_count(),
                  "actor": in_ray_actor_process()}))
"""


def _run(env_value: str | None) -> dict:
    import json

    env = dict(os.environ)
    env.pop("JOYNEXUS_GC_FREEZE", None)
    if env_value is not None:
        env["JOYNEXUS_GC_FREEZE"] = env_value
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freezes_the_startup_heap_once_per_process() -> None:
    out = _run(None)
    # The long-lived lists among them (reference counting still frees a frozen object: <= frozen).
    assert out["frozen"] >= 50_000 and 50_000 <= out["count"] <= out["frozen"]
    assert out["again"] == 0 and out["after"] == out["count"]  # once: later objects stay collectable
    assert out["actor"] is False  # a plain process is no Ray actor


def test_can_be_turned_off() -> None:
    out = _run("0")
    assert out["frozen"] == 0 and out["count"] == 0
