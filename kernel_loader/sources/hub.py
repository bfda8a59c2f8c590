"""Talking to the Hub (or a mirror) through huggingface_hub.

Refs, file listings and the metadata.json that explanations read are plain GETs through
huggingface_hub's shared HTTP client, headers and error mapping; files that land in the cache
come through ``hf_hub_download``.

Every call gets a :class:`HubSettings` (endpoint, token, timeouts, retries) from the request,
because huggingface_hub reads ``HF_ENDPOINT`` only once, at import. Repo type ``kernel`` is tried
first, then ``model`` (mirrors such as olah serve only ``model``; they answer 401/404 for kernels).

Time is bounded: huggingface_hub's shared HTTP client is given connect/read timeouts
(its default client waits forever), file transfers use the read timeout, and a call that fails in
transit is tried again ``retries`` times, each retry logged. Every failure is mapped in
:func:`_classify`, the one place that turns huggingface_hub / HTTP / OS errors into
:class:`HubUnreachable`, :class:`HubRepoMissing` or the project's cache errors, said in words
(the HTTP status, the endpoint, the timeout that ran out, what to check): library class names
steer the wording and never appear in it.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, TypeVar

from kernel_loader import constants, metadata
from kernel_loader.refs import version_branch

logger = logging.getLogger("kernel_loader")

REPO_TYPES = ("kernel", "model")
T = TypeVar("T")


class HubCallError(Exception):
    """A Hub call that failed, said in words (no library class names).

    ``str()`` is the whole sentence, ``"<what>: the Hub at <endpoint> <reason>"``; :attr:`summary`
    leaves out ``what`` for messages that already name the kernel, so no id is said twice.
    """

    def __init__(self, endpoint: str, reason: str, what: str | None = None) -> None:
        self.endpoint, self.reason, self.what = endpoint, reason, what
        super().__init__(f"{what}: {self.summary}" if what else self.summary)

    @property
    def summary(self) -> str:
        """What happened and where, without naming the call."""
        return f"the Hub at {self.endpoint} {self.reason}"


class HubUnreachable(HubCallError):
    """The Hub could not be reached, stalled or died (connection refused, DNS, timeout, offline mode)."""


class HubRepoMissing(HubCallError):
    """The Hub answered, but has no such repo, revision or file (for any repo type)."""


class HubSettings(NamedTuple):
    """Where the Hub is and how long to wait for it; travels in the resolver's request."""

    endpoint: str
    token: str | None
    connect_timeout: float
    read_timeout: float
    retries: int
    offline: bool = False

    @classmethod
    def from_env(cls) -> "HubSettings":
        """The settings :mod:`kernel_loader.constants` reads from the environment.

        Raises:
            SettingError: a timeout or retry variable holds an unusable value.
        """
        return cls(
            constants.hf_endpoint(),
            constants.hf_token(),
            constants.connect_timeout(),
            constants.read_timeout(),
            constants.retries(),
            constants.hf_offline(),
        )

    def bound_s(self) -> float:
        """The longest one Hub call can take before it is reported, retries included."""
        return (self.retries + 1) * (self.connect_timeout + self.read_timeout + 1.0)


class RemoteRepo(NamedTuple):
    """A repo on the Hub: its type and refs (name -> sha)."""

    repo_id: str
    repo_type: str
    branches: dict[str, str]
    tags: dict[str, str]

    def versions(self) -> dict[int, str]:
        """``vN`` branches: ``{N: sha}``."""
        return {n: sha for name, sha in self.branches.items() if (n := version_branch(name)) is not None}


class RemoteFile(NamedTuple):
    """One file of a variant as the Hub lists it: size, LFS sha256 (None for a plain git file), git blob id."""

    path: str  # relative to the repo root
    size: int
    lfs_sha256: str | None
    blob_id: str


# -- the HTTP client ---------------------------------------------------------------------------

_client_lock = threading.Lock()
_installed: tuple[float, float] | None = None


