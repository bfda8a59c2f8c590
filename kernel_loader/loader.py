"""The public loading API: ``get_kernel``, ``get_local_kernel``, ``has_kernel``, ``load_kernel``,
``resolve_kernel``, ``get_bundled_kernel``.

A dict keyed by the call arguments sits in front of everything, so a repeated ``get_kernel``
call costs one dict lookup. Every returned module carries ``__kernel_resolution__``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from kernel_loader import importer
from kernel_loader.errors import KernelLoaderError, KernelNotFoundError
from kernel_loader.machine import Machine, detect_machine
from kernel_loader.refs import KernelRef, check_backend, check_function, check_path, check_version
from kernel_loader.resolution import Resolution
from kernel_loader.resolver import Request, resolve, resolve_bundled, resolve_local

import os

_memo: dict[tuple, ModuleType] = {}
# Results reached by a fallback (Hub unreachable or offline, shipped copy) depend on the
# environment; they are reused only while these variables are unchanged.
_ENV_KEYS = (
    "HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE", "HF_HOME", "LOCAL_KERNELS",
    "KERNEL_LOADER_CACHE", "KERNEL_LOADER_NO_BUNDLED", "KERNEL_LOADER_TRUSTED_ORGS", "KERNEL_LOADER_BACKEND",
)
_fallback_env: dict[tuple, tuple] = {}


try:
    # os.environ.get costs ~1 µs per variable; its backing dict (keys encoded as os.environ
    # encodes them) answers in a tenth of that, which keeps a memo hit well under 10 µs.
    _ENV_DATA = os.environ._data  # type: ignore[attr-defined]
    _ENV_RAW_KEYS = tuple(os.environ.encodekey(k) for k in _ENV_KEYS)  # type: ignore[attr-defined]

    def _env_snapshot() -> tuple:
        return tuple(map(_ENV_DATA.get, _ENV_RAW_KEYS))

except AttributeError:  # pragma: no cover - other Python implementations

    def _env_snapshot() -> tuple:
        return tuple(map(os.environ.get, _ENV_KEYS))


def _remember(key: tuple, module: ModuleType) -> None:
    res = getattr(module, "__kernel_resolution__", None)
    if getattr(res, "fallback", None):
        _fallback_env[key] = _env_snapshot()
    else:
        _fallback_env.pop(key, None)
    _memo[key] = module


def _recall(key: tuple) -> ModuleType | None:
    try:
        module = _memo.get(key)
    except TypeError:  # an unhashable argument: the checks after the memo name it
        return None
    if module is not None and key in _fallback_env and _fallback_env[key] != _env_snapshot():
        return None
    return module


def _import(res: Resolution) -> ModuleType:
    assert res.path is not None and res.variant is not None
    name = importer.module_name_for(res.repo_id, res.sha, res.variant, res.path)
    what = f"{res.repo_id}@{(res.sha or 'local')[:12]} variant {res.variant}"
    module = importer.import_variant(res.path, name, what)
    res.module_name = name
    # The same files may be reached again by another route (e.g. the cache after the Hub); the
    # record describes the latest resolution that returned this module.
    module.__kernel_resolution__ = res  # type: ignore[attr-defined]
    return module


def resolve_kernel(
    repo_id: str,
    revision: str | None = None,
    *,
    version: int | None = None,
    backend: str | None = None,
    trust_remote_code: bool = False,
    local_files_only: bool = False,
    download: bool = True,
    machine: Machine | None = None,
    cache_dir: str | Path | None = None,
    shipped: bool = True,
) -> Resolution:
    """Resolve a kernel id to a variant folder without importing it.

    ``repo_id`` may carry ``@revision``/``:function``; ``machine`` describes another host (the
    default is this one); ``download=False`` stops before fetching the variant's files (only
    ``metadata.json`` files are fetched to check GPU archs); ``shipped=False`` never answers
    with the copy shipped with kernel_loader.

    Raises:
        InvalidKernelRefError, InvalidArgumentError, UntrustedKernelError, KernelNotFoundError,
        OfflineKernelMissingError, NoCompatibleVariantError, MissingDependencyError: see :func:`get_kernel`.
    """
    # Arguments are checked before any disk or network work.
    ref = KernelRef.from_parts(repo_id, revision)
    check_version(version)
    check_backend(backend, machine or detect_machine())
    req = Request(
        ref,
        version=version,
        backend=backend,
        trust_remote_code=trust_remote_code,
        local_files_only=local_files_only,
        download=download,
        cache_dir=Path(cache_dir) if cache_dir is not None else None,
        machine=machine,
        shipped=shipped,
    )
    return resolve(req)


def import_resolution(res: Resolution) -> ModuleType:
    """Import the variant a :func:`resolve_kernel` call chose (once per repo, sha and variant).

    Raises:
        KernelImportError: the kernel's package failed to import.
    """
    return _import(res)


def get_kernel(
    repo_id: str,
    revision: str | None = None,
    *,
    version: int | None = None,
    backend: str | None = None,
    trust_remote_code: bool = False,
    local_files_only: bool = False,
) -> ModuleType:
    """Fetch (once), check and import a kernel; return its module.

    ``repo_id`` is ``org/name`` (``@revision`` may be included instead of ``revision=``);
    ``version=N`` means branch ``vN``; with neither, the highest ``vN`` branch (else ``main``).
    ``backend`` restricts variant choice (``"cpu"`` or this machine's backend). The module's
    ``__kernel_resolution__`` tells where it came from and why.

    Raises:
        InvalidKernelRefError: a malformed id, or both ``revision`` and ``version``.
        InvalidArgumentError: ``version`` is not an int >= 0, or ``backend`` is unknown or not
            available here (the message lists the backends).
        KernelFunctionNotFoundError: the id's ``:function`` is not in the kernel (the message
            lists what it has).
        UntrustedKernelError: the org is not trusted and ``trust_remote_code`` is False.
        KernelNotFoundError: no source has the repo or revision.
        OfflineKernelMissingError: offline / local_files_only / Hub unreachable and not cached.
        NoCompatibleVariantError: no build fits this machine (``.decisions`` lists the reasons).
        MissingDependencyError: the build needs Python packages that are not installed.
        KernelImportError: the kernel's package failed to import.
    """
    key = (repo_id, revision, version, backend, trust_remote_code, local_files_only)
    try:
        module = _memo.get(key)
    except TypeError:  # an unhashable argument: resolve_kernel names the wrong one
        module = None
    if module is not None and (key not in _fallback_env or _fallback_env[key] == _env_snapshot()):
        return module
    res = resolve_kernel(
        repo_id,
        revision,
        version=version,
        backend=backend,
        trust_remote_code=trust_remote_code,
        local_files_only=local_files_only,
    )
    module = _import(res)
    check_function(module, KernelRef.parse(repo_id))
    _remember(key, module)
    return module


def get_local_kernel(path: str | Path, *, backend: str | None = None) -> ModuleType:
    """Import a kernel from a local folder (a repo with ``build/``, a ``build/`` folder, or one variant).

    Raises:
        KernelNotFoundError: the folder holds no kernel build.
        NoCompatibleVariantError: no variant fits this machine.
        MissingDependencyError, KernelImportError: as for :func:`get_kernel`.
    """
    check_path(path, "path")
    check_backend(backend, detect_machine())
    try:
        path = Path(path).expanduser().resolve()
    except RuntimeError:  # "~nouser/..."
        raise KernelNotFoundError(f"{path}: names an unknown user's home folder") from None
    key = ("local", str(path), backend)
    module = _memo.get(key)
    if module is not None:
        return module
    name = path.name if path.name != "build" else path.parent.name
    ref = KernelRef.parse(f"local/{_safe(name)}")
    res = resolve_local(Request(ref, backend=backend), path, "local folder")
    res.requested = str(path)
    module = _import(res)
    _memo[key] = module
    return module


def _safe(name: str) -> str:
    import re

    cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", name)
    cleaned = re.sub(r"-{2,}", "-", re.sub(r"\.{2,}", ".", cleaned))[:96].strip("._-")
    return cleaned or "kernel"


def has_kernel(repo_id: str, revision: str | None = None, *, version: int | None = None) -> bool:
    """Whether a build of the kernel exists that can run on this machine (nothing is imported).

    Downloads at most ``metadata.json`` files. Returns False when the repo, revision or a
    compatible variant is missing (or offline and not cached).

    Raises:
        InvalidKernelRefError: a malformed id.
        InvalidArgumentError: ``version`` is not an int >= 0.
        UntrustedKernelError: the org is not trusted (use ``trust_remote_code=True`` to load it).
    """
    from kernel_loader.errors import (
        MissingDependencyError,
        NoCompatibleVariantError,
    )

    try:
        resolve_kernel(repo_id, revision, version=version, download=False, trust_remote_code=False)
    except (KernelNotFoundError, NoCompatibleVariantError, MissingDependencyError):
        return False
    return True


def load_kernel(repo_id: str, *, lockfile: str | Path | None = None, trust_remote_code: bool = False) -> ModuleType:
    """Load the kernel pinned by a lock file; never touches the network.

    ``lockfile`` defaults to the nearest ``kernels.lock`` in the current folder or its parents.
    The variant's files are checked against the lock's hash before import (a successful check
    is remembered in the state folder, so a warm load only stats the files). The lock pins a
    sha but is not consent: an org outside the trusted list needs ``trust_remote_code=True``.

    Raises:
        InvalidKernelRefError: a malformed id (checked before the lock file is looked for).
        LockfileError: no lock file, ``repo_id`` is not in it, or its ``hash_type`` is unknown.
        UntrustedKernelError: the org is not trusted and ``trust_remote_code`` is False.
        OfflineKernelMissingError: the locked sha (or variant) is not in the cache; run
            ``kernel-loader download --lock kernels.lock``.
        NoCompatibleVariantError: no locked variant fits this machine.
        KernelIntegrityError: the files differ from the lock.
        KernelImportError: the kernel's package failed to import.
    """
    key = ("lock", repo_id, str(lockfile) if lockfile is not None else None, trust_remote_code)
    module = _recall(key)
    if module is not None:
        return module
    KernelRef.parse(repo_id)  # the id is checked before the lock file is looked for
    if lockfile is not None:
        check_path(lockfile, "lockfile")
    from kernel_loader import locking
    from kernel_loader import lockfile as lockmod

    path, entry = lockmod.lock_for(repo_id, lockfile)
    res = resolve(locking.locked_request(entry, path, download=False, trust_remote_code=trust_remote_code))
    module = _import(res)
    _remember(key, module)
    return module


def get_bundled_kernel(repo_id: str) -> ModuleType:
    """Import the copy of ``repo_id`` shipped with kernel_loader (the last resort of fallbacks).

    Raises:
        KernelNotFoundError: the repo is not shipped, or ``KERNEL_LOADER_NO_BUNDLED=1``.
        NoCompatibleVariantError: the shipped copy has no variant for this machine.
        KernelImportError: the shipped package failed to import.
    """
    key = ("bundled", repo_id)
    module = _recall(key)
    if module is not None:
        return module
    ref = KernelRef.parse(repo_id)
    res = resolve_bundled(Request(ref), "the shipped copy was asked for")
    if res is None:
        from kernel_loader import constants
        from kernel_loader.sources import bundled

        why = (
            "KERNEL_LOADER_NO_BUNDLED=1 is set"
            if constants.no_bundled()
            else f"it is not shipped (shipped: {', '.join(bundled.bundled_repo_ids()) or 'none'})"
        )
        raise KernelNotFoundError(
            f"No shipped copy of {repo_id}: {why}. Fetch it from the Hub with `kernel-loader download {repo_id}`."
        )
    module = _import(res)
    _remember(key, module)
    return module


def clear_memo() -> None:
    """Forget memoized ``get_kernel`` results (imported modules stay importable); for tests."""
    _memo.clear()
    _fallback_env.clear()


__all__ = [
    "get_kernel",
    "get_local_kernel",
    "has_kernel",
    "load_kernel",
    "resolve_kernel",
    "get_bundled_kernel",
    "clear_memo",
    "KernelLoaderError",
]
