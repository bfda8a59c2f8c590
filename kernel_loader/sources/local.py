"""Local folders standing in for Hub repos: ``LOCAL_KERNELS`` and ``get_local_kernel(path)``.

A local path may be a repo root (holding ``build/``), a ``build/`` folder, or one variant folder
(holding ``__init__.py`` or ``metadata.json``).
"""

from __future__ import annotations

import re
from pathlib import Path

from kernel_loader import constants
from kernel_loader.errors import KernelNotFoundError

# An entry starts with "org/name=" at the start or after a ',' or ':' separator. Finding keys
# (rather than splitting on ':') keeps Windows drive letters ("C:\k") inside the path.
_KEY_RE = re.compile(r"(?:^|[,:;])\s*([A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)=")


def parse_local_kernels(value: str) -> dict[str, Path]:
    """Parse ``"org/a=/path,org/b=/path"`` (``,`` or ``:`` separated, as in the `kernels` package).

    Raises:
        ValueError: the text does not start with ``org/name=`` or an entry has an empty path.
    """
    text = value.strip()
    matches = list(_KEY_RE.finditer(text))
    if not matches or matches[0].start() != 0:
        raise ValueError(
            f"LOCAL_KERNELS={value!r} is not understood. Expected 'org/a=/path/a,org/b=/path/b' "
            "(',' or ':' between entries)."
        )
    result: dict[str, Path] = {}
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        path = text[match.end() : end].strip()
        if not path:
            raise ValueError(f"LOCAL_KERNELS entry for {match[1]!r} has an empty path (in {value!r})")
        try:
            result[match[1]] = Path(path).expanduser()
        except RuntimeError:  # "~user" naming no user on this machine
            raise ValueError(f"LOCAL_KERNELS entry for {match[1]!r}: {path!r} starts with the home folder of an unknown user (a home folder that does not exist on this machine)") from None
    return result


def local_override(repo_id: str) -> Path | None:
    """The ``LOCAL_KERNELS`` path for ``repo_id``, or None.

    Raises:
        ValueError: ``LOCAL_KERNELS`` is malformed.
    """
    value = constants.local_kernels()
    if value is None:
        return None
    return parse_local_kernels(value).get(repo_id)


def is_variant_folder(path: Path) -> bool:
    """A folder that is itself one build variant."""
    return (path / "__init__.py").is_file() or (path / "metadata.json").is_file()


def build_folder(path: Path, what: str) -> tuple[Path, str | None]:
    """``(folder holding variant folders, the single variant name or None)`` for a local path.

    Raises:
        KernelNotFoundError: ``path`` does not exist or holds no kernel build.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise KernelNotFoundError(f"{what}: {path} is not a folder. Point it at a kernel repo (holding build/<variant>/).")
    if (path / "build").is_dir():
        return path / "build", None
    if is_variant_folder(path):
        return path.parent, path.name
    if any(is_variant_folder(p) for p in path.iterdir() if p.is_dir()):
        return path, None
    raise KernelNotFoundError(
        f"{what}: {path} holds no kernel build (expected build/<variant>/__init__.py or metadata.json)."
    )


def list_variants(build_dir: Path) -> list[str]:
    """Variant folder names under ``build_dir``."""
    try:
        return sorted(p.name for p in build_dir.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    except OSError:
        return []