def _install_timeouts(settings: HubSettings) -> None:
    """Give huggingface_hub's shared client our connect/read timeouts (its default has none).

    huggingface_hub keeps one process-wide client, so this is process-wide too; a client factory
    the application installed itself is left alone (then its timeouts apply).
    """
    global _installed
    wanted = (settings.connect_timeout, settings.read_timeout)
    with _client_lock:
        if _installed == wanted:
            return
        from huggingface_hub import constants as hf_constants

        # File transfers pass this value as their per-request timeout (all supported versions).
        hf_constants.HF_HUB_DOWNLOAD_TIMEOUT = settings.read_timeout  # type: ignore[assignment]
        try:
            from huggingface_hub.utils import _http
        except ImportError:  # pragma: no cover - layout change
            _installed = wanted
            return
        if hasattr(_http, "set_client_factory"):  # huggingface_hub 1.x / 2.x: an httpx client
            install, current, base = _http.set_client_factory, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory
            defaults: tuple = (base,)
            wrap = _httpx_with_timeouts
        else:  # huggingface_hub 0.x: a requests session
            import requests

            install, current = _http.configure_http_backend, "_GLOBAL_BACKEND_FACTORY"
            base = getattr(_http, "_default_backend_factory", requests.Session)
            defaults = (base, requests.Session, requests.session)
            wrap = _requests_with_timeouts
        now = getattr(_http, current, None)
        if now is not None and now not in defaults and not getattr(now, "_kernel_loader", False):
            logger.info("huggingface_hub has an application HTTP client factory; its timeouts apply")
        else:

            def factory() -> Any:
                return wrap(base(), settings)

            factory._kernel_loader = True  # type: ignore[attr-defined]
            install(factory)
        _installed = wanted


def _httpx_with_timeouts(client: Any, settings: HubSettings) -> Any:
    client.timeout = type(client.timeout)(settings.read_timeout, connect=settings.connect_timeout)
    return client


def _requests_with_timeouts(session: Any, settings: HubSettings) -> Any:
    request = session.request

    def timed(method: str, url: str, **kwargs: Any) -> Any:
        if kwargs.get("timeout") is None:
            kwargs["timeout"] = (settings.connect_timeout, settings.read_timeout)
        return request(method, url, **kwargs)

    session.request = timed
    return session


# The Hub is asked through huggingface_hub's shared client (``get_session``), headers
# (``build_hf_headers``: token, user agent) and error mapping (``hf_raise_for_status``), not
# through ``HfApi``: importing ``huggingface_hub.hf_api`` costs about 0.1 s, a fifth of a warm
# ``kernel-loader explain``, for three plain GETs whose JSON is read here.


class _NotAListing(Exception):
    """The Hub answered 200 with JSON that is not what the endpoint documents."""


def _http(settings: HubSettings) -> tuple[Any, dict[str, str]]:
    """huggingface_hub's shared HTTP client (with our timeouts) and the headers for ``settings``."""
    from huggingface_hub.utils import build_hf_headers, get_session

    from kernel_loader import __version__

    _install_timeouts(settings)
    headers = build_hf_headers(token=settings.token, library_name="kernel_loader", library_version=__version__)
    return get_session(), headers


def _get_json(settings: HubSettings, url: str, params: dict | None = None) -> tuple[Any, Any]:
    """GET ``url``: (its JSON, the response); an error status raises huggingface_hub's typed error."""
    from huggingface_hub.utils import hf_raise_for_status

    session, headers = _http(settings)
    response = session.get(url, headers=headers, params=params)
    hf_raise_for_status(response)
    try:
        return response.json(), response
    except ValueError:
        raise _NotAListing(f"{len(response.content)} bytes that are not JSON") from None


def _get_pages(settings: HubSettings, url: str, params: dict) -> list:
    """Every item of a paginated listing (the Hub links the next page in the ``Link`` header)."""
    items: list = []
    next_url: str | None = url
    while next_url:
        page, response = _get_json(settings, next_url, params)
        if not isinstance(page, list):
            raise _NotAListing("a page that is not a list of entries")
        items.extend(page)
        next_url, params = response.links.get("next", {}).get("url"), None  # the link carries the query
    return items


def _get_capped(settings: HubSettings, url: str, limit: int) -> bytes:
    """The body of ``url``, at most ``limit + 1`` bytes read (a larger file is refused by the caller)."""
    from huggingface_hub.utils import hf_raise_for_status

    session, headers = _http(settings)
    if callable(getattr(session, "stream", None)):  # httpx (huggingface_hub 1.x / 2.x); requests has a flag
        opened, chunks = session.stream("GET", url, headers=headers), lambda r: r.iter_bytes()
    else:  # requests (huggingface_hub 0.x)
        opened, chunks = session.get(url, headers=headers, stream=True), lambda r: r.iter_content(chunk_size=65536)
    body = bytearray()
    with opened as response:
        hf_raise_for_status(response)
        for chunk in chunks(response):
            body += chunk
            if len(body) > limit:
                break
    return bytes(body[: limit + 1])


