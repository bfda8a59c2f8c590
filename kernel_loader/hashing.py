"""Content hashes of variant folders, for lock files and for naming shipped/local kernels.

A variant's hash is ``sha256-<hex>`` over its files' ``path`` + digest lines, sorted by path.
Per-file digests come in two kinds so a lock can be written from the Hub's file listing
without downloading anything: ``git-sha1:<hex>`` (git blob id) and ``sha256:<hex>`` (file
content, what Git LFS records).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

HASH_TYPE = "sha256_files"
_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


def variant_files(folder: Path) -> list[tuple[str, Path]]:
    """``(relative posix path, absolute path)`` of every file in a variant, sorted; bytecode skipped."""
    files = []
    for path in folder.rglob("*"):
        rel = path.relative_to(folder)
        if any(part in _SKIP_DIRS for part in rel.parts) or path.name.endswith(_SKIP_SUFFIXES):
            continue
        if path.is_file():
            files.append((rel.as_posix(), path))
    return sorted(files)


def file_digest(path: Path, kind: str = "sha256") -> str:
    """``"sha256:<hex>"`` or ``"git-sha1:<hex>"`` of one file.

    Raises:
        ValueError: unknown ``kind``.
        OSError: the file cannot be read.
    """
    data = path.read_bytes()
    if kind == "sha256":
        return "sha256:" + hashlib.sha256(data).hexdigest()
    if kind == "git-sha1":
        return "git-sha1:" + hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    raise ValueError(f"unknown digest kind {kind!r} (expected 'sha256' or 'git-sha1')")


def combine(files: dict[str, str]) -> str:
    """The variant hash ``sha256-<hex>`` from ``{relative path: digest}``."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]}\n".encode())
    return "sha256-" + h.hexdigest()


def hash_folder(folder: Path, kinds: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """Hash a variant folder: ``(variant hash, {relative path: digest})``.

    ``kinds`` maps a relative path to the digest kind a lock recorded for it (default sha256),
    so a folder can be checked against a lock written from the Hub's listing.

    Raises:
        OSError: a file cannot be read.
    """
    kinds = kinds or {}
    files = {}
    for rel, path in variant_files(folder):
        kind = kinds.get(rel, "sha256").split(":", 1)[0]
        files[rel] = file_digest(path, kind if kind in ("sha256", "git-sha1") else "sha256")
    return combine(files), files
