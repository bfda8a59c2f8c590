"""``import flash_attn`` without the flash-attn package: a stand-in backed by kernel_loader's kernels.

:func:`install_flash_attn` puts one finder at the end of ``sys.meta_path``. It makes importable

- ``flash_attn`` and ``flash_attn.flash_attn_interface`` -- flash-attn 2's API
  (:mod:`~kernel_loader.flash_attn_compat.fa2`), on the kernel the ``flash_attention_2``
  fallback chain picks (Hub kernel ``kernels-community/flash-attn2``, else the shipped copy);
- ``flash_attn.bert_padding`` -- ``pad_input``, ``unpad_input``, ``index_first_axis``, ...;
- ``flash_attn_interface`` -- FlashAttention 3's API (:mod:`~kernel_loader.flash_attn_compat.fa3`),
  on the kernel of the ``flash_attention_3`` chain, and ``flash_attn_3``, the package name
  FlashAttention 3 installs beside it (transformers 4.57 looks for that name), offering the same;

and, as a distribution finder, answers ``importlib.metadata`` for ``flash-attn`` (version
:data:`FLASH_ATTN_VERSION`) and ``flash-attn-3`` (:data:`FLASH_ATTN_3_VERSION`): transformers
decides whether flash-attn is installed from ``importlib.metadata`` (``packages_distributions()``
and ``version()``), not from the module.

It never shadows a real package: being last on ``sys.meta_path``, any installed ``flash_attn``
is found first, and the finder also steps aside (modules and metadata) whenever another finder
can provide the name. Importing the stand-in imports neither torch nor the kernel; the first
attention call walks the chain (see :mod:`kernel_loader.attention.fallback`, which skips the
stand-in when it looks for the real package).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "FLASH_ATTN_3_VERSION",
    "FLASH_ATTN_VERSION",
    "describe",
    "install_flash_attn",
    "is_flash_attn_installed",
    "is_stand_in",
    "uninstall_flash_attn",
]

#: The flash-attn 2 release whose API the stand-in serves (transformers asks for >= 2.3.3).
FLASH_ATTN_VERSION = "2.8.3"
#: The FlashAttention 3 (``flash_attn_interface``) release whose API the stand-in serves.
FLASH_ATTN_3_VERSION = "3.0.0"


@dataclass(frozen=True)
class _Dist:
    name: str  # distribution name, as flash-attention's setup.py spells it
    version: str
    top_level: str  # the importable name it provides
    chain: str  # the kernel_loader fallback chain behind it


_DISTS = (
    _Dist("flash_attn", FLASH_ATTN_VERSION, "flash_attn", "flash_attention_2"),
    _Dist("flash_attn_3", FLASH_ATTN_3_VERSION, "flash_attn_interface", "flash_attention_3"),
)
# module name -> (the module whose ``__all__`` it offers, whether it is a package)
_MODULES: dict[str, tuple[str, bool]] = {
    "flash_attn": ("kernel_loader.flash_attn_compat.fa2", True),
    "flash_attn.flash_attn_interface": ("kernel_loader.flash_attn_compat.fa2", False),
    "flash_attn.bert_padding": ("kernel_loader.flash_attn_compat.bert_padding", False),
    "flash_attn_interface": ("kernel_loader.flash_attn_compat.fa3", False),
    "flash_attn_3": ("kernel_loader.flash_attn_compat.fa3", True),
}
# Top-level names one real package installs together: the stand-in serves all of them or none.
_TOGETHER = {"flash_attn_interface": ("flash_attn_interface", "flash_attn_3"),
             "flash_attn_3": ("flash_attn_interface", "flash_attn_3")}
_lock = threading.Lock()


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def is_stand_in(module: Any) -> bool:
    """Whether ``module`` (a module or a module spec) is kernel_loader's stand-in, not flash-attn."""
    spec = module if isinstance(module, importlib.machinery.ModuleSpec) else getattr(module, "__spec__", None)
    return isinstance(getattr(spec, "loader", None), _StandInFinder)


def _spec_elsewhere(name: str) -> importlib.machinery.ModuleSpec | None:
    """What the other finders on ``sys.meta_path`` offer for top-level ``name`` (a real package)."""
    for finder in list(sys.meta_path):
        if isinstance(finder, _StandInFinder) or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec(name, None)
        except (ImportError, ValueError, AttributeError, TypeError):  # a broken finder is not a package
            continue
        if spec is not None:
            return spec
    return None


