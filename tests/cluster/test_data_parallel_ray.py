"""A data-parallel Training Model Service on Ray (issue 45.2): one logical service over 2 rank
actors (gloo on the CPU), as the deployment runs it with JOYNEXUS_TRAINING_DATA_PARALLEL=2.

A leased SFT job on it (each rank reading the partition itself and stepping its chunk of every
microbatch) equals the same job trained on one device, within float tolerance, and the ranks hold
the same state; and the whole deployment (Master, actor loop, producers) runs workloads to completion
over it."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import torch

from joynexus.core.tenants import BaseModelCapabilities
from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import TrainingJob
from joynexus.services.training.service import TrainingModelService
from joynexus.settings import Settings
from tests.helpers import (
    TINY_MODEL_ID,
    assert_trained_state_close,
    interface_config,
    random_microbatch,
    ray_deployment,
    sft_spec,
    write_dataset_for,
)

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a Ray start and rank processes, each with a backbone

ROWS = 11  # microbatches of 4: 4, 4, 3 rows; each split 2 + 2 and 2 + 1 over the ranks


def _job(config, partition: str, job_id: str) -> TrainingJob:
    return TrainingJob(
        job_id=job_id, policy_key=f"{config.tenant_id}:sft", tenant_id=config.tenant_id, task_type="sft",
        partition_id=partition, sample_count=ROWS, domain="vla",
        metadata={"schema_signature": config.schema_signature}, priority=0, created_seq=0, ready_seq=0,
        behavior_policy_version=None, max_policy_staleness=1, producer_role="sft", consumer_role="actor",
        state="leased", lease_owner="actor", terminal_reason=None,
    )  # fmt: skip


def test_a_split_sft_job_equals_the_one_device_job_and_the_ranks_agree(tmp_path):
    from joynexus.actors import init_ray, service_handle
    from joynexus.services.configs import TrainingQueueConfig
    from joynexus.services.training.data_parallel import DataParallelTrainingService

    started_ray = not ray.is_initialized()
    init_ray(num_cpus=3)
    namespace = f"dp-{uuid.uuid4().hex[:8]}"
    caps = BaseModelCapabilities(model_id=TINY_MODEL_ID, feature_dim=64, max_images=3, image_size=32)
    configs = [
        interface_config(f"dp-{i}", caps, "oft_mlp", seed=i).model_copy(update={"microbatch_size": 4}) for i in range(2)
    ]
    queue_actor = TrainingQueueConfig().actor(namespace=namespace)
    remote_queue = service_handle(TrainingQueue, queue_actor)
    local_queue = TrainingQueue()
    single = TrainingModelService(BackboneSource(preset="tiny"), tmp_path / "one", local_queue, 1, placement="cpu")
    group = DataParallelTrainingService(
        BackboneSource(preset="tiny"), str(tmp_path / "dp"), queue_actor, 1, world_size=2, placement="cpu"
    )
    try:
        assert group.heartbeat()["data_parallel"]["world_size"] == 2
        for config in configs:
            single.add_tenant(config)
            group.add_tenant(config)
        for round_ in range(2):
            jobs = []
            for i, config in enumerate(configs):
                partition = f"vla/{config.tenant_id}/sft/{round_}"
                data = random_microbatch(config, ROWS, seed=10 * round_ + i)
                for q in (remote_queue, local_queue):
                    q.put(partition, data, annotations={"tenant_id": config.tenant_id})
                jobs.append(_job(config, partition, f"j{round_}-{i}"))
            # Round 0: one job at a time (train_job); round 1: both grouped (train_jobs).
            got = [group.train_job(j) for j in jobs] if round_ == 0 else group.train_jobs(jobs)
            want = [single.train_job(j) for j in jobs]
            for g, w in zip(got, want, strict=True):
                assert "error" not in g, g
                assert (g["version"], g["samples"], g["optimizer_steps"]) == (
                    w["version"],
                    w["samples"],
                    w["optimizer_steps"],
                )
                torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(w["losses"]), rtol=1e-5, atol=1e-6)
        for config in configs:
            digests = group.state_digests(config.tenant_id)
            assert len(digests) == 2 and digests[0] == digests[1]
            # Within what two summation orders of the same gradients give after AdamW (`assert_trained_state_close`).
            want, have = single.tenant_state(config.tenant_id), group.tenant_state(config.tenant_id)
            steps = single.tenant_status(config.tenant_id)["optimizer_steps"]
            assert_trained_state_close(want, have, config.learning_rate, steps, where=config.tenant_id)
            # The counters are the group's: every rank counts the rows the others stepped.
            status = group.tenant_status(config.tenant_id)
            assert status["samples_trained"] == single.tenant_status(config.tenant_id)["samples_trained"] == 2 * ROWS
            assert status["last_loss"] == pytest.approx(single.tenant_status(config.tenant_id)["last_loss"], rel=1e-5)
        # A microbatch too small to split is refused by name, and changes nothing.
        with pytest.raises(ValueError, match="needs >= 2"):
            group.train_batch(configs[0].tenant_id, random_microbatch(configs[0], 1, seed=5))
        assert group.policy_version(configs[0].tenant_id) == 2
    finally:
        group.close()
        ray.kill(queue_actor)
        if started_ray:
            ray.shutdown()


@pytest.mark.parametrize("shards", [1, 2])
def test_the_deployment_runs_workloads_over_a_data_parallel_training_service(tmp_path, shards):
    """JOYNEXUS_TRAINING_DATA_PARALLEL=2 on the whole Ray deployment: the training role (or each of
    2 shards, on bundles 2i, 2i+1 of one placement group) is the logical service over 2 ranks, the
    Master's actor loop trains over it, both workloads complete with their versions registered, and
    the ranks agree. With one service, a rank is then killed: the service restarts whole, its tenants
    are restored, and the next job trains on."""
    from joynexus.services.training.service import TRAINING_SERVICE_ACTOR_NAME
    from joynexus.services.training.shard_router import shard_actor_name

    namespace = f"test-dp-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        data_dir=tmp_path / "data", ray_namespace=namespace, torch_threads=1, training_data_parallel=2,
        training_shards=shards,
    )  # fmt: skip
    with ray_deployment(settings, num_cpus=2 + 2 * shards) as cluster:
        model_id = cluster.training.capabilities().model_id
        workloads = {}
        for i, (name, module) in enumerate((("dp-oft", "oft_mlp"), ("dp-flow", "flow_matching"))):
            spec = sft_spec(name, tmp_path / name, module=module, jobs=None, max_in_flight=1)
            write_dataset_for(spec, seed=i)
            cluster.master.create_tenant({**spec, "base_model": model_id})
            workloads[name] = cluster.master.submit_workload(name, jobs=2).workload_id
        for name, workload_id in workloads.items():
            final = cluster.wait_workload(workload_id, timeout_s=300)
            assert final.state == "completed" and final.completed_jobs == 2, (name, final.state, final.error)
            assert final.version == 2 and final.registered_version is not None, final
        names = [TRAINING_SERVICE_ACTOR_NAME] if shards == 1 else [shard_actor_name(i) for i in range(shards)]
        held: dict[str, list[str]] = {}
        pids: set[int] = set()
        for actor_name in names:
            actor = ray.get_actor(actor_name, namespace=namespace)
            beat = ray.get(actor.heartbeat.remote(), timeout=60)
            assert beat["data_parallel"]["world_size"] == 2, beat
            pids.update(beat["data_parallel"]["rank_pids"])
            for name in beat["tenants"]:
                held[name] = actor_name
                digests = ray.get(actor.state_digests.remote(name), timeout=60)
                assert len(digests) == 2 and digests[0] == digests[1], name
        assert sorted(held) == sorted(workloads) and len(pids) == 2 * shards  # a process per rank
        if shards == 1:
            # A rank that dies takes the logical service with it: Ray restarts it whole (new ranks), the
            # Health Manager restores its tenants from their checkpoints, and training goes on.
            before = beat["incarnation"]
            os.kill(beat["data_parallel"]["rank_pids"][1], signal.SIGKILL)
            deadline = time.monotonic() + 120
            while True:
                try:
                    beat = ray.get(actor.heartbeat.remote(), timeout=30)
                    if beat["incarnation"] != before:
                        break
                except Exception:  # the service's process is restarting
                    pass
                assert time.monotonic() < deadline, "the data-parallel service did not restart"
                time.sleep(0.5)
            assert not pids & set(beat["data_parallel"]["rank_pids"])
            final = cluster.wait_workload(cluster.master.submit_workload("dp-oft", jobs=1).workload_id, timeout_s=300)
            assert final.state == "completed" and final.version == 3, (final.state, final.error, final.version)
            digests = ray.get(actor.state_digests.remote("dp-oft"), timeout=60)
            assert digests[0] == digests[1]
