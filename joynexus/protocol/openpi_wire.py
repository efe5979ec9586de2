"""The openpi policy-server wire format: msgpack with numpy arrays (openpi_client.msgpack_numpy).

openpi's packer turns an ndarray into the map ``{b"__ndarray__": True, b"data": <raw bytes>,
b"dtype": "<f4", b"shape": [..]}`` and a numpy scalar into ``{b"__npgeneric__": True, b"data":
<item>, b"dtype": "<f4"}``; everything else is plain msgpack. `pack` writes exactly that, so the
stock `openpi_client.msgpack_numpy.unpackb` reads our answers unchanged. `unpack` reads it without
openpi's ``np.dtype(client_string)``: a dtype string must name one of `wire.DTYPES` (little-endian,
no object or structured dtypes), bytes must match shape x itemsize, ext types are refused and
nothing is unpickled. Needs numpy and msgpack only (the client side needs no JoyNexus code at all).
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from joynexus.protocol.wire import DTYPES, MAX_DIM, MAX_ELEMENTS, MAX_NDIM, WireError, msgpack_loads

# openpi's dtype strings (`ndarray.dtype.str`: "<f4", "|u1", "|b1", ...) -> our allow-listed dtype.
OPENPI_DTYPES: dict[str, np.dtype] = {dtype.str: dtype for dtype in DTYPES.values()}
_ND, _NG = b"__ndarray__", b"__npgeneric__"


def _dtype(value: Any) -> np.dtype:
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    if not isinstance(text, str) or text not in OPENPI_DTYPES:
        raise WireError("dtype", f"{text!r} is not accepted; allowed: {sorted(OPENPI_DTYPES)}")
    return OPENPI_DTYPES[text]


def _array(obj: dict) -> np.ndarray:
    dtype = _dtype(obj.get(b"dtype"))
    shape, data = obj.get(b"shape"), obj.get(b"data")
    if not isinstance(shape, list | tuple) or len(shape) > MAX_NDIM:
        raise WireError("shape", f"expected a list of at most {MAX_NDIM} sizes, got {shape!r}")
    if not all(isinstance(n, int) and 0 <= n <= MAX_DIM for n in shape):
        raise WireError("shape", f"sizes must be integers in [0, {MAX_DIM}], got {list(shape)}")
    elements = math.prod(shape)
    if elements > MAX_ELEMENTS:
        raise WireError("shape", f"{list(shape)} has {elements} elements, the limit is {MAX_ELEMENTS}")
    if not isinstance(data, bytes) or len(data) != elements * dtype.itemsize:
        got = len(data) if isinstance(data, bytes) else type(data).__name__
        raise WireError(
            "data", f"{got} bytes, but dtype {dtype.str} with shape {list(shape)} needs {elements * dtype.itemsize}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def _object_hook(obj: dict) -> Any:
    if obj.get(_ND) is True:
        return _array(obj)
    if obj.get(_NG) is True:
        value = obj.get(b"data")
        if not isinstance(value, int | float | bool):
            raise WireError("data", f"a numpy scalar holds a number, got {type(value).__name__}")
        return _dtype(obj.get(b"dtype")).type(value)
    return obj


def unpack(data: bytes) -> Any:
    """One openpi message decoded (numpy arrays restored through the dtype allow-list)."""
    return msgpack_loads(data, object_hook=_object_hook)


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind in "VOc":
            raise TypeError(f"dtype {obj.dtype} cannot cross the openpi wire")
        return {_ND: True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {_NG: True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot pack {type(obj).__name__}")


def pack(obj: Any) -> bytes:
    """msgpack as openpi's `Packer` writes it (what `openpi_client.msgpack_numpy.unpackb` reads)."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)


__all__ = ["OPENPI_DTYPES", "pack", "unpack"]
