"""Pixel scores as column jobs: CLIP embeddings and score, aesthetic, watermark, NSFW.

Caption-based labels are a cheap first pass; these look at the pixels. Each
scorer is one column job (:mod:`prx_data.columns.runner`: pinned version,
per-fragment write-once, checkpoints, per-row ``<prefix>_error``, Ray Data
actors holding the model), so the image data files are never rewritten and
a killed run resumes; the job itself (:class:`prx_data.pipelines.score.ScoreConfig`,
:func:`prx_data.pipelines.score.run_score`) is in :mod:`prx_data.pipelines.score`, this module
holds the scorers its steps run. Columns (``<prefix>`` defaults to the scorer's name):

- ``clip``: ``clip_image_embedding`` and ``clip_text_embedding`` (L2-normalised
  ``fixed_size_list<float32, D>``; the image one is the table's vector column
  for nearest-neighbour search) and ``clip_score`` (their cosine; null without
  a caption). A ``CLIPModel`` with its tokenizer and image processor.
- ``aesthetic``: ``aesthetic_score`` from a small head over the stored CLIP
  image embedding (the LAION aesthetic predictors: a chain of linear layers),
  loaded from a ``.safetensors`` file or a torch state dict read with
  ``weights_only=True`` (never a pickle).
- ``watermark`` / ``nsfw``: ``AutoModelForImageClassification`` by name or
  path; ``<prefix>_label`` (the top class) and ``<prefix>_p_<class>`` (each
  class's probability, one float column each so SQL filters read them).

A row that cannot be scored (missing or undecodable image, no embedding, a
model error) keeps null values and gets its reason in ``<prefix>_error``; it
is tried again on the next run. All values are float32, computed in eval
mode without sampling, so a rerun gives the same numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from prx_data.core.errors import UsageError
from prx_data.core.schema import error_column
from prx_data.table.search import CLIP_IMAGE_COLUMN

SCORERS = ("clip", "aesthetic", "watermark", "nsfw")
#: The CLIP image embedding's default column (:data:`CLIP_IMAGE_COLUMN`):
#: :func:`prx_data.table.search.vector_column` finds it.
__all__ = ["CLIP_IMAGE_COLUMN", "SCORERS", "ClassifierScorer", "ClipScorer", "aesthetic_batch"]


def class_column(prefix: str, label: str) -> str:
    """``<prefix>_p_<label>`` with the label reduced to ``[a-z0-9_]`` (SQL-friendly)."""
    slug = re.sub(r"[^a-z0-9]+", "_", str(label).lower()).strip("_") or "class"
    return f"{prefix}_p_{slug}"


def vector_type(dim: int) -> pa.DataType:
    return pa.list_(pa.float32(), dim)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _decode_all(images: list, size: int) -> tuple[list, list[str | None]]:
    """PIL images (None where unusable) and why: ``missing_image`` or the decode reason."""
    from prx_data.core import imaging

    out: list = []
    errors: list[str | None] = []
    for data in images:
        if data is None:
            out.append(None)
            errors.append("missing_image")
            continue
        try:
            info = imaging.probe(data)
            draft = imaging.draft_size(info.width, info.height, size, size)
            out.append(imaging.decode(data, draft_to=draft))
            errors.append(None)
        except imaging.ImageError as e:
            out.append(None)
            errors.append(e.reason)
        except Exception as e:  # a decoder failure is the row's, not the job's
            out.append(None)
            errors.append(f"decode_error: {type(e).__name__}")
    return out, errors


def _normalise(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(n, 1e-12)).astype(np.float32)


def _fixed(vectors: np.ndarray | None, valid: list[bool], dim: int) -> pa.Array:
    """A ``fixed_size_list`` column: ``vectors`` rows where ``valid``, null elsewhere."""
    n = len(valid)
    flat = np.zeros((n, dim), np.float32)
    if vectors is not None and len(vectors):
        flat[np.asarray(valid, bool)] = vectors
    mask = pa.array([not v for v in valid], pa.bool_())
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), dim, mask=mask)


class _ImageScorer:
    """What the image-model actors share: inference mode per call, decoding, pixel batches."""

    device: str
    processor: Any
    size: int

    def __call__(self, batch: pa.Table) -> pa.Table:
        import torch

        with torch.inference_mode():  # per call: Ray may call from another thread
            return self._score(batch)

    def _score(self, batch: pa.Table) -> pa.Table:
        raise NotImplementedError

    def _decode(self, batch: pa.Table) -> tuple[list, list[str | None], list[bool]]:
        """The batch's images at the model's size, per-row errors, and which rows decoded."""
        images, errors = _decode_all(batch["image"].to_pylist(), self.size)
        return images, errors, [e is None for e in errors]

    def _pixels(self, images: list) -> Any:
        """The processor's ``pixel_values`` for the decoded images, on the model's device."""
        pix = self.processor(images=[im for im in images if im is not None], return_tensors="pt")
        return pix["pixel_values"].to(self.device)


def _model_errors(e: Exception, errors: list[str | None]) -> list[str | None]:
    """A model failure fails the whole batch: each row not failed already says why."""
    reason = f"model_error: {str(e).splitlines()[0][:200]}"
    return [reason if err is None else err for err in errors]


class ClipScorer(_ImageScorer):
    """Ray Data actor: CLIP image and text embeddings and their cosine for a batch."""

    def __init__(
        self,
        model: str,
        prefix: str,
        device: str = "auto",
        caption_column: str = "caption",
        max_text_tokens: int = 77,
    ):
        from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

        self.device = resolve_device(device)
        self.model = CLIPModel.from_pretrained(model).eval().to(self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.processor = AutoImageProcessor.from_pretrained(model, use_fast=True)
        self.dim = int(self.model.config.projection_dim)
        limit = int(self.model.config.text_config.max_position_embeddings)
        self.max_text_tokens = min(max_text_tokens, limit)
        self.prefix = prefix
        self.caption_column = caption_column
        self.size = _processor_size(self.processor)

    def _score(self, batch: pa.Table) -> pa.Table:
        images, errors, ok = self._decode(batch)
        img = txt = None
        captions = (
            batch[self.caption_column].to_pylist()
            if self.caption_column in batch.column_names
            else [None] * len(ok)
        )
        has_text = [o and bool(c) for o, c in zip(ok, captions, strict=True)]
        try:
            if any(ok):
                feats = self.model.get_image_features(pixel_values=self._pixels(images))
                img = _normalise(feats.float().cpu().numpy())
            if any(has_text):
                texts = [c for c, h in zip(captions, has_text, strict=True) if h]
                tok = self.tokenizer(
                    texts,
                    padding=True,
                    truncation=True,
                    max_length=self.max_text_tokens,
                    return_tensors="pt",
                )
                feats = self.model.get_text_features(
                    input_ids=tok["input_ids"].to(self.device),
                    attention_mask=tok["attention_mask"].to(self.device),
                )
                txt = _normalise(feats.float().cpu().numpy())
        except (RuntimeError, ValueError) as e:  # a model failure: the batch's rows say why
            errors = _model_errors(e, errors)
            ok = [False] * len(ok)
            has_text = [False] * len(ok)
            img = txt = None
        score: list[float | None] = [None] * len(ok)
        if txt is not None:
            img_rows = np.cumsum(ok) - 1
            txt_rows = np.cumsum(has_text) - 1
            for i, h in enumerate(has_text):
                if h:
                    score[i] = float(np.dot(img[img_rows[i]], txt[txt_rows[i]]))
        p = self.prefix
        return pa.table(
            {
                f"{p}_image_embedding": _fixed(img, ok, self.dim),
                f"{p}_text_embedding": _fixed(txt, has_text, self.dim),
                f"{p}_score": pa.array(score, pa.float32()),
                error_column(p): pa.array(errors, pa.string()),
            }
        )


def _processor_size(processor: Any) -> int:
    """The image processor's target edge (for decode drafting); 224 when unknown."""
    for attr in ("crop_size", "size"):
        s = getattr(processor, attr, None)
        if isinstance(s, dict):
            for k in ("shortest_edge", "height", "width"):
                if s.get(k):
                    return int(s[k])
        elif isinstance(s, int):
            return s
    return 224


