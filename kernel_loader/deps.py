"""Python dependencies declared by a kernel build (``metadata.json`` ``python-depends``).

A dependency counts as installed when its distribution is (``importlib.metadata``), or when a
top-level module of its import name can be found (``importlib.util.find_spec`` on a name without
dots). Nothing is imported: ``find_spec("a.b")`` would import ``a``, so only top-level names are
ever looked up.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from kernel_loader.errors import MissingDependencyError
from kernel_loader.metadata import requirement_name

# Distribution name -> import name, where they differ (as in the `kernels` package's table).
_IMPORT_NAMES = {
    "nvidia-cutlass-dsl": "cutlass",
    "tvm-ffi": "tvm_ffi",
    "apache-tvm-ffi": "tvm_ffi",
    "onednn-devel": None,  # nothing importable to check
}
_PIP_NAMES = {"tvm-ffi": "apache-tvm-ffi"}


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
        return True
    except (importlib.metadata.PackageNotFoundError, ValueError):
        pass
    module = _IMPORT_NAMES.get(name, name.replace("-", "_"))
    if module is None:
        return True
    top = module.split(".", 1)[0]
    if not top.isidentifier():
        return False
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def missing_dependencies(metadata: dict | None) -> list[str]:
    """The declared dependencies that are not installed here (pip names); imports nothing.

    ``metadata`` is a record from :mod:`kernel_loader.metadata` (``python-depends`` a list of
    requirement strings).
    """
    missing = []
    for dep in (metadata or {}).get("python-depends") or []:
        name = requirement_name(str(dep))
        if name and not _installed(name):
            missing.append(_PIP_NAMES.get(name, name))
    return missing


def check_dependencies(metadata: dict | None, what: str) -> None:
    """Raise when a declared Python dependency is not installed.

    Raises:
        MissingDependencyError: naming the missing packages and the pip command.
    """
    missing = missing_dependencies(metadata)
    if missing:
        raise MissingDependencyError(
            f"{what} needs Python packages that are not installed: {', '.join(missing)}. "
            f"Install them with `pip install {' '.join(missing)}`."
        )
