"""The abuse suite (issue 26): what an unauthenticated caller, or one tenant, can do to the service
and to another tenant, through a real uvicorn server over the session's in-process deployment (the
same `api` / `live_server` world as tests/api, so a run of both builds it once).

Bounded in count and time: each flood is a fixed number of requests or a few seconds."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np
import pytest

from tests.api.conftest import ADMIN_KEY, TenantHandle, api, live_server, wire  # noqa: F401 (fixtures)
from tests.helpers import session_heap_frozen, wait_for

LATENCY_SAMPLES = 40  # the victim's 1-sample predicts per measurement


def serving_tenant(api, prefix: str, shape: str = "arm") -> TenantHandle:  # noqa: F811 (api: the fixture's value)
    """A tenant with serving weights loaded (one train step, then weights/load)."""
    t = api.tenant(prefix, shape)
    trained = api.client.post("/v1/train_batch", json=wire(t.batch(2)), headers=t.headers)
    assert trained.status_code == 200, trained.text
    loaded = api.client.post("/v1/weights/load", json={}, headers=t.headers)
    assert loaded.status_code == 200, loaded.text
    return t


def predict_body(t: TenantHandle, n: int, seed: int = 0, **extra) -> dict:
    """A predict request of `n` observations (uint8 images: the smallest body for many samples)."""
    batch = t.batch(n, seed)
    images = (batch["images"] * 255).astype(np.uint8)
    return {"observations": wire({"images": images, "state": batch["state"]}), **extra}


def queued_chunks(api, tenant_id: str) -> int:  # noqa: F811
    """The tenant's entries waiting in the Inference Queue (the queue's own size API)."""
    return api.cluster.inference.queue.depth(tenant_id)


def p99(latencies: list[float]) -> float:
    return float(np.percentile(latencies, 99))


def victim_latencies(url: str, t: TenantHandle, n: int = LATENCY_SAMPLES) -> list[float]:
    """Seconds of `n` sequential 1-sample predicts of tenant `t` over HTTP (each must answer 200)."""
    body = predict_body(t, 1, seed=7)
    out = []
    with httpx.Client(base_url=url, headers=t.headers, timeout=60) as client:
        for _ in range(n):
            started = time.perf_counter()
            response = client.post("/v1/predict", json=body)
            out.append(time.perf_counter() - started)
            assert response.status_code == 200, response.text
    return out


@dataclass
class Flood:
    """`workers` threads sending `send(client, i)` back to back against `url` until stopped."""

    url: str
    send: object  # (httpx.Client, int) -> None
    workers: int = 4
    headers: dict | None = None

    def __post_init__(self) -> None:
        self.sent = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(self.workers)]

    def _run(self, worker: int) -> None:
        with httpx.Client(base_url=self.url, headers=self.headers or {}, timeout=60) as client:
            i = worker
            while not self._stop.is_set():
                try:
                    self.send(client, i)
                except Exception as error:  # counted: a flood's own failures are not the victim's
                    self.errors.append(repr(error))
                self.sent += 1
                i += self.workers

    def __enter__(self) -> Flood:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)


@pytest.fixture
def latency_measured():
    """The session's heap frozen while the test measures latencies (`session_heap_frozen`)."""
    with session_heap_frozen():
        yield


@pytest.fixture(scope="module")
def victim(api):  # noqa: F811
    return serving_tenant(api, "victim")


@pytest.fixture(scope="module")
def attacker(api):  # noqa: F811
    return serving_tenant(api, "attacker", "flow")


__all__ = [
    "ADMIN_KEY",
    "Flood",
    "p99",
    "predict_body",
    "queued_chunks",
    "serving_tenant",
    "victim_latencies",
    "wait_for",
]