class ClassifierScorer(_ImageScorer):
    """Ray Data actor: every class's probability from an image-classification model."""

    def __init__(self, model: str, prefix: str, device: str = "auto"):
        from transformers import AutoImageProcessor, AutoModelForImageClassification

        self.device = resolve_device(device)
        self.model = AutoModelForImageClassification.from_pretrained(model).eval().to(self.device)
        self.processor = AutoImageProcessor.from_pretrained(model, use_fast=True)
        self.labels = class_labels(self.model.config)
        self.prefix = prefix
        self.size = _processor_size(self.processor)

    def _score(self, batch: pa.Table) -> pa.Table:
        import torch

        images, errors, ok = self._decode(batch)
        probs = None
        try:
            if any(ok):
                logits = self.model(pixel_values=self._pixels(images)).logits
                probs = torch.softmax(logits.float(), dim=-1).cpu().numpy()
        except (RuntimeError, ValueError) as e:
            errors = _model_errors(e, errors)
            ok = [False] * len(ok)
            probs = None
        n, k = len(ok), len(self.labels)
        full = np.full((n, k), np.nan, np.float32)
        if probs is not None:
            full[np.asarray(ok, bool)] = probs
        mask = ~np.asarray(ok, bool)
        cols: dict[str, pa.Array] = {
            f"{self.prefix}_label": pa.array(
                [
                    self.labels[int(j)] if o else None
                    for j, o in zip(np.nan_to_num(full).argmax(axis=1), ok, strict=True)
                ],
                pa.string(),
            )
        }
        for j, label in enumerate(self.labels):
            cols[class_column(self.prefix, label)] = pa.array(full[:, j], pa.float32(), mask=mask)
        cols[error_column(self.prefix)] = pa.array(errors, pa.string())
        return pa.table(cols)


