"""``@triton.jit`` pieces shared by the forward and backward kernels: what one tile needs.

* ``_seq_bounds``: where batch row ``b`` starts and how long it is (dense, packed, seqused_k);
* ``_key_range`` / ``_query_range``: which blocks a row block (forward, dQ) or a key block
  (dK/dV) visits, and the part of them that needs no mask;
* ``_scores``, ``_allowed``, ``_dropout_keep``: the score transform, the causal/window/end mask
  and dropout's keep mask of a tile;
* ``_load_tile``: a ``[rows, BLOCK_D]`` load masked only where the shape needs it;
* ``_row_offsets``: row index times row stride, in 64 bits where a tensor needs it (``WIDE``).

Arguments travel in small tuples so the inner loops keep short signatures (Triton flattens them;
the compiled code is the same as with separate arguments):

* ``win = (seqlen_k, diag, window_left, window_right)``: the mask geometry of a batch row, with
  ``diag = seqlen_k - seqlen_q`` (bottom-right aligned causal / window masks);
* ``sc = (qk_scale, softcap_scale, softcap, slope2)``: the score transform (log2 units;
  ``slope2`` is the row's ALiBi slope times log2(e));
* ``rng = (seed, rng_base, rng_sk, dropout_p)``: dropout's counter-based draw;
Compile-time flags (``HAS_LEFT``, ``EVEN_D``, ...) stay separate ``tl.constexpr`` parameters: a
tuple of them unpacked inside a jit function loses constness (an ``if`` on it becomes a runtime
branch; Triton 3.6 and 3.9).
"""

from __future__ import annotations

import triton
import triton.language as tl

_INT32_SPAN = 2**31


def needs_wide_offsets(*spans: int) -> bool:
    """Whether a row offset (row index times row stride, in elements) can pass 2**31; ``spans``
    are each tensor's row count times its row stride.

    Callers pass integers they already hold (reading a tensor's shape and strides again costs
    host time on every call). Conservative: a view whose last row ends just below the limit
    takes the 64-bit variant too, which is only a little slower.
    """
    return max(spans) >= _INT32_SPAN


@triton.jit
def _tanh(x):
    # 1 - 2/(e^{2x}+1) saturates cleanly to +-1 and runs under the interpreter (no libdevice).
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _seq_bounds(b, CuQ, CuK, SeqUsedK, seqlen_q_dense, seqlen_k_dense,
                IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr):
    """(q_start, seqlen_q, k_start, seqlen_k) of batch row ``b``: packed rows read their
    cu_seqlens, dense rows start at 0 with the tensors' lengths; seqused_k then caps the keys."""
    if IS_VARLEN:
        q_start = tl.load(CuQ + b)
        seqlen_q = tl.load(CuQ + b + 1) - q_start
        k_start = tl.load(CuK + b)
        seqlen_k = tl.load(CuK + b + 1) - k_start
    else:
        q_start = 0
        seqlen_q = seqlen_q_dense
        k_start = 0
        seqlen_k = seqlen_k_dense
    if HAS_SEQUSED:
        seqlen_k = tl.load(SeqUsedK + b)
    return q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def _scores(qk, offs_m, offs_n, diag, sc, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
            TRANS: tl.constexpr = False):
    """Raw q.k -> scores in log2 units (softcap, then ALiBi, as flash-attn orders them).

    TRANS: the tile is [keys, queries] (the backward's dK/dV layout).
    """
    qk_scale, softcap_scale, softcap, slope2 = sc
    if HAS_SOFTCAP:
        s = _tanh(qk * softcap_scale) * (softcap * 1.4426950408889634)
    else:
        s = qk * qk_scale
    if HAS_ALIBI:
        if TRANS:
            dist = (offs_m[None, :] + diag - offs_n[:, None]).to(tl.float32)
        else:
            dist = (offs_m[:, None] + diag - offs_n[None, :]).to(tl.float32)
        s = s - slope2 * tl.abs(dist)
    return s


@triton.jit
def _allowed(offs_m, offs_n, win, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
             TRANS: tl.constexpr = False, EVEN_N: tl.constexpr = False):
    """Which scores of the tile are kept. EVEN_N: every key block lies below seqlen_k, so with a
    right bound the end-of-sequence test is redundant (one compare and one AND less per score)."""
    seqlen_k, diag, window_left, window_right = win
    if TRANS:
        rows = offs_m[None, :]
        cols = offs_n[:, None]
    else:
        rows = offs_m[:, None]
        cols = offs_n[None, :]
    if EVEN_N and HAS_RIGHT:
        ok = cols <= rows + diag + window_right
    else:
        ok = cols < seqlen_k
        if HAS_RIGHT:
            ok = ok & (cols <= rows + diag + window_right)
    if HAS_LEFT:
        ok = ok & (cols >= rows + diag - window_left)
    return ok


