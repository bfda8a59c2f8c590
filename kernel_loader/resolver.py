"""From a kernel id to one variant folder on disk, with the :class:`Resolution` that explains it.

The one module that decides where a kernel comes from, which revision and sha, which variant,
and what to download. Sources are tried in order: a ``LOCAL_KERNELS`` override; the cache (no
network call at all when the revision is a sha, when offline, or when a lock pins it); the Hub
(refs -> sha -> file listing -> the chosen variant's files only, published atomically by
:mod:`kernel_loader.publish`); then the repos shipped with the package when the Hub cannot be
reached or does not have the repo, and the cache does not have it either. Every loaded
variant is checked against its completion record (or its lock). Nothing here imports the kernel.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, NamedTuple

from kernel_loader import cache, constants, deps, hashing, importer, integrity, metadata, trust
from kernel_loader.errors import (
    InvalidKernelRefError,
    KernelIntegrityError,
    KernelNotFoundError,
    LockfileError,
    NoCompatibleVariantError,
    OfflineKernelMissingError,
)
from kernel_loader.machine import Machine, detect_machine
from kernel_loader.refs import KernelRef, version_branch
from kernel_loader.resolution import Resolution
from kernel_loader.sources import bundled, hub, local
from kernel_loader.variants import select_variant

logger = logging.getLogger("kernel_loader")


class LockPin(NamedTuple):
    """A lock file's entry for one kernel: the pinned sha and, per variant, its content hash."""

    lockfile: str
    sha: str
    variants: dict[str, dict]  # variant -> {"hash", "hash_type", "files"}; empty: kernels 0.17 format
    version: int | None = None
    revision: str | None = None


class Request(NamedTuple):
    """What the caller asked for (see :func:`kernel_loader.loader.get_kernel`)."""

    ref: KernelRef
    version: int | None = None
    backend: str | None = None
    trust_remote_code: bool = False
    local_files_only: bool = False
    download: bool = True
    cache_dir: Path | None = None
    machine: Machine | None = None
    #: fetch every variant of the revision (``kernel-loader download --all-variants``)
    all_variants: bool = False
    #: pinned by a lock file: that sha only, its variants only, checked against its hashes
    lock: LockPin | None = None
    #: endpoint, token, timeouts, retries (default: :meth:`HubSettings.from_env`)
    hub: hub.HubSettings | None = None
    #: seconds to wait for another process downloading the same variant (default: constants)
    lock_timeout: float | None = None
    #: whether the copy shipped with kernel_loader may serve the request (the fallback chain
    #: asks without it, then for the shipped copy as its own step)
    shipped: bool = True

    @property
    def what(self) -> str:
        text = self.ref.repo_id
        if self.ref.revision:
            text += f"@{self.ref.revision}"
        if self.version is not None:
            text += f" (version {self.version})"
        return text


def _no_variant_error(res: Resolution, machine: Machine) -> NoCompatibleVariantError:
    where = f"{res.repo_id}@{res.sha[:12] if res.sha else res.resolved_revision or '?'} ({res.source})"
    if not res.decisions:
        msg = f"{where} has no build variants (no build/<variant>/ folders)."
    else:
        msg = f"No build variant of {where} can run on this machine ({machine.describe()}):\n" + "\n".join(
            d.line() for d in res.decisions
        )
    msg += f"\nSee `kernel-loader explain {res.repo_id}`; a newer revision may have a matching build."
    return NoCompatibleVariantError(msg, res.decisions)


MetadataReader = Callable[[str], "dict | None"]


def _finish(
    res: Resolution, build_dir: Path, names: list[str], req: Request, machine: Machine, read_meta: MetadataReader,
    required: bool = True,
) -> Resolution:
    """Select a variant among ``names``, check its dependencies, fill in ``res``."""
    if req.lock is not None and req.lock.variants:
        names = [n for n in names if n in req.lock.variants]
    try:
        chosen, decisions = select_variant(names, machine, read_meta, req.backend)
    except ValueError as exc:
        raise InvalidKernelRefError(f"{req.what}: {exc}") from exc
    res.decisions = decisions
    if chosen is None:
        if not required:
            return res
        raise _no_variant_error(res, machine)
    res.variant = chosen
    res.path = build_dir / chosen
    deps.check_dependencies(read_meta(chosen), f"{req.what} variant {chosen}")
    return res


def _local_meta(build_dir: Path) -> MetadataReader:
    return lambda variant: metadata.variant_metadata(build_dir / variant)


