"""Package attributes imported on first use (a module ``__getattr__``, PEP 562)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_attributes(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """A ``__getattr__`` for ``package`` that imports ``package.<where[name]>`` when ``name`` is
    first asked for and returns its attribute of that name."""

    def __getattr__(name: str) -> object:
        if name in where:
            return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
