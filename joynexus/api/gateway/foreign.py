"""Foreign weights (a tenant's own, or the admin's for any tenant) and evaluation declarations:
thin calls of the Master Service, its errors as API errors."""

from __future__ import annotations

from joynexus.api.errors import ApiError, NotFound, QuotaExceeded
from joynexus.api.gateway.base import GatewayBase
from joynexus.api.gateway.service_errors import invalid_from
from joynexus.master.errors import AdmissionRefused, TenantUnavailable
from joynexus.protocol import schemas as s


class ForeignOperations(GatewayBase):
    def install_weights(
        self, tenant_id: str, request: s.InstallWeightsRequest, installed_by: str
    ) -> s.InstalledWeights:
        self.tenant(tenant_id)
        self.check_admission(tenant_id, storage=True)  # a new checkpoint
        try:
            installed = self.master.install_weights(
                tenant_id, request.weights, source=request.source, installed_by=installed_by, config=request.config
            )
        except TenantUnavailable as error:
            raise ApiError(str(error), [("tenant", error.reason)]).with_status(409, "tenant_unhealthy") from None
        except KeyError:
            raise NotFound("tenant", tenant_id, "tenant_id") from None
        except (ValueError, TypeError) as error:
            raise invalid_from(error, "weights") from None
        return s.InstalledWeights.model_validate(installed)

    def declare_evaluation(self, request: s.EvaluationDeclare) -> s.EvaluationDeclaration:
        targets = [t.model_dump() for t in request.targets]
        try:
            info = self.master.declare_evaluation(
                targets, episodes=request.episodes, name=request.name, environment=request.environment,
                suite=request.suite, videos=request.videos,
            )  # fmt: skip
        except AdmissionRefused as error:
            raise QuotaExceeded(str(error), [("quota.max_device_seconds", str(error))]) from None
        except (ValueError, TypeError) as error:
            raise invalid_from(error, "targets") from None
        return s.EvaluationDeclaration.model_validate(info)

    def evaluation(self, declaration_id: str, tenant_id: str | None) -> s.EvaluationDeclaration:
        """A declaration: the admin sees it whole; a target tenant sees its own rows only; any other
        caller gets the 404 of an id that does not exist."""
        try:
            info = s.EvaluationDeclaration.model_validate(self.master.get_evaluation(declaration_id))
        except KeyError:
            raise NotFound("evaluation", declaration_id, "declaration_id") from None
        if tenant_id is None:
            return info
        if all(t.get("tenant_id") != tenant_id for t in info.targets):
            raise NotFound("evaluation", declaration_id, "declaration_id")
        return info.model_copy(
            update={
                "targets": [t for t in info.targets if t.get("tenant_id") == tenant_id],
                "table": None if info.table is None else [r for r in info.table if r.get("tenant_id") == tenant_id],
                "run_id": None,
            }
        )
