"""The RL closed loop on a real simulator (gym-pusht): Table 4 sequences for RL jobs, stale drops,
failures with their partitions cleared, version bookkeeping, and read-only evaluation."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from joynexus.actors import handle_of
from joynexus.master.deployment import Deployment
from joynexus.master.loops.actor_loop import ActorLoop
from joynexus.master.workloads.manager import WorkloadManager
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import COMPLETED, DROPPED, FAILED, NEEDS_ADVANTAGES, READY
from joynexus.services.producers.advantages import AdvantageStage
from joynexus.services.producers.evaluation import evaluate_policy
from joynexus.services.producers.rollout import RolloutProducer
from joynexus.services.training.trainer import SlotTrainer
from joynexus.settings import Settings
from tests.helpers import TINY_MODEL_ID


def rl_spec(tenant: str, *, staleness: int | None = None, advantage: str = "gae", jobs: int = 4) -> dict:
    return {
        "tenant": tenant,
        "base_model": TINY_MODEL_ID,
        "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {"cameras": ["top"], "image_size": [32, 32], "state_dim": 2, "action_dim": 2,
                        "instruction": "push the T-shaped block onto the target"},
        "environment": {"simulator": "pusht", "task": "PushT-v0", "num_envs": 2, "horizon": 6},
        "rl": {"advantage": advantage, "ppo_epochs": 2},
        "scheduling": {"max_in_flight_jobs": 2, "completion_target": jobs, "max_policy_staleness": staleness},
        "training": {"samples_per_job": 12, "microbatch_size": 6},
    }  # fmt: skip


@pytest.fixture
def dep(tmp_path):
    deployment = Deployment.in_process(Settings(data_dir=tmp_path / "data", torch_threads=1))
    yield deployment
    deployment.shutdown()


def parts(dep, tenant_id: str):
    tenant = dep.creator.get(tenant_id)
    dep.training_service.add_tenant(tenant.backend_config)
    payload = dep.training_service.export_params(tenant_id)
    dep.inference_service.load_weights(payload)
    producer = RolloutProducer(
        tenant.backend_config, dep.scheduler, dep.queue, dep.environment_service, dep.inference_service
    )
    stage = AdvantageStage(dep.scheduler, dep.queue, lambda t: dep.creator.get(t).backend_config)
    return tenant, producer, stage, ActorLoop(dep.scheduler, dep.training_service)


def count_backbone_encodes(monkeypatch) -> list[int]:
    """Patch SlotTrainer.encode to record each call's sample count; the list fills as it runs."""
    encode, encoded = SlotTrainer.encode, []

    def counting_encode(self, images, instructions, adapters=None, grad=False):
        encoded.append(len(instructions))
        return encode(self, images, instructions, adapters, grad)

    monkeypatch.setattr(SlotTrainer, "encode", counting_encode)
    return encoded


def test_rl_job_goes_reserved_advantages_ready_leased_completed(dep):
    dep.creator.create(rl_spec("pusher"))
    tenant, producer, stage, actor = parts(dep, "pusher")
    try:
        job = producer.produce_once()
        assert job.state == NEEDS_ADVANTAGES and job.behavior_policy_version == 0
        described = dep.queue.describe(job.partition_id)
        assert described["num_samples"] == 12
        assert described["annotations"] == {"tenant_id": "pusher", "schema_signature": tenant.schema_signature,
                                            "behavior_policy_version": 0}  # fmt: skip
        assert actor.step(wait_s=0.01) is None  # not ready before its advantages
        assert stage.step().state == READY
        assert {"advantage", "return"} <= set(dep.queue.describe(job.partition_id)["fields"])
        outcome = actor.step()
        assert outcome.state == COMPLETED and outcome.metrics["samples"] == 12
        assert len(outcome.metrics["losses"]) == 2 * 2  # 12 samples / microbatch 6, two PPO epochs
        assert {"rl/clip_fraction", "rl/value_loss"} <= set(outcome.metrics["rl_stats"])
        assert not dep.queue.has_partition(job.partition_id)
        assert dep.training_service.policy_version("pusher") == 1
        assert dep.inference_service.versions("pusher") == [0]  # published by the workload, not the actor
    finally:
        producer.close()


