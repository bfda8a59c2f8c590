"""From a kernel id to one variant folder on disk, with the :class:`Resolution` that explains it.

Sources are tried in order: a ``LOCAL_KERNELS`` override; the cache (no network call at all when
the revision is a sha, or when offline); the Hub (refs → sha → variant list → the chosen
variant's files only); then the repos shipped with the package when the Hub cannot be reached
or does not have the repo. Nothing here imports the kernel.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, NamedTuple

from kernel_loader import cache, constants, deps, hashing, metadata, trust
from kernel_loader.errors import (
    InvalidKernelRefError,
    KernelNotFoundError,
    NoCompatibleVariantError,
    OfflineKernelMissingError,
)
from kernel_loader.machine import Machine, detect_machine
from kernel_loader.refs import KernelRef
from kernel_loader.resolution import Resolution
from kernel_loader.sources import bundled, hub, local
from kernel_loader.variants import select_variant

logger = logging.getLogger("kernel_loader")


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
    res: Resolution, build_dir: Path, names: list[str], req: Request, machine: Machine, read_meta: MetadataReader
) -> Resolution:
    """Select a variant among ``names``, check its dependencies, fill in ``res``."""
    try:
        chosen, decisions = select_variant(names, machine, read_meta, req.backend)
    except ValueError as exc:
        raise InvalidKernelRefError(f"{req.what}: {exc}") from exc
    res.decisions = decisions
    if chosen is None:
        raise _no_variant_error(res, machine)
    res.variant = chosen
    res.path = build_dir / chosen
    deps.check_dependencies(read_meta(chosen), f"{req.what} variant {chosen}")
    return res


def _local_meta(build_dir: Path) -> MetadataReader:
    return lambda variant: metadata.variant_metadata(build_dir / variant)


def resolve_local(req: Request, path: Path, source_note: str) -> Resolution:
    """Resolve against a local folder (``LOCAL_KERNELS`` or ``get_local_kernel``).

    Raises:
        KernelNotFoundError: the folder holds no kernel build.
        NoCompatibleVariantError: no variant fits this machine.
    """
    machine = req.machine or detect_machine()
    build_dir, single = local.build_folder(path, f"{req.what} ({source_note})")
    names = [single] if single else local.list_variants(build_dir)
    res = Resolution(str(req.ref), "local", req.ref.repo_id, req.ref.revision, None, None, None, version=req.version)
    res.machine = machine
    res.notes.append(f"{source_note}: {path}")
    return _finish(res, build_dir, names, req, machine, _local_meta(build_dir))


def resolve_bundled(req: Request, why: str) -> Resolution | None:
    """Resolve against the shipped copy, or None when it is absent, disabled, or the wrong version.

    Raises:
        NoCompatibleVariantError: the shipped copy has no variant for this machine.
    """
    root = bundled.bundled_repo(req.ref.repo_id)
    if root is None:
        return None
    machine = req.machine or detect_machine()
    build_dir = root / "build"
    names = local.list_variants(build_dir)
    res = Resolution(str(req.ref), "bundled", req.ref.repo_id, req.ref.revision, None, None, None, version=req.version)
    res.machine = machine
    _finish(res, build_dir, names, req, machine, _local_meta(build_dir))
    shipped_version = bundled.bundled_version(res.path)
    wanted = req.version
    if wanted is None and req.ref.revision and req.ref.revision[0] == "v" and req.ref.revision[1:].isdigit():
        wanted = int(req.ref.revision[1:])
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
            f"{req.what}: revision {rev!r} not found {where}. Known: {', '.join(sorted(named)) or 'none'}. "
            f"See `kernel-loader explain {req.ref.repo_id}`."
        )
    if req.version is not None:
        if req.version in versions:
            return f"v{req.version}", versions[req.version]
        have = ", ".join(f"v{v}" for v in sorted(versions)) or "none"
        raise KernelNotFoundError(
            f"{req.what}: version {req.version} (branch v{req.version}) not found {where}; versions: {have}. "
            f"See `kernel-loader explain {req.ref.repo_id}`."
        )
    if versions:
        best = max(versions)
        logger.info("%s: no version given, using the latest, v%d %s", req.ref.repo_id, best, where)
        return f"v{best}", versions[best]
    if "main" in named:
        return "main", named["main"]
    raise KernelNotFoundError(f"{req.what}: no vN branch and no main {where}.")


def _from_cache(req: Request, machine: Machine, ref_name: str, sha: str, source_note: str) -> Resolution | None:
    snapshot = cache.find_snapshot(req.ref.repo_id, sha, req.cache_dir)
    if snapshot is None or not snapshot.variants():
        return None
    res = Resolution(str(req.ref), "cache", req.ref.repo_id, req.ref.revision, sha, None, None, version=req.version)
    res.machine = machine
    res.resolved_revision = ref_name
    res.notes.append(source_note)
    if req.ref.revision is None and req.version is None:
        res.notes.append(f"no version asked: used {ref_name}, the highest vN branch (else main)")
    res.notes.append(f"cache: {snapshot.path} (variants present: {', '.join(snapshot.variants())})")
    try:
        return _finish(res, snapshot.build_dir, snapshot.variants(), req, machine, _local_meta(snapshot.build_dir))
    except NoCompatibleVariantError as exc:
        # The cached variants were fetched for another machine; the caller may ask the Hub.
        _cache_misfits[(req.ref.repo_id, sha)] = exc
        return None


# (repo, sha) -> why the cached variants did not fit, quoted if nothing else works
_cache_misfits: dict[tuple[str, str], NoCompatibleVariantError] = {}


def _resolve_offline(req: Request, machine: Machine, why: str) -> Resolution:
    refs = cache.cached_refs(req.ref.repo_id, req.cache_dir)
    versions = cache.cached_versions(req.ref.repo_id, req.cache_dir)
    root = cache.cache_root(req.cache_dir)
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
    res = _from_cache(req, machine, ref_name, sha, f"no network: {why}")
    if res is not None:
        res.fallback = why
        return res
    fallback = resolve_bundled(req, why)
    if fallback is not None:
        return fallback
    misfit = _cache_misfits.pop((req.ref.repo_id, sha), None)
    detail = (
        " The cached variants do not fit this machine:\n" + "\n".join(d.line() for d in misfit.decisions) + "\n"
        if misfit is not None
        else " "
    )
    raise OfflineKernelMissingError(
        f"{req.what}: revision {ref_name} ({sha[:12]}) has no usable variant in the cache {root} and the Hub is "
        f"not used ({why}).{detail}Fetch a build for this machine while online with "
        f"`kernel-loader download {req.ref.repo_id}@{ref_name}` (see `kernel-loader explain {req.ref.repo_id}`)."
    )


def _resolve_hub(req: Request, machine: Machine) -> Resolution:
    repo_id = req.ref.repo_id
    try:
        remote = hub.remote_repo(repo_id)
    except hub.HubUnreachable as exc:
        return _resolve_offline(req, machine, f"the Hub at {constants.hf_endpoint()} is unreachable ({exc})")
    except hub.HubRepoMissing as exc:
        res = resolve_bundled(req, f"the Hub at {constants.hf_endpoint()} has no {repo_id}")
        if res is not None:
            return res
        raise KernelNotFoundError(
            f"{req.what}: {exc}. Check the id (and HF_ENDPOINT/HF_TOKEN), or see `kernel-loader explain {repo_id}`."
        ) from None
    try:
        return _resolve_remote(req, machine, remote)
    except hub.HubUnreachable as exc:  # the connection dropped after the refs were read
        return _resolve_offline(req, machine, f"the Hub at {constants.hf_endpoint()} stopped answering ({exc})")
    except hub.HubRepoMissing as exc:
        raise KernelNotFoundError(
            f"{req.what}: {exc}. See `kernel-loader explain {repo_id}`; the revision may have been rewritten."
        ) from None


def _resolve_remote(req: Request, machine: Machine, remote: hub.RemoteRepo) -> Resolution:
    repo_id = req.ref.repo_id
    named = {**remote.tags, **remote.branches}
    ref_name, sha = _pick_ref(req, remote.versions(), named, f"on {constants.hf_endpoint()}")
    if ref_name == sha and not hub.commit_exists(repo_id, remote.repo_type, sha):
        raise KernelNotFoundError(f"{req.what}: commit {sha} not found on {constants.hf_endpoint()}.")
    # A load uses the cached copy of this sha; an explanation (download=False) lists every
    # variant the Hub has, not just the ones fetched before.
    if req.download:
        cached = _from_cache(req, machine, ref_name, sha, f"revision {ref_name} resolved on {constants.hf_endpoint()}")
        if cached is not None:
            return cached
    names = hub.list_variants(repo_id, remote.repo_type, sha)
    res = Resolution(str(req.ref), "hub", repo_id, req.ref.revision, sha, None, None, version=req.version)
    res.machine = machine
    res.resolved_revision = ref_name
    res.notes.append(f"{constants.hf_endpoint()} (repo type {remote.repo_type})")
    if req.ref.revision is None and req.version is None:
        res.notes.append(f"no version asked: used {ref_name}, the highest vN branch (else main)")
    cache_dir = cache.cache_root(req.cache_dir)
    # Download by ref name so refs/<name> is recorded for later offline resolution.
    rev = ref_name
    meta_cache: dict[str, dict | None] = {}

    def read_meta(variant: str) -> dict | None:
        if variant not in meta_cache:
            meta_cache[variant] = hub.read_metadata(repo_id, remote.repo_type, rev, variant, cache_dir)
        return meta_cache[variant]

    _finish(res, Path("."), names, req, machine, read_meta)
    if req.download:
        snapshot = hub.download_variants(repo_id, remote.repo_type, rev, [res.variant], cache_dir)
        if snapshot.name != sha:
            res.notes.append(f"{ref_name} moved to {snapshot.name} while downloading")
            res.sha = snapshot.name
        res.path = snapshot / "build" / res.variant
    else:
        res.path = None
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
        KernelMetadataError: a candidate variant's metadata.json is malformed or too large.
    """
    if req.ref.revision is not None and req.version is not None:
        raise InvalidKernelRefError(
            f"{req.what}: pass either a revision ({req.ref.revision!r}) or version={req.version}, not both."
        )
    machine = req.machine or detect_machine()
    if req.backend is None and constants.backend_override():
        req = req._replace(backend=constants.backend_override())
    try:
        override = local.local_override(req.ref.repo_id)
    except ValueError as exc:
        raise InvalidKernelRefError(str(exc)) from None
    if override is not None:
        return resolve_local(req, override, "LOCAL_KERNELS override")
    if not trust.is_trusted(req.ref.repo_id, req.trust_remote_code):
        # A shipped repo is trusted as shipped; a Hub or cached copy from an untrusted org is not.
        shipped = resolve_bundled(req, "its org is not trusted for Hub downloads")
        if shipped is not None:
            return shipped
        trust.check_trust(req.ref.repo_id, req.trust_remote_code)  # raises UntrustedKernelError
    if cache.is_sha(req.ref.revision):
        res = _from_cache(req, machine, req.ref.revision, req.ref.revision, "sha pinned: no network call")
        if res is not None:
            return res
    if req.local_files_only or constants.hf_offline():
        why = "local_files_only=True" if req.local_files_only else "HF_HUB_OFFLINE=1"
        return _resolve_offline(req, machine, why)
    return _resolve_hub(req, machine)