def class_labels(config: Any) -> list[str]:
    """Class names in index order (``id2label``); ``class_<i>`` where a model has none."""
    id2label = getattr(config, "id2label", None) or {}
    n = int(getattr(config, "num_labels", len(id2label)) or len(id2label))
    return [str(id2label.get(i, id2label.get(str(i), f"class_{i}"))) for i in range(n)]


# --- the aesthetic head ----------------------------------------------------------------


def load_state_dict(path: str) -> dict[str, np.ndarray]:
    """Tensors of a ``.safetensors`` file, or of a torch state dict loaded ``weights_only``."""
    if str(path).endswith(".safetensors"):
        from safetensors.numpy import load_file

        return dict(load_file(path))
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(
            f"{path!r} is not a weights-only torch state dict ({type(e).__name__}); "
            "save the head's state_dict() with torch.save or as .safetensors"
        ) from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise UsageError(f"{path!r} holds a {type(obj).__name__}, not a state dict")
    return {k: v.detach().float().numpy() for k, v in obj.items() if hasattr(v, "detach")}


def _natural(key: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


@dataclass(frozen=True)
class LinearHead:
    """A chain of affine layers ``x @ W.T + b`` (the LAION predictors have no activations)."""

    weights: tuple[np.ndarray, ...]
    biases: tuple[np.ndarray, ...]

    @classmethod
    def from_state_dict(cls, tensors: dict[str, np.ndarray], source: str = "head") -> LinearHead:
        ws, bs = [], []
        for key in sorted((k for k in tensors if k.endswith("weight")), key=_natural):
            w = np.asarray(tensors[key], np.float32)
            if w.ndim != 2:
                continue
            b = tensors.get(key[: -len("weight")] + "bias")
            ws.append(w)
            bs.append(np.zeros(w.shape[0], np.float32) if b is None else np.asarray(b, np.float32))
        if not ws:
            raise UsageError(f"{source} has no 2-d '*weight' tensors: not a linear head")
        for a, b in zip(ws, ws[1:], strict=False):
            if a.shape[0] != b.shape[1]:
                raise UsageError(
                    f"{source}: layer shapes {a.shape} -> {b.shape} do not chain; "
                    "the head must be linear layers in key order"
                )
        if ws[-1].shape[0] != 1:
            raise UsageError(f"{source}: the last layer has {ws[-1].shape[0]} outputs, not 1")
        return cls(tuple(ws), tuple(bs))

    @property
    def input_dim(self) -> int:
        return int(self.weights[0].shape[1])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)
        for w, b in zip(self.weights, self.biases, strict=True):
            x = x @ w.T + b
        return x[:, 0]


def aesthetic_batch(
    batch: pa.Table, path: str, embedding_column: str, prefix: str, normalise: bool = True
) -> pa.Table:
    """The head's score for each stored embedding (null, with a reason, where there is none)."""
    head = cached_head(path)
    col = batch[embedding_column].combine_chunks()
    valid = np.asarray(col.is_valid(), bool) if len(col) else np.zeros(0, bool)
    scores = np.full(len(col), np.nan, np.float32)
    errors: list[str | None] = [None if v else "missing_embedding" for v in valid]
    if valid.any():
        dim = col.type.list_size
        if dim != head.input_dim:
            raise UsageError(
                f"{embedding_column!r} has {dim} dimensions, the head {path!r} takes "
                f"{head.input_dim}: use the CLIP model the head was trained on"
            )
        x = col.filter(pa.array(valid)).flatten().to_numpy(zero_copy_only=False)
        x = x.reshape(-1, dim)
        scores[valid] = head(_normalise(x) if normalise else x)
    return pa.table(
        {
            f"{prefix}_score": pa.array(scores, pa.float32(), mask=~valid),
            error_column(prefix): pa.array(errors, pa.string()),
        }
    )


_HEADS: dict[str, LinearHead] = {}


def cached_head(path: str) -> LinearHead:
    """The head at ``path``, loaded once per process (each Ray worker caches its own)."""
    head = _HEADS.get(path)
    if head is None:
        head = _HEADS[path] = LinearHead.from_state_dict(load_state_dict(path), path)
    return head
