"""Build variants: parse ``build/<variant>`` names, judge each against a :class:`Machine`, rank.

Every variant gets a :class:`VariantDecision` with a reason, accepted or not, so errors and
``kernel-loader explain`` can say exactly why a build was passed over. GPU archs declared in a
variant's ``metadata.json`` are checked here too, before anything is imported: a build for the
wrong GPU is rejected with a reason instead of crashing the process.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, NamedTuple

from kernel_loader.machine import Machine
from kernel_loader.resolution import VariantDecision

NOARCH_BACKENDS = ("universal", "cuda", "rocm", "xpu", "cpu", "metal", "npu")
_BACKEND_RE = re.compile(r"^(?:(?P<cpu>cpu)|(?P<metal>metal)|cu(?P<cu>\d{1,6})|rocm(?P<rocm>\d{1,6})|xpu(?P<xpu>\d{1,8}))$")


class Variant(NamedTuple):
    """A parsed variant name.

    ``kind``: ``"torch"`` (one torch minor), ``"stable-abi"`` (any torch ≥ ``torch_version``),
    ``"noarch"`` (Python only) or ``"unknown"`` (a name this version cannot read).
    """

    name: str
    kind: str
    torch_version: str | None = None
    cxx11_abi: bool | None = None
    backend: str | None = None
    backend_version: str | None = None
    cpu_arch: str | None = None
    os: str | None = None


def _split_version(digits: str, major_len: int | None = None) -> str:
    # "128" -> "12.8", "130" -> "13.0", "64" -> "6.4": the last digit is the minor version,
    # matching how the `kernels` package reads these names.
    if major_len is not None:
        return f"{int(digits[:major_len])}.{int(digits[major_len:] or 0)}"
    return f"{int(digits[:-1])}.{int(digits[-1])}"


def _parse_backend(text: str) -> tuple[str, str | None] | None:
    match = _BACKEND_RE.match(text)
    if match is None:
        return None
    if match["cpu"]:
        return "cpu", None
    if match["metal"]:
        return "metal", None
    if match["cu"]:
        return "cuda", _split_version(match["cu"]) if len(match["cu"]) >= 2 else None
    if match["rocm"]:
        return "rocm", _split_version(match["rocm"]) if len(match["rocm"]) >= 2 else None
    # xpu names carry a year: xpu20251 -> 2025.1
    return "xpu", _split_version(match["xpu"], 4) if len(match["xpu"]) >= 5 else None


def parse_variant(name: str) -> Variant:
    """Parse a variant folder name; unreadable names give ``kind="unknown"`` (never raise)."""
    parts = name.split("-")
    unknown = Variant(name, "unknown")
    if parts[0] == "torch" and len(parts) == 2:
        return Variant(name, "noarch", backend=parts[1]) if parts[1] in NOARCH_BACKENDS else unknown
    match = re.fullmatch(r"torch-stable-abi(\d)(\d{1,4})", "-".join(parts[:3]))
    if match and len(parts) == 6:
        framework = Variant(name, "stable-abi", torch_version=f"{match[1]}.{int(match[2])}")
        rest = parts[3:]
    else:
        match = re.fullmatch(r"torch(\d)(\d{1,4})", parts[0])
        if match is None:
            return unknown
        abi = None
        rest = parts[1:]
        if rest and rest[0] in ("cxx11", "cxx98"):
            abi = rest[0] == "cxx11"
            rest = rest[1:]
        framework = Variant(name, "torch", torch_version=f"{match[1]}.{int(match[2])}", cxx11_abi=abi)
        if len(rest) != 3:
            return unknown
    backend = _parse_backend(rest[0])
    if backend is None:
        return unknown
    return Variant(
        name,
        framework.kind,
        torch_version=framework.torch_version,
        cxx11_abi=framework.cxx11_abi,
        backend=backend[0],
        backend_version=backend[1],
        cpu_arch=rest[1],
        os=rest[2],
    )


def _vtuple(version: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".")) if version else ()


def _judge(v: Variant, m: Machine) -> tuple[bool, str]:
    """(accepted, reason) for one variant on one machine, ignoring metadata."""
    if v.kind == "unknown":
        return False, "unrecognised variant name (built for a newer loader?)"
    if v.kind == "noarch":
        if v.backend == "universal":
            return True, "Python-only build for any backend"
        if v.backend == m.backend or (v.backend == "npu" and m.backend == "npu"):
            return True, f"Python-only build for {v.backend}"
        return False, f"Python-only build for {v.backend}, this machine's backend is {m.backend}"
    if v.cpu_arch != m.cpu_arch:
        return False, f"built for CPU {v.cpu_arch}, this machine is {m.cpu_arch}"
    if v.os != m.os:
        return False, f"built for OS {v.os}, this machine runs {m.os}"
    if m.torch_version is None:
        return False, "needs torch, which is not installed"
    if v.kind == "torch":
        if v.torch_version != m.torch_version:
            return False, f"built for torch {v.torch_version}, this machine has torch {m.torch_version}"
        if v.cxx11_abi is not None and m.cxx11_abi is not None and v.cxx11_abi != m.cxx11_abi:
            want = "cxx11" if v.cxx11_abi else "pre-cxx11"
            have = "cxx11" if m.cxx11_abi else "pre-cxx11"
            return False, f"built for the {want} C++ ABI, this torch uses the {have} ABI"
    elif _vtuple(v.torch_version) > _vtuple(m.torch_version):
        return False, f"stable-ABI build needs torch >= {v.torch_version}, this machine has torch {m.torch_version}"
    if v.backend != m.backend:
        have = f"{m.backend} {m.backend_version}" if m.backend_version else m.backend
        return False, f"built for {v.backend}, this machine's backend is {have}"
    if v.backend == "cuda":
        build, runtime = _vtuple(v.backend_version), _vtuple(m.backend_version)
        if not build or not runtime or build[0] != runtime[0] or build[1] > runtime[1]:
            return False, (
                f"built for CUDA {v.backend_version}, this machine has CUDA {m.backend_version} "
                "(needs the same major and a minor <= the runtime's)"
            )
    elif v.backend in ("rocm", "xpu") and v.backend_version != m.backend_version:
        return False, f"built for {v.backend} {v.backend_version}, this machine has {v.backend} {m.backend_version}"
    fw = f"torch {v.torch_version}" if v.kind == "torch" else f"stable ABI, torch >= {v.torch_version}"
    be = f"{v.backend} {v.backend_version}" if v.backend_version else v.backend
    return True, f"{fw}, {be}, {v.cpu_arch}-{v.os}"


def _sort_key(v: Variant) -> tuple:
    # Preference, as in the `kernels` package: stable-ABI (newest first), then torch-specific
    # (untagged before ABI-tagged), then Python-only for this backend, then universal; within a
    # group the newest backend version first.
    backend_rank = tuple(-x for x in _vtuple(v.backend_version))
    if v.kind == "stable-abi":
        return (0, tuple(-x for x in _vtuple(v.torch_version)), backend_rank, v.name)
    if v.kind == "torch":
        return (1, (0 if v.cxx11_abi is None else 1,), backend_rank, v.name)
    if v.kind == "noarch":
        return (2, (1 if v.backend == "universal" else 0,), (), v.name)
    return (3, (), (), v.name)


def rank_variants(names: Iterable[str], machine: Machine, backend: str | None = None) -> list[VariantDecision]:
    """Judge every variant name against ``machine``: accepted ones first, best first (rank 0).

    ``backend`` (e.g. ``"cpu"``) restricts the machine to that backend.

    Raises:
        ValueError: ``backend`` is not available on ``machine``.
    """
    if backend is not None:
        machine = machine.with_backend(backend)
    judged = [(parse_variant(n), *_judge(parse_variant(n), machine)) for n in sorted(set(names))]
    accepted = sorted((j for j in judged if j[1]), key=lambda j: _sort_key(j[0]))
    rejected = sorted((j for j in judged if not j[1]), key=lambda j: _sort_key(j[0]))
    decisions = [VariantDecision(v.name, True, reason, rank) for rank, (v, _, reason) in enumerate(accepted)]
    decisions += [VariantDecision(v.name, False, reason, None) for v, _, reason in rejected]
    return decisions


def _cuda_arch_supports(arch: str, capability: tuple[int, int]) -> bool | None:
    # One declared arch against a compute capability. Same semantics as `kernels.archs`:
    # "9.0a" exact; "10.0f" same major, minor >=; "8.0+PTX" anything newer; "8.0" same major.
    ptx = arch.endswith("+PTX")
    core = arch[: -len("+PTX")] if ptx else arch
    suffix = core[-1] if core.endswith(("a", "f")) else ""
    core = core[:-1] if suffix else core
    major, sep, minor = core.partition(".")
    if not sep or not major.isdigit() or not minor.isdigit():
        return None
    want = (int(major), int(minor))
    if suffix == "a":
        return capability == want
    if ptx and suffix != "f":
        return capability >= want
    return capability[0] == want[0] and capability[1] >= want[1]


def arch_rejection(metadata: dict | None, machine: Machine) -> str | None:
    """Why this build's declared GPU archs exclude this machine's GPU, or None if it can run.

    Builds that declare no archs, machines without a visible GPU, and arch strings this version
    cannot read all pass (the kernel may still have a fallback).
    """
    backend = (metadata or {}).get("backend") or {}
    archs = backend.get("archs") or []
    if not archs or not isinstance(archs, list):
        return None
    btype = str(backend.get("type", "")).lower()
    if machine.backend == "cuda" and machine.gpu_capability is not None and btype in ("cuda", "universal", ""):
        verdicts = [_cuda_arch_supports(str(a), machine.gpu_capability) for a in archs]
        if all(v is None for v in verdicts) or any(verdicts):
            return None
        cap = f"{machine.gpu_capability[0]}.{machine.gpu_capability[1]}"
        return f"declares GPU archs {', '.join(map(str, archs))}; this GPU has compute capability {cap}"
    if machine.backend == "rocm" and machine.gpu_arch and btype == "rocm":
        if machine.gpu_arch in archs:
            return None
        return f"declares GPU archs {', '.join(map(str, archs))}; this GPU is {machine.gpu_arch}"
    return None


def select_variant(
    names: Iterable[str],
    machine: Machine,
    read_metadata: Callable[[str], dict | None] | None = None,
    backend: str | None = None,
) -> tuple[str | None, list[VariantDecision]]:
    """Pick the best variant that can run here.

    Variants are ranked by name (:func:`rank_variants`); then, best first, each candidate's
    ``metadata.json`` (via ``read_metadata(variant)``, which may download just that file) is
    checked for GPU archs until one passes. Returns ``(chosen or None, decisions)`` with every
    decision re-ranked after arch rejections.

    Raises:
        ValueError: ``backend`` is not available on ``machine``.
    """
    decisions = rank_variants(names, machine, backend)
    if backend is not None:
        machine = machine.with_backend(backend)
    chosen = None
    for i, decision in enumerate(decisions):
        if not decision.accepted:
            break
        metadata = read_metadata(decision.variant) if read_metadata is not None else None
        reason = arch_rejection(metadata, machine)
        if reason is None:
            chosen = decision.variant
            break
        decisions[i] = VariantDecision(decision.variant, False, reason, None)
    accepted = [d for d in decisions if d.accepted]
    rejected = [d for d in decisions if not d.accepted]
    decisions = [VariantDecision(d.variant, True, d.reason, r) for r, d in enumerate(accepted)] + rejected
    return chosen, decisions
