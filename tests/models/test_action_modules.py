"""Tests for tenant action modules and their registry."""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ["HF_HUB_OFFLINE"] = "1"

import pydantic
import pytest
import torch

from joynexus.models.action_modules import (
    ACTION_MODULES,
    ActionModule,
    ActionModuleConfig,
    available_action_modules,
    build_action_module,
    register_action_module,
)
from joynexus.models.backbone import BackboneFeatures, ResidentBackbone

# The library's registered kinds (a test file may register its own: those are left out, so the
# parameters stay the same whichever test files were collected).
# Kinds over token features (a layer-wise expert, smolvla, reads a LayerPrefix: tests/models/test_smolvla_parity.py).
KINDS = [
    k
    for k in available_action_modules()
    if ACTION_MODULES[k].__module__.startswith("joynexus.") and ACTION_MODULES[k].feature_form == "tokens"
]
B, STATE, ACT, CHUNK = 4, 5, 3, 4


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny workloads: with 2 OpenMP threads on a 2-core box shared with other jobs,
    spin-waiting threads made these tests ~10x slower; one thread is fast and stable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def backbone() -> ResidentBackbone:
    return ResidentBackbone.build_tiny()


@pytest.fixture(scope="module")
def real_features(backbone: ResidentBackbone) -> BackboneFeatures:
    g = torch.Generator().manual_seed(0)
    images = [[torch.rand(3, 32, 32, generator=g) for _ in range(1 + i % 3)] for i in range(B)]
    return backbone.encode(images, [f"pick up cube {i}" for i in range(B)])


def _config(kind: str, **overrides: object) -> ActionModuleConfig:
    fields = dict(kind=kind, feature_dim=64, state_dim=STATE, action_dim=ACT, action_chunk=CHUNK, size="tiny")
    fields.update(overrides)
    return ActionModuleConfig(**fields)


def _random_features(batch: int, length: int, dim: int, seed: int) -> BackboneFeatures:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, length + 1, (batch,), generator=g)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    tokens = torch.randn(batch, length, dim, generator=g) * mask.unsqueeze(-1)
    return BackboneFeatures(tokens, mask, tokens.sum(1) / mask.sum(1, keepdim=True))


# ---------------------------------------------------------------- registry / config
def test_registry_lists_both_kinds() -> None:
    assert set(KINDS) <= set(available_action_modules())
    assert available_action_modules() == sorted(ACTION_MODULES)
    for kind in KINDS:
        module = build_action_module(_config(kind))
        assert isinstance(module, ActionModule) and type(module) is ACTION_MODULES[kind]
        assert module.kind == kind
    # A plain mapping is accepted too.
    assert build_action_module(_config("oft_mlp").model_dump()).config == _config("oft_mlp")


def test_unknown_kind_names_field_value_and_allowed() -> None:
    with pytest.raises(ValueError) as info:
        _config("diffusion_transformer")
    message = str(info.value)
    assert "kind" in message and "diffusion_transformer" in message
    for kind in KINDS:
        assert kind in message
    # Bypassing validation still cannot build an unknown kind.
    bogus = ActionModuleConfig.model_construct(**{**_config("oft_mlp").model_dump(), "kind": "nope"})
    with pytest.raises(ValueError, match=r"kind='nope'.*allowed kinds"):
        build_action_module(bogus)


@pytest.mark.parametrize(
    ("field", "value"),
    [("size", "huge"), ("feature_dim", 0), ("state_dim", -1), ("action_dim", 0), ("action_chunk", 0)],
)
def test_bad_fields_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        _config("oft_mlp", **{field: value})


def test_config_is_frozen_and_strict_about_extras() -> None:
    cfg = _config("oft_mlp")
    with pytest.raises(pydantic.ValidationError):
        cfg.action_dim = 7  # type: ignore[misc]
    with pytest.raises(ValueError, match="hidden_size"):
        _config("oft_mlp", hidden_size=3)
    with pytest.raises(ValueError, match="size"):
        _config("oft_mlp", size="gigantic")


def test_register_rejects_duplicates_and_non_modules() -> None:
    with pytest.raises(ValueError, match="already registered"):

        @register_action_module("oft_mlp")
        class Impostor(ActionModule):  # noqa: F841
            pass

    with pytest.raises(TypeError):
        register_action_module("not_a_module")(dict)  # type: ignore[arg-type]
    assert "not_a_module" not in ACTION_MODULES


# ---------------------------------------------------------------- per-kind behaviour
@pytest.mark.parametrize("kind", KINDS)
def test_loss_is_finite_and_only_trains_the_module(
    kind: str, backbone: ResidentBackbone, real_features: BackboneFeatures
) -> None:
    torch.manual_seed(0)
    module = build_action_module(_config(kind, feature_dim=backbone.hidden_size))
    state = torch.randn(B, STATE)
    actions = torch.randn(B, CHUNK, ACT)
    loss = module.loss(real_features, state, actions)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), [
        n for n, g in grads.items() if g is None
    ]
    assert any(g.abs().sum() > 0 for g in grads.values())
    assert all(p.grad is None and not p.requires_grad for p in backbone.model.parameters())
    assert real_features.tokens.grad is None


