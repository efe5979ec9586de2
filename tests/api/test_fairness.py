"""Fairness between tenants at the API: open event streams hold no worker thread and are bounded per
tenant, and the idempotency cache is kept per authenticated tenant, so one tenant's traffic can neither
stall nor evict another tenant's."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx

from tests.api.conftest import ADMIN_KEY, free_port, wire

OPEN_STREAMS = 140  # more than the server's 128 worker threads: a thread per stream would starve the rest


@contextlib.contextmanager
def serve(api, **settings) -> Iterator[tuple[str, object]]:
    """A second app over the session's services, with its own ApiSettings, behind a real uvicorn
    server (event streams and disconnects need real sockets); yields (URL, app)."""
    import uvicorn

    from joynexus.api.app import ApiSettings, create_app

    app = create_app(api.cluster, ApiSettings(**settings), admin_key=ADMIN_KEY)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn-fairness", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextlib.contextmanager
def silent_workload(api, tenant) -> Iterator[str]:
    """A workload of `tenant` that stays queued (behind a long one of the same tenant), so its
    event stream stays open and quiet; both are cancelled afterwards."""
    running = api.client.post("/v1/workloads", json={"jobs": 100_000}, headers=tenant.headers)
    assert running.status_code == 202, running.text
    queued = api.client.post("/v1/workloads", json={"jobs": 1}, headers=tenant.headers)
    assert queued.status_code == 202, queued.text
    assert queued.json()["state"] == "queued"
    try:
        yield queued.json()["workload_id"]
    finally:
        for workload in (queued, running):
            api.client.post(f"/v1/workloads/{workload.json()['workload_id']}/cancel", headers=tenant.headers)


async def first_event(lines: AsyncIterator[str]) -> str:
    """The next event's kind. `lines` must outlive this call: a line iterator that is dropped gets
    finalized, and that closes its response."""
    while not (line := await anext(lines)).startswith("event: "):
        pass
    return line[7:]


@contextlib.asynccontextmanager
async def open_streams(
    client: httpx.AsyncClient, path: str, headers: dict, count: int
) -> AsyncIterator[list[httpx.Response]]:
    """`count` event streams held open, each having delivered its first event (so each is being
    served); closed on exit."""
    async with contextlib.AsyncExitStack() as stack:
        responses = await asyncio.gather(
            *[stack.enter_async_context(client.stream("GET", path, headers=headers)) for _ in range(count)]
        )
        assert [r.status_code for r in responses] == [200] * count
        lines = [r.aiter_lines() for r in responses]  # held until the streams close
        assert set(await asyncio.gather(*[first_event(it) for it in lines])) == {"queued"}
        yield list(responses)


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_event_streams_are_bounded_per_tenant_and_released_on_close(api):
    a, b = api.tenant("streams-a"), api.tenant("streams-b")
    with serve(api, max_streams_per_tenant=2, stream_poll_s=0.05) as (url, app), silent_workload(api, a) as quiet:
        counts = app.state.event_streams

        async def run() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                path = f"/v1/workloads/{quiet}/stream"
                async with open_streams(client, path, a.headers, 2):
                    assert counts.count(a.tenant_id) == 2
                    refused = await client.get(path, headers=a.headers)
                    assert refused.status_code == 429, refused.text
                    body = refused.json()
                    assert body["code"] == "too_many_streams" and "limit is 2" in body["message"]
                    assert body["problems"][0]["field"] == "max_streams_per_tenant"
                    # another tenant is still served, to the end of its stream
                    mine = await client.post("/v1/workloads", json={"jobs": 1}, headers=b.headers)
                    kinds = []
                    async with client.stream("GET", f"/v1/workloads/{mine.json()['workload_id']}/stream",
                                             headers=b.headers) as stream:  # fmt: skip
                        assert stream.status_code == 200
                        kinds = [line[7:] async for line in stream.aiter_lines() if line.startswith("event: ")]
                    assert kinds[0] == "queued" and kinds[-1] == "end"
                    assert counts.count(b.tenant_id) == 0  # a finished stream gave its slot back
                # the client went away: the server notices and frees both slots
                await asyncio.to_thread(wait_for, lambda: counts.count(a.tenant_id) == 0, "slots not released")
                async with open_streams(client, path, a.headers, 2):
                    assert counts.count(a.tenant_id) == 2

        asyncio.run(run())
        wait_for(lambda: counts.count(a.tenant_id) == 0, "slots of the closed streams not released")


def test_open_streams_of_one_tenant_do_not_stall_another_tenants_calls(api):
    a, b = api.tenant("hog"), api.tenant("victim")
    # No heartbeat during the test: a stream that held a thread between polls would never let go.
    settings = dict(max_streams_per_tenant=OPEN_STREAMS, stream_poll_s=0.5, stream_heartbeat_s=3600)
    with serve(api, **settings) as (url, app), silent_workload(api, a) as quiet:
        counts = app.state.event_streams

        async def run() -> dict:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
                async with open_streams(client, f"/v1/workloads/{quiet}/stream", a.headers, OPEN_STREAMS):
                    # Sync routes run in the same worker threads the streams would have pinned.
                    tenant = await client.get("/v1/tenant", headers=b.headers)
                    step = await client.post("/v1/train_batch", json=wire(b.batch(2)), headers=b.headers)
                    still_open = counts.count(a.tenant_id)
                return {"tenant": tenant, "step": step, "still_open": still_open}

        answered = asyncio.run(run())
    assert answered["tenant"].status_code == 200 and answered["tenant"].json()["tenant_id"] == b.tenant_id
    assert answered["step"].status_code == 200 and answered["step"].json()["version"] == 1
    assert answered["still_open"] == OPEN_STREAMS  # answered while every stream of the other tenant was open


def test_one_tenants_idempotency_keys_do_not_evict_anothers(api):
    a, b = api.tenant("idem-busy"), api.tenant("idem-quiet")
    batch = wire(b.batch(2))
    keyed = {**b.headers, "Idempotency-Key": "b-step-1"}
    first = api.client.post("/v1/train_batch", json=batch, headers=keyed)
    assert first.status_code == 200 and first.json()["optimizer_steps"] == 1
    # More keyed answers of tenant A than the whole cache used to hold (a cheap POST: a 422 is kept too).
    for i in range(1100):
        r = api.client.post("/v1/train_batch", json={}, headers={**a.headers, "Idempotency-Key": f"a-{i}"})
        assert r.status_code == 422
    retried = api.client.post("/v1/train_batch", json=batch, headers=keyed)
    assert retried.headers.get("idempotent-replayed") == "true"
    assert retried.json() == first.json()
    versions = api.client.get("/v1/versions", headers=b.headers).json()
    assert (versions["training_version"], versions["optimizer_steps"]) == (1, 1)  # the step was applied once
    # A's own oldest key did go (its bound is per caller): a retry of it runs again
    again = api.client.post("/v1/train_batch", json={}, headers={**a.headers, "Idempotency-Key": "a-0"})
    assert again.status_code == 422 and "idempotent-replayed" not in again.headers


def test_the_idempotency_cache_keeps_answers_per_authenticated_tenant(tmp_path):
    """Issue 26: answers are kept per tenant (any key of it), only after its key is verified; refused
    callers never touch the cache, and a tenant's own bound only ever evicts its own answers."""
    from joynexus.api.auth import ApiKeyStore
    from joynexus.api.middleware import IdempotencyMiddleware
    from joynexus.core.store import ControlPlaneStore

    store = ControlPlaneStore(f"sqlite:///{tmp_path / 'keys.db'}")
    keys = ApiKeyStore(store)
    x1, x2, y = (keys.issue(t).api_key for t in ("tenant-x", "tenant-x", "tenant-y"))
    calls: list[str] = []

    async def app(scope, receive, send) -> None:  # a real ASGI app that counts what reaches it
        while (await receive()).get("more_body"):
            pass
        auth = dict(scope["headers"]).get(b"authorization", b"").decode()
        calls.append(auth)
        status = 200 if keys.verify(auth.partition(" ")[2]) else 401
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": f"call {len(calls)}".encode()})

    middleware = IdempotencyMiddleware(app, keys, max_entries=2)

    async def run() -> None:
        transport = httpx.ASGITransport(app=middleware)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

            async def post(who: str, key: str = "k") -> httpx.Response:
                return await client.post("/step", content=b"{}", headers={"Authorization": who, "Idempotency-Key": key})

            assert (await post(f"Bearer {x1}")).text == "call 1"
            assert (await post(f"Bearer {y}")).text == "call 2"
            assert (await post(f"bearer {x2}")).text == "call 1"  # another key of the same tenant: replayed
            for i in range(50):  # refused callers reach the route (401) and are never kept
                assert (await post(f"Bearer made-up-{i}", f"k{i}")).status_code == 401
            assert middleware.entries("tenant:tenant-x") == 1 and middleware.entries("tenant:tenant-y") == 1
            assert len(middleware._done) == 2  # nothing kept for anyone else
            for key in ("a", "b", "c"):  # tenant y goes over its own bound of 2: only its oldest goes
                await post(f"Bearer {y}", key)
            assert middleware.entries("tenant:tenant-y") == 2
            assert (await post(f"Bearer {x1}")).headers.get("idempotent-replayed") == "true"
            assert (await post(f"Bearer {y}")).text == f"call {6 + 50}"  # y's first answer was its own to lose

    asyncio.run(run())
    assert sum(c.startswith("Bearer made-up") for c in calls) == 50
    store.dispose()
