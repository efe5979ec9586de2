"""The Inference Model Service's decoders: each request of a shared backbone forward decoded by its
own tenant's module at the version it was pinned to (paper 4.3).

Requests whose modules share an architecture (`models.module_batching.architecture_key`) and mode
(sampled or not) decode as ONE batched computation over their modules' stacked parameters; other
kinds decode one request at a time. Noise -- a sampled policy's Gaussian draw, or the x0 of a module
whose `predict` draws noise (`ActionModule.uses_noise`, the flow-matching expert) -- is drawn per
request, per observation when seeded, identically on both paths, so a request's actions do not
depend on what it was batched with or whether it was split into chunks.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from joynexus.models.backbone import BackboneFeatures
from joynexus.models.module_batching import (
    StackedParameterCache,
    architecture_key,
    gather_inputs,
    group_predict,
    group_sample,
    group_value,
    pad_rows,
    unpad_actions,
)
from joynexus.scheduling.inference_queue import InferenceRequest
from joynexus.services.inference.requests import Pinned

log = logging.getLogger(__name__)


def as_tensor(value: Any) -> torch.Tensor:
    """An observation's array (numpy, list or tensor) as a float32 tensor."""
    return torch.as_tensor(np.asarray(value, dtype=np.float32))


class BatchDecoder:
    """Decodes a batch's requests from the shared forward's features; results are numpy rows."""

    def __init__(self, stacked: StackedParameterCache) -> None:
        # Stacked parameters of same-architecture module groups, reused across batches.
        self.stacked = stacked

    def decode_batch(
        self, live: list[tuple[InferenceRequest, slice]], features: BackboneFeatures, images: list
    ) -> list[tuple[InferenceRequest, dict[str, Any] | Exception]]:
        """Every live request's decode (`rows`: its rows of the batch's features), in batch order.
        Requests whose modules share an architecture (and mode: sampled or not) are decoded as ONE
        batched computation over their modules' stacked parameters (`models.module_batching`); kinds
        without a batched kernel decode one request at a time. A group whose batched decode raises
        is decoded request by request, so a failing module fails only its own requests."""
        outcomes: dict[int, dict[str, Any] | Exception] = {}
        groups: dict[Any, list[tuple[InferenceRequest, slice]]] = {}
        for request, rows in live:
            pinned: Pinned = request.context
            key = architecture_key(pinned.state.module)
            if key is None:
                outcomes[id(request)] = self._decode_alone(request, features, images, rows)
            else:
                groups.setdefault((key, pinned.sample), []).append((request, rows))
        for members in groups.values():
            try:
                outcomes.update(self._decode_group(members, features, images))
            except Exception as error:  # find the failing module: decode its group one request at a time
                log.debug("batched decode of %d requests fell back to per-request: %s", len(members), error)
                for request, rows in members:
                    outcomes[id(request)] = self._decode_alone(request, features, images, rows)
        return [(request, _in_dataset_units(request, outcomes[id(request)])) for request, _ in live]

    def _decode_alone(
        self, request: InferenceRequest, features: BackboneFeatures, images: list, rows: slice
    ) -> dict[str, Any] | Exception:
        try:
            return self._decode(request, features.select(rows).trimmed(), len(images))
        except Exception as error:
            return error

    def _decode_group(
        self, members: list[tuple[InferenceRequest, slice]], features: BackboneFeatures, images: list
    ) -> dict[int, dict[str, Any]]:
        """One batched decode of same-architecture requests (state/action dims and chunks may
        differ: padded). Rows of one module (several requests of a tenant version) run as one
        member; noise is drawn per request (per observation when seeded) exactly as `_decode`
        draws it, so results equal the per-request path."""
        by_module: dict[int, list[tuple[InferenceRequest, slice]]] = {}
        for request, rows in members:
            by_module.setdefault(id(request.context.state.module), []).append((request, rows))
        # A canonical member order (tenant, version), so a recurring set of tenants hits the cache.
        order = sorted(by_module.values(), key=lambda reqs: (reqs[0][0].tenant_id, reqs[0][0].context.state.version))
        modules = [reqs[0][0].context.state.module for reqs in order]
        device = features.tokens.device
        states = [
            torch.stack([as_tensor(obs.state) for request, _ in reqs for obs in request.observations]) for reqs in order
        ]
        rows = [[i for _, r in reqs for i in range(r.start, r.stop)] for reqs in order]
        sample = members[0][0].context.sample
        cfg = modules[0].config
        with torch.inference_mode():
            inputs = gather_inputs(features, rows, states)
            if not bool(inputs.mask.any(dim=-1).all()):
                raise ValueError("features.mask: every sample needs at least one real token")
            params = self.stacked.get(modules)
            noise = None
            if sample or type(modules[0]).uses_noise:
                # Drawn in batch order (unseeded draws come from the global generator, as per request).
                drawn = {id(request): self._noise(request, device) for request, _ in members}
                chunk_shape = (max(m.config.action_chunk for m in modules), max(m.config.action_dim for m in modules))
                if sample:  # a flow head's draw leads with its chain steps (an architecture field: shared)
                    chunk_shape = (*modules[0].sample_noise_shape()[:-2], *chunk_shape)
                noise = pad_rows(
                    [torch.cat([drawn[id(r)] for r, _ in reqs]) for reqs in order], inputs.rows, chunk_shape
                )
            log_probs = chains = None
            if sample:
                actions, log_probs, chains = group_sample(modules, params, inputs, noise)
            else:
                actions = group_predict(modules, params, inputs, noise)
            per_member = unpad_actions(modules, inputs, actions)
            values = group_value(modules, params, inputs) if cfg.value_head else None
        results: dict[int, dict[str, Any]] = {}
        for g, reqs in enumerate(order):
            offset = 0
            for request, _ in reqs:
                own = slice(offset, offset + request.size)
                offset += request.size
                results[id(request)] = {
                    "tenant_id": request.tenant_id,
                    "policy_version": request.context.state.version,
                    "actions": per_member[g][own].cpu().numpy(),
                    "values": None if values is None else values[g, own].cpu().numpy(),
                    "log_probs": None if log_probs is None else log_probs[g, own].cpu().numpy(),
                    "chains": None if chains is None else _own_chain(modules[g], chains[g, own]),
                    "batch_samples": len(images),
                }
        return results

    @staticmethod
    def _noise(request: InferenceRequest, device: torch.device) -> torch.Tensor:
        """The request's noise rows, drawn as `_decode` draws them: a sampled request's standard
        normal per action (CPU generators, then moved), a flow expert's x0 through `draw_noise`."""
        pinned: Pinned = request.context
        module = pinned.state.module
        if pinned.sample:
            shape = module.sample_noise_shape()
            if pinned.seeds is None:
                return torch.randn((request.size, *shape)).to(device)
            draws = [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in pinned.seeds]
            return torch.stack(draws).to(device)
        if pinned.seeds is None:
            return module.draw_noise(request.size, device=device)
        return torch.cat([module.draw_noise(1, torch.Generator().manual_seed(s), device=device) for s in pinned.seeds])

    def decode_prefix(self, request: InferenceRequest, prefix: Any, samples: int) -> dict[str, Any] | Exception:
        """A layer-wise expert's request over its own rows of the grouped prefix cache (`LayerPrefix`),
        in the dataset's units; ``samples``: the batch's size (reported as `batch_samples`)."""
        try:
            outcome = self._decode(request, prefix, samples)
        except Exception as error:
            return error
        return _in_dataset_units(request, outcome)

    def _decode(self, request: InferenceRequest, features: Any, batch_samples: int) -> dict[str, Any]:
        pinned: Pinned = request.context
        module = pinned.state.module
        device = features.pad_mask.device if hasattr(features, "pad_mask") else features.tokens.device
        state = torch.stack([as_tensor(obs.state) for obs in request.observations]).to(device)
        log_probs = records = None
        with torch.inference_mode():
            if pinned.sample:
                noise = self._noise(request, state.device)
                actions, log_probs, records = module.sample_policy(features, state, noise)
            elif pinned.seeds is None:
                actions = module.predict(features, state)
            else:  # per-observation generators: the same draws whether served alone or grouped
                actions = torch.cat(
                    [
                        module.predict(
                            features.select([i]), state[i : i + 1], generator=torch.Generator().manual_seed(s)
                        )
                        for i, s in enumerate(pinned.seeds)
                    ]
                )
            values = module.value(features, state) if module.config.value_head else None
        return {
            "tenant_id": request.tenant_id,
            "policy_version": pinned.state.version,
            "actions": actions.cpu().numpy(),
            "values": None if values is None else values.cpu().numpy(),
            "log_probs": None if log_probs is None else log_probs.cpu().numpy(),
            # A flow head's sampled chains (its density's support), which rollouts record for PPO.
            "chains": records.cpu().numpy() if records is not None and module.rl_record_field == "chain" else None,
            "batch_samples": batch_samples,
        }


def _own_chain(module: Any, chains: torch.Tensor) -> np.ndarray:
    """A member's chains (rows, K+1, chunk, A) in the group's padded dims cut to its own."""
    return chains[:, :, : module.config.action_chunk, : module.config.action_dim].cpu().numpy()


def _in_dataset_units(request: InferenceRequest, outcome: dict[str, Any] | Exception) -> dict[str, Any] | Exception:
    """A deterministic request's actions un-normalized with its version's normalizer (the dataset's
    units). Sampled requests (RL rollouts) keep the module's units: their log-probabilities are of those."""
    pinned: Pinned = request.context
    normalizer = pinned.state.normalizer
    if isinstance(outcome, Exception) or normalizer is None or pinned.sample:
        return outcome
    return {**outcome, "actions": normalizer.unnormalize_action(outcome["actions"])}
