"""The on-disk cache: Hugging Face cache layout, read without writing.

``<cache>/<type>s--<org>--<name>/{refs/<revision>, snapshots/<sha>/build/<variant>/...}`` where
``<type>`` is ``kernel`` (the Hub's kernel repos) or ``model`` (mirrors, older repos). Reading
a kernel from here never writes into the cache, so it can live on a shared read-only filesystem.
Downloads go through huggingface_hub (see ``publish.py``), which keeps this layout.

A variant counts as present only when its completion record
``<repo folder>/kernel-loader/<sha>/<variant>.json`` exists: it is written last, after every file
arrived and matched the Hub's listing, so a reader never sees a half-downloaded variant (files in
``snapshots/`` without a record are a download in progress or one that died).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import NamedTuple

from kernel_loader import constants
from kernel_loader.errors import KernelIntegrityError
from kernel_loader.integrity import RECORD_DIR, CompletionRecord, read_record, record_path
from kernel_loader.refs import version_branch

REPO_TYPES = ("kernel", "model")
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")


def is_sha(revision: str | None) -> bool:
    """Whether ``revision`` is a full 40-hex-digit commit sha."""
    return bool(revision) and bool(_SHA_RE.match(revision))  # type: ignore[arg-type]


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir`` if given, else :func:`kernel_loader.constants.cache_dir`."""
    return Path(cache_dir).expanduser() if cache_dir is not None else constants.cache_dir()


def repo_folder(repo_id: str, repo_type: str, cache_dir: str | Path | None = None) -> Path:
    """The cache folder of one repo (the same name huggingface_hub uses)."""
    org, name = repo_id.split("/", 1)
    return cache_root(cache_dir) / f"{repo_type}s--{org}--{name}"


RECORDS = RECORD_DIR  # our folder inside a repo folder, beside huggingface_hub's