def test_each_ppo_epoch_reads_the_rollout_in_a_fresh_order_and_encodes_each_sample_once(dep, monkeypatch):
    reads: dict[str, list[tuple[int, ...]]] = {}
    get_meta = TrainingQueue.get_meta

    def recording_get_meta(self, partition_id, fields, batch_size, task_name="train", order=None):
        meta = get_meta(self, partition_id, fields, batch_size, task_name, order)
        if meta is not None and task_name.startswith("ppo-epoch-"):
            reads.setdefault(task_name, []).append(meta.indices)
        return meta

    monkeypatch.setattr(TrainingQueue, "get_meta", recording_get_meta)
    encoded = count_backbone_encodes(monkeypatch)
    dep.creator.create(rl_spec("shuffler"))  # 12 samples, microbatches of 6, two PPO epochs
    _, producer, stage, actor = parts(dep, "shuffler")
    try:
        producer.produce_once()
        stage.step()
        assert actor.step().state == COMPLETED
    finally:
        producer.close()
    epochs = [sum(reads[f"ppo-epoch-{e}@0"], ()) for e in range(2)]  # attempt 0
    assert [sorted(e) for e in epochs] == [list(range(12))] * 2  # every sample once per epoch
    assert epochs[0] != tuple(range(12)) and epochs[0] != epochs[1]  # shuffled, afresh each epoch
    assert sum(encoded) == 12  # the frozen backbone: one forward per sample over both epochs


@pytest.mark.parametrize("head", ["oft_mlp", "flow_matching"])
def test_the_decoupled_objective_anchors_each_update_at_the_learners_policy_at_the_job_start(dep, monkeypatch, head):
    proximal: list[np.ndarray] = []
    compute = SlotTrainer._proximal_log_probs

    def recording(self, queue, slot, job, fields, cache):
        out = compute(self, queue, slot, job, fields, cache)
        proximal.append(out.cpu().numpy())
        return out

    monkeypatch.setattr(SlotTrainer, "_proximal_log_probs", recording)
    encoded = count_backbone_encodes(monkeypatch)
    spec = rl_spec("anchored", staleness=1)
    spec["rl"]["off_policy_correction"] = "decoupled"
    spec["action_module"]["kind"] = head  # a flow head's density is over its recorded chain
    dep.creator.create(spec)
    _, producer, stage, actor = parts(dep, "anchored")
    try:
        jobs = [producer.produce_once(), producer.produce_once()]  # both act with version 0
        behavior = []
        for job in jobs:
            stage.step()
            meta = dep.queue.get_meta(job.partition_id, ["log_prob"], 12, "test-read")
            behavior.append(np.asarray(dep.queue.get_data(meta)["log_prob"], dtype=np.float32))
        assert [actor.step().state for _ in jobs] == [COMPLETED, COMPLETED]
    finally:
        producer.close()
    # The first job is on-policy: the learner's log-probabilities are the ones it acted with (the
    # objective is plain PPO); the second was collected by version 0 and trained at version 1.
    np.testing.assert_allclose(proximal[0], behavior[0], atol=1e-4)
    assert np.abs(proximal[1] - behavior[1]).max() > 1e-3
    assert sum(encoded) == 2 * 12  # the proximal pass shares the epochs' one forward per sample


def test_a_stale_rl_job_is_dropped_and_its_partition_cleared(dep):
    dep.creator.create(rl_spec("stale", staleness=0))
    _, producer, stage, actor = parts(dep, "stale")
    try:
        first, second = producer.produce_once(), producer.produce_once()
        assert first.behavior_policy_version == second.behavior_policy_version == 0
        stage.step(), stage.step()
        assert actor.step().state == COMPLETED  # actor now at v1
        outcome = actor.step()  # 1 - 0 > Δmax = 0
        assert outcome.state == DROPPED and outcome.reason == "policy_stale"
        final = dep.scheduler.get(second.job_id)
        assert final.state == DROPPED and final.terminal_reason == "policy_stale"
        assert not dep.queue.has_partition(second.partition_id)
        assert dep.training_service.policy_version("stale") == 1  # the drop trained nothing
    finally:
        producer.close()


def test_a_crashing_simulator_fails_only_its_own_rollout(dep):
    dep.creator.create(rl_spec("crashy"))
    dep.creator.create(rl_spec("steady"))
    _, crashy, _, _ = parts(dep, "crashy")
    _, steady, _, _ = parts(dep, "steady")
    try:
        crashy.produce_once()  # sessions are open now
        pid = dep.environment_service.sessions("crashy")[0]["pid"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="failed"):
            crashy.produce_once()
        failed = [j for j in dep.scheduler.jobs(tenant_id="crashy") if j.state == FAILED]
        assert len(failed) == 1 and failed[0].terminal_reason.startswith("rollout:")
        assert not dep.queue.has_partition(failed[0].partition_id)
        assert steady.produce_once().state == NEEDS_ADVANTAGES  # the other tenant carries on
        assert crashy.produce_once() is not None  # and the crashed one recovers with fresh sessions
    finally:
        crashy.close()
        steady.close()


