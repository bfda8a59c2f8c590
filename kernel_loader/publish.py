"""Downloading one build variant completely, then making it visible with its completion record.

Many processes (every rank of a job, on many nodes) may ask for the same variant at the same
second, and any of them may die at any moment. So, per (repo, sha, variant):

1. a completion record already there means done: nothing is fetched or locked;
2. otherwise take one cross-process ``filelock.FileLock`` (bounded wait); the OS releases it
   when its owner dies, so a dead owner never blocks the next process;
3. holding it, check the record again (the winner of a race publishes, the others then load),
   clean what dead processes left (``.incomplete`` blobs nobody is writing, our temp files);
4. fetch each file through huggingface_hub (its cache layout, its per-blob locks: a file
   already in the cache is not fetched again) and check its size and digest against the Hub's
   listing as it arrives; a bad file is removed and fetched once more;
5. write the refs that were resolved (``refs/<branch|tag|vN>``), then the record, last and
   atomically (temp file + ``os.replace``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from kernel_loader import cache
from kernel_loader.errors import CacheFullError, CacheLockError, CacheNotWritableError, KernelDownloadError
from kernel_loader.integrity import CompletionRecord, FileDigest
from kernel_loader.sources import hub

logger = logging.getLogger("kernel_loader")


class VariantFetch(NamedTuple):
    """One variant to fetch: where from, which files (from the Hub's listing), and what to record."""

    repo_id: str
    repo_type: str
    sha: str
    variant: str
    files: list[hub.RemoteFile]  # this variant's files
    variants: list[str]  # every variant name of the revision
    refs: dict[str, str]  # ref name -> sha resolved for this request
    prefetch: str = "kernel-loader download"  # the command that fetches it where the cache is writable


def _digests(path: Path, size: int) -> tuple[int, str, str]:
    """(size read, sha256 hex, git blob sha1 hex) of a file, read once."""
    sha256 = hashlib.sha256()
    sha1 = hashlib.sha1(b"blob %d\0" % size)
    read = 0
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            read += len(chunk)
            sha256.update(chunk)
            sha1.update(chunk)
    return read, sha256.hexdigest(), sha1.hexdigest()


def _check(path: Path, want: hub.RemoteFile) -> str | None:
    """The file's sha256 when it matches the listing, else None."""
    try:
        size = path.stat().st_size
        read, sha256, sha1 = _digests(path, size)
    except OSError:
        return None
    if read != want.size:
        return None
    if want.lfs_sha256 is not None:
        return sha256 if sha256 == want.lfs_sha256 else None
    return sha256 if sha1 == want.blob_id else None


def _drop(path: Path) -> None:
    """Remove a bad snapshot link and the blob it points to."""
    try:
        blob = path.resolve()
        path.unlink(missing_ok=True)
        if blob != path:
            blob.unlink(missing_ok=True)
    except OSError:
        pass


def _atomic_write(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".part")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())  # a shared filesystem must never show a record before its content
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_refs(folder: Path, refs: dict[str, str]) -> None:
    """Record ``refs/<name> -> sha`` as huggingface_hub does (names with ``/`` are skipped).

    Best effort: a read-only cache that already lacks a ref keeps lacking it (logged).
    """
    for name, sha in refs.items():
        if "/" in name or name.startswith(".") or not cache.is_sha(sha) or name == sha:
            continue
        target = folder / "refs" / name
        try:
            if target.read_text().strip() == sha:
                continue
        except OSError:
            pass
        try:
            _atomic_write(target, sha)
        except OSError as exc:
            logger.warning("%s: cannot record refs/%s -> %s (%s)", folder, name, sha[:12], exc)


