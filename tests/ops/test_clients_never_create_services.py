"""Issue 29 item 5: a client of a deployment's Ray address (the API, a flow run) never creates the named
service actors when they are absent (they would be tied to its lifetime, and not detached): it waits,
then raises `ServicesNotRunning` naming the Job that creates them; the API answers 503 with that
message. On a real local Ray: nothing is created in the deployment's namespace."""

from __future__ import annotations

import time
import uuid

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from joynexus.actors import ServicesNotRunning, init_ray, running_actor
from joynexus.api.errors import install_exception_handlers
from joynexus.connect import SERVICE_ACTOR_NAMES, ray_cluster
from joynexus.settings import Settings

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    init_ray(num_cpus=1)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        if started:
            ray.shutdown()


def _named(namespace: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]


def test_a_client_of_an_address_waits_then_refuses_and_creates_nothing(local_ray, tmp_path):
    namespace = f"client-{uuid.uuid4().hex[:8]}"
    settings = Settings(data_dir=tmp_path, ray_address=local_ray, ray_namespace=namespace)
    started = time.monotonic()
    with pytest.raises(ServicesNotRunning) as refused:
        ray_cluster(settings, wait_s=1.5)
    waited = time.monotonic() - started
    assert 1.5 <= waited < 30, waited
    message = str(refused.value)
    assert "joynexus-services" in message and "joynexus up" in message
    assert all(name in message for name in SERVICE_ACTOR_NAMES)  # every missing role is named
    assert _named(namespace) == []  # nothing made in the deployment's namespace


def test_the_futures_call_queue_is_looked_up_not_created(local_ray):
    namespace = f"client-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ServicesNotRunning, match="joynexus.call_futures is not running"):
        running_actor("joynexus.call_futures", namespace, "the futures call queue")
    assert _named(namespace) == []


def test_the_api_answers_503_naming_the_job_that_creates_the_services():
    app = FastAPI()
    install_exception_handlers(app)

    @app.get("/probe")
    def probe() -> None:
        raise ServicesNotRunning("the resident services", "joynexus.master not running: the Job joynexus-services",
                                 retry_after_s=10.0)  # fmt: skip

    answer = TestClient(app).get("/probe")
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "10"
    assert "the Job joynexus-services" in answer.text