def test_an_advantage_failure_fails_the_job_and_clears_it(dep):
    dep.creator.create(rl_spec("broken"))
    _, producer, stage, _ = parts(dep, "broken")
    try:
        job = producer.produce_once()
        handle_of(dep.queue).target._partitions[job.partition_id].fields.pop("reward")  # corrupt the rollout
        failed = stage.step()
        assert failed.state == FAILED and "advantages" in failed.terminal_reason
        assert not dep.queue.has_partition(job.partition_id)
    finally:
        producer.close()


def test_evaluation_resolves_one_version_and_changes_nothing(dep):
    dep.creator.create(rl_spec("judged"))
    tenant, producer, stage, actor = parts(dep, "judged")
    producer.close()
    jobs_before = dep.scheduler.counts()
    result = evaluate_policy(
        tenant.backend_config, dep.environment_service, dep.inference_service, version="latest", episodes=2
    )
    assert result.policy_version == 0 and result.episodes == 2 and len(result.returns) == 2
    assert 0.0 <= result.success_rate <= 1.0 and result.mean_length > 0
    assert dep.scheduler.counts() == jobs_before and dep.queue.partitions() == []
    assert dep.training_service.policy_version("judged") == 0 and dep.inference_service.versions("judged") == [0]
    assert dep.environment_service.sessions("judged") == []
    with pytest.raises(ValueError, match="version"):
        evaluate_policy(tenant.backend_config, dep.environment_service, dep.inference_service, version="newest")


def test_rl_workload_publishes_each_update_and_evaluation_runs_beside_it(dep):
    dep.creator.create(rl_spec("learner", advantage="grpo", jobs=2))
    manager = WorkloadManager(dep).start()
    try:
        workload = manager.submit("learner", jobs=2)
        status = manager.wait(workload.workload_id, timeout_s=300)
        assert status.state == "completed", status.error
        assert status.version == 2 and dep.inference_service.versions("learner")[-1] == 2
        kinds = [e["kind"] for e in manager.events(workload.workload_id)]
        assert kinds.count("rl_update") == 2
        # rollout progress in simulator steps, every update
        steps = [e["rollout/env_steps"] for e in manager.events(workload.workload_id) if e["kind"] == "rl_update"]
        assert len(steps) == 2 and 0 < steps[0] <= steps[1]  # the rollouts' steps so far
        evaluation = manager.wait(manager.evaluate("learner", episodes=2).workload_id, timeout_s=300)
        assert evaluation.state == "completed" and evaluation.result["policy_version"] == 2
        # evaluation progress in episodes: done / total and the running success rate
        episodes = [e for e in manager.events(evaluation.workload_id) if e["kind"] == "episode"]
        assert [e["total"] for e in episodes] == [2] * len(episodes) and episodes[-1]["done"] == 2
        assert all(0.0 <= e["success_rate"] <= 1.0 for e in episodes)
        assert dep.training_service.policy_version("learner") == 2
    finally:
        manager.stop()
    assert np.isfinite(evaluation.result["mean_return"])


def test_an_rl_job_is_completed_only_once_its_update_is_served(dep, monkeypatch):
    # Completing a job frees its tenant's in-flight slot; the rollout that slot starts reads the
    # served version, and must find this job's update there (else it acts a version behind and the
    # staleness bound drops it when it comes to train).
    served_at_completion: list[tuple[int, int]] = []
    complete = dep.scheduler.complete

    def checking_complete(job_id, result=None, **kwargs):
        job = dep.scheduler.get(job_id)
        if job.tenant_id == "publisher":
            served = dep.inference_service.latest_version("publisher")
            served_at_completion.append((served, dep.training_service.policy_version("publisher")))
        return complete(job_id, result, **kwargs)

    monkeypatch.setattr(dep.scheduler, "complete", checking_complete)
    dep.creator.create(rl_spec("publisher", staleness=1, jobs=3))
    manager = WorkloadManager(dep).start()
    try:
        status = manager.wait(manager.submit("publisher", jobs=3).workload_id, timeout_s=300)
    finally:
        manager.stop()
    assert status.state == "completed", status.error
    assert served_at_completion == [(1, 1), (2, 2), (3, 3)]