def _api_url(settings: HubSettings, repo_type: str, repo_id: str, *tail: str) -> str:
    return f"{settings.endpoint.rstrip('/')}/api/{repo_type}s/{repo_id}/" + "/".join(tail)


def _file_url(settings: HubSettings, repo_type: str, repo_id: str, sha: str, path: str) -> str:
    from urllib.parse import quote

    from huggingface_hub import constants as hf_constants

    prefix = getattr(hf_constants, "REPO_TYPES_URL_PREFIXES", {}).get(repo_type, "")
    return f"{settings.endpoint.rstrip('/')}/{prefix}{repo_id}/resolve/{quote(sha, safe='')}/{quote(path)}"


# -- error mapping (the one place) ------------------------------------------------------------


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during, outermost first."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and all(cur is not e for e in seen):
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def _in_chain(exc: BaseException, test: Callable[[BaseException], bool]) -> bool:
    return any(test(e) for e in _chain(exc))


def _is_transport(exc: BaseException) -> bool:
    from huggingface_hub import errors

    if isinstance(exc, (errors.OfflineModeIsEnabled, ConnectionError, TimeoutError)):
        return True
    # huggingface_hub's HTTP stack varies by version (requests, httpx, httpx2): match transport
    # failures by class name rather than importing each library.
    for cls in type(exc).__mro__:
        module = cls.__module__.split(".")[0]
        if module.startswith(("httpx", "httpcore")) and cls.__name__ in (
            "TransportError", "NetworkError", "TimeoutException", "RemoteProtocolError", "ProtocolError",
        ):
            return True
        if module in ("requests", "urllib3") and cls.__name__ in (
            "ConnectionError", "Timeout", "NewConnectionError", "ChunkedEncodingError", "ProtocolError",
        ):
            return True
    return False


def _is_missing(exc: BaseException) -> bool:
    # olah answers 401 for anything it does not have and 404 for /api/kernels by sha; the Hub
    # answers 404. huggingface_hub versions without repo type "kernel" raise ValueError.
    from huggingface_hub import errors

    if isinstance(exc, (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.EntryNotFoundError)):
        return True
    if isinstance(exc, ValueError) and "repo" in str(exc).lower() and "type" in str(exc).lower():
        return True
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None) in (401, 403, 404)


def _unsafe_names(exc: BaseException, settings: HubSettings, what: str) -> BaseException | None:
    """huggingface_hub refuses a listed file name with ``..`` or an absolute path (ValueError);
    that is the mirror's doing, so it becomes our documented error instead of a traceback."""
    text = str(exc)
    if not (isinstance(exc, ValueError) and ("Invalid filename" in text or "Invalid pointer path" in text)):
        return None
    from kernel_loader.errors import UnsafeRepoContentError

    return UnsafeRepoContentError(
        f"{what}: {settings.endpoint} lists a file name that would land outside the cache "
        f"({text.split('. ')[0]}); nothing was written. The Hub or mirror serving it is broken or compromised: "
        "check HF_ENDPOINT, or load from a cache you trust with HF_HUB_OFFLINE=1."
    )


def _is_server_error(exc: BaseException) -> bool:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return status is not None and status >= 500


def is_read_only(exc: BaseException) -> bool:
    """An OS error saying the cache cannot be written (permissions, read-only mount)."""
    return isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)


def is_disk_full(exc: BaseException) -> bool:
    """An OS error saying the disk (or quota) is full."""
    return _in_chain(exc, lambda e: isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))


def _status(exc: BaseException) -> int | None:
    return next((s for e in _chain(exc) if isinstance(s := getattr(getattr(e, "response", None), "status_code", None), int)), None)


