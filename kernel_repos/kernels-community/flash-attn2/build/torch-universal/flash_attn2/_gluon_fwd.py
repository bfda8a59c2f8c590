"""Gluon forward kernel for Hopper (sm90): warp-specialised, TMA loads, ``wgmma``, and a softmax
that overlaps the previous block's P·V product.

Entry point::

    gluon_attention_forward(q, k, v, *, softmax_scale, causal, store_lse=True,
                            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None) -> (out, lse)

dense q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hk, D]`` (any 16-byte-aligned strides, unit stride along
D) -> out like q, lse ``[B, Hq, Sq]`` fp32 natural-log; or packed sequences q ``[total_q, Hq, D]``,
k/v ``[total_k, Hk, D]`` with int32 ``cu_seqlens`` -> lse ``[Hq, total_q]`` (the layouts of
``_triton_fwd``, so the Triton backward consumes them unchanged). Causal masks are bottom-right
aligned; rows that see no key get out 0 and lse +inf. :func:`supports` says which calls this
kernel serves; everything else (windows, softcap, ALiBi, dropout, seqused_k, other head dims or
dtypes) stays on the Triton kernel.

Why this shape (Gluon gives the control plain Triton does not; FlashAttention-3's design):

* Three partitions (``gl.warp_specialize``): one producer warp issues every bulk copy, and two
  consumer warpgroups, each its own partition, own 64 of the tile's 128 query rows (a variant
  with three consumers and 192-row tiles, ``consumers=3``, is FlashAttention-3's head_dim 64
  shape; :data:`CONSUMERS` says where it runs). They hand
  K/V ring slots back and forth through "ready" and "empty" mbarriers (an empty slot needs one
  arrival from each consumer). No CTA-wide barrier is left in the loop, so one consumer's
  softmax runs while the other's matmuls keep the tensor cores busy, and the register file is
  split unevenly (``setmaxnreg``): the producer keeps 24 registers a thread, the consumers 240.
* Q, K, V and O move through 4-D TMA descriptors over ``[B, S, H, D]``: the copy engine clips
  and zero-fills at each sequence's end, so ragged lengths need no bounds arithmetic, and each
  consumer's output rows go back through the same engine from the shared buffer its Q used.
  Packed sequences share one ``[1, total, H, D]`` view: a program reads its sequence's bounds
  from ``cu_seqlens``, the keys past that sequence's end (the next one's, or the copy engine's
  zeros) are masked like a dense sequence's ragged end, and the output leaves through a store
  masked at the sequence's end, since a bulk copy of the last block would overwrite the next
  sequence's first rows.
* In each step a consumer issues ``S_j = Q K_j^T``, then ``O += P_{j-1} V_{j-1}``, waits only
  for S_j, computes the softmax of block j while the tensor cores still run P·V, and only then
  waits for P·V and rescales O (FlashAttention-3's intra-warpgroup overlap). P stays in
  registers as the A operand. ptxas, though, moves an unconditional wait for P·V above nearly
  all of the softmax's exponentials; :data:`PIN_WAIT` head dims keep it after them (see there).
* Key blocks that no mask touches run without the compare and select; only the blocks that
  cross the causal diagonal or the sequence end pay for them.
* Dense calls run persistently: one program per SM walks pairs of 128-row tiles (``_tile``:
  within a head the row blocks go in zig-zag order, so a causal pair is one short and one long
  block and every program gets about the same work). The K/V ring and the Q buffers carry on
  from tile to tile: the producer loads the next tile's first key block and, with a second set
  of Q buffers (:func:`q_buffers`; one set at head_dim 256), its Q while this tile's output
  still leaves through the first. At 1k tokens that measured 1.12x the same kernel launched
  one program per tile, what packed calls run by default. Their tiles' lengths are known only on
  the GPU, so a persistent packed call (:data:`PERSISTENT_VARLEN`, off: it measured slower)
  walks a list that :func:`packed_tiles` sorts there, longest first, dealt out in a snake.

Measured and not kept (``bench/NOTES.md``, ``bench/results/gluon_fwd*.md``): one partition of
two warpgroups that issue their own copies behind a CTA barrier per step (0.84-0.88x this
kernel); FlashAttention-3's ping-pong turns between the consumers (:data:`PINGPONG`: 0.96-0.99x
at head_dim 64, mixed at 128); K and V of a slot handed back in one arrival
(:data:`KV_TOGETHER`: level at head_dim 64, slower at 128 and 256); launching the longest
causal row blocks first (slower at 1k and 4k); FlashAttention-4's conditional rescaling of O
(:data:`LAZY_RESCALE`: 0.96-1.00x at head_dim 64); at head_dim 64 this kernel is not faster than
the Triton forward without :data:`PIN_WAIT`; with it, non-causal calls at head_dim 64 run here,
and causal ones from 4k query tokens.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import Any, List, Optional, Tuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import _schedule
from ._launch import Launcher
from ._triton_fwd import fresh_like

LOG2E = 1.4426950408889634

# Triton 3.6 names the bulk copies async_copy_global_to_shared / async_copy_shared_to_global;
# later releases call them async_load / async_store (and make the old names raise)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# a barrier among the calling partition's threads: gl.thread_barrier in 3.6, gl.barrier later
_thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

# head_dim -> (BLOCK_N, STAGES); the tile has 128 query rows (2 x 64); STAGES a power of two
# (Gluon's shared layouts need one); shared memory: 2 Q halves + STAGES x (K + V) blocks in bf16
# must stay under the 227 KB a Hopper block may take
TILES = {
    64: (128, 4),
    128: (128, 2),
    256: (64, 2),
}
# head_dim -> (most query and key tokens, (BLOCK_N, STAGES)): the tile of short causal dense calls. At
# 1k causal tokens a 64-key block measured 1.06x the 128-key one (less of each diagonal block is
# masked work) and at 4k 0.94x (bench/results/gluon_fwd_tiles.md), so only calls up to the measured
# length take it
SHORT_CAUSAL_TILES = {
    128: (1024, (64, 4)),
}
ROWS = 64  # query rows per consumer warpgroup (one m64 wgmma row block)
SHARED_BYTES = 220 * 1024  # of the 227 KB a Hopper block may take, room left for the mbarriers
# dense calls: one program per SM walks pairs of tiles (the next tile's Q and first K/V blocks
# load while this one's output leaves); False: one program per tile
PERSISTENT = True
# packed calls: one program per SM walks the live tiles, sorted longest first on the GPU
# (packed_tiles: a few small torch operations a call, no host sync) and dealt out in a snake,
# which a model of the dispatch puts within 1 % of the hardware's own balance
# (bench/results/varlen_schedule.md); False: one program per tile, the hardware dispatching them.
# The dense call gained 4.5-12 % going persistent, but on the H200 this walk measured 0.56-0.97x
# the per-tile call on 8 packed sequences of 128-4096 tokens (bench/results/varlen.md, the
# 'walk' column; same bits), so packed calls keep one program per tile
PERSISTENT_VARLEN = False
# dense persistent calls: each program walks the run of tiles _schedule deals it on the host (list
# scheduling in a model of the GPU's own dispatch, causal calls' shortest tiles dealt last) where
# that model finds a deal 2 % shorter than the formula's pairs in turn, which the kernel works out
# itself; False: the formula always. Measured (bench/results/fwd_schedule.md, back to back):
# 1.01-1.05x the formula on causal rows from 4k tokens, 1.02-1.04x at head_dim 64 non-causal 4k-16k
SCHEDULE = True
# (worker consumer, producer, kernel maxnreg) registers per thread: 4 + 4 + 1 warps (the producer's
# warp counts as a warpgroup) share the 64K-register file as 24 x 128 + 240 x 256 <= 168 x 384; the
# default partition (the first consumer) gets what maxnreg leaves, 240
REGS = (240, 24, 168)
# the same with three consumers: 4 + 4 + 4 + 1 warps as 24 x 128 + 160 x 256 + 168 x 128 <= 128 x 512
REGS_3 = (160, 24, 128)
# head_dim -> consumer warpgroups (64 query rows each) per program; 2 where not listed
CONSUMERS: dict = {}
# head dims whose consumers hand a ring slot's K and V back in one arrival, once P·V of that block
# is done, instead of K after its S and V after its P·V: one mbarrier arrival a step fewer, and
# with it one of the three warpgroup barriers (bar.sync) Gluon puts before each arrival and after
# it; a K slot is then held a step longer
KV_TOGETHER: frozenset = frozenset()
# head dims whose two consumers take turns issuing their matmuls (FlashAttention-3's ping-pong:
# one waits for the other to have issued S_j and P_{j-1} V_{j-1} before issuing its own, so one
# warpgroup's softmax runs under the other's matmuls); two consumers only
PINGPONG: frozenset = frozenset()
# head dims whose consumers hand ring slots back with one arrival from each of their 128 threads
# (cp.async.mbarrier.arrive.noinc, which with no copies pending arrives at once; the K/V barriers
# then count 128 arrivals a consumer; PINGPONG's turns likewise) instead of one thread's after a
# warpgroup barrier: Gluon puts a bar.sync before every mbarrier.arrive, and these are two of the
# three a key block costs
THREAD_ARRIVE: frozenset = frozenset()
# head dims whose consumers wait for P_{j-1} V_{j-1} behind a predicate computed from the softmax
# of block j (_after_softmax). Why: Gluon's PTX puts that wait after the softmax, but ptxas
# schedules it as early as it may, before the exponentials, so a warpgroup's softmax never ran
# under its own P·V (offline sm90 SASS, Triton 3.6); a predicate read from the row sums keeps the
# wait after every exponential of the step. Measured (bench/results/gluon_fwd_pin_wait.md):
# 1.03-1.05x the same kernel without it on non-causal head_dim 64 rows, 0.98-1.05x at 128
PIN_WAIT: frozenset = frozenset({64})
# head dims whose row maxima fold the thread's columns pairwise (_row_max: 5 dependent max
# instructions at 128 keys instead of a chain of 31, the same result bit for bit). Measured at
# head_dim 64 (bench/results/gluon_fwd_pin_wait.md, run A): 0.94-0.99x without PIN_WAIT, 0.96-1.00x
# with it, so no head dim takes it
TREE_MAX: frozenset = frozenset()
# head dims (64 only) whose rows keep a stale max until a block's is more than 2**8 above it, and
# whose warps skip the rescale of O when none of their rows moved (FlashAttention-4's conditional
# rescaling: 32 multiplies a thread a step, after the P·V wait, saved on most steps; the result
# is the same softmax, rounded differently). Measured (bench/results/gluon_fwd_lazy_rescale.md):
# 0.96 / 0.99 / 1.00x the shipped kernel at 1k / 4k / 16k non-causal, 1.00x causal, so no head dim
# takes it
LAZY_RESCALE: frozenset = frozenset()
# head_dim -> how many of every 8 exponentials of P a thread computes on the FMA units instead of
# the exp2 unit (MUFU: 16 results a clock an SM, against 128 for FFMA), as FlashAttention-4 does:
# 2**x = 2**floor(x) * 2**frac(x), the fraction's power by a cubic (relative error <= 8.6e-5,
# below bf16's 2**-9 rounding of P), the integer part added to the exponent bits. Why: at
# head_dim 64 both consumers' exponentials of a block take ~1,060 clocks of a scheduler's exp2
# unit, about what the block's matmuls take on the tensor cores; an emulated one costs ~7
# instructions, and a step already issues ~930 a scheduler (bench/results/gluon_sass.md), so by
# count 1 of 8 gains ~1 % and 2 of 8 loses, more only where the two softmaxes contend
# (bench/NOTES.md). Not timed yet, so no head dim takes it.
EXP2_POLY: dict = {}
# head dims whose unmasked key loop runs two key blocks a trip. Why: P_j is converted into
# registers of its own while P_{j-1}'s are still read by the P·V wgmma (PIN_WAIT), and a loop of
# one step must move it back into P_{j-1}'s registers before the next trip (35 moves of a step's
# 464 instructions at head_dim 64 against 15.5 unrolled, bench/results/gluon_sass.md); two steps a
# trip alternate between the two sets. The same arithmetic in the same order, so the same bits.
# Its price is compile time (the head_dim 128 causal forward 2.3 -> 3.3 s there), which a cold
# first call pays. Not timed yet, so no head dim takes it.
UNROLL2: frozenset = frozenset()
# head dims whose consumers leave a tile without waiting for its output's bulk copy: the wait, and
# the hand-back of that Q/O buffer to the producer, come after the first key block of the next
# tile. Why: a tile's output leaves through the copy engine from the buffer its Q used, and the
# consumer waited for the copy to have read it before starting the next tile, every tile (at
# 1k tokens a program walks ~16 tiles of a few key blocks each). Needs two sets of Q buffers
# (q_buffers: not head_dim 256, whose next Q loads into the same buffer) and dense calls (packed
# ones store without the copy engine). The same arithmetic, so the same bits. Not timed yet, so
# no head dim takes it.
DEFERRED_STORE: frozenset = frozenset()
# head dims whose consumers convert P to bf16 two values at a time in one instruction
# (cvt.rn.bf16x2.f32, inline PTX) instead of one at a time and then paired. Why: from the one-at-a-time
# form ptxas packs each pair with its halves the wrong way round and swaps them back, one PRMT per
# P register: 32 a key step at head_dim 128 and 16 at 256 (Triton 3.6; Triton 3.9 emits the paired
# form itself). The same rounding, so the same bits; bf16 only (other dtypes convert as before).
PACK_P: frozenset = frozenset()
# head_dim -> the choices a dense non-causal call takes instead of the head dim's defaults above
# (forward's keywords consumers, pin_wait, pack_p; a keyword given to forward wins). head_dim 64:
# three consumers (192-row tiles), the P·V wait unpinned (pinned, three consumers spill) and P
# converted in pairs: 1.00 / 1.05 / 1.06x the two pinned consumers at 1k / 4k / 16k, 0.95 / 1.01 /
# 1.03x SDPA cuDNN (bench/results/gluon_fwd_d64_c3pk.md; three consumers unpinned without
# PACK_P: 0.98 / 1.01 / 1.01x). Causal calls keep two consumers: there the larger tile masks more
# of each diagonal and measured 0.70 / 0.91 / 1.04x. The same arithmetic per row as the shipped
# kernel, so the same bits (checked there).
NON_CAUSAL: dict = {64: dict(consumers=3, pin_wait=False, pack_p=True)}


def call_choices(head_dim: int, causal: bool, varlen: bool) -> dict:
    """The :data:`NON_CAUSAL` choices a call of this kind takes: a dense non-causal call's at its
    head dim, none for causal or packed calls. Raises nothing."""
    return {} if causal or varlen else NON_CAUSAL.get(head_dim, {})


# the cubic 1 + C1 f + C2 f^2 + C3 f^3 ~ 2**f on [0, 1): minimax in relative error (Remez; the
# coefficients rounded to float32, checked in tests/kernel_repos/test_flash_attn2_gluon_exp2.py)
EXP2_POLY_COEFFS = (0x3F31F32C, 0x3E691BC5, 0x3D9DD553)


@gluon.jit
def _row_max(s, TREE: gl.constexpr):
    """The row maxima of a wgmma accumulator ``[ROWS, N]`` (N a power of two >= 8), in
    ``SliceLayout(1, s.type.layout)``.

    ``gl.max`` folds each thread's columns in one dependent chain (31 steps at N = 128). With
    TREE the columns are halved pairwise first: in the accumulator's layout each column bit from
    8 up is a register of the same thread, so every halving is a register-only max of two
    vectors, down to the 8 columns a thread shares with three others, which ``gl.max`` then
    finishes as before (one in-thread step, two shuffles). max is exact, so both give the same
    bits.
    """
    if TREE:
        R: gl.constexpr = s.shape[0]
        HALVINGS: gl.constexpr = s.shape[1].bit_length() - 4  # down to 8 columns
        x = s
        for _ in gl.static_range(HALVINGS):
            x = gl.max(x.reshape([R, 2, x.shape[1] // 2]), axis=1)
        return gl.convert_layout(gl.max(x, axis=1), gl.SliceLayout(1, s.type.layout))
    else:
        return gl.max(s, axis=1)


@gluon.jit
def _after_softmax(l_i):
    """``l_i`` unchanged, returned once this warpgroup's wgmma groups are all complete.

    The wait (``wgmma.wait_group 0``) sits behind a predicate read from the row sums, which
    depend on every exponential of the step, so ptxas cannot schedule it above them (it moves an
    unconditional wait as early as it may). The predicate is always true: a float sum is a
    number, an infinity or the canonical NaN 0x7fffffff, never the bits 0x7fc00001; the other
    branch waits as well, so the wait holds whatever the bits. One instance per thread (pack 2:
    a thread holds two rows' sums).
    """
    return gl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .b32 t;
        add.f32 t, $2, $3;
        setp.ne.b32 p, t, 0x7fc00001;
        @p wgmma.wait_group.sync.aligned 0;
        @!p wgmma.wait_group.sync.aligned 0;
        mov.b32 $0, $2;
        mov.b32 $1, $3;
        }""", "=r,=r,r,r", [l_i], dtype=gl.float32, is_pure=False, pack=2)


