"""Are the cached files the files that were published? Checked before every import.

Two sources of truth, whichever a load has:

* the **completion record** written at download, outside the snapshot, at
  ``<cache>/<type>s--<org>--<name>/kernel-loader/<sha>/<variant>.json`` (``files``: path relative to
  the snapshot root -> size and sha256 as the Hub listed them); read by :func:`read_record`,
  checked by :func:`verify_files`;
* a **lock entry** (:func:`verify_lock_variant`), by the algorithm its ``hash_type`` names:
  ``sha256_files`` (kernel_loader's: per-file ``git-sha1:``/``sha256:`` digests combined by
  :func:`kernel_loader.hashing.combine`) or ``git_lfs_concat`` (the `kernels` package's: sha256
  over the byte-sorted pairs of path-in-variant and git blob id / LFS sha256).

Hashing every file on every load would cost milliseconds per megabyte, so a successful check is
remembered in the state folder (never in the cache) under each file's
``(size, mtime_ns, ctime_ns, dev, inode)``. Rewriting a file and restoring its mtime still moves
its ctime, which no unprivileged process can set back, so a tampered file is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterable, Mapping

from kernel_loader import constants, hashing
from kernel_loader.errors import KernelIntegrityError, LockfileError

RECORD_FORMAT = 1
RECORD_DIR = "kernel-loader"
#: ``hash_type`` values a lock entry may name.
HASH_TYPES = (hashing.HASH_TYPE, "git_lfs_concat")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
# Files a kernel repo stores in Git LFS, for git_lfs_concat when a file is not a link into blobs/.
_LFS_SUFFIXES = (".so", ".dylib", ".pyd", ".dll", ".metallib", ".cubin", ".hsaco", ".bin")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileDigest:
    """What one file must be: its size (None: not recorded) and a sha256 or git blob id (hex)."""

    size: int | None = None
    sha256: str | None = None
    git_sha1: str | None = None

    @classmethod
    def parse(cls, text: str, size: int | None = None) -> "FileDigest":
        """From a lock's ``"sha256:<hex>"`` / ``"git-sha1:<hex>"``.

        Raises:
            ValueError: neither form.
        """
        kind, _, hex_ = str(text).partition(":")
        if kind == "sha256" and _HEX64.match(hex_):
            return cls(size, sha256=hex_)
        if kind == "git-sha1" and _HEX40.match(hex_):
            return cls(size, git_sha1=hex_)
        raise ValueError(f"{text!r} is not 'sha256:<64 hex>' or 'git-sha1:<40 hex>'")

    def label(self) -> str:
        return f"sha256:{self.sha256}" if self.sha256 else f"git-sha1:{self.git_sha1}"


@dataclass(frozen=True)
class CompletionRecord:
    """One variant's completion record (see the module docstring for where it lives)."""

    repo_id: str
    sha: str
    variant: str
    files: dict[str, FileDigest]
    variants: tuple[str, ...] = ()
    refs: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        """The record as written to disk (:mod:`kernel_loader.publish` writes it last, atomically)."""
        return {
            "format": RECORD_FORMAT,
            "repo_id": self.repo_id,
            "sha": self.sha,
            "variant": self.variant,
            "files": {k: {"size": v.size, "sha256": v.sha256} for k, v in sorted(self.files.items())},
            "variants": sorted(self.variants),
            "refs": dict(sorted(self.refs.items())),
        }


def record_path(repo_folder: Path, sha: str, variant: str) -> Path:
    """Where the completion record of ``(sha, variant)`` lives for a cached repo folder."""
    return repo_folder / RECORD_DIR / sha / f"{variant}.json"