class _StandInDistribution(importlib.metadata.Distribution):
    """The metadata of a stand-in: ``METADATA`` and ``top_level.txt``, nothing on disk."""

    def __init__(self, dist: _Dist) -> None:
        self._dist = dist

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (
                "Metadata-Version: 2.1\n"
                f"Name: {self._dist.name}\n"
                f"Version: {self._dist.version}\n"
                f"Summary: kernel_loader's stand-in for {self._dist.top_level}, running on the kernel of the "
                f"{self._dist.chain} fallback chain (kernel_loader.install_flash_attn)\n"
            )
        if filename == "top_level.txt":
            return self._dist.top_level + "\n"
        return None

    def locate_file(self, path: Any) -> Path:
        # No file of a stand-in exists on disk; a path under kernel_loader's package says whose it is.
        return Path(__file__).parent / str(path)


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and builds the stand-in modules; lists the stand-in distributions."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        entry = _MODULES.get(fullname)
        if entry is None:
            return None
        parent = fullname.rpartition(".")[0]
        if parent:
            if not is_stand_in(sys.modules.get(parent)):
                return None  # a submodule of a real flash_attn is that package's business
        elif any(_spec_elsewhere(name) is not None for name in _TOGETHER.get(fullname, (fullname,))):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin="kernel_loader.flash_attn_compat", is_package=entry[1])

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        source = importlib.import_module(_MODULES[module.__name__][0])
        for attr in source.__all__:
            setattr(module, attr, getattr(source, attr))
        module.__all__ = list(source.__all__)
        if module.__name__ in ("flash_attn_interface", "flash_attn_3"):
            module.__version__ = FLASH_ATTN_3_VERSION
        elif module.__name__ == "flash_attn":
            module.__version__ = FLASH_ATTN_VERSION
        module.__doc__ = (
            f"kernel_loader's stand-in for {module.__name__} (see kernel_loader.flash_attn_compat); "
            f"{source.__doc__.splitlines()[0] if source.__doc__ else ''}"
        )

    def find_distributions(self, context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        wanted = getattr(context, "name", None)
        for dist in _DISTS:
            if wanted is not None and _normalize(wanted) != _normalize(dist.name):
                continue
            loaded = sys.modules.get(dist.top_level)
            if loaded is not None and not is_stand_in(loaded):
                continue
            if loaded is None and any(_spec_elsewhere(name) is not None
                                      for name in _TOGETHER.get(dist.top_level, (dist.top_level,))):
                continue
            yield _StandInDistribution(dist)


def _finder() -> _StandInFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, _StandInFinder)), None)


def _refresh_transformers_checks() -> None:
    """Clear transformers' memoized ``is_flash_attn_*`` answers, if transformers is imported.

    transformers caches whether flash-attn is installed (``functools.lru_cache``), and up to 5.17
    also maps import names to distributions once, at import (``PACKAGE_DISTRIBUTION_MAPPING``); an
    answer computed before the stand-in came or went would otherwise stick for the whole process.
    """
    import_utils = sys.modules.get("transformers.utils.import_utils")
    if import_utils is None:
        return
    mapping = getattr(import_utils, "PACKAGE_DISTRIBUTION_MAPPING", None)
    if isinstance(mapping, dict):
        fresh = importlib.metadata.packages_distributions()
        for dist in _DISTS:
            if dist.top_level in fresh:
                mapping[dist.top_level] = fresh[dist.top_level]
            else:
                mapping.pop(dist.top_level, None)
    for attr in dir(import_utils):
        fn = getattr(import_utils, attr, None)
        if attr.startswith("is_flash_attn") and hasattr(fn, "cache_clear"):
            fn.cache_clear()


def install_flash_attn() -> bool:
    """Make ``flash_attn`` (FA2 API), ``flash_attn.bert_padding`` and ``flash_attn_interface`` (FA3
    API) importable, on kernel_loader's FlashAttention kernels, unless a real package provides them.

    Idempotent and process-wide. Imports neither torch nor a kernel: the first attention call walks
    the ``flash_attention_2`` / ``flash_attention_3`` fallback chain. Call it before transformers
    imports a model's module (GPT-Neo, Falcon and Bark decide at import time whether flash-attn is
    there); transformers' cached ``is_flash_attn_*`` answers are cleared.

    Returns:
        True when the stand-in was installed by this call, False when it already was.

    Raises:
        Nothing.
    """
    with _lock:
        if _finder() is not None:
            return False
        sys.meta_path.append(_StandInFinder())
    _refresh_transformers_checks()
    return True


def uninstall_flash_attn() -> bool:
    """Remove the stand-in: its finder, and its modules from ``sys.modules``.

    Modules that already hold references (``from flash_attn import flash_attn_func``) keep them.

    Returns:
        True when a stand-in was removed, False when none was installed.
    """
    with _lock:
        finder = _finder()
        if finder is None:
            return False
        sys.meta_path.remove(finder)
        for name in _MODULES:
            if is_stand_in(sys.modules.get(name)):
                del sys.modules[name]
    _refresh_transformers_checks()
    return True


def is_flash_attn_installed() -> bool:
    """Whether :func:`install_flash_attn` is in effect in this process."""
    return _finder() is not None


def _real_package(top_level: str) -> str | None:
    """Where a real (non-stand-in) ``top_level`` package lives, or None."""
    loaded = sys.modules.get(top_level)
    if loaded is not None and not is_stand_in(loaded):
        return getattr(loaded, "__file__", None) or "an already imported module"
    spec = _spec_elsewhere(top_level) if loaded is None else None
    return None if spec is None else spec.origin or "an installed package"


def describe(chain: str = "flash_attention_2") -> str:
    """One line on the stand-in for ``chain``'s package, for ``kernel-loader explain``.

    Says whether a real package makes it step aside, whether it is installed in this process, and
    what serves ``import flash_attn`` (or ``flash_attn_interface``) then. Imports nothing heavy.

    Raises:
        KeyError: ``chain`` is not ``flash_attention_2`` or ``flash_attention_3``.
    """
    dist = next((d for d in _DISTS if d.chain == chain), None)
    if dist is None:
        raise KeyError(f"no flash_attn stand-in for {chain!r}; known: {', '.join(d.chain for d in _DISTS)}")
    label = f"{dist.top_level} stand-in"
    real = _real_package(dist.top_level)
    if real is not None:
        return f"{label}: not used, the real {dist.top_level} package is installed ({real})."
    serves = f"`import {dist.top_level}` ({dist.name.replace('_', '-')} {dist.version} API)"
    if is_flash_attn_installed():
        return f"{label}: installed in this process; {serves} runs on the kernel this chain uses."
    return (
        f"{label}: not installed; kernel_loader.install_flash_attn() (or the transformers bridge's "
        f"enable(install_flash_attn=True)) makes {serves} run on the kernel this chain uses."
    )
