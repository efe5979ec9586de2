"""The Inference Model Service's serving states (paper 4.1.2; issue 14.5): one per (tenant, policy
version), each a frozen tenant module on the service's device and, for a LoRA tenant, its adapter on
the shared backbone.

`load_weights` payloads (what `TrainingModelService.export_params` produces) are installed here.
Versions are held in a bounded per-tenant LRU (the latest version is never evicted); a request pins
its serving state when it is submitted, so eviction never breaks a request already in the queue.

Tenant density: at most `max_resident_serving` serving states, over all tenants, stay in memory; the
least recently used beyond it are paged out to a spill folder (`ServingPager`) and paged in by the
next request for them, pinned versions too. A state with a request queued or in a batch is never
paged out; page-ins happen at submission, so group batching sees resident modules only.

LoRA tenants: a payload carrying adapter tensors (`adapter/...`, config in the manifest's
`extra["adapter"]`) installs, beside its module, a peft LoRA adapter on the shared backbone, one per
serving version. An evicted version's adapter leaves the backbone; a request pinned to it
re-installs it for its batch (`InferenceModelService._shared_forward`).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from joynexus.artifacts import decode_tenant_payload
from joynexus.data.normalization import SIMULATOR_BOUNDS_SOURCE, Normalizer
from joynexus.models.action_modules import ActionModule, ActionModuleConfig, build_action_module
from joynexus.models.adapters import LoraAdapterConfig, split_tenant_state
from joynexus.models.backbone import ResidentBackbone
from joynexus.services.inference.errors import InferenceError, UnknownPolicyVersion
from joynexus.services.inference.pager import ServingPager
from joynexus.services.residency import LruCache, ResidencyLimits, TenantResidency, UnknownEntry


@dataclass
class ServingState:
    tenant_id: str
    version: int
    schema_signature: str
    module: ActionModule
    manifest_digest: str
    last_used: float = field(default_factory=time.monotonic)
    # The version's LoRA adapter (None: the tenant has none): its config, its tensors (kept here, so
    # it can be re-installed for a pinned request after eviction) and its key on the backbone.
    adapter: LoraAdapterConfig | None = None
    adapter_state: dict[str, torch.Tensor] | None = None
    adapter_key: tuple[Any, ...] | None = None
    # The version's normalizer when the service applies it (state in, actions out); None: raw units.
    normalizer: Normalizer | None = None


class ServingStates:
    """Every tenant's serving versions: the per-tenant version bound, the residency of the states
    themselves (in memory or paged out) and their adapters on the backbone."""

    def __init__(
        self,
        backbone: ResidentBackbone,
        *,
        max_versions_per_tenant: int,
        limits: ResidencyLimits,
        spill_dir: str | Path | None,
    ) -> None:
        if max_versions_per_tenant < 1:
            raise ValueError(f"max_versions_per_tenant must be >= 1, got {max_versions_per_tenant}")
        self.backbone = backbone
        self.device = backbone.device
        self.max_versions = max_versions_per_tenant
        # Each tenant's loaded versions, least recently used first (the per-tenant version bound);
        # the serving states themselves, resident or paged out, are in `residency`, by (tenant, version).
        self.versions_of: dict[str, LruCache[int, None]] = {}  # per tenant, least recently used first
        self.lock = threading.RLock()  # guards versions_of; never held while a batch runs
        # Lock order: the residency's lock, then `lock` or the backbone's adapter lock (its pager
        # takes them); so the residency is never called with `lock` held.
        self._adapter_ids = itertools.count(1)  # one backbone adapter key per serving state
        self.residency: TenantResidency[tuple[str, int], ServingState] = TenantResidency(
            ServingPager(self), limits, spill_dir, name="inference-serving"
        )

    # -- installing ---------------------------------------------------------------------------
    def install(self, payload: bytes) -> dict[str, Any]:
        """Install a tenant payload (safetensors + manifest) as a new serving version."""
        tensors, manifest = decode_tenant_payload(payload)
        if manifest.base_model_id != self.backbone.model_id:
            raise InferenceError(
                f"payload of tenant {manifest.tenant_id!r} was trained on base model {manifest.base_model_id!r}, "
                f"this service holds {self.backbone.model_id!r}"
            )
        config = ActionModuleConfig.model_validate(manifest.module_config)
        if config.feature_dim != self.backbone.hidden_size:
            raise InferenceError(
                f"payload of tenant {manifest.tenant_id!r} expects feature_dim {config.feature_dim}, "
                f"the backbone gives {self.backbone.hidden_size}"
            )
        module_tensors, adapter_tensors = split_tenant_state(tensors)
        module = build_action_module(config)
        module.load_state_dict(module_tensors, strict=True)
        module.eval().requires_grad_(False).to(self.device)  # payloads are CPU tensors; serve on our device
        state = ServingState(
            manifest.tenant_id, manifest.policy_version, manifest.schema_signature, module, manifest.digest,
            normalizer=served_normalizer(manifest.extra.get("normalization")),
        )  # fmt: skip
        self._install_adapter(state, manifest.extra.get("adapter"), adapter_tensors)
        tenant_id, version = manifest.tenant_id, manifest.policy_version
        # Into the residency first, then listed: a listed version always resolves. Resident now; the
        # least recently used serving states beyond the bound page out.
        replaced = self.residency.add((tenant_id, version), state)
        with self.lock:
            versions = self.versions_of.setdefault(tenant_id, LruCache())
            versions.put(version, None)
            evicted = self._evict(versions)
        dropped = [s for s in (self.residency.remove((tenant_id, v)) for v in evicted) if s is not None]
        if replaced is not None:
            dropped.append(replaced)
        self.drop_adapters(dropped)  # outside `lock`: the worker takes the adapter lock, then `lock`
        return {
            "tenant_id": manifest.tenant_id,
            "version": manifest.policy_version,
            "loaded": self.versions(manifest.tenant_id),
        }

    def _install_adapter(self, state: ServingState, config: Any, adapter_tensors: dict[str, torch.Tensor]) -> None:
        """Put a payload's LoRA adapter on the backbone for `state` (strictly checked: the config's
        keys and shapes, finite values), or refuse the payload."""
        where = f"payload of tenant {state.tenant_id!r} v{state.version}"
        if config is None:
            if adapter_tensors:
                raise InferenceError(f"{where} holds LoRA adapter tensors but its manifest names no adapter")
            return
        if not adapter_tensors:
            raise InferenceError(f"{where}: its manifest names an adapter, but it holds no adapter tensors")
        try:
            self.attach_adapter(
                state,
                LoraAdapterConfig.model_validate(config),
                {k: v.detach().clone() for k, v in adapter_tensors.items()},
            )
        except (ValueError, KeyError, RuntimeError) as error:
            raise InferenceError(f"{where}: its LoRA adapter does not fit this backbone: {error}") from error

    def attach_adapter(
        self, state: ServingState, adapter: LoraAdapterConfig, adapter_state: dict[str, torch.Tensor]
    ) -> None:
        """Give `state` its adapter under a fresh backbone key (a page-in is a new state: a new key)."""
        state.adapter = adapter
        state.adapter_state = adapter_state
        state.adapter_key = ("serving", state.tenant_id, state.version, next(self._adapter_ids))
        self.backbone.adapters.add(state.adapter_key, state.adapter, state=adapter_state)

    def restored(
        self, meta: dict[str, Any], module: ActionModule, adapter_tensors: dict[str, torch.Tensor]
    ) -> ServingState:
        """A paged-in serving state from what `ServingPager.spill` wrote: a NEW object (and adapter
        key), so a request still holding the old one keeps serving from it."""
        state = ServingState(
            meta["tenant_id"], int(meta["version"]), meta["schema_signature"], module, meta["manifest_digest"],
            normalizer=served_normalizer(meta.get("normalization")),
        )  # fmt: skip
        if meta["adapter"] is not None:
            self.attach_adapter(state, LoraAdapterConfig.model_validate(meta["adapter"]), adapter_tensors)
        return state

    def drop_adapters(self, states: list[ServingState]) -> None:
        """Take dropped serving states' adapters off the backbone."""
        for state in states:
            if state.adapter_key is not None:
                self.backbone.adapters.remove(state.adapter_key)

    def is_current(self, state: ServingState) -> bool:
        """Whether `state` is what its version serves now (not evicted, replaced, or paged out)."""
        return self.residency.peek((state.tenant_id, state.version)) is state

    def _evict(self, versions: LruCache[int, None]) -> list[int]:
        """Drop the least recently used versions beyond the bound (never the latest); returns them."""
        latest = max(versions)
        dropped = []
        while len(versions) > self.max_versions:
            victim = versions.evict_least_recent(unless=lambda version, _: version == latest)
            assert victim is not None  # more than max_versions >= 1 entries: one is not the latest
            dropped.append(victim[0])
        return dropped

    # -- reading ------------------------------------------------------------------------------
    def versions(self, tenant_id: str) -> list[int]:
        with self.lock:
            return sorted(self.versions_of.get(tenant_id, {}))

    def tenants(self) -> list[str]:
        with self.lock:
            return sorted(self.versions_of)

    def remove_tenant(self, tenant_id: str) -> int:
        """Forget every serving state of the tenant (tenant deletion), resident or paged out (its
        spill files too); returns how many versions."""
        with self.lock:
            versions = list(self.versions_of.pop(tenant_id, ()))
        states = [s for s in (self.residency.remove((tenant_id, v)) for v in versions) if s is not None]
        self.drop_adapters(states)  # a paged-out state's adapter left the backbone with its page-out
        return len(versions)

    def resolve(self, tenant_id: str, version: int | None) -> ServingState:
        """The serving state a request will use (None: the latest version), paged in if it was out;
        inside a residency scope it stays pinned (never paged out) until the request settles."""
        with self.lock:
            versions = self.versions_of.get(tenant_id)
            if not versions:
                raise UnknownPolicyVersion(tenant_id, version, [])
            key = max(versions) if version is None else version
            if key not in versions:
                raise UnknownPolicyVersion(tenant_id, version, sorted(versions))
            versions.touch(key)
        try:
            state = self.residency.use((tenant_id, key))  # outside `lock` (lock order, see __init__)
        except UnknownEntry:  # evicted or removed since the check
            raise UnknownPolicyVersion(tenant_id, version, self.versions(tenant_id)) from None
        state.last_used = time.monotonic()
        return state

    def close(self) -> None:
        self.residency.close()  # the spill folder goes with the service


def served_normalizer(data: dict[str, Any] | None) -> Normalizer | None:
    """The normalizer the service applies for a version: its manifest's, except an RL tenant's
    simulator bounds, which the rollout and the evaluation apply when they step the simulator."""
    normalizer = Normalizer.from_dict(data)
    if normalizer is None or normalizer.source == SIMULATOR_BOUNDS_SOURCE:
        return None
    return normalizer
