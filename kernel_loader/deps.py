"""Python dependencies declared by a kernel build (``metadata.json`` ``python-depends``)."""

from __future__ import annotations

import importlib.util

from kernel_loader.errors import MissingDependencyError

# Distribution name -> import name, where they differ (as in the `kernels` package's table).
_IMPORT_NAMES = {
    "nvidia-cutlass-dsl": "cutlass",
    "tvm-ffi": "tvm_ffi",
    "apache-tvm-ffi": "tvm_ffi",
    "onednn-devel": None,  # nothing importable to check
}
_PIP_NAMES = {"tvm-ffi": "apache-tvm-ffi"}


def missing_dependencies(metadata: dict | None) -> list[str]:
    """The declared dependencies that cannot be imported here (pip names)."""
    missing = []
    for dep in (metadata or {}).get("python-depends") or []:
        name = str(dep).split(";")[0].split("[")[0].strip()
        for op in ("==", ">=", "<=", "~=", ">", "<", "!="):
            name = name.split(op)[0].strip()
        if not name:
            continue
        module = _IMPORT_NAMES.get(name, name.replace("-", "_"))
        if module is None:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
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