def read_record(path: Path) -> CompletionRecord:
    """Read a completion record.

    Raises:
        KernelIntegrityError: unreadable, not JSON, an unknown format, or a malformed field (a
            record that cannot be read proves nothing about the files, so the load stops).
    """
    def bad(why: str) -> KernelIntegrityError:
        repo = re.fullmatch(r"(?:kernel|model)s--([^-].*?)--(.+)", Path(path).parent.parent.parent.name)
        sha = Path(path).parent.name
        fix = (f"Re-fetch that snapshot with `kernel-loader download --force {repo[1]}/{repo[2]}@{sha}`"
               if repo and _HEX40.match(sha) else "Delete it and the snapshot it describes, then download the kernel again")
        return KernelIntegrityError(f"Completion record {path} {why}. {fix}.")

    try:
        with open(path, "rb") as fh:
            raw = fh.read(16 << 20)
        data = json.loads(raw)
    except OSError as exc:
        raise bad(f"cannot be read ({exc})") from None
    except (ValueError, RecursionError):
        raise bad("is not valid JSON") from None
    if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
        raise bad(f"does not have format {RECORD_FORMAT}")
    files: dict[str, FileDigest] = {}
    raw_files = data.get("files")
    if not isinstance(raw_files, dict):
        raise bad("has no 'files' object")
    for rel, item in raw_files.items():
        if not isinstance(item, dict) or not isinstance(item.get("sha256"), str) or not _HEX64.match(item["sha256"]):
            raise bad(f"lists {rel!r} without a sha256")
        size = item.get("size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise bad(f"lists {rel!r} with a bad size")
        files[str(rel)] = FileDigest(size, sha256=item["sha256"])
    variants = data.get("variants") or []
    refs = data.get("refs") or {}
    if not all(isinstance(v, str) for v in (data.get("repo_id"), data.get("sha"), data.get("variant"))):
        raise bad("lacks repo_id, sha or variant")
    if not isinstance(variants, list) or not isinstance(refs, dict):
        raise bad("has malformed 'variants' or 'refs'")
    return CompletionRecord(data["repo_id"], data["sha"], data["variant"], files, tuple(map(str, variants)),
                            {str(k): str(v) for k, v in refs.items()})


def sha256_file(path: Path) -> str:
    """The sha256 (hex) of a file's content.

    Raises:
        OSError: the file cannot be read.
    """
    return _digests(Path(path), os.stat(path).st_size)[0]


def default_memo_dir() -> Path:
    """Where passing checks are remembered: ``<state folder>/verified``, never the cache."""
    return constants.state_dir() / "verified"


# -- the memo --------------------------------------------------------------------------------------


def _fingerprint(st: os.stat_result) -> str:
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_dev}:{st.st_ino}"


def _memo_file(memo_dir: Path, root: Path) -> Path:
    return memo_dir / f"{hashlib.sha256(str(root).encode()).hexdigest()[:32]}.json"


def _load_memo(memo_dir: Path, root: Path) -> dict[str, list[str]]:
    try:
        with open(_memo_file(memo_dir, root), "rb") as fh:
            data = json.loads(fh.read())
        return data.get("entries", {}) if isinstance(data, dict) and data.get("root") == str(root) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def _save_memo(memo_dir: Path, root: Path, entries: dict[str, list[str]]) -> None:
    # Best effort: a read-only state folder only costs a re-hash next time.
    try:
        memo_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=memo_dir, prefix=".memo-")
        with os.fdopen(fd, "w") as fh:
            json.dump({"root": str(root), "entries": entries}, fh)
        os.replace(tmp, _memo_file(memo_dir, root))
    except OSError:
        pass


# -- digests ---------------------------------------------------------------------------------------


def _digests(path: Path, size: int) -> tuple[str, str]:
    """``(sha256 hex, git blob id hex)`` of one file, read once in chunks."""
    sha = hashlib.sha256()
    git = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            sha.update(chunk)
            git.update(chunk)
    return sha.hexdigest(), git.hexdigest()


def _matches(path: Path, want: FileDigest, size: int) -> bool:
    sha, git = _digests(path, size)
    return (want.sha256 is None or sha == want.sha256) and (want.git_sha1 is None or git == want.git_sha1)


def _safe_rel(rel: str) -> bool:
    parts = PurePosixPath(rel).parts
    return bool(parts) and not PurePosixPath(rel).is_absolute() and ".." not in parts and "\\" not in rel


