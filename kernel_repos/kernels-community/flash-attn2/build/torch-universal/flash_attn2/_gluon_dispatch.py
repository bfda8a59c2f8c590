"""When a forward call runs the Gluon kernel (``_gluon_fwd``) instead of the Triton one.

Pure Python over plain values, so that CPU tests can walk the rule; importing this module
imports neither Triton nor Gluon. The rule: an sm90 GPU, a Triton release the kernel was
measured under (:data:`MEASURED_TRITON`, or one named in ``FLASH_ATTN2_GLUON_TRITON``) that ships ``triton.experimental.gluon``, a call
without ``seqused_k``, window, softcap, ALiBi or dropout, bf16, and a (head_dim, causal) pair in
:data:`MEASURED_FASTER` (dense) or :data:`MEASURED_FASTER_VARLEN` (packed sequences) with at
least its number of query tokens: where the Gluon forward measured correct and faster than the
Triton forward on the H200 (``bench/gluon_fwd.py``; figures in ``bench/results/gluon_fwd.md``
and ``bench/results/varlen.md``).
Everything else, the interpreter included, keeps the Triton kernel.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Optional, Tuple

# (head_dim, causal) -> the fewest query tokens per sequence from which the Gluon forward
# measured faster than the Triton forward on the H200 (1k/4k/16k rows, bench/results/gluon_fwd.md:
# 1.02-1.30x at head_dim 128, 1.24-1.36x at 256). head_dim 64: non-causal, three consumers
# (_gluon_fwd.NON_CAUSAL) 1.06-1.08x (bench/results/gluon_fwd_d64_c3pk.md; two consumers with the
# pinned P·V wait had measured 0.99-1.07x, gluon_fwd_pin_wait.md); causal, two consumers 0.80x at 1k and 0.93x at 2k, 1.01-1.07x from 4k in four runs
# (gluon_fwd_pin_wait.md, gluon_fwd_d64_2k.md, gluon_fwd_d64_variants.md).
MEASURED_FASTER: Mapping[Tuple[int, bool], int] = {
    (64, False): 0,
    (64, True): 4096,
    (128, False): 0,
    (128, True): 0,
    (256, False): 0,
    (256, True): 0,
}

# The same for packed sequences (``flash_attn_varlen_func``), keyed by the longest sequence's
# query tokens (bench/results/varlen.md)
MEASURED_FASTER_VARLEN: Mapping[Tuple[int, bool], int] = {
    (128, False): 0,
    (128, True): 0,
    (256, False): 0,
    (256, True): 0,
}

# Triton releases (major, minor) the Gluon kernels were checked and timed under: 3.6 (torch 2.11)
# and 3.7 (torch 2.12, 2.13; the GPU check, flash-attention's tests and the attention table under
# Triton 3.7.1: bench/results/*_triton37.md). Gluon is experimental: names changed after 3.6 (the
# kernel follows them) and Triton 3.10 turns FP fusion off by default, so another release keeps
# the Triton kernel until it is measured too.
MEASURED_TRITON: frozenset = frozenset({(3, 6), (3, 7)})
# Further releases to run the Gluon kernels under anyway, "3.7" or "3.7,3.8" (read once, at the
# first call): for checking and timing a release on a GPU before it joins MEASURED_TRITON
# (bench/check_gpu.py and the benchmarks run under it), at one's own risk otherwise.
GLUON_TRITON_ENV = "FLASH_ATTN2_GLUON_TRITON"
_GLUON_AVAILABLE: Optional[bool] = None


def triton_version_tuple(version: str) -> Tuple[int, int]:
    """``"3.6.0"`` / ``"3.7rc1"`` -> ``(3, 6)`` / ``(3, 7)``; ``(0, 0)`` if unreadable."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def accepted_triton(environ: Optional[Mapping[str, str]] = None) -> frozenset:
    """:data:`MEASURED_TRITON` and the releases named in ``FLASH_ATTN2_GLUON_TRITON``.

    Raises ValueError naming the variable for an entry that is not ``major.minor``."""
    extra = (os.environ if environ is None else environ).get(GLUON_TRITON_ENV, "")
    releases = set(MEASURED_TRITON)
    for item in filter(None, (part.strip() for part in extra.split(","))):
        if not re.fullmatch(r"\d+\.\d+", item):
            raise ValueError(f"{GLUON_TRITON_ENV}={extra!r}: {item!r} is not a Triton release as major.minor "
                             "(for example 3.7, or 3.7,3.8)")
        releases.add(triton_version_tuple(item))
    return frozenset(releases)


def gluon_available() -> bool:
    """Whether this process's Triton is a release in :func:`accepted_triton` with Gluon's Hopper
    API (cached). Raises ValueError for a malformed ``FLASH_ATTN2_GLUON_TRITON``."""
    global _GLUON_AVAILABLE, _UNTIMED_RELEASE
    if _GLUON_AVAILABLE is None:
        accepted = accepted_triton()
        try:
            import triton

            if triton_version_tuple(triton.__version__) not in accepted:
                _UNTIMED_RELEASE = triton.__version__
                raise ImportError(triton.__version__)
            from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
            _GLUON_AVAILABLE = True
        except ImportError:
            _GLUON_AVAILABLE = False
    return _GLUON_AVAILABLE


