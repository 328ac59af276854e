"""The one table of jobs: ``prx-data JOB [args]`` and ``python -m prx_data.JOB`` both come from it.

Each job is a module ``prx_data.cli.<name>`` with ``build_parser()`` and
``main(argv=None) -> int``. The ``python -m prx_data.<name>`` spellings are
two-line shims (top-level modules, or a stage's ``__main__``) that look their
job up here, so a job cannot be reachable one way and not the other.
Modules whose name starts with ``_`` (and :mod:`prx_data.cli.reporting`) are
helpers, not jobs.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

#: ``main`` is the ``prx-data`` entry point; ``shim`` makes a ``python -m prx_data.<job>`` module.
__all__ = ["JOBS", "Job", "main", "shim"]


@dataclass(frozen=True)
class Job:
    """One entry of the table: the name both spellings use, and its one-line summary."""

    name: str
    summary: str
    #: Run as a program, end the process right after the job (:func:`end_process`).
    ends_process: bool = False

    @property
    def module(self) -> str:
        """The CLI module (argument parsing over the library): ``prx_data.cli.<name>``."""
        return f"prx_data.cli.{self.name}"

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def main(self, argv: list[str] | None = None) -> int:
        """Run the job; a :class:`PrxDataError` it did not report itself becomes one line.

        Jobs catch the errors they expect; this is the net under them, so a user
        error never reaches the terminal as a traceback (exit 2 for a usage
        error, 1 otherwise). A path that is not UTF-8, which Arrow and Lance fail on
        deep down without naming it, is one line naming it too (exit 2). Anything
        else is a bug and keeps its traceback.
        """
        from prx_data.core.errors import PrxDataError, UsageError, undecodable_path

        try:
            return int(self.load().main(argv) or 0)
        except PrxDataError as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"error: {first}", file=sys.stderr)
            return 2 if isinstance(e, UsageError) else 1
        except UnicodeEncodeError as e:  # a non-UTF-8 file name, met wherever Arrow reads it
            message = undecodable_path(e)
            if message is None:
                raise
            print(f"error: {message}", file=sys.stderr)
            return 2


JOBS: dict[str, Job] = {
    job.name: job
    for job in (
        Job(
            "ingest",
            "load sources (folders, parquet, WebDataset, twin tars, Lance) into a Lance table",
        ),
        Job("download", "fetch the images of URL-only rows (LAION-style parquet) into the table"),
        Job(
            "table",
            "table maintenance: stats (rows, fragments), compact, the tags that pin versions in use",
        ),
        Job("search", "full-text, vector and hybrid search over a table; builds the indexes"),
        Job("stats", "resolution / aspect-ratio / tier distribution of a table, with plots"),
        Job("explore", "small web explorer over a table (loopback by default)"),
        Job("quality", "measure blank / near-blank images into an image_quality column"),
        Job("caption", "re-caption images with a VLM and write the column back"),
        Job("classify", "label captions visual / text / nsfw and write the column back"),
        Job("score", "CLIP embeddings and score, aesthetic, watermark, NSFW scores into columns"),
        Job("dedup", "perceptual-hash dedup: dup_of column and a 'dedup' skip list"),
        Job(
            "semdedup",
            "embedding-cluster dedup: a 'semdedup' skip list, share removed per threshold",
        ),
        Job("optout", "add an opt-out skip list to an export"),
        Job("write_mds", "export a table to resolution/aspect-ratio bucketed MDS"),
        Job(
            "latents", "precompute VAE latents beside an export's shards (vae.source: precomputed)"
        ),
        Job(
            "attach",
            "attach table columns beside an export's shards, joined by id (no shard rewritten)",
        ),
        Job(
            "adopt",
            "id manifests and shard hashes for an MDS tree another writer made (skip lists)",
        ),
        Job(
            "verify",
            "check an export: report, indexes, shards (--deep: hashes), manifests, sidecars",
            ends_process=True,  # read-only: its exit status is its verdict, nothing else
        ),
        Job(
            "skips",
            "manage skip lists of an export and the corpus ledger (add, list, stats, remove, "
            "sync, index, rewrite, ledger)",
        ),
        Job("planner", "preflight: batches per bucket, tail drops, fatal configurations"),
        Job("jpeg_fidelity", "measure JPEG re-encode fidelity; estimate JPEG quality"),
        Job("train", "Composer training run from a YAML config"),
        Job("demo", "the export path end to end on an embedded sample"),
    )
}


def shim(name: str, module_name: str) -> Callable[[list[str] | None], int]:
    """The body of a ``python -m prx_data.<name>`` module: run the job when executed.

    Returns the job's ``main`` so ``from prx_data.<name> import main`` keeps working.
    A name missing from :data:`JOBS` is a ``KeyError`` at import: a shim without an entry.
    """
    job = JOBS[name]
    if module_name == "__main__":
        status = job.main()
        if job.ends_process:
            end_process(status)
        sys.exit(status)
    return job.load().main


def end_process(status: int) -> None:
    """Exit with ``status`` now, without the interpreter's teardown.

    After a read-only job has printed its verdict, nothing is left to flush
    or release but the output streams; what teardown would add is native
    libraries' static destructors, and pyarrow's sometimes abort there
    ("terminate called without an active exception", exit 134, about 2 in 100
    runs of threaded parquet reads, with or without Arrow's own thread pools),
    turning an "ok" into a failure. Only jobs marked ``ends_process`` use it,
    and only when run as a program.
    """
    import os

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def usage() -> str:
    lines = ["usage: prx-data JOB [options]   (same as: python -m prx_data.JOB)", "", "jobs:"]
    lines += [f"  {job.name:<14} {job.summary}" for job in JOBS.values()]
    lines += ["", "prx-data JOB --help shows a job's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``prx-data JOB ...``; without ``argv`` it runs as the program (the console script), so a
    job marked ``ends_process`` ends it as ``python -m prx_data.JOB`` does."""
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in JOBS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: no job {argv[0]!r}; the jobs are listed below", file=sys.stderr)
        print(usage())
        return 0 if argv[:1] in ([], ["-h"], ["--help"]) else 2
    job = JOBS[argv[0]]
    status = job.main(argv[1:])
    if as_program and job.ends_process:
        end_process(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