def _write_error(exc: OSError, what: str, root: Path, need: int, prefetch: str = "kernel-loader download") -> Exception:
    if hub.is_disk_full(exc):
        return CacheFullError(
            f"{what}: the disk holding the kernel cache {root} is full (about {need} more bytes needed: {exc}). "
            f"Free space there or set KERNEL_LOADER_CACHE to a larger disk, then run the same call again; "
            "the partial download is cleaned up by the next call."
        )
    if hub.is_read_only(exc):
        return CacheNotWritableError(
            f"{what} must be downloaded but the cache {root} is not writable ({exc}). Prefetch it where the cache "
            f"is writable (`{prefetch}`, see docs/cluster.md), or set KERNEL_LOADER_CACHE to a writable folder."
        )
    return KernelDownloadError(f"{what}: writing into the cache {root} failed ({exc}). Check that disk, then retry.")


def _clean_leftovers(folder: Path, root: Path) -> list[Path]:
    """Remove ``.incomplete`` blobs whose writer is gone and our own temp files; returns what went.

    huggingface_hub writes a blob as ``<etag>[.<id>].incomplete`` while holding
    ``<cache>/.locks/<repo folder>/<etag>.lock``; if that lock can be taken at once, nobody is
    writing the blob and the partial file is garbage (a writer that was killed).
    """
    from filelock import FileLock, Timeout

    removed = []
    for partial in sorted((folder / "blobs").glob("*.incomplete")):
        etag = partial.name.split(".", 1)[0]
        probe = FileLock(str(root / ".locks" / folder.name / f"{etag}.lock"), timeout=0)
        try:
            with probe:
                for stale in (folder / "blobs").glob(f"{etag}*.incomplete"):
                    stale.unlink(missing_ok=True)
                    removed.append(stale)
        except (Timeout, OSError):
            continue  # a live writer, or a lock we cannot take: leave it
    for tmp in (folder / cache.RECORDS).glob("*/.tmp-*.part"):
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    for tmp in (folder / "refs").glob(".tmp-*.part"):
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    if removed:
        logger.info("%s: removed %d leftover(s) of interrupted downloads", folder, len(removed))
    return removed


