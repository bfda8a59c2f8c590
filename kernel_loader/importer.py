"""Import one build variant folder as a uniquely named module.

The module name is derived from (repo, sha, variant), so two revisions of one repo live side by
side in one process. An import that fails leaves nothing behind in ``sys.modules``.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import marshal
import os
import re
import sys
import tempfile
import threading
from pathlib import Path
from types import CodeType, ModuleType

from kernel_loader import constants
from kernel_loader.errors import KernelImportError

_loaded: dict[str, ModuleType] = {}
_roots: set[str] = set()  # top-level module names of imported kernels
_lock = threading.RLock()  # one import at a time, so concurrent first calls share one module


class _KernelSourceLoader(importlib.machinery.SourceFileLoader):
    """Loads a kernel's Python files with bytecode kept in the state folder, not beside the source.

    Python would write ``__pycache__`` into the kernel's folder, i.e. into the cache, which may be
    a shared read-only filesystem (where every load would then recompile). Keyed by path, size,
    mtime and interpreter, the compiled code is reused across processes.
    """

    def get_code(self, fullname: str) -> CodeType:
        source_path = self.get_filename(fullname)
        st = os.stat(source_path)
        tag = sys.implementation.cache_tag or "py"
        key = hashlib.sha256(f"{os.path.abspath(source_path)}|{st.st_size}|{st.st_mtime_ns}|{tag}".encode()).hexdigest()
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
    """Routes the submodules of imported kernels through :class:`_KernelSourceLoader`."""

    @classmethod
    def find_spec(cls, fullname: str, path=None, target=None):  # noqa: ANN001 - importlib protocol
        if fullname.partition(".")[0] not in _roots or "." not in fullname:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader) and spec.origin:
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

    Raises:
        KernelImportError: neither layout is present.
    """
    flat = variant_dir / "__init__.py"
    if flat.is_file():
        return flat
    candidates = []
    try:
        meta = json.loads((variant_dir / "metadata.json").read_text())
        name = str(meta.get("name", "")).replace("-", "_")
        if name:
            candidates.append(variant_dir / name / "__init__.py")
    except (OSError, ValueError, AttributeError):
        pass
    candidates += sorted(variant_dir.glob("*/__init__.py"))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise KernelImportError(
        f"No Python package for {what} in {variant_dir}: expected {variant_dir.name}/__init__.py or "
        f"{variant_dir.name}/<package>/__init__.py. The download may be incomplete: "
        f"re-fetch it with `kernel-loader download {what.split()[0].split('@')[0]}`."
    )


def import_variant(variant_dir: Path, module_name: str, what: str) -> ModuleType:
    """Import the package in ``variant_dir`` as ``module_name`` (once per process).

    ``what`` names the kernel in error messages (e.g. ``"org/name@sha variant torch-universal"``).

    Raises:
        KernelImportError: no package found, or executing it raised (the cause is chained and
            the half-imported module and its submodules are removed from ``sys.modules``).
    """
    module = _loaded.get(module_name)
    if module is not None:
        return module
    with _lock:
        module = _loaded.get(module_name)
        if module is not None:
            return module
        return _import_locked(variant_dir, module_name, what)


def _import_locked(variant_dir: Path, module_name: str, what: str) -> ModuleType:
    init = package_init(variant_dir, what)
    _install_finder()
    _roots.add(module_name)
    spec = importlib.util.spec_from_file_location(
        module_name,
        init,
        loader=_KernelSourceLoader(module_name, str(init)),
        submodule_search_locations=[str(init.parent)],
    )
    if spec is None or spec.loader is None:
        raise KernelImportError(f"Cannot build an import spec for {what} from {init}.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        for name in [n for n in sys.modules if n == module_name or n.startswith(module_name + ".")]:
            del sys.modules[name]
        _roots.discard(module_name)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise KernelImportError(
            f"Importing {what} from {init.parent} failed: {type(exc).__name__}: {exc}. "
            "The build may not match this machine or may need a dependency; see "
            f"`kernel-loader explain {what.split()[0].split('@')[0]}`."
        ) from exc
    _loaded[module_name] = module
    return module
