"""The data-parallel training group (issue 45.2): one logical Training Model Service over 2 ranks
(Ray actors, gloo on the CPU). Each grouped step splits every tenant's microbatch across the ranks
and all-reduces the gradients; after every step each rank holds the same tenant state (digests).
For a module whose loss is a deterministic per-sample mean (oft_mlp: two tenants, the batched
same-architecture path) that state equals the single-device step's within float tolerance; a
flow-matching tenant's loss draws noise and times per microbatch, so each rank draws its own for
its chunk: its ranks stay identical, its step is not the single device's draw for draw."""

from __future__ import annotations

import tempfile

import pytest
import torch

from joynexus.core.tenants import BaseModelCapabilities
from joynexus.models.backbone import BackboneSource
from joynexus.services.training.data_parallel import split_rows
from joynexus.services.training.service import TrainingModelService
from tests.helpers import TINY_MODEL_ID, interface_config, random_microbatch

# Two tenants of one architecture (their losses batch into one computation) and a flow-matching one.
TENANTS = {"dp-a": "oft_mlp", "dp-b": "oft_mlp", "dp-flow": "flow_matching"}


def test_rows_split_into_contiguous_near_equal_chunks():
    assert split_rows(7, 2) == [slice(0, 4), slice(4, 7)]
    assert split_rows(6, 3) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    with pytest.raises(ValueError, match="needs >= 3"):
        split_rows(2, 3)


@pytest.mark.slow  # a Ray start and two rank processes, each with a backbone
def test_two_gloo_ranks_step_equal_to_one_device_and_stay_identical(tmp_path):
    ray = pytest.importorskip("ray")
    from joynexus.actors import init_ray
    from joynexus.services.training.data_parallel import DataParallelTrainingService

    started_ray = not ray.is_initialized()
    init_ray(num_cpus=2)
    caps = BaseModelCapabilities(model_id=TINY_MODEL_ID, feature_dim=64, max_images=3, image_size=32)
    configs = {name: interface_config(name, caps, kind, seed) for seed, (name, kind) in enumerate(TENANTS.items())}
    single = TrainingModelService(BackboneSource(preset="tiny"), tmp_path / "single", num_threads=1, placement="cpu")
    group = DataParallelTrainingService(
        BackboneSource(preset="tiny"), str(tmp_path / "dp"), world_size=2, placement="cpu"
    )
    try:
        for config in configs.values():
            single.add_tenant(config)
            group.add_tenant(config)
        for step in range(3):
            # 7 rows: the ranks get 4 and 3 (unequal chunks, weighted by their share of the rows).
            batches = [
                (name, random_microbatch(c, 7, seed=10 * step + i)) for i, (name, c) in enumerate(configs.items())
            ]
            expected = single.train_group(batches)
            got = group.train_group(batches)  # raises RankStateDiverged if the ranks' states differ
            for e, g in zip(expected, got, strict=True):
                assert g["tenant_id"] == e["tenant_id"] and g["version"] == e["version"] == step + 1
                if TENANTS[g["tenant_id"]] == "oft_mlp":
                    assert g["loss"] == pytest.approx(e["loss"], rel=1e-5, abs=1e-6)
            for name in configs:
                digests = group.state_digests(name)
                assert len(digests) == 2 and digests[0] == digests[1]
        for name in ("dp-a", "dp-b"):
            want, have = single.tenant_state(name), group.tenant_state(name)
            for key, tensor in want["module"].items():
                torch.testing.assert_close(have["module"][key], tensor, rtol=1e-4, atol=1e-5)
            for index, values in want["optimizer"]["state"].items():
                for key, value in values.items():
                    torch.testing.assert_close(have["optimizer"]["state"][index][key], value, rtol=1e-3, atol=1e-7)
            assert any(not torch.equal(t, single_initial) for t, single_initial in _changed(want, configs[name]))
    finally:
        group.close()
        if started_ray:
            ray.shutdown()


def _changed(state, config):
    """(trained tensor, the same tensor of a fresh slot): the steps changed the weights at all."""
    fresh = TrainingModelService(
        BackboneSource(preset="tiny"), tempfile.mkdtemp(prefix="joynexus-dp-"), num_threads=1, placement="cpu"
    )
    fresh.add_tenant(config, resume=False)
    initial = fresh.tenant_state(config.tenant_id)["module"]
    return [(tensor, initial[key]) for key, tensor in state["module"].items()]