def _listed_tree(root: Path, files: Iterable[str]) -> list[Path]:
    """The folders whose every file must be listed: each ``build/<variant>`` named, else ``root``."""
    folders = {tuple(PurePosixPath(rel).parts[:2]) for rel in files}
    if folders and all(len(f) == 2 and f[0] == "build" for f in folders):
        return [root.joinpath(*f) for f in sorted(folders)]
    return [root]


def _unlisted(root: Path, files: Mapping[str, FileDigest]) -> list[str]:
    extra = []
    for folder in _listed_tree(root, files):
        for rel, _ in hashing.variant_files(folder):
            full = (folder / rel).relative_to(root).as_posix()
            if full not in files:
                extra.append(full)
    return extra


def _refetch_advice(path: Path) -> str:
    """How to replace a damaged cached copy: ``download --force`` of its repo and sha, when ``path``
    lies in a cache's ``<type>s--<org>--<name>/snapshots/<sha>``; else deleting ``path``."""
    for folder in (path, *path.parents):
        match = re.fullmatch(r"(?:kernel|model)s--([^-].*?)--(.+)", folder.parent.parent.name)
        if folder.parent.name == "snapshots" and _HEX40.match(folder.name) and match:
            return f"Re-fetch it with `kernel-loader download --force {match[1]}/{match[2]}@{folder.name}`"
    return f"Replace {path} with a good copy"


def _integrity_error(root: Path, problems: dict[str, list[str]], what: str | None) -> KernelIntegrityError:
    details = "; ".join(
        f"{label}: {', '.join(items[:10])}{' …' if len(items) > 10 else ''}" for label, items in problems.items() if items
    )
    who = f"{what}: " if what else ""
    return KernelIntegrityError(
        f"{who}files in {root} differ from their recorded digests ({details}). The cached copy was changed after "
        f"download; nothing was imported. {_refetch_advice(root)}, then run `kernel-loader verify` to check the "
        "whole cache."
    )


def verify_files(
    snapshot_root: Path,
    files: Mapping[str, FileDigest],
    *,
    memo_dir: Path,
    use_memo: bool = True,
    what: str | None = None,
) -> None:
    """Check that each file under ``snapshot_root`` has its recorded size and digest.

    Also refuses files present in the checked folders but not listed (each ``build/<variant>``
    named by ``files``, or the whole root when the paths are relative to a variant). A check that
    passed is remembered in ``memo_dir`` per file under (size, mtime_ns, ctime_ns, dev, inode);
    ``use_memo=False`` re-hashes everything. ``what`` names the kernel in the error.

    Raises:
        KernelIntegrityError: naming each changed, missing, unexpected or unsafe (``..``,
            absolute) path.
    """
    _check_files(snapshot_root, files, memo_dir, use_memo, what)


def _check_files(
    snapshot_root: Path, files: Mapping[str, FileDigest], memo_dir: Path, use_memo: bool, what: str | None
) -> bool:
    """:func:`verify_files`; True when every file was remembered (nothing hashed)."""
    root = Path(os.path.abspath(snapshot_root))
    memo = _load_memo(memo_dir, root) if use_memo else {}
    fresh: dict[str, list[str]] = {}
    problems: dict[str, list[str]] = {"changed": [], "missing": [], "unsafe path": [], "unexpected": []}
    for rel in sorted(files):
        want = files[rel]
        if not _safe_rel(rel):
            problems["unsafe path"].append(rel)
            continue
        path = root / rel
        try:
            st = os.stat(path)
        except OSError:
            problems["missing"].append(rel)
            continue
        entry = [want.label(), _fingerprint(st)]
        if memo.get(rel) == entry:
            fresh[rel] = entry
            continue
        if (want.size is not None and st.st_size != want.size) or not _matches(path, want, st.st_size):
            problems["changed"].append(rel)
            continue
        fresh[rel] = entry
    problems["unexpected"] = _unlisted(root, files)
    if any(problems.values()):
        raise _integrity_error(root, problems, what)
    if fresh != memo:
        _save_memo(memo_dir, root, fresh)
    return fresh == memo


# -- lock entries ----------------------------------------------------------------------------------


