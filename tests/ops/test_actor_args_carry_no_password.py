"""Issue 43.8: the service actors never receive the database password as an argument (Ray keeps every
actor's creation arguments in the GCS, and with GCS fault tolerance in its Redis; the dashboard and the
state API serve them). The actors are made along the deployment's own path (`create_service_actors`,
`master_service_actor`, `call_futures_actor`, as the services driver runs them) with a URL that
carries a password, with Ray's actor creation recorded instead of run; every recorded argument is
pickled as Ray would ship it and searched for the password. Each actor then reads the login by name
in its own process (a mounted file, `JOYNEXUS_DATABASE_URL_FILE`)."""

from __future__ import annotations

from typing import Any

import cloudpickle
import pytest

import joynexus.master.deployment as deployment
from joynexus.master.service import master_service_actor
from joynexus.services.call_futures import call_futures_actor
from joynexus.settings import Settings, database_url_ref, resolve_database_url

ray = pytest.importorskip("ray")

PASSWORD = "pw-Zq81xK-not-for-actors"
URL = f"postgresql+psycopg://jnx_control_plane:{PASSWORD}@db.internal:5432/joynexus?sslmode=verify-full"


class _Recorded:
    """A stand-in for `ray.remote(cls)`: `.options(...)` then `.remote(*args, **kwargs)` records them."""

    def __init__(self, cls: Any, calls: list):
        self.cls, self.calls, self.name = cls, calls, None

    def options(self, **options: Any) -> _Recorded:
        self.name = options.get("name")
        return self

    def remote(self, *args: Any, **kwargs: Any) -> str:
        self.calls.append((self.name or self.cls.__name__, args, kwargs))
        return f"handle:{self.name}"


@pytest.fixture
def recorded(monkeypatch):
    calls: list = []

    def remote(*args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs:  # ray.remote(cls)
            return _Recorded(args[0], calls)
        return lambda cls: _Recorded(cls, calls)  # ray.remote(concurrency_groups=...)(cls)

    def get_actor(name: str, namespace: str | None = None) -> Any:
        raise ValueError(f"{name} is not running")

    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(deployment, "init_ray", lambda address: None)
    return calls


def test_no_service_actor_gets_the_database_password_as_an_argument(recorded, tmp_path):
    settings = Settings(data_dir=tmp_path, database_url=URL, ray_namespace="joynexus", producer_replicas=2)
    _, training, inference, _ = deployment.create_service_actors(settings, detached=True)
    master_service_actor(settings, detached=True)
    call_futures_actor(training, inference, database_url=settings.resolved_database_url(), namespace="joynexus")
    names = {name for name, _, _ in recorded}
    expected = {"joynexus.master", "joynexus.inference_service", "joynexus.environment_service",
                "joynexus.producers-0", "joynexus.producers-1", "joynexus.call_futures"}  # fmt: skip
    assert expected <= names, names
    for name, args, kwargs in recorded:
        shipped = cloudpickle.dumps((args, kwargs))
        assert PASSWORD.encode() not in shipped, name
    # The actors that use the store got the login by reference, the redacted URL naming what it is
    ref = database_url_ref(URL)
    assert ref is not None and PASSWORD not in ref and "jnx_control_plane@db.internal:5432" in ref
    by_name = {name: (args, kwargs) for name, args, kwargs in recorded}
    assert by_name["joynexus.master"][0][0].database_url == ref
    assert by_name["joynexus.inference_service"][1]["database_url"] == ref
    assert by_name["joynexus.environment_service"][1]["database_url"] == ref
    assert by_name["joynexus.call_futures"][1]["database_url"] == ref


def test_an_actor_reads_the_login_by_name_and_refuses_another_or_none(monkeypatch, tmp_path):
    ref = database_url_ref(URL)
    monkeypatch.delenv("JOYNEXUS_DATABASE_URL", raising=False)
    monkeypatch.delenv("JOYNEXUS_DATABASE_URL_FILE", raising=False)
    with pytest.raises(ValueError, match="neither JOYNEXUS_DATABASE_URL_FILE nor JOYNEXUS_DATABASE_URL"):
        resolve_database_url(ref)
    mounted = tmp_path / "JOYNEXUS_DATABASE_URL"
    mounted.write_text(URL + "\n")  # the kubelet writes the Secret's key as a file
    monkeypatch.setenv("JOYNEXUS_DATABASE_URL_FILE", str(mounted))
    assert resolve_database_url(ref) == URL
    actor_settings = Settings(data_dir=tmp_path, database_url=URL).for_actors()
    assert actor_settings.database_url == ref and actor_settings.resolved_database_url() == URL
    mounted.write_text(URL.replace("jnx_control_plane", "jnx_mlflow"))
    with pytest.raises(ValueError, match="holds the login .*jnx_mlflow.* its creator meant"):
        resolve_database_url(ref)
    # Without a password there is nothing to hide: a SQLite file travels as it is
    assert database_url_ref("sqlite:///var/joynexus.db") == "sqlite:///var/joynexus.db"
