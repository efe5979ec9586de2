"""The action-module base: what every kind shares, and the registry of kinds.

A tenant-private action module is trained on top of the frozen resident backbone. A LeRobot-style
registry maps a config ``kind`` to a module class, so a kind is one file: its module class
(``@register_action_module``), its own config class when it has knobs (``config_class``), and its
grouped kernel (``kernel``, see `models.grouped_kernels`); nothing in shared code switches on kind
names. The built-in kinds are `action_modules.oft_mlp` and `action_modules.flow_matching`.

Actions are expected already normalized by the data pipeline (roughly zero mean,
unit scale); the modules do not normalize.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import pydantic
import torch
from torch import nn

from joynexus.extensions import Registry
from joynexus.models.backbone import BackboneFeatures

if TYPE_CHECKING:
    from joynexus.models.grouped_kernels import Kernel

__all__ = [
    "ACTION_MODULES",
    "SIZE_PRESETS",
    "ActionModule",
    "ActionModuleConfig",
    "PrefixRows",
    "SizePreset",
    "available_action_modules",
    "by_prefix_layout",
    "build_action_module",
    "register_action_module",
    "standard_normal",
    "uses_layer_prefix",
]


@dataclass(frozen=True)
class SizePreset:
    width: int  # hidden width of the head
    depth: int  # residual MLP blocks (oft_mlp) / transformer layers (flow_matching)
    heads: int  # attention heads (must divide width)


SIZE_PRESETS: dict[str, SizePreset] = {
    "tiny": SizePreset(width=64, depth=2, heads=4),
    "small": SizePreset(width=128, depth=3, heads=4),
    "base": SizePreset(width=256, depth=4, heads=8),
}

_M = TypeVar("_M", bound="type[ActionModule]")

# Fields the shared config carried before each kind had its own config class: a record stored then
# (a compiled tenant, a checkpoint's metadata) still loads when its kind does not take them.
_LEGACY_SHARED_FIELDS = ("num_inference_steps",)


class ActionModuleConfig(pydantic.BaseModel):
    """What a tenant picks for its head; frozen so it can key caches and be stored as-is.

    The fields every kind shares. A kind with its own knobs declares a subclass (its module's
    ``config_class``); ``ActionModuleConfig(kind=..., ...)`` and ``ActionModuleConfig.model_validate``
    build the config class of the given kind, so callers never name the per-kind class."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    kind: str
    feature_dim: int = pydantic.Field(ge=1, description="backbone hidden size D")
    state_dim: int = pydantic.Field(ge=0, description="robot state size; 0 = no state input")
    action_dim: int = pydantic.Field(ge=1)
    action_chunk: int = pydantic.Field(ge=1, description="actions predicted per call")
    size: str = "small"
    value_head: bool = False
    # A learned, state-independent log-std turns the head into a Gaussian policy with a tractable
    # log-density, which PPO needs; only kinds with `supports_rl` accept it.
    stochastic: bool = False
    # Standardize the state input by running statistics of the states the policy has seen (RL:
    # updated from each rollout after its PPO update, `observe_states`), kept in the module's
    # state dict so every published version carries the statistics it was trained with.
    normalize_state: bool = False

    def __new__(cls, *args: Any, **data: Any) -> ActionModuleConfig:
        # The kind's own config class, when it specializes this one (pickling and copying call
        # __new__ without data: they keep the class).
        return super().__new__(_config_class(cls, data.get("kind")))

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> ActionModuleConfig:  # type: ignore[override]
        """Validate a mapping (or config) as the config class of its ``kind``."""
        if isinstance(obj, Mapping):
            target = _config_class(cls, obj.get("kind"))
            known = target.model_fields
            obj = {k: v for k, v in obj.items() if k in known or k not in _LEGACY_SHARED_FIELDS}
            if target is not cls:
                return target.model_validate(obj, **kwargs)
        return super().model_validate(obj, **kwargs)

    @pydantic.field_validator("kind")
    @classmethod
    def _kind_registered(cls, value: str) -> str:
        ACTION_MODULES.get(value)  # an unknown kind raises, naming the allowed ones
        return value

    @pydantic.field_validator("size")
    @classmethod
    def _size_known(cls, value: str) -> str:
        if value not in SIZE_PRESETS:
            raise ValueError(f"size={value!r} is not a known preset; allowed sizes: {sorted(SIZE_PRESETS)}")
        return value

    @pydantic.model_validator(mode="after")
    def _kind_takes_this_class(self) -> ActionModuleConfig:
        expected = ACTION_MODULES.get(self.kind).config_class
        if type(self) is not expected:
            raise ValueError(f"kind={self.kind!r} takes a {expected.__name__}, not a {type(self).__name__}")
        return self

    @property
    def preset(self) -> SizePreset:
        return SIZE_PRESETS[self.size]

    def architecture_fields(self) -> tuple[Any, ...]:
        """This kind's own fields that must be equal for modules to run stacked (none here); a
        kind's config adds its knobs (`models.module_batching.architecture_key` reads this)."""
        return ()

    @classmethod
    def backend_fields(cls, spec: Any, caps: Any, problems: list[tuple[str, str]]) -> dict[str, Any]:
        """The fields of this kind's config that the tenant creator fills from the workload spec and
        the resident backbone's capabilities, appending (field, reason) for what it refuses. None
        here; a kind that starts from a checkpoint (``action_module.checkpoint``) overrides it."""
        if spec.action_module.checkpoint:
            reason = f"kind {spec.action_module.kind!r} does not start from a checkpoint"
            problems.append(("action_module.checkpoint", reason))
        return {}

    @classmethod
    def read_checkpoint(cls, path: str) -> Any:
        """A checkpoint directory's config and processor statistics, without its weights (config,
        stats, state_dim, action_dim); None for kinds that do not start from one (`backend_fields`
        refuses the field for them)."""
        return None


