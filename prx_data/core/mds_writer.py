"""``streaming.MDSWriter`` and ``streaming.base`` without running the package's ``__init__``.

``import streaming`` runs the package's ``__init__``, which imports every
dataset it ships (C4's tokenizer pulls in transformers and torch's dynamo):
6.5-13 s on a loaded 2-core machine, in every fresh Ray worker before its
first work unit, the main part of a small export's fixed start-up. The writer
needs only ``streaming.base.format`` (and torch, through
``streaming.base.distributed``). So when ``streaming`` is not imported yet,
the packages ``streaming`` and ``streaming.base`` are registered with their
``__init__`` deferred: the writer's modules load beneath them, and the first
attribute the package does not have yet (``streaming.StreamingDataset``,
``streaming.__version__``, ...) runs the real ``__init__`` in that same module
object. Everything else that imports ``streaming`` sees the real package.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types

#: Streaming releases whose writer lives at ``streaming.base.format.mds.writer``.
SUPPORTED = ("0.13.",)
_RUN_LOCK = threading.RLock()


class _Deferred(types.ModuleType):
    """A package module whose ``__init__`` runs on the first attribute it lacks."""

    def __getattr__(self, attr: str):
        with _RUN_LOCK:  # one thread runs the __init__; the others wait for it
            if type(self) is _Deferred:
                self.__class__ = types.ModuleType  # from here on a plain module
                self.__spec__.loader.exec_module(self)
        return getattr(self, attr)  # AttributeError as usual when the package has none


def _defer(name: str) -> None:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not installed: `pip install mosaicml-streaming`")
    mod = importlib.util.module_from_spec(spec)
    mod.__class__ = _Deferred
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        types.ModuleType.__setattr__(sys.modules[parent], child, mod)


def defer_package_init() -> None:
    """Register ``streaming`` and ``streaming.base`` with their ``__init__`` deferred, if not imported."""
    if "streaming" not in sys.modules:
        _defer("streaming")
        _defer("streaming.base")


def streaming_version() -> str:
    """The installed streaming release, without running the package ``__init__`` for it."""
    defer_package_init()
    pkg = sys.modules["streaming"]
    if type(pkg) is _Deferred:
        from streaming._version import __version__

        return __version__
    return pkg.__version__


def mds_writer() -> type:
    """The ``MDSWriter`` class, importing as little of ``streaming`` as it can."""
    if not streaming_version().startswith(SUPPORTED):  # another layout: run the package now
        import streaming

        return streaming.MDSWriter
    from streaming.base.format.mds.writer import MDSWriter

    return MDSWriter
