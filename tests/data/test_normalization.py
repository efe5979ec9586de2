"""Per-tenant normalization (LeRobot's modes): statistics from meta/stats.json or computed and
cached, the spec's modes refused with their bad value, and SFT on actions 1,000x apart in scale:
with normalization every dimension converges and predict answers in the dataset's units; raw, the
small dimension does not."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from joynexus.data.normalization import (
    DEFAULT_MODES,
    NORMALIZATION_FILE,
    Normalizer,
    StatsError,
    compute_stats,
    dataset_digest,
    dataset_normalizer,
    load_dataset_stats,
)
from joynexus.spec import SpecError, parse_workload_spec
from tests.data.scaled_dataset import dataset_frames, write_scaled_dataset
from tests.helpers import sft_spec


@pytest.fixture(scope="module")
def scaled(tmp_path_factory) -> Path:
    return write_scaled_dataset(tmp_path_factory.mktemp("norm") / "scaled", "test/scaled")


def test_defaults_are_lerobots_and_the_modes_round_trip(scaled: Path):
    lerobot_types = pytest.importorskip("lerobot.configs.types")
    for feature, mode in DEFAULT_MODES.items():  # names and values are LeRobot's own
        assert lerobot_types.NormalizationMode(mode).value == mode
        assert lerobot_types.FeatureType(feature).value == feature
    state, action = dataset_frames(scaled)
    for modes in ({}, {"ACTION": "MIN_MAX", "STATE": "MIN_MAX"}, {"ACTION": "IDENTITY"}):
        normalizer = dataset_normalizer(scaled, modes, state.shape[1], action.shape[1])
        assert Normalizer.from_dict(json.loads(normalizer.to_json())) == normalizer
        normalized = normalizer.normalize_action(action)
        assert np.allclose(normalizer.unnormalize_action(normalized), action, rtol=1e-5, atol=1e-3)
        if modes.get("ACTION") == "MIN_MAX":
            assert normalized.min() >= -1.0 - 1e-5 and normalized.max() <= 1.0 + 1e-5
        elif not modes:
            assert np.allclose(normalized.mean(0), 0.0, atol=1e-4) and np.allclose(normalized.std(0), 1.0, atol=1e-3)
        else:
            assert np.array_equal(normalized, action)


def test_stats_are_computed_and_cached_beside_a_dataset_without_stats_json(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("JOYNEXUS_STATS_CACHE", raising=False)
    root = write_scaled_dataset(tmp_path / "datasets" / "nostats", "test/nostats", episodes=2, length=10)
    lerobot_stats = json.loads((root / "meta" / "stats.json").read_text())  # what lerobot's writer computed
    (root / "meta" / "stats.json").unlink()
    before = sorted(p.relative_to(root) for p in root.rglob("*"))

    stats, source = load_dataset_stats(root)
    key = dataset_digest(root)
    cached = tmp_path / "datasets" / ".joynexus-stats" / key / "stats.json"
    assert source == f"computed:{key[:16]}" and cached.is_file()
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # nothing written into the dataset
    for feature in ("observation.state", "action"):
        for name in ("mean", "std", "min", "max"):
            assert np.allclose(stats[feature][name], lerobot_stats[feature][name], rtol=1e-4, atol=1e-4), name
    # Served from the cache: the cached file is what a second read returns, and it is not rewritten.
    written = cached.stat().st_mtime_ns
    assert load_dataset_stats(root) == (stats, source) and cached.stat().st_mtime_ns == written
    # A changed dataset is a new key.
    (root / "meta" / "info.json").write_text((root / "meta" / "info.json").read_text() + " ")
    assert dataset_digest(root) != key


def test_stats_that_do_not_fit_the_tenant_are_refused(scaled: Path):
    stats = compute_stats(scaled)
    with pytest.raises(StatsError, match=r"action\.mean: 2 values, but the tenant's ACTION has 3"):
        Normalizer.from_stats({}, stats, {"STATE": 4, "ACTION": 3})
    with pytest.raises(StatsError, match="lack 'min'"):
        Normalizer.from_stats({"ACTION": "MIN_MAX"}, {"action": {"mean": [0, 0]}}, {"ACTION": 2})


@pytest.mark.parametrize(
    ("mapping", "expected"),
    [
        ({"ACTION": "ZSCORE"}, "unknown normalization mode 'ZSCORE'"),
        ({"DEPTH": "MEAN_STD"}, "unknown feature type 'DEPTH'"),
        ({"VISUAL": "MEAN_STD"}, "VISUAL: mode 'MEAN_STD' is not supported"),
        ({"STATE": 3}, "unknown normalization mode 3"),
    ],
)
def test_bad_spec_values_are_refused_naming_them(tmp_path: Path, mapping, expected):
    spec = sft_spec("bad", tmp_path / "unused")
    spec["normalization"] = mapping
    with pytest.raises(SpecError) as caught:
        parse_workload_spec(spec)
    assert caught.value.fields == ["normalization"]
    assert expected in str(caught.value)


def test_modes_are_case_insensitive_and_default_per_type(tmp_path: Path):
    spec = sft_spec("ok", tmp_path / "unused")
    spec["normalization"] = {"action": "min_max"}
    assert parse_workload_spec(spec).normalization == {"ACTION": "MIN_MAX"}


# ---------------------------------------------------------------------------------------------
# SFT through the real services: normalized vs raw on actions 1,000x apart
# ---------------------------------------------------------------------------------------------

TRAIN_JOBS = 10  # of 3 microbatches (optimizer steps) each


def _train_and_predict(tmp_path: Path, scaled: Path) -> dict[str, dict[str, np.ndarray]]:
    """Two tenants on the scaled dataset, one with LeRobot's default normalization, one raw
    (IDENTITY); each trained by the SFT producer and the actor loop, then predicted by an Inference
    Model Service. Returns per tenant its predictions over every frame and its normalizer."""
    from joynexus.actors import service_handle
    from joynexus.core.store import ControlPlaneStore
    from joynexus.core.tenants import BackendCapabilities
    from joynexus.master.loops.actor_loop import ActorLoop
    from joynexus.master.tenant_creator import TenantCreator
    from joynexus.models.backbone import BackboneSource
    from joynexus.scheduling.inference_queue import Observation
    from joynexus.scheduling.training_queue import TrainingQueue
    from joynexus.scheduling.training_scheduler import COMPLETED, TrainingScheduler
    from joynexus.services.inference.service import InferenceModelService
    from joynexus.services.producers.sft import SFTProducer
    from joynexus.services.training.service import TrainingModelService

    queue = TrainingQueue()
    training = TrainingModelService(BackboneSource(preset="tiny"), tmp_path / "ckpt", queue=queue, num_threads=1)
    inference = InferenceModelService(BackboneSource(preset="tiny"), num_threads=1, max_wait_ms=0.0)
    store = ControlPlaneStore(f"sqlite:///{tmp_path / 'control.db'}")
    scheduler = TrainingScheduler(store, release_partition=queue.clear)
    # The dataset's Great Expectations checks have tests of their own (tests/data/test_validation.py).
    caps = BackendCapabilities.single(training.capabilities())
    creator = TenantCreator(store, scheduler, caps, validate_datasets=False)
    states, _ = dataset_frames(scaled)
    out = {}
    try:
        for name, modes in (("normed", {}), ("raw", {"STATE": "IDENTITY", "ACTION": "IDENTITY"})):
            spec = sft_spec(
                name, scaled, base_model=training.backbone.model_id, cameras=(), state_dim=4, action_dim=2,
                action_chunk=1, jobs=TRAIN_JOBS, samples_per_job=48, microbatch_size=16, lr=3e-3,
            )  # fmt: skip
            spec["dataset"]["repo_id"] = "test/scaled"
            spec["normalization"] = modes
            spec["training"]["checkpoint_every_jobs"] = 0
            tenant = creator.create(spec)
            training.add_tenant(tenant.backend_config)
            producer = SFTProducer.from_dataset(
                tenant.backend_config, scheduler, service_handle(TrainingQueue, queue), str(scaled), "test/scaled"
            )
            loop = ActorLoop(scheduler, training)
            for _ in range(TRAIN_JOBS):
                assert producer.produce_once() is not None
                assert loop.step().state == COMPLETED
            inference.load_weights(training.export_params(name))
            observations = [Observation(images=(), state=s, instruction="move the arm") for s in states]
            actions = np.asarray(inference.predict(name, observations)["actions"])[:, 0, :]
            out[name] = {"actions": actions, "normalization": tenant.backend_config.normalization}
    finally:
        inference.close()
        store.dispose()
    return out


def relative_errors(predicted: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per action dimension: RMSE over the frames / the dimension's standard deviation."""
    return np.sqrt(((predicted - target) ** 2).mean(0)) / target.std(0)


