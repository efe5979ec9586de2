"""The whole SFT path on Ray: named actors, concurrent producers, one actor loop, MLflow registry."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import ray

from joynexus.actors import init_ray, service_handle
from joynexus.registry import registered_model_name
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.services.configs import TrainingQueueConfig
from joynexus.settings import Settings
from recipes.main_job import DEMO_TENANTS, run_demo


@pytest.fixture(scope="module")
def local_ray():
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


@ray.remote
def _produce(partition_id: str, namespace: str) -> int:
    queue = ray.get_actor("joynexus.training_queue", namespace=namespace)
    return ray.get(queue.put.remote(partition_id, {"x": np.arange(6, dtype=np.float32), "tenant_id": ["t"] * 6}))


def test_the_training_queue_is_shared_between_processes(local_ray):
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    queue = service_handle(TrainingQueue, TrainingQueueConfig().actor(namespace=namespace))
    assert ray.get(_produce.remote("vla/t/sft/job1", namespace)) == 6  # written by a Ray worker process
    meta = queue.get_meta("vla/t/sft/job1", ["x"], batch_size=4)
    assert queue.get_data(meta)["x"].tolist() == [0, 1, 2, 3]
    assert queue.clear("vla/t/sft/job1") and queue.partitions() == []
    assert isinstance(TrainingQueue(), TrainingQueue)


# Slow (74 s of the default run): the main job's path on Ray is in the default run as
# tests/master/test_promotion_paths.py::test_main_job_path_on_ray_registers_both_aliases_with_the_heldout_loss.
@pytest.mark.slow
def test_main_job_trains_three_schemas_on_one_backbone_and_registers_them(local_ray, tmp_path):
    settings = Settings(data_dir=tmp_path, ray_namespace=f"test-{uuid.uuid4().hex[:8]}", torch_threads=1)
    # ManiSkill camera sessions take ~10 s each to start on a CPU: its tenant runs in the slow test below.
    result = run_demo(
        settings, jobs_per_tenant=3, samples_per_job=32, rl_jobs=2, maniskill_jobs=0, demo_episodes=6, eval_episodes=2
    )
    assert result.backbone["instances_created"] == 1
    assert len({t.schema_signature for t in result.tenants}) == len(DEMO_TENANTS) + 1  # reach SFT = reach RL schema
    assert {t.spec.task.value for t in result.tenants} == {"sft", "rl"}
    from joynexus.registry import ExperimentTracker

    tracker = ExperimentTracker(settings.resolved_mlflow_uri())
    for status in result.statuses.values():
        assert status.state == "completed" and status.error is None, status
        assert status.registered_version == 1
    rl = result.statuses["reacher-rl"]
    assert rl.task == "rl" and rl.completed_jobs == rl.version == 2
    assert tracker.metric_history(rl.run_id, "rl/clip_fraction")
    # A lab's LeRobot SmolVLA checkpoint, fine-tuned on the Ray deployment beside the others.
    smolvla = result.statuses["smolvla-reacher"]
    assert smolvla.completed_jobs == 3 and smolvla.version == 3
    assert (
        next(t for t in result.tenants if t.tenant_id == "smolvla-reacher").backend_config.action_module["kind"]
        == "smolvla"
    )
    for name in ("reacher-rl", "reacher-sft", "smolvla-reacher"):
        before, after = result.evaluations[name]["before"], result.evaluations[name]["after"]
        assert before.state == after.state == "completed", (before.error, after.error)
        assert before.result["policy_version"] == 0 and after.result["policy_version"] == result.statuses[name].version
        assert before.result["episodes"] == after.result["episodes"] == 2
    for tenant in result.tenants[: len(DEMO_TENANTS)]:
        status = result.statuses[tenant.tenant_id]
        assert status.completed_jobs == 3 and status.version == 3
        history = tracker.metric_history(status.run_id, "train/loss")
        assert len(history) == status.optimizer_steps == 3 * 2  # 32 samples / microbatch 16 per job
        assert [loss for _, loss in history] == pytest.approx(result.losses[tenant.tenant_id])
        tags = tracker.model_version_tags(tenant.tenant_id, 1)
        assert tags["schema_signature"] == tenant.schema_signature and tags["policy_version"] == "3"
        payload, manifest = tracker.fetch_tenant_payload(tenant.tenant_id, version=1)
        assert manifest.policy_version == 3 and registered_model_name(tenant.tenant_id)
    # A second run continues the same tenants from where they stopped.
    again = run_demo(settings, jobs_per_tenant=1, samples_per_job=32, simulators=False)
    assert all(again.statuses[t.tenant_id].version == 4 for t in again.tenants)


@pytest.mark.slow
def test_main_job_with_a_maniskill_rl_tenant(local_ray, tmp_path):
    settings = Settings(data_dir=tmp_path, ray_namespace=f"test-{uuid.uuid4().hex[:8]}", torch_threads=1)
    result = run_demo(
        settings, jobs_per_tenant=1, samples_per_job=32, rl_jobs=1, maniskill_jobs=1, demo_episodes=4, eval_episodes=2
    )
    cube = result.statuses["cube-pusher-rl"]
    assert cube.state == "completed" and cube.version == 1, cube
    evaluation = result.evaluations["cube-pusher-rl"]["after"]
    assert evaluation.state == "completed" and evaluation.result["simulator"] == "maniskill"
