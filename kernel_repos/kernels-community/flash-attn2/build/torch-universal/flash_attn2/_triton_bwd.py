"""Triton backward kernels: delta preprocess, dK/dV (one program per key block and KV head), dQ.

Entry point::

    attention_backward(do, q, k, v, out, lse, *, <same layout and option arguments as
                       _triton_fwd.attention_forward>) -> (dq, dk, dv)

The dK/dV program of a KV head walks the query heads of its GQA group itself, so no atomics are
needed and the result is deterministic. The scores are recomputed in log2 units exactly as the
forward pass computed them, and dropout redraws the same mask from ``seed``.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import _configs, _gluon_dispatch, _launch, _lazy
from ._launch import Launcher
from ._triton_fwd import LOG2E, device_capability, fresh_like, next_pow2_dim
from ._triton_tile import (
    _allowed,
    _dropout_keep,
    _key_range,
    _load_tile,
    _query_range,
    _row_offsets,
    _scores,
    _seq_bounds,
    _tanh,
    needs_wide_offsets,
)


@triton.jit
def _delta_kernel(
    Out, DO, Delta, CuQ, DQA,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    stride_lb, stride_lh, stride_lm,
    seqlen_q_dense, n_heads_q, head_dim,
    IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ZERO_DQA: tl.constexpr,
):
    """delta = rowsum(O * dO) per query row and head; with ``ZERO_DQA`` (dense calls of the fused
    dQ modes) also zeroes the rows of the fp32 dQ buffer ``DQA`` (``[batch * heads * seqlen_q,
    BLOCK_D]``, rows head-major) that this program's query rows own: every row, once, before
    the kernel that adds into it (same stream)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads_q
    h = pid_bh % n_heads_q
    if IS_VARLEN:
        q_start = tl.load(CuQ + b)
        seqlen_q = tl.load(CuQ + b + 1) - q_start
    else:
        q_start = 0
        seqlen_q = seqlen_q_dense
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
    b64 = b.to(tl.int64)
    row = (q_start + offs_m).to(tl.int64)
    o = tl.load(Out + b64 * stride_ob + h * stride_oh + row[:, None] * stride_om + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b64 * stride_dob + h * stride_doh + row[:, None] * stride_dom + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + b64 * stride_lb + h * stride_lh + row * stride_lm, tl.sum(o * do, 1),
             mask=offs_m < seqlen_q)
    if ZERO_DQA:
        acc_row = pid_bh.to(tl.int64) * seqlen_q + offs_m
        tl.store(DQA + acc_row[:, None] * BLOCK_D + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32),
                 mask=(offs_m < seqlen_q)[:, None])


