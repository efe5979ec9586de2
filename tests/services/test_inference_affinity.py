"""Inference by tenant affinity (issue 45.3): each replica holds at most `max_tenants_per_replica`
tenants (LRU, paged in again from the set's kept payloads), a tenant's requests go only to its
holders, a hot tenant gets a second replica, the caller's router sends requests straight to the
replicas, and the actions equal a single service's."""

from __future__ import annotations

from concurrent.futures import wait

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from joynexus.core.serving_sets import ServingSetStore
from joynexus.core.store import ControlPlaneStore
from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.inference_queue import Observation
from joynexus.services.inference.affinity import TenantAffinity
from joynexus.services.inference.replicas import InferenceReplicaSet, LocalReplicas
from joynexus.services.inference.router import TenantRouter
from joynexus.services.inference.service import InferenceModelService, UnknownPolicyVersion
from joynexus.services.training.service import TrainingModelService
from joynexus.settings import ScalingPolicy
from tests.helpers import compiled_config, wait_for

SHAPE = dict(cameras=("front",), image_size=(24, 24), state_dim=4, action_dim=3, action_chunk=2)
TENANTS = ("t0", "t1", "t2", "t3")
SERVICE = {"num_threads": 1, "max_wait_ms": 2.0}


@pytest.fixture(scope="module")
def payloads(tmp_path_factory):
    """One exported version of each tenant, every tenant's module its own initialisation."""
    torch.set_num_threads(1)
    trainer = TrainingModelService(BackboneSource(preset="tiny"), tmp_path_factory.mktemp("ckpt"))
    out = {}
    for name in TENANTS:
        torch.manual_seed(len(out) + 1)
        trainer.add_tenant(compiled_config(name, trainer.capabilities(), **SHAPE))
        out[name] = trainer.export_params(name)
    return out


def affine_set(payloads, replicas: int, per_replica: int, database_url: str | None = None, **policy):
    policy = ScalingPolicy(min_replicas=replicas, max_replicas=replicas, max_tenants_per_replica=per_replica, **policy)
    service = {**SERVICE, "database_url": database_url}  # with a store, each replica records serving sets
    front = InferenceReplicaSet(LocalReplicas(BackboneSource(preset="tiny"), service), policy=policy)
    for payload in payloads.values():
        front.load_weights(payload)
    return front


def router_of(front: InferenceReplicaSet) -> TenantRouter:
    return TenantRouter(front, resolve=front.replica_target)


def observations(seed: int, n: int = 2) -> list[Observation]:
    rng = np.random.default_rng(seed)
    h, w = SHAPE["image_size"]
    return [
        Observation(
            images=(rng.random((3, h, w), dtype=np.float32),),
            state=rng.standard_normal(SHAPE["state_dim"]).astype(np.float32),
            instruction="pick",
        )
        for _ in range(n)
    ]


def held_by_replica(front: InferenceReplicaSet) -> dict[str, list[str]]:
    """What each replica service itself holds (not what the table says)."""
    return {r.name: r.handle.tenants() for r in front._active()}


def test_a_tenants_requests_go_only_to_the_replicas_that_hold_it(payloads):
    front = affine_set(payloads, replicas=3, per_replica=2)
    router = router_of(front)
    try:
        for round_ in range(3):
            for tenant in TENANTS:
                router.predict(tenant, observations(round_), seeds=[0, 1])
        table = front.assignment()["tenants"]
        held = held_by_replica(front)
        for tenant, sent in router.sent.items():
            assert set(sent) <= set(table[tenant]), (tenant, sent, table)
            for replica in sent:  # the replica itself holds it: no request needed a page-in elsewhere
                assert tenant in held[replica]
        assert all(len(tenants) <= 2 for tenants in held.values()), held
        assert router.counts["failed_requests"] == 0
        for endpoint in (router, front):  # a tenant never published: the caller's error, as one service says
            with pytest.raises(UnknownPolicyVersion):
                endpoint.predict("nobody", observations(0), seeds=[0, 1])
        # The front's own path (in process) routes by the same table.
        before = {r.name: r.served for r in front._active()}
        front.predict("t0", observations(9), seeds=[0, 1])
        after = {r.name: r.served for r in front._active()}
        assert {n for n in after if after[n] > before[n]} <= set(front.assignment()["tenants"]["t0"])
    finally:
        front.close()