def test_a_rollout_acts_with_an_update_published_while_its_job_was_being_admitted(dep, monkeypatch):
    # The producer reads the served version, then reserves. A job completing between the two
    # publishes its update and frees the slot the reservation takes: the rollout must act with that
    # update (on-policy), not start a version behind.
    dep.creator.create(rl_spec("racer"))
    _, producer, stage, actor = parts(dep, "racer")
    reserve = dep.scheduler.reserve

    def reserve_as_an_update_lands(**kwargs):
        job = reserve(**kwargs)
        dep.inference_service.load_weights(dep.training_service.export_params("racer"))
        return job

    try:
        producer.produce_once(), stage.step()
        assert actor.step().state == COMPLETED  # the learner is at v1; v0 is still served
        monkeypatch.setattr(dep.scheduler, "reserve", reserve_as_an_update_lands)
        job = producer.produce_once()
        assert job.behavior_policy_version == 1
        assert dep.scheduler.get(job.job_id).behavior_policy_version == 1
        described = dep.queue.describe(job.partition_id)
        assert described["annotations"]["behavior_policy_version"] == 1
        rows = dep.queue.get_data(dep.queue.get_meta(job.partition_id, ("behavior_policy_version",), 12, "check"))
        assert set(np.asarray(rows["behavior_policy_version"]).tolist()) == {1}
    finally:
        producer.close()


# Slow (about 100 s on 2 shared cores: staleness 0 with 3 in flight drops most rollouts before 4
# updates land); the staleness drop itself stays in the default suite (test_flow_rl_loop's).
@pytest.mark.slow
def test_stale_drops_do_not_fail_a_workload_they_are_reported_and_the_producer_rolls_out_again(dep):
    # Three jobs in flight, staleness 0: once one trains, the others' rollouts are a version behind
    # and are dropped (eq. 1); before, the third drop failed the workload ("3 training jobs failed").
    spec = rl_spec("eager", staleness=0, jobs=4)
    spec["scheduling"]["max_in_flight_jobs"] = 3
    dep.creator.create(spec)
    manager = WorkloadManager(dep).start()
    try:
        workload = manager.submit("eager", jobs=4)
        status = manager.wait(workload.workload_id, timeout_s=600)
        events = manager.events(workload.workload_id)
    finally:
        manager.stop()
    assert status.state == "completed", status.error
    assert status.version == 4
    kinds = [e["kind"] for e in events]
    assert "job_failed" not in kinds and kinds.count("rl_update") == 4
    dropped = [e for e in events if e["kind"] == "job_dropped"]
    assert dropped and all(e["reason"] == "policy_stale" for e in dropped)


def test_a_rollout_opens_its_sessions_at_once_and_closes_them_if_one_fails(dep, monkeypatch):
    """A rollout's sessions start concurrently (each is a simulator process starting up); if one
    cannot open, the ones that did are closed and the rollout fails cleanly."""
    dep.creator.create(rl_spec("opener"))
    _, producer, _, _ = parts(dep, "opener")
    env = dep.environment_service
    service = handle_of(env).target  # the in-process EnvironmentService behind the handle
    real_open = service.open_session
    in_flight, most = [0], [0]
    lock = threading.Lock()
    refuse = [False]

    def counting_open(tenant_id, rollout_id, config):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            calls = in_flight[0]
        try:
            if refuse[0] and calls == 1:
                raise ValueError("config: this simulator cannot start now")
            return real_open(tenant_id, rollout_id, config)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(service, "open_session", counting_open)
    try:
        assert producer.produce_once().state == NEEDS_ADVANTAGES
        assert most[0] == 2  # both envs' sessions were starting at the same time
        opened = {s["session_id"] for s in env.sessions("opener")}
        assert opened == set(producer._envs.ids) and len(opened) == 2
        producer.close()
        assert env.sessions("opener") == []

        refuse[0], most[0] = True, 0
        with pytest.raises(ValueError, match="cannot start now"):
            producer.produce_once()
        assert env.sessions("opener") == []  # the session that did open was closed again
        assert [j.state for j in dep.scheduler.jobs(tenant_id="opener")].count(FAILED) == 1
    finally:
        producer.close()
