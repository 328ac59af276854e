"""Composer callbacks: data-wait fraction, and an audit log of consumed sample ids.

``DataWaitMonitor`` answers "is the GPU starved by the loader?": the share of
wall time each step spends blocked on the dataloader. ``SampleIdLogger``
records which sample ids each rank trained on, per global batch, so that a run
killed and resumed (on any number of ranks) can be audited for samples seen
twice or never (:func:`consumed_ids`).
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from prx_data.core.errors import UnknownName


class DataWaitMonitor(Callback):
    """Logs the fraction of step time spent waiting for the next batch.

    Wait = ``BEFORE_DATALOADER`` -> ``AFTER_DATALOADER`` (fetch, including the
    cross-rank sync that follows it); step = ``BATCH_END`` -> next ``BATCH_END``.
    Metrics: ``throughput/data_wait_fraction`` (over the last ``window_size``
    batches), ``time/data_wait_ms`` (this batch) and, at the end of fit,
    ``throughput/data_wait_fraction_total``.
    """

    def __init__(self, window_size: int = 100) -> None:
        self.window: deque[tuple[float, float]] = deque(maxlen=max(1, window_size))
        self.total_wait = 0.0
        self.total_time = 0.0
        self._fetch_start: float | None = None
        self._wait: float = 0.0
        self._last_end: float | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        self._last_end = time.perf_counter()

    def epoch_start(self, state: State, logger: Logger) -> None:
        if self._last_end is None:
            self._last_end = time.perf_counter()

    def before_dataloader(self, state: State, logger: Logger) -> None:
        self._fetch_start = time.perf_counter()

    def after_dataloader(self, state: State, logger: Logger) -> None:
        if self._fetch_start is not None:
            self._wait = time.perf_counter() - self._fetch_start

    def batch_end(self, state: State, logger: Logger) -> None:
        now = time.perf_counter()
        step = now - self._last_end if self._last_end is not None else self._wait
        self._last_end = now
        step = max(step, self._wait, 1e-9)
        self.window.append((self._wait, step))
        self.total_wait += self._wait
        self.total_time += step
        wait_sum = sum(w for w, _ in self.window)
        time_sum = sum(s for _, s in self.window)
        logger.log_metrics(
            {
                "throughput/data_wait_fraction": wait_sum / time_sum,
                "time/data_wait_ms": 1000.0 * self._wait,
            }
        )

    @property
    def fraction(self) -> float:
        """Data-wait fraction over the whole run so far."""
        return self.total_wait / self.total_time if self.total_time else 0.0

    def fit_end(self, state: State, logger: Logger) -> None:
        logger.log_metrics({"throughput/data_wait_fraction_total": self.fraction})


class ResumeGuard(Callback):
    """Refuses to resume a checkpoint whose data layout differs from this run's.

    Streaming resumes exactly (on any world size) only with the same global
    batch size and the same DataLoader worker count; otherwise samples are
    silently repeated or skipped. The values ride in the checkpoint and are
    compared on load.
    """

    def __init__(self, global_batch_size: int, num_workers: int, holdout: str = "none") -> None:
        self.expected: dict[str, Any] = {
            "global_batch_size": int(global_batch_size),
            "num_workers": int(num_workers),
        }
        #: The eval hold-out shapes the training sample space too (checkpoints before it: "none").
        self.holdout = holdout

    def state_dict(self) -> dict[str, Any]:
        return {**self.expected, "eval_holdout": self.holdout}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from prx_data.stream.resume import check_layout

        check_layout(state, self.expected, self.holdout)


class SampleIdLogger(Callback):
    """Appends, per rank, one JSON line per batch: ``{"batch", "epoch", "ids"}``.

    Each fit is an *attempt* with a token shared by all ranks and a header
    line recording the global batch it started from; :func:`consumed_ids`
    uses these to discard batches that a resumed attempt replayed.
    Files: ``<dir>/attempt-<token>-rank<r>.jsonl``. Ids come from the batch's
    ``id`` column.
    """

    def __init__(self, directory: str | Path, id_key: str = "id") -> None:
        self.directory = Path(directory)
        self.id_key = id_key
        self._fh = None

    def fit_start(self, state: State, logger: Logger) -> None:
        token = [f"{time.time_ns():020d}"]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(token, src=0)
        self.directory.mkdir(parents=True, exist_ok=True)
        rank = dist.get_global_rank()
        path = self.directory / f"attempt-{token[0]}-rank{rank}.jsonl"
        self._fh = path.open("a", buffering=1)
        header = {
            "attempt": token[0],
            "rank": rank,
            "world_size": dist.get_world_size(),
            "start_batch": int(state.timestamp.batch),
            "start_sample": int(state.timestamp.sample),
        }
        self._fh.write(json.dumps(header) + "\n")

    def after_dataloader(self, state: State, logger: Logger) -> None:
        # Written when the batch is fetched, before its step: by the time any checkpoint
        # after this batch exists, every rank has logged it (the step's gradient sync
        # needs all ranks' batches). A batch cut short by a kill is logged but dropped by
        # consumed_ids once a later attempt resumes from an earlier checkpoint.
        batch = state.batch
        ids = batch.get(self.id_key) if isinstance(batch, dict) else None
        if ids is None:
            raise UnknownName(f"SampleIdLogger: batch has no {self.id_key!r} column")
        if self._fh is None:
            return
        line = {
            "batch": int(state.timestamp.batch),
            "epoch": int(state.timestamp.epoch),
            "ids": [str(i) for i in ids],
        }
        self._fh.write(json.dumps(line) + "\n")
        self._fh.flush()

    def close(self, state: State, logger: Logger) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


@dataclass
class _Attempt:
    token: str
    start_batch: int
    batches: list[tuple[int, int, list[str]]]  # (batch, epoch, ids) from every rank


def _read_attempts(directory: Path) -> list[_Attempt]:
    attempts: dict[str, _Attempt] = {}
    for path in sorted(directory.glob("attempt-*-rank*.jsonl")):
        with path.open() as fh:
            lines = [ln for ln in fh.read().splitlines() if ln.strip()]
        if not lines:
            continue
        header = json.loads(lines[0])
        att = attempts.setdefault(
            header["attempt"], _Attempt(header["attempt"], int(header["start_batch"]), [])
        )
        for ln in lines[1:]:
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill: that batch never completed
            att.batches.append((int(rec["batch"]), int(rec.get("epoch", 0)), list(rec["ids"])))
    return sorted(attempts.values(), key=lambda a: a.token)


def consumed_ids(directory: str | Path) -> list[str]:
    """Ids that training effectively consumed, over all attempts in ``directory``.

    A batch logged by an attempt counts unless a *later* attempt restarted
    from a checkpoint at or before it (the batch was replayed after resume).
    The last batch of an attempt that was killed and never resumed may not
    have completed its step.
    Duplicates in the result mean a sample was genuinely trained on twice.
    """
    attempts = _read_attempts(Path(directory))
    out: list[str] = []
    for i, att in enumerate(attempts):
        later_starts = [a.start_batch for a in attempts[i + 1 :]]
        cutoff = min(later_starts) if later_starts else None
        for batch, _epoch, ids in sorted(att.batches, key=lambda r: r[0]):
            if cutoff is not None and batch >= cutoff:
                continue
            out.extend(ids)
    return out


def attempts_summary(directory: str | Path) -> list[dict[str, Any]]:
    """One dict per attempt: token, start batch, batches and samples logged."""
    return [
        {
            "attempt": a.token,
            "start_batch": a.start_batch,
            "batches": len({b for b, _, _ in a.batches}),
            "samples": sum(len(ids) for _, _, ids in a.batches),
        }
        for a in _read_attempts(Path(directory))
    ]
