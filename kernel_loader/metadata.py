"""The one reader of a build variant's ``metadata.json``: size cap, depth guard, typed schema.

``metadata.json`` comes from whoever published the kernel, so it is read as untrusted input:

* at most :data:`MAX_METADATA_BYTES` (1 MiB) are read; a larger file is refused unread;
* nesting deeper than :data:`MAX_NESTING` is refused before :func:`json.loads` sees it, so no
  input reaches Python's recursion limit;
* each known field must have its documented type, else :class:`KernelMetadataError` names it;
* unknown fields are allowed (newer kernel builders add some) and dropped: only the parsed
  :class:`KernelMetadata` record is kept.

Reading metadata never imports anything.
"""

from __future__ import annotations

import itertools
import json
import keyword
import re
from dataclasses import dataclass
from pathlib import Path

from kernel_loader.errors import KernelMetadataError

#: Largest ``metadata.json`` accepted, in bytes (real ones are well under 1 KiB).
MAX_METADATA_BYTES = 1 << 20
#: Deepest nesting of JSON arrays/objects accepted (real files nest 3 deep).
MAX_NESTING = 32

# A JSON string; an unterminated one runs to the end of the text, which keeps the scan linear
# (the file is invalid JSON then, and json.loads says so).
_STRING = re.compile(r'"(?:[^"\\]|\\.?)*+(?:"|\Z)', re.S)
_BRACKETS = re.compile(r"[\[\]{}]")
# A PEP 508 distribution name, optionally followed by extras, a version specifier and a marker.
_VERSION_CLAUSE = r"(?:===|==|!=|<=|>=|~=|<|>)\s*[A-Za-z0-9.*+!_-]+"
_REQUIREMENT = re.compile(
    r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(\[[A-Za-z0-9._,\s-]*\])?\s*"
    rf"(\(?\s*(?:{_VERSION_CLAUSE}\s*(?:,\s*{_VERSION_CLAUSE}\s*)*)?\)?)\s*(;.*)?$",
    re.S,
)
_PACKAGE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class KernelMetadata:
    """The fields of ``metadata.json`` that kernel_loader uses, type-checked.

    ``name`` is the package folder name of a nested build (``-`` read as ``_``), ``python_depends``
    the distribution names with their specifiers, ``backend_type``/``archs`` what the build targets,
    ``upstream``/``source`` where the kernel comes from (shown by ``kernel-loader info``).
    """

    name: str | None = None
    id: str | None = None
    version: int | None = None
    license: str | None = None
    python_depends: tuple[str, ...] = ()
    backend_type: str | None = None
    archs: tuple[str, ...] = ()
    upstream: str | None = None
    source: str | None = None

    @property
    def package_name(self) -> str | None:
        """The Python package folder named by ``name`` (``my-kern`` -> ``my_kern``), or None."""
        return self.name.replace("-", "_") if self.name else None

    def to_json(self) -> dict:
        """The record in ``metadata.json`` spelling (what variant selection and deps read)."""
        out: dict = {"python-depends": list(self.python_depends)}
        for key, value in (("name", self.name), ("id", self.id), ("version", self.version), ("license", self.license),
                           ("upstream", self.upstream), ("source", self.source)):
            if value is not None:
                out[key] = value
        if self.backend_type is not None or self.archs:
            out["backend"] = {"type": self.backend_type, "archs": list(self.archs)}
        return out


def _nesting(text: str) -> int:
    # Strings are removed first so brackets inside them do not count; the rest is a running sum.
    brackets = _BRACKETS.findall(_STRING.sub("", text))
    steps = (1 if b in "[{" else -1 for b in brackets)
    return max(itertools.accumulate(steps, initial=0))


def _fail(where: str, field: str, problem: str) -> KernelMetadataError:
    return KernelMetadataError(
        f"{where}: field {field!r} {problem}. The kernel's metadata.json is malformed; ask its publisher "
        "to fix it, or pin an earlier revision that loads."
    )


