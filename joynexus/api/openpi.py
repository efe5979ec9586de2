"""OpenPI-compatible serving: ``/v1/openpi`` speaks the openpi policy-server protocol, so a stock
`openpi_client.websocket_client_policy.WebsocketClientPolicy` drives a tenant's policy unchanged.

The protocol (openpi's `serving/websocket_policy_server.py`): on connect the server sends its
metadata (one msgpack map); then each client message is an observation dict and each answer a dict
with ``"actions"``. Arrays travel in openpi's msgpack-numpy form (`protocol.openpi_wire`). An error
is a TEXT frame (openpi's client raises ``RuntimeError("Error in inference server:\\n<text>")``);
unlike openpi's server ours keeps the connection open after a bad observation.

The same server also answers at ``/`` (`OPENPI_DEFAULT_PATH`), where openpi's own example form
``WebsocketClientPolicy(host="<server>", port=8765)`` connects (it appends no path).

Authentication: the tenant's API key as ``Authorization: Api-Key <key>`` (what
``WebsocketClientPolicy(..., api_key=key)`` sends) or ``Bearer <key>``. A connection without one is
refused at once: an openpi client waits for the metadata and sends nothing first, so waiting for a
hello frame (as `/v1/stream` does) only delayed its refusal by `auth_timeout_s`. Refusals close
with 1008 before any metadata. The limits
are `/v1/stream`'s (`StreamSettings`): frame size, the connection count per tenant (shared with
/v1/stream), auth and request timeouts; a connection has one request in flight (openpi's protocol
is request / answer). Every request goes through the gateway's predict, i.e. the shared Inference
Queue, group-batched with every other robot's and tenant's.

Observation (one sample, openpi's convention)::

    {"images": {"<camera>": uint8 (H, W, 3) or (3, H, W), or float in [0, 1]},   # every tenant camera
     "state": float (state_dim,),                    # also "observation/state"
     "prompt": str (optional: the tenant's instruction),
     "policy_version": int (optional: pin a served version), "seed": int (optional: flow-matching draws)}

Camera images may also come as flat keys ``"observation/images/<camera>"``. Answer::

    {"actions": float32 (action_chunk, action_dim), "policy_version": int, "batch_samples": int,
     "server_timing": {"infer_ms": float}}
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio.to_thread
import numpy as np
from fastapi import APIRouter, WebSocket
from pydantic import ValidationError

from joynexus.actors import role_unavailable_errors
from joynexus.api.abandoned import keyed_predict
from joynexus.api.auth import Principal
from joynexus.api.errors import ApiError, role_away, validation_problems
from joynexus.api.streaming import CLOSE_POLICY, PolicyStream, _Refused, tenant_interface
from joynexus.core.tenants import TenantBackendConfig
from joynexus.protocol import openpi_wire
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import tensor

OPENPI_PATH = "/v1/openpi"
OPENPI_DEFAULT_PATH = "/"  # where WebsocketClientPolicy(host=, port=) connects
MISSING_KEY = (  # a close reason: at most 120 bytes
    "missing API key: pass WebsocketClientPolicy(..., api_key=<tenant key>) (header 'Authorization: Api-Key <key>')"
)
_IMAGE_PREFIXES = ("observation/images/", "images/")
_KNOWN = {"images", "state", "observation/state", "prompt", "policy_version", "seed"}


class ObservationError(ValueError):
    """An openpi observation that does not fit the tenant: `field` names the key."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def server_metadata(cfg: TenantBackendConfig, limits: dict[str, Any]) -> dict[str, Any]:
    """What a client reads on connect (`WebsocketClientPolicy.get_server_metadata()`)."""
    return {
        "server": "joynexus",
        "protocol": "openpi",
        **tenant_interface(cfg),
        "observation_keys": {
            "images": {c: [cfg.image_size[0], cfg.image_size[1], 3] for c in cfg.cameras},
            "state": [cfg.state_dim],
            "prompt": "str (optional)",
        },
        "limits": limits,
    }


