"""Promotion, in ONE home (the Master) for every path: API / CLI workloads, the main job and the flows.

Every publish registers a version; then `promote`:
1. moves `candidate` to it (always);
2. measures it by the tenant's declared metric (`spec.promotion`, `WorkloadSpec.promotion_metric`):
   simulator success rate (an evaluation of that pinned version in the tenant's environment) or the
   held-out loss on `dataset.validation_episodes` (heldout.py), and logs the metrics on the version
   (`ExperimentTracker.log_version_evaluation`);
3. moves `champion` by `joynexus.registry.promote`'s rule: when there is none yet, or when the new
   version beats the champion's measurement by more than `promotion.min_improvement`. A success
   rate is compared by its interval (`evaluation_stats`): the candidate's 95% Wilson LOWER bound
   must beat the champion's success rate. A tenant with no measurable metric (no environment,
   nothing held out) has its champion follow every version.

A measurement that fails leaves the champion where it is (the reason is in the decision); the
version stays the candidate, so the periodic evaluation flow measures and promotes it later.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from joynexus.core.tenants import Tenant
from joynexus.registry import CANDIDATE_ALIAS, CHAMPION_ALIAS, PromotionDecision, promote
from joynexus.services.producers.evaluation_stats import HELDOUT_METRIC, SUCCESS_CI_LOW_METRIC
from joynexus.spec import PromotionMetric

if TYPE_CHECKING:
    from joynexus.master.deployment import Deployment

log = logging.getLogger(__name__)
R = TypeVar("R")

SUCCESS_METRIC = "eval/success_rate"
METRIC_NAMES = {PromotionMetric.SUCCESS_RATE: SUCCESS_METRIC, PromotionMetric.HELDOUT_LOSS: HELDOUT_METRIC}


class Promoter:
    """The promotion rule as an object of its own (issue 40, item 3: a collaborator of the workload
    manager, not a mixin sharing its `self`): it reads the tenant and the registry, has versions
    measured on the tenant's producer replica, moves the aliases, and records the decision through
    `emit`; `through_restarts` waits a measurement out through a restarting service."""

    def __init__(
        self,
        deployment: Deployment,
        *,
        emit: Callable[..., None],
        through_restarts: Callable[[Callable[[], R], str, str], R],
    ):
        self.deployment = deployment
        self._emit = emit
        self._through_restarts = through_restarts

    def promote(self, tenant_id: str, registry_version: int | None = None, *, measure: bool = True) -> dict[str, Any]:
        """Apply the tenant's promotion rule to `registry_version` (default: its `candidate`);
        measure it first when it has no measurement of the declared metric yet (`measure`).
        Returns the decision as a dict (PromotionDecision's fields)."""
        tracker = self.deployment.tracker
        tenant = self.deployment.creator.get(tenant_id)
        if registry_version is None:
            registry_version = tracker.alias_version(tenant_id, CANDIDATE_ALIAS)
            if registry_version is None:
                raise ValueError(f"registry_version: tenant {tenant_id!r} has no {CANDIDATE_ALIAS!r} version")
        version = int(registry_version)
        tags = tracker.model_version_tags(tenant_id, version)  # raises if it does not exist
        metric = tenant.spec.promotion_metric()
        if metric is None:  # nothing to measure: the champion follows the newest version
            tracker.set_alias(tenant_id, CANDIDATE_ALIAS, version)
            previous = tracker.alias_version(tenant_id, CHAMPION_ALIAS)
            tracker.set_alias(tenant_id, CHAMPION_ALIAS, version)
            reason = "no promotion metric declared (no environment, no dataset.validation_episodes)"
            tracker.set_version_tags(tenant_id, version, {"promotion": "champion", "promotion_reason": reason})
            decision = PromotionDecision(tenant_id, version, "-", None, previous, None, version, True, reason)
            return dataclasses.asdict(decision)
        name = METRIC_NAMES[metric]
        # Success: the candidate's interval lower bound against the champion's measured rate.
        interval = metric is PromotionMetric.SUCCESS_RATE
        if interval:
            name = SUCCESS_CI_LOW_METRIC
        tracker.set_alias(tenant_id, CANDIDATE_ALIAS, version)  # before measuring: it is the candidate now
        failure = None
        if measure and tracker.evaluation_metric(tenant_id, version, name) is None:
            try:
                self.measure_version(tenant, version, int(tags["policy_version"]))
            except Exception as error:  # the champion stays; the decision says why
                failure = f"measuring {name} failed: {type(error).__name__}: {error}"
                log.warning("tenant %s registry version %s: %s", tenant_id, version, failure)
        decision = promote(
            tracker, tenant_id, version, metric=name,
            higher_is_better=metric is PromotionMetric.SUCCESS_RATE,
            min_improvement=tenant.spec.promotion.min_improvement,
            champion_metric=SUCCESS_METRIC if interval else None,
        )  # fmt: skip
        if failure is not None:
            decision = dataclasses.replace(decision, reason=f"{decision.reason}; {failure}")
        return dataclasses.asdict(decision)

    def measure_version(self, tenant: Tenant, registry_version: int, policy_version: int) -> dict[str, float]:
        """Measure one registered version by the tenant's metric and log it on the version."""
        tenant_id, metric = tenant.tenant_id, tenant.spec.promotion_metric()
        if metric is None:
            raise ValueError(f"promotion.metric: tenant {tenant_id!r} declares none it can be measured by")
        # Measured on the tenant's producer replica (episodes, or held-out frames through inference).
        producers = self.deployment.producers
        run = lambda: producers.measure(tenant_id, policy_version)  # noqa: E731
        metrics = self._through_restarts(run, tenant_id, "promotion measurement")
        self.deployment.tracker.log_version_evaluation(tenant_id, registry_version, metrics)
        return metrics

    def promote_published(self, workload_id: str, tenant_id: str, registry_version: int) -> dict[str, Any] | None:
        """After a workload published `registry_version`: the promotion rule, recorded as the
        workload's `promotion` event. Never fails the workload: the training happened."""
        try:
            decision = self.promote(tenant_id, registry_version)
        except Exception as error:
            log.exception("promoting tenant %s registry version %s failed", tenant_id, registry_version)
            self._emit(workload_id, "promotion_failed", error=f"{type(error).__name__}: {error}")
            return None
        self._emit(workload_id, "promotion", **decision)
        return decision
