"""Tiny, randomly initialised Hugging Face models, saved like real checkpoints.

Nothing here is a feature: the weights are random and the outputs are noise.
The point is that every job loads these through the same
``from_pretrained(path)`` code it uses for real checkpoints, so
preprocessing, ``generate``, scoring and decoding all run for real, on the
CPU, with no downloads: the demo saves one per job
(:func:`save_demo_models`), and the tests build them too.

* :func:`build_tiny_vlm` saves a ~0.3 M-parameter Qwen2-VL with its
  processor (image processor + in-memory byte-level tokenizer + chat
  template), for ``caption`` and ``caption --schema``.
* :func:`build_tiny_causal_lm` saves a tiny Qwen2 causal LM (``classify``).
* :func:`build_tiny_clip` saves a ``CLIPModel`` (``score clip``, ``semdedup``,
  and CMMD, which loads its vision tower).
* :func:`build_tiny_image_classifier` saves a ViT classifier (``score
  watermark`` / ``score nsfw``); :func:`build_tiny_aesthetic_head` a
  LAION-style head (``score aesthetic``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Width and depth of the tiny random transformers (metric models, CLIP, classifiers).
TINY_TRANSFORMER: dict[str, int] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


def save_square_processor(cls: Any, path: str, edge: int) -> None:
    """Save an image processor of type ``cls`` that resizes to ``edge`` and centre-crops square."""
    cls(size={"shortest_edge": edge}, crop_size={"height": edge, "width": edge}).save_pretrained(
        path
    )


# Words of the tiny vocabularies: the model emits these at random.
_WORDS = [
    "a",
    "the",
    "photo",
    "of",
    "cat",
    "dog",
    "red",
    "blue",
    "green",
    "sign",
    "text",
    "reads",
    "on",
    "in",
    "with",
    "and",
    "is",
    "large",
    "small",
    "bright",
    "dark",
    "sky",
    "tree",
    "person",
    "street",
    "wall",
    "poster",
    "label",
    "visual",
    "nsfw",
    "image",
    "document",
    "black",
    "white",
    "close",
    "view",
    "left",
    "right",
    "top",
    "bottom",
    "center",
]

_SPECIAL = ["<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_VISION = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]

#: Minimal chat template in the Qwen style: images become
#: ``<|vision_start|><|image_pad|><|vision_end|>``, which the Qwen2-VL
#: processor expands to one pad token per merged patch.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


#: Single characters, so that any JSON text (and so any schema-valid object) is expressible.
_CHARS = [chr(c) for c in range(32, 127)]


def _tokenizer(extra_special: list[str]):
    """Words plus every printable ASCII character; decoding concatenates tokens as they are.

    The characters let constrained decoding (``caption --schema``) spell any
    JSON object; the words keep captions word-like noise.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    words = [w + " " for w in _WORDS]
    vocab_list = _SPECIAL + extra_special + ["user", "assistant", "system"] + words + _CHARS
    # Words of the default prompts tokenize to <unk>: fine for noise generation.
    vocab = {w: i for i, w in enumerate(dict.fromkeys(vocab_list))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    # Qwen2TokenizerFast wraps any `tokenizers` object; the Qwen2-VL processor insists on it.
    fast = Qwen2TokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        bos_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>", *extra_special],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_vlm(
    path: str | Path, seed: int = 0, *, hidden_size: int = 64, vision_embed_dim: int = 32
) -> Path:
    """Save a tiny Qwen2-VL (model + processor) under ``path`` and return it.

    Heads are 4 (text) and 2 (vision); widen ``hidden_size`` / ``vision_embed_dim``
    for engines whose attention kernels need a head size of 64 or more (vLLM).
    """
    import torch
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    path = Path(path)
    tok = _tokenizer(_VISION)
    ids = {t: tok.convert_tokens_to_ids(t) for t in _VISION}
    torch.manual_seed(seed)
    config = Qwen2VLConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_scaling={"type": "mrope", "mrope_section": _mrope_section(hidden_size // 4)},
        vision_config={
            "depth": 1,
            "embed_dim": vision_embed_dim,
            "hidden_size": hidden_size,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    processor = Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _mrope_section(head_dim: int) -> list[int]:
    """Temporal/height/width split of the rotary half-dims ([2, 2, 4] at head dim 16)."""
    half = head_dim // 2
    return [half // 4, half // 4, half - 2 * (half // 4)]


def build_tiny_causal_lm(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny Qwen2 causal LM with its tokenizer under ``path`` and return it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    tok = _tokenizer([])
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok),
        **TINY_TRANSFORMER,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _word_tokenizer():
    """A WordLevel tokenizer as a ``PreTrainedTokenizerFast`` (no vocab files to ship)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(dict.fromkeys(["<pad>", "<unk>", "<eos>", *_WORDS]))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )


#: Embedding width of :func:`build_tiny_clip` (what the tiny aesthetic head reads).
CLIP_PROJECTION_DIM = 16


def build_tiny_clip(
    path: str | Path, seed: int = 0, projection_dim: int = CLIP_PROJECTION_DIM
) -> Path:
    """Save a tiny random ``CLIPModel`` with a WordLevel tokenizer and a CLIP image processor."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    path = Path(path)
    tok = _word_tokenizer()
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config={
            "vocab_size": len(tok),
            **TINY_TRANSFORMER,
            "max_position_embeddings": 32,
            "pad_token_id": tok.pad_token_id,
            "eos_token_id": 2,  # legacy pooling: the highest token id of each text
        },
        vision_config={
            **TINY_TRANSFORMER,
            "image_size": 32,
            "patch_size": 8,
            # As in OpenAI's checkpoints: CLIPVisionModelWithProjection (CMMD) reads it here.
            "projection_dim": projection_dim,
        },
        projection_dim=projection_dim,
    )
    CLIPModel(config).eval().save_pretrained(path)
    tok.save_pretrained(path)
    save_square_processor(CLIPImageProcessor, str(path), 32)
    return path


def build_tiny_image_classifier(
    path: str | Path, labels: tuple[str, ...] = ("clean", "watermark"), seed: int = 0
) -> Path:
    """Save a tiny random ``ViTForImageClassification`` with its image processor."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    path = Path(path)
    torch.manual_seed(seed)
    config = ViTConfig(
        **TINY_TRANSFORMER,
        image_size=32,
        patch_size=8,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )
    ViTForImageClassification(config).eval().save_pretrained(path)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(path)
    return path


def build_tiny_aesthetic_head(path: str | Path, dim: int = 16, seed: int = 0) -> Path:
    """Save a LAION-style MLP head (linear layers, no activations) as ``.safetensors``."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    torch.manual_seed(seed)
    head = torch.nn.Sequential(
        torch.nn.Linear(dim, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 4), torch.nn.Linear(4, 1)
    )
    save_file({f"layers.{k}": v.contiguous() for k, v in head.state_dict().items()}, str(path))
    return path


#: What :func:`save_demo_models` writes under its folder, per job.
DEMO_MODELS = {
    "vlm": "tiny-vlm",  # caption (and caption --schema)
    "lm": "tiny-lm",  # classify
    "clip": "tiny-clip",  # score clip, semdedup, CMMD
    "aesthetic": "tiny-aesthetic.safetensors",  # score aesthetic (over the clip embedding)
    "watermark": "tiny-watermark",  # score watermark
    "nsfw": "tiny-nsfw",  # score nsfw
}


def save_demo_models(workdir: str | Path, seed: int = 0) -> dict[str, str]:
    """Save one tiny random-weight model per job under ``workdir``; ``{job: path}``.

    Existing ones are kept (their ``config.json`` or weights file present).
    """
    workdir = Path(workdir)
    paths = {k: workdir / v for k, v in DEMO_MODELS.items()}
    builders = {
        "vlm": lambda p: build_tiny_vlm(p, seed),
        "lm": lambda p: build_tiny_causal_lm(p, seed),
        "clip": lambda p: build_tiny_clip(p, seed),
        "aesthetic": lambda p: build_tiny_aesthetic_head(p, CLIP_PROJECTION_DIM, seed),
        "watermark": lambda p: build_tiny_image_classifier(p, ("clean", "watermark"), seed),
        "nsfw": lambda p: build_tiny_image_classifier(p, ("normal", "nsfw"), seed),
    }
    for key, path in paths.items():
        done = path.is_file() or (path / "config.json").is_file()
        if done and key == "clip":  # older demos saved a vision tower alone here
            done = '"model_type": "clip"' in (path / "config.json").read_text()
        if not done:
            builders[key](path)
    return {k: str(v) for k, v in paths.items()}
