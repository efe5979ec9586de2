"""Tensors on the wire: explicit dtype and shape, raw little-endian bytes, never pickle.

A tensor travels as ``{"dtype": "float32", "shape": [2, 7], "data": ...}``. In a JSON body ``data``
is the base64 of the raw little-endian bytes; in a msgpack body (``Content-Type:
application/msgpack``) it is a msgpack ``bin`` holding those bytes, so a batch of images crosses
the wire without the base64 overhead. Module payloads (export, load_weights) are safetensors bytes
in the same kind of field. Nothing here ever unpickles: a tensor is `numpy.frombuffer` over bytes
whose length must equal ``prod(shape) * itemsize`` for a dtype from a fixed allow-list.

Both the server (`joynexus.api.app`) and the client (`joynexus.client`) use this module; it needs
only numpy, pydantic and msgpack.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Annotated, Any, Literal

import msgpack
import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, WithJsonSchema, model_validator

JSON_MEDIA_TYPE = "application/json"
MSGPACK_MEDIA_TYPE = "application/msgpack"
MSGPACK_MEDIA_TYPES = frozenset({MSGPACK_MEDIA_TYPE, "application/x-msgpack", "application/vnd.msgpack"})
SAFETENSORS_MEDIA_TYPE = "application/octet-stream"

# The only dtypes a client may send or receive, always little-endian. Mapping a name through this
# table (never `np.dtype(client_string)`) is what keeps object and structured dtypes out.
DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype("?"),
    "uint8": np.dtype("<u1"),
    "int8": np.dtype("<i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
DTypeName = Literal["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]

MAX_NDIM = 6
MAX_DIM = 1 << 20
MAX_ELEMENTS = 1 << 27  # 128 Mi elements; the request-size cap usually binds first


class WireError(ValueError):
    """Bytes or a tensor that do not follow the wire format; `field` names where."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def _to_bytes(value: Any) -> bytes:
    """Raw bytes from msgpack (bin) or JSON (base64 text); anything else is rejected."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as error:
            raise ValueError(f"not valid base64 ({error})") from None
    raise ValueError(f"expected base64 text (JSON) or bytes (msgpack), got {type(value).__name__}")


# bytes in Python and msgpack, base64 text in JSON (and so in the OpenAPI schema).
WireBytes = Annotated[
    bytes,
    BeforeValidator(_to_bytes),
    PlainSerializer(lambda data: base64.b64encode(data).decode("ascii"), return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "contentEncoding": "base64", "description": "base64 (JSON) or bin (msgpack)"}),
]


class Tensor(BaseModel):
    """One n-d array: dtype from the allow-list, shape, raw little-endian bytes (C order)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: DTypeName
    shape: list[Annotated[int, Field(ge=0, le=MAX_DIM)]] = Field(max_length=MAX_NDIM)
    data: WireBytes

    @model_validator(mode="after")
    def _bytes_match_shape(self) -> Tensor:
        elements = math.prod(self.shape)
        if elements > MAX_ELEMENTS:
            raise ValueError(f"shape {self.shape} has {elements} elements, the limit is {MAX_ELEMENTS}")
        expected = elements * DTYPES[self.dtype].itemsize
        if len(self.data) != expected:
            raise ValueError(
                f"data has {len(self.data)} bytes, but dtype {self.dtype} with shape {self.shape} needs {expected}"
            )
        return self

    def to_numpy(self) -> np.ndarray:
        """A writable array in native byte order (a copy: the request buffer is not kept alive)."""
        array = np.frombuffer(self.data, dtype=DTYPES[self.dtype]).reshape(self.shape)
        return array.astype(array.dtype.newbyteorder("="), copy=True)

    @classmethod
    def from_numpy(cls, array: Any) -> Tensor:
        array = np.asarray(array)
        name = _dtype_name(array.dtype)
        if name is None:
            raise WireError("tensor", f"dtype {array.dtype} cannot cross the wire; allowed: {sorted(DTYPES)}")
        little = np.ascontiguousarray(array, dtype=DTYPES[name])
        return cls(dtype=name, shape=list(little.shape), data=little.tobytes())

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def __repr_args__(self) -> list[tuple[str, Any]]:
        # dtype, shape and size, never the raw bytes (a PredictResult's repr stays one readable line).
        return [("dtype", self.dtype), ("shape", self.shape), ("nbytes", len(self.data))]


