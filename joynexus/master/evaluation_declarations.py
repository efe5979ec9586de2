"""Evaluation declarations (paper 4.2): one declaration names target tenants and versions; the
Master runs one evaluation workload per target (`WorkloadManager.evaluate`: the version resolved
once, episodes through the Inference Queue and the Environment Service, seeded by episode index, so
every target sees the same episodes), then writes ONE comparison table to MLflow (a run tagged
``task=evaluation-declaration`` holding ``comparison.json``) and into the declaration's row.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

from joynexus.core.store import EvaluationDeclarationRecord, utcnow

log = logging.getLogger(__name__)

MAX_TARGETS = 32
RUNNING, COMPLETED, FAILED = "running", "completed", "failed"
_COLUMNS = ("success_rate", "success_ci_low", "success_ci_high", "mean_return", "mean_length", "episodes")


def _targets(targets: Any) -> list[tuple[str, int | str]]:
    if not isinstance(targets, list) or not 1 <= len(targets) <= MAX_TARGETS:
        raise ValueError(f"targets: expected 1..{MAX_TARGETS} targets, got {targets!r}"[:300])
    out: list[tuple[str, int | str]] = []
    for i, target in enumerate(targets):
        if not isinstance(target, dict) or not isinstance(target.get("tenant_id"), str):
            raise ValueError(f"targets[{i}].tenant_id: expected a tenant id")
        version = target.get("version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"targets[{i}].version: expected a policy version (an int >= 0) or null, got {version!r}")
        out.append((target["tenant_id"], "latest" if version is None else version))
    return out


def _info(record: EvaluationDeclarationRecord) -> dict[str, Any]:
    return {
        "declaration_id": record.declaration_id,
        "name": record.name,
        "state": record.state,
        "targets": list(record.targets or []),
        "table": record.table,
        "run_id": record.run_id,
        "error": record.error,
        "created_at": record.created_at.isoformat() if record.created_at else None,
        "finished_at": record.finished_at.isoformat() if record.finished_at else None,
    }


class EvaluationDeclarations:
    """Declarations of the Master: `declare` starts them, `get` reads one back."""

    def __init__(self, deployment: Any, workloads: Any):
        self.deployment = deployment
        self.workloads = workloads

    def declare(
        self,
        targets: Any,
        *,
        episodes: int = 4,
        name: str = "",
        environment: dict[str, Any] | None = None,
        suite: list[dict[str, Any]] | None = None,
        videos: int = 0,
    ) -> dict[str, Any]:
        """Start one evaluation workload per target (all checked first: a bad target starts none);
        `environment` (one simulator for every target) overrides each tenant's declared one; a
        `suite` evaluates every target in each of its entries (`evaluation_report`)."""
        parsed = _targets(targets)
        for i, (tenant_id, _) in enumerate(parsed):
            try:
                self.deployment.creator.get(tenant_id)
            except KeyError:
                raise ValueError(f"targets[{i}].tenant_id: no tenant {tenant_id!r}") from None
        started = []
        for i, (tenant_id, version) in enumerate(parsed):
            try:
                info = self.workloads.evaluate(
                    tenant_id, version=version, episodes=episodes, environment=environment, suite=suite, videos=videos
                )
            except ValueError as error:
                for done in started:  # none half-declared
                    self.workloads.cancel(done["workload_id"])
                raise ValueError(f"targets[{i}].{error}") from None
            started.append({"tenant_id": tenant_id, "version": info.version, "workload_id": info.workload_id})
        declaration_id = f"evd-{uuid.uuid4().hex[:12]}"
        with self.deployment.store.transaction() as s:
            s.add(EvaluationDeclarationRecord(declaration_id=declaration_id, name=name, state=RUNNING, targets=started))
        threading.Thread(
            target=self._finish, args=(declaration_id, started), name=f"declaration-{declaration_id}", daemon=True
        ).start()
        return self.get(declaration_id)

    def get(self, declaration_id: str) -> dict[str, Any]:
        with self.deployment.store.transaction() as s:
            record = s.get(EvaluationDeclarationRecord, declaration_id)
            if record is None:
                raise KeyError(declaration_id)
            return _info(record)

    def _finish(self, declaration_id: str, started: list[dict[str, Any]]) -> None:
        """Wait for every target's evaluation, then write the one comparison table."""
        state, error, run_id, rows = COMPLETED, None, None, []
        try:
            infos = self.workloads.wait_all([t["workload_id"] for t in started])
            for target, info in zip(started, infos, strict=True):
                result = info.result or {}
                rows.append(
                    {
                        "tenant_id": target["tenant_id"],
                        "version": target["version"],
                        "workload_id": target["workload_id"],
                        "state": info.state,
                        **{key: result.get(key) for key in _COLUMNS},
                        "error": info.error,
                    }
                )
            run_id = self.deployment.tracker.log_comparison_table(declaration_id, rows, {"targets": str(len(rows))})
        except Exception as failure:
            log.warning("evaluation declaration %s failed: %s", declaration_id, failure)
            state, error = FAILED, f"{type(failure).__name__}: {failure}"
        with self.deployment.store.transaction() as s:
            record = s.get(EvaluationDeclarationRecord, declaration_id)
            record.state, record.table, record.run_id, record.error = state, rows, run_id, error
            record.finished_at = utcnow()
