"""Launch configurations per GPU family, so the first call compiles once and never autotunes.

A config is ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``. Tables are keyed by the padded head
dimension (32, 64, 128, 256; 16 uses the row of 32). Families: sm90 (H100/H200), sm80 (A100; also used for sm86/sm89
with fewer stages since their shared memory is smaller), and the interpreter (CPU test suite:
small tiles so short test sequences still cross several blocks).

``FLASH_ATTN2_AUTOTUNE=1`` (set before the import) opts in to timing a few candidates on the first call of each shape
class and keeping the fastest for the rest of the process.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Tuple

Config = Tuple[int, int, int, int]

# The padded head dims (powers of two, 16 = the narrowest `tl.dot` operand) the kernels run at;
# the tables below have rows from 32 up.
PADDED_HEAD_DIMS = (16, 32, 64, 128, 256)
MIN_TABLE_DIM = 32

# (BLOCK_M, BLOCK_N, num_warps, num_stages) for the forward kernel.
_FWD_SM90: Dict[int, Config] = {  # H100/H200; chosen on an H200 (bench/NOTES.md, Kernel tuning)
    32: (128, 64, 8, 4),
    64: (128, 64, 8, 3),
    128: (128, 64, 8, 3),
    256: (128, 64, 8, 2),
}
# Rows bounded on the right (causal, right windows) on sm90: 64-row tiles on one warpgroup, 3
# stages, three programs to an SM, so the short rows near the diagonal leave no SM idle. At
# d=128 only with GQA or short keys: with many MHA heads each K/V block, read twice as often by
# 64-row tiles, is not shared by the heads of a group (bench/NOTES.md, Kernel tuning). Unbounded rows keep the
# tables above.
_FWD_SM90_RIGHT: Dict[int, Config] = {64: (64, 64, 4, 3), 128: (64, 64, 4, 3)}
_RIGHT_MHA_MAX_KEYS = 2048  # d=128 MHA: 64-row tiles up to this many keys
# The same rows at d=64 with an even GQA group (dense calls, no left window, ALiBi or dropout): two
# query heads of a group in one program, 64 positions of each, 128 rows on 8 warps. The 64-row
# diagonal stays, and each K/V block leaves L2 once for 128 rows instead of 64. Under sustained
# load these kernels run at the GPU's 700 W cap, where that traffic sets the clock: 1.64 GHz
# against 1.53 for the one-head tile, 3-4 % more TFLOP/s (bench/NOTES.md, Kernel tuning).
_FWD_SM90_RIGHT_PAIRED: Dict[int, Config] = {64: (128, 64, 8, 3)}

# sm80/sm8x tables are estimates (no A100 was available to measure them).
_FWD_SM80: Dict[int, Config] = {
    32: (128, 64, 4, 3),
    64: (128, 64, 4, 3),
    128: (128, 64, 8, 3),
    256: (64, 32, 4, 2),
}
_FWD_SM8X: Dict[int, Config] = {  # sm86/sm89: ~100 KB of shared memory per block
    32: (128, 64, 4, 2),
    64: (128, 64, 4, 2),
    128: (64, 64, 4, 2),
    256: (64, 32, 4, 1),
}
# Backward: ((BLOCK_M, BLOCK_N, num_warps, num_stages, mode) for the dK/dV kernel,
#            (BLOCK_M, BLOCK_N, num_warps, num_stages) for the dQ kernel).
# dK/dV holds two [BLOCK_N, D] fp32 accumulators, so registers are the limit: at D=128 only
# 32-row query steps over 128 keys with 8 warps stay (almost) spill-free. mode picks the dK/dV
# formulation: "keys" = [keys, queries] tiles, k/v in registers, no transposes; "queries" =
# [queries, keys] tiles, k/v in shared memory, p and ds transposed; "-2pass" = dV then dK in two
# sweeps so only one accumulator is live (one extra q.k product per step).
_BWD_SM90: Dict[int, tuple] = {
    32: ((64, 64, 4, 3, "keys"), (128, 64, 8, 3)),
    64: ((64, 64, 4, 3, "keys"), (128, 64, 8, 3)),
    128: ((64, 128, 8, 3, "keys"), (128, 64, 8, 3)),
    256: ((32, 128, 8, 2, "keys-2pass"), (128, 32, 8, 2)),
}
# (padded head dim, causal) -> the fewest keys per sequence from which the sm90 backward computes
# dQ inside the dK/dV kernel (bulk reduce-adds into an fp32 buffer, no dQ kernel;
# _triton_bwd.dq_mode). H200, forward+backward against the dQ kernel in one run: d=128 causal
# 16k 1.045x (4k 0.98x, 1k 0.86x, non-causal 0.88-0.99x); d=64 causal 4k 1.07x (GQA 2k 0.97x,
# non-causal 0.87-0.88x); bench/NOTES.md.
FUSED_DQ_SM90: Dict[Tuple[int, bool], int] = {(128, True): 16384, (64, True): 4096}
_BWD_SM80: Dict[int, tuple] = {
    32: ((64, 64, 4, 2, "keys"), (64, 64, 4, 2)),
    64: ((64, 64, 4, 2, "keys"), (64, 64, 4, 2)),
    128: ((32, 64, 4, 2, "keys"), (64, 32, 4, 2)),
    256: ((32, 32, 4, 1, "queries"), (32, 32, 4, 1)),
}
_INTERPRETER: Config = (16, 16, 4, 1)


def _table(kind: str, capability: Optional[Tuple[int, int]]) -> Dict[int, Config]:
    major, minor = capability if capability is not None else (0, 0)
    if kind == "fwd":
        if major >= 9:
            return _FWD_SM90
        if (major, minor) == (8, 0):
            return _FWD_SM80
        return _FWD_SM8X
    if major >= 9:
        return _BWD_SM90
    return _BWD_SM80


def pick(kind: str, capability: Optional[Tuple[int, int]], block_d: int) -> tuple:
    """The shipped config for ``kind`` ("fwd" or "bwd"); ``capability`` None = interpreter.

    Under the interpreter every dK/dV formulation gets exercised: small heads take "keys",
    padded head dim 128 "queries", 256 "keys-2pass".
    """
    if capability is None:
        if kind == "fwd":
            return _INTERPRETER
        mode = "keys" if block_d < 128 else "queries" if block_d == 128 else "keys-2pass"
        return (_INTERPRETER + (mode,), _INTERPRETER)
    # Tables start at 32: a 16-wide head (head_dim <= 16) runs in the tiles of 32, which hold
    # less data per row than the 32 they were sized for.
    return _table(kind, capability)[max(block_d, MIN_TABLE_DIM)]


def pick_fwd(capability: Optional[Tuple[int, int]], block_d: int, masked_right: bool, group: int,
             keys: int) -> Config:
    """The shipped forward config for a call: ``pick("fwd", ...)``, or on sm90 for rows bounded on
    the right the 64-row tile of ``_FWD_SM90_RIGHT`` (at d=128 only with GQA or short keys)."""
    if masked_right and capability is not None and capability[0] == 9:
        cfg = _FWD_SM90_RIGHT.get(block_d)
        if cfg is not None and (block_d < 128 or group > 1 or keys <= _RIGHT_MHA_MAX_KEYS):
            return cfg
    return pick("fwd", capability, block_d)


def pick_fwd_paired(capability: Optional[Tuple[int, int]], block_d: int, masked_right: bool, group: int,
                    plain_dense: bool) -> Optional[Config]:
    """The tile for two query heads a program (``_FWD_SM90_RIGHT_PAIRED``) where a call takes it,
    else None. ``plain_dense``: a dense call without a left window, ALiBi or dropout. Raises
    nothing."""
    if (masked_right and plain_dense and group % 2 == 0 and capability is not None
            and capability[0] == 9):
        return _FWD_SM90_RIGHT_PAIRED.get(block_d)
    return None


# Read once at import (set the variable before importing the kernel): the launch path consults
# it on every call, where an environment lookup is measurable host time.
AUTOTUNE = os.environ.get("FLASH_ATTN2_AUTOTUNE", "0") == "1"


def candidates(kind: str, block_d: int) -> List[Config]:
    """Configs worth timing when autotuning is on (the shipped one first)."""
    out: List[Config] = []
    for bm in (64, 128):
        for bn in (32, 64, 128):
            if block_d >= 256 and bm * bn > 128 * 64:
                continue
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    if kind == "fwd":
                        out.append((bm, bn, warps, stages))
                    else:
                        # dK/dV and dQ tiles are tuned together: the dQ tile is the transpose.
                        for mode in ("keys", "queries", "keys-2pass"):
                            if mode == "queries" and warps == 8:
                                # Triton 3.6 gave wrong dK for (32, 64, 8 warps, "queries") at
                                # D=256 on an H200: never let the autotuner pick that family.
                                continue
                            out.append(((bm, bn, warps, stages, mode), (bn, bm, warps, stages)))
    return out


_TUNED: Dict[tuple, Config] = {}


def choose(kind: str, capability: Optional[Tuple[int, int]], block_d: int, shape_class: tuple,
           override: Optional[tuple], time_fn: Callable[[tuple], float],
           shipped: Optional[tuple] = None) -> tuple:
    """The config a launch uses: ``override`` if given, else the shipped one (``shipped``, or
    ``pick``'s), or with ``FLASH_ATTN2_AUTOTUNE=1`` on a GPU the fastest candidate for this shape
    class (``tuned``)."""
    if override is not None:
        return override
    if shipped is None:
        shipped = pick(kind, capability, block_d)
    if capability is None or not AUTOTUNE:
        return shipped
    return tuned((kind, capability, block_d) + shape_class, shipped, kind, block_d, time_fn)


def tuned(key: tuple, default: Config, kind: str, block_d: int, time_fn: Callable[[Config], float]) -> Config:
    """Return the fastest candidate for ``key``, timing them once per process with ``time_fn``.

    ``time_fn`` runs the kernel with a config and returns milliseconds, or raises when the
    config does not fit (out of shared memory); such configs are skipped.
    """
    if key in _TUNED:
        return _TUNED[key]
    best, best_ms = default, float("inf")
    for cfg in [default] + [c for c in candidates(kind, block_d) if c != default]:
        try:
            ms = time_fn(cfg)
        except Exception:  # a config that does not compile or fit is simply not a candidate
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    _TUNED[key] = best
    return best
