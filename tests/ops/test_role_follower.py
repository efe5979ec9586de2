"""The API server's role follower after a Ray head restart (issue 29, the topology test's head-restart
step): the detached actors live on, but a Ray Client (`ray://`) session ends with the old head, and
every handle got through it is void. Calls then answer 503 (not a 500 "Ray Client is not
connected"), and once the head's client port answers the follower connects a new session, retargets
EVERY role's handle (the same actors, by id, but the old session's handles), and tells the holders
of other handles (the gateway's call queue)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from joynexus.actors import RoleUnavailable, handle_of, service_handle
from joynexus.connect import Cluster
from joynexus.ops import role_follower
from joynexus.ops.role_follower import ROLE_ACTORS, RoleFollower
from joynexus.settings import Settings

ray = pytest.importorskip("ray")


class FakeActor:
    """A named actor's handle in one Ray session: the actor's id, the session it came through."""

    def __init__(self, name: str, session: int):
        self._actor_id, self.session = name, session
        self.ping = SimpleNamespace(remote=lambda: "pong")


class FakeRay:
    """The process's Ray Client session: connected or ended; `connect` opens session n+1."""

    def __init__(self, monkeypatch):
        self.session, self.connected, self.port_open = 1, True, True
        self.events: list[str] = []
        monkeypatch.setattr(role_follower, "_client_session_lost", lambda address: not self.connected)
        monkeypatch.setattr(role_follower, "_port_open", lambda address: self.port_open)
        monkeypatch.setattr(role_follower, "_end_session", lambda: self.events.append("end"))
        monkeypatch.setattr(role_follower, "init_ray", self.connect)
        monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: FakeActor(name, self.session))
        monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)

    def connect(self, address: str) -> None:
        self.events.append(f"init {address}")
        self.session += 1
        self.connected = True


@pytest.fixture
def follower(tmp_path, monkeypatch):
    fake = FakeRay(monkeypatch)
    settings = Settings(data_dir=tmp_path, ray_address="ray://joynexus-head-svc:10001")
    handles = {attr: service_handle(object, FakeActor(name, 1)) for attr, name in ROLE_ACTORS.items()}
    cluster = Cluster(settings=settings, mode="ray", **handles)
    follower = RoleFollower(cluster)
    return follower, fake


def test_an_ended_client_session_refuses_calls_until_a_new_one_serves_every_role(follower):
    follower, fake = follower
    follower._gate()  # a live session: calls go through
    fake.connected, fake.port_open = False, False  # the head pod is gone; its client session ended
    with pytest.raises(RoleUnavailable, match="Ray Client session ended"):
        follower._gate()  # a 503 with Retry-After, not a 500 "Ray Client is not connected"
    follower.follow(relookup=False)
    assert fake.events == []  # nothing calls into Ray while the head's client port is closed
    with pytest.raises(RoleUnavailable):
        follower._gate()
    dropped = []
    follower.on_reconnect.append(lambda: dropped.append(True))
    fake.port_open = True  # the new head serves
    follower.follow(relookup=False)
    assert fake.events == ["end", "init ray://joynexus-head-svc:10001"]
    for attr, name in ROLE_ACTORS.items():  # the same actors, through the new session
        target = handle_of(getattr(follower.cluster, attr)).target
        assert (target._actor_id, target.session) == (name, 2), attr
    assert dropped == [True] and follower.reconnects == 1
    follower._gate()  # open again
    follower.follow(relookup=False)
    assert follower.reconnects == 1  # a live session is left alone


def test_a_live_session_is_not_reconnected_and_unchanged_actors_keep_their_handles(follower):
    follower, fake = follower
    before = {attr: handle_of(getattr(follower.cluster, attr)).target for attr in ROLE_ACTORS}
    follower.follow(relookup=True)
    assert fake.events == [] and follower.reconnects == 0
    assert {attr: handle_of(getattr(follower.cluster, attr)).target for attr in ROLE_ACTORS} == before


def test_the_client_port_is_the_one_checked_for_a_ray_client_address():
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert role_follower._port_open(f"ray://127.0.0.1:{port}")
    assert not role_follower._port_open(f"ray://127.0.0.1:{port}")


class ClientWorker:
    def __init__(self, connected: bool = True, data_channel_ended: bool = False):
        self.connected, self.data_client = connected, SimpleNamespace(_in_shutdown=data_channel_ended)

    def is_connected(self) -> bool:
        return self.connected


@pytest.mark.parametrize(
    ("worker", "lost"),
    [
        (ClientWorker(), False),
        (None, True),  # disconnected
        (ClientWorker(connected=False), True),  # "Ray Client is not connected"
        # the data channel gave up reconnecting ("Attempted to reconnect a session that has already
        # been cleaned up"): the worker still says connected, every call raises ConnectionError
        (ClientWorker(data_channel_ended=True), True),
    ],
)
def test_an_ended_client_session_is_seen_however_ray_client_left_it(monkeypatch, worker, lost):
    from ray.util.client import ray as client

    monkeypatch.setattr(client, "get_context", lambda: SimpleNamespace(client_worker=worker))
    assert role_follower._client_session_lost("ray://joynexus-head-svc:10001") is lost
    assert role_follower._client_session_lost("127.0.0.1:6379") is False  # a Ray node's own session


def test_a_heartbeat_through_ray_client_goes_without_a_concurrency_group(monkeypatch):
    """Ray Client's `.options` refuses `concurrency_group` (the API's /v1/health said the Master
    "does not answer: ValueError: Invalid option keyword"); a cluster driver still uses the group."""
    from joynexus import actors

    class Method:
        def __init__(self, client: bool):
            self.client, self.groups = client, []

        def options(self, **options):
            if self.client:
                raise ValueError(f"Invalid option keyword: '{next(iter(options))}'")
            self.groups.append(options["concurrency_group"])
            return self

        def remote(self):
            return "beat"

    monkeypatch.setattr(actors, "_is_actor_handle", lambda target: True)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    for client in (True, False):
        target = SimpleNamespace(heartbeat=Method(client))
        monkeypatch.setattr(actors, "_is_client_actor_handle", lambda t, client=client: client)
        assert actors.ServiceHandle(target).probe("heartbeat", timeout_s=1) == "beat"
        assert target.heartbeat.groups == ([] if client else [actors.HEALTH_GROUP])
