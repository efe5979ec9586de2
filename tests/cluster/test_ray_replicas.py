"""Inference Model Service replicas on the real deployment (issue 12, part 3): the named actor
`joynexus.inference_service` is a replica set of Ray replica actors (`create_service_actors` with
`inference_scaling.max_replicas > 1`). Under concurrent predict load, through the Ray handle and the
API's Ray path (`connect(mode="ray")` + `/v1/predict`), it scales 1 -> 3 -> 1 by `scale_to` and again by
the autoscaler reacting to the load, with zero failed requests; every Ray replica answers the
pinned versions; a replica killed with `ray.kill(..., no_restart=False)` is restarted by Ray and gets
its weights back from the set before it serves again; `/v1/health` reports the replicas.

Everything lives in a namespace of its own; the module kills its actors at the end (and stops Ray
if it started it)."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from joynexus.ops.health_report import replica_summary
from tests.api.conftest import ADMIN_KEY, sample_batch, wire
from tests.helpers import sft_spec, wait_for, write_dataset_for

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a Ray deployment with up to three replica backbones (see the report)

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
POLICY = {
    "min_replicas": 1,
    "max_replicas": 3,
    "scale_out_queue_per_replica": 2.0,
    "scale_in_queue_per_replica": 0.5,
    "cooldown_s": 1.0,
    "interval_s": 0.2,
    "drain_timeout_s": 60.0,
}


@dataclass
class RayReplicaWorld:
    namespace: str
    cluster: Any  # joynexus.connect.Cluster over the Ray deployment
    client: Any  # TestClient of the API server
    specs: dict[str, dict[str, Any]]
    keys: dict[str, str]

    @property
    def front(self) -> Any:
        """The replica set: the named actor `joynexus.inference_service`."""
        return ray.get_actor("joynexus.inference_service", namespace=self.namespace)

    def call(self, method: str, *args: Any, timeout_s: float = 120.0) -> Any:
        return ray.get(getattr(self.front, method).remote(*args), timeout=timeout_s)

    def replica(self, name: str) -> Any:
        return ray.get_actor(name, namespace=self.namespace)

    def active(self) -> list[dict[str, Any]]:
        return [r for r in self.call("replicas") if r["state"] == "active"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> RayReplicaWorld:
    from fastapi.testclient import TestClient

    from joynexus.api.app import ApiSettings, create_app
    from joynexus.connect import connect
    from joynexus.ops.supervisor import remove_service_actors
    from joynexus.settings import ScalingPolicy, Settings

    started_ray = not ray.is_initialized()
    namespace = f"test-ray-replicas-{uuid.uuid4().hex[:8]}"
    data_dir = tmp_path_factory.mktemp("ray-replicas")
    settings = Settings(
        data_dir=data_dir,
        ray_namespace=namespace,
        torch_threads=1,
        inference_scaling=ScalingPolicy(**POLICY),
        # A quarter CPU each: three replicas and the Training Model Service fit a 2-CPU Ray.
        resources={"inference_service": {"num_cpus": 0.25}},
    )
    cluster = None
    try:
        cluster = connect(settings, mode="ray")  # starts a local Ray here if none runs
        app = create_app(cluster, ApiSettings(), admin_key=ADMIN_KEY)
        with TestClient(app, raise_server_exceptions=False) as client:
            specs, keys = {}, {}
            for name in ("alpha", "beta"):
                spec = sft_spec(f"rr-{name}", data_dir / "datasets" / name, jobs=1, samples_per_job=8)
                write_dataset_for(spec, episodes=1, length=8)
                response = client.post("/v1/admin/tenants", json=spec, headers=ADMIN)
                assert response.status_code == 201, response.text
                specs[name], keys[name] = spec, response.json()["key"]["api_key"]
            yield RayReplicaWorld(namespace, cluster, client, specs, keys)
    finally:
        if cluster is not None:
            cluster.close()
        if ray.is_initialized():
            remove_service_actors(namespace)  # the set's replica actors go with it (it owns them)
            if started_ray:
                ray.shutdown()


def observations(spec: dict[str, Any], n: int, seed: int) -> list[Any]:
    from joynexus.scheduling.inference_queue import Observation

    batch = sample_batch(spec, n, seed)
    return [
        Observation(images=tuple(batch["images"][i]), state=batch["state"][i], instruction="pick") for i in range(n)
    ]


@dataclass
class Load:
    """Callers predicting in a loop until stopped: Ray-handle callers pinned to a version of
    alpha, and one API caller for beta through `/v1/predict`; every outcome is recorded."""

    world: RayReplicaWorld
    pins: dict[int, int]  # caller index -> pinned version of alpha
    api_caller: bool = True
    stop: threading.Event = field(default_factory=threading.Event)
    ok: list[tuple[int, int]] = field(default_factory=list)  # (pinned or -1 for the API, served version)
    errors: list[str] = field(default_factory=list)
    sent: int = 0
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _count_sent(self) -> None:
        with self.lock:
            self.sent += 1

    def _ray_caller(self, index: int) -> None:
        inference = self.world.cluster.inference  # the ServiceHandle the API uses too
        obs, version = observations(self.world.specs["alpha"], 1, index), self.pins[index]
        while not self.stop.is_set():
            self._count_sent()
            try:
                result = inference.predict("rr-alpha", obs, policy_version=version, seeds=[index], timeout_s=60)
                self.ok.append((version, result["policy_version"]))
            except Exception as error:  # recorded: the test asserts there are none
                self.errors.append(f"{type(error).__name__}: {error}")

    def _api_caller(self) -> None:
        batch = sample_batch(self.world.specs["beta"], 2, seed=11)
        body = {"observations": wire({"images": batch["images"], "state": batch["state"]})}
        headers = {"Authorization": f"Bearer {self.world.keys['beta']}"}
        while not self.stop.is_set():
            self._count_sent()
            response = self.world.client.post("/v1/predict", json=body, headers=headers)
            if response.status_code == 200:
                self.ok.append((-1, response.json()["policy_version"]))
            else:
                self.errors.append(f"HTTP {response.status_code}: {response.text[:300]}")

    def __enter__(self) -> Load:
        self.threads = [threading.Thread(target=self._ray_caller, args=(i,), daemon=True) for i in self.pins]
        if self.api_caller:
            self.threads.append(threading.Thread(target=self._api_caller, daemon=True))
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=90)
        assert not any(t.is_alive() for t in self.threads), "a caller is still waiting for its request"

    def served_more(self, count: int) -> bool:
        return len(self.ok) >= count


def test_ray_replicas_scale_1_3_1_under_load_restart_with_weights_and_autoscale(world: RayReplicaWorld):
    master = world.cluster.master
    started = time.monotonic()
    # Weights: alpha v0, then one train step (v1) published too; beta v0. Published to every replica.
    assert master.publish_weights("rr-alpha") == 0 and master.publish_weights("rr-beta") == 0
    alpha = {"Authorization": f"Bearer {world.keys['alpha']}"}
    stepped = world.client.post("/v1/train_batch", json=wire(sample_batch(world.specs["alpha"], 4, 1)), headers=alpha)
    assert stepped.status_code == 200 and stepped.json()["version"] == 1, stepped.text
    assert master.publish_weights("rr-alpha") == 1
    assert world.call("versions", "rr-alpha") == [0, 1] and len(world.active()) == 1

    # An unknown version through the Ray path is the tenant's 404, not a server error.
    missing = world.client.post(
        "/v1/predict",
        json={"observations": wire({"images": sample_batch(world.specs["alpha"], 1, 0)["images"],
                                    "state": sample_batch(world.specs["alpha"], 1, 0)["state"]}),
              "policy_version": 7},
        headers=alpha,
    )  # fmt: skip
    assert missing.status_code == 404, missing.text

    # -- 1 -> 3 -> 1 by scale_to, a replica killed and restarted in place, all under load ------------
    assert world.call("set_autoscale", False) is False  # the operator holds the size
    with Load(world, pins={0: 0, 1: 1, 2: 0, 3: 1}) as load:
        wait_for(lambda: load.served_more(10), "requests served by one replica", timeout_s=120)
        assert world.call("scale_to", 3, timeout_s=300)["replicas"] == 3
        wait_for(lambda: all(r["served"] > 0 for r in world.active()), "traffic on every replica", timeout_s=120)
        names = [r["name"] for r in world.active()]
        assert len(names) == 3
        for name in names:  # each Ray replica holds every published version and answered requests
            replica = world.replica(name)
            assert ray.get(replica.versions.remote("rr-alpha"), timeout=60) == [0, 1]
            assert ray.get(replica.versions.remote("rr-beta"), timeout=60) == [0]
            assert ray.get(replica.stats.remote(), timeout=60)["requests"] > 0

        # Ray restarts a killed replica in place (same actor, new process, no weights); the set
        # sees the new incarnation and loads every kept version before it takes traffic again.
        victim = world.active()[1]
        ray.kill(world.replica(victim["name"]), no_restart=False)

        def restored() -> dict[str, Any] | None:
            entry = next(r for r in world.call("replicas") if r["name"] == victim["name"])
            return entry if entry["restarts"] == 1 and entry["state"] == "active" else None

        back = wait_for(restored, "the killed replica restarted and restored", timeout_s=180)
        assert back["incarnation"] != victim["incarnation"] and back["pid"] != victim["pid"]
        assert ray.get(world.replica(victim["name"]).versions.remote("rr-alpha"), timeout=60) == [0, 1]
        assert ray.get(world.replica(victim["name"]).versions.remote("rr-beta"), timeout=60) == [0]
        served = back["served"]
        wait_for(
            lambda: next(r for r in world.call("replicas") if r["name"] == victim["name"])["served"] > served + 3,
            "the restored replica serving again",
            timeout_s=120,
        )

        def inference_health() -> dict[str, Any] | None:
            entry = world.client.get("/v1/health").json()["roles"]["inference_service"]
            return entry if "1 replica restarts" in entry["detail"] else None

        health = wait_for(inference_health, "the Health Manager's report of the replicas", timeout_s=30)
        assert health["healthy"] and "replicas: 3 active" in health["detail"], health

        before_in = len(load.ok)
        assert world.call("scale_to", 1, timeout_s=300)["replicas"] == 1  # drains two under load
        wait_for(lambda: load.served_more(before_in + 10), "requests served after the scale-in", timeout_s=120)
    assert load.errors == [], load.errors[:5]
    assert len(load.ok) == load.sent  # every request sent was answered: none lost in a drain or the kill
    assert all(pinned == got for pinned, got in load.ok if pinned >= 0)  # each served by its pinned version
    assert {got for pinned, got in load.ok if pinned < 0} == {0}  # beta unpinned: its latest published
    assert [r["state"] for r in world.call("replicas")] == ["active"]
    for name in names:
        if name not in {r["name"] for r in world.call("replicas")}:  # drained and stopped: the actor is gone
            wait_for(lambda n=name: _actor_gone(n, world.namespace), f"replica {name} stopped", timeout_s=60)
    stats = world.call("stats")
    print("replica set after 1 -> 3 -> 1:", {k: stats["replica_set"][k] for k in ("requests", "rerouted_requests")})
    # The unknown version above, the caller's error: counted where it was routed (the caller's
    # TenantRouter, issue 45.3, or the front).
    routed = world.cluster.inference.stats().get("router", {})
    assert stats["replica_set"]["failed_requests"] + routed.get("failed_requests", 0) == 1
    assert stats["queue_depth"] == 0 and stats["tenants"] == {"rr-alpha": [0, 1], "rr-beta": [0]}
    assert replica_summary(stats["replicas"]) == "; replicas: 1 active"  # `joynexus status`'s line
    manual_phase_s = time.monotonic() - started

    # -- the autoscaler reacts to the load: out while it lasts, back in once idle -----------------
    events_before = stats["replica_set"]["scale_events"]
    assert world.call("set_autoscale", True) is True
    with Load(world, pins={i: i % 2 for i in range(8)}, api_caller=False) as load:
        wait_for(lambda: len(world.active()) >= 2, "an autoscaler scale-out under load", timeout_s=240)
        grown = len(load.ok)
        wait_for(lambda: load.served_more(grown + 10), "requests served after the scale-out", timeout_s=120)
    wait_for(lambda: len(world.active()) == 1, "the autoscaler's scale-in once idle", timeout_s=120)
    assert load.errors == [] and len(load.ok) == load.sent
    assert all(pinned == got for pinned, got in load.ok)
    stats = world.call("stats")
    reasons = [e["reason"] for e in stats["replica_set"]["scale_events_recent"]]
    assert stats["replica_set"]["scale_events"] >= events_before + 2
    assert any(r.startswith("autoscaler") for r in reasons), reasons

    # -- the front itself restarted in place: its replicas go with it, the Master serves every tenant again
    front_before = world.call("heartbeat")
    ray.kill(world.front, no_restart=False)

    seen: list[dict[str, Any]] = []

    def front_restored() -> dict[str, Any] | None:
        entry = world.client.get("/v1/health").json()["roles"]["inference_service"]
        seen[:] = [entry]  # the last report, for the failure message
        # The Master's restore line (master/serving_restore.py `describe`): both tenants' sets loaded again.
        restored = "restored the serving sets of 2 tenants" in entry["detail"]
        return entry if entry["restarts"] == 1 and entry["healthy"] and restored else None

    try:
        wait_for(front_restored, "the Master restoring the restarted replica set", timeout_s=180)
    except AssertionError as error:
        raise AssertionError(f"{error}; the last report: {seen}") from None
    front_after = world.call("heartbeat")
    assert front_after["incarnation"] != front_before["incarnation"]
    assert [r["state"] for r in front_after["replicas"]] == ["active"]
    served_again = {t: world.call("versions", t) for t in ("rr-alpha", "rr-beta")}
    print("versions served after the front restarted:", served_again)
    assert served_again["rr-alpha"][-1] == 1 and served_again["rr-beta"] == [0]  # each tenant's current version
    print(f"manual 1->3->1 with a restart: {manual_phase_s:.1f} s; total {time.monotonic() - started:.1f} s")


def _actor_gone(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return True
    return False