def _lazy_rescale_asm(n: int) -> str:
    """PTX multiplying a thread's ``n`` accumulator values ($0..) by their rows' alphas
    ($2n..), skipped by a warp none of whose rows changed its max (every alpha exactly 1).

    A thread's values come in groups of four, rows r, r, r+8, r+8 (the wgmma accumulator's
    register order), so the alphas of the first four cover both of its rows. ``vote`` makes the
    branch uniform over the warp; labels inside braces are local to each copy of the asm.
    """
    lines = ["{", ".reg .pred p;", f"setp.neu.f32 p, ${2 * n}, 0f3F800000;"]
    lines += [f"setp.neu.or.f32 p, ${2 * n + i}, 0f3F800000, p;" for i in (1, 2, 3)]
    lines += ["vote.sync.any.pred p, p, 0xffffffff;", "@!p bra.uni SKIP;"]
    lines += [f"mul.f32 ${i}, ${i}, ${2 * n + i};" for i in range(n)]
    lines += ["SKIP:", "}"]
    return "\n".join(lines)


def _lazy_rescale_constraints(n: int) -> str:
    """Outputs ``=r`` tied to the accumulator inputs (a skipped value stays in its register),
    then the alphas."""
    return ",".join(["=r"] * n + [str(i) for i in range(n)] + ["r"] * n)


