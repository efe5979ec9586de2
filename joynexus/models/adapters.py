"""Tenant-private LoRA adapters on the shared, frozen backbone (through peft).

A tenant may own, beside its action module, a LoRA adapter on the backbone's text model (the Llama
decoder of Idefics3 / SmolVLM). The backbone's weights stay ONE shared, frozen copy: peft wraps each
targeted ``nn.Linear`` once (a ``LoraLayer``) and keeps every tenant's low-rank pair in that
wrapper's ``ModuleDict``s under its own adapter name. A batch mixing tenants runs in ONE forward:
peft's mixed-batch path (``adapter_names=[one name per sample]``, ``"__base__"`` for samples without
an adapter) computes the frozen projection over the whole batch once and adds each adapter's
``B(A(x)) * alpha / r`` to its own samples' rows only. Samples are independent in the decoder
(per-sample attention, per-token norms and MLPs), so a sample's features are the same whichever
other tenants share its batch.

``BackboneAdapters`` is the one owner of that state on a backbone: it injects adapters
(``peft.functional.inject_adapter_in_model``) under internal names (tenant ids may hold ``.``, which
a ``ModuleDict`` key can not), reads and writes their tensors in peft's own key format (the keys of
``get_peft_model_state_dict``: ``layers.0.self_attn.q_proj.lora_A.weight``), deletes them, and routes
a forward (``routing``): forward pre-hooks on every ``LoraLayer`` pass ``adapter_names``, which is
what ``LoraModel`` itself does for ``PeftModel.forward(..., adapter_names=...)``. The inactive set
of every layer is kept empty, so a forward that is not routed is the base model.

Only vanilla LoRA without dropout: the backbone runs in eval mode (dropout would be silently off)
and grouped training must equal per-tenant training sample for sample.
"""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, Literal

import pydantic
import torch
from peft import LoraConfig
from peft.functional import delete_adapter, inject_adapter_in_model, set_adapter
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import cast_adapter_dtype
from torch import nn

__all__ = [
    "ADAPTER_TENSOR_PREFIX",
    "BASE_ADAPTER",
    "MAX_LORA_RANK",
    "BackboneAdapters",
    "LoraAdapterConfig",
    "join_tenant_state",
    "linear_module_names",
    "split_tenant_state",
]

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed batch
MAX_LORA_RANK = 64
# A tenant's state dict (what is versioned, checkpointed and exported) is its action module's
# tensors under their own names plus the adapter's under this prefix; "/" never occurs in a module
# attribute path, so the two can not collide, and a tenant without an adapter has exactly its
# module's keys (as before adapters existed).
ADAPTER_TENSOR_PREFIX = "adapter/"
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


class LoraAdapterConfig(pydantic.BaseModel):
    """A tenant's LoRA adapter as the backend builds it (compiled from the spec's `adapter`)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    kind: Literal["lora"] = "lora"
    rank: int = pydantic.Field(default=8, ge=1, le=MAX_LORA_RANK)
    alpha: float = pydantic.Field(default=16.0, gt=0, le=4096)
    target_modules: tuple[str, ...] = pydantic.Field(default=("q_proj", "v_proj"), min_length=1, max_length=16)
    dropout: float = 0.0

    @pydantic.field_validator("target_modules")
    @classmethod
    def _targets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not _NAME_RE.fullmatch(name):
                raise ValueError(f"target module {name!r} is not a module name (letters, digits, _)")
        if len(set(value)) != len(value):
            raise ValueError(f"target modules must be unique, got {list(value)}")
        return tuple(sorted(value))  # one canonical order: configs compare and serialise equal

    @pydantic.field_validator("dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError(
                f"{value} is not supported: only 0.0 (the shared backbone runs in eval mode, and a tenant's "
                "grouped and per-tenant steps must be equal)"
            )
        return 0.0

    def peft_config(self, base_model_name_or_path: str | None = None, *, inference_mode: bool = False) -> LoraConfig:
        """The equivalent peft ``LoraConfig`` (vanilla LoRA, no bias, no dropout)."""
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=list(self.target_modules),
            lora_dropout=0.0,
            bias="none",
            base_model_name_or_path=base_model_name_or_path,
            inference_mode=inference_mode,
        )


def linear_module_names(model: nn.Module) -> list[str]:
    """Leaf names of the ``nn.Linear`` layers of ``model`` (what ``target_modules`` may name), sorted.
    Layers peft already wrapped count by their own name (not their ``base_layer`` / ``lora_*`` parts)."""
    names = set()
    for path, module in model.named_modules():
        parts = path.split(".")
        if not path or "base_layer" in parts or any(part.startswith("lora_") for part in parts):
            continue
        base = module.get_base_layer() if isinstance(module, LoraLayer) else module
        if isinstance(base, nn.Linear):
            names.add(parts[-1])
    return sorted(names)


def split_tenant_state(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A tenant state dict -> (action-module tensors, adapter tensors in peft key format)."""
    module: dict[str, torch.Tensor] = {}
    adapter: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.startswith(ADAPTER_TENSOR_PREFIX):
            adapter[key[len(ADAPTER_TENSOR_PREFIX) :]] = value
        else:
            module[key] = value
    return module, adapter


