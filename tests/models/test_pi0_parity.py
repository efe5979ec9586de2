"""The ``pi0`` and ``pi05`` kinds against LeRobot's own π0 / π0.5 (lerobot 0.4.4) as the oracle.

LeRobot's ``PI0Pytorch`` / ``PI05Pytorch`` are built at small dimensions: LeRobot knows only the
published Gemma variants, so the test registers small ones in its variant table
(``get_gemma_config``) and gives its ``PaliGemmaWithExpertModel`` our resident backbone's small
PaliGemma config (the published one is SigLIP So400m + Gemma 2B; `test_published_sizes` below
builds those). The oracle runs on transformers patched as openpi patches it
(`tests/models/openpi_transformers.py`). For the same weights, inputs, noise and time, predict
(every row of two π0 tenants and a π0.5 tenant from ONE prefix forward), the training loss and the
expert's gradients equal LeRobot's within float32 tolerance.
"""

from __future__ import annotations

import pytest
import torch
from transformers import PaliGemmaForConditionalGeneration

from joynexus.artifacts.openpi_transformers import openpi_transformers
from joynexus.models.action_modules import ActionModuleConfig, PrefixRows, build_action_module, by_prefix_layout
from joynexus.models.action_modules.pi0 import PI0ActionModule
from joynexus.models.backbone.paligemma import PaliGemmaBackbone, PaliGemmaSpec, paligemma_config

ATOL, RTOL = 2e-5, 1e-4
SPEC = PaliGemmaSpec(name="paligemma-parity", width=64, depth=2, mlp_dim=128, head_dim=8, image_size=28)
EXPERT = (32, 2, 64, 8, 1, 8)  # width, depth, mlp_dim, heads, kv_heads, head_dim
STATE_DIM, ACTION_DIM, CHUNK, STEPS = 3, 2, 4, 3
TASKS = ["pick up the red cube", "push the green block to the left", "open the top drawer"]


@pytest.fixture(scope="module")
def backbone() -> PaliGemmaBackbone:
    return PaliGemmaBackbone.build_tiny(SPEC, seed=3)


def tenant(kind: str, backbone: PaliGemmaBackbone, seed: int) -> PI0ActionModule:
    geometry = backbone.prefix_geometry
    config = ActionModuleConfig(
        kind=kind,
        feature_dim=backbone.hidden_size,
        state_dim=STATE_DIM,
        action_dim=ACTION_DIM,
        action_chunk=CHUNK,
        num_steps=STEPS,
        max_state_dim=6,
        max_action_dim=5,
        expert_width=EXPERT[0],
        expert_mlp_dim=EXPERT[2],
        tokenizer_max_length=40 if kind == "pi05" else 16,
        image_resolution=SPEC.image_size,
        vlm_depth=SPEC.depth,
        vlm_num_heads=geometry.num_heads,
        vlm_num_kv_heads=geometry.num_kv_heads,
        vlm_head_dim=geometry.head_dim,
    )
    torch.manual_seed(seed)
    module = build_action_module(config)
    with torch.no_grad():  # non-trivial norms and adaRMS gates (their inits are zeros)
        for name, p in module.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return module.eval()


def lerobot_model(kind: str, module: PI0ActionModule, backbone: PaliGemmaBackbone, monkeypatch) -> torch.nn.Module:
    """LeRobot's PI0Pytorch / PI05Pytorch at our small shapes with our weights (call in openpi_transformers)."""
    if kind == "pi0":
        from lerobot.policies.pi0 import modeling_pi0 as modeling
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
    else:
        from lerobot.policies.pi05 import modeling_pi05 as modeling
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
    vlm = modeling.GemmaConfig(SPEC.width, SPEC.depth, SPEC.mlp_dim, SPEC.num_heads, SPEC.num_kv_heads, SPEC.head_dim)
    expert = modeling.GemmaConfig(*EXPERT)
    monkeypatch.setattr(modeling, "get_gemma_config", lambda variant: vlm if variant == "gemma_2b" else expert)

    def small_paligemma(config):
        ours = paligemma_config(SPEC)
        ours.text_config.use_adarms, ours.text_config.adarms_cond_dim = False, None
        return PaliGemmaForConditionalGeneration(ours)

    monkeypatch.setattr(modeling, "PaliGemmaForConditionalGeneration", small_paligemma)
    cfg = module.config
    config = Config(
        chunk_size=CHUNK,
        n_action_steps=CHUNK,
        num_inference_steps=STEPS,
        max_state_dim=cfg.max_state_dim,
        max_action_dim=cfg.max_action_dim,
        tokenizer_max_length=cfg.tokenizer_max_length,
        image_resolution=(SPEC.image_size, SPEC.image_size),
        dtype="float32",
        train_expert_only=True,
        device="cpu",
    )
    model = modeling.PI0Pytorch(config) if kind == "pi0" else modeling.PI05Pytorch(config)
    pwe = model.paligemma_with_expert
    pwe.paligemma.load_state_dict(backbone.model.state_dict())
    expert_state = {k.removeprefix("gemma_expert."): v for k, v in module.state_dict().items() if "gemma_expert" in k}
    missing, unexpected = pwe.gemma_expert.load_state_dict(expert_state, strict=False)
    assert not unexpected and missing == ["lm_head.weight"], (missing, unexpected)
    rest = {k: v for k, v in module.state_dict().items() if "gemma_expert" not in k and k != "log_std"}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    assert not unexpected and all(k.startswith("paligemma_with_expert.") for k in missing), unexpected
    return model.eval()


