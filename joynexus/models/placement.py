"""Device placement of a service's tensors: which device and which backbone dtype (issue 12).

A service process holds ONE placement. Everything that computes lives on its device: the resident
backbone (in the placement's dtype), the tenants' action modules, LoRA adapters and AdamW state
(always float32: AdamW on bfloat16 weights loses small updates), and each microbatch's tensors.
Everything that leaves the process is device-independent: exports, checkpoints, `load_weights`
payloads and `tenant_state` copies are CPU tensors, predict results are numpy arrays. safetensors
records no device, so a checkpoint written on a GPU loads on a CPU and back; loading maps it onto the
service's device (`map_location`).

Settings: `device` is "auto" (cuda:0 when torch sees a CUDA device, else cpu), "cpu", "cuda" (the
current CUDA device) or "cuda:N"; `dtype` is the backbone's "float32" or "bfloat16"; `autocast`
runs a bfloat16 backbone's forward under `torch.autocast` (ops autocast keeps in float32, e.g.
softmax and norms, stay there). The placement is a small frozen config that travels to Ray actors as
an argument; whether its device exists is checked where it is used (`resolve()`, in the service's own
process): a driver without a GPU may configure an actor placed on a GPU node.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, field_validator

__all__ = [
    "DTYPES",
    "DevicePlacement",
    "PlacementError",
    "cpu_copy",
    "move_tensors",
    "tensor_devices",
]

# The backbone dtypes a placement may name, and the torch dtype of each.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DEVICE_RE = re.compile(r"auto|cpu|cuda(:(0|[1-9][0-9]*))?")


class PlacementError(ValueError):
    """A placement this process cannot honour (no CUDA, no such GPU); names the field and the value."""


class DevicePlacement(BaseModel):
    """Where a service computes: the device of every tensor it holds and the backbone's dtype."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = "auto"
    dtype: Literal["float32", "bfloat16"] = "float32"
    autocast: bool = True

    @field_validator("device", mode="before")
    @classmethod
    def _device_syntax(cls, value: Any) -> str:
        if isinstance(value, torch.device):
            value = str(value)
        if not isinstance(value, str) or not _DEVICE_RE.fullmatch(value.strip().lower()):
            raise ValueError(f"device: {value!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N' (N a GPU index)")
        return value.strip().lower()

    @classmethod
    def of(cls, value: DevicePlacement | Mapping[str, Any] | str | None) -> DevicePlacement:
        """A placement from what a caller passes: a placement, its fields, a device string, or None
        (`from_env`: what the environment configures, "auto" when it says nothing)."""
        if value is None:
            return cls.from_env()
        if isinstance(value, DevicePlacement):
            return value
        if isinstance(value, str | torch.device):
            return cls(device=str(value))
        return cls.model_validate(dict(value))

    @classmethod
    def from_env(cls) -> DevicePlacement:
        """The placement JOYNEXUS_DEVICE / JOYNEXUS_DTYPE / JOYNEXUS_AUTOCAST name (the variables
        `Settings` reads), so a service or benchmark built without one follows the configuration."""
        return cls(
            device=os.environ.get("JOYNEXUS_DEVICE", "auto"),
            dtype=os.environ.get("JOYNEXUS_DTYPE", "float32").strip().lower(),
            autocast=os.environ.get("JOYNEXUS_AUTOCAST", "1").strip().lower(),
        )

    @classmethod
    def from_settings(cls, settings: Any) -> DevicePlacement:
        """The placement `joynexus.settings.Settings` names (JOYNEXUS_DEVICE, JOYNEXUS_DTYPE, JOYNEXUS_AUTOCAST)."""
        return cls(device=settings.device, dtype=settings.dtype, autocast=settings.autocast)

    def resolve(self) -> torch.device:
        """The torch device in THIS process; raises PlacementError when it does not exist here."""
        if self.device == "auto":
            if torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cpu")
        if self.device == "cpu":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise PlacementError(
                f"device: {self.device!r} needs a CUDA device, but torch sees none in this process "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use 'cpu' or 'auto'"
            )
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if self.device == "cuda" else int(self.device.split(":", 1)[1])
        if index >= count:
            raise PlacementError(
                f"device: {self.device!r} names GPU {index}, but this process sees {count} CUDA "
                f"device{'s' if count != 1 else ''} (cuda:0..cuda:{count - 1})"
            )
        return torch.device("cuda", index)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The backbone's weight dtype."""
        return DTYPES[self.dtype]

    @property
    def uses_autocast(self) -> bool:
        """Autocast only changes anything for a reduced-precision backbone."""
        return self.autocast and self.dtype != "float32"

    def autocast_context(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """`torch.autocast` to the backbone dtype on `device` when `uses_autocast`, else a no-op."""
        if not self.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.torch_dtype)

    def describe(self, device: torch.device) -> dict[str, Any]:
        """What heartbeats and stats report: the configured and resolved device, dtype, autocast, GPU name."""
        return {
            "device": str(device),
            "device_setting": self.device,
            "dtype": self.dtype,
            "autocast": self.uses_autocast,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        }


def move_tensors(value: Any, device: torch.device | str, *, dtype: torch.dtype | None = None) -> Any:
    """`value` with every tensor in it (nested dicts, lists, tuples) moved to `device`; floating
    tensors also cast to `dtype` when given. Other values are returned as they are."""
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.is_floating_point():
            return value.to(device=device, dtype=dtype)
        return value.to(device)
    if isinstance(value, Mapping):
        return {key: move_tensors(item, device, dtype=dtype) for key, item in value.items()}
    if isinstance(value, list):
        return [move_tensors(item, device, dtype=dtype) for item in value]
    if isinstance(value, tuple):
        return tuple(move_tensors(item, device, dtype=dtype) for item in value)
    return value


def cpu_copy(value: Any) -> Any:
    """Detached CPU copies of every tensor in `value` (nested containers kept): what may leave a
    service. A copy even on the CPU, so the caller never aliases a live parameter."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {key: cpu_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [cpu_copy(item) for item in value]
    if isinstance(value, tuple):
        return tuple(cpu_copy(item) for item in value)
    return value


def tensor_devices(value: Any) -> Iterator[torch.device]:
    """The device of every tensor in `value` (nested containers): for checks that nothing leaves a
    service on an accelerator."""
    if isinstance(value, torch.Tensor):
        yield value.device
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensor_devices(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensor_devices(item)