def _new(req: Request, source: str, machine: Machine, sha: str | None = None, ref_name: str | None = None) -> Resolution:
    return Resolution(
        requested=str(req.ref), source=source, repo_id=req.ref.repo_id, revision=req.ref.revision, sha=sha,
        variant=None, path=None, version=req.version, resolved_revision=ref_name, machine=machine,
        lockfile=req.lock.lockfile if req.lock is not None else None,
    )


def resolve_local(req: Request, path: Path, source_note: str) -> Resolution:
    """Resolve against a local folder (``LOCAL_KERNELS`` or ``get_local_kernel``).

    Raises:
        KernelNotFoundError: the folder holds no kernel build.
        NoCompatibleVariantError: no variant fits this machine.
    """
    machine = req.machine or detect_machine()
    build_dir, single = local.build_folder(path, f"{req.what} ({source_note})")
    names = [single] if single else local.list_variants(build_dir)
    res = _new(req, "local", machine)
    res.notes.append(f"{source_note}: {path}")
    return _finish(res, build_dir, names, req, machine, _local_meta(build_dir))


def resolve_bundled(req: Request, why: str) -> Resolution | None:
    """Resolve against the shipped copy, or None when it is absent, disabled, or the wrong version.

    Raises:
        NoCompatibleVariantError: the shipped copy has no variant for this machine.
    """
    root = bundled.bundled_repo(req.ref.repo_id) if req.shipped else None
    if root is None:
        return None
    machine = req.machine or detect_machine()
    build_dir = root / "build"
    names = local.list_variants(build_dir)
    res = _new(req, "bundled", machine)
    _finish(res, build_dir, names, req, machine, _local_meta(build_dir))
    shipped_version = bundled.bundled_version(res.path)
    wanted = req.version
    if wanted is None and req.ref.revision and version_branch(req.ref.revision) is not None:
        wanted = version_branch(req.ref.revision)
    elif req.ref.revision not in (None, "main") and wanted is None:
        return None  # a specific tag or sha cannot be vouched for by the shipped copy
    if wanted is not None and shipped_version is not None and wanted != shipped_version:
        return None
    res.sha = hashing.hash_folder(res.path)[0].removeprefix("sha256-")
    res.resolved_revision = f"v{shipped_version}" if shipped_version is not None else None
    res.notes.append(f"shipped copy used because {why}; sha is the content hash of the variant folder")
    res.fallback = why
    bundled.warn_bundled(req.ref.repo_id, why)
    return res


def _pick_ref(req: Request, versions: dict[int, str], named: dict[str, str], where: str) -> tuple[str, str]:
    """(ref name, sha) for the request from ``vN`` versions and named refs (branches + tags)."""
    if req.ref.revision is not None:
        rev = req.ref.revision
        if rev in named:
            return rev, named[rev]
        if cache.is_sha(rev):
            return rev, rev
        raise KernelNotFoundError(
            f"{req.what}: revision not found {where}. Known: {', '.join(sorted(named)) or 'none'}. "
            f"See `kernel-loader explain {req.ref.repo_id}`."
        )
    if req.version is not None:
        if req.version in versions:
            return f"v{req.version}", versions[req.version]
        have = ", ".join(f"v{v}" for v in sorted(versions)) or "none"
        raise KernelNotFoundError(
            f"{req.what}: branch v{req.version} not found {where}; versions: {have}. "
            f"See `kernel-loader explain {req.ref.repo_id}`."
        )
    if versions:
        best = max(versions)
        logger.info("%s: no version given, using the latest, v%d %s", req.ref.repo_id, best, where)
        return f"v{best}", versions[best]
    if "main" in named:
        return "main", named["main"]
    raise KernelNotFoundError(f"{req.what}: no vN branch and no main {where}.")


class _CacheMiss(NamedTuple):
    """Why the cache could not serve a revision it has (its variants do not fit), or None."""

    misfit: NoCompatibleVariantError | None


