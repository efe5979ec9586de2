"""Tenant-affine inference on Ray (issue 45.3): the replica set is the named actor
`joynexus.inference_service` with three replica actors, each holding at most two of four tenants;
callers hold a `TenantRouter` (what `connect` and the producers get), whose requests go straight to
the replica actors. One replica is killed for good mid-run: every request still answers (the router
reads the table again and the tenant is placed on a live replica), and the killed replica leaves
the table."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
import torch

from joynexus.actors import init_ray
from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.inference_queue import Observation
from joynexus.services.configs import InferenceServiceConfig
from joynexus.services.inference.router import TenantRouter, inference_endpoint
from joynexus.services.training.service import TrainingModelService
from joynexus.settings import RoleResources, ScalingPolicy
from tests.helpers import compiled_config, wait_for

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a Ray start and three replica backbones in their own processes

SHAPE = dict(cameras=("front",), image_size=(24, 24), state_dim=4, action_dim=3, action_chunk=2)
TENANTS = ("ra", "rb", "rc", "rd")


def observation(seed: int) -> Observation:
    rng = np.random.default_rng(seed)
    return Observation(
        images=(rng.random((3, 24, 24), dtype=np.float32),),
        state=rng.standard_normal(4).astype(np.float32),
        instruction="pick",
    )


def test_three_ray_replicas_one_killed_mid_run_every_request_answers(tmp_path):
    torch.set_num_threads(1)
    trainer = TrainingModelService(BackboneSource(preset="tiny"), tmp_path / "ckpt")
    payloads = {}
    for name in TENANTS:
        trainer.add_tenant(compiled_config(name, trainer.capabilities(), **SHAPE))
        payloads[name] = trainer.export_params(name)

    started_ray = not ray.is_initialized()
    init_ray(num_cpus=2)
    namespace = f"affinity-{uuid.uuid4().hex[:8]}"
    config = InferenceServiceConfig(
        backbone=BackboneSource(preset="tiny"),
        scaling=ScalingPolicy(min_replicas=3, max_replicas=3, max_tenants_per_replica=2, interval_s=0.2),
        replica_resources=RoleResources(num_cpus=0.25),  # three replicas fit a 2-CPU Ray
    )
    front = config.actor(namespace=namespace)
    try:
        router = inference_endpoint(front, replicated=True, namespace=namespace)
        assert isinstance(router, TenantRouter)
        for payload in payloads.values():
            assert router.load_weights(payload)["version"] == 0
        table = router.assignment()
        assert len(table["replicas"]) == 3
        ok: list[str] = []
        errors: list[str] = []
        stop = threading.Event()

        def caller(index: int) -> None:
            tenant = TENANTS[index % len(TENANTS)]
            while not stop.is_set():
                try:
                    router.predict(tenant, [observation(index)], seeds=[index], timeout_s=120)
                    ok.append(tenant)
                except Exception as error:  # recorded: the test asserts there are none
                    errors.append(f"{type(error).__name__}: {error}")

        threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(8)]
        for thread in threads:
            thread.start()
        try:
            wait_for(lambda: len(ok) >= 40, "requests served by three replicas", timeout_s=180)
            table = router.assignment()
            victim = next(name for name in table["replicas"] if any(name in h for h in table["tenants"].values()))
            ray.kill(ray.get_actor(victim, namespace=namespace), no_restart=True)
            served = len(ok)
            wait_for(lambda: len(ok) >= served + 80, "requests served after the kill", timeout_s=180)
            wait_for(lambda: victim not in router.assignment()["replicas"], "the killed replica out of the table")
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=120)
        assert errors == []
        assert set(ok) == set(TENANTS)
        after = router.assignment()
        assert all(victim not in holders for holders in after["tenants"].values())
        for name in after["replicas"]:  # each live replica holds at most two tenants
            assert len(ray.get(ray.get_actor(name, namespace=namespace).tenants.remote(), timeout=60)) <= 2
        assert router.counts["rerouted_requests"] >= 1
        print("router after the kill:", router.counts, f"{len(ok)} requests answered")
    finally:
        ray.kill(front)
        if started_ray:
            ray.shutdown()
