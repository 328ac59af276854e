"""Prompts as editable text files.

The defaults ship in ``prx_data/columns/prompts_txt/*.txt`` so they can be read,
diffed and changed without touching code; ``--prompt-file`` swaps in your
own file.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from prx_data.core.errors import NotFound, UsageError

CAPTION_PROMPT = "caption.txt"
CLASSIFY_PROMPT = "classify.txt"
CLASSIFY_RULES = "classify_rules.txt"
ATTRIBUTES_PROMPT = "attributes.txt"
#: Placeholder the classification prompt must contain.
CAPTION_SLOT = "{caption}"
#: Where the attributes prompt takes the JSON schema (appended when a prompt lacks it).
SCHEMA_SLOT = "{schema}"


def default_path(name: str) -> Path:
    """Path of a prompt file shipped with the package."""
    return Path(str(resources.files("prx_data.columns") / "prompts_txt" / name))


def load_prompt(path: str | Path | None, default: str = CAPTION_PROMPT) -> str:
    """Read a prompt file (or the packaged ``default``), stripped of outer whitespace."""
    p = Path(path) if path else default_path(default)
    try:
        text = p.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise NotFound(f"prompt file not found: {p}") from None
    if not text:
        raise UsageError(f"prompt file is empty: {p}")
    return text


def load_classify_prompt(path: str | Path | None = None) -> str:
    """The text-only classification prompt; it must contain ``{caption}``."""
    text = load_prompt(path, CLASSIFY_PROMPT)
    if CAPTION_SLOT not in text:
        raise UsageError(
            f"classification prompt must contain {CAPTION_SLOT!r} where the caption goes"
        )
    return text


def fill_caption(template: str, caption: str) -> str:
    """Insert a caption into the template (plain replace: captions may hold braces)."""
    return template.replace(CAPTION_SLOT, caption)


def load_attributes_prompt(path: str | Path | None, schema: dict) -> str:
    """The structured-attributes prompt with the schema (indented JSON) at ``{schema}``.

    A prompt file without the slot gets the schema appended, so the model sees
    it even where the backend cannot enforce it (transformers).
    """
    import json

    text = load_prompt(path, ATTRIBUTES_PROMPT)
    body = json.dumps(schema, indent=2)
    if SCHEMA_SLOT in text:
        return text.replace(SCHEMA_SLOT, body)
    return f"{text}\n\nJSON schema:\n{body}"
