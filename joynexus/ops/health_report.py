"""`joynexus status`'s entries for the resident services, from the health the deployment's Master
publishes (`joynexus.master.health_snapshot`): no Ray driver, no actor calls, so status answers in
well under a second. When the published health is missing or stale (the Master died, hangs, or runs
on another host), `joynexus.ops.supervisor.status` asks the actors instead; both give the same rows.
"""

from __future__ import annotations

from typing import Any

from joynexus.actors import EXECUTION_PLANE_ACTORS, ROLE_OF_ACTOR
from joynexus.master.health_snapshot import health_snapshot_path, read_health_snapshot
from joynexus.settings import Settings

__all__ = ["master_detail", "published_health", "replica_summary", "role_entries"]

# The service actors' rows: actor name -> the Health Manager's role that watches it.
SERVICE_ROLE_OF = {name: ROLE_OF_ACTOR[name] for name in EXECUTION_PLANE_ACTORS}


def master_detail(ping: dict[str, Any]) -> str:
    return (
        f"Master Service {ping['incarnation']}: {ping['tenants']} tenants "
        f"({len(ping['unhealthy_tenants'])} unhealthy), {ping['running_workloads']} workloads running"
    )


def replica_summary(replicas: list[dict[str, Any]] | None) -> str:
    """'; replicas: 2 active, 1 draining' for a replica set's stats (nothing for one service)."""
    if not replicas:
        return ""
    states: dict[str, int] = {}
    for replica in replicas:
        states[replica["state"]] = states.get(replica["state"], 0) + 1
    return "; replicas: " + ", ".join(f"{n} {state}" for state, n in sorted(states.items()))


def role_entries(roles: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The Health Manager's truth per role (`MasterService.health()`) as status rows."""
    return {
        f"role {role}": {
            "healthy": entry["healthy"],
            "where": "joynexus.master" if entry.get("incarnation") is None else f"incarnation {entry['incarnation']}",
            "detail": f"{entry['restarts']} restarts; {entry['detail']}",
            "restarts": entry["restarts"],
        }
        for role, entry in roles.items()
        if role != "master"
    }


def published_health(settings: Settings) -> dict[str, dict[str, Any]] | None:
    """The service and role rows from the Master's published health; None unless it is fresh."""
    namespace = settings.ray_namespace
    snapshot = read_health_snapshot(health_snapshot_path(settings.data_dir, namespace))
    if snapshot is None or snapshot.get("namespace") != namespace:
        return None
    ping, roles, beats = snapshot["ping"], snapshot["health"], snapshot["beats"]
    as_of = f" (as of {snapshot['age_s']:.1f} s ago)"
    report: dict[str, dict[str, Any]] = {
        "joynexus.master": {
            "healthy": True,
            "where": f"{namespace}/joynexus.master",
            "detail": master_detail(ping) + as_of,
        }
    }
    for name, role in SERVICE_ROLE_OF.items():
        state, beat = roles.get(role, {}), beats.get(role) or {}
        entry: dict[str, Any] = {"healthy": bool(state.get("healthy")), "where": f"{namespace}/{name}"}
        if not entry["healthy"]:
            entry["detail"] = f"{state.get('detail', 'no heartbeat')}{as_of}"
        elif role == "training_queue":
            entry["depth"] = int(beat.get("partitions", 0))
            entry["detail"] = f"Training Queue depth: {entry['depth']} partitions"
        elif role == "training_service":
            entry["detail"] = f"{len(beat.get('tenants', []))} tenant slots"
        elif role == "inference_service":
            entry["depth"] = int(beat.get("queue_depth", 0))
            entry["detail"] = (
                f"Inference Queue depth: {entry['depth']} requests; {len(beat.get('tenants', []))} tenants served"
                + replica_summary(beat.get("replicas"))
            )
        else:
            entry["detail"] = "alive"
        report[name] = entry
    report.update(role_entries(roles))
    return report
