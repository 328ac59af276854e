"""Quiet training logs: each warning once, library chatter and known deprecations left out.

An 8-step smoke run should read as what the run did: the plan, the losses,
eval and samples. Composer and streaming log their defaults at INFO on every
start (seeds, "Because `predownload` was not specified ..."), several ranks'
libraries repeat the same warning, and diffusers/transformers announce
deprecations the project cannot act on. :func:`quiet_logs` installs one
filter on the root handlers that drops those, and a warnings filter for the
deprecations; ``--log-level DEBUG`` keeps everything.
"""

from __future__ import annotations

import logging
import re
import warnings

#: INFO messages of libraries that restate their own defaults on every start.
CHATTER = (
    ("streaming", r"^Because `\w+` was not specified"),
    ("composer", r"^Setting seed to "),
    ("composer", r"^Stepping schedulers every batch"),
    ("composer", r"^Searching for a previous checkpoint"),
    ("composer", r"^Looking for autoresume checkpoint"),
    ("composer", r"^Checkpoint not found in"),
    ("composer", r"^Using precision "),
)

#: Notices at any level that name an optional speed-up, not a problem of the run.
NOTICES = (
    ("diffusers", r"^Cannot initialize model with low cpu memory usage"),
    ("transformers", r"^Using a slow image processor as `use_fast` is unset"),
)

#: Libraries whose deprecation notices are theirs to act on, not the user's.
LIBRARIES = r"(diffusers|transformers|torch|composer|streaming|accelerate|torchmetrics)(\.|$)"
#: Lance's warning at every fork (see :func:`quiet_logs`).
LANCE_FORK = r"lance is not fork-safe"
#: Library deprecation warnings (category, message pattern) users of this toolkit cannot act on.
DEPRECATIONS = (
    (FutureWarning, r".*"),
    (DeprecationWarning, r".*"),
    (UserWarning, r".*(deprecated|will be removed|is now loaded as a fast processor).*"),
)


class QuietFilter(logging.Filter):
    """Drops :data:`CHATTER` and any warning (or error) already emitted once."""

    def __init__(self) -> None:
        super().__init__()
        self._chatter = [(name, re.compile(pat)) for name, pat in CHATTER]
        self._notices = [(name, re.compile(pat)) for name, pat in NOTICES]
        self._seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if any(record.name.startswith(n) and p.search(msg) for n, p in self._notices):
            return False
        if record.levelno <= logging.INFO:
            return not any(
                record.name.startswith(name) and pat.search(msg) for name, pat in self._chatter
            )
        key = (record.name, msg)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


def quiet_logs(level: str = "INFO") -> None:
    """Install :class:`QuietFilter` on the root handlers and mute known deprecations.

    ``level="DEBUG"`` installs nothing: every message stays.
    """
    if level.upper() == "DEBUG":
        return
    flt = QuietFilter()
    # diffusers and transformers log through handlers of their own (no propagation).
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    libraries = [diffusers_logging.get_logger("diffusers"), transformers_logging.get_logger()]
    for logger in [logging.getLogger(), *libraries]:
        for handler in logger.handlers:
            handler.addFilter(flt)
    logging.captureWarnings(True)  # warnings go through the same filter: each once
    for category, pattern in DEPRECATIONS:
        warnings.filterwarnings("ignore", message=pattern, category=category, module=LIBRARIES)
    # Lance warns at every fork once it is imported (a ledger or table read by the run);
    # the DataLoader's forked workers read MDS shards only, never a Lance handle.
    warnings.filterwarnings("ignore", message=LANCE_FORK, category=UserWarning)
