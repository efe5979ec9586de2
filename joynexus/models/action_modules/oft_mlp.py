"""The ``oft_mlp`` action-module kind: OpenVLA-OFT style parallel decoding.

Pooled + attention-pooled backbone features and the projected robot state go through a residual
MLP that emits the whole action chunk at once; L1 regression (the loss OFT uses). `OFTKernel` is
the same computation over stacked parameters, for grouped serving and training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from joynexus.models.action_modules.base import ActionModule, ActionModuleConfig, register_action_module
from joynexus.models.backbone import BackboneFeatures
from joynexus.models.grouped_kernels import (
    GroupDims,
    GroupInputs,
    Kernel,
    StackedParameters,
    attend,
    attend_mask,
    key_values,
    layer_norm,
    linear,
    masked_means,
)

__all__ = ["OFTKernel", "OFTMLPActionModule"]


class _ResidualMLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class OFTKernel(Kernel):
    """`OFTMLPActionModule` over stacked parameters (its forward, loss and policy mean)."""

    def forward(self, p: StackedParameters, cfg: ActionModuleConfig, x: GroupInputs) -> torch.Tensor:
        heads = cfg.preset.heads
        norm_w, norm_b = p["feature_norm.weight"], p["feature_norm.bias"]
        pooled = linear(layer_norm(x.pooled, norm_w, norm_b), p["pooled_proj.weight"], p["pooled_proj.bias"])
        tokens = linear(layer_norm(x.tokens, norm_w, norm_b), p["token_proj.weight"], p["token_proj.bias"])
        keys, values = key_values(p, "attn_pool.", tokens, heads)
        # The learned query is one row per tenant: (G, 1, 1, w), broadcast over the member's rows.
        query = p["pool_query"].expand(-1, x.rows, -1, -1)
        attended = attend(p, "attn_pool.", query, keys, values, attend_mask(x.mask, tokens.dtype), heads)
        parts = [pooled, attended.squeeze(2)]
        if cfg.state_dim > 0:
            parts.append(linear(x.state, p["state_proj.weight"], p["state_proj.bias"]))
        hidden = linear(torch.cat(parts, dim=-1), p["trunk.0.weight"], p["trunk.0.bias"])
        for i in range(1, cfg.preset.depth + 1):
            block = f"trunk.{i}."
            inner = layer_norm(hidden, p[block + "norm.weight"], p[block + "norm.bias"])
            inner = F.gelu(linear(inner, p[block + "fc1.weight"], p[block + "fc1.bias"]))
            hidden = hidden + linear(inner, p[block + "fc2.weight"], p[block + "fc2.bias"])
        last = f"trunk.{cfg.preset.depth + 1}."
        hidden = layer_norm(hidden, p[last + "weight"], p[last + "bias"])
        out = linear(hidden, p["action_out.weight"], p["action_out.bias"])
        return out.view(x.groups, x.rows, cfg.action_chunk, cfg.action_dim)

    def predict(
        self,
        p: StackedParameters,
        cfg: ActionModuleConfig,
        x: GroupInputs,
        noise: torch.Tensor | None,
        dims: GroupDims,
    ) -> torch.Tensor:
        return self.forward(p, cfg, x)

    def policy_mean(self, p: StackedParameters, cfg: ActionModuleConfig, x: GroupInputs) -> torch.Tensor:
        return self.forward(p, cfg, x)

    def loss(
        self,
        p: StackedParameters,
        cfg: ActionModuleConfig,
        x: GroupInputs,
        actions: torch.Tensor,
        action_is_pad: torch.Tensor,
        noise: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        dims: GroupDims,
    ) -> torch.Tensor:
        own = dims.action_mask(actions.device)
        return masked_means((self.forward(p, cfg, x) - actions).abs(), action_is_pad, x.valid, own)


@register_action_module("oft_mlp")
class OFTMLPActionModule(ActionModule):
    """OpenVLA-OFT style head: one forward pass decodes the whole chunk in parallel."""

    supports_rl = True
    kernel = OFTKernel()

    def __init__(self, config: ActionModuleConfig) -> None:
        super().__init__(config)
        p = config.preset
        self.feature_norm = nn.LayerNorm(config.feature_dim)
        self.pooled_proj = nn.Linear(config.feature_dim, p.width)
        # Attention pooling with a learned query: lets the head pick the relevant
        # tokens (e.g. one camera's patches) that a plain mean would wash out.
        self.token_proj = nn.Linear(config.feature_dim, p.width)
        self.pool_query = nn.Parameter(torch.randn(1, 1, p.width) * 0.02)
        self.attn_pool = nn.MultiheadAttention(p.width, p.heads, batch_first=True)
        self.state_proj = nn.Linear(config.state_dim, p.width) if config.state_dim > 0 else None
        n_inputs = 2 + (1 if self.state_proj is not None else 0)
        self.trunk = nn.Sequential(
            nn.Linear(n_inputs * p.width, p.width),
            *[_ResidualMLPBlock(p.width) for _ in range(p.depth)],
            nn.LayerNorm(p.width),
        )
        self.action_out = nn.Linear(p.width, config.action_chunk * config.action_dim)
        if config.stochastic:
            # An RL policy starts with its mean near 0 so early actions are the Gaussian's exploration,
            # not a random per-state bias (CleanRL / ManiSkill PPO: output layer orthogonal, gain 0.01).
            nn.init.orthogonal_(self.action_out.weight, gain=0.01)
            nn.init.zeros_(self.action_out.bias)

    def forward(self, features: BackboneFeatures, state: torch.Tensor) -> torch.Tensor:
        """Differentiable chunk prediction (B, chunk, action_dim)."""
        cfg = self.config
        pooled = self.pooled_proj(self.feature_norm(features.pooled))
        tokens = self.token_proj(self.feature_norm(features.tokens))
        query = self.pool_query.expand(tokens.shape[0], -1, -1)
        attended, _ = self.attn_pool(query, tokens, tokens, key_padding_mask=~features.mask, need_weights=False)
        parts = [pooled, attended.squeeze(1)]
        if self.state_proj is not None:
            parts.append(self.state_proj(self.normalized_state(state)))
        hidden = self.trunk(torch.cat(parts, dim=-1))
        return self.action_out(hidden).view(-1, cfg.action_chunk, cfg.action_dim)

    def loss(
        self,
        features: BackboneFeatures,
        state: torch.Tensor,
        actions: torch.Tensor,
        action_is_pad: torch.Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        self._check_inputs(features, state, actions, action_is_pad)
        # L1 regression, as in OpenVLA-OFT: robust to outlier demos, sharper than MSE.
        return self._masked_mean((self(features, state) - actions).abs(), action_is_pad)

    def predict(
        self, features: BackboneFeatures, state: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        # Deterministic regression head (the policy mean): the generator is accepted for a uniform API.
        self._check_inputs(features, state)
        with torch.no_grad():
            return self(features, state)

    def policy_mean(self, features: BackboneFeatures, state: torch.Tensor) -> torch.Tensor:
        return self(features, state)
