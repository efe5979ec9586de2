"""MLflow tracking + registry tests against an embedded sqlite store in tmp_path."""

from __future__ import annotations

import os
import threading
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("mlflow")

from joynexus.artifacts import (  # noqa: E402
    CheckpointStore,
    TenantManifest,
    decode_tenant_payload,
    encode_tenant_payload,
)
from joynexus.registry import ExperimentTracker, RegistryError, registered_model_name
from joynexus.settings import local_artifact_location, local_tracking_uri


@pytest.fixture(scope="module")
def tracker(tmp_path_factory: pytest.TempPathFactory) -> ExperimentTracker:
    # One store per module: creating the sqlite schema (alembic migrations) is the slow part.
    data_dir = tmp_path_factory.mktemp("data")
    return ExperimentTracker(local_tracking_uri(data_dir))


def _payload(tenant: str, version: int, seed: int) -> tuple[bytes, TenantManifest, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    state = torch.nn.Linear(4, 3).state_dict()
    manifest = TenantManifest(
        tenant_id=tenant,
        policy_version=version,
        schema_signature="obs:rgb64|act:7",
        base_model_id="tiny-vlm@abc123",
        module_kind="linear",
        module_config={"in_features": 4, "out_features": 3},
        files={},
        created_at="2026-01-01T00:00:00+00:00",
        extra={"optimizer_steps": version * 10},
    )
    return encode_tenant_payload(state, manifest), manifest, state


def test_local_uris(tmp_path: Path) -> None:
    uri = local_tracking_uri(tmp_path)
    assert uri == f"sqlite:///{tmp_path.resolve()}/mlflow/mlflow.db"
    assert (tmp_path / "mlflow").is_dir()
    assert local_artifact_location(tmp_path) == (tmp_path.resolve() / "mlflow" / "artifacts").as_uri()
    assert registered_model_name("acme") == "joynexus-acme-policy"
    with pytest.raises(ValueError, match="tenant_id"):
        registered_model_name("../x")


def test_artifacts_default_next_to_db(tracker: ExperimentTracker) -> None:
    exp = tracker.client.get_experiment(tracker.experiment_id)
    db_dir = Path(tracker.tracking_uri.removeprefix("sqlite:///")).parent
    assert exp.artifact_location == (db_dir / "artifacts").as_uri()
    # A second tracker (another worker process, say) reuses the experiment instead of failing.
    again = ExperimentTracker(tracker.tracking_uri)
    assert again.experiment_id == tracker.experiment_id


def test_run_params_and_metric_history(tracker: ExperimentTracker) -> None:
    run_id = tracker.start_workload_run(
        "acme", "wl-1", {"lr": 0.001, "batch_size": 8, "sched": {"kind": "cosine"}}, tags={"team": "a"}
    )
    for step in range(3):
        tracker.log_metrics(run_id, {"loss": 1.0 / (step + 1), "reward": float(step)}, step=step)
    tracker.end_run(run_id)

    run = tracker.client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.001", "batch_size": "8", "sched": '{"kind": "cosine"}'}
    assert run.data.tags["tenant_id"] == "acme"
    assert run.data.tags["workload_id"] == "wl-1"
    assert run.data.tags["team"] == "a"
    assert tracker.metric_history(run_id, "loss") == [(0, 1.0), (1, 0.5), (2, 1.0 / 3)]
    assert tracker.metric_history(run_id, "reward") == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert tracker.metric_history(run_id, "missing") == []
    with pytest.raises(ValueError, match="status"):
        tracker.end_run(run_id, "DONE")


def test_register_versions_aliases_and_fetch(tracker: ExperimentTracker) -> None:
    run_id = tracker.start_workload_run("tenant-a", "wl-a", {"lr": 0.01})
    p1, m1, s1 = _payload("tenant-a", 1, seed=1)
    p2, m2, s2 = _payload("tenant-a", 2, seed=2)
    v1 = tracker.register_tenant_payload(run_id=run_id, tenant_id="tenant-a", payload=p1, manifest=m1)
    v2 = tracker.register_tenant_payload(run_id=run_id, tenant_id="tenant-a", payload=p2, manifest=m2)
    tracker.end_run(run_id)
    assert (v1, v2) == (1, 2)

    tags = tracker.model_version_tags("tenant-a", v2)
    assert tags["tenant_id"] == "tenant-a"
    assert tags["policy_version"] == "2"
    assert tags["schema_signature"] == m2.schema_signature
    assert tags["base_model_id"] == m2.base_model_id
    assert tags["manifest_digest"] == m2.digest
    assert tracker.model_version_tags("tenant-a", v1)["manifest_digest"] == m1.digest

    tracker.set_alias("tenant-a", "production", v1)
    payload, manifest = tracker.fetch_tenant_payload("tenant-a", alias="production")
    assert payload == p1 and manifest == m1
    state, _ = decode_tenant_payload(payload)
    for key, value in s1.items():
        assert torch.equal(state[key], value)
        assert state[key].numpy().tobytes() == value.numpy().tobytes()  # bit-identical

    tracker.set_alias("tenant-a", "production", v2)  # alias moves
    payload, manifest = tracker.fetch_tenant_payload("tenant-a", alias="production")
    assert payload == p2 and manifest.digest == m2.digest
    assert tracker.fetch_tenant_payload("tenant-a", version=v1)[1] == m1
    assert tracker.fetch_tenant_payload("tenant-a")[1] == m2  # newest by default
    with pytest.raises(ValueError, match="either"):
        tracker.fetch_tenant_payload("tenant-a", version=1, alias="production")
    # Registering the same payload again (a Master restarted mid-publish) is the version registered.
    assert tracker.register_tenant_payload(run_id=run_id, tenant_id="tenant-a", payload=p1, manifest=m1) == v1
    p1_other, m1_other, _ = _payload("tenant-a", 1, seed=7)  # other weights under the same policy version
    with pytest.raises(ValueError, match="already holds a different payload"):
        tracker.register_tenant_payload(run_id=run_id, tenant_id="tenant-a", payload=p1_other, manifest=m1_other)


def test_registration_finishes_what_a_dead_master_left_half_done(tracker: ExperimentTracker) -> None:
    """Artifacts logged, model version never created (the Master died between the two): registering
    the same payload again creates the version instead of refusing the logged artifacts."""
    run_id = tracker.start_workload_run("tenant-h", "wl-h", {})
    payload, manifest, _ = _payload("tenant-h", 3, seed=3)
    first = tracker.register_tenant_payload(run_id=run_id, tenant_id="tenant-h", payload=payload, manifest=manifest)
    tracker.client.delete_model_version(registered_model_name("tenant-h"), str(first))
    again = tracker.register_tenant_payload(run_id=run_id, tenant_id="tenant-h", payload=payload, manifest=manifest)
    assert again != first
    assert tracker.model_version_tags("tenant-h", again)["manifest_digest"] == manifest.digest
    assert tracker.fetch_tenant_payload("tenant-h", version=again) == (payload, manifest)


def test_two_tenants_get_separate_models(tracker: ExperimentTracker) -> None:
    results: dict[str, tuple[str, int, bytes]] = {}
    errors: list[BaseException] = []

    def work(tenant: str, seed: int) -> None:
        try:
            run_id = tracker.start_workload_run(tenant, f"wl-{tenant}", {"seed": seed})
            tracker.log_metrics(run_id, {"loss": float(seed)}, step=0)
            payload, manifest, _ = _payload(tenant, 1, seed=seed)
            version = tracker.register_tenant_payload(
                run_id=run_id, tenant_id=tenant, payload=payload, manifest=manifest
            )
            tracker.end_run(run_id)
            results[tenant] = (run_id, version, payload)
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t, s)) for t, s in (("red", 10), ("blue", 20))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

    for tenant in ("red", "blue"):
        run_id, version, payload = results[tenant]
        assert version == 1  # each tenant has its own version sequence
        model = tracker.client.get_registered_model(registered_model_name(tenant))
        assert model.tags["tenant_id"] == tenant
        fetched, manifest = tracker.fetch_tenant_payload(tenant, version=1)
        assert fetched == payload and manifest.tenant_id == tenant
        assert tracker.metric_history(run_id, "loss") == [(0, 10.0 if tenant == "red" else 20.0)]
    assert results["red"][2] != results["blue"][2]


