"""How a serving state of the Inference Model Service leaves memory and comes back: the pager of
its `TenantResidency` (`joynexus.services.residency`; tenant density, issue 14.5)."""

from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from joynexus.models.action_modules import ActionModule, ActionModuleConfig, build_action_module
from joynexus.services.residency import rebuild_module, tensor_bytes

if TYPE_CHECKING:  # the serving states own their pager: types only, no import at run time
    from joynexus.services.inference.serving import ServingState, ServingStates

SPARE_MODULES = 4  # modules of paged-out serving states kept per architecture for reuse


class ServingPager:
    """How a serving state leaves memory and comes back (`TenantResidency`'s pager): its module's
    tensors and its adapter's, with what names the version. A serving state never changes, so it is
    written once and later page-outs only drop it; a page-in builds a NEW state object (and adapter
    key), so a request still holding the old one keeps serving from it, and the shared forward
    treats its adapter as not current (installed for that batch only)."""

    immutable = True

    def __init__(self, states: ServingStates) -> None:
        self._states = states
        # Modules of paged-out states, per architecture, for the next page-in of the same config to
        # overwrite in place (a fifth of the cost of building one, most of a page-in otherwise). One
        # is taken only once the state that held it is gone: until then a request may still serve
        # from it. A few per config: at most SPARE_MODULES modules' memory beyond the bound.
        self._spares: dict[ActionModuleConfig, deque[tuple[weakref.ref[ServingState], ActionModule]]] = {}
        # Each recycled module's tensors by state-dict name, found once per module (not per page-in).
        self._tensors_of: weakref.WeakKeyDictionary[ActionModule, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()

    def _reuse(self, config: ActionModuleConfig, tensors: dict[str, torch.Tensor]) -> ActionModule | None:
        """A spare module of this config with `tensors` copied in (exactly its keys and shapes), or None."""
        spares = self._spares.get(config)
        for entry in list(spares or ()):
            holder, module = entry
            if holder() is not None:  # a request still holds the old state: it may be serving from it
                continue
            spares.remove(entry)  # type: ignore[union-attr]
            own = self._tensors_of.get(module)
            if own is None:
                own = self._tensors_of[module] = dict(module.state_dict(keep_vars=True))
            if own.keys() != tensors.keys() or any(own[k].shape != t.shape for k, t in tensors.items()):
                return None  # not this module's state after all: build one
            with torch.no_grad():
                for name, tensor in tensors.items():
                    own[name].copy_(tensor)
            return module
        return None

    def nbytes(self, state: ServingState) -> int:
        adapter = list((state.adapter_state or {}).values())
        return tensor_bytes([*state.module.parameters(), *state.module.buffers(), *adapter])

    def can_page_out(self, key: tuple[str, int], state: ServingState) -> bool:
        return True  # requests pin what they need; nothing else holds a state in memory

    def at_rest(self, key: tuple[str, int], state: ServingState) -> None:
        pass

    def spill(self, key: tuple[str, int], state: ServingState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"module/{k}": v for k, v in state.module.state_dict().items()}
        tensors.update({f"adapter/{k}": v for k, v in (state.adapter_state or {}).items()})
        meta = {
            "tenant_id": state.tenant_id,
            "version": state.version,
            "schema_signature": state.schema_signature,
            "manifest_digest": state.manifest_digest,
            "module_config": state.module.config.model_dump(mode="json"),
            "adapter": None if state.adapter is None else state.adapter.model_dump(mode="json"),
            "normalization": None if state.normalizer is None else state.normalizer.to_dict(),
        }
        return tensors, meta

    def evicted(self, key: tuple[str, int], state: ServingState) -> None:
        self._states.drop_adapters([state])
        spares = self._spares.setdefault(state.module.config, deque(maxlen=SPARE_MODULES))
        spares.append((weakref.ref(state), state.module))

    def restore(self, key: tuple[str, int], tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> ServingState:
        module_tensors = {k.removeprefix("module/"): v for k, v in tensors.items() if k.startswith("module/")}
        adapter_tensors = {k.removeprefix("adapter/"): v for k, v in tensors.items() if k.startswith("adapter/")}
        config = ActionModuleConfig.model_validate(meta["module_config"])
        module = self._reuse(config, module_tensors)  # in place: it stays eval, without grad, on our device
        if module is None:
            module = rebuild_module(lambda: build_action_module(config), module_tensors, self._states.device)
            module.eval().requires_grad_(False)
        return self._states.restored(meta, module, adapter_tensors)