def _image(value: Any, camera: str, size: tuple[int, int]) -> np.ndarray:
    field = f"images.{camera}"
    if not isinstance(value, np.ndarray):
        raise ObservationError(field, f"expected a numpy array, got {type(value).__name__}")
    height, width = size
    if value.shape == (height, width, 3):
        value = value.transpose(2, 0, 1)  # openpi's HWC -> our CHW
    elif value.shape != (3, height, width):
        raise ObservationError(
            field, f"expected shape ({height}, {width}, 3) or (3, {height}, {width}), got {value.shape}"
        )
    if value.dtype == np.uint8:
        return value
    if value.dtype.kind != "f":
        raise ObservationError(field, f"expected uint8, or floats in [0, 1]; got {value.dtype}")
    return value.astype(np.float32)


def _images(obs: dict[str, Any], cfg: TenantBackendConfig) -> np.ndarray | None:
    given: dict[str, Any] = {}
    nested = obs.get("images")
    if nested is not None:
        if not isinstance(nested, dict):
            raise ObservationError("images", f"expected a map of camera name -> array, got {type(nested).__name__}")
        given.update(nested)
    for key, value in obs.items():
        for prefix in _IMAGE_PREFIXES:
            if isinstance(key, str) and key.startswith(prefix):
                given[key[len(prefix) :]] = value
    unknown = sorted(str(k) for k in given if k not in cfg.cameras)
    if unknown:
        raise ObservationError("images", f"unknown cameras {unknown}; the tenant's cameras are {list(cfg.cameras)}")
    missing = [c for c in cfg.cameras if c not in given]
    if missing:
        raise ObservationError(f"images.{missing[0]}", f"missing; the tenant's cameras are {list(cfg.cameras)}")
    if not cfg.cameras:
        return None
    frames = [_image(given[c], c, tuple(cfg.image_size)) for c in cfg.cameras]
    if any(f.dtype != np.uint8 for f in frames):  # one dtype for the batch: floats in [0, 1]
        frames = [f.astype(np.float32) / 255.0 if f.dtype == np.uint8 else f for f in frames]
    return np.stack(frames)[None]


def predict_request(obs: Any, cfg: TenantBackendConfig, timeout_s: float) -> s.PredictRequest:
    """One openpi observation as a predict request of the tenant (checked against its schema)."""
    if not isinstance(obs, dict):
        raise ObservationError("observation", f"expected a map of keys -> values, got {type(obs).__name__}")
    extra = sorted(str(k) for k in obs if k not in _KNOWN and not str(k).startswith(_IMAGE_PREFIXES))
    if extra:
        raise ObservationError("observation", f"unknown keys {extra}; expected {sorted(_KNOWN)}")
    state = obs.get("state", obs.get("observation/state"))
    if not isinstance(state, np.ndarray):
        raise ObservationError(
            "state", f"expected a numpy array of shape ({cfg.state_dim},), got {type(state).__name__}"
        )
    if state.shape != (cfg.state_dim,):
        raise ObservationError("state", f"expected shape ({cfg.state_dim},), got {state.shape}")
    if state.dtype.kind not in "fiu":
        raise ObservationError("state", f"expected numbers, got {state.dtype}")
    prompt = obs.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise ObservationError("prompt", f"expected a string, got {type(prompt).__name__}")
    version, seed = obs.get("policy_version"), obs.get("seed")
    for name, value in (("policy_version", version), ("seed", seed)):
        if value is not None and (not isinstance(value, int | np.integer) or value < 0):
            raise ObservationError(name, f"expected a non-negative integer, got {value!r}")
    images = _images(obs, cfg)
    return s.PredictRequest(
        observations=s.ObservationBatch(
            images=tensor(images) if images is not None else None,
            state=tensor(state.astype(np.float32)[None]),
            instructions=[prompt] if prompt else None,
        ),
        policy_version=None if version is None else int(version),
        seeds=None if seed is None else [int(seed)],
        timeout_s=timeout_s,
    )


def _error_text(error: ApiError) -> str:
    """openpi's error frame: text, with the problems and (429, 503) the retry delay."""
    details = "; ".join(f"{f}: {r}" for f, r in error.problems[:5])
    retry = (error.headers or {}).get("Retry-After")
    return (
        f"{error.code}: {error.message}"
        + (f" ({details})" if details else "")
        + (f" [retry after {retry} s]" if retry else "")
    )