def test_register_rejects_mismatches(tracker: ExperimentTracker) -> None:
    run_id = tracker.start_workload_run("owner", "wl", {})
    payload, manifest, _ = _payload("owner", 1, seed=0)
    with pytest.raises(ValueError, match="belongs to tenant"):
        tracker.register_tenant_payload(
            run_id=run_id,
            tenant_id="intruder",
            payload=_payload("intruder", 1, 0)[0],
            manifest=_payload("intruder", 1, 0)[1],
        )
    with pytest.raises(ValueError, match="not 'other'"):
        tracker.register_tenant_payload(run_id=run_id, tenant_id="other", payload=payload, manifest=manifest)
    other_manifest = _payload("owner", 2, seed=0)[1]
    with pytest.raises(ValueError, match="embeds manifest"):
        tracker.register_tenant_payload(run_id=run_id, tenant_id="owner", payload=payload, manifest=other_manifest)
    with pytest.raises(ValueError, match="not a valid tenant payload"):
        tracker.register_tenant_payload(run_id=run_id, tenant_id="owner", payload=b"junk", manifest=manifest)
    with pytest.raises(RegistryError, match="no registered"):
        tracker.fetch_tenant_payload("nobody")
    tracker.end_run(run_id, "KILLED")


def test_tampered_artifact_detected(tracker: ExperimentTracker) -> None:
    run_id = tracker.start_workload_run("tamper", "wl", {})
    payload, manifest, _ = _payload("tamper", 1, seed=5)
    version = tracker.register_tenant_payload(run_id=run_id, tenant_id="tamper", payload=payload, manifest=manifest)
    tracker.end_run(run_id)
    source = tracker.client.get_model_version(registered_model_name("tamper"), str(version)).source
    folder = Path(source.removeprefix("file://"))
    # Swap in a valid payload with a different manifest: only the digest tag can catch it.
    forged, forged_manifest, _ = _payload("tamper", 1, seed=6)
    forged_manifest = TenantManifest(**{**forged_manifest.__dict__, "extra": {"evil": True}})
    (folder / "action_module.safetensors").write_bytes(encode_tenant_payload({"w": torch.ones(1)}, forged_manifest))
    with pytest.raises(RegistryError, match="digest mismatch"):
        tracker.fetch_tenant_payload("tamper", version=version)


def test_checkpoint_to_registry_flow(tmp_path: Path, tracker: ExperimentTracker) -> None:
    # The intended path: trainer saves a checkpoint, exporter registers the verified module state.
    store = CheckpointStore(tmp_path / "ckpt")
    model = torch.nn.Linear(4, 3)
    store.save_tenant(
        tenant_id="flow",
        policy_version=4,
        schema_signature="s",
        base_model_id="b",
        module_kind="linear",
        module_config={},
        module_state=model.state_dict(),
        optimizer_state=None,
    )
    manifest, state, _ = store.load_tenant("flow")
    run_id = tracker.start_workload_run("flow", "export", {"policy_version": 4})
    version = tracker.register_tenant_payload(
        run_id=run_id, tenant_id="flow", payload=encode_tenant_payload(state, manifest), manifest=manifest
    )
    tracker.set_alias("flow", "champion", version)
    _, fetched = tracker.fetch_tenant_payload("flow", alias="champion")
    assert fetched.digest == manifest.digest
    assert tracker.model_version_tags("flow", version)["policy_version"] == "4"
