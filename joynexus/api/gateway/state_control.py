"""State control of the caller's tenant (issue 28.3): `load_state` rolls its training slot back to
a kept version; `fork` makes a new tenant from one of its versions with another learning rate or
seed, and issues the new tenant's first API key to the caller (the holder of the source's key owns
the fork). Thin calls of the Master Service (`master/state_control.py`), its errors as API errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from joynexus.api.errors import ApiError, Conflict, NotFound, QuotaExceeded
from joynexus.api.gateway.admission import Admission
from joynexus.api.gateway.directory import TenantDirectory
from joynexus.api.gateway.service_errors import cause_of, invalid_from
from joynexus.api.gateway.tenants import tenant_info
from joynexus.master.errors import TenantUnavailable
from joynexus.master.state_control import ForkLimitReached
from joynexus.master.tenant_creator import TenantExists
from joynexus.protocol import state_control as sc
from joynexus.spec import SpecError

if TYPE_CHECKING:
    from joynexus.api.auth import ApiKeyStore
    from joynexus.master.service import MasterService


def _master_errors(error: BaseException, field: str) -> ApiError:
    cause = cause_of(error)
    if isinstance(cause, TenantUnavailable):
        return ApiError(str(cause), [("tenant", cause.reason)]).with_status(409, "tenant_unhealthy")
    if isinstance(cause, ForkLimitReached):
        return QuotaExceeded(str(cause), [("max_forks_per_tenant", str(cause))])
    if isinstance(cause, TenantExists):
        return Conflict(str(cause), list(cause.problems))
    if isinstance(cause, SpecError):
        return ApiError("invalid request", list(cause.problems)).with_status(422, "invalid_input")
    if isinstance(cause, KeyError):
        return NotFound("tenant", field, "tenant_id")
    if isinstance(cause, ValueError):
        return invalid_from(cause, field)
    raise error


class StateControl:
    """load_state, fork and the caller's forks; a fork's first API key is issued here."""

    def __init__(self, master: MasterService, directory: TenantDirectory, admission: Admission, keys: ApiKeyStore):
        self._master, self._directory, self._admission, self._keys = master, directory, admission, keys

    def load_state(self, tenant_id: str, request: sc.LoadStateRequest) -> sc.LoadStateResult:
        self._directory.tenant(tenant_id)
        try:
            result = self._master.load_state(tenant_id, request.version)
        except Exception as error:
            raise _master_errors(error, "version") from None
        return sc.LoadStateResult.model_validate(result)

    def fork(self, tenant_id: str, request: sc.ForkRequest, key_id: str) -> sc.TenantForked:
        self._directory.tenant(tenant_id)
        self._admission.check(tenant_id, storage=True)  # a checkpoint copy and a new slot
        try:
            forked = self._master.fork_tenant(
                tenant_id,
                request.new_tenant,
                version=request.version,
                overrides=request.overrides.model_dump(exclude_none=True),
            )
        except Exception as error:
            raise _master_errors(error, "new_tenant") from None
        tenant = forked["tenant"]
        key = self._keys.issue(tenant.tenant_id, label=f"fork of {tenant_id} (by key {key_id})")
        return sc.TenantForked(
            tenant=tenant_info(tenant), key=key, forked_from=sc.ForkedFrom(**forked["forked_from"]),
            version=forked["version"], owner=forked.get("owner"),
        )  # fmt: skip

    def forks(self, tenant_id: str) -> sc.ForkList:
        self._directory.tenant(tenant_id, healthy=False)
        forks = [sc.ForkInfo(**fork) for fork in self._master.forks(tenant_id)]
        return sc.ForkList(forks=forks, max_forks=self._master.max_forks_per_tenant())

    def delete_fork(self, tenant_id: str, fork_tenant_id: str) -> dict:
        """Delete a fork the caller owns, with its artifacts; another tenant's (or none) is 404."""
        self._directory.tenant(tenant_id, healthy=False)
        try:
            report = self._master.delete_fork(tenant_id, fork_tenant_id)
        except KeyError:
            raise NotFound("fork", fork_tenant_id, "tenant_id") from None
        self._directory.forget(fork_tenant_id)
        return report
