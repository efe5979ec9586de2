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
    """Size of a randomly initialized Idefics3 / SmolVLM backbone built in code (no hub).

    ``image_size`` is the canonical square side cameras are resized to; ``vision_grid_image_size``
    is the vision config's own ``image_size`` (its position-embedding grid, None = ``image_size``).
    The real-size presets keep their published grid (512 px) while `with_overrides` may serve them
    at a smaller canonical side, so their parameter count stays the published one; Idefics3's vision
    embeddings bucket a smaller patch grid onto the configured one.
    """

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
    # Published-size fields (None: the small presets' rules, 4x hidden MLPs, as many KV heads as heads,
    # the tokenizer's length as vocabulary).
    text_kv_heads: int | None = None
    text_intermediate_size: int | None = None
    vision_intermediate_size: int | None = None
    vocab_size: int | None = None
    vision_grid_image_size: int | None = None
    rope_theta: float = 10000.0
    # SmolVLA's trick: features from the first K text layers only (the others are never built).
    feature_layers: int | None = None

    def __post_init__(self) -> None:
        if self.image_size % (self.patch_size * self.scale_factor) != 0:
            raise ValueError(
                f"TinyBackboneSpec.image_size={self.image_size} (preset {self.name!r}) must be a multiple of "
                f"patch_size*scale_factor={self.patch_size * self.scale_factor}"
            )
        if self.grid_image_size % self.patch_size != 0:
            raise ValueError(
                f"TinyBackboneSpec.vision_grid_image_size={self.grid_image_size} must be a multiple of "
                f"patch_size={self.patch_size}"
            )
        if self.vision_hidden_size % self.vision_heads or self.text_hidden_size % self.text_heads:
            raise ValueError("TinyBackboneSpec hidden sizes must be divisible by their head counts")
        if self.text_heads % self.kv_heads != 0:
            raise ValueError(f"TinyBackboneSpec.text_kv_heads={self.kv_heads} must divide text_heads={self.text_heads}")
        if self.max_images < 1:
            raise ValueError(f"TinyBackboneSpec.max_images must be >= 1, got {self.max_images}")
        if self.feature_layers is not None and not 1 <= self.feature_layers <= self.text_layers:
            raise ValueError(
                f"TinyBackboneSpec.feature_layers={self.feature_layers} (preset {self.name!r}) must be in "
                f"1..text_layers={self.text_layers}"
            )

    @classmethod
    def preset(cls, name: str) -> TinyBackboneSpec:
        """Named sizes: "tiny" for tests, "small" for benchmarks, "smolvlm-256m" / "smolvlm-500m"
        at their published dimensions (random weights)."""
        presets = _SPEC_PRESETS
        if name not in presets:
            raise ValueError(f"unknown backbone preset {name!r}; allowed presets: {sorted(presets)}")
        return presets[name]

    def with_overrides(self, image_size: int | None = None, feature_layers: int | None = None) -> TinyBackboneSpec:
        """This size served at another canonical image side and/or with only the first
        ``feature_layers`` text layers; the vision position grid stays the preset's."""
        changes: dict[str, int] = {}
        if image_size is not None and image_size != self.image_size:
            changes.update(image_size=int(image_size), vision_grid_image_size=self.grid_image_size)
        if feature_layers is not None:
            changes["feature_layers"] = int(feature_layers)
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def image_seq_len(self) -> int:
        """Image tokens per camera after the pixel-shuffle connector."""
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2

    @property
    def grid_image_size(self) -> int:
        """The vision config's image_size (its position-embedding grid)."""
        return self.vision_grid_image_size or self.image_size

    @property
    def kv_heads(self) -> int:
        return self.text_kv_heads or self.text_heads

    @property
    def built_text_layers(self) -> int:
        """Text layers the model is built with (``feature_layers`` when set)."""
        return self.feature_layers or self.text_layers


