"""The tensor wire format: explicit dtype and shape, raw bytes, an allow-list of dtypes, no pickle."""

from __future__ import annotations

import base64
import pickle

import msgpack
import numpy as np
import pytest
from pydantic import ValidationError

from joynexus.protocol.wire import MAX_NDIM, Tensor, WireError, msgpack_dumps, msgpack_loads, tensor, wants_msgpack


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"])
def test_every_allowed_dtype_round_trips_through_json_and_msgpack(dtype):
    array = (np.arange(24).reshape(2, 3, 4) % 5).astype(dtype)
    t = tensor(array)
    assert (t.dtype, t.shape) == (dtype, [2, 3, 4])
    from_json = Tensor.model_validate_json(t.model_dump_json())
    from_msgpack = Tensor.model_validate(msgpack_loads(msgpack_dumps(t.model_dump())))
    for back in (from_json, from_msgpack):
        np.testing.assert_array_equal(back.to_numpy(), array)
        assert back.to_numpy().flags.writeable


def test_json_carries_base64_and_msgpack_raw_bytes():
    t = tensor(np.ones(3, np.float32))
    assert t.model_dump(mode="json")["data"] == base64.b64encode(np.ones(3, np.float32).tobytes()).decode()
    assert isinstance(t.model_dump()["data"], bytes)


def test_big_endian_and_non_contiguous_arrays_are_sent_little_endian_c_order():
    array = np.arange(12, dtype=">i4").reshape(3, 4).T
    np.testing.assert_array_equal(tensor(array).to_numpy(), array)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"dtype": "object", "shape": [1], "data": ""}, "dtype"),
        ({"dtype": "<f4", "shape": [1], "data": "AAAAAA=="}, "dtype"),
        ({"dtype": "float32", "shape": [2], "data": "AAAAAA=="}, "needs 8"),
        ({"dtype": "float32", "shape": [-1], "data": ""}, "greater than or equal to 0"),
        ({"dtype": "float32", "shape": [1] * (MAX_NDIM + 1), "data": "AAAAAA=="}, "at most 6"),
        ({"dtype": "float32", "shape": [1], "data": "not base64!"}, "base64"),
        ({"dtype": "float32", "shape": [1], "data": 12}, "expected base64"),
        ({"dtype": "float32", "shape": [1], "data": "AAAAAA==", "pickle": "x"}, "Extra inputs"),
    ],
)
def test_malformed_tensors_are_refused_with_the_reason(body, needle):
    with pytest.raises(ValidationError) as caught:
        Tensor.model_validate(body)
    assert needle in str(caught.value)


def test_pickled_bytes_never_become_an_object_array():
    evil = pickle.dumps(np.array([1, 2, 3]))
    with pytest.raises(ValidationError):  # the byte count does not match any declared shape
        Tensor.model_validate({"dtype": "float32", "shape": [3], "data": evil})
    t = Tensor.model_validate({"dtype": "uint8", "shape": [len(evil)], "data": evil})
    assert t.to_numpy().dtype == np.uint8  # just bytes, never unpickled


def test_object_arrays_cannot_be_sent():
    with pytest.raises(WireError):
        tensor(np.array([{"a": 1}], dtype=object))


def test_msgpack_ext_types_and_non_string_keys_are_refused():
    with pytest.raises(WireError, match="ext type"):
        msgpack_loads(msgpack.packb(msgpack.ExtType(5, b"x")))
    with pytest.raises(WireError, match="not valid msgpack"):
        msgpack_loads(msgpack.packb({1: 2}))
    with pytest.raises(WireError, match="not valid msgpack"):
        msgpack_loads(b"\xc1")


def test_accept_header_negotiation():
    assert wants_msgpack("application/msgpack")
    assert wants_msgpack("application/x-msgpack, application/json;q=0.5")
    assert not wants_msgpack("application/json, application/msgpack")
    assert not wants_msgpack(None)
