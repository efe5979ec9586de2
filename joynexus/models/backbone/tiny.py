"""The built-in random-weight backbone presets (`TinyBackboneSpec`) and the offline tokenizer
they use: byte-level BPE trained in code on robot instructions, with the Idefics3 / SmolVLM
special tokens and chat template (no hub, no files)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "END_OF_UTTERANCE_TOKEN",
    "EOS_TOKEN",
    "FAKE_IMAGE_TOKEN",
    "GLOBAL_IMAGE_TOKEN",
    "IMAGE_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TinyBackboneSpec",
    "spec_model_id",
    "train_tokenizer",
]

# Special tokens of the Idefics3 / SmolVLM prompt format.
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE_TOKEN = "<end_of_utterance>"
SPECIAL_TOKENS = (
    PAD_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    END_OF_UTTERANCE_TOKEN,
    FAKE_IMAGE_TOKEN,
    GLOBAL_IMAGE_TOKEN,
    IMAGE_TOKEN,
)
# Chat template matching the hand-built prompt in ``ResidentBackbone._prompt_ids``.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# A few dozen robot instructions: enough for byte-level BPE to learn useful merges.
_TOKENIZER_CORPUS = (
    "pick up the red cube and place it in the bowl",
    "push the green block to the left",
    "open the top drawer",
    "close the top drawer",
    "put the apple on the plate",
    "stack the blue cube on the red cube",
    "pick up the sponge and wipe the table",
    "move the gripper to the right",
    "turn on the stove",
    "turn off the faucet",
    "place the mug on the coaster",
    "insert the peg into the hole",
    "pull the handle of the cabinet",
    "push the button on the microwave",
    "put the spoon in the cup",
    "pick the banana from the basket",
    "slide the box to the front of the table",
    "rotate the knob clockwise",
    "lift the lid off the pot",
    "put the bottle in the fridge",
    "grasp the pen and put it in the holder",
    "fold the towel in half",
    "pour water from the cup into the bowl",
    "hang the cloth on the rack",
    "sort the blocks by color",
    "move the yellow sphere next to the green cube",
    "reach the target position",
    "push the t-shaped block into the goal region",
    "pick up the cube",
    "place the cube on the target",
    "open the door",
    "close the window",
    "press the red button twice",
    "put the carrot in the pot",
    "pick up the bowl and put it in the sink",
    "move the plate to the left side of the table",
    "unstack the cubes",
    "put the book on the shelf",
    "grab the handle and pull it toward you",
    "wipe the spill with the towel",
    "User: Assistant: what action should the robot take?",
    "0 1 2 3 4 5 6 7 8 9 step camera left right front wrist top",
)


@dataclass(frozen=True)
class TinyBackboneSpec:
    """Size of a randomly initialized backbone built in code (no hub)."""

    name: str = "tiny"
    vision_hidden_size: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    patch_size: int = 8
    image_size: int = 32
    scale_factor: int = 2
    text_hidden_size: int = 64
    text_layers: int = 2
    text_heads: int = 4
    max_images: int = 3
    max_position_embeddings: int = 512
    max_instruction_tokens: int = 64
    tokenizer_vocab_size: int = 512

    def __post_init__(self) -> None:
        if self.image_size % (self.patch_size * self.scale_factor) != 0:
            raise ValueError(
                f"TinyBackboneSpec.image_size={self.image_size} must be a multiple of "
                f"patch_size*scale_factor={self.patch_size * self.scale_factor}"
            )
        if self.vision_hidden_size % self.vision_heads or self.text_hidden_size % self.text_heads:
            raise ValueError("TinyBackboneSpec hidden sizes must be divisible by their head counts")
        if self.max_images < 1:
            raise ValueError(f"TinyBackboneSpec.max_images must be >= 1, got {self.max_images}")

    @classmethod
    def preset(cls, name: str) -> TinyBackboneSpec:
        """Named sizes: "tiny" for tests, "small" for benchmarks."""
        presets = _SPEC_PRESETS
        if name not in presets:
            raise ValueError(f"unknown backbone preset {name!r}; allowed presets: {sorted(presets)}")
        return presets[name]

    @property
    def image_seq_len(self) -> int:
        """Image tokens per camera after the pixel-shuffle connector."""
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2


_SPEC_PRESETS: dict[str, TinyBackboneSpec] = {
    "tiny": TinyBackboneSpec(),
    "small": TinyBackboneSpec(
        name="small",
        vision_hidden_size=64,
        vision_layers=2,
        vision_heads=4,
        image_size=64,
        text_hidden_size=128,
        text_layers=4,
        text_heads=4,
    ),
}


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained in code on robot instructions, with the VLM's special tokens.

    Byte-level means every string tokenizes (no unknown token); training on a fixed
    corpus is deterministic.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_CORPUS, trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # So that HF's own processor path (add_special_tokens=True) starts with BOS like ours.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[END_OF_UTTERANCE_TOKEN, FAKE_IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, IMAGE_TOKEN],
        padding_side="right",
        model_max_length=4096,
    )


def spec_model_id(spec: TinyBackboneSpec, seed: int) -> str:
    """Readable id for presets at seed 0; otherwise suffixed with a digest of spec+seed,
    so two backbones with different weights never share a prefix key."""
    base = f"joynexus/{spec.name}-smolvlm"
    if seed == 0 and _SPEC_PRESETS.get(spec.name) == spec:
        return base
    digest = hashlib.sha256(json.dumps([dataclasses.asdict(spec), seed], sort_keys=True).encode()).hexdigest()
    return f"{base}-{digest[:10]}"
