"""Lock files (``kernels.lock``): pinned shas and per-variant content hashes.

Written format (a JSON list, one entry per kernel; the layout the `kernels` package used before
0.11, which recorded exactly these fields)::

    [{"repo_id": "org/name", "sha": "<40 hex>", "version": 1,
      "variants": {"torch-universal": {"hash": "sha256-…", "hash_type": "sha256_files",
                                       "files": {"pkg/__init__.py": "git-sha1:…"}}}}]

Also read: the `kernels` 0.17 format (``[{"dependency": {"repo-id", "version"|"revision"},
"lock": {"commit"}}]``), which pins the sha but has no content hash; ``write_lock(...,
fmt="kernels")`` writes it for projects that also use that package.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kernel_loader import cache
from kernel_loader.errors import LockfileError
from kernel_loader.refs import KernelRef

LOCK_NAME = "kernels.lock"


@dataclass
class LockEntry:
    """One locked kernel: repo, sha, and for each variant its hash (``{"hash", "hash_type", "files"}``)."""

    repo_id: str
    sha: str
    variants: dict[str, dict] = field(default_factory=dict)
    version: int | None = None
    revision: str | None = None

    def to_json(self) -> dict:
        out: dict = {"repo_id": self.repo_id, "sha": self.sha}
        if self.version is not None:
            out["version"] = self.version
        if self.revision is not None:
            out["revision"] = self.revision
        out["variants"] = {k: self.variants[k] for k in sorted(self.variants)}
        return out


def find_lockfile(start: Path | None = None) -> Path | None:
    """The nearest ``kernels.lock`` in ``start`` (default: the current folder) or its parents."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / LOCK_NAME
        if candidate.is_file():
            return candidate
    return None


def read_lock(path: str | Path) -> list[LockEntry]:
    """Parse a lock file in either format.

    Raises:
        LockfileError: missing, not JSON, or entries without a valid repo id and sha.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise LockfileError(f"Cannot read lock file {path}: {exc}. Create it with `kernel-loader lock`.") from None
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the json module follows
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise LockfileError(f"Lock file {path} is not valid JSON ({detail}). Re-create it with `kernel-loader lock`.") from None
    if not isinstance(data, list):
        raise LockfileError(f"Lock file {path} must hold a JSON list of kernels, found {type(data).__name__}.")
    entries = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise LockfileError(f"Lock file {path}: entry {i} is not an object.")
        if "dependency" in item:  # kernels >= 0.11
            dep, lock = item.get("dependency") or {}, item.get("lock") or {}
            if not isinstance(dep, dict) or not isinstance(lock, dict):
                raise LockfileError(f"Lock file {path}: entry {i} needs 'dependency' and 'lock' objects.")
            repo_id, sha = dep.get("repo-id"), lock.get("commit")
            entry = LockEntry(str(repo_id), str(sha), {}, dep.get("version"), dep.get("revision"))
        else:
            repo_id, sha = item.get("repo_id"), item.get("sha")
            variants = item.get("variants") or {}
            if not isinstance(variants, dict) or not all(
                isinstance(v, dict) and isinstance(v.get("hash", ""), str) and isinstance(v.get("hash_type", ""), str)
                for v in variants.values()
            ):
                raise LockfileError(
                    f"Lock file {path}: 'variants' of entry {i} must map variant names to "
                    '{"hash": "sha256-…", "hash_type": "…"} objects.'
                )
            entry = LockEntry(str(repo_id), str(sha), variants, item.get("version"), item.get("revision"))
        try:
            if KernelRef.parse(entry.repo_id).repo_id != entry.repo_id:
                raise ValueError(entry.repo_id)
        except Exception:
            raise LockfileError(f"Lock file {path}: entry {i} has an invalid repo id {repo_id!r}.") from None
        if not cache.is_sha(entry.sha):
            raise LockfileError(f"Lock file {path}: {entry.repo_id} has sha {sha!r}, expected 40 hex digits.")
        if (entry.version is not None and (isinstance(entry.version, bool) or not isinstance(entry.version, int))) or (
            entry.revision is not None and not isinstance(entry.revision, str)
        ):
            raise LockfileError(f"Lock file {path}: {entry.repo_id} needs an integer version or a string revision.")
        entries.append(entry)
    return entries


def write_lock(entries: list[LockEntry], path: str | Path, fmt: str = "kernel_loader") -> Path:
    """Write a lock file (``fmt``: ``"kernel_loader"`` with hashes, or ``"kernels"`` for `kernels` 0.17).

    Raises:
        ValueError: unknown ``fmt``.
        OSError: the file cannot be written.
    """
    path = Path(path)
    entries = sorted(entries, key=lambda e: e.repo_id)
    if fmt == "kernel_loader":
        data = [e.to_json() for e in entries]
    elif fmt == "kernels":
        data = []
        for e in entries:
            dep: dict = {"repo-id": e.repo_id}
            if e.version is not None:
                dep["version"] = e.version
            else:
                dep["revision"] = e.revision or e.sha
            data.append({"dependency": dep, "lock": {"commit": e.sha}})
    else:
        raise ValueError(f"unknown lock format {fmt!r}: use 'kernel_loader' or 'kernels'")
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def toml_module():
    """``tomllib`` (``tomli`` before Python 3.11), imported on first use: loading through a lock
    never reads TOML, and importing tomllib costs ~4 ms."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib


def read_dependencies(pyproject: str | Path) -> dict[str, int | str]:
    """``[tool.kernels.dependencies]`` of a pyproject.toml: ``{"org/name": version or revision}``.

    Raises:
        LockfileError: the file is missing or unreadable, the table is absent, or a value is
            neither an int (version) nor a string / ``{revision = "..."}`` / ``{version = N}``.
    """
    pyproject = Path(pyproject)
    tomllib = toml_module()
    try:
        data = tomllib.loads(pyproject.read_text())
    except OSError as exc:
        raise LockfileError(f"Cannot read {pyproject}: {exc}.") from None
    except tomllib.TOMLDecodeError as exc:
        raise LockfileError(f"{pyproject} is not valid TOML: {exc}.") from None
    tool = data.get("tool")
    kernels = tool.get("kernels") if isinstance(tool, dict) else None
    table = kernels.get("dependencies") if isinstance(kernels, dict) else None
    if not isinstance(table, dict) or not table:
        raise LockfileError(
            f"{pyproject} has no [tool.kernels.dependencies] table. Add one, e.g.\n"
            '[tool.kernels.dependencies]\n"kernels-community/flash-attn2" = 1'
        )
    deps: dict[str, int | str] = {}
    for repo_id, spec in table.items():
        if isinstance(spec, dict):
            spec = spec.get("version", spec.get("revision"))
        if isinstance(spec, bool) or not isinstance(spec, (int, str)):
            raise LockfileError(f"{pyproject}: {repo_id} = {spec!r}; expected a version number or a revision string.")
        try:
            KernelRef.parse(repo_id)
        except Exception as exc:
            raise LockfileError(f"{pyproject}: {exc}") from None
        deps[repo_id] = spec
    return deps


def lock_for(repo_id: str, lockfile: str | Path | None) -> tuple[Path, LockEntry]:
    """The lock file (given, else the nearest ``kernels.lock``) and its entry for ``repo_id``.

    Raises:
        LockfileError: no lock file, or ``repo_id`` is not in it.
    """
    path = Path(lockfile) if lockfile is not None else find_lockfile()
    if path is None:
        raise LockfileError(
            f"No {LOCK_NAME} in {Path.cwd()} or its parents for {repo_id}. "
            f"Create one with `kernel-loader lock` (reads [tool.kernels.dependencies] from pyproject.toml)."
        )
    for entry in read_lock(path):
        if entry.repo_id == repo_id:
            return path, entry
    raise LockfileError(f"{repo_id} is not locked in {path}. Add it to pyproject.toml and run `kernel-loader lock`.")
