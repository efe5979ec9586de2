"""The schema signature: same interface -> same signature in any process and field order."""

from __future__ import annotations

import json
import subprocess
import sys

from joynexus.schema import VLASchema, schema_signature

FIELDS = {
    "base_model_id": "joynexus/tiny-smolvlm",
    "cameras": ["front", "wrist"],
    "image_size": [32, 48],
    "state_dim": 6,
    "action_dim": 7,
    "action_chunk": 4,
}


def test_signature_ignores_field_order():
    forward = VLASchema.model_validate(FIELDS)
    backward = VLASchema.model_validate(dict(reversed(list(FIELDS.items()))))
    assert forward.signature == backward.signature
    assert schema_signature({"a": 1, "b": 2}) == schema_signature({"b": 2, "a": 1})


def test_signature_is_the_same_in_another_process():
    code = (
        "import json,sys; from joynexus.schema import VLASchema; "
        "print(VLASchema.model_validate(json.loads(sys.argv[1])).signature)"
    )
    # A different hash seed would expose any dependence on Python's randomized hash().
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(FIELDS)],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout.strip()
    assert out == VLASchema.model_validate(FIELDS).signature


def test_every_interface_field_changes_the_signature():
    base = VLASchema.model_validate(FIELDS).signature
    changes = {
        "base_model_id": "other/model",
        "cameras": ["wrist", "front"],  # order is the slot assignment
        "image_size": [48, 32],
        "state_dim": 5,
        "action_dim": 6,
        "action_chunk": 8,
    }
    seen = {base}
    for field, value in changes.items():
        sig = VLASchema.model_validate({**FIELDS, field: value}).signature
        assert sig not in seen, field
        seen.add(sig)