def _from_cache(req: Request, machine: Machine, ref_name: str, sha: str, source_note: str) -> Resolution | _CacheMiss:
    """The cached, complete variant of ``sha`` for this machine, checked against its record (and lock)."""
    snapshot = cache.find_snapshot(req.ref.repo_id, sha, req.cache_dir)
    if snapshot is not None:
        snapshot.check_records()
    if snapshot is None or not snapshot.variants():
        return _CacheMiss(None)
    res = _new(req, "cache", machine, sha, ref_name)
    res.repo_type = snapshot.repo_type
    res.notes.append(source_note)
    if req.ref.revision is None and req.version is None and req.lock is None:
        res.notes.append(f"no version asked: used {ref_name}, the highest vN branch (else main)")
    res.notes.append(f"cache: {snapshot.path} (complete variants: {', '.join(snapshot.variants())})")
    try:
        _finish(res, snapshot.build_dir, snapshot.variants(), req, machine, _local_meta(snapshot.build_dir))
    except NoCompatibleVariantError as exc:
        return _CacheMiss(exc)  # fetched for another machine; the caller may ask the Hub
    _check_lock(req, res)  # first: a lock's message names the lock and how to re-lock
    record = snapshot.record(res.variant)  # type: ignore[arg-type]
    assert record is not None and res.path is not None
    what = f"{res.repo_id}@{sha[:12]} variant {res.variant}"
    # Links out of the snapshot first: their message names the link, a digest mismatch would not.
    importer.check_contained(res.path, importer.bounds_for(res.path), what)
    integrity.verify_files(snapshot.path, record.files, memo_dir=integrity.default_memo_dir(), what=what)
    res.notes.append("files match the digests recorded at download")
    return res


def _check_lock(req: Request, res: Resolution) -> None:
    """Verify the chosen variant against the lock's content hash, when the lock records one."""
    if req.lock is None:
        return
    expected = req.lock.variants.get(res.variant or "")
    if expected and expected.get("hash"):
        outcome = integrity.verify_lock_variant(
            res.path, expected, f"{res.repo_id}@{req.lock.sha[:12]} variant {res.variant}",  # type: ignore[arg-type]
            memo_dir=integrity.default_memo_dir(),
        )
        res.notes.append(f"files match the lock ({outcome})")
    else:
        res.notes.append("the lock records no content hash for this variant (kernels 0.17 format): sha pinned only")


def _shipped_for_lock(req: Request, machine: Machine, why: str) -> Resolution | None:
    """The shipped copy, when one of its variants has exactly the locked files (hash-checked)."""
    root = bundled.bundled_repo(req.ref.repo_id) if req.shipped else None
    if root is None or req.lock is None or not req.lock.variants:
        return None
    build_dir = root / "build"
    res = _new(req, "bundled", machine, req.lock.sha, req.lock.revision)
    _finish(res, build_dir, local.list_variants(build_dir), req, machine, _local_meta(build_dir), required=False)
    if res.variant is None:
        return None
    try:
        _check_lock(req, res)
    except (KernelIntegrityError, LockfileError):
        return None
    res.notes.append("not in the cache; the shipped copy has exactly the locked files (hash checked)")
    res.fallback = why
    bundled.warn_bundled(req.ref.repo_id, f"it matches the hash locked in {req.lock.lockfile} and the cache lacks it")
    return res


def _resolve_offline(req: Request, machine: Machine, why: str) -> Resolution:
    root = cache.cache_root(req.cache_dir)
    if req.lock is not None:
        got = _from_cache(req, machine, req.lock.sha, req.lock.sha, f"lock pinned ({why})")
        if isinstance(got, Resolution):
            got.fallback = why if req.download else None
            return got
        if got.misfit is None:
            shipped = _shipped_for_lock(req, machine, why)
            if shipped is not None:
                return shipped
        raise OfflineKernelMissingError(
            f"{req.ref.repo_id}@{req.lock.sha[:12]} (locked in {req.lock.lockfile}) has no usable variant in the cache "
            f"{root} ({why})." + _misfit_text(got.misfit)
            + f" Fetch it with `kernel-loader download --lock {req.lock.lockfile}`; load_kernel never uses the network."
        )
    refs = cache.cached_refs(req.ref.repo_id, req.cache_dir)
    versions = cache.cached_versions(req.ref.repo_id, req.cache_dir)
    try:
        ref_name, sha = _pick_ref(req, versions, refs, f"in the cache {root}")
    except KernelNotFoundError:
        res = resolve_bundled(req, why)
        if res is not None:
            return res
        found = ", ".join(sorted(refs)) or "nothing"
        target = req.ref.repo_id + (f"@v{req.version}" if req.version is not None else f"@{req.ref.revision}" if req.ref.revision else "")
        raise OfflineKernelMissingError(
            f"{req.what} is not in the cache {root} (cached revisions of it: {found}) and the Hub is not used "
            f"({why}). Fetch it while online with `kernel-loader download {target}`, or point KERNEL_LOADER_CACHE "
            "at a cache that has it."
        ) from None
    got = _from_cache(req, machine, ref_name, sha, f"no network: {why}")
    if isinstance(got, Resolution):
        got.fallback = why
        return got
    # The cache knows this revision: a shipped copy (another kernel build) never stands in for it.
    raise OfflineKernelMissingError(
        f"{req.what}: revision {ref_name} ({sha[:12]}) has no usable variant in the cache {root} and the Hub is "
        f"not used ({why}).{_misfit_text(got.misfit) or ' '}Fetch a build for this machine while online with "
        f"`kernel-loader download {req.ref.repo_id}@{ref_name}` (see `kernel-loader explain {req.ref.repo_id}`)."
    )


