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

from kernel_loader import cache, constants, hashing, integrity, metadata, trust
from kernel_loader.errors import (
    KernelIntegrityError,
    LockfileError,
    NoCompatibleVariantError,
    OfflineKernelMissingError,
)
from kernel_loader.machine import detect_machine
from kernel_loader.refs import KernelRef
from kernel_loader.resolution import Resolution
from kernel_loader.variants import select_variant

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
        raise LockfileError(f"Lock file {path} is not valid JSON ({type(exc).__name__}). Re-create it with `kernel-loader lock`.") from None
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


def read_dependencies(pyproject: str | Path) -> dict[str, int | str]:
    """``[tool.kernels.dependencies]`` of a pyproject.toml: ``{"org/name": version or revision}``.

    Raises:
        LockfileError: the file is missing or unreadable, the table is absent, or a value is
            neither an int (version) nor a string / ``{revision = "..."}`` / ``{version = N}``.
    """
    pyproject = Path(pyproject)
    try:
        # imported here: loading through a lock never reads TOML, and tomllib costs ~4 ms to import
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover
            import tomli as tomllib  # type: ignore[no-redef]
        data = tomllib.loads(pyproject.read_text())
    except OSError as exc:
        raise LockfileError(f"Cannot read {pyproject}: {exc}.") from None
    except tomllib.TOMLDecodeError as exc:
        raise LockfileError(f"{pyproject} is not valid TOML: {exc}.") from None
    table = data
    for key in ("tool", "kernels", "dependencies"):
        table = table.get(key) if isinstance(table, dict) else None
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


def lock_entry_from_hub(repo_id: str, spec: int | str) -> LockEntry:
    """Resolve one dependency on the Hub and hash every variant from the file listing (no download).

    Raises:
        KernelNotFoundError: the repo, version or revision does not exist.
        OfflineKernelMissingError: the Hub cannot be reached.
    """
    from kernel_loader.errors import KernelNotFoundError
    from kernel_loader.sources import hub

    try:
        remote = hub.remote_repo(repo_id)
        if isinstance(spec, int):
            sha = remote.versions().get(spec)
            if sha is None:
                have = ", ".join(f"v{v}" for v in sorted(remote.versions())) or "none"
                raise KernelNotFoundError(f"{repo_id}: version {spec} not found on {constants.hf_endpoint()} (versions: {have}).")
        else:
            sha = {**remote.tags, **remote.branches}.get(spec) or (spec if cache.is_sha(spec) else None)
            if sha is None:
                raise KernelNotFoundError(f"{repo_id}: revision {spec!r} not found on {constants.hf_endpoint()}.")
        entry = LockEntry(repo_id, sha, {}, spec if isinstance(spec, int) else None, spec if isinstance(spec, str) else None)
        for variant in hub.list_variants(repo_id, remote.repo_type, sha):
            files = hub.variant_file_digests(repo_id, remote.repo_type, sha, variant)
            entry.variants[variant] = {"hash": hashing.combine(files), "hash_type": hashing.HASH_TYPE, "files": files}
    except hub.HubUnreachable as exc:
        raise OfflineKernelMissingError(f"Cannot lock {repo_id}: the Hub is unreachable ({exc}).") from None
    except hub.HubRepoMissing as exc:
        raise KernelNotFoundError(f"Cannot lock {repo_id}: {exc}.") from None
    return entry


def _lock_for(repo_id: str, lockfile: str | Path | None) -> tuple[Path, LockEntry]:
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


def _shipped_match(repo_id: str, entry: LockEntry, machine, res: Resolution) -> Resolution | None:
    """The shipped copy, if one of its variants has exactly the locked content (hash-checked)."""
    from kernel_loader.sources import bundled

    root = bundled.bundled_repo(repo_id)
    if root is None:
        return None
    names = [n for n in entry.variants if (root / "build" / n).is_dir() and entry.variants[n].get("hash")]
    chosen, decisions = select_variant(names, machine, lambda v: metadata.variant_metadata(root / "build" / v))
    if chosen is None:
        return None
    try:
        integrity.verify_lock_variant(root / "build" / chosen, entry.variants[chosen], repo_id, memo_dir=integrity.default_memo_dir())
    except (KernelIntegrityError, LockfileError):
        return None
    res.source, res.variant, res.path, res.decisions = "bundled", chosen, root / "build" / chosen, decisions
    res.notes.append("not in the cache; the shipped copy has exactly the locked files (hash checked)")
    res.fallback = "the cache lacks the locked sha"
    res.notes.append("lock pinned: no network call")
    bundled.warn_bundled(repo_id, f"it matches the hash locked in {res.lockfile} and the cache lacks it")
    return res


def resolve_locked(
    repo_id: str, lockfile: str | Path | None = None, machine=None, trust_remote_code: bool = False
) -> Resolution:
    """Resolve a lock-pinned kernel from the cache (no network call), verified against the lock.

    Raises:
        LockfileError, UntrustedKernelError, OfflineKernelMissingError, NoCompatibleVariantError,
            KernelIntegrityError: see :func:`kernel_loader.loader.load_kernel`.
    """
    path, entry = _lock_for(repo_id, lockfile)
    trust.check_trust(repo_id, trust_remote_code)  # a lock entry pins a sha; it is not consent
    machine = machine or detect_machine()
    res = Resolution(repo_id, "cache", repo_id, entry.revision, entry.sha, None, None, version=entry.version)
    res.machine, res.lockfile, res.resolved_revision = machine, str(path), entry.revision
    snapshot = cache.find_snapshot(repo_id, entry.sha)
    cached = snapshot.variants() if snapshot else []
    locked = list(entry.variants) or cached
    chosen_all, decisions = select_variant(locked, machine, None)
    usable = [d.variant for d in decisions if d.accepted and d.variant in cached]

    def meta(v: str) -> dict | None:
        return metadata.variant_metadata(snapshot.build_dir / v)  # type: ignore[union-attr]

    chosen, decisions = select_variant(usable, machine, meta) if usable else (None, decisions)
    res.decisions = decisions
    fetch = f"`kernel-loader download --lock {path}`"
    if chosen is None:
        shipped = _shipped_match(repo_id, entry, machine, res) if chosen_all is not None else None
        if shipped is not None:
            return shipped
        if chosen_all is not None:
            raise OfflineKernelMissingError(
                f"{repo_id}@{entry.sha[:12]} (locked in {path}): variant {chosen_all} is not in the cache "
                f"{cache.cache_root()}. Fetch it with {fetch}; load_kernel never uses the network."
            )
        raise NoCompatibleVariantError(
            f"No locked variant of {repo_id}@{entry.sha[:12]} fits this machine ({machine.describe()}):\n"
            + "\n".join(d.line() for d in decisions)
            + f"\nSee `kernel-loader explain {repo_id}`.",
            decisions,
        )
    assert snapshot is not None
    res.variant, res.path = chosen, snapshot.build_dir / chosen
    expected = entry.variants.get(chosen)
    if expected and expected.get("hash"):
        outcome = integrity.verify_lock_variant(
            res.path, expected, f"{repo_id}@{entry.sha[:12]} variant {chosen}", memo_dir=integrity.default_memo_dir()
        )
        res.notes.append(f"files match the lock ({outcome})")
    else:
        res.notes.append("the lock records no content hash for this variant (kernels 0.17 format): sha pinned only")
    res.notes.append("lock pinned: no network call")
    return res