def _lfs_or_git_id(path: Path, st: os.stat_result) -> str:
    """The object id the Hub lists for a file: LFS sha256 or git blob id, from the content.

    Which of the two is told by the blob the cache links to (the Hub cache names LFS blobs by
    their 64-hex sha256, git blobs by their 40-hex id); a plain file (a copied or local tree) is
    taken as LFS when it is a binary artefact by suffix or holds a NUL byte.
    """
    sha, git = _digests(path, st.st_size)
    blob = Path(os.path.realpath(path)).name
    if path.is_symlink() and (_HEX64.match(blob) or _HEX40.match(blob)):
        return sha if len(blob) == 64 else git
    if path.name.endswith(_LFS_SUFFIXES):
        return sha
    with open(path, "rb") as fh:
        return sha if b"\0" in fh.read(8192) else git


def git_lfs_concat(variant_dir: Path) -> str:
    """The `kernels` package's variant hash of a folder: ``sha256-<hex>``.

    sha256 over the files sorted by their UTF-8 path bytes, feeding for each the path relative to
    the variant and then the raw bytes of its git blob id or LFS sha256.

    Raises:
        OSError: a file cannot be read.
    """
    pairs = []
    for rel, path in hashing.variant_files(variant_dir):
        pairs.append((rel.encode("utf-8"), bytes.fromhex(_lfs_or_git_id(path, path.stat()))))
    h = hashlib.sha256()
    for name, oid in sorted(pairs):
        h.update(name)
        h.update(oid)
    return "sha256-" + h.hexdigest()


def _tree_fingerprint(variant_dir: Path) -> str:
    h = hashlib.sha256()
    for rel, path in hashing.variant_files(variant_dir):
        h.update(f"{rel}\0{_fingerprint(path.stat())}\n".encode())
    return h.hexdigest()


def _lock_mismatch(variant_dir: Path, what: str, want: str, got: str, hash_type: str) -> KernelIntegrityError:
    return KernelIntegrityError(
        f"{what}: files in {variant_dir} do not match the lock ({hash_type}: expected {want}, found {got}); nothing "
        f"was imported. {_refetch_advice(Path(os.path.abspath(variant_dir)))}, or re-lock with `kernel-loader lock` "
        "if the change is intended."
    )


def verify_lock_variant(
    variant_dir: Path, expected: Mapping, what: str, *, memo_dir: Path, use_memo: bool = True
) -> str:
    """Check a variant folder against a lock's variant entry, by the entry's ``hash_type``.

    Returns ``"verified"`` (hashed now) or ``"remembered"`` (unchanged since a passing check).

    Raises:
        LockfileError: an unknown ``hash_type``, or a ``sha256_files`` entry whose ``files`` do not
            add up to its ``hash`` (the lock itself was edited).
        KernelIntegrityError: the files differ (changed/missing/unexpected files named where the
            lock lists them).
    """
    want = str(expected.get("hash", ""))
    hash_type = expected.get("hash_type", hashing.HASH_TYPE)
    if hash_type not in HASH_TYPES:
        raise LockfileError(
            f"{what}: the lock's hash_type {hash_type!r} is not one kernel_loader can check (known: "
            f"{', '.join(HASH_TYPES)}). Re-lock with `kernel-loader lock` to get a checkable lock."
        )
    listed = expected.get("files") or {}
    if hash_type == hashing.HASH_TYPE and listed:
        if not isinstance(listed, dict) or hashing.combine({str(k): str(v) for k, v in listed.items()}) != want:
            raise LockfileError(
                f"{what}: the lock lists files whose digests do not add up to its hash {want}; the lock was edited. "
                "Re-create it with `kernel-loader lock`."
            )
        try:
            digests = {str(rel): FileDigest.parse(str(text)) for rel, text in listed.items()}
        except ValueError as exc:
            raise LockfileError(f"{what}: the lock has a malformed file digest ({exc}). Re-lock with `kernel-loader lock`.") from None
        remembered = _check_files(variant_dir, digests, memo_dir, use_memo, what)
        return "remembered" if remembered and use_memo else "verified"
    root = Path(os.path.abspath(variant_dir))
    key = f"{hash_type}|{want}"
    fp = _tree_fingerprint(variant_dir)
    memo = _load_memo(memo_dir, root) if use_memo else {}
    if memo.get(key) == [want, fp]:
        return "remembered"
    got = git_lfs_concat(variant_dir) if hash_type == "git_lfs_concat" else hashing.hash_folder(variant_dir)[0]
    if got != want:
        raise _lock_mismatch(variant_dir, what, want, got, hash_type)
    _save_memo(memo_dir, root, {key: [want, fp]})
    return "verified"