@triton.jit
def _dq_cast_kernel(
    Acc, DQ,
    stride_dqb, stride_dqm, stride_dqh,
    rows_head, n_heads_q, head_dim, scale,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dQ from the fused modes' fp32 buffer: rows head-major (``[.., heads, tokens, BLOCK_D]``)
    -> dq's ``[.., tokens, heads, head_dim]``, scaled and cast. One pass that reads the buffer in
    whole rows and writes whole head rows of dq, where torch's strided multiply of the
    transposed view ran well below the memory rate (bench/NOTES.md)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads_q
    h = pid_bh % n_heads_q
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < rows_head
    acc_row = pid_bh.to(tl.int64) * rows_head + offs_m
    x = tl.load(Acc + acc_row[:, None] * BLOCK_D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    dst = DQ + b.to(tl.int64) * stride_dqb + h * stride_dqh + offs_m.to(tl.int64)[:, None] * stride_dqm + offs_d[None, :]
    tl.store(dst, (x * scale).to(DQ.dtype.element_ty, fp_downcast_rounding="rtne"), mask=row_ok[:, None] & (offs_d[None, :] < head_dim))


@triton.jit
def _add_dq(dqa, dq, m0, offs_m, offs_d, seqlen_q, MASKED: tl.constexpr, DQ_MODE: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """Add one block pair's share of dQ (fp32, unscaled) at rows ``m0 + [0, BLOCK_M)`` of a head.

    ``dqa = (DQA, row0)``: the fp32 accumulator, ``[rows, BLOCK_D]`` contiguous, and the head's
    first row in it. DQ_MODE 2: one bulk (TMA) reduce-add through the descriptor DQA; the rows
    past the sequence's end add zeros (their scores were masked) and the copy engine clips the
    tensor's end. DQ_MODE 1: per-element atomics (the interpreter has no bulk reduce)."""
    DQA, row0 = dqa
    if DQ_MODE == 2:
        DQA.atomic_add([(row0 + m0).to(tl.int32), 0], dq)
    else:
        ptrs = DQA + (row0 + offs_m)[:, None] * BLOCK_D + offs_d[None, :]
        if MASKED:
            tl.atomic_add(ptrs, dq, mask=offs_m[:, None] < seqlen_q, sem="relaxed")
        else:
            tl.atomic_add(ptrs, dq, sem="relaxed")


@triton.jit
def _bwd_dkdv_inner(grads, k, v, rows, offs_n, offs_d, start, end, seqlen_q, head_dim, win, sc, rng,
                    dqa,
                    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
                    MASKED: tl.constexpr, BLOCK_M: tl.constexpr,
                    KEYS_AS_ROWS: tl.constexpr, WANT: tl.constexpr, WIDE: tl.constexpr,
                    DQ_MODE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Add query blocks [start, end) of one query head to ``grads = (dk, dv)`` of one key block.

    ``rows = (q_base, do_base, lse_base, delta_base, stride_qm, stride_dom, stride_lm)`` point at
    that head's rows; ``WANT = (WANT_DK, WANT_DV)`` (the two-pass mode wants one at a time).
    DQ_MODE 1 or 2 also adds each block's dS.K into the dQ accumulator ``dqa`` (see _add_dq):
    five matmuls per block pair, and no dQ kernel recomputing the scores."""
    dk, dv = grads
    q_base, do_base, lse_base, delta_base, stride_qm, stride_dom, stride_lm = rows
    WANT_DK: tl.constexpr = WANT[0]
    WANT_DV: tl.constexpr = WANT[1]
    diag = win[1]
    offs_mb = tl.arange(0, BLOCK_M)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + offs_mb
        q = _load_tile(q_base + _row_offsets(offs_m[:, None], stride_qm, WIDE) + offs_d[None, :], offs_m, seqlen_q,
                       offs_d, head_dim, MASKED, EVEN_D)
        do = _load_tile(do_base + _row_offsets(offs_m[:, None], stride_dom, WIDE) + offs_d[None, :], offs_m, seqlen_q,
                        offs_d, head_dim, MASKED, EVEN_D)
        if MASKED:
            row_ok = offs_m < seqlen_q
            lse2 = tl.load(lse_base + offs_m * stride_lm, mask=row_ok, other=float("inf")) * 1.4426950408889634
            delta = tl.load(delta_base + offs_m * stride_lm, mask=row_ok, other=0.0)
        else:
            lse2 = tl.load(lse_base + offs_m * stride_lm) * 1.4426950408889634
            delta = tl.load(delta_base + offs_m * stride_lm)
        if KEYS_AS_ROWS:
            # Tiles are [keys, queries]: dK and dV accumulate with no transpose, but k and v
            # must live in registers as the left operand.
            qkT = tl.dot(k, tl.trans(q))
            sT = _scores(qkT, offs_m, offs_n, diag, sc, HAS_SOFTCAP, HAS_ALIBI, True)
            if MASKED:
                sT = tl.where(_allowed(offs_m, offs_n, win, HAS_LEFT, HAS_RIGHT, True), sT, float("-inf"))
            pT = tl.exp2(sT - lse2[None, :])
            dpT = tl.zeros_like(pT)
            if WANT_DK:
                dpT = tl.dot(v, tl.trans(do))
            if HAS_DROPOUT:
                keepT = _dropout_keep(rng, offs_m, offs_n, True)
                inv_keep = 1.0 / (1.0 - rng[3])
                pdT = tl.where(keepT, pT * inv_keep, 0.0)
                dpT = tl.where(keepT, dpT * inv_keep, 0.0)
            else:
                pdT = pT
            if WANT_DV:
                dv = tl.dot(pdT.to(do.dtype), do, dv)
            if WANT_DK:
                dsT = pT * (dpT - delta[None, :])
                if HAS_SOFTCAP:
                    t = _tanh(qkT * sc[1])
                    dsT = dsT * (1.0 - t * t)
                dk = tl.dot(dsT.to(q.dtype), q, dk)
                if DQ_MODE != 0:
                    _add_dq(dqa, tl.dot(tl.trans(dsT.to(k.dtype)), k), m0, offs_m, offs_d, seqlen_q,
                            MASKED, DQ_MODE, BLOCK_D)
        else:
            # Tiles are [queries, keys]: k and v stay in shared memory as right operands (fewer
            # registers at large head dims) at the price of transposing p and ds.
            qk = tl.dot(q, tl.trans(k))
            s = _scores(qk, offs_m, offs_n, diag, sc, HAS_SOFTCAP, HAS_ALIBI)
            if MASKED:
                s = tl.where(_allowed(offs_m, offs_n, win, HAS_LEFT, HAS_RIGHT), s, float("-inf"))
            p = tl.exp2(s - lse2[:, None])
            dp = tl.zeros_like(p)
            if WANT_DK:
                dp = tl.dot(do, tl.trans(v))
            if HAS_DROPOUT:
                keep = _dropout_keep(rng, offs_m, offs_n)
                inv_keep = 1.0 / (1.0 - rng[3])
                pd = tl.where(keep, p * inv_keep, 0.0)
                dp = tl.where(keep, dp * inv_keep, 0.0)
            else:
                pd = p
            if WANT_DV:
                dv = tl.dot(tl.trans(pd.to(do.dtype)), do, dv)
            if WANT_DK:
                ds = p * (dp - delta[:, None])
                if HAS_SOFTCAP:
                    t = _tanh(qk * sc[1])
                    ds = ds * (1.0 - t * t)
                dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk)
                if DQ_MODE != 0:
                    _add_dq(dqa, tl.dot(ds.to(k.dtype), k), m0, offs_m, offs_d, seqlen_q, MASKED,
                            DQ_MODE, BLOCK_D)
    return dk, dv


@triton.jit
def _bwd_dkdv_group(grads, k, v, ins, strides, b64, hk, group, n_heads_q, q_start, offs_n, offs_d,
                    ranges, seqlen_q, head_dim, win, sc3, rng3, dq3,
                    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, KEYS_AS_ROWS: tl.constexpr, WANT: tl.constexpr, WIDE: tl.constexpr,
                    DQ_MODE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Accumulate ``grads = (dk, dv)`` of one key block over the query heads of its GQA group.

    ``ins = (Q, DO, Lse, Delta, Alibi)``; ``strides`` their (batch, token, head) strides and the
    ALiBi strides; ``ranges = (lo, hi, flo, fhi)`` from ``_query_range``; ``sc3`` / ``rng3`` the
    score and dropout tuples without the per-head part (slope, counter base); ``dq3 = (DQA,
    rows per batch, rows per head)`` the dQ accumulator and its row strides (DQ_MODE 1 and 2)."""
    Q, DO, Lse, Delta, Alibi = ins
    (stride_qb, stride_qm, stride_qh, stride_dob, stride_dom, stride_doh,
     stride_lb, stride_lh, stride_lm, stride_ab, stride_ah) = strides
    lo, hi, flo, fhi = ranges
    qk_scale, softcap_scale, softcap = sc3
    seed, rng_sq, rng_sk, dropout_p = rng3
    DQA, dqa_sb, dqa_sh = dq3
    for g in range(0, group):
        h = hk * group + g
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(Alibi + b64 * stride_ab + h * stride_ah).to(tl.float32) * 1.4426950408889634
        sc = (qk_scale, softcap_scale, softcap, slope2)
        rng = (seed, (b64 * n_heads_q + h) * rng_sq * rng_sk, rng_sk, dropout_p)
        rows = (Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm,
                DO + b64 * stride_dob + h.to(tl.int64) * stride_doh + q_start.to(tl.int64) * stride_dom,
                Lse + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start.to(tl.int64) * stride_lm,
                Delta + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start.to(tl.int64) * stride_lm,
                stride_qm, stride_dom, stride_lm)
        dqa = (DQA, b64 * dqa_sb + h * dqa_sh + q_start)
        # masked blocks before the bulk (right window / causal edge), the bulk, masked after
        grads = _bwd_dkdv_inner(grads, k, v, rows, offs_n, offs_d, lo, flo, seqlen_q, head_dim, win,
                                sc, rng, dqa, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
                                EVEN_D, True, BLOCK_M, KEYS_AS_ROWS, WANT, WIDE, DQ_MODE, BLOCK_D)
        grads = _bwd_dkdv_inner(grads, k, v, rows, offs_n, offs_d, flo, fhi, seqlen_q, head_dim, win,
                                sc, rng, dqa, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
                                EVEN_D, False, BLOCK_M, KEYS_AS_ROWS, WANT, WIDE, DQ_MODE, BLOCK_D)
        grads = _bwd_dkdv_inner(grads, k, v, rows, offs_n, offs_d, fhi, hi, seqlen_q, head_dim, win,
                                sc, rng, dqa, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
                                EVEN_D, True, BLOCK_M, KEYS_AS_ROWS, WANT, WIDE, DQ_MODE, BLOCK_D)
    return grads


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, CuQ, CuK, SeqUsedK, Alibi, DQA,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lb, stride_lh, stride_lm,
    stride_ab, stride_ah, dqa_sb, dqa_sh,
    seqlen_q_dense, seqlen_k_dense, n_heads_q, n_heads_k, group, head_dim,
    qk_scale, softcap_scale, softcap, sm_scale, window_left, window_right,
    dropout_p, seed, rng_sq, rng_sk,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KEYS_AS_ROWS: tl.constexpr, TWO_PASS: tl.constexpr, WIDE: tl.constexpr, DQ_MODE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads_k
    hk = pid_bh % n_heads_k
    q_start, seqlen_q, k_start, seqlen_k = _seq_bounds(b, CuQ, CuK, SeqUsedK, seqlen_q_dense,
                                                       seqlen_k_dense, IS_VARLEN, HAS_SEQUSED)
    n0 = pid_n * BLOCK_N
    if n0 >= seqlen_k:
        return
    diag = seqlen_k - seqlen_q
    b64 = b.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = offs_n[:, None] < seqlen_k
    if not EVEN_D:
        kv_mask = kv_mask & (offs_d[None, :] < head_dim)
    krow = (k_start + offs_n).to(tl.int64)
    k = tl.load(K + b64 * stride_kb + hk * stride_kh + krow[:, None] * stride_kn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + b64 * stride_vb + hk * stride_vh + krow[:, None] * stride_vn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    grads = (tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32), tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32))
    dk_ptrs = DK + b64 * stride_dkb + hk * stride_dkh + krow[:, None] * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + b64 * stride_dvb + hk * stride_dvh + krow[:, None] * stride_dvn + offs_d[None, :]

    ranges = _query_range(n0, seqlen_q, seqlen_k, diag, window_left, window_right,
                          BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    ins = (Q, DO, Lse, Delta, Alibi)
    strides = (stride_qb, stride_qm, stride_qh, stride_dob, stride_dom, stride_doh,
               stride_lb, stride_lh, stride_lm, stride_ab, stride_ah)
    win = (seqlen_k, diag, window_left, window_right)
    sc3 = (qk_scale, softcap_scale, softcap)
    rng3 = (seed, rng_sq, rng_sk, dropout_p)
    dq3 = (DQA, dqa_sb, dqa_sh)
    if TWO_PASS:
        # dV first, stored, then dK: one [BLOCK_N, D] accumulator live at a time (large heads),
        # for one extra q.k product per step.
        grads = _bwd_dkdv_group(grads, k, v, ins, strides, b64, hk, group, n_heads_q, q_start,
                                offs_n, offs_d, ranges, seqlen_q, head_dim, win, sc3, rng3, dq3,
                                HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D,
                                BLOCK_M, KEYS_AS_ROWS, (False, True), WIDE, 0, BLOCK_D)
        tl.store(dv_ptrs, grads[1].to(DV.dtype.element_ty), mask=kv_mask)
        grads = _bwd_dkdv_group(grads, k, v, ins, strides, b64, hk, group, n_heads_q, q_start,
                                offs_n, offs_d, ranges, seqlen_q, head_dim, win, sc3, rng3, dq3,
                                HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D,
                                BLOCK_M, KEYS_AS_ROWS, (True, False), WIDE, DQ_MODE, BLOCK_D)
        tl.store(dk_ptrs, (grads[0] * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    else:
        grads = _bwd_dkdv_group(grads, k, v, ins, strides, b64, hk, group, n_heads_q, q_start,
                                offs_n, offs_d, ranges, seqlen_q, head_dim, win, sc3, rng3, dq3,
                                HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D,
                                BLOCK_M, KEYS_AS_ROWS, (True, True), WIDE, DQ_MODE, BLOCK_D)
        tl.store(dv_ptrs, grads[1].to(DV.dtype.element_ty), mask=kv_mask)
        tl.store(dk_ptrs, (grads[0] * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_inner(dq, rows, kv, offs_m, offs_d, start, end, head_dim, win, sc, rng,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
                  MASKED: tl.constexpr, WIDE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Add key blocks [start, end) to ``dq``; ``rows = (q, do, lse2, delta)`` of the row block,
    ``kv = (k_base, v_base, stride_kn, stride_vn)``."""
    q, do, lse2, delta = rows
    k_base, v_base, stride_kn, stride_vn = kv
    seqlen_k = win[0]
    offs_nb = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_nb
        k = _load_tile(k_base + _row_offsets(offs_n[:, None], stride_kn, WIDE) + offs_d[None, :], offs_n, seqlen_k,
                       offs_d, head_dim, MASKED, EVEN_D)
        v = _load_tile(v_base + _row_offsets(offs_n[:, None], stride_vn, WIDE) + offs_d[None, :], offs_n, seqlen_k,
                       offs_d, head_dim, MASKED, EVEN_D)
        qk = tl.dot(q, tl.trans(k))
        s = _scores(qk, offs_m, offs_n, win[1], sc, HAS_SOFTCAP, HAS_ALIBI)
        if MASKED:
            s = tl.where(_allowed(offs_m, offs_n, win, HAS_LEFT, HAS_RIGHT), s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v))
        if HAS_DROPOUT:
            dp = tl.where(_dropout_keep(rng, offs_m, offs_n), dp * (1.0 / (1.0 - rng[3])), 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            t = _tanh(qk * sc[1])
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, CuQ, CuK, SeqUsedK, Alibi,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh, stride_lm,
    stride_ab, stride_ah,
    seqlen_q_dense, seqlen_k_dense, n_heads_q, group, head_dim,
    qk_scale, softcap_scale, softcap, sm_scale, window_left, window_right,
    dropout_p, seed, rng_sq, rng_sk,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
    REVERSE: tl.constexpr, WIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if REVERSE:
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads_q
    h = pid_bh % n_heads_q
    hk = h // group
    q_start, seqlen_q, k_start, seqlen_k = _seq_bounds(b, CuQ, CuK, SeqUsedK, seqlen_q_dense,
                                                       seqlen_k_dense, IS_VARLEN, HAS_SEQUSED)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    diag = seqlen_k - seqlen_q
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    ld_mask = row_ok[:, None]
    if not EVEN_D:
        ld_mask = ld_mask & (offs_d[None, :] < head_dim)
    qrow = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + h64 * stride_qh + qrow[:, None] * stride_qm + offs_d[None, :],
                mask=ld_mask, other=0.0)
    do = tl.load(DO + b64 * stride_dob + h64 * stride_doh + qrow[:, None] * stride_dom + offs_d[None, :],
                 mask=ld_mask, other=0.0)
    lrow = b64 * stride_lb + h64 * stride_lh + qrow * stride_lm
    lse2 = tl.load(Lse + lrow, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(Delta + lrow, mask=row_ok, other=0.0)
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(Alibi + b * stride_ab + h * stride_ah).to(tl.float32) * 1.4426950408889634
    rows = (q, do, lse2, delta)
    kv = (K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn,
          V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn,
          stride_kn, stride_vn)
    win = (seqlen_k, diag, window_left, window_right)
    sc = (qk_scale, softcap_scale, softcap, slope2)
    rng = (seed, (b64 * n_heads_q + h) * rng_sq * rng_sk, rng_sk, dropout_p)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi, flo, fhi = _key_range(m0, seqlen_q, seqlen_k, diag, window_left, window_right,
                                  BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    # masked blocks at the window's left edge, the unmasked bulk, then the diagonal / end
    dq = _bwd_dq_inner(dq, rows, kv, offs_m, offs_d, lo, flo, head_dim, win, sc, rng,
                       HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D, True, WIDE, BLOCK_N)
    dq = _bwd_dq_inner(dq, rows, kv, offs_m, offs_d, flo, fhi, head_dim, win, sc, rng,
                       HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D, False, WIDE, BLOCK_N)
    dq = _bwd_dq_inner(dq, rows, kv, offs_m, offs_d, fhi, hi, head_dim, win, sc, rng,
                       HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D, True, WIDE, BLOCK_N)
    dq = dq * sm_scale
    tl.store(DQ + b64 * stride_dqb + h64 * stride_dqh + qrow[:, None] * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=ld_mask)


def _strides3(t: torch.Tensor, varlen: bool) -> Tuple[int, int, int]:
    """(batch, token, head) strides; packed tensors have no batch stride."""
    if varlen:
        return (0,) + t.stride()[:2]
    return t.stride()[:3]


def attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    seqused_k: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    config: Optional[tuple] = None,
    deterministic: bool = False,
    compile_only: bool = False,
) -> Union[Tuple[torch.Tensor, torch.Tensor, torch.Tensor], list]:
    """Gradients of q, k, v (same layouts as the inputs, contiguous) given dO.

    ``config`` ``((BLOCK_M, BLOCK_N, warps, stages, keys_as_rows), (BLOCK_M, BLOCK_N, warps,
    stages))`` for the dK/dV and dQ kernels overrides the shipped table (benchmarks).

    Where :func:`dq_mode` says so (sm90, head dims the table lists), the dK/dV kernel also
    adds each block's share of dQ into an fp32 buffer through bulk (TMA) reduce-adds, and no dQ
    kernel runs: the order of those additions, and so the last bits of dQ, can vary from run to
    run. ``deterministic=True`` keeps the dQ kernel (bitwise repeatable).

    On a GPU the kernels not compiled yet compile concurrently (``_launch.compile_all``) before
    the launches. ``compile_only=True`` launches nothing: it starts compiling the kernels such a
    call needs and returns their Futures (``do``, ``out``, ``lse`` may then be ``meta`` tensors
    shaped like the real ones; see :func:`prepare_backward`).
    """
    varlen = cu_seqlens_q is not None
    head_dim = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        hq, hk = q.shape[1], k.shape[1]
        sq_max, sk_max = int(max_seqlen_q), int(max_seqlen_k)
        l3 = (0, lse.stride(0), lse.stride(1))
    else:
        batch, sq_max, hq, _ = q.shape
        sk_max, hk = k.shape[1], k.shape[2]
        l3 = (lse.stride(0), lse.stride(1), lse.stride(2))
    if do.stride(-1) != 1:
        do = do.contiguous()
    # compile_only: the gradients' buffers are stand-ins (a meta tensor has the strides of a
    # fresh one, and Triton takes its address 0 as 16-byte aligned, as a fresh allocation is)
    where = "meta" if compile_only else q.device
    if compile_only:
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=where) for t in (q, k, v))
    else:
        dq, dk, dv = fresh_like(q), fresh_like(k), fresh_like(v)
    if batch == 0 or q.numel() == 0 or k.shape[0 if varlen else 1] == 0:
        if compile_only:
            return []
        return (dq.zero_(), dk.zero_(), dv.zero_()) if batch == 0 or q.numel() == 0 else (dq.zero_(), dk, dv)
    # compile_only, not empty_like: moving a CUDA tensor's layout to ``meta`` runs torch's Python
    # reference, whose first use imports sympy (seconds of a prepared node's first call)
    delta = (torch.empty_like(lse) if not compile_only and lse.is_contiguous() else
             torch.empty_strided(lse.shape, lse.stride(), dtype=lse.dtype, device=where))
    left, right = int(window_size[0]), int(window_size[1])
    softcap = float(softcap)
    if causal:
        right = 0
    block_d = next_pow2_dim(head_dim)
    cap = device_capability(q)
    softmax_scale = float(softmax_scale)
    # what the Gluon path needs comes first; the Triton kernels' own arguments after its branch
    pre_m = 64 if cap is not None else 16
    so, sdo = _strides3(out, varlen), _strides3(do, varlen)
    sdq = _strides3(dq, varlen)
    flags = (varlen, seqused_k is not None, left >= 0, right >= 0, softcap > 0,
             alibi_slopes is not None, dropout_p > 0.0, block_d == head_dim)
    # the dQ accumulator of the fused modes: [rows, block_d] fp32, rows head-major (dense: batch,
    # head, token; packed: head, token), so a block of query rows is one contiguous box
    acc_rows_head = q.shape[0] if varlen else sq_max
    acc_rows = (1 if varlen else batch) * hq * acc_rows_head

    def delta_launch(dq_acc):
        # cu_seqlens_q is None for dense calls: a compile-time constant the launch does not validate.
        # A dense call's fused-dQ buffer is zeroed here too (new_dq_acc)
        zero = dq_acc is not None and not varlen
        return (_DELTA, ((sq_max + pre_m - 1) // pre_m, batch * hq, 1),
                (out, do, delta, cu_seqlens_q, dq_acc if zero else None, *so, *sdo, *l3, sq_max, hq, head_dim),
                (varlen, pre_m, block_d, zero), 4, 3)  # Triton's defaults, as before the Launcher

    def new_dq_acc(device):
        # Why not torch.zeros for dense calls: its fill is one more launch (host time each step),
        # and the delta kernel, which runs first, writes those rows anyway. Packed buffers keep the
        # fill: rows past the last sequence (a total longer than cu_seqlens_q[-1]) belong to no
        # delta program
        if varlen:
            return torch.zeros(acc_rows, block_d, dtype=torch.float32, device=device)
        return torch.empty(acc_rows, block_d, dtype=torch.float32, device=device)

    def cast_launch(dq_acc):
        # [.., heads, tokens, block_d] -> dq's [.., tokens, heads, head_dim], scaled and cast
        return (_DQ_CAST, ((acc_rows_head + 63) // 64, (1 if varlen else batch) * hq, 1),
                (dq_acc, dq, *sdq, acc_rows_head, hq, head_dim, softmax_scale), (64, block_d), 4, 1)

    # the kernel reads lse and delta rows with unit stride (the forward's own layout); decided
    # before the Triton kernels' arguments are built, which the Gluon path does not need
    gluon = (config is None and lse.stride(-1) == 1
             and _gluon_wanted(q, k, v, do, cap, varlen, flags, causal, sk_max, deterministic))
    packed = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=sq_max,
                  max_seqlen_k=sk_max) if varlen else {}
    if gluon and not compile_only:
        dq_acc = new_dq_acc(q.device)
        _run(delta_launch(dq_acc))
        _lazy.module("_gluon_bwd").gluon_dkdv_dq(q, k, v, do, lse, delta, dq_acc, dk, dv,
                                                 softmax_scale=softmax_scale, causal=causal, **packed)
        _run(cast_launch(dq_acc))
        return dq, dk, dv

    if alibi_slopes is not None:
        a2 = (alibi_slopes.stride(0), alibi_slopes.stride(1)) if alibi_slopes.dim() == 2 else (0, alibi_slopes.stride(0))
    else:
        a2 = (0, 0)
    # absent optional pointers: None, a compile-time constant the launch does not validate
    cuq = cu_seqlens_q if varlen else None
    cuk = cu_seqlens_k if varlen else None
    used = seqused_k
    alibi = alibi_slopes
    scalars = (softmax_scale * LOG2E, softmax_scale / softcap if softcap > 0 else 1.0,
               softcap, softmax_scale, left, right, float(dropout_p), int(seed),
               sq_max, sk_max)
    rows_q, rows_k = (q.shape[0], k.shape[0]) if varlen else (sq_max, sk_max)
    acc_sb = 0 if varlen else hq * acc_rows_head
    sq, sk, sv = _strides3(q, varlen), _strides3(k, varlen), _strides3(v, varlen)
    sdk, sdv = _strides3(dk, varlen), _strides3(dv, varlen)
    # the dK/dV kernel's arguments around DQA (after alibi) and its two row strides (after a2)
    dkdv_ptrs = (q, k, v, do, lse, delta, dk, dv, cuq, cuk, used, alibi)
    dkdv_strides = (*sq, *sk, *sv, *sdo, *sdk, *sdv, *l3, *a2)
    dkdv_rest = (sq_max, sk_max, hq, hk, hq // hk, head_dim, *scalars)
    dq_args = (q, k, v, do, lse, delta, dq, cuq, cuk, used, alibi, *sq, *sk, *sv, *sdo,
               *sdq, *l3, *a2, sq_max, sk_max, hq, hq // hk, head_dim, *scalars)
    wide = needs_wide_offsets(rows_q * max(sq[1], sdo[1], sdq[1]), rows_k * max(sk[1], sv[1], sdk[1], sdv[1]))

    def launches(cfg, fused: int, dq_acc=None) -> list:
        (bm_, bn_, w_, s_, mode), (bm2, bn2, w2, s2) = cfg
        if fused:
            dqa = dq_acc if fused == 1 else TensorDescriptor(dq_acc, [acc_rows, block_d], [block_d, 1], [bm_, block_d])
            args = dkdv_ptrs + (dqa,) + dkdv_strides + (acc_sb, acc_rows_head) + dkdv_rest
        else:
            args = dkdv_ptrs + (None,) + dkdv_strides + (0, 0) + dkdv_rest
        plan = [
            delta_launch(dq_acc),
            (_DKDV_TMA if fused == 2 else _DKDV, ((sk_max + bn_ - 1) // bn_, batch * hk, 1), args,
             flags + (bm_, bn_, block_d, mode in ("keys", "keys-2pass"), mode.endswith("2pass"), wide, fused),
             w_, s_),
        ]
        if not fused:
            plan.append((_DQ, ((sq_max + bm2 - 1) // bm2, batch * hq, 1), dq_args,
                         flags + (right >= 0, wide, bm2, bn2, block_d), w2, s2))
        else:
            plan.append(cast_launch(dq_acc))
        return plan

    def launch(cfg):
        fused = dq_mode(cap, block_d, cfg[0][4], deterministic, causal, sk_max)
        dq_acc = new_dq_acc(q.device) if fused else None
        plan = launches(cfg, fused, dq_acc)
        if cap is not None:
            _launch.wait(_launch.compile_all([(k_, a_, c_, w_, s_) for k_, _g, a_, c_, w_, s_ in plan], q.device))
        for step in plan:
            _run(step)

    shape_class = (q.dtype, causal, left >= 0, softcap > 0, alibi_slopes is not None,
                   bool(dq_mode(cap, block_d, "keys", deterministic, causal, sk_max)))
    if gluon and compile_only:
        acc = torch.empty(acc_rows, block_d, dtype=torch.float32, device="meta")
        plan = (delta_launch(acc), cast_launch(acc))
        # the Gluon kernel first: the longest compile takes the first free thread
        ahead = _lazy.module("_gluon_bwd").compile_ahead(q, k, v, do, lse, delta, acc, dk, dv,
                                                         softmax_scale=softmax_scale, causal=causal, **packed)
        return ahead + _launch.compile_all([(k_, a_, c_, w_, s_) for k_, _g, a_, c_, w_, s_ in plan], q.device)
    if compile_only:
        cfg = config if config is not None else _configs.pick("bwd", cap, block_d)
        fused = dq_mode(cap, block_d, cfg[0][4], deterministic, causal, sk_max)
        acc = torch.empty(acc_rows, block_d, dtype=torch.float32, device="meta") if fused else None
        return _launch.compile_all([(k_, a_, c_, w_, s_) for k_, _g, a_, c_, w_, s_ in launches(cfg, fused, acc)],
                                   q.device)
    launch(_configs.choose("bwd", cap, block_d, shape_class, config,
                           lambda c: triton.testing.do_bench(lambda: launch(c))))
    return dq, dk, dv


def _run(step: tuple) -> None:
    """Launch one planned ``(launcher, grid, args, constexprs, warps, stages)``."""
    launcher, grid, args, constexprs, warps, stages = step
    launcher(grid, args, constexprs, warps, stages)


def _gluon_wanted(q, k, v, do, cap, varlen, flags, causal, keys, deterministic) -> bool:
    """Whether this backward runs the Gluon sm90 kernel (``GLUON_BWD`` forces it either way when
    not None; otherwise the rule ``_gluon_dispatch.wants_gluon_backward``). Only the calls the
    kernel serves qualify: dense or packed, no seqused_k / window / softcap / ALiBi / dropout,
    the layout ``_gluon_bwd.supports`` checks."""
    # flags: (varlen, seqused, left, right, softcap, alibi, dropout, even_d); causal sets right
    plain = not any(flags[1:3]) and (causal or not flags[3]) and not any(flags[4:7])
    # forced on, it still serves only what it can: sm90, plain, not deterministic
    if GLUON_BWD is False or not plain or deterministic or cap != (9, 0) or not _gluon_dispatch.gluon_available():
        return False
    if GLUON_BWD is None and not _gluon_dispatch.wants_gluon_backward(
            cap, True, q.shape[-1], causal, keys, plain, q.dtype == torch.bfloat16, deterministic, varlen=varlen):
        return False
    return _lazy.module("_gluon_bwd").supports(q, k, v, do)


def prepare_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     cu_seqlens_q: Optional[torch.Tensor] = None, **options) -> list:
    """Start compiling, on the compile threads, the backward kernels that a backward of this
    forward call will need; returns their Futures (see ``_launch.compile_all``).

    Called by the forward before it runs, so the two compile at the same time. The gradient of
    the output is assumed laid out like the output (contiguous, a fresh allocation), as autograd
    hands it over in the usual case; if it is not, the backward compiles what it misses itself.
    ``options`` are :func:`attention_backward`'s keywords. Raises what the launch arguments'
    construction raises (never a compile error: those surface in the Futures).
    """
    varlen = cu_seqlens_q is not None
    out = torch.empty(q.shape, dtype=q.dtype, device="meta")
    if varlen:
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device="meta")
    else:
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device="meta")
    return attention_backward(out, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, compile_only=True, **options)


def dq_mode(capability: Optional[Tuple[int, int]], block_d: int, mode: str, deterministic: bool,
            causal: bool = False, keys: int = 0) -> int:
    """How the backward computes dQ: 0 = its own kernel (recomputes the scores), 1 = atomics in
    the dK/dV kernel (the interpreter's form of 2, for tests; also a forced fused form before
    sm90, which has no bulk reduce), 2 = bulk reduce-adds in the dK/dV kernel (sm90, where
    ``_configs.FUSED_DQ_SM90`` lists (block_d, causal) and ``keys``, the longest sequence's
    keys, reaches its minimum). ``FUSED_DQ`` forces 0 (False) or the fused form (True) when not
    None. Raises nothing."""
    if deterministic or mode.endswith("2pass"):
        return 0
    if FUSED_DQ is not None:
        fused = FUSED_DQ
    else:
        min_keys = _configs.FUSED_DQ_SM90.get((block_d, bool(causal)))
        fused = capability is not None and capability[0] == 9 and min_keys is not None and keys >= min_keys
    if not fused:
        return 0
    return 2 if capability is not None and capability[0] >= 9 else 1


# None: dq_mode follows _configs.FUSED_DQ_SM90; True / False force it (benchmarks, tests)
FUSED_DQ: Optional[bool] = None
# None: the Gluon sm90 backward runs where _gluon_dispatch.MEASURED_FASTER_BWD says; True / False
# force it on (for the calls it serves) or off (benchmarks, tests)
GLUON_BWD: Optional[bool] = None

_DELTA = Launcher(_delta_kernel)
_DKDV = Launcher(_bwd_dkdv_kernel)
_DKDV_TMA = Launcher(_bwd_dkdv_kernel)  # DQA is a TensorDescriptor here (a Launcher keys one kind per slot)
_DQ = Launcher(_bwd_dq_kernel)
_DQ_CAST = Launcher(_dq_cast_kernel)
