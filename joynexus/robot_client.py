"""A robot-side client of the policy stream (`/v1/stream`, see `joynexus.api.streaming`).

    client = RobotPolicyClient("http://127.0.0.1:8765", api_key, get_observation, control_hz=30)
    with client:
        while running:
            action = client.next_action(timeout=0.1)   # (action_dim,) float32, or None
            if action is not None:
                robot.apply(action)
            sleep_until_next_tick()

Asynchronous inference in the manner of LeRobot's: the client keeps a queue of upcoming actions.
Its background loop ticks at `control_hz`; when the queue holds `request_threshold` actions or
fewer and no request is pending, it calls `get_observation()` and sends it, so the next chunk is
on its way before the current one runs out. A chunk answers the observation taken at control step
t; when it arrives at step t' >= t, its actions for steps t'.. replace the queue (the first t' - t
were overtaken by time), so the robot always executes the freshest plan for each step.

`get_observation()` returns ``{"images": (cameras, 3, H, W), "state": (state_dim,),
"instruction": str}`` for one robot (a leading sample axis of 1 is accepted too; a robot of a
tenant without cameras leaves "images" out); images uint8 or
float in [0, 1].

The connection is re-opened with exponential backoff (and jitter) when it drops; a request that
was pending is sent again on the new connection. An authentication refusal (close code 1008) or a
frame the server could not read (1003, 1009) is fatal: `next_action` then raises
`RobotClientError`. Error frames (a bad observation) are kept in `stats()["last_error"]` and the
client carries on. The client runs its asyncio loop in a daemon thread; it needs only numpy,
msgpack, pydantic and websockets (no server code).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from joynexus.protocol.wire import Tensor, msgpack_dumps, msgpack_loads

log = logging.getLogger("joynexus.robot_client")

STREAM_PATH = "/v1/stream"
FATAL_CLOSE_CODES = frozenset({1003, 1008, 1009})


class RobotClientError(RuntimeError):
    pass


def stream_url(url: str) -> str:
    """ws(s)://host:port/v1/stream from an http(s)://, ws(s):// or bare host:port URL."""
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None:
        raise ValueError(f"url: unsupported scheme {parts.scheme!r}")
    path = parts.path.rstrip("/")
    if not path.endswith(STREAM_PATH):
        path += STREAM_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def observation_frame(seq: int, observation: dict[str, Any], policy_version: int | None = None) -> dict[str, Any]:
    """An `obs` frame for one robot's observation (adds the sample axis when it is missing). A robot
    of a tenant without cameras leaves out "images" (or gives None)."""
    state = np.asarray(observation["state"])
    if state.ndim == 1:
        state = state[None]
    if state.dtype != np.float32:
        state = state.astype(np.float32)
    images = observation.get("images")
    if images is not None:
        images = np.asarray(images)
        if images.ndim == 4:
            images = images[None]
        if images.dtype.kind == "f" and images.dtype != np.float32:
            images = images.astype(np.float32)
    instruction = observation.get("instruction")
    instructions = None if instruction is None else [instruction] * state.shape[0]
    return {
        "type": "obs",
        "seq": seq,
        "observations": {
            "images": None if images is None else Tensor.from_numpy(images).model_dump(),
            "state": Tensor.from_numpy(state).model_dump(),
            "instructions": instructions,
        },
        "policy_version": policy_version,
    }


@dataclass
class _Pending:
    seq: int
    data: bytes  # the encoded frame, re-sent after a reconnect
    step: int  # the control step the observation was taken at
    sent_at: float = field(default_factory=time.monotonic)


