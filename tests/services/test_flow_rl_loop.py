"""A flow-matching head learns by RL through the services (in-process deployment): rollouts sample
its noise-injected denoising chain (`models.action_modules.flow_rl`) through the Inference Queue and
record the chains, the Training Model Service rescores them in PPO (GAE with a critic, GRPO
without), and the staleness rule drops a too-old flow rollout like any other."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from joynexus.artifacts.codec import decode_tenant_payload
from joynexus.master.workloads.manager import WorkloadManager
from joynexus.scheduling.training_scheduler import COMPLETED, DROPPED
from tests.services.test_rl_loop import dep, parts, rl_spec  # noqa: F401  (dep: the fixture)

STEPS = 10  # FlowMatchingConfig.num_inference_steps default (the spec does not set it)


def flow_rl_spec(tenant: str, **options) -> dict:
    spec = rl_spec(tenant, **options)
    spec["action_module"] = {"kind": "flow_matching", "size": "tiny"}
    spec["observation"]["action_chunk"] = 2
    return spec


@pytest.mark.parametrize("advantage", ["gae", "grpo"])
def test_a_flow_head_rollout_records_its_chains_and_ppo_updates_the_policy(dep, advantage):  # noqa: F811
    dep.creator.create(flow_rl_spec("flow", advantage=advantage))
    tenant, producer, stage, actor = parts(dep, "flow")
    before = decode_tenant_payload(dep.training_service.export_params("flow"))[0]
    try:
        job = producer.produce_once()
        queue = dep.queue
        assert "chain" in queue.describe(job.partition_id)["fields"]
        stage.step()
        meta = queue.get_meta(job.partition_id, ("chain", "action", "log_prob"), 12, "check")
        data = queue.get_data(meta)
        chain, action = np.asarray(data["chain"]), np.asarray(data["action"])
        assert chain.shape == (12, STEPS + 1, 2, 2)
        np.testing.assert_allclose(chain[:, -1], action, atol=1e-6)  # the executed action ends its chain
        assert np.isfinite(np.asarray(data["log_prob"])).all()
        outcome = actor.step()
        assert outcome.state == COMPLETED and outcome.metrics["samples"] == 12, outcome
        stats = outcome.metrics["rl_stats"]
        assert np.isfinite(stats["rl/approx_kl"]) and ("rl/value_loss" in stats) == (advantage == "gae")
        after = decode_tenant_payload(dep.training_service.export_params("flow"))[0]
        moved = [k for k in before if not torch.equal(before[k], after[k])]
        assert any(k.startswith("noise_net.") for k in moved) and any(k.startswith("blocks.") for k in moved)
    finally:
        producer.close()


def test_a_stale_flow_rollout_is_dropped_by_the_staleness_rule(dep):  # noqa: F811
    dep.creator.create(flow_rl_spec("stale-flow", staleness=0))
    _, producer, stage, actor = parts(dep, "stale-flow")
    try:
        producer.produce_once(), producer.produce_once()
        stage.step(), stage.step()
        assert actor.step().state == COMPLETED
        outcome = actor.step()
        assert outcome.state == DROPPED and outcome.reason == "policy_stale"
    finally:
        producer.close()


@pytest.mark.slow  # ~28 s: the workload's evaluation beside it; the tests above cover each stage
def test_a_flow_rl_workload_runs_and_publishes_through_the_workload_manager(dep):  # noqa: F811
    dep.creator.create(flow_rl_spec("flow-workload", advantage="grpo", jobs=1))
    manager = WorkloadManager(dep).start()
    try:
        status = manager.wait(manager.submit("flow-workload", jobs=1).workload_id, timeout_s=300)
        assert status.state == "completed", status.error
        assert status.version == 1 and dep.inference_service.versions("flow-workload")[-1] == 1
    finally:
        manager.stop()
