"""Quiet training logs: library chatter dropped, each warning once, the rest kept."""

from __future__ import annotations

import logging

from prx_data.train.logs import QuietFilter


def record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_quiet_filter_drops_chatter_and_repeats_only():
    f = QuietFilter()
    chatter = "Because `predownload` was not specified, it will default to 8*batch_size"
    assert not f.filter(record("streaming.base.dataset", logging.INFO, chatter))
    assert not f.filter(
        record("composer.utils.reproducibility", logging.INFO, "Setting seed to 17")
    )
    # Our own INFO lines, and the same words from another logger, stay.
    assert f.filter(record("prx_data.stream.dataset", logging.INFO, "bucket plan: ..."))
    assert f.filter(record("prx_data.x", logging.INFO, "Setting seed to 17"))
    warn = record("prx_data.stream.dataset", logging.WARNING, "bucket plan: 1 sample left out")
    assert f.filter(warn)
    assert not f.filter(record(warn.name, logging.WARNING, warn.getMessage()))  # once
    assert f.filter(record(warn.name, logging.WARNING, "bucket plan: 2 samples left out"))
    assert f.filter(record("other", logging.WARNING, warn.getMessage()))
