"""Grouped RL updates (paper 5.2 applied to PPO / GRPO jobs, issue 46.1): ready RL jobs of several
tenants, with SFT jobs beside them, train in one `train_jobs` call — one shared backbone forward per
round over the rows that need one — and each equals the same job trained alone (`train_job`): its
own PPO objective, clip, value head, optimizer, epochs and shuffled order. A tenant's NaN fails its
job only; a stale RL job is dropped by the actor loop while its companions train."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from joynexus.core.store import ControlPlaneStore
from joynexus.core.tenants import BackendCapabilities
from joynexus.master.loops.actor_loop import ActorLoop
from joynexus.master.tenant_creator import TenantCreator
from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.training_jobs import TrainingJob, partition_id_for
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import COMPLETED, DROPPED, FAILED, READY, TrainingScheduler
from joynexus.services.training.job_groups import JobGroupTrainer
from joynexus.services.training.service import TrainingModelService
from joynexus.services.training.slots import Microbatch
from joynexus.services.training.trainer import SlotTrainer
from tests.helpers import TINY_MODEL_ID, assert_trained_state_close, write_dataset_for

SAMPLES = 12
SERIAL = "-serial"  # a copy of each tenant (same seed, same partition) trained one job at a time
TASKS = ("push the block", "", "push the t-shaped block onto the target and then open the top drawer")


def _spec(tenant: str, kind: str, obs: dict, *, task: str = "rl", microbatch: int = 6, **extra) -> dict:
    spec = {
        "tenant": tenant,
        "base_model": TINY_MODEL_ID,
        "task": task,
        "action_module": {"kind": kind} if kind == "smolvla" else {"kind": kind, "size": "tiny"},
        "observation": {**obs, "instruction": "push the block"},
        "scheduling": {"max_in_flight_jobs": 2, "completion_target": 8, "max_policy_staleness": 1},
        "training": {"samples_per_job": SAMPLES, "microbatch_size": microbatch},
    }
    if task == "rl":
        spec["environment"] = {"simulator": "pusht", "task": "PushT-v0", "num_envs": 2, "horizon": 6}
        spec["rl"] = {"advantage": "gae", "ppo_epochs": 2}
    for key, value in extra.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


MLP_OBS = {"cameras": ["front"], "image_size": [32, 32], "state_dim": 4, "action_dim": 3, "action_chunk": 2}
FLOW_OBS = {"cameras": ["top"], "image_size": [24, 40], "state_dim": 6, "action_dim": 5, "action_chunk": 4}
LORA = {"kind": "lora", "rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}

# PPO with a value head (GAE), a flow head under GRPO with the decoupled objective (its proximal
# pass), a LoRA tenant (its rows in the adapter-carrying forward, every epoch), and an SFT job of
# another oft_mlp tenant whose microbatches share the rounds' forwards.
SPECS = {
    "ppo-mlp": _spec("ppo-mlp", "oft_mlp", MLP_OBS, microbatch=4),
    "grpo-flow": _spec(
        "grpo-flow",
        "flow_matching",
        FLOW_OBS,
        rl={"advantage": "grpo", "group_size": 2, "off_policy_correction": "decoupled"},
    ),  # fmt: skip
    "lora-rl": _spec("lora-rl", "oft_mlp", MLP_OBS, adapter=LORA),
    "sft-mlp": _spec("sft-mlp", "oft_mlp", MLP_OBS, task="sft", microbatch=4),
}

# A layer-wise expert (SmolVLA, GRPO over its recorded chain) beside a plain RL head.
LAYERED = {
    "smol-rl": _spec(
        "smol-rl", "smolvla", {**MLP_OBS, "cameras": ["top"], "state_dim": 2, "action_dim": 2, "action_chunk": 3},
        rl={"advantage": "grpo", "group_size": 2},
    ),
    "mlp-rl": _spec("mlp-rl", "oft_mlp", MLP_OBS),
}  # fmt: skip
ALL_SPECS = {**SPECS, **LAYERED}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    path = tmp_path_factory.mktemp("grouped-rl")
    queue = TrainingQueue()
    service = TrainingModelService(BackboneSource(preset="tiny"), path / "ckpt", queue=queue, num_threads=1)
    store = ControlPlaneStore(f"sqlite:///{path / 'control.db'}")
    sft = SPECS["sft-mlp"]  # an SFT tenant names a dataset (its jobs' partitions are written below)
    sft["dataset"] = {"root": str(path / "sft-data"), "repo_id": "test/sft-mlp"}
    write_dataset_for({**sft, "observation": {**sft["observation"], "cameras": tuple(MLP_OBS["cameras"])}})
    scheduler = TrainingScheduler(store, release_partition=queue.clear)
    creator = TenantCreator(store, scheduler, BackendCapabilities.single(service.capabilities()))
    yield {"queue": queue, "service": service, "scheduler": scheduler, "creator": creator, "counter": [0]}
    store.dispose()


def _add(world, spec: dict, tenant_id: str) -> None:
    tenant = world["creator"].create({**spec, "tenant": tenant_id, "base_model": world["service"].backbone.model_id})
    world["service"].add_tenant(tenant.backend_config)


def _rollout(service: TrainingModelService, tenant_id: str, seed: int) -> dict:
    """A partition as a rollout would leave it: observations, the policy's own samples (action, and
    a flow head's chain) with their log-probabilities under the current parameters, nudged as an
    older behavior version's would be, and advantages / returns."""
    slot = service.slot_table.slot(tenant_id)
    cfg = slot.config
    rng = np.random.default_rng(seed)
    obs = ALL_SPECS[tenant_id.removesuffix(SERIAL)]["observation"]
    h, w = obs["image_size"]
    data = {
        "images": rng.random((SAMPLES, len(obs["cameras"]), 3, h, w), dtype=np.float32),
        "state": rng.standard_normal((SAMPLES, obs["state_dim"])).astype(np.float32),
        "action_is_pad": np.zeros((SAMPLES, obs["action_chunk"]), dtype=bool),
        "task": [TASKS[i % 3] for i in range(SAMPLES)],
        "tenant_id": [tenant_id] * SAMPLES,
        "schema_signature": [cfg.schema_signature] * SAMPLES,
    }
    if cfg.rl is None:
        data["action"] = rng.standard_normal((SAMPLES, obs["action_chunk"], obs["action_dim"])).astype(np.float32)
        return data
    module, trainer = slot.module, service.trainer
    images = [[torch.from_numpy(cam) for cam in row] for row in data["images"]]
    instructions = [text or cfg.instruction for text in data["task"]]
    state = torch.from_numpy(data["state"]).to(service.device)
    batch = Microbatch(images, instructions, state, torch.zeros(0), torch.zeros(0))
    noise = torch.from_numpy(rng.standard_normal((SAMPLES, *module.sample_noise_shape())).astype(np.float32))
    with torch.no_grad():
        features = trainer.encode_slot(slot, batch)
        actions, log_prob, record = module.sample_policy(features, state, noise.to(service.device))
    data["action"] = actions.cpu().numpy()
    if module.rl_record_field != "action":
        data[module.rl_record_field] = record.cpu().numpy()
    data["log_prob"] = (log_prob.cpu().numpy() + 0.2 * rng.standard_normal(SAMPLES)).astype(np.float32)
    data["advantage"] = rng.standard_normal(SAMPLES).astype(np.float32)
    data["return"] = rng.standard_normal(SAMPLES).astype(np.float32)
    return data


