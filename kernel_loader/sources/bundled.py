"""The kernel repos shipped inside this package (``kernel_repos/``), the embedded default.

In an installed wheel they are the data package ``kernel_loader._kernel_repos``; in a source
checkout they sit in ``kernel_repos/`` at the repo root. Shipped repos are always trusted.
Using one is never silent: :func:`warn_bundled` warns once per repo.
"""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path

from kernel_loader import constants, metadata

logger = logging.getLogger("kernel_loader")


class BundledKernelWarning(UserWarning):
    """A kernel was loaded from the copy shipped with kernel_loader instead of the Hub or cache."""


@functools.lru_cache(maxsize=1)
def bundled_root() -> Path | None:
    """The folder holding ``<org>/<name>/`` shipped repos, or None when none are shipped."""
    try:
        from importlib.resources import files

        root = Path(str(files("kernel_loader._kernel_repos")))
        if root.is_dir():
            return root
    except (ImportError, ModuleNotFoundError, TypeError):
        pass
    checkout = Path(__file__).resolve().parents[2] / "kernel_repos"
    return checkout if checkout.is_dir() else None


def bundled_repo(repo_id: str) -> Path | None:
    """The shipped repo folder for ``repo_id`` (holding ``build/``), or None.

    Returns None when ``KERNEL_LOADER_NO_BUNDLED=1``.
    """
    if constants.no_bundled():
        return None
    root = bundled_root()
    if root is None:
        return None
    path = root.joinpath(*repo_id.split("/", 1))
    return path if (path / "build").is_dir() else None


def bundled_repo_ids() -> list[str]:
    """Every shipped repo id (``org/name``)."""
    root = bundled_root()
    if root is None:
        return []
    return sorted(f"{p.parent.name}/{p.name}" for p in root.glob("*/*") if (p / "build").is_dir())


def bundled_version(variant_dir: Path) -> int | None:
    """The ``version`` recorded in a shipped variant's ``metadata.json`` (None if absent)."""
    meta = metadata.read_metadata(variant_dir / "metadata.json")
    return meta.version if meta is not None else None


_warned: set[str] = set()


def warn_bundled(repo_id: str, why: str) -> None:
    """Warn (once per repo and process) that the shipped copy of ``repo_id`` is in use."""
    if repo_id in _warned:
        return
    _warned.add(repo_id)
    message = (
        f"Using the copy of {repo_id} shipped with kernel_loader ({why}). "
        f"To use the Hub version, prefetch it while online: `kernel-loader download {repo_id}` "
        f"(see `kernel-loader explain {repo_id}`); set KERNEL_LOADER_NO_BUNDLED=1 to forbid shipped copies."
    )
    # the warning is what the user sees; the log keeps a record at INFO so an unconfigured
    # logging setup (Python's last-resort handler prints WARNING) does not print it twice
    logger.info(message)
    warnings.warn(message, BundledKernelWarning, stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    # Point the warning at the first frame outside kernel_loader, however deep the call chain.
    import sys

    package_dir = str(Path(__file__).resolve().parents[1])
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package_dir):
        frame, level = frame.f_back, level + 1
    return level