def _optional_str(data: dict, key: str, where: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise _fail(where, key, f"must be a string, found {type(value).__name__}")
    return value


def parse_metadata(raw: bytes, where: str) -> KernelMetadata:
    """Parse the bytes of a ``metadata.json`` (``where`` names it in errors).

    Raises:
        KernelMetadataError: larger than :data:`MAX_METADATA_BYTES`, not UTF-8 JSON, nested deeper
            than :data:`MAX_NESTING`, not an object, or a known field of the wrong type.
    """
    if len(raw) > MAX_METADATA_BYTES:
        raise KernelMetadataError(
            f"{where} is larger than {MAX_METADATA_BYTES} bytes; metadata.json files are small, so it is refused unread."
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KernelMetadataError(f"{where} is not UTF-8 ({exc}).") from None
    if _nesting(text) > MAX_NESTING:
        raise KernelMetadataError(f"{where} nests arrays/objects deeper than {MAX_NESTING} levels; refused.")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise KernelMetadataError(f"{where} is not valid JSON ({exc}).") from None
    if not isinstance(data, dict):
        raise KernelMetadataError(f"{where} must hold a JSON object, found {type(data).__name__}.")
    name = _optional_str(data, "name", where)
    if name is not None and (not _PACKAGE_NAME.match(name) or keyword.iskeyword(name.replace("-", "_"))):
        raise _fail(where, "name", f"must be a plain package name (letters, digits, '_' or '-'), found {name!r}")
    ident = _optional_str(data, "id", where)
    if ident is not None and not ident.isidentifier():
        raise _fail(where, "id", f"must be a Python identifier, found {ident!r}")
    version = data.get("version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise _fail(where, "version", f"must be an integer, found {type(version).__name__}")
    depends = data.get("python-depends")
    if depends is None:
        depends = []
    if not isinstance(depends, list):
        raise _fail(where, "python-depends", f"must be a list of requirement strings, found {type(depends).__name__}")
    for dep in depends:
        if not isinstance(dep, str) or not _REQUIREMENT.match(dep):
            raise _fail(where, "python-depends", f"holds {dep!r}, which is not a requirement such as 'einops>=0.7'")
    backend = data.get("backend")
    backend_type, archs = None, []
    if backend is not None:
        if not isinstance(backend, dict):
            raise _fail(where, "backend", f"must be an object, found {type(backend).__name__}")
        backend_type = _optional_str(backend, "type", f"{where} backend")
        archs = backend.get("archs")
        if archs is None:
            archs = []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise _fail(where, "backend.archs", "must be a list of strings such as '8.0' or 'gfx942'")
    return KernelMetadata(
        name=name,
        id=ident,
        version=version,
        license=_optional_str(data, "license", where),
        upstream=_optional_str(data, "upstream", where),
        source=_optional_str(data, "source", where),
        python_depends=tuple(depends),
        backend_type=backend_type,
        archs=tuple(archs),
    )


def read_metadata(path: Path) -> KernelMetadata | None:
    """Read and check one ``metadata.json``; None when the file does not exist.

    At most :data:`MAX_METADATA_BYTES` + 1 bytes are read, whatever the file's size.

    Raises:
        KernelMetadataError: see :func:`parse_metadata`; also when ``path`` is not a regular file.
    """
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_METADATA_BYTES + 1)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise KernelMetadataError(f"{path} is a folder, not a metadata.json file.") from None
    except OSError as exc:
        raise KernelMetadataError(f"Cannot read {path}: {exc}.") from None
    return parse_metadata(raw, str(path))


def requirement_name(requirement: str) -> str:
    """The distribution name of a requirement string already accepted by :func:`parse_metadata`."""
    match = _REQUIREMENT.match(requirement)
    return match[1] if match else requirement.strip()


def variant_metadata(variant_dir: Path) -> dict | None:
    """``read_metadata(variant_dir / "metadata.json")`` in ``metadata.json`` spelling, or None.

    Raises:
        KernelMetadataError: see :func:`parse_metadata`.
    """
    meta = read_metadata(variant_dir / "metadata.json")
    return meta.to_json() if meta is not None else None