# -- a whole cache ---------------------------------------------------------------------------------


def verify_cache(cache_dir: Path | None, lock_entries: Iterable = (), *, memo_dir: Path) -> list[dict]:
    """Re-hash every cached variant (no memo): against the lock when it pins that (repo, sha) and
    variant, else against the download's completion record.

    ``lock_entries`` are :class:`kernel_loader.lockfile.LockEntry` objects. Returns one row per
    variant: ``{"repo_id", "sha", "variant", "status", "detail"}`` with status ``ok``, ``MISMATCH``
    (``detail`` names each changed file where known), ``unrecorded`` (neither a lock hash nor a
    record to compare with), ``unlocked`` (the lock pins that sha but records no hash for the
    variant; its files were checked against the record) or ``missing`` (locked but not in the
    cache, ``variant`` None).
    """
    from kernel_loader import cache

    locked = {(e.repo_id, e.sha): e for e in lock_entries}
    rows, seen = [], set()
    for repo in cache.list_cached(cache_dir):
        for sha, variants in repo.snapshots.items():
            if variants:
                seen.add((repo.repo_id, sha))
            snapshot = repo.folder / "snapshots" / sha
            try:  # variants without a record too: an unfinished download or a copy made by hand
                present = sorted({*variants, *(p.name for p in (snapshot / "build").iterdir() if p.is_dir())})
            except OSError:
                present = list(variants)
            for variant in present:
                rows.append(_verify_cached(repo.repo_id, repo.folder, snapshot, sha, variant,
                                           locked.get((repo.repo_id, sha)), memo_dir))
    for key, entry in sorted(locked.items()):
        if key not in seen:
            rows.append({"repo_id": entry.repo_id, "sha": entry.sha, "variant": None, "status": "missing",
                         "detail": "locked but not in the cache"})
    return rows


def _verify_cached(repo_id: str, folder: Path, snapshot: Path, sha: str, variant: str, entry, memo_dir: Path) -> dict:
    """One row of :func:`verify_cache`; ``entry`` is the lock entry pinning this (repo, sha), if any."""
    row = {"repo_id": repo_id, "sha": sha, "variant": variant}
    expected = entry.variants.get(variant) if entry is not None else None
    record = record_path(folder, sha, variant)
    what = f"{repo_id}@{sha[:12]} variant {variant}"
    try:
        if expected and expected.get("hash"):
            verify_lock_variant(snapshot / "build" / variant, expected, what, memo_dir=memo_dir, use_memo=False)
            return {**row, "status": "ok", "detail": f"matches the lock ({expected.get('hash_type', hashing.HASH_TYPE)})"}
        if not record.is_file():
            return {**row, "status": "unrecorded", "detail": (
                "no lock hash and no completion record to compare with: the download did not finish, or the files "
                f"were copied by hand; nothing loads them until `kernel-loader download --force {repo_id}@{sha}` "
                "fetches them again")}
        verify_files(snapshot, read_record(record).files, memo_dir=memo_dir, use_memo=False, what=what)
    except (KernelIntegrityError, LockfileError) as exc:
        return {**row, "status": "MISMATCH", "detail": str(exc)}
    if entry is not None:  # the files are intact, but the lock cannot vouch for them
        return {**row, "status": "unlocked", "detail": (
            "the files match the completion record, but the lock records no content hash for this variant (a "
            "`kernels`-format lock pins only the commit); re-lock with `kernel-loader lock` to record hashes")}
    return {**row, "status": "ok", "detail": f"matches the completion record {record}"}