def _locks_work(lock_path: Path) -> bool:
    """While we hold the lock, a second exclusive flock on the same file must be refused."""
    import fcntl

    fd = os.open(lock_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def publish_variant(job: VariantFetch, cache_dir: Path, settings: hub.HubSettings, lock_timeout: float) -> Path:
    """Make ``job``'s variant complete in the cache; return the snapshot folder (``.../snapshots/<sha>``).

    Raises:
        CacheNotWritableError: the variant is missing and the cache is read-only.
        CacheFullError: the disk filled up (the message names the cache and the bytes needed).
        CacheLockError: another process held the variant's lock past ``lock_timeout`` seconds,
            or the cache's filesystem has no working locks.
        KernelDownloadError: the Hub died, stalled or sent a file that does not match its listing.
    """
    from filelock import FileLock, Timeout

    root = Path(cache_dir)
    folder = cache.repo_folder(job.repo_id, job.repo_type, root)
    snapshot = folder / "snapshots" / job.sha
    record = cache.record_path(folder, job.sha, job.variant)
    what = f"{job.repo_id}@{job.sha[:12]} build/{job.variant}"
    if _complete(job, snapshot):
        write_refs(folder, job.refs)
        return snapshot
    need = sum(f.size for f in job.files)
    lock_path = folder / cache.RECORDS / ".locks" / f"{job.sha}.{job.variant}.lock"
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _write_error(exc, what, root, need, job.prefetch) from None
    lock = FileLock(str(lock_path), timeout=lock_timeout)
    started = time.monotonic()
    try:
        lock.acquire()
    except Timeout:
        raise CacheLockError(
            f"{what}: another process has been downloading it for more than {lock_timeout:g} s (lock {lock_path}). "
            "Wait for it, raise KERNEL_LOADER_LOCK_TIMEOUT, or check that process; a lock whose owner died is "
            "released by the OS."
        ) from None
    except (OSError, NotImplementedError) as exc:
        if isinstance(exc, OSError) and (hub.is_read_only(exc) or hub.is_disk_full(exc)):
            raise _write_error(exc, what, root, need, job.prefetch) from None
        raise _no_locks(what, root, exc) from None
    try:
        if not _locks_work(lock_path):
            raise _no_locks(what, root, None)
        waited = time.monotonic() - started
        if _complete(job, snapshot):
            logger.info("%s: published by another process (waited %.1f s)", what, waited)
            write_refs(folder, job.refs)
            return snapshot
        _clean_leftovers(folder, root)
        files = _fetch_all(job, root, settings, what)
        try:
            write_refs(folder, job.refs)
            rec = CompletionRecord(job.repo_id, job.sha, job.variant, files, tuple(job.variants), dict(job.refs))
            _atomic_write(record, json.dumps(rec.to_json(), indent=1) + "\n")
        except OSError as exc:
            raise _write_error(exc, what, root, 4096, job.prefetch) from None
        logger.info("%s: %d files downloaded and published", what, len(files))
        return snapshot
    finally:
        lock.release()


def _no_locks(what: str, root: Path, exc: BaseException | None) -> CacheLockError:
    detail = f" ({exc})" if exc is not None else ""
    return CacheLockError(
        f"{what}: the filesystem of the kernel cache {root} has no working file locks{detail}, so concurrent "
        "downloads could mix. Prefetch once with `kernel-loader download` (see docs/cluster.md) and load with "
        "HF_HUB_OFFLINE=1, or set KERNEL_LOADER_CACHE to a local disk."
    )


def _complete(job: VariantFetch, snapshot: Path) -> bool:
    snap = cache.CachedSnapshot(job.repo_id, job.repo_type, job.sha, snapshot)
    return snap.record(job.variant) is not None


def _fetch_all(job: VariantFetch, root: Path, settings: hub.HubSettings, what: str) -> dict[str, FileDigest]:
    files: dict[str, FileDigest] = {}
    remaining = sum(f.size for f in job.files)
    for want in job.files:
        name = want.path.removeprefix(f"build/{job.variant}/")  # `what` names the variant folder
        for attempt in (1, 2):
            try:
                path = hub.download_file(job.repo_id, job.repo_type, job.sha, want.path, root, settings)
            except hub.HubUnreachable as exc:
                raise KernelDownloadError(
                    f"{what}: the download stopped at {name}: {exc.summary} (each call is bounded by "
                    f"KERNEL_LOADER_CONNECT_TIMEOUT / KERNEL_LOADER_READ_TIMEOUT, {settings.retries} retries). "
                    "Check it, then run the same call again: files already fetched are kept."
                ) from None
            except hub.HubRepoMissing as exc:
                raise KernelDownloadError(
                    f"{what}: {name} is listed but cannot be fetched: {exc.summary}; the revision may have been rewritten. "
                    f"See `kernel-loader explain {job.repo_id}`."
                ) from None
            except OSError as exc:
                if hub.is_disk_full(exc) or hub.is_read_only(exc):
                    raise _write_error(exc, what, root, remaining, job.prefetch) from None
                if attempt == 1:  # e.g. huggingface_hub's size consistency check of a cut transfer
                    logger.warning("%s: %s failed (%s); fetching it again", what, want.path, exc)
                    continue
                raise KernelDownloadError(f"{what}: {want.path} could not be fetched ({exc}). Run the same call again.") from None
            sha256 = _check(path, want)
            if sha256 is not None:
                files[want.path] = FileDigest(want.size, sha256)
                remaining -= want.size
                break
            logger.warning("%s: %s arrived truncated or changed; fetching it again", what, want.path)
            _drop(path)
        else:
            raise KernelDownloadError(
                f"{what}: {want.path} arrived twice with a size or digest that differs from the Hub's listing "
                f"({want.size} bytes). The mirror {settings.endpoint} serves a damaged file; fix it, then run the same call again."
            )
    return files

