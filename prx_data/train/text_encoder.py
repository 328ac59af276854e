"""Frozen text encoder, run inside the training step.

Encoding on the fly (rather than precomputing features into the shards) keeps
the exports independent of the encoder choice and lets caption selection and
dropout change per step. Any transformers encoder works: encoder-decoder
models (T5, T5Gemma) contribute their encoder; decoder-only towers (Qwen) their
hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers
from transformers import AutoModel, AutoModelForTextEncoding, AutoTokenizer, PreTrainedModel

from prx_data.core.errors import UsageError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device | str | None = None) -> torch.dtype:
    """``auto`` means bfloat16 on CUDA (half the memory, no loss for a frozen encoder), else fp32."""
    if name == "auto":
        dev = torch.device(device) if device is not None else None
        cuda = dev.type == "cuda" if dev is not None else torch.cuda.is_available()
        return torch.bfloat16 if cuda else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}; use one of auto, {', '.join(_DTYPES)}") from None


#: transformers renamed ``torch_dtype`` to ``dtype`` in 4.56.
_DTYPE_KW = (
    "dtype"
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 56)
    else "torch_dtype"
)


def load_encoder_model(name_or_path: str, dtype: torch.dtype) -> PreTrainedModel:
    """Load the text side of a checkpoint: the encoder-only class when transformers has one."""
    kw = {_DTYPE_KW: dtype}
    try:
        model = AutoModelForTextEncoding.from_pretrained(name_or_path, **kw)
    except ValueError:
        # Not in the text-encoding mapping (e.g. Qwen): the base model gives hidden states.
        model = AutoModel.from_pretrained(name_or_path, **kw)
    if getattr(model.config, "is_encoder_decoder", False) and hasattr(model, "get_encoder"):
        model = model.get_encoder()
    return model


class TextEncoder:
    """Tokenizer + frozen encoder; ``encode(captions)`` -> (features [B, L, D], mask [B, L]).

    Deliberately not an ``nn.Module`` so that it stays out of the trained
    model's parameters, optimizer, EMA copy and checkpoints: it is reloaded
    from ``name_or_path`` instead.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer,
        *,
        max_length: int = 256,
        layer: int = -1,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.layer = layer

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        tokenizer: str | None = None,
        max_length: int = 256,
        dtype: str = "auto",
        layer: int = -1,
        device: torch.device | str | None = None,
    ) -> TextEncoder:
        torch_dtype = resolve_dtype(dtype, device)
        model = load_encoder_model(name_or_path, torch_dtype)
        tok = AutoTokenizer.from_pretrained(tokenizer or name_or_path)
        enc = cls(model, tok, max_length=max_length, layer=layer)
        if device is not None:
            enc.to(device)
        return enc

    @property
    def hidden_size(self) -> int:
        cfg = self.model.config
        for name in ("d_model", "hidden_size"):
            if isinstance(getattr(cfg, name, None), int):
                return getattr(cfg, name)
        text_cfg = getattr(cfg, "text_config", None)
        if text_cfg is not None and isinstance(getattr(text_cfg, "hidden_size", None), int):
            return text_cfg.hidden_size
        raise UsageError(f"cannot tell the hidden size of {type(self.model).__name__}")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: torch.device | str) -> TextEncoder:
        self.model.to(device)
        return self

    @torch.no_grad()
    def encode(self, captions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Features of the chosen layer and a boolean mask (True = real token)."""
        tokens = self.tokenizer(
            list(captions),
            padding="max_length",
            max_length=self.max_length,
            truncation=True,
            return_tensors="pt",
        )
        device = self.device
        input_ids = tokens["input_ids"].to(device)
        mask = tokens["attention_mask"].to(device)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            output_hidden_states=self.layer != -1,
        )
        feats = out.last_hidden_state if self.layer == -1 else out.hidden_states[self.layer]
        return feats, mask.bool()


def save_tiny_t5(path: str) -> str:
    """Save a ~0.1 M-parameter, randomly initialised T5 encoder + ByT5 tokenizer at ``path``.

    For offline smoke runs only (its features are noise): it goes through
    ``save_pretrained`` / ``from_pretrained`` exactly like a real encoder, and
    the byte-level ByT5 tokenizer needs no vocabulary download.
    """
    import os

    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    model = T5EncoderModel(
        T5Config(vocab_size=384, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16)
    )
    model.save_pretrained(path)
    ByT5Tokenizer().save_pretrained(path)
    return path