def _transport_reason(exc: BaseException, settings: HubSettings) -> str:
    """What went wrong in transit, in words; the class names only steer the choice of words."""
    chain = _chain(exc)
    names = {cls.__name__ for e in chain for cls in type(e).__mro__}
    text = " ".join(str(e) for e in chain).lower()
    if "OfflineModeIsEnabled" in names:
        return "is not used: HF_HUB_OFFLINE is set"
    # Refusals and DNS first: urllib3 files its NewConnectionError under ConnectTimeoutError.
    if "ConnectionRefusedError" in names or "connection refused" in text:
        detail = "the connection was refused, nothing listens there; check HF_ENDPOINT"
    elif "gaierror" in names or any(t in text for t in ("name or service not known", "name resolution", "nodename nor servname")):
        detail = "its host name does not resolve; check HF_ENDPOINT and the network"
    elif names & {"ConnectTimeout", "ConnectTimeoutError"}:
        detail = f"no connection within {settings.connect_timeout:g} s (KERNEL_LOADER_CONNECT_TIMEOUT)"
    elif names & {"TimeoutException", "Timeout", "TimeoutError", "ReadTimeout", "ReadTimeoutError", "timeout"}:
        detail = f"no answer within {settings.read_timeout:g} s (KERNEL_LOADER_READ_TIMEOUT)"
    elif "ConnectionResetError" in names or "reset by peer" in text:
        detail = "the server reset the connection"
    elif names & {"RemoteProtocolError", "ReadError", "ChunkedEncodingError", "ProtocolError", "IncompleteRead"}:
        detail = "the answer broke off midway"
    else:
        detail = "the connection failed"
    return f"is unreachable: {detail}"


def _missing_reason(exc: BaseException) -> str:
    status = _status(exc)
    if any(type(e).__name__ == "GatedRepoError" for e in _chain(exc)):
        return f"answered HTTP {status}: the repo is gated; accept its terms on the Hub and set HF_TOKEN"
    if status in (401, 403):
        return f"answered HTTP {status}: not found, or private (then set HF_TOKEN)"
    if status is not None:
        return f"answered HTTP {status}: not found"
    return "cannot be asked for this repo type by the installed huggingface_hub"  # the ValueError of old releases


def _failure(exc: BaseException, settings: HubSettings) -> str:
    """A failed call in words (for retry logs): a transport failure or the HTTP status."""
    status = _status(exc)
    return f"answered HTTP {status}" if status is not None and not _in_chain(exc, _is_transport) else _transport_reason(exc, settings)


def _classify(exc: BaseException, settings: HubSettings, what: str) -> BaseException | None:
    """The exception to raise for a failed call, or None when it is not ours to map."""
    unsafe = _unsafe_names(exc, settings, what)
    if unsafe is not None:
        return unsafe
    if isinstance(exc, _NotAListing):
        return HubUnreachable(settings.endpoint, f"answered with {exc}, not what the Hub API returns", what)
    if _in_chain(exc, _is_transport):
        return HubUnreachable(settings.endpoint, _transport_reason(exc, settings), what)
    if _is_missing(exc):
        return HubRepoMissing(settings.endpoint, _missing_reason(exc), what)
    return None


def _retryable(exc: BaseException) -> bool:
    return _in_chain(exc, _is_transport) or _is_server_error(exc)


def call(settings: HubSettings, what: str, fn: Callable[[], T]) -> T:
    """Run one Hub call with bounded, logged retries; failures come out as this module's errors.

    Raises:
        HubUnreachable: offline mode, or the call failed in transit ``retries + 1`` times.
        HubRepoMissing: the Hub answered that the repo, revision or file does not exist.
        UnsafeRepoContentError: huggingface_hub refused a listed name (``..``, an absolute path).
        Exception: anything else (e.g. an OSError of the cache), unchanged, for the caller.
    """
    if settings.offline:
        raise HubUnreachable(settings.endpoint, "is not used: HF_HUB_OFFLINE is set", what)
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if attempt < settings.retries and _retryable(exc) and not is_disk_full(exc):
                attempt += 1
                wait = min(0.25 * 2 ** (attempt - 1), 2.0)
                logger.warning("%s: the Hub at %s %s; retry %d of %d in %.2f s",
                               what, settings.endpoint, _failure(exc, settings), attempt, settings.retries, wait)
                time.sleep(wait)
                continue
            mapped = _classify(exc, settings, what)
            if mapped is None and _is_server_error(exc):
                mapped = HubUnreachable(settings.endpoint, f"is unreachable: it failed with HTTP {_status(exc)}, a server error", what)
            if mapped is None:
                raise
            raise mapped from exc


# -- the calls -----------------------------------------------------------------------------------


def _repo_types() -> tuple[str, ...]:
    # Older huggingface_hub releases cannot download repo type "kernel"; only ask for "model".
    from huggingface_hub import constants as hf_constants

    accepted = getattr(hf_constants, "REPO_TYPES_WITH_KERNEL", hf_constants.REPO_TYPES)
    return tuple(t for t in REPO_TYPES if t in accepted)