@triton.constexpr_function
def exp2_mixed_asm(poly: int, pack: int = 8) -> str:
    """PTX computing 2**x for ``pack`` values ($pack.. in, $0.. out), ``poly`` of them (spread over
    the pack) on the FMA units and the rest with ``ex2.approx.ftz``. Raises ValueError unless
    0 <= poly <= pack.

    The emulation, per value: x clamped to >= -127 (so -inf, a masked score, gives +0, as the
    exp2 unit's flush to zero does); ``t = x + 1.5 * 2**23`` rounded down holds floor(x) in its
    low mantissa bits, so ``t - 1.5 * 2**23`` is floor(x) and ``x - floor(x)`` the fraction f,
    both exact; the cubic in f (three FMAs) gives 2**f in [1, 2); and ``t * 2**23 + bits(2**f)``
    (one integer multiply-add: the magic constant's bits vanish above bit 31) adds floor(x) to
    the exponent field.
    """
    if not 0 <= poly <= pack:
        raise ValueError(f"poly must lie in [0, {pack}], got {poly}")
    c1, c2, c3 = (f"0f{c:08X}" for c in EXP2_POLY_COEFFS)
    emulated = {round((k + 1) * pack / poly) - 1 for k in range(poly)} if poly else set()
    lines = []
    for i in range(pack):
        src, dst = f"${pack + i}", f"${i}"
        if i not in emulated:
            lines.append(f"ex2.approx.ftz.f32 {dst}, {src};")
            continue
        lines += ["{", ".reg .b32 x, t, j, f, p;",
                  f"max.ftz.f32 x, {src}, 0fC2FE0000;",
                  "add.rm.ftz.f32 t, x, 0f4B400000;",
                  "sub.ftz.f32 j, t, 0f4B400000;",
                  "sub.ftz.f32 f, x, j;",
                  f"fma.rn.ftz.f32 p, f, {c3}, {c2};",
                  f"fma.rn.ftz.f32 p, p, f, {c1};",
                  "fma.rn.ftz.f32 p, p, f, 0f3F800000;",
                  f"mad.lo.u32 {dst}, t, 8388608, p;",
                  "}"]
    return "\n".join(lines)


_EXP2_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 8 + ["r"] * 8))


@gluon.jit
def _exp2(x, POLY: gl.constexpr):
    """``gl.exp2(x)``; with POLY (:data:`EXP2_POLY`), POLY of every 8 values by the cubic on the
    FMA units (the asm built at compile time by :func:`exp2_mixed_asm`)."""
    if POLY > 0:
        return gl.inline_asm_elementwise(exp2_mixed_asm(POLY), _EXP2_CONSTRAINTS, [x], dtype=gl.float32,
                                         is_pure=True, pack=8)
    else:
        return gl.exp2(x)


# head_dim 64 (64 query rows x 64 columns on 128 threads: 32 values a thread)
_LAZY_ASM = gl.constexpr(_lazy_rescale_asm(32))
_LAZY_CONSTRAINTS = gl.constexpr(_lazy_rescale_constraints(32))


@gluon.jit
def _rescale(acc, alpha, LAZY: gl.constexpr):
    """``acc * alpha`` (alpha broadcast over a row); with LAZY (:data:`LAZY_RESCALE`, head_dim 64
    only) a warp whose alphas are all 1 skips the multiplies."""
    if LAZY:
        gl.static_assert(acc.shape[0] * acc.shape[1] == 32 * 128, "LAZY_RESCALE: head_dim 64 only")
        return gl.inline_asm_elementwise(_LAZY_ASM, _LAZY_CONSTRAINTS, [acc, alpha], dtype=gl.float32,
                                         is_pure=True, pack=32)
    else:
        return acc * alpha


@gluon.jit
def _softmax(s, m_i, l_i, j, off_m, diag, seqlen_k, qk_scale, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, TREE_MAX: gl.constexpr,
             LAZY: gl.constexpr, POLY: gl.constexpr):
    """Online softmax of key block j's raw scores: (p, alpha, new row max, new row sum).

    LAZY (:data:`LAZY_RESCALE`): a row keeps the max it has unless the block's is more than
    2**8 above it, so its probabilities stay below 256 and its alpha is exactly 1 on most steps.
    """
    if MASK:
        offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = offs_n[None, :] < seqlen_k
        if CAUSAL:
            offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + diag)
        s = gl.where(keep, s, float("-inf"))
    # the row max on raw scores: scale*log2(e) > 0 folds into the one multiply-add of exp2
    m_new = gl.maximum(m_i, _row_max(s, TREE_MAX) * qk_scale)
    if LAZY:
        m_new = gl.where(m_new > m_i + 8.0, m_new, m_i)
    if MASK:
        # a row that has seen no key yet keeps m = -inf; subtract 0 there instead (no NaN)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    pf = _exp2(s * qk_scale - m_use[:, None], POLY)
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(pf, axis=1)
    return pf, alpha, m_new, l_i




@gluon.jit
def _sequence_bounds(cu_seqlens_q, cu_seqlens_k, b):
    """Packed sequence b's first row and length, of the queries and of the keys."""
    q_row0 = gl.load(cu_seqlens_q + b)
    k_row0 = gl.load(cu_seqlens_k + b)
    return q_row0, gl.load(cu_seqlens_q + b + 1) - q_row0, k_row0, gl.load(cu_seqlens_k + b + 1) - k_row0


@gluon.jit
def _snake(i, pid, nprog):
    """Program pid's place in round i of a snake deal over nprog programs: from program 0 up when
    i is even, from the last program down when it is odd."""
    return pid + (i % 2) * (nprog - 1 - 2 * pid)


@gluon.jit
def _run(tiles):
    """Where this program's run of the host's table (``_schedule.table``) starts."""
    return gl.num_programs(0) + 1 + gl.load(tiles + gl.program_id(0))