_UNTIMED_RELEASE: Optional[str] = None


def untimed_release_note() -> Optional[str]:
    """Why the Gluon kernels are off when the only reason is the Triton release (it has Gluon's
    Hopper API, but is not in :func:`accepted_triton`): a message saying what runs instead and how
    to opt in; None otherwise (call after :func:`gluon_available`). Raises nothing."""
    if _UNTIMED_RELEASE is None:
        return None
    try:  # a release without Gluon's Hopper API: opting in would change nothing
        import importlib.util

        if importlib.util.find_spec("triton.experimental.gluon.language.nvidia.hopper") is None:
            return None
    except Exception:  # its packages failed to import: the same
        return None
    release = "%d.%d" % triton_version_tuple(_UNTIMED_RELEASE)
    timed = ", ".join("%d.%d" % r for r in sorted(MEASURED_TRITON))
    return (f"flash_attn2: on sm90 the Gluon kernels, faster than the Triton ones at bf16, run only under the "
            f"Triton releases they were checked and timed under ({timed}); this is Triton {_UNTIMED_RELEASE}, so the "
            f"Triton kernels run. {GLUON_TRITON_ENV}={release} (set before the first call) runs the Gluon kernels "
            f"under it anyway, not checked or timed on a GPU under it (kernel_loader's docs/performance.md, "
            f"'Triton releases').")


def wants_gluon(capability: Optional[Tuple[int, int]], gluon_ok: bool, head_dim: int, causal: bool,
                seqlen_q: int, plain: bool, bf16: bool, layout_ok: bool,
                faster: Optional[Mapping[Tuple[int, bool], int]] = None, varlen: bool = False) -> bool:
    """The dispatch rule over plain facts about one forward call (see the module docstring).

    ``capability`` is None off CUDA (the interpreter, the CPU); ``plain`` means no seqused_k,
    window, softcap, ALiBi or dropout; ``varlen``: packed sequences (``seqlen_q`` is then the
    longest one's); ``layout_ok`` is ``_gluon_fwd.supports``'s answer; ``faster`` defaults to
    :data:`MEASURED_FASTER` or :data:`MEASURED_FASTER_VARLEN` as they are at call time. Raises
    nothing.
    """
    if faster is None:
        faster = MEASURED_FASTER_VARLEN if varlen else MEASURED_FASTER
    min_tokens = faster.get((head_dim, bool(causal)))
    return (capability == (9, 0) and gluon_ok and plain and bf16 and layout_ok
            and min_tokens is not None and seqlen_q >= min_tokens)


# The backward (``_gluon_bwd``): (head_dim, causal) -> the fewest keys per sequence from which
# the Gluon dK/dV/dQ kernel measured faster than the Triton backward on the H200, in one run
# beside it (``bench/attention.py``: ``ours f+b`` runs it, ``ours f+b deterministic`` the Triton
# backward; figures in ``bench/results/attention.md``)
MEASURED_FASTER_BWD: Mapping[Tuple[int, bool], int] = {
    (64, False): 0,
    (64, True): 0,
    (128, False): 0,
    (128, True): 0,
    (256, False): 0,
    (256, True): 0,
}

# The same for packed sequences, keyed by the longest sequence's keys (``bench/varlen.py``:
# ``ours f+b`` against ``ours f+b deterministic``, ``bench/results/varlen.md``)
MEASURED_FASTER_BWD_VARLEN: Mapping[Tuple[int, bool], int] = {
    (64, False): 0,
    (64, True): 0,
    (128, False): 0,
    (128, True): 0,
    (256, False): 0,
    (256, True): 0,
}


def wants_gluon_backward(capability: Optional[Tuple[int, int]], gluon_ok: bool, head_dim: int, causal: bool,
                         seqlen_k: int, plain: bool, bf16: bool, deterministic: bool,
                         faster: Optional[Mapping[Tuple[int, bool], int]] = None, varlen: bool = False) -> bool:
    """Whether a backward goes to the Gluon sm90 kernel: an sm90 GPU, a Triton release in
    :data:`MEASURED_TRITON` with Gluon, a bf16 call with no seqused_k, window, softcap, ALiBi or
    dropout (``plain``), not ``deterministic`` (its dQ adds in an order that varies), and
    (head_dim, causal) in ``faster`` (default :data:`MEASURED_FASTER_BWD`, or
    :data:`MEASURED_FASTER_BWD_VARLEN` for packed sequences, ``varlen``) with at least its number
    of keys (packed: the longest sequence's). The layout check (``_gluon_bwd.supports``) is the
    caller's. Raises nothing.
    """
    if faster is None:
        faster = MEASURED_FASTER_BWD_VARLEN if varlen else MEASURED_FASTER_BWD
    min_keys = faster.get((head_dim, bool(causal)))
    return (capability == (9, 0) and gluon_ok and plain and bf16 and not deterministic
            and min_keys is not None and seqlen_k >= min_keys)