@triton.jit
def _dropout_keep(rng, offs_m, offs_n, TRANS: tl.constexpr = False):
    """Keep mask for a [M, N] tile ([N, M] with TRANS); one offset per (batch, head, query, key),
    so the forward, both backward kernels and the debug hook draw the same numbers."""
    seed, rng_base, rng_sk, dropout_p = rng
    if TRANS:
        offs = rng_base + offs_m[None, :].to(tl.int64) * rng_sk + offs_n[:, None]
    else:
        offs = rng_base + offs_m[:, None].to(tl.int64) * rng_sk + offs_n[None, :]
    return tl.rand(seed, offs) >= dropout_p


@triton.jit
def _load_tile(ptrs, offs_r, n_rows, offs_d, head_dim, ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """A ``[rows, BLOCK_D]`` tile; rows at or past ``n_rows`` (ROW_MASK) and padded head dims
    (not EVEN_D) read 0. Unmasked loads are the bulk: no predicate, full vector width."""
    if ROW_MASK:
        mask = offs_r[:, None] < n_rows
        if not EVEN_D:
            mask = mask & (offs_d[None, :] < head_dim)
        x = tl.load(ptrs, mask=mask, other=0.0)
    elif EVEN_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=offs_d[None, :] < head_dim, other=0.0)
    return x


@triton.jit
def _row_offsets(offs, stride, WIDE: tl.constexpr):
    """``offs * stride``, the element offset of each row from the row block's base pointer.

    32-bit products are what the kernels compile to by default; they wrap past 2**31 elements
    (a row stride of 256 reaches that at 8.4M rows: transformers' continuous batching hands a
    whole paged cache as one sequence). ``WIDE`` (host: :func:`needs_wide_offsets`) computes them
    in 64 bits; only tensors that large compile that variant."""
    if WIDE:
        offs = offs.to(tl.int64)
    return offs * stride


@triton.jit
def _key_range(m0, seqlen_q, seqlen_k, diag, window_left, window_right,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key blocks [lo, hi) that rows [m0, m0+BLOCK_M) can see, and the unmasked part [flo, fhi)."""
    lo = 0
    hi = seqlen_k
    flo = 0
    fhi = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = tl.maximum(m0 + diag - window_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        flo = tl.maximum(m0 + BLOCK_M - 1 + diag - window_left, 0)
        flo = ((flo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(m0 + BLOCK_M + diag + window_right, seqlen_k)
        fhi = tl.minimum(m0 + diag + window_right + 1, seqlen_k)
        fhi = (tl.maximum(fhi, 0) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    flo = tl.minimum(tl.maximum(flo, lo), hi)
    fhi = tl.maximum(tl.minimum(fhi, hi), flo)
    return lo, hi, flo, fhi


@triton.jit
def _query_range(n0, seqlen_q, seqlen_k, diag, window_left, window_right,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query blocks [lo, hi) that can see keys [n0, n0+BLOCK_N), and the unmasked part [flo, fhi)
    (empty when the key block is the partial last one: every query block then needs the
    key-end mask)."""
    lo = 0
    hi = seqlen_q
    flo = 0
    fhi = (seqlen_q // BLOCK_M) * BLOCK_M
    if HAS_RIGHT:
        lo = tl.maximum(n0 - diag - window_right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
        flo = tl.maximum(n0 + BLOCK_N - 1 - diag - window_right, 0)
        flo = ((flo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(n0 + BLOCK_N - diag + window_left, seqlen_q)
        fhi = tl.minimum(n0 - diag + window_left + 1, seqlen_q)
        fhi = (tl.maximum(fhi, 0) // BLOCK_M) * BLOCK_M
    if n0 + BLOCK_N > seqlen_k:
        fhi = flo
    hi = tl.maximum(hi, lo)
    flo = tl.minimum(tl.maximum(flo, lo), hi)
    fhi = tl.maximum(tl.minimum(fhi, hi), flo)
    return lo, hi, flo, fhi
