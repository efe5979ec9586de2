"""Upgrades by drain-and-replace (issue 43.6): new image -> new actors, no version lost.

Why not in place: KubeRay v1.4.2 does not replace running Ray pods when the RayCluster's image
changes, and `named_actor` reuses a running actor (`get_if_exists`), so a new release would keep the
old code running. Every Master records the release of its code (`Settings.release`, the image tag:
`JOYNEXUS_RELEASE` in `joynexus-config`, written by render-deployment). The services driver of a new
release (the Job `joynexus-services`, `joynexus up`) calls `replace_older_release` before it creates
anything; when the running Master is of another release it

1. drains it (`MasterService.drain`): admission paused, the loops stopped after their in-flight
   steps (running workloads stay `running` in the store), every tenant slot checkpointed;
2. kills every named actor of the deployment's namespace (no restart), so nothing of the old code
   answers by name;
3. waits until every Ray node runs this release (bootstrap-cluster deletes the Ray pods once the
   driver logs `OLD_ACTORS_GONE`; KubeRay makes them again from the new template).

The driver then creates the actors from the new code, and the new Master restores every tenant from
its checkpoint and resumes the running workloads from their recorded progress (its restart path).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

OLD_ACTORS_GONE = "the previous release's actors are gone"  # bootstrap-cluster waits for this line
NODE_PROBE_TIMEOUT_S = 30.0


def running_master_release(namespace: str | None) -> str | None:
    """The release of the deployment's running Master; None when none runs, "unknown" for a Master of
    a release from before Masters recorded it."""
    import ray

    from joynexus.master.service import MASTER_ACTOR

    try:
        master = ray.get_actor(MASTER_ACTOR, namespace=namespace)
    except ValueError:
        return None
    return str(ray.get(master.ping.remote(), timeout=120).get("release") or "unknown")


def node_releases(timeout_s: float = NODE_PROBE_TIMEOUT_S) -> dict[str, str]:
    """Node id -> the release its pod runs, for every alive Ray node (a task pinned to each; a node
    that does not answer in time, e.g. one being deleted, reads "no answer")."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from joynexus.settings import process_release

    probe = ray.remote(num_cpus=0, max_retries=0)(process_release)
    refs = {
        node["NodeID"]: probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
        ).remote()
        for node in ray.nodes()
        if node.get("Alive")
    }
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    answered = set(ready)
    out = {}
    for node, ref in refs.items():
        try:
            out[node] = ray.get(ref) if ref in answered else "no answer"
        except Exception as error:  # a node that went away under the probe
            out[node] = f"no answer ({type(error).__name__})"
    return out


def kill_named_actors(namespace: str | None, timeout_s: float = 120.0) -> list[str]:
    """Kill every named actor of `namespace` without restart; returns their names once none answers
    by name any more (TimeoutError naming the rest otherwise)."""
    import ray

    def named() -> list[str]:
        return sorted(
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == namespace
        )

    killed = named()
    for name in killed:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:  # gone already (an owned replica that went with its set)
            pass
    deadline = time.monotonic() + timeout_s
    while (left := named()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        raise TimeoutError(f"named actors still alive {timeout_s:.0f} s after they were killed: {left}")
    return killed


def replace_older_release(
    release: str, namespace: str | None, deadline: float, stage: Callable[[str], None]
) -> dict[str, Any] | None:
    """Drain and kill a deployment of another release than `release`, then wait for Ray nodes of this
    one (see the module doc). None when nothing of another release runs; else what was drained."""
    import ray

    running = running_master_release(namespace)
    report: dict[str, Any] | None = None
    if running is not None and running != release:
        from joynexus.master.service import MASTER_ACTOR

        stage(f"draining the Master of release {running} for release {release}")
        master = ray.get_actor(MASTER_ACTOR, namespace=namespace)
        try:
            report = dict(ray.get(master.drain.remote(), timeout=max(1.0, deadline - time.monotonic())))
        except AttributeError:  # a Master from before drains existed: its tenants restore from their last checkpoints
            report = {"release": running, "drained": False}
        report["killed"] = kill_named_actors(namespace)
        stage(f"{OLD_ACTORS_GONE}: {report}")
    waiting = False
    while True:
        releases = node_releases()
        other = {node[:12]: r for node, r in releases.items() if r != release}
        if not other:
            return report
        if report is None and running is None and not waiting:
            # no Master runs, but nodes of another release do (a driver restarted after its kill)
            stage(f"{OLD_ACTORS_GONE}: no Master runs; Ray nodes of another release {other}")
        if not waiting:
            stage(f"waiting for the Ray pods of release {release} (bootstrap-cluster replaces {other})")
            waiting = True
        if time.monotonic() > deadline:
            raise SystemExit(f"Ray nodes of another release than {release} still run: {other}")
        time.sleep(2.0)