class CachedSnapshot(NamedTuple):
    """A commit of a repo present in the cache."""

    repo_id: str
    repo_type: str
    sha: str
    path: Path  # snapshots/<sha>

    @property
    def build_dir(self) -> Path:
        return self.path / "build"

    def record(self, variant: str) -> CompletionRecord | None:
        """The variant's completion record, or None when it is absent, malformed or for another commit."""
        try:
            rec = read_record(record_path(self.path.parent.parent, self.sha, variant))
        except (OSError, KernelIntegrityError):
            return None
        if rec.sha != self.sha or rec.variant != variant or rec.repo_id != self.repo_id:
            return None
        return rec

    def check_records(self) -> None:
        """Refuse a snapshot whose completion records exist but cannot be read.

        A record is written atomically, so an unreadable one was damaged or edited afterwards: it
        proves nothing about the files, and the load stops instead of skipping the variant.

        Raises:
            KernelIntegrityError: naming the record and how to re-fetch the snapshot.
        """
        folder = record_path(self.path.parent.parent, self.sha, "x").parent
        try:
            records = sorted(p for p in folder.iterdir() if p.name.endswith(".json") and not p.name.startswith("."))
        except OSError:
            return
        for path in records:
            read_record(path)

    def variants(self) -> list[str]:
        """Variants completely downloaded into this snapshot (those with a completion record)."""
        try:
            folder = record_path(self.path.parent.parent, self.sha, "x").parent
            names = [p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json")]
        except OSError:
            return []
        return sorted(n for n in names if not n.startswith(".") and self.record(n) is not None)


def _read_ref(folder: Path, revision: str) -> str | None:
    if "/" in revision or revision.startswith("."):
        return None
    try:
        sha = (folder / "refs" / revision).read_text().strip()
    except OSError:
        return None
    return sha if is_sha(sha) else None


def find_snapshot(repo_id: str, revision: str, cache_dir: str | Path | None = None) -> CachedSnapshot | None:
    """The cached snapshot for ``revision`` (a sha, or a branch/tag recorded under ``refs/``).

    Makes no network call and writes nothing. Returns None when the cache does not have it.
    """
    for repo_type in REPO_TYPES:
        folder = repo_folder(repo_id, repo_type, cache_dir)
        sha = revision if is_sha(revision) else _read_ref(folder, revision)
        if sha is None:
            continue
        path = folder / "snapshots" / sha
        if path.is_dir():
            return CachedSnapshot(repo_id, repo_type, sha, path)
    return None


def cached_refs(repo_id: str, cache_dir: str | Path | None = None) -> dict[str, str]:
    """Every ``refs/<name>`` recorded for the repo (branch or tag name -> sha), both repo types."""
    refs: dict[str, str] = {}
    for repo_type in reversed(REPO_TYPES):  # kernel wins over model on conflicts
        folder = repo_folder(repo_id, repo_type, cache_dir) / "refs"
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            if entry.is_file():
                sha = _read_ref(folder.parent, entry.name)
                if sha:
                    refs[entry.name] = sha
    return refs


def cached_versions(repo_id: str, cache_dir: str | Path | None = None) -> dict[int, str]:
    """``vN`` branches recorded in the cache: ``{N: sha}``."""
    refs = cached_refs(repo_id, cache_dir)
    return {n: sha for name, sha in refs.items() if (n := version_branch(name)) is not None}


class CachedRepo(NamedTuple):
    """One kernel repo in the cache, for ``kernel-loader cache ls``."""

    repo_id: str
    repo_type: str
    folder: Path
    refs: dict[str, str]
    snapshots: dict[str, list[str]]  # sha -> variants
    size_bytes: int

    def to_json(self) -> dict:
        return {
            "repo_id": self.repo_id,
            "repo_type": self.repo_type,
            "folder": str(self.folder),
            "refs": self.refs,
            "snapshots": self.snapshots,
            "size_bytes": self.size_bytes,
        }


def _folder_size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def list_cached(cache_dir: str | Path | None = None) -> list[CachedRepo]:
    """Every cached repo that holds at least one snapshot with a ``build/`` folder."""
    root = cache_root(cache_dir)
    repos = []
    try:
        folders = sorted(root.iterdir())
    except OSError:
        return []
    for folder in folders:
        match = re.fullmatch(r"(kernel|model)s--([^-].*?)--(.+)", folder.name)
        if not match or not folder.is_dir():
            continue
        repo_id = f"{match[2]}/{match[3]}"
        snaps = {}
        for snap in sorted((folder / "snapshots").glob("*")):
            snapshot = CachedSnapshot(repo_id, match[1], snap.name, snap)
            if snapshot.build_dir.is_dir():
                snaps[snap.name] = snapshot.variants()
        if not snaps:
            continue
        refs = {}
        for ref in sorted((folder / "refs").glob("*")):
            sha = _read_ref(folder, ref.name)
            if sha:
                refs[ref.name] = sha
        repos.append(CachedRepo(repo_id, match[1], folder, refs, snaps, _folder_size(folder)))
    return repos


def prune(cache_dir: str | Path | None = None, keep_shas: set[str] | None = None, dry_run: bool = False) -> list[Path]:
    """Remove cached kernel snapshots superseded by a newer download.

    A snapshot goes when its repo has refs (branches/tags recorded by downloads), none of them
    points to it, and its sha is not in ``keep_shas``. Repos fetched only by sha (e.g. from a
    lock file) have no refs and are kept whole. Blobs no longer used by any snapshot are removed
    too. Returns what was (or, with ``dry_run``, would be) removed.

    Raises:
        OSError: the cache is read-only or a file cannot be removed.
    """
    keep = set(keep_shas or ())
    removed: list[Path] = []
    for repo in list_cached(cache_dir):
        if not repo.refs:
            continue
        live = set(repo.refs.values()) | keep
        for sha in repo.snapshots:
            if sha not in live:
                removed.append(repo.folder / "snapshots" / sha)
                if not dry_run:
                    # the record goes first: a variant is never listed while its files are going
                    shutil.rmtree(repo.folder / RECORDS / sha, ignore_errors=True)
                    shutil.rmtree(repo.folder / "snapshots" / sha)
        blobs = repo.folder / "blobs"
        if not blobs.is_dir():
            continue
        # Blobs used by no snapshot that stays; computed the same way with --dry-run, so the
        # dry run lists exactly what a real prune removes.
        gone = {p.name for p in removed if p.parent == repo.folder / "snapshots"}
        used = {
            Path(link.resolve()).name
            for snap in (repo.folder / "snapshots").glob("*")
            if snap.name not in gone
            for link in snap.rglob("*")
            if link.is_symlink()
        }
        for blob in sorted(blobs.iterdir()):
            if blob.name not in used:
                removed.append(blob)
                if not dry_run:
                    blob.unlink()
    return removed


def remove(
    repo_id: str, revision: str | None = None, cache_dir: str | Path | None = None, keep_refs: bool = False
) -> list[Path]:
    """Remove a cached repo (both repo types), or one revision of it; returns what was removed.

    For a revision (branch, tag or sha): its snapshot, the refs that point to it (unless
    ``keep_refs``, for a re-fetch of the same sha), its completion records, and the blobs no other
    snapshot uses, so that the next download fetches every file afresh (a damaged blob is never
    reused).

    Raises:
        OSError: the cache is read-only or a file cannot be removed.
    """
    removed: list[Path] = []
    for repo_type in REPO_TYPES:
        folder = repo_folder(repo_id, repo_type, cache_dir)
        if not folder.is_dir():
            continue
        if revision is None:
            shutil.rmtree(folder)
            removed.append(folder)
            continue
        sha = revision if is_sha(revision) else _read_ref(folder, revision)
        if sha is None:
            continue
        snapshot = folder / "snapshots" / sha
        others = [s for s in (folder / "snapshots").glob("*") if s.name != sha]
        keep = {Path(link.resolve()).name for s in others for link in s.rglob("*") if link.is_symlink()}
        mine = {Path(link.resolve()).name for link in snapshot.rglob("*") if link.is_symlink()} if snapshot.is_dir() else set()
        for ref in [] if keep_refs else sorted((folder / "refs").glob("*")):
            if _read_ref(folder, ref.name) == sha:
                ref.unlink()
                removed.append(ref)
        for target in (snapshot, folder / "kernel-loader" / sha):
            if target.is_dir():
                shutil.rmtree(target)
                removed.append(target)
        for blob in sorted(mine - keep):
            path = folder / "blobs" / blob
            if path.is_file():
                path.unlink()
                removed.append(path)
    return removed
