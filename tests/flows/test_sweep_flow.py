"""The `sweep` flow on an in-process deployment, lean (N=2): a dataset-only SFT tenant with a held-out
episode is forked into two learning rates, both train side by side, each is scored by its held-out
loss, MLflow gets one parent run with a child run per variant, and the best is adopted into the
source (installed as its next version, promoted by the source's rule)."""

from __future__ import annotations

import pytest

from joynexus.master.sweeps import expand_variants
from tests.helpers import assert_state_equal, sft_spec, write_dataset_for


@pytest.fixture(scope="module")
def cluster(prefect_api, tmp_path_factory):
    from flows.tasks import shared_tracker
    from joynexus.connect import in_process, use_cluster
    from joynexus.settings import Settings

    root = tmp_path_factory.mktemp("sweep")
    cluster = in_process(Settings(data_dir=root / "data", torch_threads=1))
    previous = use_cluster(cluster)
    shared_tracker.cache_clear()
    try:
        yield cluster
    finally:
        use_cluster(previous)
        shared_tracker.cache_clear()
        cluster.close()


def test_a_sweep_of_two_learning_rates_logs_one_comparison_and_adopts_the_best(cluster, tmp_path):
    from flows.sweep import sweep
    from flows.tasks import shared_tracker

    spec = sft_spec("swept", tmp_path / "ds", jobs=1, samples_per_job=8, microbatch_size=8)
    spec["dataset"]["validation_episodes"] = 1
    write_dataset_for(spec, episodes=3, length=8)
    cluster.master.create_tenant(spec)

    result = sweep("swept", grid={"learning_rate": [1e-4, 3e-2]}, jobs=1, train_timeout_s=300)

    rows = result["rows"]
    assert [row["changes"] for row in rows] == [{"learning_rate": 1e-4}, {"learning_rate": 3e-2}]
    assert all(row["state"] == "completed" and row["metric"] == "eval/heldout_loss" for row in rows), rows
    best = result["best"]
    assert rows[best]["value"] == min(row["value"] for row in rows)
    for row in rows:  # each variant is its own tenant, forked from the source's version 0, with its own lr
        tenant = cluster.master.get_tenant(row["tenant_id"])
        assert tenant.backend_config.learning_rate == row["changes"]["learning_rate"]
        assert tenant.schema_signature == cluster.master.get_tenant("swept").schema_signature

    runs = shared_tracker().client.search_runs(
        [shared_tracker().experiment_id], f"tags.sweep_id = '{result['sweep_id']}'"
    )
    parent = next(r for r in runs if r.info.run_id == result["run_id"])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.data.tags["best_tenant"] == rows[best]["tenant_id"]
    assert sorted(float(c.data.params["learning_rate"]) for c in children) == [1e-4, 3e-2]
    assert all("eval/heldout_loss" in c.data.metrics for c in children)

    promotion = result["promotion"]
    assert promotion["adopted"] and promotion["tenant_id"] == "swept" and promotion["installed_version"] == 1
    source = cluster.training.tenant_state("swept")["module"]
    assert_state_equal(source, cluster.training.tenant_state(rows[best]["tenant_id"])["module"], "adopted")


@pytest.mark.parametrize(
    ("grid", "variants", "needle"),
    [
        (None, None, "grid: give either"),
        ({"learning_rate": [0.0]}, None, "grid.learning_rate"),
        ({"momentum": [0.9]}, None, "grid.momentum: not a sweep field"),
        ({"seed": []}, None, "grid.seed"),
        (None, [{"seed": 1}, {"seed": 1}], "appears twice"),
        (None, [{"seed": 1}, {"learning_rate": 5}], "variants\\[1\\].learning_rate"),
    ],
)
def test_bad_sweeps_are_refused_naming_the_field(grid, variants, needle):
    with pytest.raises(ValueError, match=needle):
        expand_variants(grid, variants)


def test_a_grid_is_every_combination_in_order():
    variants = expand_variants({"learning_rate": [1e-3, 1e-2], "seed": [0, 1]})
    assert [v.label() for v in variants] == [
        "learning_rate=0.001,seed=0", "learning_rate=0.001,seed=1", "learning_rate=0.01,seed=0",
        "learning_rate=0.01,seed=1",
    ]  # fmt: skip


def test_a_module_size_variant_is_a_new_tenant_from_the_spec(cluster, tmp_path):
    from joynexus.master.sweeps import SweepVariant, create_variant
    from joynexus.spec import SpecError

    spec = sft_spec("sized", tmp_path / "ds", jobs=1, samples_per_job=8, microbatch_size=8)
    write_dataset_for(spec, episodes=2, length=8)
    cluster.master.create_tenant(spec)
    made = create_variant(cluster.master, "sized", None, SweepVariant(module_size="small", seed=4), "sized-small")
    assert made["forked_from"] is None
    config = cluster.master.get_tenant("sized-small").backend_config
    assert config.action_module["size"] == "small" and config.seed == 4
    assert config.schema_signature == cluster.master.get_tenant("sized").schema_signature
    with pytest.raises(SpecError) as caught:
        create_variant(cluster.master, "sized", None, SweepVariant(module_size="colossal"), "sized-bad")
    assert caught.value.fields == ["module_size"]
    assert "sized-bad" not in {t.tenant_id for t in cluster.master.list_tenants()}
