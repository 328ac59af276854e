"""Output checks: decide whether a generation may be stored as a caption.

Vision-language models fail in a few recognisable ways: they say nothing,
they fall into a loop ("a red car, a red car, a red car, ..."), or they hit
the token limit in the middle of a sentence. Such text must never be stored
silently as a caption, so each generation gets a status and only ``ok``
text is kept; the others are stored as null with their status, so they can
be counted, inspected and retried (``--redo``).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

OK = "ok"
EMPTY = "empty"
LOOPING = "looping"
TRUNCATED = "truncated"
ERROR = "error"
#: Structured output (``--schema``) that is not JSON or fails the schema.
INVALID = "invalid"
#: The row's image cannot be read (empty, truncated, not an image): a drop with its
#: reason, not a model failure; ``--max-error-rate`` does not count it.
UNREADABLE = "unreadable"
#: Every status a row can get, in order of precedence.
STATUSES = (ERROR, UNREADABLE, EMPTY, LOOPING, TRUNCATED, INVALID, OK)

_WORD = re.compile(r"\w+", re.UNICODE)
_THINK = re.compile(r"^\s*<think>.*?</think>", re.DOTALL)
# A sentence is finished when it ends on terminal punctuation, optionally
# followed by closing quotes or brackets.
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f\u2026][\"'\u201d\u2019)\]\u300d\u300f]*\s*$")


@dataclass(frozen=True)
class LoopLimits:
    """Thresholds of the repetition detector (defaults are deliberately loose).

    A fluent 150-word caption has almost no repeated 4-grams; a looping one
    repeats the same phrase until the token limit.
    """

    #: Flag when a block of up to ``max_period`` words repeats back to back
    #: at least ``min_repeats`` times, covering at least ``min_words`` words.
    max_period: int = 30
    min_repeats: int = 3
    min_words: int = 12
    #: Flag when fewer than this share of the word 4-grams are distinct
    #: (texts of at least ``min_ngram_words`` words).
    min_distinct_4grams: float = 0.5
    min_ngram_words: int = 24
    #: The same tests on characters, for scripts written without spaces.
    min_chars: int = 40


def clean(text: str | None) -> str:
    """Strip whitespace and a leading ``<think>...</think>`` block."""
    if not text:
        return ""
    return _THINK.sub("", text).strip()


def _periodic_tail(tokens: list, limits: LoopLimits, min_cover: int) -> bool:
    """True when the sequence ends with one block repeated back to back."""
    n = len(tokens)
    for period in range(1, min(limits.max_period, n // limits.min_repeats) + 1):
        block = tokens[n - period :]
        reps = 1
        while (reps + 1) * period <= n and tokens[
            n - (reps + 1) * period : n - reps * period
        ] == block:
            reps += 1
        if reps >= limits.min_repeats and reps * period >= min_cover:
            return True
    return False


def is_looping(text: str, limits: LoopLimits = LoopLimits()) -> bool:
    """Repetitive n-grams: a repeated tail, or too few distinct word 4-grams."""
    words = [w.lower() for w in _WORD.findall(text)]
    if len(words) >= limits.min_words and _periodic_tail(words, limits, limits.min_words):
        return True
    if len(words) >= limits.min_ngram_words:
        grams = list(zip(words, words[1:], words[2:], words[3:], strict=False))
        if len(set(grams)) / len(grams) < limits.min_distinct_4grams:
            return True
    # Scripts without spaces (CJK): the same tests on characters.
    chars = [c for c in text if not c.isspace()]
    if len(words) < len(chars) / 8 and len(chars) >= limits.min_chars:
        if _periodic_tail(chars, limits, limits.min_chars):
            return True
        grams = Counter(zip(chars, chars[1:], chars[2:], chars[3:], strict=False))
        if len(grams) / max(1, sum(grams.values())) < limits.min_distinct_4grams:
            return True
    return False


def is_truncated(text: str, finish_reason: str | None) -> bool:
    """Hit the token limit without finishing the sentence it was writing."""
    return finish_reason == "length" and not _SENTENCE_END.search(text)


def check(
    text: str | None,
    finish_reason: str | None,
    error: str | None = None,
    limits: LoopLimits = LoopLimits(),
) -> tuple[str, str | None]:
    """Return ``(status, caption)``; the caption is ``None`` unless status is ``ok``.

    ``finish_reason`` is ``"stop"``, ``"length"`` (the token limit was hit) or
    ``None`` when the backend does not say.
    """
    if error is not None:
        return ERROR, None
    text = clean(text)
    if not _WORD.search(text):
        return EMPTY, None
    if is_looping(text, limits):
        return LOOPING, None
    if is_truncated(text, finish_reason):
        return TRUNCATED, None
    return OK, text