@gluon.jit
def _tile(i, seqlen_q, seqlen_k, heads, n_m, cu_seqlens_q, cu_seqlens_k, tiles, e, CAUSAL: gl.constexpr,
          VARLEN: gl.constexpr, PERSISTENT: gl.constexpr, TILE_M: gl.constexpr):
    """The program's i-th tile: (off_m, batch coordinate, head, q_row0, k_row0, seqlen_q, seqlen_k);
    ``e``: its entry of the host's table (a dense call with one, :func:`_run`), else unused."""
    if PERSISTENT and VARLEN:
        # packed sequences: the live (sequence, row block) pairs, sorted longest first on the GPU
        # (packed_tiles), each pair's heads one after another, dealt out in a snake
        nprog = gl.num_programs(0)
        t = i * nprog + _snake(i, gl.program_id(0), nprog)
        pair = gl.load(tiles + 1 + t // heads)
        m = pair % n_m
        b = pair // n_m
        h = t % heads
    elif PERSISTENT and tiles is not None:
        # dense tiles dealt on the host (_schedule.table): the entry read during the tile before
        bh = e // n_m
        m = e % n_m
        b = bh // heads
        h = bh % heads
    elif PERSISTENT:
        # programs take pairs of tiles in turn; within a (batch, head) the tiles go in zig-zag
        # order of their row blocks (0, n-1, 1, n-2, ...), so a causal pair is a short and a long
        # one and every program gets about the same work
        u = gl.program_id(0) + (i // 2) * gl.num_programs(0)
        t = 2 * u + i % 2
        bh = t // n_m
        r = t % n_m
        if CAUSAL:
            if r % 2 == 0:
                m = r // 2
            else:
                m = n_m - 1 - r // 2
        else:
            m = r
        b = bh // heads
        h = bh % heads
    else:
        m = gl.program_id(0)
        bh = gl.program_id(1)
        b = bh // heads
        h = bh % heads
    if VARLEN:
        # packed sequences: one [1, total, H, D] view, the descriptors' batch coordinate 0
        q_row0, sq, k_row0, sk = _sequence_bounds(cu_seqlens_q, cu_seqlens_k, b)
        tb = 0
    else:
        q_row0 = 0
        k_row0 = 0
        sq = seqlen_q
        sk = seqlen_k
        tb = b
    return m * TILE_M, tb, h, q_row0, k_row0, sq, sk


@gluon.jit
def _key_blocks(off_m, seqlen_q, seqlen_k, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """How many key blocks the tile at row off_m reads (at least one: the ring stays in step)."""
    if CAUSAL:
        hi = gl.minimum(seqlen_k, off_m + TILE_M + seqlen_k - seqlen_q)
    else:
        hi = seqlen_k
    return gl.maximum((hi + BLOCK_N - 1) // BLOCK_N, 1)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
              seqlen_q, seqlen_k, heads, group, n_m, my_n, cu_seqlens_q, cu_seqlens_k, tiles, CAUSAL: gl.constexpr,
              VARLEN: gl.constexpr, PERSISTENT: gl.constexpr, STAGES: gl.constexpr, QBUF: gl.constexpr,
              CONSUMERS: gl.constexpr, KV_TOGETHER: gl.constexpr):
    ROWS: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    c = 0  # key blocks this program has streamed: the ring's position
    LISTED: gl.constexpr = PERSISTENT and not VARLEN and tiles is not None  # a dense call with the host's table
    e = 0  # LISTED: the next tile's entry, read a tile ahead
    if LISTED:
        run = _run(tiles)
        e = gl.load(tiles + run)
    for i in range(my_n):
        off_m, tb, h, q_row0, k_row0, sq, sk = _tile(i, seqlen_q, seqlen_k, heads, n_m, cu_seqlens_q, cu_seqlens_k,
                                                     tiles, e, CAUSAL, VARLEN, PERSISTENT, CONSUMERS * ROWS)
        if LISTED:
            # issued now, waited for at the next tile: a load at the tile's start stalled the
            # walk by its latency every tile (the last program reads the table's padding)
            e = gl.load(tiles + run + i + 1)
        hk = h // group
        n_end = _key_blocks(off_m, sq, sk, CONSUMERS * ROWS, BLOCK_N, CAUSAL)
        # K_0 first: its ring slot frees before this tile's Q buffer does (one Q buffer: only
        # once the previous tile's output, which leaves through it, has been read)
        slot = c % STAGES
        # mbarriers start with the phase before 0 complete: the first round of waits passes
        mbarrier.wait(k_empty.index(slot), ((c // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        _tma_load(k_desc, [tb, k_row0, hk, 0], k_ready.index(slot), k_smem.index(slot).reshape([1, BLOCK_N, 1, HEAD_DIM]))
        qb = (i % QBUF) * CONSUMERS
        for w in gl.static_range(CONSUMERS):
            mbarrier.wait(q_empty.index(qb + w), ((i // QBUF) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qb + w), q_desc.block_type.nbytes)
            _tma_load(q_desc, [tb, q_row0 + off_m + w * ROWS, h, 0], q_ready.index(qb + w),
                      q_smem.index(qb + w).reshape([1, ROWS, 1, HEAD_DIM]))
        # the order the consumers need them: K_{j+1} before V_j (S_{j+1} is issued before P_j V_j)
        for j in range(n_end):
            nxt = c + j + 1
            slot = nxt % STAGES
            more = j + 1 < n_end
            mbarrier.wait(k_empty.index(slot), ((nxt // STAGES) & 1) ^ 1, pred=more)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes, pred=more)
            _tma_load(k_desc, [tb, k_row0 + (j + 1) * BLOCK_N, hk, 0], k_ready.index(slot),
                      k_smem.index(slot).reshape([1, BLOCK_N, 1, HEAD_DIM]), pred=more)
            vslot = (c + j) % STAGES
            if not KV_TOGETHER:  # together: the wait for K_j's slot freed V_j's as well
                mbarrier.wait(v_empty.index(vslot), (((c + j) // STAGES) & 1) ^ 1)
            mbarrier.expect(v_ready.index(vslot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [tb, k_row0 + j * BLOCK_N, hk, 0], v_ready.index(vslot),
                      v_smem.index(vslot).reshape([1, BLOCK_N, 1, HEAD_DIM]))
        c += n_end


@gluon.jit
def _release(bar, THREAD_ARRIVE: gl.constexpr):
    """One consumer's arrival on a ring slot's empty barrier: every thread's (THREAD_ARRIVE), or
    one thread's after the warpgroup barrier Gluon puts before an arrive."""
    if THREAD_ARRIVE:
        async_copy.mbarrier_arrive(bar, increment_count=False)
    else:
        mbarrier.arrive(bar)


@gluon.jit
def _release_v(k_empty, v_empty, slot, KV_TOGETHER: gl.constexpr, THREAD_ARRIVE: gl.constexpr):
    """Hand ring slot ``slot`` back once its V is read: through its own barrier, or with
    KV_TOGETHER through the K barrier, whose arrival then frees K and V alike."""
    if KV_TOGETHER:
        _release(k_empty.index(slot), THREAD_ARRIVE)
    else:
        _release(v_empty.index(slot), THREAD_ARRIVE)


@gluon.jit
def _take_turn(turns, r, W: gl.constexpr):
    """Wait until the other consumer has issued its matmuls of ring position r-1 (W=0) or r (W=1).

    Each consumer's barrier completes one phase per arrival of the other; an mbarrier starts with
    the phase before 0 complete, so the first consumer's first wait passes at once.
    """
    if W == 0:
        mbarrier.wait(turns.index(0), (r & 1) ^ 1)
    else:
        mbarrier.wait(turns.index(1), r & 1)


@gluon.jit
def _to_operand(pf, dtype: gl.constexpr, PACK: gl.constexpr):
    """P (fp32) in ``dtype`` for the P·V matmul; with PACK (:data:`PACK_P`) and bf16, two values
    an instruction (``cvt.rn.bf16x2.f32 d, hi, lo``: the pack's second value goes high)."""
    if PACK and dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [pf], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return pf.to(dtype)


@gluon.jit
def _step(j, c, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turns, acc, p, m_i, l_i, row0, diag,
          seqlen_k, qk_scale, s_layout: gl.constexpr, STAGES: gl.constexpr, MASK: gl.constexpr,
          CAUSAL: gl.constexpr, HAS_PREV: gl.constexpr, KV_TOGETHER: gl.constexpr, W: gl.constexpr,
          PINGPONG: gl.constexpr, THREAD_ARRIVE: gl.constexpr, PIN_WAIT: gl.constexpr, TREE_MAX: gl.constexpr,
          LAZY_RESCALE: gl.constexpr, EXP2_POLY: gl.constexpr, PACK_P: gl.constexpr):
    """Key block j (ring position c + j) for one consumer: S_j, then P_{j-1} V_{j-1} beside the
    softmax of S_j."""
    ROWS: gl.constexpr = q.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    r = c + j
    slot = r % STAGES
    mbarrier.wait(k_ready.index(slot), (r // STAGES) & 1)
    if PINGPONG:
        _take_turn(turns, r, W)
    s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    if HAS_PREV:
        pslot = (r - 1) % STAGES
        mbarrier.wait(v_ready.index(pslot), ((r - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(pslot), acc, is_async=True)
        if PINGPONG:  # both matmuls issued: the other consumer's turn
            _release(turns.index(1 - W), THREAD_ARRIVE)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
    else:
        if PINGPONG:
            _release(turns.index(1 - W), THREAD_ARRIVE)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
    if not KV_TOGETHER:
        _release(k_empty.index(slot), THREAD_ARRIVE)
    pf, alpha, m_new, l_i = _softmax(s, m_i, l_i, j, row0, diag, seqlen_k, qk_scale, s_layout, ROWS, BLOCK_N, MASK,
                                     CAUSAL, TREE_MAX, LAZY_RESCALE, EXP2_POLY)
    if HAS_PREV:
        if PIN_WAIT:
            # P_j into registers of its own before the wait (P_{j-1}'s are still being read), then
            # the wait behind the row sums; as a dependency of the wait below, the conversion
            # stays above it in the PTX too
            p_next = gl.convert_layout(_to_operand(pf, p.dtype, PACK_P), p.type.layout)
            l_i = _after_softmax(l_i)
            acc, p_next = warpgroup_mma_wait(0, deps=(acc, p_next))
        else:
            acc = warpgroup_mma_wait(0, deps=(acc, ))
        _release_v(k_empty, v_empty, (r - 1) % STAGES, KV_TOGETHER, THREAD_ARRIVE)
    acc = _rescale(acc, gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None], LAZY_RESCALE)
    # without PIN_WAIT, P is converted here, after the rescale, as in the code that was measured
    if PIN_WAIT and HAS_PREV:
        p = p_next
    else:
        p = gl.convert_layout(_to_operand(pf, p.dtype, PACK_P), p.type.layout)
    return acc, p, m_new, l_i


@gluon.jit
def _hand_back_after_copy(bar):
    """Wait until the copy engine has read this warpgroup's pending output copy, then hand its
    buffer back to the producer (one arrival)."""
    tma.store_wait(pendings=0)
    _thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns, o_desc, o_ptr, stride_on,
              stride_oh, lse_ptr, stride_lb, stride_lh, seqlen_q, seqlen_k, heads, n_m, my_n, cu_seqlens_q,
              cu_seqlens_k, tiles, qk_scale, W: gl.constexpr, CAUSAL: gl.constexpr, STORE_LSE: gl.constexpr,
              STAGES: gl.constexpr, VARLEN: gl.constexpr, PERSISTENT: gl.constexpr, QBUF: gl.constexpr,
              CONSUMERS: gl.constexpr, KV_TOGETHER: gl.constexpr, PINGPONG: gl.constexpr,
              THREAD_ARRIVE: gl.constexpr, PIN_WAIT: gl.constexpr, TREE_MAX: gl.constexpr,
              LAZY_RESCALE: gl.constexpr, EXP2_POLY: gl.constexpr, UNROLL2: gl.constexpr,
              DEFERRED_STORE: gl.constexpr, PACK_P: gl.constexpr):
    ROWS: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    c = 0  # key blocks this program has consumed: the ring's position
    # DEFERRED_STORE: the previous tile's output copy is waited for inside the next tile
    DEFER: gl.constexpr = DEFERRED_STORE and QBUF == 2 and not VARLEN
    prev_qi = 0  # the Q/O buffer whose output copy is in flight (DEFER)
    LISTED: gl.constexpr = PERSISTENT and not VARLEN and tiles is not None  # as in _producer
    e = 0
    if LISTED:
        run = _run(tiles)
        e = gl.load(tiles + run)
    for i in range(my_n):
        off_m, b, h, q_row0, k_row0, sq, sk = _tile(i, seqlen_q, seqlen_k, heads, n_m, cu_seqlens_q, cu_seqlens_k,
                                                    tiles, e, CAUSAL, VARLEN, PERSISTENT, CONSUMERS * ROWS)
        if LISTED:
            e = gl.load(tiles + run + i + 1)  # the next tile's, as in _producer
        n_end = _key_blocks(off_m, sq, sk, CONSUMERS * ROWS, BLOCK_N, CAUSAL)
        row0 = off_m + W * ROWS
        diag = sk - sq
        # this warpgroup's own ranges: [0, n_full) unmasked, [n_full, my_end) masked; the
        # producer streams up to the tile's n_end, and the blocks past my_end are only handed
        # back below
        if CAUSAL:
            hi = gl.minimum(sk, row0 + ROWS + diag)
            n_full = gl.maximum(gl.minimum(sk, row0 + diag + 1), 0) // BLOCK_N
        else:
            hi = sk
            n_full = sk // BLOCK_N
        my_end = gl.minimum(gl.maximum((hi + BLOCK_N - 1) // BLOCK_N, 1), n_end)
        qi = (i % QBUF) * CONSUMERS + W
        q = q_smem.index(qi)
        mbarrier.wait(q_ready.index(qi), (i // QBUF) & 1)

        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        p = gl.zeros([ROWS, BLOCK_N], dtype, p_layout)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
        acc, p, m_i, l_i = _step(0, c, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turns, acc, p, m_i, l_i, row0,
                                 diag, sk, qk_scale, s_layout, STAGES, True, CAUSAL, False, KV_TOGETHER, W, PINGPONG,
                                 THREAD_ARRIVE, PIN_WAIT, TREE_MAX, LAZY_RESCALE, EXP2_POLY, PACK_P)
        if DEFER:
            if i > 0:  # the previous tile's output has had a key block's time to leave
                _hand_back_after_copy(q_empty.index(prev_qi))
        if UNROLL2:  # two steps a trip, then the odd one out (UNROLL2)
            for j2 in range(0, (n_full - 1) // 2):
                acc, p, m_i, l_i = _step(1 + 2 * j2, c, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turns, acc,
                                         p, m_i, l_i, row0, diag, sk, qk_scale, s_layout, STAGES, False, CAUSAL, True,
                                         KV_TOGETHER, W, PINGPONG, THREAD_ARRIVE, PIN_WAIT, TREE_MAX, LAZY_RESCALE,
                                         EXP2_POLY, PACK_P)
                acc, p, m_i, l_i = _step(2 + 2 * j2, c, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turns, acc,
                                         p, m_i, l_i, row0, diag, sk, qk_scale, s_layout, STAGES, False, CAUSAL, True,
                                         KV_TOGETHER, W, PINGPONG, THREAD_ARRIVE, PIN_WAIT, TREE_MAX, LAZY_RESCALE,
                                         EXP2_POLY, PACK_P)
            if (n_full - 1) % 2 == 1:
                acc, p, m_i, l_i = _step(n_full - 1, c, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turns, acc,
                                         p, m_i, l_i, row0, diag, sk, qk_scale, s_layout, STAGES, False, CAUSAL, True,
                                         KV_TOGETHER, W, PINGPONG, THREAD_ARRIVE, PIN_WAIT, TREE_MAX, LAZY_RESCALE,
                                         EXP2_POLY, PACK_P)
        else:
            for j in range(1, n_full):
                acc, p, m_i, l_i = _step(j, c, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turns, acc, p, m_i,
                                         l_i, row0, diag, sk, qk_scale, s_layout, STAGES, False, CAUSAL, True, KV_TOGETHER,
                                         W, PINGPONG, THREAD_ARRIVE, PIN_WAIT, TREE_MAX, LAZY_RESCALE, EXP2_POLY, PACK_P)
        for j in range(gl.maximum(n_full, 1), my_end):
            acc, p, m_i, l_i = _step(j, c, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turns, acc, p, m_i, l_i,
                                     row0, diag, sk, qk_scale, s_layout, STAGES, True, CAUSAL, True, KV_TOGETHER, W, PINGPONG,
                                     THREAD_ARRIVE, PIN_WAIT, TREE_MAX, LAZY_RESCALE, EXP2_POLY, PACK_P)
        last = c + my_end - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        _release_v(k_empty, v_empty, last % STAGES, KV_TOGETHER, THREAD_ARRIVE)
        # blocks the other warpgroup still needs: wait for each (so arrivals stay in phase
        # order) and hand it back untouched
        for j in range(c + my_end, c + n_end):
            if PINGPONG:  # the other consumer counts on one turn per ring position
                _take_turn(turns, j, W)
                _release(turns.index(1 - W), THREAD_ARRIVE)
            mbarrier.wait(k_ready.index(j % STAGES), (j // STAGES) & 1)
            if not KV_TOGETHER:
                _release(k_empty.index(j % STAGES), THREAD_ARRIVE)
            mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
            _release_v(k_empty, v_empty, j % STAGES, KV_TOGETHER, THREAD_ARRIVE)
        c += n_end

        empty = l_i == 0.0
        inv = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i))
        out = acc * gl.convert_layout(inv, gl.SliceLayout(1, o_layout))[:, None]
        if STORE_LSE:
            lse = gl.where(empty, float("inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
            offs_m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
            gl.store(lse_ptr + b * stride_lb + h * stride_lh + q_row0 + offs_m, lse, mask=offs_m < sq)
        if VARLEN:
            # the rows past this sequence's end belong to the next one: a bulk copy would
            # overwrite them, so the output leaves through a store masked at the sequence's end
            offs_r = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
            offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            rows = (q_row0 + offs_r).to(gl.int64) * stride_on
            gl.store(o_ptr + rows[:, None] + h * stride_oh + offs_d[None, :], out.to(dtype),
                     mask=offs_r[:, None] < sq)
        else:
            # this warpgroup's Q rows are read (every wgmma waited): their buffer takes the
            # output rows, and is handed back to the producer once the copy engine has read it
            q.store(out.to(dtype))
            fence_async_shared()
            _tma_store(o_desc, [b, row0, h, 0], q.reshape([1, ROWS, 1, HEAD_DIM]))
            if not DEFER:
                tma.store_wait(pendings=0)
                _thread_barrier()
        if DEFER:
            prev_qi = qi
        else:
            mbarrier.arrive(q_empty.index(qi))
    if DEFER:
        if my_n > 0:
            _hand_back_after_copy(q_empty.index(prev_qi))


# the persistent walk's tile counts stay runtime values: specialising them (a multiple of 16, or
# 1) would compile the kernel again for shapes that differ only in their batch or length
@gluon.jit(do_not_specialize=("n_m", "n_tiles"))
def _gluon_attn_fwd(q_desc, k_desc, v_desc, o_desc, o_ptr, stride_on, stride_oh, lse_ptr, stride_lb, stride_lh,
                    cu_seqlens_q, cu_seqlens_k, tiles, seqlen_q, seqlen_k, heads, group, n_m, n_tiles, qk_scale,
                    CAUSAL: gl.constexpr, STORE_LSE: gl.constexpr, STAGES: gl.constexpr, QBUF: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, VARLEN: gl.constexpr,
                    PERSISTENT: gl.constexpr, CONSUMERS: gl.constexpr, KV_TOGETHER: gl.constexpr,
                    PINGPONG: gl.constexpr, THREAD_ARRIVE: gl.constexpr, PIN_WAIT: gl.constexpr,
                    TREE_MAX: gl.constexpr, LAZY_RESCALE: gl.constexpr, EXP2_POLY: gl.constexpr,
                    UNROLL2: gl.constexpr, DEFERRED_STORE: gl.constexpr, PACK_P: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)

    if PERSISTENT and VARLEN:
        # the live tiles, counted on the GPU (packed_tiles): a tile in every full round of the
        # snake (_tile), and one more where this program's place in the last round is below what
        # is left over
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_live = gl.load(tiles) * heads
        rounds = n_live // nprog
        my_n = rounds + (_snake(rounds, pid, nprog) < n_live % nprog).to(gl.int32)
    elif PERSISTENT and tiles is not None:
        # the length of this program's run in the host's table (_schedule.table)
        pid = gl.program_id(0)
        my_n = gl.load(tiles + pid + 1) - gl.load(tiles + pid)
    elif PERSISTENT:
        # the tiles of pairs pid, pid + P, pid + 2P, ... (P programs); the last pair may hold one
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        my_pairs = ((n_tiles + 1) // 2 - pid + nprog - 1) // nprog
        my_n = 2 * my_pairs - (2 * (pid + (my_pairs - 1) * nprog) + 1 >= n_tiles).to(gl.int32)
    else:
        my_n = 1
    if PERSISTENT and VARLEN:
        live = True  # every tile this program takes has rows: my_n counts live ones only
    elif VARLEN:
        b = gl.program_id(1) // heads
        live = gl.program_id(0) * (CONSUMERS * ROWS) < gl.load(cu_seqlens_q + b + 1) - gl.load(cu_seqlens_q + b)
    else:
        # every dense program has rows: no test at all, so a dense call's code stays the one
        # measured (a runtime test around the partitions measured slower at d=128, bench/NOTES.md)
        live = True

    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS * QBUF, ROWS, HEAD_DIM], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS * QBUF, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS * QBUF, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if PINGPONG:
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    else:
        turns = q_ready  # never used: no barrier added, shared memory laid out as without turns
    for w in gl.static_range(CONSUMERS * QBUF):
        mbarrier.init(q_ready.index(w), count=1)
        mbarrier.init(q_empty.index(w), count=1)
    ARRIVALS: gl.constexpr = 128 if THREAD_ARRIVE else 1  # a consumer's arrivals per release
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS * ARRIVALS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS * ARRIVALS)
    if PINGPONG:
        for w in gl.static_range(2):
            mbarrier.init(turns.index(w), count=ARRIVALS)
    fence_async_shared()

    if live:
        # the partition lists are spelled out: warp_specialize takes a list literal of
        # (function, argument tuple) pairs, which a jit function cannot build in a loop
        if CONSUMERS == 3:
            # three 64-row consumers (FlashAttention-3's head_dim 64 tile): each K/V block serves
            # 192 query rows, and a third warpgroup's matmuls cover the other two's softmax
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns, o_desc,
                             o_ptr, stride_on, stride_oh, lse_ptr, stride_lb, stride_lh, seqlen_q, seqlen_k, heads, n_m,
                             my_n, cu_seqlens_q, cu_seqlens_k, tiles, qk_scale, 0, CAUSAL, STORE_LSE, STAGES, VARLEN,
                             PERSISTENT, QBUF, CONSUMERS, KV_TOGETHER, False, THREAD_ARRIVE, PIN_WAIT, TREE_MAX,
                             LAZY_RESCALE, EXP2_POLY, UNROLL2, DEFERRED_STORE, PACK_P)),
                (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns, o_desc,
                             o_ptr, stride_on, stride_oh, lse_ptr, stride_lb, stride_lh, seqlen_q, seqlen_k, heads, n_m,
                             my_n, cu_seqlens_q, cu_seqlens_k, tiles, qk_scale, 1, CAUSAL, STORE_LSE, STAGES, VARLEN,
                             PERSISTENT, QBUF, CONSUMERS, KV_TOGETHER, False, THREAD_ARRIVE, PIN_WAIT, TREE_MAX,
                             LAZY_RESCALE, EXP2_POLY, UNROLL2, DEFERRED_STORE, PACK_P)),
                (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns, o_desc,
                             o_ptr, stride_on, stride_oh, lse_ptr, stride_lb, stride_lh, seqlen_q, seqlen_k, heads, n_m,
                             my_n, cu_seqlens_q, cu_seqlens_k, tiles, qk_scale, 2, CAUSAL, STORE_LSE, STAGES, VARLEN,
                             PERSISTENT, QBUF, CONSUMERS, KV_TOGETHER, False, THREAD_ARRIVE, PIN_WAIT, TREE_MAX,
                             LAZY_RESCALE, EXP2_POLY, UNROLL2, DEFERRED_STORE, PACK_P)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                             v_ready, v_empty, seqlen_q, seqlen_k, heads, group, n_m, my_n, cu_seqlens_q, cu_seqlens_k,
                             tiles, CAUSAL, VARLEN, PERSISTENT, STAGES, QBUF, CONSUMERS, KV_TOGETHER)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns, o_desc,
                             o_ptr, stride_on, stride_oh, lse_ptr, stride_lb, stride_lh, seqlen_q, seqlen_k, heads, n_m,
                             my_n, cu_seqlens_q, cu_seqlens_k, tiles, qk_scale, 0, CAUSAL, STORE_LSE, STAGES, VARLEN,
                             PERSISTENT, QBUF, CONSUMERS, KV_TOGETHER, PINGPONG, THREAD_ARRIVE, PIN_WAIT, TREE_MAX,
                             LAZY_RESCALE, EXP2_POLY, UNROLL2, DEFERRED_STORE, PACK_P)),
                (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns, o_desc,
                             o_ptr, stride_on, stride_oh, lse_ptr, stride_lb, stride_lh, seqlen_q, seqlen_k, heads, n_m,
                             my_n, cu_seqlens_q, cu_seqlens_k, tiles, qk_scale, 1, CAUSAL, STORE_LSE, STAGES, VARLEN,
                             PERSISTENT, QBUF, CONSUMERS, KV_TOGETHER, PINGPONG, THREAD_ARRIVE, PIN_WAIT, TREE_MAX,
                             LAZY_RESCALE, EXP2_POLY, UNROLL2, DEFERRED_STORE, PACK_P)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                             v_ready, v_empty, seqlen_q, seqlen_k, heads, group, n_m, my_n, cu_seqlens_q, cu_seqlens_k,
                             tiles, CAUSAL, VARLEN, PERSISTENT, STAGES, QBUF, CONSUMERS, KV_TOGETHER)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def q_buffers(head_dim: int, block_n: int, stages: int, consumers: int = 2) -> int:
    """How many sets of Q buffers (one 64-row part per consumer each) fit beside the K/V ring:
    two let the producer load a persistent program's next tile while this one's output still
    leaves through its own; one at head_dim 256."""
    ring = stages * 2 * block_n * head_dim * 2
    return 2 if ring + 2 * consumers * ROWS * head_dim * 2 <= SHARED_BYTES else 1


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def tile_for(head_dim: int) -> Optional[Tuple[int, int]]:
    """(BLOCK_N, STAGES) for a head dim this kernel serves, else None."""
    return TILES.get(head_dim)


def call_tile(head_dim: int, causal: bool, tokens: int, varlen: bool) -> Tuple[int, int]:
    """(BLOCK_N, STAGES) of one call: :data:`SHORT_CAUSAL_TILES` for a dense causal call whose
    query and key lengths (``tokens``: the larger) are at most its number of tokens, else
    :data:`TILES`. Raises KeyError for a head dim :func:`tile_for` does not serve."""
    short = SHORT_CAUSAL_TILES.get(head_dim)
    if short is not None and causal and not varlen and tokens <= short[0]:
        return short[1]
    return TILES[head_dim]


def packed_tiles(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, n_m: int, tile_m: int, block_n: int,
                 causal: bool) -> torch.Tensor:
    """The persistent packed call's tile list, built on the GPU without a host sync: int32
    ``[1 + batch * n_m]``, entry 0 the number of live (sequence, row block) pairs, then every pair
    as ``b * n_m + m``, the live ones first, longest (most key blocks read) first; the kernel
    deals each live pair's heads out in a snake (``_tile``). Raises nothing."""
    lens_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    lens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    rows = torch.arange(0, n_m * tile_m, tile_m, device=cu_seqlens_q.device, dtype=torch.int32)
    live = rows < lens_q[:, None]
    if causal:  # a row block reads keys up to its last row's diagonal (bottom-right aligned)
        keys = torch.minimum(lens_k[:, None], rows + (tile_m + lens_k - lens_q)[:, None])
    else:
        keys = lens_k[:, None].expand_as(live)
    # a dead pair sorts last (-1); a live one that reads no key still costs its one block
    blocks = torch.where(live, torch.clamp((keys + block_n - 1) // block_n, min=1), -1)
    order = torch.argsort(blocks.flatten(), descending=True, stable=True)
    return torch.cat([live.sum(dtype=torch.int32).view(1), order.to(torch.int32)])


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether q/k/v (dense ``[B, S, H, D]`` or packed ``[total, H, D]``) meet this kernel's
    layout needs.

    bf16 only (the dtype it was checked and timed in); the copy engine needs a non-empty tensor,
    the base 16-byte aligned, unit stride along D and every other stride a multiple of 16 bytes.
    Raises nothing.
    """
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16):
        return False
    if q.dim() not in (3, 4) or tile_for(q.shape[-1]) is None or 0 in q.shape or 0 in k.shape:
        return False
    # an ``and`` chain, not all() over a generator: this runs on every call
    return copy_engine_reads(q) and copy_engine_reads(k) and copy_engine_reads(v)


def copy_engine_reads(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can address ``t``: the base 16-byte aligned, unit stride along the
    last dim, every other stride of a dim longer than 1 positive and a multiple of 16 bytes (an
    expanded tensor, stride 0, as a gradient of a broadcast can be, goes to the Triton kernels).
    Raises nothing."""
    if t.data_ptr() & 15:
        return False
    # Why a memo: a training step asks this of seven tensors, and the walk over the strides costs
    # several times the lookup; the answer depends on shape, strides and dtype only
    key = (t.shape, t.stride(), t.dtype)
    ok = _READS.get(key)
    if ok is None:
        if len(_READS) >= _READS_MAX:  # packed calls bring a new total length each step: stay bounded
            _READS.clear()
        ok = _READS[key] = t.stride(-1) == 1 and all(
            (s * t.element_size()) % 16 == 0 and (s > 0 or n == 1) for s, n in zip(t.stride()[:-1], t.shape[:-1]))
    return ok


_READS: dict = {}
_READS_MAX = 4096


@functools.lru_cache(maxsize=None)
def _shared_layout(rows: int, head_dim: int) -> gl.NVMMASharedLayout:
    # asked four times per forward call: computed once per tile shape
    return gl.NVMMASharedLayout.get_default_for([1, rows, 1, head_dim], gl.bfloat16)


def _descriptor(t: torch.Tensor, rows: int, head_dim: int) -> TensorDescriptor:
    return make_descriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, head_dim], _shared_layout(rows, head_dim))


_DESCRIPTOR_FIELDS = ("base", "shape", "strides", "block_shape", "layout", "padding")
# Triton 3.7 adds round_f32_to_tf32 (the constructor's default, False: the copy engine does not
# round fp32 to tf32)
_DESCRIPTOR_FIELDS_TF32 = _DESCRIPTOR_FIELDS + ("round_f32_to_tf32",)
_FIELDS = tuple(getattr(TensorDescriptor, "__dataclass_fields__", ()))
_TF32_FIELD = _FIELDS == _DESCRIPTOR_FIELDS_TF32
# the check-free construction below fills exactly these fields: any other TensorDescriptor
# (another Triton release) and the launch check mode go through its constructor
_UNCHECKED_DESCRIPTORS = (_FIELDS in (_DESCRIPTOR_FIELDS, _DESCRIPTOR_FIELDS_TF32)
                          and os.environ.get("FLASH_ATTN2_LAUNCH_CHECK", "0") != "1")


def make_descriptor(base: Any, shape: List[int], strides: List[int], block_shape: List[int],
                    layout: gl.NVMMASharedLayout) -> TensorDescriptor:
    """A host TMA descriptor (``TensorDescriptor(base, shape, strides, block_shape, layout)``).

    Why not the constructor: it re-checks rank, alignment, strides and block shape on every
    call, several µs of host time, and a training step builds eleven. Each caller passes a
    tensor :func:`supports` (or ``_gluon_bwd.supports``) accepted or a fresh allocation, and a
    block shape fixed in this package, so the checks cannot fail here; with
    ``FLASH_ATTN2_LAUNCH_CHECK=1`` (the GPU check) the constructor runs them anyway. Raises
    AssertionError (the constructor's) only in that mode.
    """
    if not _UNCHECKED_DESCRIPTORS:
        return TensorDescriptor(base, shape, strides, block_shape, layout)
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.layout, desc.padding = (
        base, shape, strides, block_shape, layout, "zero")
    if _TF32_FIELD:
        desc.round_f32_to_tf32 = False
    return desc


def gluon_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    store_lse: bool = True,
    tile: Optional[Tuple[int, int]] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    persistent: Optional[bool] = None,
    consumers: Optional[int] = None,
    kv_together: Optional[bool] = None,
    pingpong: Optional[bool] = None,
    thread_arrive: Optional[bool] = None,
    pin_wait: Optional[bool] = None,
    tree_max: Optional[bool] = None,
    lazy_rescale: Optional[bool] = None,
    exp2_poly: Optional[int] = None,
    unroll2: Optional[bool] = None,
    deferred_store: Optional[bool] = None,
    pack_p: Optional[bool] = None,
    schedule: Optional[bool] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run the Gluon forward; the caller checked :func:`supports`. Returns ``(out, lse)``.

    Packed sequences: q ``[total_q, H, D]``, k/v ``[total_k, Hk, D]`` with int32 ``cu_seqlens_q``
    / ``cu_seqlens_k`` and ``max_seqlen_q``; out like q, lse ``[H, total_q]`` (``_triton_fwd``'s
    varlen layouts). ``tile`` (BLOCK_N, STAGES) overrides :func:`call_tile` and ``persistent``
    :data:`PERSISTENT` (packed calls: :data:`PERSISTENT_VARLEN`), ``consumers``
    (2 or 3 consumer warpgroups of 64 rows) :data:`CONSUMERS`, and ``kv_together``, ``pingpong``,
    ``thread_arrive``, ``pin_wait``, ``tree_max`` and ``lazy_rescale`` the head-dim sets of the same
    names in capitals, ``exp2_poly`` (0-4 of every 8 exponentials on the FMA units) :data:`EXP2_POLY`
    and ``unroll2`` / ``deferred_store`` / ``pack_p`` :data:`UNROLL2` / :data:`DEFERRED_STORE` /
    :data:`PACK_P`, and ``schedule`` (a dense persistent call's tiles read from ``_schedule``'s
    table where it deals them better than the formula in the kernel) :data:`SCHEDULE`.
    Raises what Triton raises on compile errors.
    """
    varlen = cu_seqlens_q is not None
    head_dim = q.shape[-1]
    out = fresh_like(q)
    if varlen:
        batch, seqlen_q, seqlen_k = cu_seqlens_q.numel() - 1, int(max_seqlen_q), 0  # lengths: per sequence
        total_q, heads, _ = q.shape
        heads_k = k.shape[1]
        lse = torch.empty(heads, total_q, device=q.device, dtype=torch.float32) if store_lse else None
        lse_strides = (0, lse.stride(0)) if store_lse else (0, 0)
        # one batch of all the tokens: each program finds its sequence's rows in it
        q4, k4, v4, o4 = (t.unsqueeze(0) for t in (q, k, v, out))
    else:
        batch, seqlen_q, heads, _ = q.shape
        seqlen_k, heads_k = k.shape[1], k.shape[2]
        lse = torch.empty(batch, heads, seqlen_q, device=q.device, dtype=torch.float32) if store_lse else None
        lse_strides = (lse.stride(0), lse.stride(1)) if store_lse else (0, 0)
        q4, k4, v4, o4 = q, k, v, out
    block_n, stages = tile or call_tile(head_dim, causal, max(seqlen_q, seqlen_k), varlen)
    if batch == 0 or seqlen_q == 0:
        return out, lse
    preset = call_choices(head_dim, causal, varlen)
    if preset:
        consumers = preset.get("consumers") if consumers is None else consumers
        pin_wait = preset.get("pin_wait") if pin_wait is None else pin_wait
        pack_p = preset.get("pack_p") if pack_p is None else pack_p
    consumers = consumers or CONSUMERS.get(head_dim, 2)
    tile_m = consumers * ROWS
    n_m = (seqlen_q + tile_m - 1) // tile_m  # not triton.cdiv: a jit-wrapped helper, µs a call
    if persistent is None:
        persistent = PERSISTENT_VARLEN if varlen else PERSISTENT
    tiles = None
    if persistent and varlen:
        # programs enough for every (sequence, row block, head) triple, which bounds the live ones
        tiles = packed_tiles(cu_seqlens_q, cu_seqlens_k, n_m, tile_m, block_n, causal)
        n_tiles = 0
        grid = (min(n_m * batch * heads, _sm_count(q.device)), 1)
    elif persistent:
        n_tiles = n_m * batch * heads
        sms = _sm_count(q.device)
        dealt = None
        if SCHEDULE if schedule is None else schedule:
            dealt = _schedule.device_table(q.device, batch * heads, n_m, tile_m, block_n, seqlen_q, seqlen_k,
                                           bool(causal), sms)
        if dealt is not None:
            tiles, programs = dealt
            grid = (programs, 1)
        else:
            grid = (min((n_tiles + 1) // 2, sms), 1)
    else:
        n_tiles = 0
        grid = (n_m, batch * heads)
    args = (
        _descriptor(q4, ROWS, head_dim), _descriptor(k4, block_n, head_dim), _descriptor(v4, block_n, head_dim),
        # the output's pointer and strides serve the packed store only: None (compile-time) for dense calls
        _descriptor(o4, ROWS, head_dim), *((out, out.stride(-3), out.stride(-2)) if varlen else (None, None, None)),
        lse if store_lse else out,
        *lse_strides, cu_seqlens_q, cu_seqlens_k if varlen else None, tiles,
        seqlen_q, seqlen_k, heads, heads // heads_k, n_m, n_tiles, float(softmax_scale) * LOG2E,
    )
    regs = REGS if consumers == 2 else REGS_3
    constexprs = (bool(causal), store_lse, stages, q_buffers(head_dim, block_n, stages, consumers), regs[0], regs[1],
                  varlen, persistent, consumers, head_dim in KV_TOGETHER if kv_together is None else bool(kv_together),
                  head_dim in PINGPONG if pingpong is None else bool(pingpong),
                  head_dim in THREAD_ARRIVE if thread_arrive is None else bool(thread_arrive),
                  head_dim in PIN_WAIT if pin_wait is None else bool(pin_wait),
                  head_dim in TREE_MAX if tree_max is None else bool(tree_max),
                  head_dim in LAZY_RESCALE if lazy_rescale is None else bool(lazy_rescale),
                  EXP2_POLY.get(head_dim, 0) if exp2_poly is None else int(exp2_poly),
                  head_dim in UNROLL2 if unroll2 is None else bool(unroll2),
                  head_dim in DEFERRED_STORE if deferred_store is None else bool(deferred_store),
                  head_dim in PACK_P if pack_p is None else bool(pack_p))
    if WARM_BOTH_DEALS and persistent and not varlen:
        _warm_other_deal(q.device, consumers, tiles is not None, args, constexprs)
    _LAUNCHERS[varlen, consumers, tiles is not None]((*grid, 1), args, constexprs, 4, 1)
    return out, lse


# Under `kernel-loader warmup` (which sets FLASH_ATTN2_WARMUP=1): a dense persistent call also
# compiles the build it did not take, with or without the host's tile table. Why: which one a call
# takes depends on its batch, heads and length (_schedule.device_table), so a compile cache warmed
# with one batch would miss the other build for a job run with another
WARM_BOTH_DEALS = os.environ.get("FLASH_ATTN2_WARMUP", "0") == "1"
_WARMED_DEALS: set = set()


def _warm_other_deal(device: torch.device, consumers: int, listed: bool, args: tuple, constexprs: tuple) -> None:
    """Compile, without launching, the dense forward's other build (see WARM_BOTH_DEALS), once per
    configuration in a process. Raises nothing: a build that fails to compile here is named in a
    RuntimeWarning (the call that asked goes on; a job that needs that build compiles it then)."""
    key = (device, consumers, listed, constexprs)
    if key in _WARMED_DEALS:
        return
    _WARMED_DEALS.add(key)
    other = list(args)
    # the table's slot: any int32 pointer compiles the same (a meta tensor: address 0, aligned)
    other[_TILES_ARG] = None if listed else torch.empty(1, dtype=torch.int32, device="meta")
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            _LAUNCHERS[False, consumers, not listed].warmup(tuple(other), constexprs, 4, 1)
    except Exception as e:  # noqa: BLE001 - reported, and the call that asked is not the one failing
        warnings.warn(f"flash-attn2 warmup: the Gluon forward's build {'without' if listed else 'with'} the tile "
                      f"table did not compile ({type(e).__name__}: {e}); jobs whose batch takes it compile it "
                      "on their first call", RuntimeWarning, stacklevel=3)


# the launches through _launch's cached path, one Launcher per (packed, consumers, tile list): a
# dense call's argument slots hold None where a packed one's hold the output's pointer and
# strides, a per-tile packed call's None where a persistent one's holds its tile list, and the
# register split (maxnreg) differs with the number of consumers
_LAUNCHERS = {(varlen, n, listed): Launcher(_gluon_attn_fwd, maxnreg=(REGS if n == 2 else REGS_3)[2])
              for varlen in (False, True) for n in (2, 3) for listed in (False, True)}
_TILES_ARG = _gluon_attn_fwd.arg_names.index("tiles")  # its place among the launch's arguments
