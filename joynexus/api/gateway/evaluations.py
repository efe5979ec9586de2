"""Evaluation declarations (paper 4.2): declared by the admin, read by the admin whole or by a
target tenant for its own rows; thin calls of the Master Service, its errors as API errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from joynexus.api.errors import NotFound, QuotaExceeded
from joynexus.api.gateway.service_errors import invalid_from
from joynexus.master.errors import AdmissionRefused
from joynexus.protocol import schemas as s

if TYPE_CHECKING:
    from joynexus.master.service import MasterService


class Evaluations:
    def __init__(self, master: MasterService):
        self._master = master

    def declare(self, request: s.EvaluationDeclare) -> s.EvaluationDeclaration:
        targets = [t.model_dump() for t in request.targets]
        try:
            info = self._master.declare_evaluation(
                targets, episodes=request.episodes, name=request.name, environment=request.environment,
                suite=request.suite, videos=request.videos,
            )  # fmt: skip
        except AdmissionRefused as error:
            raise QuotaExceeded(str(error), [("quota.max_device_seconds", str(error))]) from None
        except (ValueError, TypeError) as error:
            raise invalid_from(error, "targets") from None
        return s.EvaluationDeclaration.model_validate(info)

    def get(self, declaration_id: str, tenant_id: str | None) -> s.EvaluationDeclaration:
        """A declaration: the admin sees it whole; a target tenant sees its own rows only; any other
        caller gets the 404 of an id that does not exist."""
        try:
            info = s.EvaluationDeclaration.model_validate(self._master.get_evaluation(declaration_id))
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