def join_tenant_state(
    module: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`split_tenant_state`."""
    out = dict(module)
    for key, value in (adapter or {}).items():
        out[ADAPTER_TENSOR_PREFIX + key] = value
    return out


def _pre_forward_hook(
    target: nn.Module, args: tuple, kwargs: dict[str, Any], adapter_names: list[str]
) -> tuple[tuple, dict[str, Any]]:
    kwargs["adapter_names"] = adapter_names
    return args, kwargs


class BackboneAdapters:
    """The LoRA adapters injected into one model (a backbone's text model), keyed by any hashable
    (a tenant id in the Training Model Service, a served (tenant, version) in the Inference Model
    Service). Every method takes ``lock``, which the backbone also holds for a whole forward, so an
    adapter is never added or removed while a forward runs."""

    def __init__(self, model: nn.Module, lock: threading.RLock | None = None) -> None:
        self.model = model
        self.lock = lock if lock is not None else threading.RLock()
        self._names: dict[Hashable, str] = {}  # key -> peft adapter name
        self._configs: dict[Hashable, LoraAdapterConfig] = {}
        self._trainable: dict[Hashable, bool] = {}
        self._counter = 0
        self._targets = set(linear_module_names(model))

    # -- registry -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._names

    def keys(self) -> list[Hashable]:
        return list(self._names)

    def config(self, key: Hashable) -> LoraAdapterConfig:
        return self._configs[self._check(key)]

    def target_modules(self) -> list[str]:
        return sorted(self._targets)

    def _check(self, key: Hashable) -> Hashable:
        if key not in self._names:
            raise KeyError(f"no LoRA adapter {key!r} on this backbone (present: {len(self._names)})")
        return key

    def add(
        self,
        key: Hashable,
        config: LoraAdapterConfig | Mapping[str, Any],
        *,
        state: Mapping[str, torch.Tensor] | None = None,
        seed: int | None = None,
        trainable: bool = False,
    ) -> None:
        """Inject a LoRA adapter for ``key``: peft's initialization (A Kaiming-uniform, B zero, so a
        fresh adapter leaves the features unchanged) drawn from ``seed`` on a private RNG stream,
        then ``state`` if given (strictly: the keys and shapes of this config)."""
        config = config if isinstance(config, LoraAdapterConfig) else LoraAdapterConfig.model_validate(config)
        missing = sorted(set(config.target_modules) - self._targets)
        if missing:
            raise ValueError(
                f"adapter.target_modules: {missing} are not Linear layers of the backbone's text model; "
                f"choose from {sorted(self._targets)}"
            )
        with self.lock:
            if key in self._names:
                raise ValueError(f"LoRA adapter {key!r} already exists on this backbone")
            self._counter += 1
            name = f"jx_adapter_{self._counter}"
            with contextlib.ExitStack() as stack:
                stack.enter_context(warnings.catch_warnings())
                # peft warns that a second adapter is added to a model: that is the point here.
                warnings.simplefilter("ignore")
                if seed is not None:
                    stack.enter_context(torch.random.fork_rng(devices=[]))
                    torch.manual_seed(seed)
                inject_adapter_in_model(config.peft_config(), self.model, adapter_name=name)
            # peft makes the adapter in its base layer's dtype; on a bfloat16 backbone keep it float32,
            # as PeftModel does (autocast_adapter_dtype): AdamW steps on bfloat16 weights lose updates.
            cast_adapter_dtype(self.model, adapter_name=name, autocast_adapter_dtype=True)
            self._names[key] = name
            self._configs[key] = config
            self._trainable[key] = trainable
            self._deactivate()
            if state is not None:
                try:
                    self.load_state_dict(key, state)
                except Exception:
                    self.remove(key)
                    raise

    def _deactivate(self) -> None:
        """No adapter is "active" (an unrouted forward is the base model); set_adapter also turns
        requires_grad off everywhere, so the trainable adapters get it back."""
        set_adapter(self.model, [], inference_mode=True)
        for key, trainable in self._trainable.items():
            for param in self.parameters(key):
                param.requires_grad_(trainable)

    def remove(self, key: Hashable) -> bool:
        """Delete ``key``'s adapter from every layer; False if there was none."""
        with self.lock:
            name = self._names.pop(key, None)
            if name is None:
                return False
            self._configs.pop(key, None)
            self._trainable.pop(key, None)
            delete_adapter(self.model, adapter_name=name, prefix="lora_", layer_cls=LoraLayer)
            configs = getattr(self.model, "peft_config", None)
            if isinstance(configs, dict):
                configs.pop(name, None)
            self._deactivate()
            return True

    # -- tensors --------------------------------------------------------------------------
    def _named_parameters(self, key: Hashable) -> Iterator[tuple[str, nn.Parameter]]:
        """(peft key, parameter) of one adapter, in the model's module order."""
        name = self._names[self._check(key)]
        marker = f".{name}."
        for path, param in self.model.named_parameters():
            if marker in path:
                yield path.replace(marker, "."), param

    def parameters(self, key: Hashable) -> list[nn.Parameter]:
        """The adapter's parameters (lora_A / lora_B of every targeted layer), in a fixed order."""
        return [param for _, param in sorted(self._named_parameters(key), key=lambda kv: kv[0])]

    def state_dict(self, key: Hashable) -> dict[str, torch.Tensor]:
        """Detached copies under peft's keys (those of ``get_peft_model_state_dict``), sorted."""
        with self.lock:
            return {k: p.detach().clone() for k, p in sorted(self._named_parameters(key), key=lambda kv: kv[0])}

    def load_state_dict(self, key: Hashable, state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state`` into the adapter's parameters in place (an optimizer holding them keeps
        them). Strict: exactly the adapter's keys, each with its shape, finite floats."""
        with self.lock:
            params = dict(self._named_parameters(key))
            missing, unexpected = sorted(params.keys() - state.keys()), sorted(state.keys() - params.keys())
            if missing or unexpected:
                raise ValueError(
                    f"LoRA adapter tensors do not fit the adapter config: missing {missing[:4]}"
                    f"{' ...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                    f"{' ...' if len(unexpected) > 4 else ''}"
                )
            for name, param in params.items():
                value = state[name]
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(param.shape):
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(f"LoRA adapter tensor {name!r}: expected shape {tuple(param.shape)}, got {got}")
                if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
                    raise ValueError(f"LoRA adapter tensor {name!r}: expected finite floating-point values")
            with torch.no_grad():
                for name, param in params.items():
                    param.copy_(state[name].to(dtype=param.dtype, device=param.device))

    # -- forward --------------------------------------------------------------------------
    def adapter_names(self, adapters: Sequence[Hashable | None]) -> list[str]:
        """Per-sample peft adapter names (``__base__`` for None); unknown keys raise KeyError."""
        return [BASE_ADAPTER if key is None else self._names[self._check(key)] for key in adapters]

    @contextlib.contextmanager
    def routing(self, adapters: Sequence[Hashable | None]) -> Iterator[None]:
        """Within the block, every forward of the model is a mixed-adapter batch: sample i uses
        ``adapters[i]``'s adapter (None: the base weights only). Holds the lock throughout."""
        with self.lock:
            names = self.adapter_names(adapters)
            handles = []
            try:
                for module in self.model.modules():
                    if isinstance(module, LoraLayer):
                        hook = _HookWithNames(names)
                        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
                yield
            finally:
                for handle in handles:
                    handle.remove()


class _HookWithNames:
    """A forward pre-hook passing ``adapter_names`` (a callable object, not a lambda: no closure
    over a loop variable)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def __call__(self, target: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        return _pre_forward_hook(target, args, kwargs, self.names)