def _misfit_text(misfit: NoCompatibleVariantError | None) -> str:
    if misfit is None:
        return ""
    return " The cached variants do not fit this machine:\n" + "\n".join(d.line() for d in misfit.decisions) + "\n"


def _resolve_hub(req: Request, machine: Machine, settings: hub.HubSettings) -> Resolution:
    repo_id = req.ref.repo_id
    try:
        remote = hub.remote_repo(repo_id, settings)
    except hub.HubUnreachable as exc:
        return _resolve_offline(req, machine, exc.summary)
    except hub.HubRepoMissing as exc:
        res = resolve_bundled(req, f"the Hub at {settings.endpoint} has no {repo_id}") if req.lock is None else None
        if res is not None:
            return res
        raise KernelNotFoundError(f"{req.what}: {exc.summary}. Check the id (and HF_ENDPOINT).") from None
    try:
        return _resolve_remote(req, machine, remote, settings)
    except NoCompatibleVariantError as misfit:
        # The Hub has the repo but no build for this machine (e.g. only CUDA builds on a CPU
        # host): a shipped copy of the same version serves, with a warning that names every
        # rejected Hub build. A lock pins one sha, so it never falls back.
        fits = (
            resolve_bundled(req, f"no build of {repo_id} on {settings.endpoint} fits this machine")
            if req.lock is None and not req.all_variants else None
        )
        if fits is None:
            raise
        fits.notes.append("rejected Hub builds:\n" + "\n".join(d.line() for d in misfit.decisions))
        return fits
    except hub.HubUnreachable as exc:  # the connection dropped after the refs were read
        return _resolve_offline(req, machine, f"{exc.summary} after listing the refs")
    except hub.HubRepoMissing as exc:
        raise KernelNotFoundError(
            f"{req.what}: {exc.summary} after listing the refs; the revision may have been rewritten. "
            f"See `kernel-loader explain {repo_id}`."
        ) from None


def _refs_to_record(req: Request, ref_name: str, sha: str) -> dict[str, str]:
    refs = {} if ref_name == sha else {ref_name: sha}
    if req.lock is not None:
        if req.lock.version is not None:
            refs[f"v{req.lock.version}"] = sha
        if req.lock.revision is not None and req.lock.revision != sha:
            refs[req.lock.revision] = sha
    return refs


