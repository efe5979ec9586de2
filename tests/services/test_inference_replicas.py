"""Inference Model Service replicas behind one front (issue 12): scale 1 -> 3 -> 1 under concurrent
load with no failed request, every replica serving the pinned versions, drain on scale-in, weights
given back to a replica restarted in place, and the autoscaler's decisions."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from joynexus.actors import ServiceHandle
from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.autoscaler import Autoscaler, LoadSignals
from joynexus.scheduling.inference_queue import Observation
from joynexus.services.inference.replicas import InferenceReplicaSet, LocalReplicas
from joynexus.services.inference.service import InferenceModelService, UnknownPolicyVersion
from joynexus.services.training.service import TrainingModelService
from joynexus.settings import ScalingPolicy
from tests.helpers import compiled_config, wait_for

SHAPE = dict(cameras=("front",), image_size=(24, 24), state_dim=4, action_dim=3, action_chunk=2)


@pytest.fixture(scope="module")
def payloads(tmp_path_factory):
    """Two real versions of one tenant, exported by a Training Model Service (v0, then v1 after a
    changed parameter), and one of another tenant."""
    torch.set_num_threads(1)
    trainer = TrainingModelService(BackboneSource(preset="tiny"), tmp_path_factory.mktemp("ckpt"))
    out = {}
    for name in ("alpha", "beta"):
        trainer.add_tenant(compiled_config(name, trainer.capabilities(), **SHAPE))
        out[(name, 0)] = trainer.export_params(name)
    return out


def replica_set(policy: ScalingPolicy, **kwargs) -> InferenceReplicaSet:
    factory = LocalReplicas(BackboneSource(preset="tiny"), {"num_threads": 1, "max_wait_ms": 2.0})
    return InferenceReplicaSet(factory, policy=policy, **kwargs)


def observation(rng: np.random.Generator) -> Observation:
    h, w = SHAPE["image_size"]
    return Observation(
        images=(rng.random((3, h, w), dtype=np.float32),),
        state=rng.standard_normal(SHAPE["state_dim"]).astype(np.float32),
        instruction="pick",
    )


class Load:
    """Callers predicting in a loop until stopped; every outcome is recorded."""

    def __init__(self, replicas: InferenceReplicaSet, callers: int = 6):
        self.replicas, self.stop = replicas, threading.Event()
        self.ok: list[dict] = []
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(callers)]

    def _loop(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not self.stop.is_set():
            try:
                self.ok.append(self.replicas.predict("alpha", [observation(rng)], seeds=[seed], timeout_s=60))
            except BaseException as error:  # recorded: the test asserts there are none
                self.errors.append(error)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def test_scale_1_to_3_to_1_under_load_fails_no_request_and_every_replica_serves_the_version(payloads):
    replicas = replica_set(ScalingPolicy(min_replicas=1, max_replicas=3))
    try:
        assert replicas.load_weights(payloads[("alpha", 0)])["version"] == 0
        with Load(replicas) as load:
            wait_for(lambda: len(load.ok) >= 10, "requests served by one replica")
            assert replicas.scale_to(3)["replicas"] == 3
            served_before = len(load.ok)
            wait_for(lambda: len(load.ok) >= served_before + 30, "requests served by three replicas")
            # Every replica took traffic, and each holds the tenant's published version.
            described = replicas.replicas()
            assert [r["state"] for r in described] == ["active"] * 3
            wait_for(lambda: all(r["served"] > 0 for r in replicas.replicas()), "traffic on every replica")
            for replica in replicas._active():
                assert replica.handle.versions("alpha") == [0]
            assert replicas.scale_to(1)["replicas"] == 1  # drains two of them under load
            served_after = len(load.ok)
            wait_for(lambda: len(load.ok) >= served_after + 10, "requests served after the scale-in")
        assert load.errors == []
        assert {r["policy_version"] for r in load.ok} == {0}
        assert len(replicas.replicas()) == 1
        stats = replicas.stats()
        assert stats["replica_set"]["failed_requests"] == 0 and stats["replica_set"]["scale_events"] == 2
        assert stats["queue_depth"] == 0
        # Same seed, same observation: the same action whichever replica served it (same backbone).
        rng = np.random.default_rng(7)
        obs = [observation(rng)]
        first = replicas.predict("alpha", obs, seeds=[1])["actions"]
        replicas.scale_to(2)
        answers = [replicas.predict("alpha", obs, seeds=[1])["actions"] for _ in range(4)]
        for actions in answers:
            np.testing.assert_allclose(actions, first, atol=1e-6)
    finally:
        replicas.close()


def test_a_new_replica_gets_every_published_version_before_it_takes_traffic(payloads):
    replicas = replica_set(ScalingPolicy(min_replicas=1, max_replicas=2), max_versions_per_tenant=3)
    try:
        replicas.load_weights(payloads[("alpha", 0)])
        replicas.load_weights(payloads[("beta", 0)])
        replicas.scale_to(2)
        newest = replicas._active()[-1]
        assert newest.handle.tenants() == ["alpha", "beta"]
        assert replicas.versions("alpha") == [0] and replicas.latest_version("beta") == 0
        assert replicas.tenants() == ["alpha", "beta"]
        # A request without a version is pinned here to the published latest.
        rng = np.random.default_rng(0)
        assert replicas.predict("beta", [observation(rng)])["policy_version"] == 0
        assert replicas.remove_tenant("beta") == 1
        assert replicas.versions("beta") == [] and replicas.tenants() == ["alpha"]
        with pytest.raises(UnknownPolicyVersion):
            replicas.predict("beta", [observation(rng)])
        assert replicas.stats()["replica_set"]["failed_requests"] == 1  # the caller's error, not a replica's
    finally:
        replicas.close()


def test_a_replica_restarted_in_place_gets_its_weights_back_before_traffic(payloads):
    replicas = replica_set(ScalingPolicy(min_replicas=2, max_replicas=2, interval_s=60))
    try:
        replicas.load_weights(payloads[("alpha", 0)])
        victim = replicas._active()[0]
        # What Ray does on a restart in place: the same handle, a fresh service (new incarnation, no weights).
        old = victim.handle.target
        victim.handle = ServiceHandle(InferenceModelService(BackboneSource(preset="tiny"), num_threads=1))
        old.close()
        assert victim.handle.versions("alpha") == []
        assert replicas.check_replicas() == [victim.name]
        assert victim.handle.versions("alpha") == [0] and victim.restarts == 1 and victim.state == "active"
        assert replicas.check_replicas() == []  # same incarnation now: nothing to do
    finally:
        replicas.close()


def test_requests_of_a_replica_stopped_under_them_go_to_another_replica(payloads):
    replicas = replica_set(ScalingPolicy(min_replicas=2, max_replicas=2, interval_s=60))
    try:
        replicas.load_weights(payloads[("alpha", 0)])
        victim = replicas._active()[0]
        victim.handle.target._stop.set()  # its worker stops: requests queue there, unserved
        victim.handle.target._worker.join(timeout=5)
        rng = np.random.default_rng(1)
        futures = [replicas.submit("alpha", [observation(rng)]) for _ in range(6)]
        time.sleep(0.1)
        victim.handle.target.queue.close()  # a closed queue fails its pending requests
        results = [f.result(timeout=30) for f in futures]
        assert all(r["policy_version"] == 0 for r in results)
        assert replicas.stats()["replica_set"]["rerouted_requests"] >= 1
    finally:
        replicas.close()


def test_bad_scale_requests_and_payloads_are_refused_with_the_field(payloads):
    replicas = replica_set(ScalingPolicy(min_replicas=1, max_replicas=2))
    try:
        with pytest.raises(ValueError, match=r"replicas: 3 is outside \[min_replicas=1, max_replicas=2\]"):
            replicas.scale_to(3)
        with pytest.raises(Exception, match="payload|safetensors|header|manifest"):
            replicas.load_weights(b"not a payload")
        assert replicas.tenants() == []
    finally:
        replicas.close()
    with pytest.raises(ValueError, match="min_replicas"):
        ScalingPolicy(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="scale_in_queue_per_replica"):
        ScalingPolicy(scale_in_queue_per_replica=8, scale_out_queue_per_replica=8)


def test_autoscaler_decisions_bounds_cooldown_and_latency():
    policy = ScalingPolicy(
        min_replicas=1, max_replicas=4, scale_out_queue_per_replica=4, scale_in_queue_per_replica=1,
        max_p99_latency_s=0.5, cooldown_s=10,
    )  # fmt: skip
    scaler = Autoscaler(policy)
    assert scaler.decide(LoadSignals(replicas=0, in_flight=0), now=0).desired == 1  # below min: at once
    assert scaler.decide(LoadSignals(replicas=1, in_flight=40), now=1).reason == "cooldown"
    out = scaler.decide(LoadSignals(replicas=1, in_flight=40), now=20)
    assert out.desired == 4  # enough for the queue at the threshold, capped at max
    assert scaler.decide(LoadSignals(replicas=2, in_flight=2, p99_latency_s=0.9), now=40).desired == 3  # slow
    assert scaler.decide(LoadSignals(replicas=3, in_flight=1, p99_latency_s=0.4), now=60).desired == 3  # not fast
    assert scaler.decide(LoadSignals(replicas=3, in_flight=1, p99_latency_s=0.1), now=60).desired == 2
    assert scaler.decide(LoadSignals(replicas=1, in_flight=0), now=100).desired == 1  # never below min
    assert scaler.decide(LoadSignals(replicas=6, in_flight=0), now=100).desired == 4  # above max: at once


def test_the_autoscaler_scales_out_under_load_and_back_in_when_idle(payloads):
    policy = ScalingPolicy(
        min_replicas=1, max_replicas=3, scale_out_queue_per_replica=2, scale_in_queue_per_replica=0.5,
        cooldown_s=0.3, interval_s=0.1, drain_timeout_s=30,
    )  # fmt: skip
    replicas = replica_set(policy)
    try:
        replicas.load_weights(payloads[("alpha", 0)])
        with Load(replicas, callers=12) as load:
            wait_for(lambda: len(replicas._active()) >= 2, "a scale-out under load", timeout_s=30)
        wait_for(lambda: len(replicas._active()) == 1, "the scale-in once idle", timeout_s=30)
        assert load.errors == [] and load.ok
        assert replicas.stats()["replica_set"]["scale_events"] >= 2
    finally:
        replicas.close()


def test_a_replica_that_lost_its_weights_hands_requests_on_until_it_is_restored(payloads):
    """Ray queues calls to a restarting replica: one can reach the fresh process before the
    monitor sees the new incarnation. The set reroutes it and takes the replica out until restored."""
    replicas = replica_set(ScalingPolicy(min_replicas=2, max_replicas=2, interval_s=60))
    try:
        replicas.load_weights(payloads[("alpha", 0)])
        victim, other = replicas._active()
        old = victim.handle.target
        victim.handle = ServiceHandle(InferenceModelService(BackboneSource(preset="tiny"), num_threads=1))
        old.close()
        victim.in_flight = -10  # route the next requests to the victim first (fewest in flight)
        rng = np.random.default_rng(2)
        results = [replicas.predict("alpha", [observation(rng)], policy_version=0) for _ in range(3)]
        assert [r["policy_version"] for r in results] == [0, 0, 0]
        victim.in_flight += 10  # back to its true count (none in flight)
        assert victim.in_flight == 0 and victim.state == "unreachable" and other.state == "active"
        counts = replicas.stats()["replica_set"]
        assert counts["failed_requests"] == 0 and counts["rerouted_requests"] == 1
        assert replicas.check_replicas() == [victim.name]  # new incarnation: weights loaded, active again
        assert victim.state == "active" and victim.handle.versions("alpha") == [0]
        # A version never published is still the caller's error, not a lost replica.
        with pytest.raises(UnknownPolicyVersion):
            replicas.predict("alpha", [observation(rng)], policy_version=5)
        assert victim.state == other.state == "active"
    finally:
        replicas.close()


def test_the_autoscaler_can_be_paused_and_resumed_only_for_an_elastic_policy(payloads):
    fixed = replica_set(ScalingPolicy(min_replicas=1, max_replicas=1))
    try:
        assert fixed.set_autoscale(False) is False
        with pytest.raises(ValueError, match="enabled: the policy is a fixed size"):
            fixed.set_autoscale(True)
        with pytest.raises(ValueError, match="enabled: expected true or false"):
            fixed.set_autoscale("yes")
    finally:
        fixed.close()
    elastic = replica_set(ScalingPolicy(min_replicas=1, max_replicas=2))
    try:
        assert elastic.set_autoscale(False) is False and elastic.stats()["replica_set"]["autoscale"] is False
        assert elastic.set_autoscale(True) is True
    finally:
        elastic.close()


def test_an_unknown_version_error_survives_pickling_as_itself():
    """Ray pickles a service's exception to its caller: the set (lost weights) and the API (404)
    recognize it only as UnknownPolicyVersion with its fields, not as Ray's UnserializableException."""
    import pickle

    error = pickle.loads(pickle.dumps(UnknownPolicyVersion("alpha", 3, [1, 2])))
    assert isinstance(error, UnknownPolicyVersion)
    assert (error.tenant_id, error.version, error.available) == ("alpha", 3, [1, 2])
    assert str(error) == str(UnknownPolicyVersion("alpha", 3, [1, 2]))
    assert "tenant 'alpha' has no version 3 (loaded: [1, 2])" in str(error)


def test_stats_report_the_batching_bounds_of_the_service_and_of_the_replica_set():
    # What benchmarks read through the public interface (not the service object's attributes).
    factory = LocalReplicas(BackboneSource(preset="tiny"), {"num_threads": 1, "max_wait_ms": 3.0, "max_batch_size": 5})
    replicas = InferenceReplicaSet(factory, policy=ScalingPolicy(min_replicas=1, max_replicas=2))
    try:
        stats = replicas.stats()
        assert (stats["max_batch_size"], stats["max_wait_s"]) == (5, pytest.approx(0.003))
        one = replicas._active()[0].handle.stats()
        assert (one["max_batch_size"], one["max_wait_s"]) == (5, pytest.approx(0.003))
    finally:
        replicas.close()
