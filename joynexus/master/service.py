"""The Master Service (paper section 4.1.1): ONE per deployment.

It owns the control plane's moving parts: the tenant creator, the workload manager with its
admission queue, the shared actor loop and the advantage stage. Every entry point (the tenant API
server, the Prefect flows, the CLI, the main job) is a client of it through a typed handle
(`joynexus.connect`), so two drivers can never lease each other's jobs.

In a deployment it is the named, detached Ray actor `joynexus.master` (threaded: a client blocked
in `wait_workload` does not hold up the others); in one process (tests, `--services in-process`)
the same class is a local object. On start it gives every tenant its slot (a tenant whose slot
cannot be built, e.g. a corrupt checkpoint, is marked unhealthy with the reason and the others are
served), reconciles the store with what survived (`WorkloadManager.reconcile`) and starts the
actor loop and advantage stage.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

from joynexus.actors import handle_of, named_actor
from joynexus.core.serving_sets import ServingSetStore
from joynexus.core.tenants import Tenant
from joynexus.data.sources import resolve_dataset, resolve_dataset_source
from joynexus.data.uploads import delete_tenant_datasets
from joynexus.master.deployment import Deployment
from joynexus.master.errors import TenantUnavailable
from joynexus.master.health import HealthManager
from joynexus.master.health_snapshot import health_snapshot_path, write_health_snapshot
from joynexus.master.options import MasterOptions
from joynexus.master.tenant_slots import add_slot
from joynexus.master.workloads.manager import FINAL_WORKLOAD_STATES, AdmissionRefused, WorkloadManager
from joynexus.protocol.schemas import WorkloadInfo
from joynexus.scheduling.training_scheduler import TERMINAL_STATES
from joynexus.settings import Settings
from joynexus.spec import DatasetSpec, SpecError, TaskType, WorkloadSpec, parse_workload_spec

log = logging.getLogger(__name__)

MASTER_ACTOR = "joynexus.master"
# The services the Health Manager watches (`health()` roles; their beats go into the published health).
SERVICE_ROLES = ("training_queue", "training_service", "inference_service", "environment_service")
UNHEALTHY = "unhealthy"


class MasterService:
    def __init__(
        self,
        settings: Settings | None = None,
        *,
        deployment: Deployment | None = None,
        options: MasterOptions | None = None,
        detached: bool = False,
        publish_health: bool = False,
    ):
        """`publish_health`: write the health after every round for `joynexus status` (the detached
        Master of a deployment; master/health_snapshot.py)."""
        self.options = options or MasterOptions()
        self.deployment = deployment or Deployment.start(settings, detached=detached)
        self.settings = self.deployment.settings
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        self._published_ping: tuple[float, dict[str, Any]] | None = None
        from joynexus.master.usage import UsageLedger

        self.ledger = UsageLedger(
            self.deployment.store,
            checkpoints=self.deployment.checkpoints,
            default_max_device_seconds=self.options.default_max_device_seconds,
            default_max_queued_workloads=self.options.default_max_queued_workloads,
            default_max_storage_bytes=self.options.default_max_storage_bytes,
            datasets_dir=self.settings.data_dir / "datasets",
        )
        self.workloads = WorkloadManager(
            self.deployment,
            owner=f"master-{self.incarnation}",
            max_running=self.options.max_running_workloads,
            max_failures_per_workload=self.options.max_failures_per_workload,
            max_job_attempts=self.options.max_job_attempts,
            admission_check=self._check_spend,
            max_queued=lambda tenant_id: self.ledger.quota(tenant_id).max_queued_workloads,
        )
        self._restore_tenant_slots()
        from joynexus.master.tenant_lifecycle import TenantHousekeeping

        self.housekeeping = TenantHousekeeping(
            self.deployment,
            self._restore_slot,
            sweep_every_s=self.options.leftover_sweep_interval_s,
            leftover_grace_s=self.options.leftover_grace_s,
            retry_unhealthy_every_s=self.options.unhealthy_retry_interval_s,
        )
        self.last_serving_restore = self._restore_serving_sets()
        self.last_reconcile = self.workloads.reconcile()
        if any(self.last_reconcile.values()):
            log.warning("reconciled after a restart: %s", self.last_reconcile)
        self.workloads.start()
        self.workloads.admit()
        dep = self.deployment
        self.health_manager = HealthManager(
            {
                "training_queue": handle_of(dep.queue).target,
                "training_service": dep.training_service,
                "inference_service": dep.inference_service,
                "environment_service": dep.environment_service,
            },
            check_roles=self._check_roles,
            on_restart=self._restore_role,
            options=self.options.health,
            on_round=self._publish_health if publish_health else None,
        ).start()
        self.workloads.on_unavailable = self.health_manager.check_now
        from joynexus.master.evaluation_declarations import EvaluationDeclarations

        self.declarations = EvaluationDeclarations(self.deployment, self.workloads)
        self.draining = False  # an upgrade drains this Master (ops/upgrade.py): nothing is admitted
        self.workloads.admission_paused = lambda: self.draining or bool(self.health_manager.escalated())

    def _check_roles(self, stale_after_s: float) -> dict[str, dict[str, Any]]:
        """Every Health Manager round: the Master's own roles, and the housekeeping that is due."""
        roles = self.workloads.check_roles(stale_after_s)
        self.housekeeping.tick()
        return roles

    def _check_spend(self, tenant_id: str) -> None:
        from joynexus.master.usage import SpendCapReached

        # A hung role whose restart budget is spent pauses admission until it answers again.
        escalated = self.health_manager.escalated() if hasattr(self, "health_manager") else {}
        if escalated:
            role, reason = next(iter(sorted(escalated.items())))
            raise AdmissionRefused(f"admission paused: role {role} is {reason}")

        try:
            self.ledger.check_spend(tenant_id)
        except SpendCapReached as error:
            raise AdmissionRefused(str(error)) from None

    # -- service ----------------------------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        """Cheap liveness answer: which incarnation is serving, since when, what it holds."""
        tenants = self.deployment.creator.list()
        return {
            "incarnation": self.incarnation,
            "release": self.settings.release,  # the code it runs: an upgrade replaces a Master of another
            "draining": self.draining,
            "started_at": self.started_at,
            "pid": os.getpid(),
            "tenants": len(tenants),
            "unhealthy_tenants": {t.tenant_id: t.status_reason for t in tenants if t.status == UNHEALTHY},
            "running_workloads": self.workloads.running_count(),
            "reconciled": self.last_reconcile,
        }

    def process_report(self) -> dict[str, Any]:
        """What this process has loaded (issue 40's guard: the Master is a control plane): the model
        and simulator stacks, and the execution-plane modules that build observations, batches or
        weight payloads. Both lists stay empty in a deployment whose producers run elsewhere."""
        import sys

        heavy = {"torch", "transformers", "lerobot", "mani_skill", "gymnasium", "gym_pusht"}
        data = (
            "joynexus.scheduling.inference_queue", "joynexus.services.producers.rollout",
            "joynexus.services.producers.sft", "joynexus.services.producers.service", "joynexus.models",
            "joynexus.data.lerobot_dataset",
        )  # fmt: skip
        return {
            "pid": os.getpid(),
            "heavy_modules": sorted({m.split(".")[0] for m in list(sys.modules) if m.split(".")[0] in heavy}),
            "data_modules": sorted(m for m in data if m in sys.modules),
        }

    def health(self) -> dict[str, dict[str, Any]]:
        """The truth per role: this Master, its own threads (actor loop, advantage stage, admission,
        producers) and every service it drives, from the Health Manager's last round."""
        master = {
            "healthy": True,
            "incarnation": self.incarnation,
            "last_beat_s": 0.0,
            "restarts": 0,
            "detail": f"up {time.time() - self.started_at:.0f} s; {self.workloads.running_count()} workloads running",
        }
        return {"master": master, **self.health_manager.report()}

    def _publish_health(self) -> None:
        """`health()`, the services' last beats and (every few seconds) `ping()` as the file
        `joynexus status` reads without a Ray driver (master/health_snapshot.py)."""
        manager = getattr(self, "health_manager", None)
        if manager is None:  # the first round runs inside HealthManager.start(), before it is assigned
            return
        now = time.monotonic()
        if self._published_ping is None or now - self._published_ping[0] >= 5.0:  # ping lists the tenants
            self._published_ping = (now, self.ping())
        write_health_snapshot(
            health_snapshot_path(self.settings.data_dir, self.settings.ray_namespace),
            {
                "namespace": self.settings.ray_namespace,
                "ping": self._published_ping[1],
                "health": self.health(),
                "beats": {role: manager.last_beat(role) for role in SERVICE_ROLES},
            },
        )

    def role_beat(self, role: str) -> dict[str, Any]:
        """The last heartbeat of a service role (where it runs: pid, incarnation, what it holds)."""
        return self.health_manager.last_beat(role)

    def _restore_role(self, role: str, previous: dict[str, Any], beat: dict[str, Any]) -> str:
        """A service restarted in place (a new incarnation): give it back what its previous life held."""
        dep = self.deployment
        if role == "training_service":
            tenants = dep.creator.list()
            for tenant in tenants:
                self._restore_slot(tenant)
            return f"restored {len(tenants)} tenant slots from their last checkpoints"
        if role == "inference_service":
            return self._restore_serving_sets(previous.get("tenants", []))
        if role == "training_queue":
            released = 0
            for job in dep.scheduler.jobs():
                if job.state in TERMINAL_STATES or job.state == "reserved" or dep.queue.has_partition(job.partition_id):
                    continue  # a reserved job's producer is writing it (to the new queue, or it fails)
                dep.scheduler.abandon(job.job_id, "its data was lost with a restart of the Training Queue")
                released += 1
            return f"released {released} jobs whose data was lost; producers make new ones"
        return "sessions of its previous life are gone; rollout producers open new ones"

    def _restore_serving_sets(self, served_before: list[str] | None = None) -> str:
        """What each tenant was served, from the store (`serving_restore.py`); a tenant the service
        served before without a recorded set (a store from before sets were recorded) gets its
        current version, as it used to."""
        from joynexus.master.serving_restore import describe, restore_serving_sets

        try:
            account = restore_serving_sets(self.deployment)
            recorded = set(ServingSetStore(self.deployment.store).all())
            unrecorded = set(served_before or ()) - recorded
            # A recorded tenant none of whose versions could be loaded still gets its current one.
            unrecorded |= {t for t in recorded if t in account and not self.deployment.inference_service.versions(t)}
        except Exception as error:  # the service is away: its restart restores it (Health Manager)
            log.warning("serving sets not restored: %s", _reason(error))
            return f"serving sets not restored: {_reason(error)}"
        for tenant_id in sorted(unrecorded):
            try:
                self.workloads.publish_weights(tenant_id)
            except Exception as error:  # that tenant is served again by its next workload
                log.warning("serving tenant %s again failed: %s", tenant_id, _reason(error))
        if account:
            log.warning("serving sets: %s", account)
        return describe(account)

    def capabilities(self) -> Any:
        return self.deployment.training_service.capabilities()

    def shutdown(self, *, cancel_running: bool = False) -> None:
        """Stop the actor loop and advantage stage; running workloads stay `running` in the store
        unless `cancel_running`, so the next Master resumes them."""
        self.health_manager.stop()
        self.workloads.stop(cancel_running=cancel_running)

    def drain(self) -> dict[str, Any]:
        """Before an upgrade replaces this Master and the services (ops/upgrade.py): admit nothing
        more (submissions wait in the store), stop the loops once their in-flight steps are done
        (running workloads stay `running` in the store: the next Master resumes them from their
        recorded progress), then checkpoint every tenant slot, so the new Training Model Service
        restores each tenant at its last version. Jobs still leased are re-queued by the next
        Master's reconcile."""
        from joynexus.scheduling.training_jobs import LEASED_STATES

        self.draining = True
        running = self.workloads.running_count()
        self.shutdown(cancel_running=False)
        leased = [job.job_id for job in self.deployment.scheduler.jobs() if job.state in LEASED_STATES]
        saved = self.deployment.training_service.save()
        return {
            "release": self.settings.release,
            "running_workloads": running,
            "leased_jobs_left": leased,
            "checkpointed": {m["tenant_id"]: m["policy_version"] for m in saved},
        }

    def close(self) -> None:
        """Shut down and release what this process holds (an in-process deployment's services).
        Running workloads stay `running` in the store: the next Master on it resumes them."""
        self.shutdown(cancel_running=False)
        self.deployment.shutdown()

    # -- tenants ----------------------------------------------------------------------------------
    def create_tenant(
        self,
        spec: WorkloadSpec | dict[str, Any],
        *,
        starts_from_checkpoint: bool = False,
        dataset_owner: str | None = None,
    ) -> Tenant:
        """Validate (every check that can fail runs before anything is written), persist, and give
        the tenant its slot. A slot that still cannot be built removes the tenant again: no
        half-made tenant is left behind. `starts_from_checkpoint`: the caller (a fork) wrote the
        new tenant's version 0 itself, after checking that the id had no checkpoints. `dataset_owner`:
        the tenant whose uploads a `dataset.id` names (default the new tenant; a fork's source)."""
        if not isinstance(spec, WorkloadSpec):
            spec = parse_workload_spec(spec)
        spec = resolve_dataset_source(spec, self.settings, owner=dataset_owner)
        from joynexus.master.tenant_lifecycle import check_id_reusable

        if not starts_from_checkpoint:
            check_id_reusable(self.deployment, spec.tenant)  # no inheriting an earlier tenant's checkpoints
        tenant = self.deployment.creator.create(spec)
        try:
            add_slot(self.deployment.training_service, tenant)
        except Exception as error:
            reason = _reason(error)
            log.warning("tenant %s: the backend could not build its slot (%s); removing it", tenant.tenant_id, reason)
            self._forget_tenant(tenant.tenant_id, delete_artifacts=False, retire_id=False)
            raise SpecError([("action_module", f"the backend could not build this tenant: {reason}")]) from None
        return tenant

    def get_tenant(self, tenant_id: str) -> Tenant:
        """The tenant; an unhealthy one has its slot tried again first (rate-limited), so a
        repaired checkpoint is picked up without a restart."""
        tenant = self.deployment.creator.get(tenant_id)
        return self.housekeeping.heal(tenant) if tenant.status == UNHEALTHY else tenant

    def list_tenants(self) -> list[Tenant]:
        return self.deployment.creator.list()

    def check_tenant(self, tenant_id: str) -> Tenant:
        """The tenant if it is healthy; TenantUnavailable (with the reason) if not; KeyError if absent."""
        tenant = self.get_tenant(tenant_id)
        if tenant.status == UNHEALTHY:
            raise TenantUnavailable(tenant_id, tenant.status_reason or "unknown")
        return tenant

    def delete_tenant(self, tenant_id: str, *, delete_artifacts: bool = False) -> dict[str, Any]:
        """Remove a tenant: its workloads are cancelled, its jobs released, its queue partitions,
        slots, serving states, sessions, keys, quota and usage rows removed; with
        `delete_artifacts` its checkpoints and registered model too. Without them (or when deleting
        them failed) the id stays retired: no new tenant may take it until `purge_tenant_artifacts`."""
        self.deployment.creator.get(tenant_id)  # KeyError if absent
        for status in self.workloads.list(tenant_id):
            if status.state not in FINAL_WORKLOAD_STATES:
                self.workloads.cancel(status.workload_id)
        return self._forget_tenant(tenant_id, delete_artifacts=delete_artifacts)

    def purge_tenant_artifacts(self, tenant_id: str) -> dict[str, Any]:
        """Delete a deleted tenant's kept checkpoints and registered model, and free its id."""
        from joynexus.master.tenant_lifecycle import purge

        return purge(self.deployment, tenant_id)

    def _forget_tenant(self, tenant_id: str, *, delete_artifacts: bool, retire_id: bool = True) -> dict[str, Any]:
        dep = self.deployment
        report: dict[str, Any] = {"tenant_id": tenant_id}
        for job in dep.scheduler.jobs(tenant_id=tenant_id):
            dep.scheduler.abandon(job.job_id, f"tenant {tenant_id!r} deleted")
        steps = (
            ("queue_partitions", lambda: dep.queue.clear_tenant(tenant_id)),
            ("training_slot", lambda: dep.training_service.remove_tenant(tenant_id)),
            ("serving_versions", lambda: dep.inference_service.remove_tenant(tenant_id)),
            ("sessions", lambda: dep.environment_service.close_tenant(tenant_id)),
            ("serving_set", lambda: ServingSetStore(dep.store).forget(tenant_id)),  # also if inference is away
        )
        if delete_artifacts:
            steps += (
                ("checkpoint_objects", lambda: dep.checkpoints.delete_tenant(tenant_id)),
                ("registered_model", lambda: dep.tracker.delete_tenant_model(tenant_id)),
                ("uploaded_datasets", lambda: delete_tenant_datasets(self.settings.data_dir / "datasets", tenant_id)),
            )
        for name, step in steps:
            try:
                report[name] = step()
            except Exception as error:  # keep deleting: what is left is reported, the rows go anyway
                report[name] = f"not removed: {_reason(error)}"
                log.warning("deleting tenant %s: %s failed: %s", tenant_id, name, _reason(error))
        from joynexus.master.tenant_lifecycle import retired_reason

        retired = retired_reason(report, delete_artifacts) if retire_id else None
        dep.creator.delete(tenant_id, tombstone=retired)
        report["tenant_id_reusable"] = "yes" if retired is None else f"no: {retired}"
        return report

    def _restore_tenant_slots(self) -> None:
        for tenant in self.deployment.creator.list():
            self._restore_slot(tenant)

    def _restore_slot(self, tenant: Tenant) -> None:
        try:
            add_slot(self.deployment.training_service, tenant)
        except Exception as error:
            reason = _reason(error)
            log.warning("tenant %s is unhealthy: %s", tenant.tenant_id, reason)
            self.deployment.creator.mark_unhealthy(tenant.tenant_id, reason)
            return
        if tenant.status == UNHEALTHY:
            self.deployment.creator.mark_healthy(tenant.tenant_id)

    # -- workloads: the API's and Ray clients' names for the WorkloadManager's calls --------------
    def submit_workload(
        self, tenant_id: str, *, jobs: int | None = None, dataset: DatasetSpec | dict[str, Any] | None = None
    ) -> WorkloadInfo:
        """Queue a training workload; `dataset` (SFT) trains on another dataset than the tenant's:
        one it uploaded (`dataset.id`), resolved here to the stored copy (a SpecError naming
        `dataset.id` when the tenant has no such upload)."""
        tenant = self.check_tenant(tenant_id)
        resolved = None
        if dataset is not None:
            dataset = dataset if isinstance(dataset, DatasetSpec) else DatasetSpec.model_validate(dataset)
            if dataset.id is None:
                raise SpecError([("dataset.id", "a workload names an uploaded dataset by its id (POST /v1/datasets)")])
            if tenant.spec.task is not TaskType.SFT:
                reason = f"tenant {tenant_id!r} trains by {tenant.spec.task.value!r}, not on a dataset"
                raise SpecError([("dataset.id", reason)])
            resolved = resolve_dataset(dataset, tenant_id, self.settings).model_dump(mode="json")
        return self.workloads.submit(tenant_id, jobs=jobs, dataset=resolved)

    def evaluate(
        self,
        tenant_id: str,
        *,
        version: int | str = "latest",
        episodes: int = 4,
        environment: dict[str, Any] | None = None,
        suite: list[dict[str, Any]] | None = None,
        videos: int = 0,
    ) -> WorkloadInfo:
        self.check_tenant(tenant_id)
        return self.workloads.evaluate(
            tenant_id, version=version, episodes=episodes, environment=environment, suite=suite, videos=videos
        )

    def promote(self, tenant_id: str, registry_version: int | None = None) -> dict[str, Any]:
        """The promotion rule (workloads/promotion.py) on a registered version, default the tenant's
        `candidate`: measured by its declared metric if not yet, then `champion` moves if it wins."""
        self.deployment.creator.get(tenant_id)  # KeyError for an unknown tenant
        return self.workloads.promote(tenant_id, registry_version)

    def measure_version(self, tenant_id: str, registry_version: int) -> dict[str, float]:
        """Measure a registered version by the tenant's promotion metric (simulator success rate or
        held-out loss) again, log the metrics on the version and return them."""
        tenant = self.deployment.creator.get(tenant_id)
        tags = self.deployment.tracker.model_version_tags(tenant_id, registry_version)
        return self.workloads.measure_version(tenant, int(registry_version), int(tags["policy_version"]))

    def get_workload(self, workload_id: str, tenant_id: str | None = None) -> WorkloadInfo:
        return self.workloads.get(workload_id, tenant_id)

    def list_workloads(self, tenant_id: str | None = None) -> list[WorkloadInfo]:
        return self.workloads.list(tenant_id)

    def cancel_workload(self, workload_id: str, tenant_id: str | None = None) -> WorkloadInfo:
        return self.workloads.cancel(workload_id, tenant_id)

    def workload_events(self, workload_id: str, after: int = 0, tenant_id: str | None = None) -> list[dict[str, Any]]:
        return self.workloads.events(workload_id, after, tenant_id)

    def wait_workload(self, workload_id: str, timeout_s: float = 30.0) -> WorkloadInfo:
        """Wait up to min(timeout_s, options.max_wait_s) for the workload to end; clients loop."""
        return self.workloads.wait(workload_id, min(timeout_s, self.options.max_wait_s))

    def workload_losses(self, workload_id: str) -> list[float]:
        return self.workloads.losses(workload_id)

    # -- metrics (joynexus.ops.metrics: one call per scrape) ----------------------------------------
    def learning_signals(self) -> dict[str, dict[str, float]]:
        """Per tenant, the latest loss, PPO statistics and rollout returns (from workload events)."""
        from joynexus.master.signals import learning_signals

        return learning_signals(self.deployment.store)

    def metrics_snapshot(self) -> dict[str, Any]:
        """Control and learning signals for a metrics scrape, as plain data (a few aggregate store
        queries; no call to the services, so a busy Training Model Service never stalls a scrape)."""
        from joynexus.master.signals import control_signals

        tenants = self.deployment.creator.list()
        known = {t.tenant_id for t in tenants}
        return {
            **control_signals(self.deployment.store),
            "learning": {t: v for t, v in self.learning_signals().items() if t in known},
            "tenants": {t.tenant_id: t.status for t in tenants},
            "running_workloads": self.workloads.running_count(),
            "incarnation": self.incarnation,
            "started_at": self.started_at,
            "rss_bytes": _rss_bytes(),
        }

    # -- usage and quotas -------------------------------------------------------------------------
    def usage(self, tenant_id: str) -> Any:
        self.deployment.creator.get(tenant_id)
        for service in (self.deployment.inference_service, self.deployment.environment_service):
            service.flush_usage()  # read-your-writes: the services batch their metering
        return self.ledger.summary(
            tenant_id,
            running=self.workloads.count(tenant_id, "running"),
            queued=self.workloads.count(tenant_id, "queued"),
        )

    def quota(self, tenant_id: str) -> Any:
        return self.ledger.quota(tenant_id)

    def set_quota(self, tenant_id: str, update: Any) -> Any:
        self.deployment.creator.get(tenant_id)
        return self.ledger.set_quota(tenant_id, update)

    # -- weights ----------------------------------------------------------------------------------
    def publish_weights(self, tenant_id: str) -> int:
        """Training -> inference weight sync of the tenant's current version (paper A.1)."""
        self.check_tenant(tenant_id)
        return self.workloads.publish_weights(tenant_id)

    def admit_weights_install(self, tenant_id: str, *, source: str, config: dict[str, Any] | None = None) -> None:
        """Foreign weights, the control half before the install (`foreign_weights`): the tenant is
        healthy and runs no workload (it would train over them), `source` and `config` are checked,
        and its training slot exists. The API server then sends the weights to the Training Model
        Service itself: they never pass through this process."""
        from joynexus.master.foreign_weights import admit_install

        tenant = self.check_tenant(tenant_id)
        if self.workloads.count(tenant_id, "running"):
            raise ValueError(f"tenant: {tenant_id!r} has a running workload; wait for it or cancel it first")
        admit_install(self.deployment, tenant, source=source, config=config)

    def publish_installed_weights(
        self, tenant_id: str, version: int, *, source: str, sha256: str, installed_by: str
    ) -> dict[str, Any]:
        """Foreign weights installed as `version`: served and registered with their provenance by the
        tenant's producer replica (where the payload moves); returns the registration."""
        self.check_tenant(tenant_id)
        provenance = {"source": source, "sha256": sha256, "installed_by": installed_by}
        return self.deployment.producers.publish_installed(tenant_id, int(version), provenance)

    # -- state control (issue 28.3; master/state_control.py) -----------------------------------------
    def load_state(self, tenant_id: str, version: int) -> dict[str, Any]:
        """Roll the tenant's training slot back to a kept checkpoint version (module, adapter,
        optimizer). Refused while a workload of the tenant runs (it trains the slot)."""
        from joynexus.master.state_control import load_state

        self.check_tenant(tenant_id)
        if self.workloads.count(tenant_id, "running"):
            raise ValueError(f"tenant: {tenant_id!r} has a running workload; wait for it or cancel it first")
        return load_state(self.deployment, tenant_id, version)

    def fork_tenant(
        self, tenant_id: str, new_tenant: str, *, version: int | None = None, overrides: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """A new tenant from `tenant_id`'s kept `version` (None: its current one) with `overrides`
        (learning_rate, seed); same schema, nothing mutable shared (master/state_control.py)."""
        from joynexus.master.state_control import fork_tenant

        return fork_tenant(self, self.check_tenant(tenant_id), new_tenant, version=version, overrides=overrides)

    def forks(self, owner_tenant_id: str) -> list[dict[str, Any]]:
        """The forks the tenant owns (forks of its forks too), oldest first."""
        self.get_tenant(owner_tenant_id)
        return self.ledger.forks(owner_tenant_id)

    def max_forks_per_tenant(self) -> int:
        return self.options.max_forks_per_tenant

    def delete_fork(self, owner_tenant_id: str, fork_tenant_id: str) -> dict[str, Any]:
        """Delete a fork the tenant owns with its artifacts (KeyError when it owns no such fork)."""
        self.get_tenant(owner_tenant_id)
        if fork_tenant_id not in {fork["tenant_id"] for fork in self.ledger.forks(owner_tenant_id)}:
            raise KeyError(f"tenant {owner_tenant_id!r} owns no fork {fork_tenant_id!r}")
        return self.delete_tenant(fork_tenant_id, delete_artifacts=True)

    # -- evaluation declarations (paper 4.2) --------------------------------------------------------
    def declare_evaluation(
        self,
        targets: list[dict[str, Any]],
        *,
        episodes: int = 4,
        name: str = "",
        environment: dict[str, Any] | None = None,
        suite: list[dict[str, Any]] | None = None,
        videos: int = 0,
    ) -> dict[str, Any]:
        """Evaluate each target (tenant, version) on its simulator; one comparison table in MLflow."""
        return self.declarations.declare(
            targets, episodes=episodes, name=name, environment=environment, suite=suite, videos=videos
        )

    def get_evaluation(self, declaration_id: str) -> dict[str, Any]:
        return self.declarations.get(declaration_id)


def master_service_actor(settings: Settings, *, options: MasterOptions | None = None, detached: bool = False) -> Any:
    """Get the deployment's Master Service actor, creating it if absent (Ray must be initialized).
    Threaded, so blocking waits of some clients do not hold up the others."""
    return named_actor(
        MasterService,
        MASTER_ACTOR,
        settings.for_actors(),  # the database login by reference: arguments are kept in the GCS
        # made here, in the creating process (`joynexus up`), from its environment (JOYNEXUS_MAX_*)
        options=options or MasterOptions(),
        publish_health=detached,  # the deployment's Master (`joynexus up`): `joynexus status` reads it
        detached=detached,
        namespace=settings.ray_namespace,
        max_concurrency=64,
    )


def _rss_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # metrics never fail for it
        return None


def _reason(error: BaseException) -> str:
    cause = getattr(error, "cause", None) or error
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}".rstrip(": ")