# Published dimensions of SmolVLM-256M/500M(-Instruct), the backbone class SmolVLA uses. Sources:
# - model cards https://huggingface.co/HuggingFaceTB/SmolVLM-256M-Instruct and .../SmolVLM-500M-Instruct:
#   base models SmolLM2-135M-Instruct / SmolLM2-360M-Instruct + google/siglip-base-patch16-512,
#   Idefics3 architecture, "64 visual tokens to encode image patches of size 512x512"
#   ((512/16)^2 / scale_factor^2 = 64, so scale_factor = 4);
# - SmolLM2-135M config.json (hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536,
#   rope_theta 100000, max_position_embeddings 8192); SmolVLM's text config extends the vocabulary
#   to 49280 (49152 + its image/row/column special tokens);
# - SmolLM2-360M as used in SmolVLM-500M (hidden 960, 32 layers, 15 heads, 5 KV heads,
#   intermediate 2560, vocab 49280, rope_theta 100000);
# - SigLIP base patch16-512 (hidden 768, 12 layers, 12 heads, intermediate 3072, patch 16, image
#   512; "the 93M-parameter SigLIP base patch-16/512", https://huggingface.co/blog/smolervlm).
# Built as Idefics3Model (no LM head): tests/models/test_real_size_presets.py pins the counts.
_SMOLVLM_VISION = dict(
    vision_hidden_size=768,
    vision_layers=12,
    vision_heads=12,
    vision_intermediate_size=3072,
    patch_size=16,
    image_size=512,
    scale_factor=4,
)
_SMOLVLM_TEXT = dict(vocab_size=49280, max_position_embeddings=8192, rope_theta=100000.0)

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
    "smolvlm-256m": TinyBackboneSpec(
        name="smolvlm-256m",
        **_SMOLVLM_VISION,
        **_SMOLVLM_TEXT,
        text_hidden_size=576,
        text_layers=30,
        text_heads=9,
        text_kv_heads=3,
        text_intermediate_size=1536,
    ),
    "smolvlm-500m": TinyBackboneSpec(
        name="smolvlm-500m",
        **_SMOLVLM_VISION,
        **_SMOLVLM_TEXT,
        text_hidden_size=960,
        text_layers=32,
        text_heads=15,
        text_kv_heads=5,
        text_intermediate_size=2560,
    ),
}
# Fields added after model ids were first derived: left out of the id digest while at their
# defaults, so every earlier spec keeps its id.
_LATER_FIELDS = {
    f.name: f.default
    for f in dataclasses.fields(TinyBackboneSpec)
    if f.name
    in {
        "text_kv_heads",
        "text_intermediate_size",
        "vision_intermediate_size",
        "vocab_size",
        "vision_grid_image_size",
        "rope_theta",
        "feature_layers",
    }
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
        # Named as SmolVLM's own tokenizer names them (`tokenizer.fake_image_token_id`, ...): LeRobot's
        # SmolVLA reads them from the tokenizer of the VLM directory it is built over.
        extra_special_tokens={
            "fake_image_token": FAKE_IMAGE_TOKEN,
            "global_image_token": GLOBAL_IMAGE_TOKEN,
            "image_token": IMAGE_TOKEN,
            "end_of_utterance_token": END_OF_UTTERANCE_TOKEN,
        },
        padding_side="right",
        model_max_length=4096,
    )


def spec_model_id(spec: TinyBackboneSpec, seed: int) -> str:
    """Readable id for presets at seed 0; otherwise suffixed with a digest of spec+seed,
    so two backbones with different weights never share a prefix key."""
    # The real-size presets already say their family in their name.
    base = f"joynexus/{spec.name}" if spec.name.startswith("smolvlm") else f"joynexus/{spec.name}-smolvlm"
    if seed == 0 and _SPEC_PRESETS.get(spec.name) == spec:
        return base
    fields = {k: v for k, v in dataclasses.asdict(spec).items() if k not in _LATER_FIELDS or v != _LATER_FIELDS[k]}
    digest = hashlib.sha256(json.dumps([fields, seed], sort_keys=True).encode()).hexdigest()
    return f"{base}-{digest[:10]}"
