"""This package's kernel modules, imported on first use.

Why: the kernel modules import Triton (and Gluon), so the package must not import them before a
call needs them; and a ``from .module import f`` statement inside a hot function runs the
import machinery on every call, about a microsecond each, several times per training step.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_MODULES: dict = {}


def module(name: str) -> ModuleType:
    """This package's module ``name`` (``"_gluon_fwd"``), imported on the first call. Attributes
    are read from the module at call time, so patching them works. Raises ImportError."""
    found = _MODULES.get(name)
    if found is None:
        found = _MODULES[name] = importlib.import_module(f"{__package__}.{name}")
    return found
