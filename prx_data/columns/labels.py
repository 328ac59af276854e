"""Caption labels: parse a language model's answer, and a rule-based pre-filter.

The question asked of each caption is "would you look at this image, or
read it?": ``visual`` images are kept for training, ``text`` (documents,
screenshots, slides) and ``nsfw`` rows usually become skip lists. An answer
that names no label, or several, is ``unknown`` and counted, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from prx_data.columns.prompts import CLASSIFY_RULES, default_path
from prx_data.core.errors import UsageError, read_user_text

VISUAL = "visual"
TEXT = "text"
NSFW = "nsfw"
UNKNOWN = "unknown"
LABELS = (VISUAL, TEXT, NSFW)

# Words a model may answer with, mapped to labels ("look" / "read" answer
# the question literally).
_ANSWER_WORDS = {
    "visual": VISUAL,
    "look": VISUAL,
    "text": TEXT,
    "textual": TEXT,
    "read": TEXT,
    "nsfw": NSFW,
}
_ANSWER = re.compile(r"\b(" + "|".join(_ANSWER_WORDS) + r")\b", re.IGNORECASE)
_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_QUOTED = re.compile(r"[\"\u201c\u201e]([^\"\u201c\u201d\u201e]{1,2000})[\"\u201d]")
_WORD = re.compile(r"\w+")


def parse_label(answer: str | None) -> str:
    """Map a free-form answer to a label, or ``unknown``.

    The first label word decides when it opens the answer ("Text. The image
    is a ..."); otherwise the answer must name exactly one label.
    """
    if not answer:
        return UNKNOWN
    text = _THINK.sub("", answer).strip()
    hits = [_ANSWER_WORDS[m.group(1).lower()] for m in _ANSWER.finditer(text)]
    if not hits:
        return UNKNOWN
    head = re.sub(r"^[\W_]*(answer|label|category)?[\W_]*", "", text, flags=re.IGNORECASE)
    first = _ANSWER.match(head)
    if first:
        return _ANSWER_WORDS[first.group(1).lower()]
    return hits[0] if len(set(hits)) == 1 else UNKNOWN


def quoted_words(caption: str) -> int:
    """Number of words inside quotation marks (transcribed visible text)."""
    return sum(len(_WORD.findall(m.group(1))) for m in _QUOTED.finditer(caption))


@dataclass(frozen=True)
class Rule:
    label: str
    pattern: re.Pattern | None = None
    min_quoted_words: int | None = None

    def matches(self, caption: str) -> bool:
        if self.pattern is not None:
            return self.pattern.search(caption) is not None
        return quoted_words(caption) >= (self.min_quoted_words or 0)


class RuleFilter:
    """Cheap keyword/regex labeller for clear cases; ``None`` means undecided."""

    def __init__(self, rules: list[Rule]):
        self.rules = rules

    @classmethod
    def load(cls, path: str | Path | None = None) -> RuleFilter:
        """Parse a rules file (``label: regex`` or ``text: quoted_words >= N`` per line)."""
        p = Path(path) if path else default_path(CLASSIFY_RULES)
        rules: list[Rule] = []
        for lineno, raw in enumerate(read_user_text(str(p), "rules file").splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            label, sep, body = line.partition(":")
            label, body = label.strip().lower(), body.strip()
            if not sep or label not in LABELS or not body:
                raise UsageError(
                    f"{p}:{lineno}: expected '<visual|text|nsfw>: <regex>', got {raw!r}"
                )
            m = re.fullmatch(r"quoted_words\s*>=\s*(\d+)", body)
            if m:
                rules.append(Rule(label, min_quoted_words=int(m.group(1))))
                continue
            try:
                rules.append(Rule(label, pattern=re.compile(body, re.IGNORECASE)))
            except re.error as e:
                raise UsageError(f"{p}:{lineno}: bad regular expression: {e}") from None
        return cls(rules)

    def __call__(self, caption: str | None) -> str | None:
        if not caption:
            return None
        for rule in self.rules:
            if rule.matches(caption):
                return rule.label
        return None