def test_a_replica_never_holds_more_than_its_bound_and_an_evicted_tenant_answers_the_same(payloads, tmp_path):
    front = affine_set(payloads, replicas=2, per_replica=1, database_url=f"sqlite:///{tmp_path / 'store.db'}")
    router = router_of(front)
    try:
        obs = observations(3)
        first = {t: router.predict(t, obs, seeds=[5, 6])["actions"] for t in TENANTS}
        for _ in range(2):  # every round pages each tenant in again (4 tenants, 2 slots)
            for tenant in TENANTS:
                actions = router.predict(tenant, obs, seeds=[5, 6])["actions"]
                np.testing.assert_allclose(actions, first[tenant], atol=1e-6)
                held = held_by_replica(front)
                assert all(len(tenants) <= 1 for tenants in held.values()), held
        assert router.counts["placements"] >= len(TENANTS)  # tenants were evicted and paged in again
        # An eviction is not a deletion: the deployment's recorded serving sets keep every tenant.
        recorded = ServingSetStore(ControlPlaneStore(f"sqlite:///{tmp_path / 'store.db'}")).all()
        assert {t: list(s.versions) for t, s in recorded.items()} == {t: [0] for t in TENANTS}
        assert len({t: a.tobytes() for t, a in first.items()}) == len(TENANTS)  # distinct tenants
    finally:
        front.close()


def test_a_hot_tenant_spreads_to_a_second_replica(payloads):
    front = affine_set(payloads, replicas=2, per_replica=2, hot_tenant_in_flight=2)
    router = router_of(front)
    try:
        assert len(front.assignment()["tenants"]["t0"]) == 1

        def burst() -> bool:
            futures = [router.submit("t0", observations(i, 1), seeds=[i]) for i in range(12)]
            wait(futures, timeout=60)
            assert all(f.exception() is None for f in futures)
            return len(router.sent["t0"]) == 2

        wait_for(burst, "t0 served by two replicas", timeout_s=30)
        assert len(front.assignment()["tenants"]["t0"]) == 2
        # A cold tenant stays on one replica.
        router.predict("t1", observations(1), seeds=[0, 1])
        assert len(router.sent["t1"]) == 1
    finally:
        front.close()


def test_predictions_equal_the_single_service_ones(payloads):
    single = InferenceModelService(BackboneSource(preset="tiny"), **SERVICE)
    front = affine_set(payloads, replicas=2, per_replica=2)
    router = router_of(front)
    try:
        for payload in payloads.values():
            single.load_weights(payload)
        for seed, tenant in enumerate(TENANTS * 2):
            obs = observations(seed, 3)
            expected = single.predict(tenant, obs, seeds=[1, 2, 3])
            for endpoint in (router, front):
                answer = endpoint.predict(tenant, obs, seeds=[1, 2, 3])
                np.testing.assert_allclose(answer["actions"], expected["actions"], atol=1e-6)
                assert answer["policy_version"] == expected["policy_version"]
        assert sorted(front.versions("t2")) == single.versions("t2")
    finally:
        single.close()
        front.close()


def test_a_replica_stopped_under_the_router_loses_no_request(payloads):
    front = affine_set(payloads, replicas=3, per_replica=2)
    router = router_of(front)
    try:
        for tenant in TENANTS:
            router.predict(tenant, observations(0), seeds=[0, 1])
        victim = front._active()[0]
        lost = front.affinity.tenants_of(victim.name)
        victim.handle.close()  # its queue refuses from now on; the router's table still names it
        futures = [router.submit(t, observations(i), seeds=[0, 1]) for i, t in enumerate(TENANTS * 3)]
        wait(futures, timeout=60)
        assert [f.exception() for f in futures] == [None] * len(futures)
        assert lost and router.counts["rerouted_requests"] >= 1  # its tenants' requests went elsewhere
    finally:
        front.close()


def test_affinity_bookkeeping_and_bad_settings():
    affinity = TenantAffinity(2)
    for name in ("r0", "r1"):
        affinity.add_replica(name)
    assert affinity.place("a").holders == ["r0"]
    assert affinity.place("b").holders == ["r1"]  # the emptier replica first
    affinity.place("c")
    affinity.place("d")  # both full now
    affinity.touch("a")
    affinity.touch("b")
    placed = affinity.place("e")  # c is the least recently used of all (a and b were touched)
    assert placed.evictions == [("r0", "c")] and placed.loads == ["r0"]
    assert affinity.holders("c") == []
    assert affinity.remove_replica("r1") == ["d", "b"]  # least recently used first
    with pytest.raises(ValueError, match="max_tenants_per_replica"):
        TenantAffinity(0)
    with pytest.raises(ValidationError, match="max_tenants_per_replica"):
        ScalingPolicy(max_tenants_per_replica=0)
    with pytest.raises(ValidationError, match="max_tenants_per_replica .* needs max_replicas >= 2"):
        ScalingPolicy(max_tenants_per_replica=4)  # one replica: the plain service, which holds every tenant
    with pytest.raises(ValidationError, match="hot_tenant_in_flight"):
        ScalingPolicy(hot_tenant_in_flight=0)
