"""The canonical model-facing interface of a tenant (the paper's VLA schema / VLAFeature).

A schema names what the shared backbone and the tenant's action module see: the base model, the
camera slots and image size, the robot-state and action dimensions and the action-chunk length.
Its signature is a stable hash of that interface, so that two tenants (or two processes) with the
same interface always agree on it, whatever order the fields were written in.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SIGNATURE_VERSION = 1  # bump when the canonical form changes, so old and new signatures never collide


class VLASchema(BaseModel):
    """The model-facing interface of one tenant; instructions are data, not part of the interface."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_model_id: str
    cameras: tuple[str, ...]  # ordered: position i is canonical camera slot i; () for a state-only tenant
    image_size: tuple[int, int]  # (height, width) as the tenant's data provides it
    state_dim: int = Field(ge=0)
    action_dim: int = Field(ge=1)
    action_chunk: int = Field(ge=1)

    def canonical_form(self) -> dict[str, Any]:
        """A plain dict with only JSON types; the input to the signature."""
        return {
            "signature_version": SIGNATURE_VERSION,
            "base_model_id": self.base_model_id,
            "cameras": list(self.cameras),
            "image_size": [int(self.image_size[0]), int(self.image_size[1])],
            "state_dim": int(self.state_dim),
            "action_dim": int(self.action_dim),
            "action_chunk": int(self.action_chunk),
        }

    @property
    def signature(self) -> str:
        return schema_signature(self.canonical_form())


def schema_signature(canonical: dict[str, Any]) -> str:
    """sha256 over sorted-key compact JSON: independent of dict order, process and Python hash seed."""
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "vla1-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]
