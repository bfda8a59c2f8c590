"""Checking a snapshot's files against the digests recorded when they were downloaded.

The completion record (written by :mod:`kernel_loader.publish`, read here) lists every file of a
variant with its size and sha256. :func:`verify_files` re-hashes them, and remembers a success in
the state folder under a stat fingerprint (size, mtime_ns, ctime_ns, dev, inode) that a tamper
cannot restore: rewriting a file changes its ctime, so a warm check only stats the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from kernel_loader.errors import KernelIntegrityError

RECORD_FORMAT = 1


class FileDigest(NamedTuple):
    """Size in bytes and sha256 (hex) of one file."""

    size: int
    sha256: str


@dataclass
class CompletionRecord:
    """Proof that one (repo, sha, variant) was downloaded completely (see BRIEF / docs/cluster.md)."""

    repo_id: str
    sha: str
    variant: str
    files: dict[str, FileDigest]  # path relative to the snapshot root -> digest
    variants: list[str] = field(default_factory=list)
    refs: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "format": RECORD_FORMAT,
            "repo_id": self.repo_id,
            "sha": self.sha,
            "variant": self.variant,
            "files": {k: {"size": v.size, "sha256": v.sha256} for k, v in sorted(self.files.items())},
            "variants": sorted(self.variants),
            "refs": dict(sorted(self.refs.items())),
        }


def read_record(path: Path) -> CompletionRecord:
    """Parse a completion record.

    Raises:
        FileNotFoundError: there is no record (the variant is not complete).
        KernelIntegrityError: the record is unreadable or malformed.
    """
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise KernelIntegrityError(f"completion record {path} is unreadable ({exc})") from None
    try:
        if data["format"] != RECORD_FORMAT:
            raise ValueError(f"format {data['format']!r}")
        files = {str(k): FileDigest(int(v["size"]), str(v["sha256"])) for k, v in data["files"].items()}
        return CompletionRecord(
            str(data["repo_id"]), str(data["sha"]), str(data["variant"]), files,
            [str(v) for v in data.get("variants", [])], {str(k): str(v) for k, v in data.get("refs", {}).items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise KernelIntegrityError(f"completion record {path} is malformed ({exc})") from None


def sha256_file(path: Path) -> str:
    """The sha256 (hex) of a file's content.

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fingerprint(snapshot_root: Path, files: Mapping[str, FileDigest]) -> str:
    h = hashlib.sha256()
    for rel in sorted(files):
        st = (snapshot_root / rel).stat()  # links followed: the blob's own identity counts
        h.update(f"{rel}\0{files[rel].sha256}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_dev}\0{st.st_ino}\n".encode())
    return h.hexdigest()


def verify_files(snapshot_root: Path, files: Mapping[str, FileDigest], *, memo_dir: Path) -> None:
    """Check every file against its recorded size and sha256.

    Raises:
        KernelIntegrityError: a file is missing or differs (each one is named).
    """
    snapshot_root = Path(snapshot_root)
    try:
        fp = _fingerprint(snapshot_root, files)
    except OSError:
        fp = None
    memo = Path(memo_dir) / (fp or "none")
    if fp is not None and memo.is_file():
        return
    bad = []
    for rel in sorted(files):
        want = files[rel]
        try:
            size = (snapshot_root / rel).stat().st_size
            if size != want.size:
                bad.append(f"{rel} (size {size}, recorded {want.size})")
            elif sha256_file(snapshot_root / rel) != want.sha256:
                bad.append(f"{rel} (content changed)")
        except OSError:
            bad.append(f"{rel} (missing)")
    if bad:
        raise KernelIntegrityError(
            f"files in {snapshot_root} differ from the digests recorded at download: {', '.join(bad[:10])}"
            f"{' …' if len(bad) > 10 else ''}. Remove that snapshot folder and load again to re-download it."
        )
    try:  # best effort: a read-only state folder only costs a re-hash next time
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=memo.parent, prefix=".tmp-")
        os.close(fd)
        os.replace(tmp, memo)
    except OSError:
        pass
