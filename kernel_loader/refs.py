"""Kernel ids: ``[wrapper|]org/name[@revision][:function]`` parsed into a :class:`KernelRef`.

The grammar is deliberately narrow: a repo id becomes a folder name in the cache, so anything
that could escape it (``..``, absolute paths, separators, control characters) is refused here,
before any other module sees the id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kernel_loader.errors import InvalidArgumentError, InvalidKernelRefError, KernelFunctionNotFoundError

MAX_REF_LENGTH = 256
_MAX_PART = 96

# Hub repo id parts: start alphanumeric, then letters, digits, '.', '_', '-'.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,%d})" % (_MAX_PART - 1)
_REVISION = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,%d})" % (MAX_REF_LENGTH - 1)
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_WRAPPER = r"[A-Za-z_][A-Za-z0-9_-]*"

_REF_RE = re.compile(
    rf"^(?:(?P<wrapper>{_WRAPPER})\|)?"
    rf"(?P<org>{_PART})/(?P<name>{_PART})"
    rf"(?:@(?P<revision>{_REVISION}))?"
    rf"(?::(?P<function>{_IDENT}))?$"
)
# "org/name..." shape: one slash with something on each side, no whitespace.
_SHAPE_RE = re.compile(r"^(?:[^|/\s]+\|)?[^/\s@:|]+/\S+$")

ACCEPTED_FORMS = (
    "org/name, org/name@revision, org/name:function, org/name@revision:function, "
    "each optionally prefixed by 'wrapper|' (e.g. 'paged|org/name')"
)


def looks_like_kernel_ref(text: object) -> bool:
    """Whether ``text`` has the ``org/name...`` shape of a kernel id.

    Cheap and permissive: it tells a kernel id apart from a plain backend name such as
    ``"sdpa"``. A text that looks like a kernel id may still be invalid; :meth:`KernelRef.parse`
    raises :class:`InvalidKernelRefError` for it.
    """
    return isinstance(text, str) and len(text) <= 4 * MAX_REF_LENGTH and bool(_SHAPE_RE.match(text))


def _invalid(text: object, why: str) -> InvalidKernelRefError:
    shown = repr(text) if not isinstance(text, str) or len(text) <= 120 else repr(text[:120] + "...")
    return InvalidKernelRefError(f"Invalid kernel id {shown}: {why}. Accepted forms: {ACCEPTED_FORMS}.")


@dataclass(frozen=True)
class KernelRef:
    """A parsed kernel id.

    ``repo_id`` is ``"org/name"``; ``revision`` a branch, tag or commit sha (None: pick a
    version); ``function`` an attribute of the kernel module to use (None: the module itself);
    ``wrapper`` a named adapter applied by the attention layer (e.g. ``"paged"``).
    """

    repo_id: str
    org: str
    name: str
    revision: str | None = None
    function: str | None = None
    wrapper: str | None = None

    @classmethod
    def parse(cls, text: str) -> KernelRef:
        """Parse a kernel id.

        Raises:
            InvalidKernelRefError: ``text`` is not a string of one of the accepted forms, is
                longer than 256 characters, contains whitespace or control characters, or has a
                part that is empty, ``..``-laden, or could address a path outside the cache.
        """
        if not isinstance(text, str):
            raise _invalid(text, f"expected a string, got {type(text).__name__}")
        if not text:
            raise _invalid(text, "it is empty")
        if len(text) > MAX_REF_LENGTH:
            raise _invalid(text, f"it is {len(text)} characters long (at most {MAX_REF_LENGTH})")
        if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in text):
            raise _invalid(text, "it contains whitespace or control characters")
        if ".." in text:
            raise _invalid(text, "'..' is not allowed")
        if text.startswith(("/", "\\", "~")) or re.match(r"^[A-Za-z]:[\\/]", text) or "\\" in text:
            raise _invalid(text, "it looks like a file path; use get_local_kernel(path) for local folders")
        match = _REF_RE.match(text)
        if match is None:
            raise _invalid(text, _diagnose(text))
        org, name = match["org"], match["name"]
        for part in (org, name):
            if part.endswith(".") or "--" in part:
                raise _invalid(text, f"repo id part {part!r} may not end with '.' or contain '--'")
        return cls(
            repo_id=f"{org}/{name}",
            org=org,
            name=name,
            revision=match["revision"],
            function=match["function"],
            wrapper=match["wrapper"],
        )

    @classmethod
    def from_parts(
        cls, repo_id: str, revision: str | None = None, function: str | None = None, wrapper: str | None = None
    ) -> KernelRef:
        """Build a ref from separate arguments, validating each part as :meth:`parse` does.

        Raises:
            InvalidKernelRefError: a part is invalid, or ``repo_id`` already carries a
                revision that conflicts with ``revision``.
        """
        ref = cls.parse(repo_id)
        if revision is not None and not isinstance(revision, str):
            raise InvalidArgumentError(f"revision={revision!r} is not a branch, tag or sha: give a string")
        if revision is not None:
            if ref.revision is not None and ref.revision != revision:
                raise _invalid(repo_id, f"it names revision {ref.revision!r} but revision={revision!r} was also given")
            ref = cls.parse(str(cls(ref.repo_id, ref.org, ref.name, revision, ref.function, ref.wrapper)))
        if function is not None or wrapper is not None:
            ref = cls.parse(
                str(cls(ref.repo_id, ref.org, ref.name, ref.revision, function or ref.function, wrapper or ref.wrapper))
            )
        return ref

    def with_revision(self, revision: str | None) -> KernelRef:
        """The same ref pinned to ``revision`` (validated)."""
        return KernelRef.parse(str(KernelRef(self.repo_id, self.org, self.name, revision, self.function, self.wrapper)))

    def __str__(self) -> str:
        text = self.repo_id
        if self.wrapper:
            text = f"{self.wrapper}|{text}"
        if self.revision:
            text += f"@{self.revision}"
        if self.function:
            text += f":{self.function}"
        return text


def _diagnose(text: str) -> str:
    body = text.split("|", 1)[1] if "|" in text else text
    if text.count("|") > 1:
        return "only one 'wrapper|' prefix is allowed"
    if body.count("/") != 1:
        return f"expected exactly one '/' between org and name, found {body.count('/')}"
    if body.count(":") > 1:
        return "expected at most one ':' before the function name"
    if body.count("@") > 1:
        return "expected at most one '@' before the revision"
    org, rest = body.split("/", 1)
    if not org:
        return "the org part is empty"
    name = re.split(r"[@:]", rest, maxsplit=1)[0]
    if not name:
        return "the name part is empty"
    if "@" in rest and not rest.split("@", 1)[1].split(":", 1)[0]:
        return "the revision after '@' is empty"
    if rest.endswith(":"):
        return "the function name after ':' is empty"
    return "it contains characters that are not allowed (use letters, digits, '.', '_', '-')"


def check_version(version: object) -> int | None:
    """``version`` as given when it is None or a non-negative int (the N of branch ``vN``).

    Raises:
        InvalidArgumentError: a bool, a negative number, or anything but an int.
    """
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, int):
        raise InvalidArgumentError(
            f"version={version!r} is not a version number: give a whole number N >= 0 (branch vN), e.g. version=1"
        )
    if version < 0:
        raise InvalidArgumentError(f"version={version} is negative: give a whole number N >= 0 (branch vN)")
    return version


def check_backend(backend: object, machine: object | None = None) -> str | None:
    """``backend`` when None or one of the known backends (and, given ``machine``, usable there).

    Raises:
        InvalidArgumentError: unknown backend, or one this machine does not have; the message
            lists the known backends and this machine's.
    """
    from kernel_loader.machine import BACKENDS

    if backend is None:
        return None
    if not isinstance(backend, str) or backend not in BACKENDS:
        have = f" (this machine has {machine.available_backends()})" if machine is not None else ""  # type: ignore[attr-defined]
        raise InvalidArgumentError(f"backend={backend!r} is not a known backend; known: {', '.join(BACKENDS)}{have}")
    if machine is not None:
        machine.with_backend(backend)  # type: ignore[attr-defined]
    return backend


def check_function(module: object, ref: KernelRef) -> None:
    """Check that the module of ``ref`` has the attribute named by ``ref.function``.

    Raises:
        KernelFunctionNotFoundError: it does not; the message lists the public names it has.
    """
    if ref.function is None or hasattr(module, ref.function):
        return
    names = sorted(n for n in dir(module) if not n.startswith("_"))
    shown = ", ".join(names[:40]) + (f", ... ({len(names)} in all)" if len(names) > 40 else "")
    raise KernelFunctionNotFoundError(f"{ref.repo_id} has no function {ref.function!r}; it has: {shown or 'no public names'}")


def check_path(value: object, name: str) -> None:
    """Check that ``value`` can name a file or folder (a ``str`` or ``os.PathLike``).

    Raises:
        InvalidArgumentError: it cannot.
    """
    import os

    if not isinstance(value, (str, os.PathLike)) or (isinstance(value, str) and not value):
        raise InvalidArgumentError(f"{name}={value!r} is not a path: give a non-empty str or pathlib.Path")
    raw = os.fspath(value)
    if ("\x00" if isinstance(raw, str) else b"\x00") in raw:  # the OS would refuse it with ValueError
        raise InvalidArgumentError(f"{name}={value!r} is not a path: it holds a NUL character")


def version_branch(name: str) -> int | None:
    """``N`` for a ``vN`` version branch name (``"v2"`` -> 2), else None; the one place this is parsed."""
    if len(name) > 1 and name[0] == "v" and name[1:].isdigit():
        return int(name[1:])
    return None
