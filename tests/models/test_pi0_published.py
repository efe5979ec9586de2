"""π0 / π0.5 at their published sizes (slow): PaliGemma 3B (SigLIP So400m/14 at 224 px + Gemma 2B,
the ``paligemma-3b`` preset) in bfloat16 and Gemma-300M experts (bfloat16, projections float32, as
LeRobot keeps them), one grouped predict of a π0 and a π0.5 tenant over ONE prefix forward."""

from __future__ import annotations

import pytest
import torch

from joynexus.models.action_modules import ActionModuleConfig, PrefixRows, build_action_module, by_prefix_layout
from joynexus.models.action_modules.pi0 import GEMMA_VARIANTS, PI0ActionModule
from joynexus.models.backbone.paligemma import PALIGEMMA_PRESETS, PaliGemmaBackbone
from joynexus.models.placement import DevicePlacement

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # minutes of CPU at 3B


def test_published_pi0_and_pi05_tenants_predict_from_one_bfloat16_prefix():
    backbone = PaliGemmaBackbone.build_tiny(
        PALIGEMMA_PRESETS["paligemma-3b"], placement=DevicePlacement(device="cpu", dtype="bfloat16")
    )
    params = backbone.parameter_count()
    assert 2.8e9 < params < 3.1e9, params  # PaliGemma 3B: ~2.92B
    geometry = backbone.prefix_geometry
    width, depth, mlp, *_ = GEMMA_VARIANTS["gemma_300m"]
    modules = []
    for kind in ("pi0", "pi05"):
        config = ActionModuleConfig(
            kind=kind, feature_dim=backbone.hidden_size, state_dim=6, action_dim=6, action_chunk=50, num_steps=10,
            expert_width=width, expert_mlp_dim=mlp, image_resolution=224, vlm_depth=depth, tokenizer_max_length=200,
            vlm_num_heads=geometry.num_heads, vlm_num_kv_heads=geometry.num_kv_heads, vlm_head_dim=geometry.head_dim,
        )  # fmt: skip
        module = build_action_module(config).eval()
        module.gemma_expert.to(torch.bfloat16)
        modules.append(module)
    expert = sum(p.numel() for p in modules[0].gemma_expert.parameters())
    assert 2.5e8 < expert < 3.5e8, expert  # Gemma 300M without its embeddings
    assert list(by_prefix_layout(modules).values()) == [[0, 1]]  # one prefix layout: one forward
    g = torch.Generator().manual_seed(0)
    members = [
        PrefixRows(m, [[torch.rand(3, 224, 224, generator=g)]], ["pick up the red cube"], torch.rand(1, 6) * 2 - 1)
        for m in modules
    ]
    with torch.inference_mode():
        prefixes = PI0ActionModule.layer_prefixes(backbone, members)
        actions = [
            m.module.predict(p, m.state, torch.Generator().manual_seed(1))
            for m, p in zip(members, prefixes, strict=True)
        ]
    assert prefixes[0].keys[0].dtype == torch.bfloat16 and prefixes[0].num_layers == 18
    assert prefixes[0].length >= 256 + 2  # 256 image tokens, <bos> and the task
    for out in actions:
        assert out.shape == (1, 50, 6) and out.dtype == torch.float32 and torch.isfinite(out).all()