def _config_class(cls: type[ActionModuleConfig], kind: Any) -> type[ActionModuleConfig]:
    """The registered config class of ``kind`` when it specializes ``cls``; else ``cls`` itself
    (an unknown kind is then reported by the field validator)."""
    module = ACTION_MODULES.get(kind, None) if isinstance(kind, str) else None
    target = getattr(module, "config_class", cls)
    return target if isinstance(target, type) and issubclass(target, cls) else cls


def build_action_module(config: ActionModuleConfig | Mapping[str, Any]) -> ActionModule:
    """Instantiate the registered class for ``config.kind`` (a mapping is validated by its kind)."""
    if not isinstance(config, ActionModuleConfig):
        config = ActionModuleConfig.model_validate(config)
    return ACTION_MODULES.get(config.kind)(config)


STATE_CLIP = 5.0  # standardized state entries are clipped to +-this (rare outliers, unseen states)
STATE_STD_FLOOR = 1e-4  # a (near) constant state entry is centred, not blown up


def standardize_state(state: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """(state - mean) / std, clipped to +-STATE_CLIP; `mean`/`var` broadcast over the rows. A
    zero-padded entry (mean 0, var 0: a narrower member of a stacked group) stays 0."""
    std = var.clamp_min(0.0).sqrt().clamp_min(STATE_STD_FLOOR)
    return ((state - mean) / std).clamp(-STATE_CLIP, STATE_CLIP)


def _shape_error(name: str, expected: str, got: torch.Tensor) -> ValueError:
    return ValueError(f"{name}: expected shape {expected}, got {tuple(got.shape)}")


class ActionModule(nn.Module, abc.ABC):
    """Base class: input validation, padded-step masking and the optional value head."""

    kind: ClassVar[str] = ""
    supports_rl: ClassVar[bool] = False  # has a tractable action density (stochastic=True is allowed)
    # The RL sample field whose density the policy gives: "action" for a Gaussian head; a flow head's
    # density is over its whole denoising chain ("chain", recorded by rollouts beside the action).
    rl_record_field: ClassVar[str] = "action"
    # predict integrates from drawn noise (the module then has `draw_noise`): the inference service
    # draws it per request, so a request decodes the same alone or in a group.
    uses_noise: ClassVar[bool] = False
    # The kind's config class (a subclass of ActionModuleConfig when the kind has its own knobs).
    config_class: ClassVar[type[ActionModuleConfig]] = ActionModuleConfig
    # The kind's grouped kernel over stacked parameters (`models.grouped_kernels.Kernel`); None: the
    # kind always runs per tenant through its own methods.
    kernel: ClassVar[Kernel | None] = None
    config: ActionModuleConfig

    def __init__(self, config: ActionModuleConfig) -> None:
        super().__init__()
        if config.kind != type(self).kind:
            raise ValueError(f"kind={config.kind!r} does not match {type(self).__name__} (kind {type(self).kind!r})")
        if not isinstance(config, type(self).config_class):
            expected = type(self).config_class.__name__
            raise ValueError(f"{type(self).__name__} takes a {expected}, got {type(config).__name__}")
        if config.stochastic and not type(self).supports_rl:
            raise ValueError(
                f"stochastic=True: kind={config.kind!r} has no tractable action density; "
                f"kinds that support RL: {[k for k, c in ACTION_MODULES.items() if c.supports_rl]}"
            )
        self.config = config
        self.log_std: nn.Parameter | None = None
        if config.stochastic:
            self.log_std = nn.Parameter(torch.full((config.action_dim,), -0.5))
        self.state_mean: nn.Parameter | None = None
        self.state_var: nn.Parameter | None = None
        self.state_count: nn.Parameter | None = None
        if config.normalize_state and config.state_dim > 0:
            # Parameters without gradients, not buffers: they travel wherever parameters do (the
            # grouped kernels' stacked parameters, checkpoints, publications); AdamW skips them.
            self.state_mean = nn.Parameter(torch.zeros(config.state_dim), requires_grad=False)
            self.state_var = nn.Parameter(torch.ones(config.state_dim), requires_grad=False)
            self.state_count = nn.Parameter(torch.zeros(()), requires_grad=False)
        width = config.preset.width
        # Value head for PPO: a separate MLP on (pooled features, state) so value
        # regression never pulls on the policy's own layers.
        self.value_net: nn.Module | None = None
        if config.value_head:
            self.value_net = nn.Sequential(
                nn.LayerNorm(config.feature_dim + config.state_dim),
                nn.Linear(config.feature_dim + config.state_dim, width),
                nn.GELU(),
                nn.Linear(width, width),
                nn.GELU(),
                nn.Linear(width, 1),
            )

    # A module whose services give it the prefix's per-layer cache (`backbone.layer_prefix.LayerPrefix`,
    # made by the kind's `layer_prefixes` over a batch's `PrefixRows`) instead of token features.
    feature_form: ClassVar[str] = "tokens"

    def load_initial_state(self, backbone: Any) -> None:
        """Called once when a tenant's slot is built on ``backbone``, before any checkpoint is restored:
        a kind checks what it needs of the backbone and loads the weights it starts from (none here)."""

    # -------------------------------------------------------------- API
    @abc.abstractmethod
    def loss(
        self,
        features: BackboneFeatures,
        state: torch.Tensor,
        actions: torch.Tensor,
        action_is_pad: torch.Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Scalar training loss; chunk steps with ``action_is_pad`` True are excluded."""

    @abc.abstractmethod
    def predict(
        self, features: BackboneFeatures, state: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """(B, action_chunk, action_dim) actions; no autograd graph is built."""

    def value(self, features: BackboneFeatures, state: torch.Tensor) -> torch.Tensor:
        """(B,) state-value estimate; only for configs with ``value_head=True``."""
        if self.value_net is None:
            raise RuntimeError(f"{type(self).__name__} was built with value_head=False; it has no value head")
        self._check_inputs(features, state)
        return self.value_net(torch.cat([features.pooled, self.normalized_state(state)], dim=-1)).squeeze(-1)

    def normalized_state(self, state: torch.Tensor) -> torch.Tensor:
        """What the layers see of ``state``: standardized by the running statistics when the config
        has ``normalize_state``, else ``state`` itself."""
        if self.state_mean is None or self.state_var is None:
            return state
        return standardize_state(state, self.state_mean, self.state_var)

    @torch.no_grad()
    def observe_states(self, states: torch.Tensor) -> None:
        """Fold a batch of raw states (N, state_dim) into the running mean and variance (Chan et
        al.'s parallel update, as gym's NormalizeObservation); a no-op without ``normalize_state``."""
        if self.state_mean is None or self.state_var is None or self.state_count is None or len(states) == 0:
            return
        batch = states.detach().to(self.state_mean.device, torch.float64).reshape(-1, self.config.state_dim)
        n, count = float(batch.shape[0]), float(self.state_count)
        batch_mean, batch_var = batch.mean(dim=0), batch.var(dim=0, unbiased=False)
        mean, var = self.state_mean.double(), self.state_var.double()
        if count == 0:  # the initial (0, 1) is a placeholder, not an observation
            new_mean, new_var = batch_mean, batch_var
        else:
            total = count + n
            delta = batch_mean - mean
            new_mean = mean + delta * n / total
            new_var = (var * count + batch_var * n + delta.pow(2) * count * n / total) / total
        # In-place copies bump the tensors' versions, so stacked-parameter caches see the change.
        self.state_mean.copy_(new_mean)
        self.state_var.copy_(new_var)
        self.state_count.add_(n)

    def policy_mean(self, features: BackboneFeatures, state: torch.Tensor) -> torch.Tensor:
        """Differentiable mean action chunk of the Gaussian policy (kinds with `supports_rl`)."""
        raise NotImplementedError(f"{type(self).__name__} has no tractable action density")

    def action_distribution(self, features: BackboneFeatures, state: torch.Tensor) -> torch.distributions.Normal:
        """The Gaussian policy over the (B, chunk, action_dim) action chunk; needs stochastic=True."""
        if self.log_std is None:
            raise RuntimeError(f"{type(self).__name__} was built with stochastic=False; it defines no policy density")
        self._check_inputs(features, state)
        mean = self.policy_mean(features, state)
        std = self.log_std.clamp(-5.0, 2.0).exp().expand_as(mean)
        return torch.distributions.Normal(mean, std)

    def sample_noise_shape(self) -> tuple[int, ...]:
        """The standard-normal draw one sampled (RL) action takes: (chunk, action_dim) here."""
        return (self.config.action_chunk, self.config.action_dim)

    def sample_policy(
        self, features: BackboneFeatures, state: torch.Tensor, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A sampled action chunk from given standard normals ``noise`` (B, *sample_noise_shape()):
        (actions, log_prob (B,), record), where ``record`` is what `record_log_prob` rescores
        (the `rl_record_field` of the RL sample: here the actions themselves)."""
        dist = self.action_distribution(features, state)
        actions = dist.mean + dist.stddev * noise
        return actions, dist.log_prob(actions).sum(dim=(-1, -2)), actions

    def record_log_prob(
        self, features: BackboneFeatures, state: torch.Tensor, record: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log_prob (B,), entropy (B,)) of recorded samples under the current parameters
        (differentiable): what PPO's ratio and entropy bonus take."""
        dist = self.action_distribution(features, state)
        return dist.log_prob(record).sum(dim=(-1, -2)), dist.entropy().sum(dim=(-1, -2))

    # -------------------------------------------------------------- helpers
    def _check_inputs(
        self,
        features: BackboneFeatures,
        state: torch.Tensor,
        actions: torch.Tensor | None = None,
        action_is_pad: torch.Tensor | None = None,
    ) -> None:
        cfg = self.config
        if not isinstance(features, BackboneFeatures):
            raise ValueError(f"features: expected BackboneFeatures, got {type(features).__name__}")
        b = features.batch_size
        if features.hidden_size != cfg.feature_dim:
            raise _shape_error("features.tokens", f"(B, L, {cfg.feature_dim}) [feature_dim]", features.tokens)
        if not bool(features.mask.any(dim=1).all()):
            # Cross-attention over a row with no real token would produce NaNs.
            raise ValueError("features.mask: every sample needs at least one real token")
        if state.ndim != 2 or state.shape != (b, cfg.state_dim):
            raise _shape_error("state", f"({b}, {cfg.state_dim}) [B, state_dim]", state)
        if actions is not None and actions.shape != (b, cfg.action_chunk, cfg.action_dim):
            raise _shape_error(
                "actions", f"({b}, {cfg.action_chunk}, {cfg.action_dim}) [B, chunk, action_dim]", actions
            )
        if action_is_pad is not None:
            if action_is_pad.shape != (b, cfg.action_chunk):
                raise _shape_error("action_is_pad", f"({b}, {cfg.action_chunk}) [B, chunk]", action_is_pad)
            if action_is_pad.dtype != torch.bool:
                raise ValueError(f"action_is_pad: expected dtype torch.bool, got {action_is_pad.dtype}")

    @staticmethod
    def _masked_mean(per_element: torch.Tensor, action_is_pad: torch.Tensor | None) -> torch.Tensor:
        """Mean over (B, chunk, action_dim) ignoring padded chunk steps."""
        if action_is_pad is None:
            return per_element.mean()
        valid = (~action_is_pad).unsqueeze(-1)
        # where(), not a multiply: NaN/inf in a padded step must not poison the mean.
        kept = torch.where(valid, per_element, torch.zeros((), dtype=per_element.dtype, device=per_element.device))
        denom = (valid.sum() * per_element.shape[-1]).clamp_min(1).to(per_element.dtype)
        return kept.sum() / denom


@dataclass(frozen=True)
class PrefixRows:
    """One member of a grouped layer-wise prefix forward: a tenant's module and its rows."""

    module: ActionModule
    images: list[list[torch.Tensor]]  # per row: (3, h, w) float cameras in [0, 1]
    instructions: list[str]
    state: torch.Tensor  # (rows, state_dim), normalized


def uses_layer_prefix(module: Any) -> bool:
    """Whether the services give ``module`` a `LayerPrefix` (its kind's `feature_form`)."""
    return getattr(module, "feature_form", "tokens") == "layers"


def by_prefix_layout(modules: Sequence[Any]) -> dict[tuple[Any, ...], list[int]]:
    """Indices of layer-wise modules grouped by prefix layout: the class whose `layer_prefixes`
    makes the group's ONE prefix forward (a kind that inherits it, as π0.5 from π0, shares the
    group) and the config's `prefix_group_key`, in first-seen order."""
    layouts: dict[tuple[Any, ...], list[int]] = {}
    for index, module in enumerate(modules):
        owner = next(c for c in type(module).__mro__ if "layer_prefixes" in vars(c))
        layouts.setdefault((owner, module.config.prefix_group_key()), []).append(index)
    return layouts


def standard_normal(
    shape: tuple[int, ...],
    generator: torch.Generator | None,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A standard-normal draw of ``shape`` on ``device``; a generator on another device (a CPU
    generator for a CUDA module) draws on its own and the draw is moved, so a seed gives the same
    values on any device."""
    if generator is not None and generator.device != device:
        return torch.randn(shape, generator=generator, device=generator.device, dtype=dtype).to(device)
    return torch.randn(shape, generator=generator, device=device, dtype=dtype)


# Filled by @register_action_module where each kind is defined.
ACTION_MODULES: Registry[ActionModule] = Registry(
    ActionModule, field="kind", noun="action module", plural="kinds", name_attribute="kind"
)


def register_action_module(name: str) -> Callable[[_M], _M]:
    """Class decorator: make ``cls`` buildable from ``ActionModuleConfig(kind=name)``."""
    return ACTION_MODULES.register(name)


def available_action_modules() -> list[str]:
    """Registered kinds, sorted."""
    return ACTION_MODULES.available()