@pytest.mark.parametrize("kind", KINDS)
def test_predict_shape_and_determinism(kind: str, real_features: BackboneFeatures) -> None:
    torch.manual_seed(0)
    module = build_action_module(_config(kind))
    state = torch.randn(B, STATE)
    a = module.predict(real_features, state, generator=torch.Generator().manual_seed(7))
    b = module.predict(real_features, state, generator=torch.Generator().manual_seed(7))
    assert a.shape == (B, CHUNK, ACT) and torch.isfinite(a).all()
    assert not a.requires_grad
    assert torch.equal(a, b)
    if kind == "flow_matching":
        c = module.predict(real_features, state, generator=torch.Generator().manual_seed(8))
        assert not torch.equal(a, c)  # sampling really starts from the generator's noise
        assert module.predict(real_features, state, num_steps=3).shape == (B, CHUNK, ACT)


@pytest.mark.parametrize("kind", KINDS)
def test_no_state_input(kind: str) -> None:
    module = build_action_module(_config(kind, state_dim=0))
    feats = _random_features(3, 6, 64, seed=1)
    state = torch.zeros(3, 0)
    assert module.predict(feats, state).shape == (3, CHUNK, ACT)
    assert torch.isfinite(module.loss(feats, state, torch.randn(3, CHUNK, ACT)))