def _refs(settings: HubSettings, repo_type: str, repo_id: str) -> tuple[dict[str, str], dict[str, str]]:
    data, _ = _get_json(settings, _api_url(settings, repo_type, repo_id, "refs"))
    try:
        return tuple(  # type: ignore[return-value]
            {str(r["name"]): str(r["targetCommit"]) for r in data[kind]} for kind in ("branches", "tags")
        )
    except (KeyError, TypeError):
        raise _NotAListing("refs that lack the lists of branches and tags with their commits") from None


def remote_repo(repo_id: str, settings: HubSettings) -> RemoteRepo:
    """The repo's type and refs.

    Raises:
        HubUnreachable: the Hub cannot be reached (or offline mode), or answers with no refs listing.
        HubRepoMissing: no repo of type ``kernel`` or ``model`` with this id.
    """
    tried = []
    for repo_type in _repo_types():
        try:
            branches, tags = call(settings, f"the refs of {repo_id}", lambda: _refs(settings, repo_type, repo_id))
        except HubRepoMissing as exc:
            status = _status(exc.__cause__) if exc.__cause__ is not None else None
            tried.append(f"HTTP {status} as repo type {repo_type}" if status else f"nothing as repo type {repo_type}")
            continue
        return RemoteRepo(repo_id, repo_type, branches, tags)
    reason = f"answered {' and '.join(tried)}: repo not found; a private or gated repo also needs HF_TOKEN"
    raise HubRepoMissing(settings.endpoint, reason, repo_id)


def commit_exists(repo_id: str, repo_type: str, sha: str, settings: HubSettings) -> bool:
    """Whether ``sha`` is a commit of the repo.

    Raises:
        HubUnreachable: the Hub cannot be reached.
    """
    what = f"commit {sha} of {repo_id}"
    try:
        # no retries: olah answers 500 for an unknown sha, the Hub 404
        info, _ = call(settings._replace(retries=0), what,
                       lambda: _get_json(settings, _api_url(settings, repo_type, repo_id, "revision", sha)))
    except HubRepoMissing:
        return False
    except HubUnreachable as exc:
        if _is_server_error(exc.__cause__) if exc.__cause__ else False:
            return False
        raise
    return isinstance(info, dict) and info.get("sha") == sha


# A commit's tree never changes, so one listing per (endpoint, repo, sha) serves every caller in
# the process: the resolver, then `info`'s metadata reads and `lock`'s digests, with one GET.
_listings: dict[tuple[str, str, str, str], list[RemoteFile]] = {}
_listings_lock = threading.Lock()
_LISTINGS_KEPT = 64


def _remote_file(item: Any) -> RemoteFile | None:
    """One tree entry as a :class:`RemoteFile`; None for folders and Python caches."""
    if not isinstance(item, dict):
        raise _NotAListing("a tree entry that is not an object")
    if item.get("type") != "file":
        return None
    try:
        path, size, blob_id, lfs = str(item["path"]), item["size"], str(item["oid"]), item.get("lfs")
        if lfs is not None:
            size, lfs_sha = lfs["size"], str(lfs["oid"])
        else:
            lfs_sha = None
        size = int(size)
    except (KeyError, TypeError, ValueError):
        raise _NotAListing("a file entry without a usable path, size and object id") from None
    if "/__pycache__/" in path or path.endswith((".pyc", ".pyo")):
        return None
    return RemoteFile(path, size, lfs_sha, blob_id)


def list_files(repo_id: str, repo_type: str, sha: str, settings: HubSettings) -> list[RemoteFile]:
    """Every file under ``build/`` at ``sha`` with the sizes and digests the Hub lists (nothing downloaded).

    Raises:
        HubUnreachable: the Hub cannot be reached, or answers with something that is not a file listing.
    """
    from urllib.parse import quote

    key = (settings.endpoint, repo_type, repo_id, sha)
    if key in _listings:
        return list(_listings[key])
    url = _api_url(settings, repo_type, repo_id, "tree", quote(sha, safe=""), "build")

    def listing() -> list[RemoteFile]:
        items = _get_pages(settings, url, {"recursive": "true", "expand": "false"})
        return sorted(f for f in map(_remote_file, items) if f is not None)

    try:
        files = call(settings, f"the file list of {repo_id}@{sha[:12]}", listing)
    except HubRepoMissing:
        return []
    with _listings_lock:
        if len(_listings) >= _LISTINGS_KEPT:
            _listings.pop(next(iter(_listings)))
        _listings[key] = files
    return list(files)


