"""Workloads of the caller's tenant (upper layer): submit (training or eval), follow, cancel."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from joynexus.api.errors import ApiError, InvalidInput, NotFound, QuotaExceeded
from joynexus.api.gateway.directory import TenantDirectory
from joynexus.api.gateway.service_errors import invalid_from
from joynexus.core.tenants import Tenant
from joynexus.master.errors import AdmissionRefused, TenantUnavailable
from joynexus.protocol import schemas as s
from joynexus.spec import SpecError, WorkloadSpec, parse_workload_spec

if TYPE_CHECKING:
    from joynexus.master.service import MasterService


class Workloads:
    """The caller's workloads on the Master Service: a submitted spec is checked here against the
    tenant's (a workload applies only what it can apply); the Master admits, runs and records."""

    def __init__(self, master: MasterService, directory: TenantDirectory):
        self._master, self._directory = master, directory

    def submit(self, tenant_id: str, request: s.WorkloadSubmit) -> s.WorkloadInfo:
        tenant = self._directory.tenant(tenant_id)
        declared = tenant.spec.task.value
        task = request.task or declared
        if task not in (declared, "eval"):
            reason = f"your tenant was created for {declared!r}: submit {declared!r} (training) or 'eval', got {task!r}"
            raise InvalidInput("task", reason)
        jobs, dataset = request.jobs, None
        if request.spec is not None:
            spec = self._check_submitted_spec(tenant, request.spec)
            if jobs is None:
                jobs = spec.scheduling.completion_target
            if _names_an_upload(spec):
                assert spec.dataset is not None
                dataset = spec.dataset.model_dump(mode="json", exclude_none=True)
        try:
            if task == "eval":
                version: int | str = "latest" if request.version is None else request.version
                status = self._master.evaluate(
                    tenant_id, version=version, episodes=request.episodes, environment=request.environment,
                    suite=request.suite, videos=request.videos,
                )  # fmt: skip
            elif dataset is not None:
                status = self._master.submit_workload(tenant_id, jobs=jobs, dataset=dataset)
            else:
                status = self._master.submit_workload(tenant_id, jobs=jobs)
        except SpecError as error:  # dataset.id: not one of the tenant's uploads
            problems = [(f"spec.{field}", reason) for field, reason in error.problems]
            raise ApiError("invalid workload spec", problems).with_status(422, "invalid_spec") from None
        except AdmissionRefused as error:
            field = next(
                (f"quota.{name}" for name in ("max_queued_workloads", "max_storage_bytes") if name in str(error)),
                "quota.max_device_seconds",
            )
            raise QuotaExceeded(str(error), [(field, str(error))]) from None
        except TenantUnavailable as error:
            raise ApiError(str(error), [("tenant", error.reason)]).with_status(409, "tenant_unhealthy") from None
        except (ValueError, TypeError) as error:
            raise invalid_from(error, "task") from None
        return status

    def _check_submitted_spec(self, tenant: Tenant, data: dict[str, Any]) -> WorkloadSpec:
        try:
            spec = parse_workload_spec(data)
        except SpecError as error:
            raise ApiError("invalid workload spec", [(f"spec.{f}", r) for f, r in error.problems]).with_status(
                422, "invalid_spec"
            ) from None
        if spec.tenant != tenant.tenant_id:
            raise InvalidInput("spec.tenant", f"must be your tenant {tenant.tenant_id!r}, got {spec.tenant!r}")
        if spec.task != tenant.spec.task:
            raise InvalidInput(
                "spec.task",
                f"tenant {tenant.tenant_id!r} was created for task {tenant.spec.task.value!r}, got {spec.task.value!r}",
            )
        signature = spec.vla_schema().signature
        if signature != tenant.schema_signature:
            raise InvalidInput(
                "spec.observation",
                f"the interface (schema signature {signature[:16]}) differs from the one tenant "
                f"{tenant.tenant_id!r} was created with ({tenant.schema_signature[:16]}); a new interface needs a "
                "new tenant",
            )
        # A workload applies only completion_target; any other field set to something else than the
        # tenant's would be ignored without a word, so it is refused, naming each one.
        applied = APPLIED | ({"dataset"} if _names_an_upload(spec) else set())
        changed = _changed_fields(spec, tenant.spec)
        ignored = [(f, m, t) for f, m, t in changed if f not in applied and f.partition(".")[0] not in applied]
        if ignored:
            raise ApiError(
                f"a workload applies only spec.{', spec.'.join(sorted(APPLIED))} (and, for SFT, a spec.dataset "
                "naming your upload by dataset.id); the other fields were fixed when the tenant was created (a "
                "change needs a new tenant)",
                [
                    (f"spec.{field}", f"{mine!r} differs from your tenant's {theirs!r}; a workload cannot change it")
                    for field, mine, theirs in ignored
                ],
            ).with_status(422, "invalid_spec")
        return spec

    def get(self, tenant_id: str, workload_id: str) -> s.WorkloadInfo:
        try:
            status = self._master.get_workload(workload_id, tenant_id)
        except KeyError:
            raise NotFound("workload", workload_id, "workload_id") from None
        return status

    def list_workloads(self, tenant_id: str) -> list[s.WorkloadInfo]:
        return self._master.list_workloads(tenant_id)

    def cancel(self, tenant_id: str, workload_id: str) -> s.WorkloadInfo:
        try:
            status = self._master.cancel_workload(workload_id, tenant_id)
        except KeyError:
            raise NotFound("workload", workload_id, "workload_id") from None
        return status

    def events(self, tenant_id: str, workload_id: str, after: int) -> s.WorkloadEvents:
        try:
            events = self._master.workload_events(workload_id, after, tenant_id)
        except KeyError:
            raise NotFound("workload", workload_id, "workload_id") from None
        info = self.get(tenant_id, workload_id)
        return s.WorkloadEvents(workload=info, events=[s.WorkloadEvent.model_validate(e) for e in events])


# The fields of a submitted spec a workload applies (the rest must equal the tenant's); an SFT
# workload's spec may also name another dataset, one the tenant uploaded (dataset.id).
APPLIED = frozenset({"scheduling.completion_target"})


def _names_an_upload(spec: WorkloadSpec) -> bool:
    return spec.dataset is not None and spec.dataset.id is not None


def _changed_fields(submitted: BaseModel, declared: BaseModel, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(path, submitted, declared) of every field the submitted spec sets (defaults it leaves out
    are not its choice) to a value the declared spec does not have."""
    out: list[tuple[str, Any, Any]] = []
    for name in sorted(submitted.model_fields_set):
        mine, theirs = getattr(submitted, name), getattr(declared, name, None)
        if isinstance(mine, BaseModel) and isinstance(theirs, BaseModel):
            out.extend(_changed_fields(mine, theirs, f"{prefix}{name}."))
        elif mine != theirs and not _same_dataset_root(f"{prefix}{name}", mine, theirs):
            out.append((f"{prefix}{name}", _plain(mine), _plain(theirs)))
    return out


def _same_dataset_root(field: str, mine: Any, theirs: Any) -> bool:
    """The tenant's dataset.root is stored resolved (joynexus.data.sources): the same folder spelled
    otherwise is no change."""
    if field != "dataset.root" or not isinstance(mine, str) or not isinstance(theirs, str):
        return False
    return os.path.realpath(mine) == os.path.realpath(theirs)


def _plain(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else getattr(value, "value", value)
