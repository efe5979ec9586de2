"""Lower-layer environment sessions of the caller's tenant on the Environment Service: open,
list, reset, step, close. Another tenant's session id answers like one that does not exist."""

from __future__ import annotations

from typing import TYPE_CHECKING

from joynexus.api.errors import ServiceUnavailable
from joynexus.api.gateway.base import GatewayBase
from joynexus.api.gateway.service_errors import session_errors
from joynexus.api.gateway.tensors import float_array, to_wire
from joynexus.protocol import schemas as s

if TYPE_CHECKING:  # the service module is the Environment Service's own side (simulators)
    from joynexus.services.environment.service import EnvironmentService


class EnvironmentOperations(GatewayBase):
    def _environment(self) -> EnvironmentService:
        service = self.cluster.environment
        if service is None:
            raise ServiceUnavailable("this server runs no Environment Service")
        return service

    def open_session(self, tenant_id: str, request: s.SessionOpen) -> s.SessionInfo:
        self.tenant(tenant_id)
        self.check_admission(tenant_id)
        env = self._environment()
        with session_errors(None, "config"):
            session_id = env.open_session(tenant_id, request.rollout_id, request.config)
            spec = env.spec(tenant_id, session_id)
        return s.SessionInfo(session_id=session_id, rollout_id=request.rollout_id, state="ready", spec=spec)

    def sessions(self, tenant_id: str) -> s.SessionList:
        described = self._environment().sessions(tenant_id)
        return s.SessionList(sessions=[s.SessionInfo.model_validate(d) for d in described])

    def reset_session(self, tenant_id: str, session_id: str, request: s.EnvReset) -> s.EnvResult:
        with session_errors(session_id, "seed"):
            result = self._environment().reset(tenant_id, session_id, request.seed)
        return s.EnvResult(data=to_wire(result))

    def step_session(self, tenant_id: str, session_id: str, request: s.EnvStep) -> s.EnvResult:
        action = float_array(request.action, "action", None)
        self.check_admission(tenant_id)
        with session_errors(session_id, "action"):
            result = self._environment().step(tenant_id, session_id, action)
        return s.EnvResult(data=to_wire(result))

    def close_session(self, tenant_id: str, session_id: str) -> s.Cleared:
        with session_errors(session_id, "session_id"):
            self._environment().close(tenant_id, session_id)
        return s.Cleared(cleared=True)