def _dtype_name(dtype: np.dtype) -> str | None:
    for name, allowed in DTYPES.items():
        if dtype.kind == allowed.kind and dtype.itemsize == allowed.itemsize:
            return name
    return None


def tensor(array: Any) -> Tensor:
    """Shorthand for `Tensor.from_numpy` (numpy arrays, torch CPU tensors, nested lists)."""
    if hasattr(array, "detach"):  # a torch tensor, without importing torch here
        array = array.detach().cpu().numpy()
    return Tensor.from_numpy(array)


TensorKind = Literal["float", "image", "bool", "int"]


def as_tensor(value: Any, field: str, kind: TensorKind) -> Tensor:
    """A request tensor from what a caller has at hand, for a field that expects `kind`.

    A `Tensor`, a numpy array or a torch tensor keeps its dtype (the server says which dtypes a
    field accepts). Plain Python numbers and (nested, rectangular) lists or tuples of them get the
    dtype the field expects, so nothing is guessed: ``"float"`` -> float32; ``"image"`` -> uint8
    when every value is an integer in [0, 255], else float32 (in [0, 1]); ``"bool"`` -> bool (from
    bools, or integers 0 / 1); ``"int"`` -> int64 (integers only, never silently truncated floats).
    Anything else raises a `WireError` naming `field`.
    """
    if isinstance(value, Tensor):
        return value
    if hasattr(value, "detach") or isinstance(value, np.ndarray | np.generic):
        try:
            return tensor(value)
        except WireError as error:
            raise WireError(field, error.reason) from None
    if not isinstance(value, list | tuple | int | float | bool):
        raise WireError(
            field, f"expected a numpy array, a torch tensor or nested lists of numbers, got {type(value).__name__}"
        )
    try:
        array = np.asarray(value)
    except ValueError as error:  # ragged nesting: lists of different lengths at one depth
        raise WireError(field, f"nested lists must be rectangular (equal lengths at each depth): {error}") from None
    if array.dtype.kind not in "biuf":
        raise WireError(field, f"expected numbers, got {array.dtype.kind!r}-kind values ({array.dtype})")
    if kind == "float" or (kind == "image" and array.dtype.kind == "f"):
        return tensor(array.astype(np.float32))
    if kind == "image":
        if array.size and (array.min() < 0 or array.max() > 255):
            raise WireError(field, "integer images are uint8: every value in [0, 255] (or send floats in [0, 1])")
        return tensor(array.astype(np.uint8))
    if kind == "bool":
        if array.dtype.kind == "f" or (array.size and not np.isin(array, (0, 1)).all()):
            raise WireError(field, "expected booleans (True / False, or 0 / 1)")
        return tensor(array.astype(bool))
    if kind == "int":
        if array.dtype.kind == "f":
            raise WireError(field, "expected integers, got floats")
        return tensor(array.astype(np.int64))
    raise WireError(field, f"unknown tensor kind {kind!r}")


# -- msgpack bodies ----------------------------------------------------------------------------


def msgpack_dumps(obj: Any) -> bytes:
    """msgpack with bin for bytes and str for text (what `msgpack_loads` expects)."""
    return msgpack.packb(obj, use_bin_type=True)


def msgpack_loads(data: bytes, object_hook: Any = None) -> Any:
    """Decode a msgpack body: str map keys only, ext types refused, nothing unpickled;
    `object_hook` (e.g. openpi's numpy-array maps) sees each decoded map."""

    def refuse_ext(code: int, _payload: bytes) -> Any:
        raise WireError("body", f"msgpack ext type {code} is not accepted")

    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, ext_hook=refuse_ext, object_hook=object_hook
        )
    except WireError:
        raise
    except (ValueError, TypeError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError) as error:
        raise WireError("body", f"not valid msgpack ({type(error).__name__}: {error})") from None
    except msgpack.exceptions.StackError:
        raise WireError("body", "msgpack nesting is too deep") from None


def wants_msgpack(accept_header: str | None) -> bool:
    """True when the Accept header names a msgpack media type before (or without) JSON."""
    if not accept_header:
        return False
    for part in accept_header.split(","):
        media = part.split(";")[0].strip().lower()
        if media in MSGPACK_MEDIA_TYPES:
            return True
        if media == JSON_MEDIA_TYPE:
            return False
    return False
