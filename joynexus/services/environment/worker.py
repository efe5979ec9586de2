"""A session's simulator worker process, and the pickle-free codec it talks to the service with.

The service starts `worker_main` in a process of its own ("spawn") per session; parent and worker
exchange messages over a Pipe as `pack_message` / `unpack_message` bytes: a JSON header plus raw
buffers, carrying only plain data and numpy arrays of numeric dtypes, so nothing is ever unpickled.
This module imports no SQLAlchemy or Ray: the spawned worker imports it.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import signal
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from joynexus.envs.base import AssetDownloadRefused, SimulatorConfig, build_simulator
from joynexus.envs.vector import VectorSimulator

__all__ = ["pack_message", "unpack_message", "worker_main"]


# Wire codec: JSON header + raw numeric buffers. No pickle in either direction.
_ND = "__ndarray__"
_ND_KINDS = "biuf"  # bool, int, uint, float: never object arrays


def pack_message(obj: Any) -> bytes:
    buffers: list[bytes] = []

    def enc(o: Any) -> Any:
        if isinstance(o, np.ndarray):
            if o.dtype.kind not in _ND_KINDS:
                raise TypeError(f"cannot send an array of dtype {o.dtype}")
            a = np.ascontiguousarray(o)
            buffers.append(a.tobytes())
            return {_ND: [a.dtype.str, list(a.shape), len(buffers) - 1]}
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, dict):
            return {str(k): enc(v) for k, v in o.items()}
        if isinstance(o, list | tuple):
            return [enc(v) for v in o]
        if o is None or isinstance(o, bool | int | float | str):
            return o
        raise TypeError(f"cannot send a {type(o).__name__} between the service and a simulator worker")

    body = enc(obj)
    header = json.dumps({"body": body, "sizes": [len(b) for b in buffers]}).encode()
    return struct.pack("<I", len(header)) + header + b"".join(buffers)


def unpack_message(data: bytes) -> Any:
    (n,) = struct.unpack_from("<I", data, 0)
    head = json.loads(data[4 : 4 + n])
    offsets, pos = [], 4 + n
    for size in head["sizes"]:
        offsets.append(pos)
        pos += size

    def dec(o: Any) -> Any:
        if isinstance(o, dict):
            if len(o) == 1 and _ND in o:
                dtype_str, shape, idx = o[_ND]
                dtype = np.dtype(dtype_str)
                if dtype.kind not in _ND_KINDS:
                    raise TypeError(f"refusing an array of dtype {dtype}")
                count = math.prod(shape)
                return np.frombuffer(data, dtype=dtype, count=count, offset=offsets[idx]).reshape(shape).copy()
            return {k: dec(v) for k, v in o.items()}
        if isinstance(o, list):
            return [dec(v) for v in o]
        return o

    return dec(head["body"])


def _error_reply(exc: BaseException) -> dict[str, Any]:
    reply: dict[str, Any] = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, AssetDownloadRefused):
        reply["asset"] = {"simulator": exc.simulator, "task": exc.task, "missing": list(exc.missing), "hint": exc.hint}
    elif isinstance(exc, ValueError):
        reply["type"] = "ValueError"  # pydantic's ValidationError et al. arrive as plain ValueErrors
    return reply


def _exit_with_parent(parent_pid: int) -> None:
    # Polling the parent pid works for "spawn" (parent = the service) and "forkserver" (parent = the
    # fork server, which exits with the service); an orphan is re-parented, so its ppid changes.
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def worker_main(conn: Connection, adapter_module: str, config_json: str) -> None:
    """Entry point of a session's worker: build the simulator, then serve reset/step/close."""
    # stdin can never block: multiprocessing already swaps sys.stdin for /dev/null; also point
    # fd 0 there so C code (or a library calling input() on fd 0) sees EOF, never a terminal.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    # Ctrl-C in a terminal signals the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One env per process on tiny tensors: extra intra-op threads only fight other sessions.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    # lavapipe (CPU Vulkan) rasterizes a 64x64 frame no faster on many threads; sessions are the
    # parallelism. Measured on 2 cores: two camera sessions 47 vs 41 env-steps/s with 1 thread.
    os.environ.setdefault("LP_NUM_THREADS", "1")

    # If the service dies while this worker is stuck inside the simulator (where a closed pipe is
    # never noticed), exit anyway.
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()

    def send(msg: dict[str, Any]) -> None:
        conn.send_bytes(pack_message(msg))

    adapter = None
    try:
        # The adapter's defining module registers it (e.g. a test-only adapter); the name comes from
        # the service's own registry, never from a client.
        if adapter_module not in ("__main__", "__mp_main__"):
            importlib.import_module(adapter_module)
        config = SimulatorConfig.model_validate_json(config_json)
        vector = config.num_envs > 1
        adapter = VectorSimulator(config) if vector else build_simulator(config)
        if "torch" in sys.modules:  # ManiSkill computes on tiny CPU tensors
            sys.modules["torch"].set_num_threads(1)
        spec = adapter.spec_dict() if vector else adapter.spec.to_dict()
        send({"ok": True, "result": {"spec": spec, "pid": os.getpid()}})
    except BaseException as exc:  # report, then exit: the parent reaps us
        try:
            send(_error_reply(exc))
        except OSError:
            pass
        return
    try:
        while True:
            try:
                msg = unpack_message(conn.recv_bytes())
            except (EOFError, OSError):  # the service went away
                break
            cmd = msg.get("cmd")
            if cmd == "close":
                send({"ok": True, "result": None})
                break
            try:
                if cmd == "reset" and vector:
                    result = adapter.reset(msg.get("slot"), msg.get("seed")).to_dict()
                elif cmd == "reset":
                    result = adapter.reset(msg.get("seed")).to_dict()
                elif cmd == "step_many" and vector:  # {slot: action} -> {slot: result}, keys as strings
                    stepped = adapter.step_many({int(k): a for k, a in msg["actions"].items()})
                    result = {str(k): v for k, v in stepped.items()}
                elif cmd == "renew":  # a warm worker taken by a new session of the same tenant
                    adapter.renew()
                    result = None
                elif cmd == "step" and not vector:
                    result = adapter.step(msg["action"]).to_dict()
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                send({"ok": True, "result": result})
            except Exception as exc:  # the simulator raised: report, keep serving
                send(_error_reply(exc))
    finally:
        # Leave at once, without closing the simulator: the process's exit frees it, while closing
        # costs CPU for nothing (ManiSkill's close runs gc.collect() per environment: 1.6 CPU s for
        # 8 PushCube scenes at every evaluation's end), and interpreter shutdown can wait on a
        # simulator's own non-daemon threads (seen with gym-pusht / pygame).
        os._exit(0)
