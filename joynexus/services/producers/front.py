"""The producer replicas' front (issue 40): which replica runs which tenant's work.

A tenant goes to the least loaded live replica the first time it needs one and stays there
(sticky: its weight syncs, producers and evaluations share one replica's sessions and caches).
When a replica dies, or comes back as a new incarnation without its work, `poll()` moves each of
its workloads to another replica: `on_move(workload_id, tenant_id, lost_owners)` first lets the
Master take back what the dead producer held (a job it was writing, its advantage leases: the
Training Scheduler's rules, so no version is lost or issued twice), then the workload starts
again from its request.

The front lives in the Master's process and holds no data: requests, states and reasons. The
replicas are typed handles (`actors.service_handle`): local `ProducerService` objects in one
process, named Ray actors in a deployment; the code is the same. A new Master's front learns the
running work from the replicas themselves (`sync`), so nothing runs twice after a Master restart.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from joynexus.actors import role_unavailable

if TYPE_CHECKING:  # names the type only: the Master never imports the producers' loops
    from joynexus.services.producers.service import ProducerService

log = logging.getLogger(__name__)


class NoProducerReplica(RuntimeError):
    """Every producer replica is unreachable."""


class ProducerFront:
    def __init__(self, replicas: Sequence[ProducerService]):
        if not replicas:
            raise ValueError("a deployment needs at least one producer replica")
        self.replicas = list(replicas)
        self.on_move: Callable[[str, str, set[str]], None] | None = None
        self._lock = threading.RLock()
        self._dead: set[int] = set()
        self._tenant: dict[str, int] = {}  # tenant -> replica (sticky)
        self._work: dict[str, tuple[int, str, str, dict[str, Any]]] = {}  # workload -> (replica, tenant, kind, request)
        self._seen: dict[int, dict[str, Any]] = {}  # replica -> its last poll (incarnation, owners)
        self._synced = False
        self._lost: set[str] = set()  # lease owners of replicas gone since `take_lost_owners`
        self._placing = threading.Lock()  # a stop and a move of one workload never interleave
        self.moves = 0

    # -- placement ----------------------------------------------------------------------------------
    def sync(self) -> None:
        """Learn what the replicas run (a Master that just started knows nothing yet)."""
        with self._lock:
            if self._synced:
                return
            self._synced = True
        for index in range(len(self.replicas)):
            report = self._poll_one(index)
            if report is None:
                continue
            with self._lock:
                self._seen[index] = {"incarnation": report["incarnation"], "owners": report["owners"]}
                for workload_id, entry in report["work"].items():
                    if entry["state"] == "running" or workload_id not in self._work:
                        self._work[workload_id] = (index, entry["tenant_id"], entry["kind"], entry["request"])
                        self._tenant.setdefault(entry["tenant_id"], index)

    def replica_of(self, tenant_id: str, avoid: int | None = None) -> int:
        """The tenant's replica: where it is, else the least loaded live one (other than `avoid`
        while another answers)."""
        self.sync()
        with self._lock:
            index = self._tenant.get(tenant_id)
            if index is not None and index not in self._dead:
                return index
            alive = [i for i in range(len(self.replicas)) if i not in self._dead]
            if not alive:
                raise NoProducerReplica("no producer replica answers")
            alive = [i for i in alive if i != avoid] or alive
            load = {i: 0 for i in alive}
            for placed in self._tenant.values():
                if placed in load:
                    load[placed] += 1
            index = min(alive, key=lambda i: (load[i], i))
            self._tenant[tenant_id] = index
            return index

    def _call(
        self, tenant_id: str, method: str, *args: Any, avoid: int | None = None, **kwargs: Any
    ) -> tuple[int, Any]:
        """Call the tenant's replica; one that is gone is marked dead and the next one is tried."""
        for _ in range(len(self.replicas)):
            index = self.replica_of(tenant_id, avoid)
            try:
                return index, getattr(self.replicas[index], method)(*args, **kwargs)
            except Exception as error:
                if not role_unavailable(error):
                    raise
                self._mark_dead(index, error)
        raise NoProducerReplica("no producer replica answers")

    def _mark_dead(self, index: int, error: BaseException) -> None:
        log.warning("producer replica %d is gone: %s", index, type(error).__name__)
        with self._lock:
            self._dead.add(index)
            for tenant_id in [t for t, i in self._tenant.items() if i == index]:
                del self._tenant[tenant_id]

    # -- work ---------------------------------------------------------------------------------------
    def start_workload(self, workload_id: str, tenant_id: str, **request: Any) -> int:
        index, _ = self._call(tenant_id, "start_workload", workload_id, tenant_id, **request)
        with self._lock:
            self._work[workload_id] = (index, tenant_id, request["task"], request)
        return index

    def start_evaluation(self, workload_id: str, tenant_id: str, **request: Any) -> int:
        index, _ = self._call(tenant_id, "start_evaluation", workload_id, tenant_id, **request)
        with self._lock:
            self._work[workload_id] = (index, tenant_id, "eval", request)
        return index

    def stop_workload(self, workload_id: str) -> None:
        with self._placing:
            with self._lock:
                placed = self._work.pop(workload_id, None)
            if placed is None:
                return
            try:
                self.replicas[placed[0]].stop_workload(workload_id)
            except Exception as error:
                if not role_unavailable(error):
                    raise  # a replica that is gone stopped it already

    def running_workloads(self) -> set[str]:
        self.sync()
        with self._lock:
            return set(self._work)

    def publish_weights(self, tenant_id: str) -> int:
        return int(self._call(tenant_id, "publish_weights", tenant_id)[1])

    def serve_version(self, tenant_id: str, version: int, *, from_slot: bool = False) -> None:
        self._call(tenant_id, "serve_version", tenant_id, version, from_slot=from_slot)

    def publish_trained(self, tenant_id: str, run_id: str | None) -> int:
        return int(self._call(tenant_id, "publish_trained", tenant_id, run_id)[1])

    def publish_installed(self, tenant_id: str, version: int, provenance: dict[str, str]) -> dict[str, Any]:
        return dict(self._call(tenant_id, "publish_installed", tenant_id, version, provenance)[1])

    def measure(self, tenant_id: str, policy_version: int) -> dict[str, float]:
        return dict(self._call(tenant_id, "measure", tenant_id, policy_version)[1])

    def compile_tenant(self, tenant_id: str, spec: dict[str, Any]) -> dict[str, Any]:
        """Have the (new) tenant's replica check and compile its spec (the model stack stays there)."""
        return dict(self._call(tenant_id, "compile_tenant", spec)[1])

    def rollout_stats(self, workload_id: str) -> dict[str, float]:
        with self._lock:
            placed = self._work.get(workload_id)
        if placed is None:
            return {}
        try:
            return dict(self.replicas[placed[0]].rollout_stats(workload_id))
        except Exception as error:
            if role_unavailable(error):
                return {}  # its episodes went with the replica; the moved producer counts anew
            raise

    # -- following ----------------------------------------------------------------------------------
    def _poll_one(self, index: int) -> dict[str, Any] | None:
        try:
            report = self.replicas[index].poll()
        except Exception as error:
            if not role_unavailable(error):
                raise
            self._mark_dead(index, error)
            return None
        with self._lock:
            self._dead.discard(index)  # a replica restarted in place answers again
        return report

    def poll(self) -> dict[str, dict[str, Any]]:
        """Each placed workload's report (state, error, result, events, waits) from its replica;
        the workloads of replicas that are gone or lost them are moved (`on_move`) and reported
        with `moved_to`."""
        self.sync()
        with self._lock:  # before asking: work placed while the replicas answer is not taken for lost
            placed = dict(self._work)
        reports: dict[str, dict[str, Any]] = {}
        lost_owners: set[str] = set()
        answered: dict[int, dict[str, Any]] = {}
        for index in range(len(self.replicas)):
            report = self._poll_one(index)
            with self._lock:
                previous = self._seen.get(index)
            if report is None:
                if previous is not None:
                    lost_owners.update(previous["owners"])
                continue
            if previous is not None and previous["incarnation"] != report["incarnation"]:
                lost_owners.update(previous["owners"])  # restarted in place: its old leases are gone
                self._unassign(index)
            answered[index] = report
            with self._lock:
                self._seen[index] = {"incarnation": report["incarnation"], "owners": report["owners"]}
            reports.update(report["work"])
        with self._lock:
            for index in range(len(self.replicas)):
                if index not in answered:
                    self._seen.pop(index, None)
            self._lost |= lost_owners
        for workload_id, (index, tenant_id, kind, request) in placed.items():
            if index in answered and workload_id in answered[index]["work"]:
                continue
            moved = self._move(workload_id, index, tenant_id, kind, request, lost_owners)
            if moved is None:
                continue  # stopped meanwhile
            reports[workload_id] = {"tenant_id": tenant_id, "kind": kind, "state": "running", "error": None,
                                    "result": None, "events": [], "waits": 0, "moved_to": moved}  # fmt: skip
        return reports

    def _unassign(self, index: int) -> None:
        with self._lock:
            for tenant_id in [t for t, i in self._tenant.items() if i == index]:
                del self._tenant[tenant_id]

    def _move(
        self, workload_id: str, old: int, tenant_id: str, kind: str, request: dict[str, Any], lost: set[str]
    ) -> int | None:
        """Start a workload whose replica lost it on the tenant's (new) replica; None when it was
        stopped meanwhile (its workload ended)."""
        with self._placing:
            with self._lock:
                if self._work.get(workload_id, (None,))[0] != old:
                    return None
                if self._tenant.get(tenant_id) == old:
                    del self._tenant[tenant_id]  # prefer another replica than the one that lost it
            if self.on_move is not None:
                self.on_move(workload_id, tenant_id, lost)
            method = "start_evaluation" if kind == "eval" else "start_workload"
            index, _ = self._call(tenant_id, method, workload_id, tenant_id, avoid=old, **request)
            with self._lock:
                self._work[workload_id] = (index, tenant_id, kind, request)
                self.moves += 1
        log.warning("workload %s moved from producer replica %s to %d", workload_id, old, index)
        return index

    def take_lost_owners(self) -> set[str]:
        """The lease owners of replicas found gone since the last call (their leases are orphans)."""
        with self._lock:
            lost, self._lost = self._lost, set()
        return lost

    def live_owners(self) -> set[str]:
        """The lease owners of the replicas that answered last (their producers and stages)."""
        with self._lock:
            return {owner for seen in self._seen.values() for owner in seen["owners"]}

    def health(self) -> dict[str, Any]:
        with self._lock:
            dead, total = len(self._dead), len(self.replicas)
            running = len(self._work)
            replicas = [
                {
                    "replica": index,
                    "answers": index not in self._dead,
                    "tenants": sorted(t for t, i in self._tenant.items() if i == index),
                    "workloads": sorted(w for w, placed in self._work.items() if placed[0] == index),
                }
                for index in range(total)
            ]
        each = "; ".join(
            f"#{r['replica']}{'' if r['answers'] else ' gone'}: {len(r['tenants'])} tenants, "
            f"{len(r['workloads'])} workloads"
            for r in replicas
        )
        return {
            "healthy": dead < total,
            "restarts": self.moves,
            "replicas": replicas,
            "detail": f"{total - dead} of {total} producer replicas answer ({each}); {running} workloads placed, "
            f"{self.moves} moved",
        }