@pytest.mark.parametrize("kind", KINDS)
def test_padded_chunk_steps_are_ignored(kind: str) -> None:
    module = build_action_module(_config(kind))
    feats = _random_features(B, 6, 64, seed=2)
    state = torch.randn(B, STATE)
    actions = torch.randn(B, CHUNK, ACT)
    is_pad = torch.zeros(B, CHUNK, dtype=torch.bool)
    is_pad[:, -1] = True
    other = actions.clone()
    other[:, -1] = 1e3  # garbage in padded steps must not change the loss
    other[0, -1, 0] = float("nan")
    la = module.loss(feats, state, actions, is_pad, generator=torch.Generator().manual_seed(0))
    lb = module.loss(feats, state, other, is_pad, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(la, lb)
    other[0, -1, 0] = 0.0
    lc = module.loss(feats, state, other, generator=torch.Generator().manual_seed(0))
    assert lc > 10 * la


@pytest.mark.parametrize("kind", KINDS)
def test_shape_validation_names_tensor(kind: str) -> None:
    module = build_action_module(_config(kind))
    feats = _random_features(B, 6, 64, seed=3)
    state = torch.randn(B, STATE)
    actions = torch.randn(B, CHUNK, ACT)
    with pytest.raises(ValueError, match=r"state: expected shape \(4, 5\).*got \(4, 6\)"):
        module.loss(feats, torch.randn(B, STATE + 1), actions)
    with pytest.raises(ValueError, match=r"actions: expected shape \(4, 4, 3\).*got \(4, 2, 3\)"):
        module.loss(feats, state, torch.randn(B, 2, ACT))
    with pytest.raises(ValueError, match="features.tokens"):
        module.predict(_random_features(B, 6, 32, seed=3), state)
    with pytest.raises(ValueError, match="action_is_pad"):
        module.loss(feats, state, actions, torch.zeros(B, CHUNK + 1, dtype=torch.bool))


@pytest.mark.parametrize("kind", KINDS)
def test_value_head_only_when_asked(kind: str) -> None:
    feats = _random_features(B, 6, 64, seed=4)
    state = torch.randn(B, STATE)
    plain = build_action_module(_config(kind))
    assert plain.value_net is None
    with pytest.raises(RuntimeError, match="value_head"):
        plain.value(feats, state)
    with_value = build_action_module(_config(kind, value_head=True))
    v = with_value.value(feats, state)
    assert v.shape == (B,) and torch.isfinite(v).all()
    v.sum().backward()
    assert all(p.grad is not None for p in with_value.value_net.parameters())
    n_plain = sum(p.numel() for p in plain.parameters())
    assert sum(p.numel() for p in with_value.parameters()) > n_plain


@pytest.mark.parametrize("kind", KINDS)
def test_module_learns_a_fixed_mapping(kind: str) -> None:
    """200 Adam steps on fixed data (actions = f(state)) cut the loss by >= 5x."""
    torch.manual_seed(0)
    batch = 16
    feats = _random_features(batch, 6, 64, seed=5)
    g = torch.Generator().manual_seed(6)
    state = torch.randn(batch, STATE, generator=g)
    weights = torch.randn(STATE, ACT, generator=g)
    ramp = torch.linspace(0.5, 1.5, CHUNK)
    actions = torch.tanh(state @ weights).unsqueeze(1) * ramp.view(1, CHUNK, 1)
    module = build_action_module(_config(kind))

    def eval_loss() -> float:
        # Flow-matching loss is stochastic: average fixed draws so before/after compare fairly.
        gen = torch.Generator().manual_seed(123)
        with torch.no_grad():
            return sum(module.loss(feats, state, actions, generator=gen).item() for _ in range(8)) / 8

    def predict_error() -> float:
        pred = module.predict(feats, state, generator=torch.Generator().manual_seed(1))
        return (pred - actions).pow(2).mean().item()

    before, before_pred = eval_loss(), predict_error()
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    for _ in range(200):
        loss = module.loss(feats, state, actions)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = eval_loss()
    assert after * 5 <= before, (before, after)
    # Sampling must agree with training (catches sign/direction errors in the Euler loop).
    assert predict_error() * 5 <= before_pred


def test_stochastic_oft_head_is_a_gaussian_policy_around_its_prediction() -> None:
    cfg = _config("oft_mlp", stochastic=True, value_head=True)
    module = build_action_module(cfg)
    features = _random_features(3, 5, cfg.feature_dim, seed=7)
    state = torch.randn(3, cfg.state_dim)
    dist = module.action_distribution(features, state)
    assert dist.mean.shape == (3, cfg.action_chunk, cfg.action_dim)
    torch.testing.assert_close(dist.mean, module.predict(features, state))
    actions = dist.sample()
    log_prob = dist.log_prob(actions).sum(dim=(-1, -2))
    log_prob.sum().backward()
    assert module.log_std.grad is not None and module.log_std.grad.abs().sum() > 0


def test_an_rl_oft_head_starts_with_its_mean_near_zero_and_an_sft_head_does_not() -> None:
    features = _random_features(16, 5, 64, seed=3)
    state = torch.randn(16, STATE) * 3
    torch.manual_seed(0)
    rl = build_action_module(_config("oft_mlp", stochastic=True, value_head=True)).predict(features, state)
    torch.manual_seed(0)
    sft = build_action_module(_config("oft_mlp")).predict(features, state)
    # Exploration comes from the Gaussian (std exp(-0.5) = 0.61), not from a random mean per state.
    assert rl.abs().max() < 0.05 < sft.abs().max()


@pytest.mark.parametrize("kind", ["oft_mlp", "flow_matching"])
def test_state_normalization_keeps_running_statistics_and_feeds_the_standardized_state(kind: str) -> None:
    """`normalize_state`: batches fold into one running mean/variance (equal to the statistics of all
    of them together), saved with the module; the layers see (state - mean) / std, clipped."""
    from joynexus.models.action_modules.base import STATE_CLIP

    g = torch.Generator().manual_seed(4)
    first, second = torch.randn(40, STATE, generator=g) * 3 + 2, torch.randn(24, STATE, generator=g) * 0.5 - 1
    torch.manual_seed(0)
    module = build_action_module(_config(kind, value_head=True, normalize_state=True))
    plain = build_action_module(_config(kind, value_head=True))
    statistics = ("state_mean", "state_var", "state_count")
    assert not [name for name, _ in plain.named_parameters() if name.startswith(statistics)]
    state = torch.randn(3, STATE, generator=g)
    torch.testing.assert_close(module.normalized_state(state), state)  # nothing seen yet: identity
    module.observe_states(first)
    module.observe_states(second)
    both = torch.cat([first, second]).double()
    torch.testing.assert_close(module.state_mean.double(), both.mean(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(module.state_var.double(), both.var(0, unbiased=False), atol=1e-5, rtol=1e-5)
    assert float(module.state_count) == 64
    std = both.var(0, unbiased=False).sqrt().float()
    expected = ((state - both.mean(0).float()) / std).clamp(-STATE_CLIP, STATE_CLIP)
    torch.testing.assert_close(module.normalized_state(state), expected, atol=1e-5, rtol=1e-5)
    assert module.normalized_state(torch.full((1, STATE), 1e6)).max() == STATE_CLIP
    # The statistics are not trained and travel in the state dict (checkpoints, publications).
    assert all(not p.requires_grad for name, p in module.named_parameters() if name.startswith(statistics))
    copy = build_action_module(_config(kind, value_head=True, normalize_state=True))
    copy.load_state_dict(module.state_dict())
    features = _random_features(3, 5, 64, seed=5)
    torch.testing.assert_close(copy.value(features, state), module.value(features, state))
    # The head reads the standardized state: shifting the statistics changes what it computes.
    with torch.no_grad():
        copy.state_mean.add_(1.0)
    assert not torch.allclose(copy.value(features, state), module.value(features, state))


def test_rl_needs_a_kind_with_a_tractable_density() -> None:
    # flow_matching's density is over its noise-injected chain (test_flow_rl); it has no closed-form one.
    with pytest.raises(RuntimeError, match="denoising chain"):
        module = build_action_module(_config("flow_matching", stochastic=True))
        module.action_distribution(_random_features(1, 2, module.config.feature_dim, 0), torch.zeros(1, STATE))
    with pytest.raises(RuntimeError, match="stochastic=False"):
        module = build_action_module(_config("oft_mlp"))
        module.action_distribution(_random_features(1, 2, module.config.feature_dim, 0), torch.zeros(1, 4))
