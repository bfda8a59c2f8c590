"""Import one build variant folder as a uniquely named module, and nothing from outside it.

The module name is derived from (repo, sha, variant), so two revisions of one repo live side by
side in one process. An import that fails leaves nothing behind in ``sys.modules``.

Containment: every path handed to Python (the variant folder, the package folder, each module
file, including submodules found later) is resolved first and must lie inside its own snapshot.
In the Hugging Face cache layout that means links from ``snapshots/<sha>/…`` into the same repo's
``blobs/``; a local folder (``LOCAL_KERNELS``, ``get_local_kernel``) is resolved once and must
then hold everything itself. Anything else is refused with ``KernelIntegrityError`` before import.

Integrity: a cached variant with a completion record (written at download) is checked against
it before import (:func:`kernel_loader.integrity.verify_files`).

Locking: each module has its own lock, so a kernel whose ``__init__`` hangs blocks only callers
of that same kernel; after ``KERNEL_LOADER_IMPORT_WARN_S`` seconds a warning names it.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import marshal
import os
import re
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, ModuleType

from kernel_loader import cache, constants, integrity, metadata
from kernel_loader.errors import KernelImportError, KernelIntegrityError

logger = logging.getLogger("kernel_loader")

_loaded: dict[str, ModuleType] = {}
_bounds: dict[str, "Bounds"] = {}  # top-level module name of an imported kernel -> where its files may be
_module_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()  # held only to look up or create a module's lock


@dataclass(frozen=True)
class Bounds:
    """Where a kernel's resolved paths may lie: folders in ``folders``, files there or in ``blobs``.

    ``snapshot`` is the snapshot folder of a cached kernel (None for a local folder); ``record``
    its completion record's path.
    """

    folders: Path
    blobs: Path | None = None
    snapshot: Path | None = None
    record: Path | None = None

    def refuse(self, path: Path, is_dir: bool) -> str | None:
        """Why ``path`` may not be used (None: it may)."""
        real = Path(os.path.realpath(path))
        inside = real == self.folders or real.is_relative_to(self.folders)
        if not inside and not is_dir and self.blobs is not None:
            inside = real.parent == self.blobs
        if inside:
            return None
        link = _outermost_link(path, self.snapshot or self.folders)
        allowed = f"{self.folders}" + (f" or {self.blobs}" if self.blobs is not None and not is_dir else "")
        return f"{link} is a link to {os.path.realpath(link)}, outside {allowed}" if link else f"{path} lies outside {allowed}"


def _outermost_link(path: Path, top: Path) -> Path | None:
    """The link nearest to ``top`` (the snapshot) on the way down to ``path``, for the message."""
    for candidate in reversed((path, *path.parents)):
        if (candidate == top or candidate.is_relative_to(top)) and candidate.is_symlink():
            return candidate
    return None


def bounds_for(variant_dir: Path) -> Bounds:
    """The bounds of a variant folder: its snapshot (cache layout) or its own resolved folder."""
    variant_dir = Path(os.path.abspath(variant_dir))
    build, snapshot = variant_dir.parent, variant_dir.parent.parent
    if build.name == "build" and snapshot.parent.name == "snapshots" and cache.is_sha(snapshot.name):
        repo = Path(os.path.realpath(snapshot.parent.parent))
        record = integrity.record_path(repo, snapshot.name, variant_dir.name)
        return Bounds(repo / "snapshots" / snapshot.name, repo / "blobs", snapshot, record)
    return Bounds(Path(os.path.realpath(variant_dir)))


def check_contained(variant_dir: Path, bounds: Bounds, what: str) -> None:
    """Refuse a variant whose folder, or any file or folder inside it, resolves outside ``bounds``.

    Raises:
        KernelIntegrityError: naming the link and where it points.
    """
    problems = []
    if not variant_dir.is_dir():
        problems.append(f"{variant_dir} is not a folder")
    elif (why := bounds.refuse(variant_dir, True)) is not None:
        problems.append(why)
    else:
        seen: set[str] = set()
        for top, dirs, files in os.walk(variant_dir, followlinks=True):
            real = os.path.realpath(top)
            if real in seen:  # a link back into an ancestor; its contents are checked once
                dirs[:] = []
                continue
            seen.add(real)
            for name in dirs:
                if (why := bounds.refuse(Path(top) / name, True)) is not None:
                    problems.append(why)
            dirs[:] = [d for d in dirs if bounds.refuse(Path(top) / d, True) is None]
            for name in files:
                if (why := bounds.refuse(Path(top) / name, False)) is not None:
                    problems.append(why)
    if problems:
        raise KernelIntegrityError(
            f"{what}: refused before import: {'; '.join(problems[:5])}{' …' if len(problems) > 5 else ''}. A kernel "
            "may only run files inside its own snapshot; the cache was altered. Delete the affected folder and fetch "
            "the kernel again with `kernel-loader download <org/name>@<sha>`."
        )


class _KernelSourceLoader(importlib.machinery.SourceFileLoader):
    """Loads a kernel's Python files with bytecode kept in the state folder, not beside the source.

    Python would write ``__pycache__`` into the kernel's folder, i.e. into the cache, which may be
    a shared read-only filesystem (where every load would then recompile). Keyed by path, size,
    mtime, ctime and interpreter, the compiled code is reused across processes.
    """

    def get_code(self, fullname: str) -> CodeType:
        source_path = self.get_filename(fullname)
        st = os.stat(source_path)
        tag = sys.implementation.cache_tag or "py"
        key = hashlib.sha256(
            f"{os.path.abspath(source_path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}|{tag}".encode()
        ).hexdigest()
        cached = constants.state_dir() / "bytecode" / tag / key[:2] / f"{key}.bin"
        try:
            return marshal.loads(cached.read_bytes())
        except (OSError, ValueError, EOFError, TypeError):
            pass
        code = self.source_to_code(self.get_data(source_path), source_path)
        if sys.dont_write_bytecode:  # PYTHONDONTWRITEBYTECODE / -B: the user asked for no bytecode files
            return code
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cached.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as fh:
                fh.write(marshal.dumps(code))
            os.replace(tmp, cached)
        except OSError:
            pass  # no writable state folder: compile every time, still write nothing to the cache
        return code


class _KernelFinder:
    """Routes the submodules of imported kernels through :class:`_KernelSourceLoader`.

    Each submodule's file is checked against its kernel's bounds when it is found (a file may be
    swapped for a link after the up-front check); bytecode-only modules are refused outright.
    """

    @classmethod
    def find_spec(cls, fullname: str, path=None, target=None):  # noqa: ANN001 - importlib protocol
        bounds = _bounds.get(fullname.partition(".")[0]) if "." in fullname else None
        if bounds is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not spec.origin:
            return spec
        what = f"kernel module {fullname}"
        if isinstance(spec.loader, importlib.machinery.SourcelessFileLoader):
            raise KernelIntegrityError(f"{what}: {spec.origin} is bytecode without source; kernels are imported from source only.")
        why = bounds.refuse(Path(spec.origin), False)
        if why is not None:
            raise KernelIntegrityError(f"{what}: refused: {why}.")
        if isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            spec.loader = _KernelSourceLoader(fullname, spec.origin)
        return spec


def _install_finder() -> None:
    if _KernelFinder not in sys.meta_path:
        sys.meta_path.insert(0, _KernelFinder)


def module_name_for(repo_id: str, sha: str | None, variant: str, path: Path | None = None) -> str:
    """A valid, flat module name unique per (repo, sha, variant); local folders key on their path."""
    key = sha[:12] if sha else hashlib.sha256(str(path).encode()).hexdigest()[:12]
    raw = f"_kernel_loader__{repo_id.replace('/', '__')}__{key}__{variant}"
    return re.sub(r"\W", "_", raw)


def package_init(variant_dir: Path, what: str = "<org/name>") -> Path:
    """The ``__init__.py`` of a variant: flattened (in the folder) or nested (``<pkg>/__init__.py``).

    A nested package is the one ``metadata.json`` names (a plain identifier), else the only
    folder with an ``__init__.py``.

    Raises:
        KernelImportError: neither layout is present.
        KernelMetadataError: ``metadata.json`` is malformed (e.g. ``name`` is a path).
    """
    flat = variant_dir / "__init__.py"
    if flat.is_file():
        return flat
    meta = metadata.read_metadata(variant_dir / "metadata.json")
    candidates = []
    if meta is not None and meta.package_name:
        candidates.append(variant_dir / meta.package_name / "__init__.py")
    candidates += sorted(variant_dir.glob("*/__init__.py"))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise KernelImportError(
        f"No Python package for {what} in {variant_dir}: expected {variant_dir.name}/__init__.py or "
        f"{variant_dir.name}/<package>/__init__.py. The download may be incomplete: "
        f"re-fetch it with `kernel-loader download {what.split()[0].split('@')[0]}`."
    )


def _lock_for(module_name: str) -> threading.Lock:
    with _locks_guard:
        return _module_locks.setdefault(module_name, threading.Lock())


def import_variant(variant_dir: Path, module_name: str, what: str, warn_after: float | None = None) -> ModuleType:
    """Import the package in ``variant_dir`` as ``module_name`` (once per process).

    ``what`` names the kernel in messages (e.g. ``"org/name@sha variant torch-universal"``);
    ``warn_after`` is how many seconds an import may run before a warning names it (default
    :func:`kernel_loader.constants.import_warn_seconds`). Concurrent callers of one module share
    one import; other kernels import meanwhile.

    Raises:
        KernelIntegrityError: a path resolves outside the snapshot, or the files differ from the
            download's completion record.
        KernelMetadataError: ``metadata.json`` is malformed.
        KernelImportError: no package found, or executing it raised (``SystemExit`` included; the
            cause is chained and the half-imported module and its submodules are removed from
            ``sys.modules``). ``KeyboardInterrupt`` propagates unchanged.
    """
    module = _loaded.get(module_name)
    if module is not None:
        return module
    with _lock_for(module_name):
        module = _loaded.get(module_name)
        if module is not None:
            return module
        return _import_locked(Path(variant_dir), module_name, what, warn_after)


def _verify_record(bounds: Bounds, what: str) -> None:
    if bounds.record is None or bounds.snapshot is None or not bounds.record.is_file():
        return
    record = integrity.read_record(bounds.record)
    integrity.verify_files(bounds.snapshot, record.files, memo_dir=integrity.default_memo_dir(), what=what)


def _import_locked(variant_dir: Path, module_name: str, what: str, warn_after: float | None) -> ModuleType:
    bounds = bounds_for(variant_dir)
    check_contained(variant_dir, bounds, what)
    _verify_record(bounds, what)
    init = package_init(variant_dir, what)
    _install_finder()
    spec = importlib.util.spec_from_file_location(
        module_name,
        init,
        loader=_KernelSourceLoader(module_name, str(init)),
        submodule_search_locations=[str(init.parent)],
    )
    if spec is None or spec.loader is None:
        raise KernelImportError(f"Cannot build an import spec for {what} from {init}.")
    module = importlib.util.module_from_spec(spec)
    delay = warn_after if warn_after is not None else constants.import_warn_seconds()
    timer = threading.Timer(
        delay,
        logger.warning,
        ("Importing %s from %s has not finished after %.0f s; other kernels still load meanwhile. "
         "Set KERNEL_LOADER_IMPORT_WARN_S to change when this is reported.", what, init.parent, delay),
    )
    timer.daemon = True
    _bounds[module_name] = bounds
    sys.modules[module_name] = module
    timer.start()
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        for name in [n for n in sys.modules if n == module_name or n.startswith(module_name + ".")]:
            del sys.modules[name]
        _bounds.pop(module_name, None)
        if isinstance(exc, (KeyboardInterrupt, KernelIntegrityError)):
            raise
        kind = f"SystemExit({exc.code!r}) (the kernel tried to end the program)" if isinstance(exc, SystemExit) else type(exc).__name__
        raise KernelImportError(
            f"Importing {what} from {init.parent} failed: {kind}: {exc}. "
            "The build may not match this machine or may need a dependency; see "
            f"`kernel-loader explain {what.split()[0].split('@')[0]}`."
        ) from exc
    finally:
        timer.cancel()
    _loaded[module_name] = module
    return module