def inputs(batch: int, seed: int) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # one camera at the model's side, one that LeRobot resizes with padding
    cams = [[torch.rand(3, 28, 28, generator=g), torch.rand(3, 20, 36, generator=g)] for _ in range(batch)]
    return cams, torch.rand(batch, STATE_DIM, generator=g) * 2 - 1


def lerobot_inputs(kind: str, module: PI0ActionModule, backbone, cams, tasks, state):
    """LeRobot's preprocessing of the same rows (`PI0Policy._preprocess_images`, its processors)."""
    from lerobot.policies.pi0.modeling_pi0 import pad_vector, resize_with_pad_torch

    images, masks = [], []
    for c in range(len(cams[0])):
        img = torch.stack([row[c] for row in cams]).permute(0, 2, 3, 1)
        if img.shape[1:3] != (SPEC.image_size, SPEC.image_size):
            img = resize_with_pad_torch(img, SPEC.image_size, SPEC.image_size)
        images.append((img * 2.0 - 1.0).permute(0, 3, 1, 2))
        masks.append(torch.ones(len(cams), dtype=torch.bool))
    if kind == "pi0":
        prompts = [t if t.endswith("\n") else f"{t}\n" for t in tasks]
    else:
        from lerobot.policies.pi05.processor_pi05 import Pi05PrepareStateTokenizerProcessorStep
        from lerobot.processor.core import TransitionKey

        step = Pi05PrepareStateTokenizerProcessorStep(max_state_dim=module.config.max_state_dim)
        out = step(
            {TransitionKey.OBSERVATION: {"observation.state": state}, TransitionKey.COMPLEMENTARY_DATA: {"task": tasks}}
        )
        prompts = out[TransitionKey.COMPLEMENTARY_DATA]["task"]
    tok = backbone.tokenizer(
        prompts,
        max_length=module.config.tokenizer_max_length,
        truncation=True,
        padding="max_length",
        return_tensors="pt",
    )
    return images, masks, tok["input_ids"], tok["attention_mask"].bool(), pad_vector(state, module.config.max_state_dim)


def oracle_predict(kind, model, images, masks, tokens, token_mask, state, noise):
    if kind == "pi0":
        return model.sample_actions(images, masks, tokens, token_mask, state, noise=noise)
    return model.sample_actions(images, masks, tokens, token_mask, noise=noise)


def test_one_prefix_forward_serves_pi0_and_pi05_tenants_and_each_equals_lerobot(backbone, monkeypatch):
    modules = {"a": tenant("pi0", backbone, 1), "b": tenant("pi0", backbone, 2), "c": tenant("pi05", backbone, 3)}
    rows = {name: inputs(len(TASKS) - i, 10 + i) for i, name in enumerate(modules)}
    members = [PrefixRows(m, rows[n][0], TASKS[: len(rows[n][0])], rows[n][1]) for n, m in modules.items()]
    groups = by_prefix_layout([m.module for m in members])
    prefixes = {}
    for (owner, _), indices in groups.items():
        for i, prefix in zip(indices, owner.layer_prefixes(backbone, [members[i] for i in indices]), strict=True):
            prefixes[list(modules)[i]] = prefix
    assert list(groups.values())[0] == [0, 1]  # the two π0 tenants in one prefix forward
    for name, module in modules.items():
        cams, state = rows[name]
        noise = module.draw_noise(len(cams), torch.Generator().manual_seed(7))
        ours = module.predict(prefixes[name], state, noise=noise)
        kind = module.kind
        with openpi_transformers():
            model = lerobot_model(kind, module, backbone, monkeypatch)
            args = lerobot_inputs(kind, module, backbone, cams, TASKS[: len(cams)], state)
            theirs = oracle_predict(kind, model, *args, noise)[:, :, :ACTION_DIM]
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)


