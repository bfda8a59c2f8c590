"""Talking to the Hub (or a mirror) through huggingface_hub's public API.

Every call passes ``endpoint=`` and ``token=`` from :mod:`kernel_loader.constants`, because
huggingface_hub reads ``HF_ENDPOINT`` only once, at import. Repo type ``kernel`` is tried first,
then ``model`` (mirrors such as olah serve only ``model``; they answer 401/404 for kernels).
Downloads land in the cache in huggingface_hub's layout and show its progress bars.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

from kernel_loader import constants, metadata

logger = logging.getLogger("kernel_loader")

REPO_TYPES = ("kernel", "model")


class HubUnreachable(Exception):
    """The Hub could not be reached (connection refused, DNS, timeout, offline mode)."""


class HubRepoMissing(Exception):
    """The Hub answered, but has no such repo (for any repo type)."""


class RemoteRepo(NamedTuple):
    """A repo on the Hub: its type and refs (name -> sha)."""

    repo_id: str
    repo_type: str
    branches: dict[str, str]
    tags: dict[str, str]

    def versions(self) -> dict[int, str]:
        """``vN`` branches: ``{N: sha}``."""
        out = {}
        for name, sha in self.branches.items():
            if len(name) > 1 and name[0] == "v" and name[1:].isdigit():
                out[int(name[1:])] = sha
        return out


def _api() -> Any:
    from huggingface_hub import HfApi

    from kernel_loader import __version__

    return HfApi(
        endpoint=constants.hf_endpoint(),
        token=constants.hf_token(),
        library_name="kernel_loader",
        library_version=__version__,
    )


def _unreachable(exc: BaseException, depth: int = 0) -> bool:
    from huggingface_hub import errors

    if isinstance(exc, (errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError, ConnectionError, TimeoutError)):
        return True
    # huggingface_hub's HTTP stack varies by version (requests, httpx, httpx2): match transport
    # failures by class name rather than importing each library.
    for cls in type(exc).__mro__:
        module = cls.__module__.split(".")[0]
        if module.startswith(("httpx", "httpcore")) and cls.__name__ in ("TransportError", "NetworkError", "TimeoutException"):
            return True
        if module in ("requests", "urllib3") and cls.__name__ in ("ConnectionError", "Timeout", "NewConnectionError"):
            return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and depth < 8 and _unreachable(cause, depth + 1)


def _missing(exc: BaseException) -> bool:
    # olah answers 401 for anything it does not have and 404 for /api/kernels by sha; the Hub
    # answers 404. huggingface_hub versions without repo type "kernel" raise ValueError.
    from huggingface_hub import errors

    if isinstance(exc, (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.EntryNotFoundError)):
        return True
    if isinstance(exc, ValueError) and "repo" in str(exc).lower() and "type" in str(exc).lower():
        return True
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None) in (401, 403, 404)


def _refuse_unsafe_names(exc: BaseException, repo_id: str, revision: str) -> None:
    """huggingface_hub refuses a listed file name with ``..`` or an absolute path (ValueError);
    that is the mirror's doing, so it becomes our documented error instead of a traceback.

    Raises:
        UnsafeRepoContentError: ``exc`` is such a refusal.
    """
    text = str(exc)
    if isinstance(exc, ValueError) and ("Invalid filename" in text or "Invalid pointer path" in text):
        from kernel_loader.errors import UnsafeRepoContentError

        raise UnsafeRepoContentError(
            f"{repo_id}@{revision}: {constants.hf_endpoint()} lists a file name that would land outside the cache "
            f"({text.split('. ')[0]}); nothing was written. The Hub or mirror serving it is broken or compromised: "
            "check HF_ENDPOINT, or load from a cache you trust with HF_HUB_OFFLINE=1."
        ) from None


def _read_only(exc: OSError) -> bool:
    import errno

    return exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)


def _retrying(call):
    """Run ``call()``; on a transport failure try once more before calling the Hub unreachable.

    A pooled keep-alive connection the server has since closed (olah does after an error
    answer) fails once with "connection reset"; a fresh connection then works.
    """
    try:
        return call()
    except Exception as exc:
        if not _stale_connection(exc):
            raise
    return call()


def _stale_connection(exc: BaseException | None) -> bool:
    # Only a dropped keep-alive connection is worth an immediate retry; a refused connection or
    # a timeout would just fail (slowly) again.
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
            return True
        if type(exc).__name__ in ("RemoteProtocolError", "ReadError", "ServerDisconnectedError"):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _repo_types() -> tuple[str, ...]:
    # Older huggingface_hub releases cannot download repo type "kernel"; only ask for "model".
    from huggingface_hub import constants as hf_constants

    accepted = getattr(hf_constants, "REPO_TYPES_WITH_KERNEL", hf_constants.REPO_TYPES)
    return tuple(t for t in REPO_TYPES if t in accepted)


def remote_repo(repo_id: str) -> RemoteRepo:
    """The repo's type and refs.

    Raises:
        HubUnreachable: the Hub cannot be reached.
        HubRepoMissing: no repo of type ``kernel`` or ``model`` with this id.
    """
    if constants.hf_offline():
        raise HubUnreachable("HF_HUB_OFFLINE is set")
    api = _api()
    errors = []
    for repo_type in _repo_types():
        try:
            refs = _retrying(lambda: api.list_repo_refs(repo_id, repo_type=repo_type))
        except Exception as exc:  # classified below; anything else is a real error
            if _unreachable(exc):
                raise HubUnreachable(f"{constants.hf_endpoint()}: {type(exc).__name__}: {exc}") from exc
            if _missing(exc):
                errors.append(f"{repo_type}: {type(exc).__name__}")
                continue
            raise
        return RemoteRepo(
            repo_id,
            repo_type,
            {b.name: b.target_commit for b in refs.branches},
            {t.name: t.target_commit for t in refs.tags},
        )
    raise HubRepoMissing(f"{repo_id} not found on {constants.hf_endpoint()} ({'; '.join(errors)})")


def commit_exists(repo_id: str, repo_type: str, sha: str) -> bool:
    """Whether ``sha`` is a commit of the repo.

    Raises:
        HubUnreachable: the Hub cannot be reached.
    """
    try:
        info = _retrying(lambda: _api().repo_info(repo_id, repo_type=repo_type, revision=sha))
    except Exception as exc:
        if _unreachable(exc):
            raise HubUnreachable(str(exc)) from exc
        # olah answers 500 for an unknown sha; the Hub answers 404.
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if _missing(exc) or (status is not None and status >= 500):
            return False
        raise
    return getattr(info, "sha", None) == sha


def list_variants(repo_id: str, repo_type: str, revision: str) -> list[str]:
    """Variant folder names under ``build/`` at ``revision`` (empty if there is no build/).

    Raises:
        HubUnreachable: the Hub cannot be reached.
    """
    from huggingface_hub.hf_api import RepoFolder

    try:
        tree = _retrying(
            lambda: list(_api().list_repo_tree(repo_id, path_in_repo="build", repo_type=repo_type, revision=revision))
        )
    except Exception as exc:
        if _unreachable(exc):
            raise HubUnreachable(str(exc)) from exc
        if _missing(exc):
            return []
        raise
    return sorted(item.path.split("/")[-1] for item in tree if isinstance(item, RepoFolder))


def variant_file_digests(repo_id: str, repo_type: str, sha: str, variant: str) -> dict[str, str]:
    """``{path relative to the variant: digest}`` from the Hub's listing, downloading nothing.

    LFS files give ``sha256:<hex>``, others their git blob id ``git-sha1:<hex>``.

    Raises:
        HubUnreachable: the Hub cannot be reached.
    """
    from huggingface_hub.hf_api import RepoFile

    prefix = f"build/{variant}/"
    try:
        items = _retrying(
            lambda: list(
                _api().list_repo_tree(
                    repo_id, path_in_repo=prefix.rstrip("/"), repo_type=repo_type, revision=sha, recursive=True
                )
            )
        )
    except Exception as exc:
        if _unreachable(exc):
            raise HubUnreachable(str(exc)) from exc
        raise
    digests = {}
    for item in items:
        if not isinstance(item, RepoFile) or not item.path.startswith(prefix):
            continue
        rel = item.path[len(prefix) :]
        if "__pycache__/" in rel or rel.endswith((".pyc", ".pyo")):
            continue
        lfs = getattr(item, "lfs", None)
        lfs_sha = getattr(lfs, "sha256", None) or (lfs.get("sha256") if isinstance(lfs, dict) else None)
        digests[rel] = f"sha256:{lfs_sha}" if lfs_sha else f"git-sha1:{item.blob_id}"
    return digests


def read_metadata(repo_id: str, repo_type: str, revision: str, variant: str, cache_dir: Path) -> dict | None:
    """Download (into the cache) and parse ``build/<variant>/metadata.json``; None if absent.

    Raises:
        HubUnreachable: the Hub cannot be reached.
    """
    from huggingface_hub import hf_hub_download

    try:
        path = _retrying(
            lambda: hf_hub_download(
                repo_id,
                f"build/{variant}/metadata.json",
                repo_type=repo_type,
                revision=revision,
                cache_dir=str(cache_dir),
                endpoint=constants.hf_endpoint(),
                token=constants.hf_token(),
            )
        )
    except Exception as exc:
        if isinstance(exc, OSError) and _read_only(exc):
            # A read-only (shared) cache: fetch this small file into a throwaway folder instead.
            import tempfile

            with tempfile.TemporaryDirectory(prefix="kernel-loader-meta-") as tmp:
                return read_metadata(repo_id, repo_type, revision, variant, Path(tmp))
        _refuse_unsafe_names(exc, repo_id, revision)
        if _unreachable(exc):
            raise HubUnreachable(str(exc)) from exc
        if _missing(exc):
            return None
        raise
    return metadata.variant_metadata(Path(path).parent)


def download_variants(repo_id: str, repo_type: str, revision: str, variants: list[str], cache_dir: Path) -> Path:
    """Download only the given variants' files; return the snapshot folder (``.../snapshots/<sha>``).

    ``revision`` may be a branch or tag (recorded under ``refs/`` for later offline use) or a sha.

    Raises:
        HubUnreachable: the Hub cannot be reached.
    """
    from huggingface_hub import snapshot_download

    try:
        path = _retrying(
            lambda: snapshot_download(
                repo_id,
                repo_type=repo_type,
                revision=revision,
                cache_dir=str(cache_dir),
                allow_patterns=[f"build/{v}/*" for v in variants],
                endpoint=constants.hf_endpoint(),
                token=constants.hf_token(),
            )
        )
    except Exception as exc:
        if isinstance(exc, OSError) and _read_only(exc):
            from kernel_loader.errors import CacheNotWritableError

            raise CacheNotWritableError(
                f"{repo_id}@{revision}: build/{variants[0]} must be downloaded but the cache {cache_dir} is not "
                f"writable ({exc}). Prefetch it where the cache is writable (`kernel-loader download "
                f"{repo_id}@{revision}`), or set KERNEL_LOADER_CACHE to a writable folder."
            ) from None
        _refuse_unsafe_names(exc, repo_id, revision)
        if _unreachable(exc):
            raise HubUnreachable(str(exc)) from exc
        if _missing(exc):
            raise HubRepoMissing(
                f"{repo_id}@{revision}: build/{', build/'.join(variants)} could not be fetched ({type(exc).__name__})"
            ) from exc
        raise
    return Path(path)
