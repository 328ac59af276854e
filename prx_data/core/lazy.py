"""Names a package exports that load on first use, so that importing the package stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[list[str], Callable[[str], Any]]:
    """``(__all__, __getattr__)`` for ``package``: each name loads from its module when first used.

    Args:
        package: the package's ``__name__``.
        exports: name -> the module that defines it; a dotted path is absolute,
            a bare name is a submodule of ``package``.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        where = exports[name]
        return getattr(
            importlib.import_module(where if "." in where else f"{package}.{where}"), name
        )

    return sorted(exports), __getattr__
