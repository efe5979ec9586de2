"""A plain Hugging Face checkpoint directory written by transformers itself, as a user brings one:
``save_pretrained`` of a tiny Idefics3 (SmolVLM architecture) ``ForConditionalGeneration`` model,
sharded, and of its ``Idefics3Processor`` (image processor without image splitting, a WordLevel
tokenizer built offline with ``tokenizers``, a chat template of its own). No JoyNexus file."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessor,
    Idefics3Processor,
    PreTrainedTokenizerFast,
)

HF_MODEL_ID = "HuggingFaceTB/SmolVLM-test-tiny"  # the config's _name_or_path (see write_plain_hf_checkpoint)
IMAGE_SIDE = 32
IMAGE_MEAN = [0.485, 0.456, 0.406]  # not the tiny preset's 0.5: the test sees they come from the file
IMAGE_STD = [0.229, 0.224, 0.225]
# Its own prompt ("Robot:" where the built-in one says "Assistant:"): the test sees it comes from here.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}: "
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Robot:' }}{% endif %}"
)
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<global-img>",
    "<image>",
)
WORDS = (
    "user robot assistant : , . pick up the red green blue cube block and place it in bowl push to left right "
    "open close drawer move pusher t-shaped goal fold towel what action should take"
).split()


def offline_tokenizer() -> PreTrainedTokenizerFast:
    """A WordLevel tokenizer with the special tokens Idefics3Processor needs (no hub, no files)."""
    tokens = dict.fromkeys([*SPECIAL_TOKENS, *(w.capitalize() for w in WORDS), *WORDS])  # unique, in order
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<fake_token_around_image>", "<global-img>", "<image>"],
    )


def tiny_idefics3(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Idefics3ForConditionalGeneration:
    text_config = {
        "model_type": "llama",
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    vision_config = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "patch_size": 8,
        "image_size": IMAGE_SIDE,
    }
    config = Idefics3Config(
        vision_config=vision_config,
        text_config=text_config,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config).eval()
    return model


def write_plain_hf_checkpoint(
    root: Path, *, max_shard_size: str | None = "200KB", name_or_path: str | None = HF_MODEL_ID, seed: int = 0
) -> Path:
    """Write the directory as transformers does (sharded when ``max_shard_size`` is given).
    ``name_or_path``: the config's ``_name_or_path``, as hub checkpoints written by earlier
    transformers versions carry it (4.57 leaves it out of config.json); None: none."""
    tokenizer = offline_tokenizer()
    model = tiny_idefics3(tokenizer, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(root, safe_serialization=True, **kwargs)
    image_processor = Idefics3ImageProcessor(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIDE},
        max_image_size={"longest_edge": IMAGE_SIDE},
        image_mean=IMAGE_MEAN,
        image_std=IMAGE_STD,
    )
    tokens_per_tile = (IMAGE_SIDE // 8) ** 2 // 2**2
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=tokens_per_tile, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(root)
    if name_or_path is not None:
        config = json.loads((root / "config.json").read_text())
        (root / "config.json").write_text(json.dumps({"_name_or_path": name_or_path, **config}, indent=2))
    return root
