"""Request tensors against the tenant's schema, and service results back onto the wire.

Every check names the field, the expected shape and the received one, so a client can fix its
request; the gateway adds the tenant and schema annotations itself (a client never names a tenant).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from joynexus.api.errors import InvalidInput
from joynexus.core.tenants import Tenant
from joynexus.data.normalization import SIMULATOR_BOUNDS_SOURCE, Normalizer
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import Tensor

FLOAT_DTYPES = ("float16", "float32", "float64")
# Largest |value| of an observation's state: values near float32's limit (3e38) pass the cast but
# overflow in the first layer and come back as NaN actions. Generous for any robot's units (raw
# encoder ticks included); what still overflows inside a module is refused by predict (`finite_actions`).
MAX_ABS_STATE_VALUE = 1e9
IMAGE_DTYPES = ("uint8", *FLOAT_DTYPES)
MASK_DTYPES = ("bool", "uint8")


def checked_array(tensor: Tensor, field: str, shape: tuple[int, ...] | None, dtypes: tuple[str, ...]) -> np.ndarray:
    """The tensor as an array, refused unless its dtype is one of `dtypes`, its shape is `shape`
    (None: any) and its floats are finite."""
    if tensor.dtype not in dtypes:
        raise InvalidInput(f"{field}.dtype", f"{tensor.dtype!r} is not accepted here; use one of {list(dtypes)}")
    if shape is not None and tuple(tensor.shape) != shape:
        raise InvalidInput(f"{field}.shape", f"expected {shape}, got {tuple(tensor.shape)}")
    array = tensor.to_numpy()
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise InvalidInput(field, "holds NaN or infinite values")
    return array


def float_array(tensor: Tensor, field: str, shape: tuple[int, ...] | None) -> np.ndarray:
    """A float tensor as the float32 array the services compute in."""
    return to_float32(checked_array(tensor, field, shape, FLOAT_DTYPES), field)


def to_float32(array: np.ndarray, field: str) -> np.ndarray:
    """The float32 the services compute in; finite float64 values beyond float32's range would
    silently become inf in the cast (and NaN losses or actions later), so they are refused."""
    with np.errstate(over="ignore"):
        out = array.astype(np.float32)
    if out.size and not np.isfinite(out).all():
        limit = float(np.finfo(np.float32).max)
        raise InvalidInput(field, f"values overflow float32 (|x| > {limit:.8g}); send values within float32 range")
    return out


def sample_columns(tenant: Tenant, batch: s.SampleBatch, max_samples: int) -> dict[str, Any]:
    """Training columns (the Training Model Service's format) with this tenant's annotations."""
    cfg = tenant.backend_config
    images, state, instructions = observation_arrays(tenant, batch.images, batch.state, batch.instructions, max_samples)
    n = images.shape[0]
    action = float_array(batch.action, "action", (n, cfg.action_chunk, cfg.action_dim))
    if batch.action_is_pad is None:
        pad = np.zeros((n, cfg.action_chunk), dtype=bool)
    else:
        pad = checked_array(batch.action_is_pad, "action_is_pad", (n, cfg.action_chunk), MASK_DTYPES).astype(bool)
    normalizer = Normalizer.from_dict(cfg.normalization)
    if normalizer is not None and normalizer.source != SIMULATOR_BOUNDS_SOURCE:
        # Callers send dataset units, as predict returns them; the module learns normalized values.
        state, action = normalizer.normalize_state(state), normalizer.normalize_action(action)
    return {
        "images": images,
        "state": state,
        "action": action,
        "action_is_pad": pad,
        "task": instructions,
        "tenant_id": [tenant.tenant_id] * n,
        "schema_signature": [tenant.schema_signature] * n,
    }


def observation_arrays(
    tenant: Tenant, images_in: Tensor | None, state_in: Tensor, instructions_in: list[str] | None, max_samples: int
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(images, state, instructions) of N observations in the tenant's shapes; images as float32
    in [0, 1]. A state-only tenant sends no images: N comes from the state."""
    cfg = tenant.backend_config
    height, width = cfg.image_size
    cameras = len(cfg.cameras)
    if images_in is None:
        images_in = _no_camera_images(tenant, state_in, max_samples)
    if len(images_in.shape) != 5 or not images_in.shape[0]:
        raise InvalidInput(
            "images",
            f"expected shape (N, {cameras}, 3, {height}, {width}) [samples, cameras {list(cfg.cameras)}, "
            f"channels, height, width] with N >= 1, got {tuple(images_in.shape)}",
        )
    n = images_in.shape[0]
    if n > max_samples:
        raise InvalidInput("images", f"{n} samples, the limit per request is {max_samples}")
    images = checked_array(images_in, "images", (n, cameras, 3, height, width), IMAGE_DTYPES)
    images = images.astype(np.float32) / 255.0 if images.dtype == np.uint8 else to_float32(images, "images")
    if images.size and (images.min() < 0.0 or images.max() > 1.0):
        raise InvalidInput("images", "float images must lie in [0, 1] (or send uint8 in [0, 255])")
    state = float_array(state_in, "state", (n, cfg.state_dim))
    if state.size and float(np.abs(state).max()) > MAX_ABS_STATE_VALUE:
        sample, dim = (int(i) for i in np.unravel_index(int(np.abs(state).argmax()), state.shape))
        raise InvalidInput(
            "state",
            f"value {float(state[sample, dim]):.6g} at [{sample}, {dim}] is out of range: |x| must be at most "
            f"{MAX_ABS_STATE_VALUE:.0e}",
        )
    return images, state, _instructions(instructions_in, n, cfg.instruction)


def finite_actions(actions: np.ndarray) -> np.ndarray:
    """The actions a policy computed, refused (naming the observations' state) when some are not
    finite: the observation drove the module outside float32's range, and a robot must never get NaN."""
    flat = actions.reshape(actions.shape[0], -1) if actions.ndim else actions.reshape(1, -1)
    bad = np.flatnonzero(~np.isfinite(flat).all(axis=1))
    if bad.size:
        raise InvalidInput(
            "state",
            f"the policy's actions for samples {bad.tolist()[:8]} are not finite: their observation values are "
            "outside the range the action module computes in; send values in the units the tenant trained on",
        )
    return actions


def _no_camera_images(tenant: Tenant, state_in: Tensor, max_samples: int) -> Tensor:
    """Empty camera images for a request without any: refused unless the tenant has no camera."""
    cfg = tenant.backend_config
    height, width = cfg.image_size
    cameras = len(cfg.cameras)
    if cameras:
        raise InvalidInput(
            "images",
            f"required: your tenant has cameras {list(cfg.cameras)}; send shape (N, {cameras}, 3, {height}, {width})",
        )
    # A state-only tenant: N comes from the state, and every sample has no camera image.
    n = state_in.shape[0] if len(state_in.shape) == 2 else 0
    if not n:
        raise InvalidInput("state", f"expected shape (N, {cfg.state_dim}) with N >= 1, got {tuple(state_in.shape)}")
    if n > max_samples:
        raise InvalidInput("state", f"{n} samples, the limit per request is {max_samples}")
    return Tensor.from_numpy(np.zeros((n, 0, 3, height, width), dtype=np.float32))


def _instructions(instructions_in: list[str] | None, n: int, default: str) -> list[str]:
    """The request's instructions; omitted: the tenant's own instruction (spec
    `observation.instruction`) for every sample, as its rollouts and evaluations use it."""
    if instructions_in is None:
        return [default] * n
    if len(instructions_in) != n:
        raise InvalidInput("instructions", f"expected {n} strings (one per sample), got {len(instructions_in)}")
    long = [i for i, text in enumerate(instructions_in) if len(text) > s.MAX_INSTRUCTION_CHARS]
    if long:
        raise InvalidInput(f"instructions[{long[0]}]", f"longer than {s.MAX_INSTRUCTION_CHARS} characters")
    return list(instructions_in)


def to_wire(value: Any) -> Any:
    """Service results as JSON-able data with arrays as wire tensors (recursively)."""
    if isinstance(value, np.ndarray):
        return Tensor.from_numpy(value)
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return to_wire(value.to_dict())
    if isinstance(value, dict):
        return {str(k): to_wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_wire(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