def _job(world, tenant_id: str, task_type: str, job_id: str) -> TrainingJob:
    """A leased job over a fresh partition of the tenant (built here, so that a tenant and its
    serial copy train jobs of the same id: the PPO shuffle is seeded by the job)."""
    world["counter"][0] += 1
    service = world["service"]
    slot = service.slot_table.slot(tenant_id)
    partition = partition_id_for(f"{job_id}-{world['counter'][0]}", "vla", tenant_id, task_type)
    annotations = {"tenant_id": tenant_id, "schema_signature": slot.config.schema_signature}
    seed = zlib.crc32(job_id.encode())  # a tenant's job and its serial copy's hold the same samples
    world["queue"].put(partition, _rollout(service, tenant_id, seed), annotations=annotations)
    return TrainingJob(
        job_id=job_id, policy_key=f"{tenant_id}:{task_type}", tenant_id=tenant_id, task_type=task_type,
        partition_id=partition, sample_count=SAMPLES, domain="vla",
        metadata={"schema_signature": slot.config.schema_signature}, priority=0, created_seq=0, ready_seq=0,
        behavior_policy_version=service.policy_version(tenant_id) if task_type == "rl" else None,
        max_policy_staleness=1, producer_role="rollout", consumer_role="actor", state="leased", lease_owner="actor",
        terminal_reason=None,
    )  # fmt: skip


