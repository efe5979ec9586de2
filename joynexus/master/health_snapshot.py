"""The deployment's health, published as a file: `joynexus status` answers without a Ray driver.

After every Health Manager round (`HealthOptions.interval_s`, 1 s) the deployment's Master (the
detached actor `joynexus up` creates) writes ``<data_dir>/run/health-<namespace>.json``: when, its
own `ping()`, `health()` (the truth per role: healthy, incarnation, restarts, detail) and each
service's last heartbeat (queue depths, tenants). The file is replaced atomically.

`joynexus status` reads it when it is fresh (`read_health_snapshot`, at most `max_age_s` old by
this host's clock): a Master that died or hangs stops writing, the file goes stale, and status
asks the actors themselves instead. So a fresh file is as true as the Master's last round, and a
stale one is never reported.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["SNAPSHOT_MAX_AGE_S", "health_snapshot_path", "read_health_snapshot", "write_health_snapshot"]

# Fresh enough to report: a few Health Manager rounds (1 s each by default).
SNAPSHOT_MAX_AGE_S = 5.0


def health_snapshot_path(data_dir: str | Path, namespace: str) -> Path:
    return Path(data_dir) / "run" / f"health-{namespace}.json"


def write_health_snapshot(path: Path, payload: dict[str, Any]) -> None:
    """Write `payload` with its time stamp (`written_at`, seconds since the epoch), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps({**payload, "written_at": time.time()}, default=str)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_health_snapshot(path: Path, max_age_s: float = SNAPSHOT_MAX_AGE_S) -> dict[str, Any] | None:
    """The published health if the file is there, whole and at most `max_age_s` old; else None."""
    try:
        snapshot = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(snapshot, dict) or not {"written_at", "ping", "health", "beats"} <= snapshot.keys():
        return None
    age = time.time() - float(snapshot["written_at"])
    if not -1.0 <= age <= max_age_s:  # a clock step backwards by more than a second: not trusted either
        return None
    return {**snapshot, "age_s": max(0.0, age)}
