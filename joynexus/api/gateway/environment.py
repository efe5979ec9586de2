"""Lower-layer environment sessions of the caller's tenant on the Environment Service: open,
list, reset, step, close. Another tenant's session id answers like one that does not exist."""

from __future__ import annotations

from typing import TYPE_CHECKING

from joynexus.api.errors import ServiceUnavailable
from joynexus.api.gateway.admission import Admission
from joynexus.api.gateway.directory import TenantDirectory
from joynexus.api.gateway.service_errors import session_errors
from joynexus.api.gateway.tensors import float_array, to_wire
from joynexus.protocol import schemas as s

if TYPE_CHECKING:  # the service module is the Environment Service's own side (simulators)
    from joynexus.services.environment.service import EnvironmentService


class Sessions:
    """Environment sessions over the deployment's Environment Service (None: it runs none)."""

    def __init__(self, environment: EnvironmentService | None, directory: TenantDirectory, admission: Admission):
        self._service, self._directory, self._admission = environment, directory, admission

    def _environment(self) -> EnvironmentService:
        if self._service is None:
            raise ServiceUnavailable("this server runs no Environment Service")
        return self._service

    def open(self, tenant_id: str, request: s.SessionOpen) -> s.SessionInfo:
        self._directory.tenant(tenant_id)
        self._admission.check(tenant_id)
        env = self._environment()
        with session_errors(None, "config"):
            session_id = env.open_session(tenant_id, request.rollout_id, request.config)
            spec = env.spec(tenant_id, session_id)
        return s.SessionInfo(session_id=session_id, rollout_id=request.rollout_id, state="ready", spec=spec)

    def list_sessions(self, tenant_id: str) -> s.SessionList:
        described = self._environment().sessions(tenant_id)
        return s.SessionList(sessions=[s.SessionInfo.model_validate(d) for d in described])

    def reset(self, tenant_id: str, session_id: str, request: s.EnvReset) -> s.EnvResult:
        with session_errors(session_id, "seed"):
            result = self._environment().reset(tenant_id, session_id, request.seed)
        return s.EnvResult(data=to_wire(result))

    def step(self, tenant_id: str, session_id: str, request: s.EnvStep) -> s.EnvResult:
        action = float_array(request.action, "action", None)
        self._admission.check(tenant_id)
        with session_errors(session_id, "action"):
            result = self._environment().step(tenant_id, session_id, action)
        return s.EnvResult(data=to_wire(result))

    def close(self, tenant_id: str, session_id: str) -> s.Cleared:
        with session_errors(session_id, "session_id"):
            self._environment().close(tenant_id, session_id)
        return s.Cleared(cleared=True)