def _resolve_remote(req: Request, machine: Machine, remote: hub.RemoteRepo, settings: hub.HubSettings) -> Resolution:
    from kernel_loader import publish

    repo_id = req.ref.repo_id
    named = {**remote.tags, **remote.branches}
    ref_name, sha = _pick_ref(req, remote.versions(), named, f"on {settings.endpoint}")
    if ref_name == sha and not hub.commit_exists(repo_id, remote.repo_type, sha, settings):
        raise KernelNotFoundError(
            f"{req.what}: commit not found on {settings.endpoint}. Known refs: {', '.join(sorted(named)) or 'none'}."
        )
    cache_dir = cache.cache_root(req.cache_dir)
    refs = _refs_to_record(req, ref_name, sha)
    # A load uses the cached copy of this sha; an explanation (download=False) lists every
    # variant the Hub has, not just the ones fetched before.
    if req.download and not req.all_variants:
        got = _from_cache(req, machine, ref_name, sha, f"revision {ref_name} resolved on {settings.endpoint}")
        if isinstance(got, Resolution):
            snapshot = cache.find_snapshot(repo_id, sha, req.cache_dir)
            publish.write_refs(snapshot.path.parent.parent, refs)  # type: ignore[union-attr]
            return got
    files = hub.list_files(repo_id, remote.repo_type, sha, settings)
    names = hub.variants_of(files)
    res = _new(req, "hub", machine, sha, ref_name)
    res.repo_type = remote.repo_type
    res.notes.append(f"{settings.endpoint} (repo type {remote.repo_type})")
    if req.ref.revision is None and req.version is None and req.lock is None:
        res.notes.append(f"no version asked: used {ref_name}, the highest vN branch (else main)")
    meta_cache: dict[str, dict | None] = {}

    def read_meta(variant: str) -> dict | None:
        # A load keeps metadata.json in the cache (its files are fetched next); an explanation
        # (download=False) leaves the cache as it was and reads it straight from the Hub.
        if variant not in meta_cache:
            meta_cache[variant] = (
                hub.read_metadata(repo_id, remote.repo_type, sha, variant, cache_dir, settings) if req.download
                else hub.fetch_metadata(repo_id, remote.repo_type, sha, variant, settings)
            )
        return meta_cache[variant]

    listing_only = req.all_variants and not req.download  # locking: every variant, nothing fetched
    _finish(res, Path("."), names, req, machine, (lambda v: None) if listing_only else read_meta, required=not req.all_variants)
    if not req.download:
        res.path = None
        return res
    wanted = [n for n in names if req.lock is None or not req.lock.variants or n in req.lock.variants] if req.all_variants else [res.variant]
    lock_timeout = req.lock_timeout if req.lock_timeout is not None else constants.lock_timeout()
    snapshot = cache_dir
    for variant in wanted:
        job = publish.VariantFetch(
            repo_id, remote.repo_type, sha, variant, [f for f in files if f.path.startswith(f"build/{variant}/")], names, refs,
            prefetch=f"kernel-loader download --lock {req.lock.lockfile}" if req.lock else f"kernel-loader download {repo_id}@{ref_name}",
        )
        snapshot = publish.publish_variant(job, cache_dir, settings, lock_timeout)
    res.fetched = list(wanted)
    res.notes.append(f"downloaded into {snapshot}: {', '.join(wanted)}")
    res.path = snapshot / "build" / res.variant if res.variant else None
    if res.variant is not None:
        _check_lock(req, res)
    return res


def resolve(req: Request) -> Resolution:
    """Resolve a request to a variant folder (downloading it when needed and allowed).

    Raises:
        InvalidKernelRefError: both ``revision`` and ``version`` given, or an unknown backend.
        UntrustedKernelError: the org is not trusted (checked before any download).
        KernelNotFoundError: no source has the repo or revision.
        OfflineKernelMissingError: offline (or the Hub unreachable) and not in the cache.
        NoCompatibleVariantError: no variant fits this machine (every reason listed).
        MissingDependencyError: the chosen variant needs Python packages that are missing.
        KernelIntegrityError: cached files differ from their completion record or the lock.
        KernelDownloadError, CacheFullError, CacheNotWritableError, CacheLockError: a needed
            download failed (server died or stalled, disk full, read-only cache, no working locks).
        SettingError: a timeout/retry environment variable is malformed.
        KernelMetadataError: a candidate variant's metadata.json is malformed or too large.
    """
    if req.ref.revision is not None and req.version is not None:
        raise InvalidKernelRefError(
            f"{req.what}: pass either a revision ({req.ref.revision!r}) or version={req.version}, not both."
        )
    machine = req.machine or detect_machine()
    if req.backend is None and constants.backend_override():
        req = req._replace(backend=constants.backend_override())
    if req.hub is None:
        req = req._replace(hub=hub.HubSettings.from_env())
    settings = req.hub
    assert settings is not None
    try:
        override = local.local_override(req.ref.repo_id)
    except ValueError as exc:
        raise InvalidKernelRefError(str(exc)) from None
    if override is not None and req.lock is None:
        return resolve_local(req, override, "LOCAL_KERNELS override")
    if not trust.is_trusted(req.ref.repo_id, req.trust_remote_code):
        # A shipped repo is trusted as shipped; a Hub or cached copy from an untrusted org is not.
        shipped = resolve_bundled(req, "its org is not trusted for Hub downloads") if req.lock is None else None
        if shipped is not None:
            return shipped
        trust.check_trust(req.ref.repo_id, req.trust_remote_code)  # raises UntrustedKernelError
    if req.lock is not None and not req.download:
        return _resolve_offline(req, machine, "lock pinned: no network call")
    if cache.is_sha(req.ref.revision) and not req.all_variants:
        got = _from_cache(req, machine, req.ref.revision, req.ref.revision, "sha pinned: no network call")  # type: ignore[arg-type]
        if isinstance(got, Resolution):
            return got
    if req.local_files_only or settings.offline:
        why = "local_files_only=True" if req.local_files_only else "HF_HUB_OFFLINE=1"
        return _resolve_offline(req, machine, why)
    return _resolve_hub(req, machine, settings)
