"""A plain Hugging Face Qwen3-VL checkpoint directory written by transformers itself, as a user brings
one: ``save_pretrained`` of a tiny ``Qwen3VLForConditionalGeneration`` (sharded) and of its
``Qwen3VLProcessor`` (the Qwen2-VL image processor, the Qwen3-VL video processor the processor
requires, a byte-level BPE ``Qwen2TokenizerFast`` trained offline with ``tokenizers``, whose special
tokens are added after the vocabulary as in Qwen's own, and a chat template of its own). No
JoyNexus file."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    Qwen2TokenizerFast,
    Qwen2VLImageProcessorFast,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

HF_MODEL_ID = "Qwen/Qwen3-VL-test-tiny"  # the config's _name_or_path (see write_qwen_hf_checkpoint)
PATCH, MERGE = 8, 2
# The processor's pixel range: a square side S (a multiple of 16) is kept when 16^2 <= S^2 <= 48^2,
# so the family's 224-pixel default is outside it and the backbone serves the largest side, 48.
MIN_PIXELS, MAX_PIXELS = 16 * 16, 48 * 48
SERVED_SIDE = 48
# Qwen2-VL's OpenAI-CLIP normalization, not Qwen3-VL's 0.5: the test sees they come from the file.
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
SYSTEM_PROMPT = "You are a robot."
# In the style of the Qwen-VL templates (Qwen3-VL's render_content macro; Qwen2-VL's default system
# turn, here a prompt of its own so the test sees the prompt comes from this file), abridged: no tools.
CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- macro render_content(content) %}{%- if content is string %}{{- content }}{%- else %}"
    "{%- for item in content %}"
    "{%- if 'image' in item or 'image_url' in item or item.type == 'image' %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif 'video' in item or item.type == 'video' %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in item %}{{- item.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- endmacro %}"
    "{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\\n" + SYSTEM_PROMPT + "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
CORPUS = (
    "system user assistant You are a robot.",
    "pick up the red cube and place it in the bowl",
    "push the green block to the left",
    "open the top drawer and close it",
    "move the pusher to the t-shaped goal",
    "fold the towel",
)


def offline_tokenizer() -> Qwen2TokenizerFast:
    """Byte-level BPE trained in code, the Qwen-VL special tokens added after its vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return Qwen2TokenizerFast(
        tokenizer_object=tok,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )


def tiny_qwen3_vl(tokenizer: Qwen2TokenizerFast, seed: int = 0) -> Qwen3VLForConditionalGeneration:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "rope_theta": 5_000_000.0,
        "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": PATCH,
        "temporal_patch_size": 2,
        "spatial_merge_size": MERGE,
        "out_hidden_size": 64,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
    }
    config = Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,  # as the 2B release
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3VLForConditionalGeneration(config).eval()


def write_qwen_hf_checkpoint(
    root: Path, *, max_shard_size: str | None = "200KB", name_or_path: str | None = HF_MODEL_ID, seed: int = 0
) -> Path:
    """Write the directory as transformers does (sharded when ``max_shard_size`` is given);
    ``name_or_path``: the config's ``_name_or_path`` as earlier transformers versions wrote it."""
    tokenizer = offline_tokenizer()
    model = tiny_qwen3_vl(tokenizer, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(root, safe_serialization=True, **kwargs)
    image_processor = Qwen2VLImageProcessorFast(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=PATCH,
        temporal_patch_size=2,
        merge_size=MERGE,
        image_mean=IMAGE_MEAN,
        image_std=IMAGE_STD,
    )
    video_processor = Qwen3VLVideoProcessor(patch_size=PATCH, temporal_patch_size=2, merge_size=MERGE)
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(root)
    if name_or_path is not None:
        config = json.loads((root / "config.json").read_text())
        (root / "config.json").write_text(json.dumps({"_name_or_path": name_or_path, **config}, indent=2))
    return root