def variants_of(files: list[RemoteFile]) -> list[str]:
    """Variant folder names (``build/<variant>/...``) present in a file listing."""
    return sorted({f.path.split("/")[1] for f in files if f.path.count("/") >= 2})


def list_variants(repo_id: str, repo_type: str, sha: str, settings: HubSettings) -> list[str]:
    """Variant folder names under ``build/`` at ``sha`` (empty if there is no build/).

    Raises:
        HubUnreachable: the Hub cannot be reached.
    """
    return variants_of(list_files(repo_id, repo_type, sha, settings))


def variant_file_digests(repo_id: str, repo_type: str, sha: str, variant: str, settings: HubSettings) -> dict[str, str]:
    """``{path relative to the variant: digest}`` from the Hub's listing (for lock files).

    LFS files give ``sha256:<hex>``, others their git blob id ``git-sha1:<hex>``.

    Raises:
        HubUnreachable: the Hub cannot be reached.
    """
    return lock_digests(list_files(repo_id, repo_type, sha, settings), variant)


def lock_digests(files: list[RemoteFile], variant: str) -> dict[str, str]:
    """``{path relative to the variant: digest}`` of one variant in a listing (the lock's per-file digests)."""
    prefix = f"build/{variant}/"
    return {
        f.path[len(prefix):]: f"sha256:{f.lfs_sha256}" if f.lfs_sha256 else f"git-sha1:{f.blob_id}"
        for f in files
        if f.path.startswith(prefix)
    }


def download_file(repo_id: str, repo_type: str, sha: str, path: str, cache_dir: Path, settings: HubSettings) -> Path:
    """Fetch one file of commit ``sha`` into the cache (huggingface_hub's layout); a cached one is not fetched again.

    Raises:
        HubUnreachable: the Hub cannot be reached, stalled, or died mid-transfer.
        HubRepoMissing: the file or commit does not exist.
        OSError: the cache cannot be written (read-only, disk full), unchanged for the caller.
    """
    from huggingface_hub import hf_hub_download

    _install_timeouts(settings)
    return Path(
        call(
            settings,
            f"{repo_id}@{sha[:12]}/{path}",
            lambda: hf_hub_download(
                repo_id,
                path,
                repo_type=repo_type,
                revision=sha,
                cache_dir=str(cache_dir),
                endpoint=settings.endpoint,
                token=settings.token,
                etag_timeout=settings.connect_timeout + settings.read_timeout,
            ),
        )
    )


def read_metadata(repo_id: str, repo_type: str, sha: str, variant: str, cache_dir: Path, settings: HubSettings) -> dict | None:
    """Fetch (into the cache) and parse ``build/<variant>/metadata.json``; None if absent.

    Raises:
        HubUnreachable: the Hub cannot be reached.
        KernelMetadataError: the file is malformed or too large (see :mod:`kernel_loader.metadata`).
        UnsafeRepoContentError: the mirror lists a name that would land outside the cache.
    """
    try:
        path = download_file(repo_id, repo_type, sha, f"build/{variant}/metadata.json", cache_dir, settings)
    except HubRepoMissing:
        return None
    except OSError as exc:
        if not (is_read_only(exc) or is_disk_full(exc)):
            raise
        # A read-only (shared) or full cache: read this small file without storing it.
        return fetch_metadata(repo_id, repo_type, sha, variant, settings)
    return metadata.variant_metadata(path.parent)


def fetch_metadata(repo_id: str, repo_type: str, sha: str, variant: str, settings: HubSettings) -> dict | None:
    """Parse ``build/<variant>/metadata.json`` of ``sha`` read straight from the Hub; nothing is written.

    For explanations (``explain``, ``variants``, ``info``): one GET, and none for a variant whose
    metadata.json the file listing does not have. None when absent.

    Raises:
        HubUnreachable: the Hub cannot be reached.
        KernelMetadataError: the file is malformed or too large (see :mod:`kernel_loader.metadata`).
    """
    path = f"build/{variant}/metadata.json"
    where = f"{repo_id}@{sha[:12]}/{path}"
    if path not in {f.path for f in list_files(repo_id, repo_type, sha, settings)}:
        return None
    url = _file_url(settings, repo_type, repo_id, sha, path)
    try:
        raw = call(settings, where, lambda: _get_capped(settings, url, metadata.MAX_METADATA_BYTES))
    except HubRepoMissing:
        return None
    return metadata.parse_metadata(raw, where).to_json()