def _assert_equal_to_alone(world, names: list[str], grouped: list[dict]) -> None:
    service = world["service"]
    for name, g in zip(names, grouped, strict=True):
        assert "error" not in g, (name, g)
        assert g["group_size"] == len(names)
        s = service.train_job(_job(world, name + SERIAL, ALL_SPECS[name]["task"], g["job_id"]))
        assert set(g) - {"group_size", "group_seconds"} == set(s)
        assert (g["samples"], g["optimizer_steps"], g["version"]) == (s["samples"], s["optimizer_steps"], s["version"])
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(s["losses"]), atol=2e-5, rtol=1e-4)
        if ALL_SPECS[name]["task"] == "rl":
            for key, value in s["rl_stats"].items():
                assert g["rl_stats"][key] == pytest.approx(value, abs=2e-5, rel=1e-4), (name, key)
        lr = service.slot_table.slot(name).config.learning_rate
        state_g, state_s = service.tenant_state(name), service.tenant_state(name + SERIAL)
        assert_trained_state_close(state_s, state_g, lr, g["optimizer_steps"], where=name)


def _count_encodes(monkeypatch) -> list[int]:
    encode, encoded = SlotTrainer.encode, []

    def counting(self, images, instructions, adapters=None, grad=False):
        encoded.append(len(instructions))
        return encode(self, images, instructions, adapters, grad)

    monkeypatch.setattr(SlotTrainer, "encode", counting)
    return encoded


def test_rl_jobs_of_several_tenants_and_an_sft_job_train_grouped_equal_to_each_alone(world, monkeypatch):
    for name, spec in SPECS.items():
        _add(world, spec, name)
        _add(world, spec, name + SERIAL)
    names = list(SPECS)
    jobs = [_job(world, name, SPECS[name]["task"], f"job-{name}") for name in names]
    rounds = []
    train_members = JobGroupTrainer(world["service"].trainer, world["service"].slot_table).grouped.train_members

    def recording(members):
        rounds.append([(m.slot.config.tenant_id, m.features is None) for m in members])
        return train_members(members)

    service = world["service"]
    monkeypatch.setattr(service.job_groups.grouped, "train_members", recording)
    encoded = _count_encodes(monkeypatch)
    grouped = service.train_jobs(jobs)
    # ppo-mlp: 12 samples / 4 x 2 epochs = 6 steps; the others 2 x 2 = 4; sft-mlp 12 / 4 = 3. Its
    # last two steps are rounds of one (trained alone, not a group).
    assert [len(g["losses"]) for g in grouped] == [6, 4, 4, 3]
    assert [len(r) for r in rounds] == [4, 4, 4, 3]
    # One shared forward per round over the rows that need one: a plain head's rows in its first
    # epoch only (the decoupled flow head's proximal pass, its own two forwards of 6 before the
    # rounds, encoded them all), the LoRA tenant's every round (its features change every step).
    assert encoded == [6, 6, 4 + 6 + 4, 4 + 6 + 4, 4 + 6 + 4, 6]
    assert [m for m in rounds[3] if m[0] != "lora-rl"] == [("ppo-mlp", False), ("grpo-flow", False)]
    assert all(("lora-rl", True) in r for r in rounds)
    monkeypatch.undo()
    _assert_equal_to_alone(world, names, grouped)