class OpenPiStream(PolicyStream):
    """`/v1/openpi`: `PolicyStream`'s connection handling (auth, per-tenant connection limit, frame
    limit, close codes) with openpi's messages. One instance per app."""

    auth_schemes = ("bearer", "api-key")

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_websocket_route(OPENPI_PATH, self.serve, name="openpi_policy_server")
        router.add_api_websocket_route(OPENPI_DEFAULT_PATH, self.serve, name="openpi_policy_server_default_path")
        return router

    async def _authenticate(self, websocket: WebSocket) -> Principal:
        if websocket.headers.get("authorization") is None:
            raise _Refused(CLOSE_POLICY, MISSING_KEY)
        return await super()._authenticate(websocket)

    def _decode(self, data: bytes) -> Any:
        return openpi_wire.unpack(data)

    async def _session(self, websocket: WebSocket, tenant_id: str) -> None:
        try:
            tenant = await anyio.to_thread.run_sync(self.gateway.tenant, tenant_id)
        except ApiError as error:
            raise _Refused(CLOSE_POLICY, error.message) from None
        cfg = tenant.backend_config
        limits = {
            "max_frame_bytes": self.settings.max_frame_bytes,
            "max_connections_per_tenant": self.settings.max_connections_per_tenant,
            "request_timeout_s": self.settings.request_timeout_s,
        }
        await websocket.send_bytes(openpi_wire.pack(server_metadata(cfg, limits)))
        next_frame: asyncio.Task | None = None
        try:
            while True:
                next_frame = next_frame or asyncio.ensure_future(self._receive_frame(websocket))
                obs = await next_frame
                next_frame = None
                if obs.get("type") == "hello":  # authenticated by header already
                    continue
                # openpi is request / answer, but the socket is read meanwhile: a robot that hangs
                # up while its request waits in the Inference Queue has the request called off at
                # once (a frame sent early is kept for its turn).
                answering = asyncio.ensure_future(self._answer_openpi(tenant_id, cfg, obs))
                next_frame = asyncio.ensure_future(self._receive_frame(websocket))
                await asyncio.wait({answering, next_frame}, return_when=asyncio.FIRST_COMPLETED)
                if next_frame.done() and next_frame.exception() is not None and not answering.done():
                    answering.cancel()  # hung up (or a frame refused): nobody to answer
                    raise next_frame.exception()
                answer = await answering
                if isinstance(answer, str):
                    await websocket.send_text(answer)
                else:
                    await websocket.send_bytes(openpi_wire.pack(answer))
        finally:
            if next_frame is not None and not next_frame.done():
                next_frame.cancel()

    async def _answer_openpi(self, tenant_id: str, cfg: TenantBackendConfig, obs: dict) -> dict | str:
        """The answer map, or the error text (openpi's error frame is text)."""
        started = time.perf_counter()
        try:
            request = predict_request(obs, cfg, self.settings.request_timeout_s)
            samples = request.observations.state.shape[0] if request.observations.state.shape else 0
            result = await keyed_predict(self.limiter, self.gateway, tenant_id, request, samples)
        except ObservationError as error:
            return f"invalid_input: {error.field}: {error.reason}"
        except ValidationError as error:
            problems = [(p.field, p.reason) for p in validation_problems(list(error.errors()), ())]
            return "invalid_input: " + "; ".join(f"{f}: {r}" for f, r in problems[:5])
        except ApiError as error:
            return _error_text(error)
        except role_unavailable_errors() as error:  # as HTTP answers it: 503-like, never `internal`
            return _error_text(role_away(error, self.role_follower))
        return {
            "actions": result.actions.to_numpy()[0],
            "policy_version": result.policy_version,
            "batch_samples": result.batch_samples,
            "server_timing": {"infer_ms": (time.perf_counter() - started) * 1000.0},
        }


__all__ = [
    "OPENPI_DEFAULT_PATH", "OPENPI_PATH", "ObservationError", "OpenPiStream", "predict_request", "server_metadata",
]  # fmt: skip