def test_normalized_sft_converges_on_every_dimension_and_raw_does_not(tmp_path: Path, scaled: Path):
    _, target = dataset_frames(scaled)
    assert 300 < target.std(0)[1] / target.std(0)[0] < 3000  # ~ SCALES[1] / SCALES[0]
    results = _train_and_predict(tmp_path, scaled)
    normed = relative_errors(results["normed"]["actions"], target)
    raw = relative_errors(results["raw"]["actions"], target)
    print(f"per-dimension relative error: normalized {normed.round(3).tolist()}, raw {raw.round(3).tolist()}")
    # Predictions come back in the dataset's units: each dimension near the data, per its own scale.
    assert normed.max() < 0.35, normed
    assert np.allclose(results["normed"]["actions"].mean(0), target.mean(0), rtol=0.05, atol=0.1 * target.std(0))
    # Raw units: the 1,000x dimension dominates the loss and the small one is not learned.
    assert raw.max() > 0.8, raw
    assert raw.max() > 3 * normed.max()
    assert results["normed"]["normalization"]["modes"] == DEFAULT_MODES
    assert results["raw"]["normalization"]["stats"] == {}


def test_the_version_carries_its_normalization_in_checkpoints_exports_and_tags(tmp_path: Path, scaled: Path):
    from joynexus.artifacts import CheckpointStore, decode_tenant_payload
    from joynexus.artifacts.exports import export_directory
    from joynexus.core.tenants import TenantBackendConfig
    from joynexus.models.backbone import BackboneSource
    from joynexus.services.training.service import TrainingModelService
    from tests.helpers import compiled_config

    training = TrainingModelService(BackboneSource(preset="tiny"), tmp_path / "ckpt", num_threads=1)
    normalizer = dataset_normalizer(scaled, {"ACTION": "MIN_MAX"}, 4, 2)
    config = compiled_config("carry", training.capabilities(), cameras=(), state_dim=4, action_dim=2, action_chunk=1)
    config = TenantBackendConfig.model_validate({**config.model_dump(), "normalization": normalizer.to_dict()})
    training.add_tenant(config)
    training.save(["carry"])
    store = CheckpointStore(tmp_path / "ckpt")
    manifest, _, _ = store.load_tenant("carry", 0)
    assert NORMALIZATION_FILE in manifest.files
    assert manifest.extra["normalization"] == normalizer.to_dict()
    payload = training.export_params("carry")
    assert decode_tenant_payload(payload)[1].extra["normalization"] == normalizer.to_dict()
    export_directory(payload, tmp_path / "export")
    written = json.loads((tmp_path / "export" / "action_module" / NORMALIZATION_FILE).read_text())
    assert Normalizer.from_dict(written) == normalizer
    assert normalizer.tags() == {
        "normalization.action": "MIN_MAX",
        "normalization.state": "MEAN_STD",
        "normalization.visual": "IDENTITY",
        "normalization.source": "meta/stats.json",
    }