def test_a_nan_rl_tenant_fails_alone_and_a_stale_one_is_dropped_while_the_others_train(world):
    service, scheduler, queue = world["service"], world["scheduler"], world["queue"]
    versions = {name: service.policy_version(name) for name in SPECS}
    jobs = {}
    for name in SPECS:  # through the scheduler and the actor loop: each job's own staleness check
        behavior = versions[name] - 2 if name == "lora-rl" else versions[name]  # lora-rl's is stale
        task = SPECS[name]["task"]
        signature = service.slot_table.slot(name).config.schema_signature
        job = scheduler.reserve(
            tenant_id=name, task_type=task, sample_count=SAMPLES, metadata={"schema_signature": signature},
            behavior_policy_version=behavior if task == "rl" else None,
        )  # fmt: skip
        annotations = {"tenant_id": name, "schema_signature": signature}
        queue.put(job.partition_id, _rollout(service, name, seed=3), annotations=annotations)
        jobs[name] = scheduler.mark(job.job_id, READY)
    with torch.no_grad():  # ppo-mlp's head now yields a NaN loss (its rollout was taken before)
        for param in service.slot_table.slot("ppo-mlp").module.parameters():
            param.fill_(float("nan"))
    outcomes = {o.job.tenant_id: o for o in ActorLoop(scheduler, service, group_max=8).step_all()}
    assert set(outcomes) == set(SPECS)
    # Its own error (the NaN policy mean, refused by its Normal), as the job alone would fail.
    assert outcomes["ppo-mlp"].state == FAILED and "nan" in outcomes["ppo-mlp"].reason
    assert outcomes["lora-rl"].state == DROPPED and outcomes["lora-rl"].reason == "policy_stale"
    for name in ("grpo-flow", "sft-mlp"):
        assert outcomes[name].state == COMPLETED and outcomes[name].metrics["group_size"] == 3
        assert service.policy_version(name) == versions[name] + 1
    assert service.policy_version("ppo-mlp") == versions["ppo-mlp"]  # no step applied
    assert service.policy_version("lora-rl") == versions["lora-rl"]
    for job in jobs.values():  # every terminal outcome clears its partition
        assert not queue.has_partition(job.partition_id)


def test_a_smolvla_rl_tenant_groups_through_the_shared_prefix_forward_equal_to_alone(world, monkeypatch):
    # SmolVLA (layer-wise expert): its rows share ONE prefix forward with the graph back to its
    # state token; the oft_mlp tenant's rows share the token-feature forward of the same round.
    names = list(LAYERED)
    for name in names:
        _add(world, ALL_SPECS[name], name)
        _add(world, ALL_SPECS[name], name + SERIAL)
    prefixes = []
    layer_prefixes = SlotTrainer.layer_prefixes

    def recording(self, members, *, grad):
        prefixes.append([slot.config.tenant_id for slot, _ in members])
        return layer_prefixes(self, members, grad=grad)

    monkeypatch.setattr(SlotTrainer, "layer_prefixes", recording)
    jobs = [_job(world, name, "rl", f"job-{name}") for name in names]
    prefixes.clear()  # the rollouts' own prefix forwards
    rounds = []
    train_members = world["service"].job_groups.grouped.train_members

    def counting(members):
        rounds.append(len(members))
        return train_members(members)

    monkeypatch.setattr(world["service"].job_groups.grouped, "train_members", counting)
    grouped = world["service"].train_jobs(jobs)
    assert rounds == [2] * 4 and prefixes == [["smol-rl"]] * 4  # 2 microbatches x 2 epochs, grouped
    monkeypatch.undo()
    _assert_equal_to_alone(world, names, grouped)
