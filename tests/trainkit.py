"""Test-only builders for the training tests: a tiny T5 text encoder and tiny-run overrides.

The encoder has random weights (its features are noise) but is saved with
``save_pretrained`` and loaded back by path, so the real loading code runs.
The ByT5 tokenizer needs no vocabulary files, so nothing is downloaded.
"""

from __future__ import annotations

import os


def save_tiny_t5(path: str | os.PathLike) -> str:
    """A ~0.1 M-parameter T5 encoder + ByT5 tokenizer at ``path``; returns the path."""
    from prx_data.train.text_encoder import save_tiny_t5 as _save

    return _save(str(path))


def tiny_overrides(encoder: str, *, max_length: int = 32) -> list[str]:
    """``key=value`` overrides that shrink any config to a CPU-sized PRX (patch 32, 256 tokens)."""
    return [
        f"text_encoder.name_or_path={encoder}",
        f"text_encoder.max_length={max_length}",
        "text_encoder.dtype=float32",
        "model.patch_size=32",
        "model.hidden_size=32",
        "model.num_heads=2",
        "model.depth=1",
        "model.mlp_ratio=2.0",
        "trainer.device=cpu",
        "trainer.precision=fp32",
    ]