class RobotPolicyClient:
    def __init__(
        self,
        url: str,
        api_key: str,
        get_observation: Callable[[], dict[str, Any]],
        *,
        control_hz: float = 30.0,
        request_threshold: int | None = None,
        policy_version: int | None = None,
        request_timeout_s: float = 5.0,
        open_timeout_s: float = 10.0,
        reconnect_initial_s: float = 0.05,
        reconnect_max_s: float = 2.0,
        max_frame_bytes: int = 16 << 20,
    ):
        """`request_threshold`: request the next chunk when the queue holds this many actions or
        fewer (default: half the tenant's chunk, from the server's ready frame)."""
        if control_hz <= 0:
            raise ValueError(f"control_hz must be > 0, got {control_hz}")
        self.url = stream_url(url)
        self._api_key = api_key
        self.get_observation = get_observation
        self.control_hz = control_hz
        self.request_threshold = request_threshold
        self.policy_version = policy_version
        self.request_timeout_s = request_timeout_s
        self.open_timeout_s = open_timeout_s
        self.reconnect_initial_s = reconnect_initial_s
        self.reconnect_max_s = reconnect_max_s
        self.max_frame_bytes = max_frame_bytes
        self.tenant: dict[str, Any] | None = None  # from the server's ready frame
        self._cond = threading.Condition()
        self._queue: collections.deque[np.ndarray] = collections.deque()
        self._step = 0  # actions handed to the control loop so far
        self._seq = 0
        self._pending: _Pending | None = None
        self._fatal: str | None = None
        self._closing = False
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._latencies_ms: list[float] = []
        self._stats: dict[str, Any] = {
            "requests": 0,
            "chunks": 0,
            "stale_chunks": 0,
            "refills_before_empty": 0,
            "actions": 0,
            "starved": 0,
            "errors": 0,
            "timeouts": 0,
            "connects": 0,
            "reconnects": 0,
            "resent": 0,
            "last_error": None,
            "policy_version": None,
        }

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, wait_s: float | None = 10.0) -> RobotPolicyClient:
        """Start the background loop; with `wait_s`, wait until connected (RobotClientError if not)."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run_loop, name="robot-policy-client", daemon=True)
        self._thread.start()
        if wait_s is not None and not self.wait_connected(wait_s):
            raise RobotClientError(self._fatal or f"not connected to {self.url} within {wait_s} s")
        return self

    def wait_connected(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._fatal is None:
            if self._ready.wait(0.05):
                return True
        return self._ready.is_set()

    def close(self) -> None:
        self._closing = True
        if self._loop is not None and self._stop is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop is gone already
                pass
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> RobotPolicyClient:
        return self.start()

    def __exit__(self, *_exc: Any) -> None:
        self.close()

    # -- the control loop's side ----------------------------------------------------------------
    def next_action(self, timeout: float | None = 0.0) -> np.ndarray | None:
        """The action for the current control step, or None if none arrives within `timeout`
        (0: do not wait; None: wait until one comes). Raises RobotClientError after a fatal close."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._queue:
                if self._fatal is not None:
                    raise RobotClientError(self._fatal)
                remaining = None if deadline is None else deadline - time.monotonic()
                if self._closing or (remaining is not None and remaining <= 0):
                    if self._stats["chunks"]:
                        self._stats["starved"] += 1
                    return None
                self._cond.wait(remaining)
            self._step += 1
            self._stats["actions"] += 1
            return self._queue.popleft()

    @property
    def queue_length(self) -> int:
        with self._cond:
            return len(self._queue)

    @property
    def connected(self) -> bool:
        return self._ready.is_set()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            latencies = np.asarray(self._latencies_ms, dtype=np.float64)
            out = dict(self._stats, queue_length=len(self._queue), step=self._step, fatal=self._fatal)
        out["latency_ms"] = (
            {"p50": float(np.percentile(latencies, 50)), "p99": float(np.percentile(latencies, 99))}
            if latencies.size
            else None
        )
        out["latencies_ms"] = latencies.tolist()
        return out

    # -- the background loop --------------------------------------------------------------------
    def _run_loop(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except Exception as error:  # pragma: no cover - _main catches what it expects
            log.exception("robot policy client loop failed")
            self._fail(f"client loop failed: {error}")
        finally:
            loop.close()

    def _fail(self, reason: str) -> None:
        with self._cond:
            self._fatal = reason
            self._cond.notify_all()

    async def _main(self) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed, InvalidHandshake

        self._stop = asyncio.Event()
        backoff = self.reconnect_initial_s
        while not self._stop.is_set():
            try:
                async with connect(
                    self.url,
                    additional_headers={"Authorization": f"Bearer {self._api_key}"},
                    open_timeout=self.open_timeout_s,
                    max_size=self.max_frame_bytes,
                    compression=None,
                ) as ws:
                    await self._connected(ws)
                    backoff = self.reconnect_initial_s
                    await self._session(ws)
                    if self._stop.is_set():
                        return
            except ConnectionClosed as closed:
                frame = closed.rcvd
                if frame is not None and frame.code in FATAL_CLOSE_CODES:
                    self._fail(f"the server closed the stream: {frame.code} {frame.reason}")
                    return
                log.info("policy stream dropped (%s); reconnecting", closed)
            except (OSError, TimeoutError, InvalidHandshake) as error:
                log.info("policy stream connect failed (%s); retrying", error)
            except RobotClientError as error:
                self._fail(str(error))
                return
            finally:
                self._ready.clear()
            if self._stop.is_set():
                return
            self._stats["reconnects"] += 1
            try:
                await asyncio.wait_for(self._stop.wait(), backoff * (0.5 + random.random()))
            except TimeoutError:
                pass
            backoff = min(backoff * 2, self.reconnect_max_s)

    async def _connected(self, ws: Any) -> None:
        ready = msgpack_loads(await asyncio.wait_for(ws.recv(), self.open_timeout_s))
        if not isinstance(ready, dict) or ready.get("type") != "ready":
            raise RobotClientError(f"expected a ready frame, got {str(ready)[:200]}")
        self.tenant = ready.get("tenant")
        if self.request_threshold is None:
            chunk = int((self.tenant or {}).get("action_chunk", 2))
            self.request_threshold = max(1, chunk // 2)
        self._stats["connects"] += 1
        pending = self._pending
        if pending is not None:  # resume: the answer to this one was lost with the old connection
            pending.sent_at = time.monotonic()
            await ws.send(pending.data)
            self._stats["resent"] += 1
        self._ready.set()

    async def _session(self, ws: Any) -> None:
        receiver = asyncio.create_task(self._receive(ws))
        ticker = asyncio.create_task(self._tick(ws))
        stopper = asyncio.create_task(self._stop.wait())
        try:
            done, _ = await asyncio.wait({receiver, ticker, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (receiver, ticker, stopper):
                task.cancel()
            await asyncio.gather(receiver, ticker, stopper, return_exceptions=True)
        for task in done:
            if task is not stopper and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    async def _tick(self, ws: Any) -> None:
        period = 1.0 / self.control_hz
        next_tick = time.monotonic()
        while True:
            pending = self._pending
            if pending is not None and time.monotonic() - pending.sent_at > self.request_timeout_s:
                self._stats["timeouts"] += 1
                self._pending = pending = None
            if pending is None and self.queue_length <= (self.request_threshold or 1):
                await self._request(ws)
            next_tick += period
            delay = next_tick - time.monotonic()
            if delay < 0:  # fell behind (a slow get_observation): skip ticks instead of bursting
                next_tick, delay = time.monotonic(), 0.0
            await asyncio.sleep(delay)

    async def _request(self, ws: Any) -> None:
        with self._cond:
            step = self._step
        observation = await asyncio.to_thread(self.get_observation)
        self._seq += 1
        data = msgpack_dumps(observation_frame(self._seq, observation, self.policy_version))
        self._pending = _Pending(self._seq, data, step)
        self._stats["requests"] += 1
        await ws.send(data)

    async def _receive(self, ws: Any) -> None:
        async for message in ws:
            if isinstance(message, str):
                continue
            frame = msgpack_loads(message)
            if not isinstance(frame, dict):
                continue
            pending = self._pending
            matches = pending is not None and frame.get("seq") == pending.seq
            if frame.get("type") == "actions" and matches:
                self._pending = None
                self._accept_chunk(pending, frame)
            elif frame.get("type") == "error":
                self._stats["errors"] += 1
                self._stats["last_error"] = {k: frame.get(k) for k in ("seq", "code", "message", "problems")}
                log.warning("policy stream error for request %s: %s", frame.get("seq"), frame.get("message"))
                if matches:
                    self._pending = None

    def _accept_chunk(self, pending: _Pending, frame: dict[str, Any]) -> None:
        actions = Tensor.model_validate(frame["actions"]).to_numpy()
        chunk = actions[0] if actions.ndim == 3 else actions  # (action_chunk, action_dim) of this robot
        latency_ms = (time.monotonic() - pending.sent_at) * 1000.0
        with self._cond:
            self._latencies_ms.append(latency_ms)
            self._stats["chunks"] += 1
            self._stats["policy_version"] = frame.get("policy_version")
            elapsed = self._step - pending.step  # steps executed since the observation was taken
            fresh = chunk[elapsed:]
            if not len(fresh):
                self._stats["stale_chunks"] += 1
                return
            if self._queue:
                self._stats["refills_before_empty"] += 1
            self._queue.clear()
            self._queue.extend(np.array(a, dtype=np.float32) for a in fresh)
            self._cond.notify_all()


__all__ = ["RobotClientError", "RobotPolicyClient", "observation_frame", "stream_url"]
