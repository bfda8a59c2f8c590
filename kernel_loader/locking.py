"""From ``[tool.kernels.dependencies]`` and lock entries to resolver requests (``kernel-loader lock``,
``download --lock`` and ``load_kernel``).

The resolver decides the sha and the variants; this module only turns a dependency spec or a
lock entry into a :class:`~kernel_loader.resolver.Request` and a resolved revision into a
:class:`~kernel_loader.lockfile.LockEntry` (hashes from the Hub's file listing, nothing
downloaded). The lock format lives in :mod:`kernel_loader.lockfile`, its verification in
:mod:`kernel_loader.integrity`.
"""

from __future__ import annotations

from pathlib import Path

from kernel_loader import hashing
from kernel_loader.errors import OfflineKernelMissingError
from kernel_loader.lockfile import LockEntry
from kernel_loader.refs import KernelRef
from kernel_loader.resolution import Resolution
from kernel_loader.resolver import LockPin, Request, resolve
from kernel_loader.sources import hub


def pin(entry: LockEntry, lockfile: Path) -> LockPin:
    """The resolver's view of one lock entry."""
    return LockPin(str(lockfile), entry.sha, dict(entry.variants), entry.version, entry.revision)


def locked_request(entry: LockEntry, lockfile: Path, **options) -> Request:
    """A request for exactly the locked sha (``options``: other :class:`Request` fields)."""
    return Request(KernelRef.parse(f"{entry.repo_id}@{entry.sha}"), lock=pin(entry, lockfile), **options)


def lock_entry(repo_id: str, spec: int | str, *, cache_dir: Path | None = None, trust_remote_code: bool = False) -> LockEntry:
    """Resolve one dependency on the Hub and hash every variant from the file listing (no download).

    Raises:
        KernelNotFoundError: the repo, version or revision does not exist.
        OfflineKernelMissingError: the Hub cannot be reached.
        UntrustedKernelError: the org is not trusted and ``trust_remote_code`` is False.
    """
    version = spec if isinstance(spec, int) else None
    revision = spec if isinstance(spec, str) else None
    req = Request(
        KernelRef.from_parts(repo_id, revision), version=version, download=False, all_variants=True,
        cache_dir=cache_dir, trust_remote_code=trust_remote_code,
    )
    res: Resolution = resolve(req)
    if res.source != "hub" or res.sha is None or res.repo_type is None:
        raise OfflineKernelMissingError(
            f"Cannot lock {repo_id}: the Hub was not used ({res.fallback or res.source}). "
            "Locking reads the Hub's file listing; check HF_ENDPOINT / the network and run `kernel-loader lock` again."
        )
    settings = req.hub or hub.HubSettings.from_env()
    try:
        files = hub.list_files(repo_id, res.repo_type, res.sha, settings)
    except hub.HubUnreachable as exc:
        raise OfflineKernelMissingError(f"Cannot lock {repo_id}: {exc.summary}. Check it, then run the same call again.") from None
    entry = LockEntry(repo_id, res.sha, {}, version, revision)
    for variant in hub.variants_of(files):
        digests = hub.lock_digests(files, variant)
        entry.variants[variant] = {"hash": hashing.combine(digests), "hash_type": hashing.HASH_TYPE, "files": digests}
    return entry
