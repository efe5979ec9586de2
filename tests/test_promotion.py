"""The registry lifecycle: `candidate` always follows the newest version, `champion` moves only
when an evaluation beats it (by more than `min_improvement`, in the configured direction)."""

from __future__ import annotations

import pytest
import torch
from mlflow.exceptions import MlflowException

from joynexus.artifacts import TenantManifest, encode_tenant_payload
from joynexus.registry import CANDIDATE_ALIAS, CHAMPION_ALIAS, ExperimentTracker, promote
from joynexus.settings import local_tracking_uri


@pytest.fixture(scope="module")
def tracker(tmp_path_factory) -> ExperimentTracker:
    return ExperimentTracker(local_tracking_uri(tmp_path_factory.mktemp("mlflow")))


def register(tracker: ExperimentTracker, tenant: str, policy_version: int) -> int:
    """A training run that registers `policy_version`; returns the registry version."""
    torch.manual_seed(policy_version)
    manifest = TenantManifest(
        tenant_id=tenant,
        policy_version=policy_version,
        schema_signature="sig",
        base_model_id="tiny",
        module_kind="linear",
        module_config={},
        files={},
        created_at="2026-01-01T00:00:00+00:00",
        extra={},
    )
    payload = encode_tenant_payload(torch.nn.Linear(2, 2).state_dict(), manifest)
    run_id = tracker.start_workload_run(tenant, f"wl-{policy_version}", {"jobs": 1}, tags={"task": "sft"})
    version = tracker.register_tenant_payload(run_id=run_id, tenant_id=tenant, payload=payload, manifest=manifest)
    tracker.end_run(run_id)
    return version


def evaluate(tracker: ExperimentTracker, tenant: str, policy_version: int, status: str = "FINISHED", **metrics):
    """What an evaluation workload leaves behind: an eval run at one policy version."""
    run_id = tracker.start_workload_run(tenant, "ev", {"policy_version": policy_version}, tags={"task": "eval"})
    tracker.log_metrics(run_id, {f"eval/{k}": v for k, v in metrics.items()}, step=policy_version)
    tracker.end_run(run_id, status)


def aliases(tracker: ExperimentTracker, tenant: str) -> tuple[int | None, int | None]:
    return tracker.alias_version(tenant, CANDIDATE_ALIAS), tracker.alias_version(tenant, CHAMPION_ALIAS)


def test_champion_moves_only_when_beaten(tracker):
    t = "promo-a"
    assert aliases(tracker, t) == (None, None)  # no registered model yet

    v1 = register(tracker, t, 3)
    evaluate(tracker, t, 3, success_rate=0.25)
    first = promote(tracker, t, v1)
    assert first.promoted and first.reason == "no champion yet" and first.value == 0.25
    assert aliases(tracker, t) == (v1, v1)

    v2 = register(tracker, t, 6)
    evaluate(tracker, t, 6, success_rate=0.5)
    second = promote(tracker, t, v2)
    assert second.promoted and second.previous_champion == v1 and second.champion_value == 0.25
    assert aliases(tracker, t) == (v2, v2)

    v3 = register(tracker, t, 9)
    evaluate(tracker, t, 9, success_rate=0.5)  # a tie does not beat the champion
    third = promote(tracker, t, v3)
    assert not third.promoted and third.champion == v2 and "does not beat" in third.reason
    assert aliases(tracker, t) == (v3, v2)  # the candidate always moves

    tags = tracker.model_version_tags(t, v3)
    assert tags["promotion"] == "candidate" and tags["eval/success_rate"] == "0.5"
    assert tags["policy_version"] == "9" and tags["manifest_digest"]  # registration tags kept
    assert tracker.model_version_tags(t, v2)["promotion"] == "champion"


def test_min_improvement_and_lower_is_better(tracker):
    t = "promo-b"
    v1 = register(tracker, t, 1)
    evaluate(tracker, t, 1, success_rate=0.5, mean_length=40.0)
    promote(tracker, t, v1)

    v2 = register(tracker, t, 2)
    evaluate(tracker, t, 2, success_rate=0.55, mean_length=30.0)
    assert not promote(tracker, t, v2, min_improvement=0.1).promoted  # +0.05 is not enough
    assert aliases(tracker, t) == (v2, v1)
    shorter = promote(tracker, t, v2, metric="eval/mean_length", higher_is_better=False, min_improvement=5.0)
    assert shorter.promoted and "lower is better" in shorter.reason
    assert aliases(tracker, t) == (v2, v2)
    with pytest.raises(ValueError, match="min_improvement"):
        promote(tracker, t, v2, min_improvement=-1)


def test_unevaluated_versions(tracker):
    t = "promo-c"
    v1 = register(tracker, t, 1)
    assert promote(tracker, t, v1).promoted  # nothing to compare with: the first version is champion
    v2 = register(tracker, t, 2)
    evaluate(tracker, t, 2, success_rate=0.1)
    evaluate(tracker, t, 2, status="FAILED", success_rate=1.0)  # failed evaluations do not count
    decision = promote(tracker, t, v2)
    assert decision.promoted and decision.value == 0.1
    assert "champion v1 has no eval/success_rate" in decision.reason

    v3 = register(tracker, t, 3)
    decision = promote(tracker, t, v3)
    assert not decision.promoted and decision.value is None and "has no eval/success_rate" in decision.reason
    assert aliases(tracker, t) == (v3, v2)

    evaluate(tracker, t, 3, success_rate=0.0)
    evaluate(tracker, t, 3, success_rate=0.75)  # the newest finished evaluation counts
    assert tracker.evaluation_metric(t, v3, "eval/success_rate") == 0.75
    with pytest.raises(MlflowException):
        promote(tracker, t, 99)


def test_evaluation_history_is_one_run_per_tenant(tracker):
    t = "promo-d"
    first = tracker.log_evaluation_history(t, 2, {"eval/success_rate": 0.5})
    second = tracker.log_evaluation_history(t, 3, {"eval/success_rate": 0.75})
    assert first == second
    assert tracker.metric_history(first, "eval/success_rate") == [(0, 0.5), (1, 0.75)]
    assert tracker.metric_history(first, "registry_version") == [(0, 2.0), (1, 3.0)]
