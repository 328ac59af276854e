"""Per-sample caption choice across several caption columns, plus CFG dropout.

Exports may carry more than one caption per image (the original alt-text, a
long VLM caption, a short one). Mixing them by weight during training is the
usual recipe; dropping the caption for a fraction of samples trains the
unconditional branch used by classifier-free guidance.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from prx_data.core.errors import UnknownName, UsageError

#: Share of drawn samples (dropout aside) whose caption columns were all empty above which
#: the trainer warns, once enough samples were drawn to judge (:data:`EMPTY_WARN_AFTER`).
EMPTY_WARN_SHARE = 0.5
EMPTY_WARN_AFTER = 256


@dataclass(frozen=True)
class CaptionPolicy:
    """Columns with weights (any positive scale) and the dropout probability."""

    columns: tuple[str, ...]
    weights: tuple[float, ...]
    dropout: float = 0.0
    #: Warn (once) when the columns give empty captions: every one of the first batch, or
    #: more than :data:`EMPTY_WARN_SHARE` of the samples once :data:`EMPTY_WARN_AFTER` were
    #: drawn. The training policy sets it; an export whose captions are all empty otherwise
    #: trains an unconditional model without a word.
    warn_empty: bool = False
    _tally: dict = field(
        default_factory=lambda: {"drawn": 0, "empty": 0, "warned": False},
        compare=False,
        repr=False,
    )

    def __post_init__(self) -> None:
        if not self.columns or len(self.columns) != len(self.weights):
            raise UsageError("caption columns and weights must be non-empty and of equal length")
        if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise UsageError(f"caption weights must be >= 0 and not all zero: {self.weights}")
        if not 0.0 <= self.dropout <= 1.0:
            raise UsageError(f"caption dropout must be in [0, 1], got {self.dropout}")

    @classmethod
    def single(cls, column: str = "caption", dropout: float = 0.0) -> CaptionPolicy:
        return cls((column,), (1.0,), dropout)

    def choose(
        self, batch: Mapping[str, object], generator: torch.Generator | None = None
    ) -> list[str]:
        """One caption per sample (:meth:`choose_index`'s picks as text; "" when dropped)."""
        picks = self.choose_index(batch, generator)
        return ["" if j < 0 else batch[self.columns[j]][i] for i, j in enumerate(picks)]  # type: ignore[index]

    def choose_index(
        self, batch: Mapping[str, object], generator: torch.Generator | None = None
    ) -> list[int]:
        """Per sample, the index in ``columns`` of its caption, or -1 for the empty caption
        (dropped, or every column empty): what precomputed text embeddings are picked by.
        An empty pick falls back to the next non-empty column.

        Raises :class:`UnknownName` (a ``KeyError``) naming the column when a configured
        column is not in the batch.
        """
        cols: list[Sequence[str]] = []
        for name in self.columns:
            if name not in batch:
                raise UnknownName(
                    f"caption column {name!r} is not in the batch (has: {sorted(batch)})"
                )
            cols.append(batch[name])  # type: ignore[arg-type]
        n = len(cols[0])
        weights = torch.tensor(self.weights, dtype=torch.float64)
        picks = torch.multinomial(weights.expand(n, -1), 1, replacement=True, generator=generator)
        drop = torch.rand(n, generator=generator) < self.dropout
        out: list[int] = []
        for i in range(n):
            if drop[i]:
                out.append(-1)
                continue
            first = int(picks[i, 0])
            # Fall back in column order; a weight-0 column thus serves as a fallback only.
            order = [first] + [j for j in range(len(cols)) if j != first]
            pick = -1
            for j in order:
                if cols[j][i]:
                    pick = j
                    break
            out.append(pick)
        if self.warn_empty:
            self._watch(n - int(drop.sum()), sum(1 for i in range(n) if not drop[i] and out[i] < 0))
        return out

    def _watch(self, drawn: int, empty: int) -> None:
        t = self._tally
        if t["warned"]:
            return
        first = t["drawn"] == 0
        t["drawn"] += drawn
        t["empty"] += empty
        share = t["empty"] / t["drawn"] if t["drawn"] else 0.0
        if (first and drawn and empty == drawn) or (
            t["drawn"] >= EMPTY_WARN_AFTER and share > EMPTY_WARN_SHARE
        ):
            t["warned"] = True
            warnings.warn(
                f"caption columns {', '.join(self.columns)} were empty for {share:.0%} of the "
                f"{t['drawn']:,} samples drawn so far (caption dropout aside): those train "
                "without text. Check data.caption_columns against the export's columns, or fill "
                "them (python -m prx_data.caption, then write_mds --overwrite)",
                UserWarning,
                stacklevel=3,
            )
