"""Where the trainer works around Composer 0.32's autoresume on several nodes.

Three things, all during ``Trainer.__init__`` (autoresume's checkpoint
lookup and the checkpoint load); docs/TRAINING.md, "Multi-node":

* **Per-node signal files** (:func:`per_node_signal_files`). Composer
  synchronises the ranks of a node with a file: local rank 0 writes
  ``<folder>/._signal_file_node<N>_<random>``, the other local ranks wait for
  it, and local rank 0 removes it after a global barrier.
  ``composer.utils.dist.get_node_signal_file_name`` broadcasts that name from
  global rank 0, so every node gets *node 0's* name. For autoresume the
  folder is ``save_folder``; when the nodes share it (NFS, Lustre, or one
  working directory under an ``s3://`` save folder, which Composer mirrors
  under ``./s3:/...``), every node's local rank 0 writes the same file and
  the second to remove it fails with ``FileNotFoundError``: a multi-node run
  cannot start. The fix keeps the random part global rank 0 drew (every rank
  still makes the same collective call) and puts each node's own rank in the
  name, which is what the function's docstring intends: one file per node.
  Checkpoints stay where they are; only Composer's scratch name changes.
* **A fresh download of a remote checkpoint** (:func:`drop_stale_autoresume_copy`).
* **One line** instead of Composer's traceback when a node cannot read the
  checkpoint rank 0 found (:func:`multinode_safe`).

The patch applies only while a ``Trainer`` is built and only on the Composer
versions in :data:`SUPPORTED`; the contract tests in
``tests/test_train_nodes.py`` pin the Composer source each piece relies on.
When upgrading Composer, re-run them and the slow two-node tests, then add
the version.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import composer
from composer.utils import dist as composer_dist

from prx_data.core.errors import UsageError

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Composer release prefixes whose signal-file handling this module was checked against.
SUPPORTED = ("0.32.",)
#: Composer's name: ``._signal_file_node<node rank of global rank 0>_<6 random characters>``.
_NAME = re.compile(r"\._signal_file_node\d+_(?P<tag>[A-Za-z0-9]+)")


def node_signal_file_name(broadcast_name: str, node_rank: int) -> str:
    """This node's signal-file name from the one global rank 0 broadcast (pure).

    Keeps Composer's format when it recognises it; otherwise appends the node
    rank, which is just as unique.
    """
    m = _NAME.fullmatch(broadcast_name)
    if m is None:
        return f"{broadcast_name}.node{node_rank}"
    return f"._signal_file_node{node_rank}_{m.group('tag')}"


def supported(version: str | None = None) -> bool:
    """True when ``version`` (default: the installed Composer) is one this module knows."""
    return (version or composer.__version__).startswith(SUPPORTED)


@contextmanager
def per_node_signal_files() -> Iterator[None]:
    """Within the block, Composer's node signal files are named per node (see the module doc).

    Restores Composer's function on exit. On an unknown Composer version it
    changes nothing and warns when the job spans several nodes.
    """
    if not supported():
        if composer_dist.get_world_size() > composer_dist.get_local_world_size():
            log.warning(
                "composer %s is not one of %s: its node signal files are left as they are; "
                "on a save_folder shared by the nodes, autoresume may fail at start-up with "
                "FileNotFoundError ._signal_file_node0_* (see prx_data/train/composer_compat.py)",
                composer.__version__,
                ", ".join(v + "x" for v in SUPPORTED),
            )
        yield
        return
    original: Callable[..., str] = composer_dist.get_node_signal_file_name

    def per_node(*args, **kwargs) -> str:
        name = original(*args, **kwargs)  # collective: every rank calls it, as Composer does
        return node_signal_file_name(name, composer_dist.get_node_rank())

    composer_dist.get_node_signal_file_name = per_node
    try:
        yield
    finally:
        composer_dist.get_node_signal_file_name = original


def multinode_safe(factory: Callable[..., _T]) -> Callable[..., _T]:
    """``factory`` (``composer.Trainer``) built inside :func:`per_node_signal_files`.

    Composer's "Downloading the checkpoint to all nodes failed" (a node
    cannot read the checkpoint global rank 0 found) becomes one line that
    says what to do.
    """

    @functools.wraps(factory)
    def build(*args, **kwargs) -> _T:
        try:
            with per_node_signal_files():
                return factory(*args, **kwargs)
        except RuntimeError as e:
            if MISSING_ON_A_NODE not in str(e):
                raise
            raise CheckpointNotOnEveryNode(
                f"autoresume: the latest checkpoint in save_folder {kwargs.get('save_folder')!r} "
                "is on global rank 0's node only; the other nodes cannot read it (a node-local "
                "disk?). Put trainer.save_folder on a file system every node mounts or on object "
                "storage (s3://...), copy the folder to every node, or resume on that node alone "
                "(docs/TRAINING.md, Multi-node)"
            ) from None

    return build


#: What Composer 0.32 raises when some node lacks the checkpoint rank 0 resumes from.
MISSING_ON_A_NODE = "Downloading the checkpoint to all nodes failed"


class CheckpointNotOnEveryNode(UsageError):
    """Autoresume found the checkpoint on global rank 0's node but not on every node."""


#: Composer's default ``save_latest_filename`` (the trainer does not change it).
LATEST_FILENAME = "latest-rank{rank}.pt"


def remote_autoresume_copy(save_folder: str, run_name: str, cwd: str | None = None) -> str | None:
    """Where Composer 0.32 mirrors a remote save folder's latest checkpoint; None if local.

    Autoresume joins the URI with the latest file name and takes
    ``os.path.abspath`` of it, so ``s3://b/runs/x/checkpoints`` becomes
    ``<cwd>/s3:/b/runs/x/checkpoints/latest-rank0.pt``. Local rank 0 of each
    node downloads the remote latest checkpoint there *only if that file does
    not exist*, so a copy left by an earlier resume is loaded instead of the
    newer checkpoint in the bucket.
    """
    from composer.utils import format_name_with_dist, parse_uri

    backend, _, _ = parse_uri(save_folder)
    if not backend:
        return None
    folder = format_name_with_dist(save_folder, run_name)
    name = LATEST_FILENAME.format(rank=0)  # the path global rank 0 broadcasts
    path = os.path.join(folder, name)
    return os.path.abspath(path) if cwd is None else os.path.normpath(os.path.join(cwd, path))


def drop_stale_autoresume_copy(save_folder: str | None, run_name: str | None) -> str | None:
    """Before autoresume on a remote save folder: remove Composer's previous download of it.

    The bucket holds the run's checkpoints; the mirror under the working
    directory is only ever a download Composer made at an earlier resume
    (checkpoints are saved under ``TMPDIR`` and uploaded). Removing it makes
    every resume fetch the newest checkpoint. Local rank 0 of each node
    removes it, then all ranks meet at a barrier, before any node downloads.
    Returns the path removed, if any. Does nothing for a local save folder or
    an unknown Composer version.
    """
    if not save_folder or not run_name or not supported():
        return None
    path = remote_autoresume_copy(save_folder, run_name)
    removed = None
    if path is not None and composer_dist.get_local_rank() == 0:
        try:
            os.remove(path)
            removed = path
            log.info("autoresume: removed the earlier download %s; fetching the latest", path)
        except FileNotFoundError:
            pass
    if path is not None:
        composer_dist.barrier()
    return removed