def test_pi0_and_pi05_share_one_prefix_forward_when_their_layouts_match(backbone):
    a, c = tenant("pi0", backbone, 1), tenant("pi05", backbone, 3)
    layout_a = a.config.model_copy(update={"tokenizer_max_length": 40})
    a2 = build_action_module(layout_a)
    groups = by_prefix_layout([a2, c])
    assert list(groups.values()) == [[0, 1]], groups
    cams, state = inputs(2, 5)
    both = PI0ActionModule.layer_prefixes(
        backbone, [PrefixRows(a2, cams, TASKS[:2], state), PrefixRows(c, cams, TASKS[:2], state)]
    )
    alone = PI0ActionModule.layer_prefixes(backbone, [PrefixRows(c, cams, TASKS[:2], state)])[0]
    for k_both, k_alone in zip(both[1].keys, alone.keys, strict=True):
        torch.testing.assert_close(k_both[:, : alone.length], k_alone, atol=1e-6, rtol=1e-5)
    # the π0.5 rows' prompts hold the state, π0's do not: their prefixes differ
    assert both[1].length > both[0].length


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_loss_and_expert_gradients_equal_lerobot(kind, backbone, monkeypatch):
    module = tenant(kind, backbone, 4).train()
    cams, state = inputs(3, 21)
    g = torch.Generator().manual_seed(9)
    actions = torch.randn(3, CHUNK, ACTION_DIM, generator=g)
    noise = module.draw_noise(3, g)
    time = module.sample_time(3, g, torch.device("cpu"))
    prefix = PI0ActionModule.layer_prefixes(backbone, [PrefixRows(module, cams, TASKS, state)], grad=True)[0]
    ours = module.loss(prefix, state, actions, noise=noise, time=time)
    ours.backward()
    with openpi_transformers():
        model = lerobot_model(kind, module, backbone, monkeypatch).train()
        images, masks, tokens, token_mask, padded_state = lerobot_inputs(kind, module, backbone, cams, TASKS, state)
        padded_actions = torch.nn.functional.pad(actions, (0, module.config.max_action_dim - ACTION_DIM))
        if kind == "pi0":
            losses = model.forward(images, masks, tokens, token_mask, padded_state, padded_actions, noise, time)
        else:
            losses = model.forward(images, masks, tokens, token_mask, padded_actions, noise, time)
        theirs = losses[:, :, :ACTION_DIM].mean()
        theirs.backward()
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)
    oracle = dict(model.named_parameters())
    compared = 0
    for name, p in module.named_parameters():
        if name == "log_std":
            continue
        other = oracle[f"paligemma_with_expert.{name}" if name.startswith("gemma_expert.") else name]
        assert p.grad is not None and other.grad is not None, name
        torch.testing.assert_close(p.grad, other.grad, atol=1e-5, rtol=1e-3, msg=name)
        compared += 1
    assert compared == len([n for n, _ in module.named_parameters() if n != "log_std"]) > 10
    # the frozen PaliGemma got no gradient in either
    assert all(p.grad is None for p in backbone.model.parameters())


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_the_flow_rl_chain_density_of_a_sample_is_the_one_rescored(kind, backbone):
    """π0 / π0.5 RL goes through the flow-RL path `PrefixFlowExpert` shares with SmolVLA: the density
    a sample was drawn with is the one the trainer rescores, and it reaches the expert and its std."""
    module = build_action_module(tenant(kind, backbone, 5).config.model_copy(update={"stochastic": True}))
    cams, state = inputs(2, 31)
    rows = PrefixRows(module, cams, TASKS[:2], state)
    with torch.no_grad():
        prefix = PI0ActionModule.layer_prefixes(backbone, [rows])[0]
        noise = torch.randn(2, *module.sample_noise_shape(), generator=torch.Generator().manual_seed(0))
        actions, density, chain = module.sample_policy(prefix, state, noise)
    assert actions.shape == (2, CHUNK, ACTION_DIM) and chain.shape == (2, STEPS + 1, CHUNK, 5)
    torch.testing.assert_close(chain[:, -1, :, :ACTION_DIM], actions)
    rescored, entropy = module.record_log_prob(
        PI0ActionModule.layer_prefixes(backbone, [rows], grad=True)[0], state, chain
    )
    torch.testing.assert_close(rescored, density, atol=1e-4, rtol=1e-5)
    rescored.sum().backward()
    assert module.log_std.grad is not None and module.action_in_proj.weight.grad.abs().sum() > 0
    assert entropy.shape == (2,)