@pytest.mark.parametrize(("mode", "low", "high"), [("QUANTILES", "q01", "q99"), ("QUANTILE10", "q10", "q90")])
def test_quantile_modes_equal_lerobots_normalizer_both_ways(mode: str, low: str, high: str):
    """π0.5's default modes: [q_lo, q_hi] onto [-1, 1] as LeRobot's NormalizerProcessorStep maps them."""
    import torch

    types = pytest.importorskip("lerobot.configs.types")
    from lerobot.processor.normalize_processor import NormalizerProcessorStep, UnnormalizerProcessorStep

    stats = {
        "observation.state": {low: [-2.0, 0.0, 1.0], high: [2.0, 0.0, 3.0]},
        "action": {low: [-1.0, -4.0], high: [1.0, 4.0]},
    }
    ours = Normalizer.from_stats({"STATE": mode, "ACTION": mode}, stats, {"STATE": 3, "ACTION": 2})
    features = {
        "observation.state": types.PolicyFeature(types.FeatureType.STATE, (3,)),
        "action": types.PolicyFeature(types.FeatureType.ACTION, (2,)),
    }
    modes = {"STATE": types.NormalizationMode(mode), "ACTION": types.NormalizationMode(mode)}
    tensors = {k: {s: torch.tensor(v) for s, v in e.items()} for k, e in stats.items()}
    normalize = NormalizerProcessorStep(features=features, norm_map=modes, stats=tensors)
    unnormalize = UnnormalizerProcessorStep(features=features, norm_map=modes, stats=tensors)
    state = np.array([[1.0, 0.5, 2.5], [-3.0, 0.0, 1.0]], dtype=np.float32)
    action = np.array([[0.5, -2.0]], dtype=np.float32)
    theirs_state = normalize._normalize_observation({"observation.state": torch.from_numpy(state)}, inverse=False)
    np.testing.assert_allclose(ours.normalize_state(state), theirs_state["observation.state"].numpy(), rtol=1e-6)
    theirs_action = unnormalize._normalize_action(torch.from_numpy(action), inverse=True)
    np.testing.assert_allclose(ours.unnormalize_action(action), theirs_action.numpy(), rtol=1e-6)
