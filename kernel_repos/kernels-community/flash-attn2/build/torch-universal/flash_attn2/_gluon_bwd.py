"""Gluon dK/dV/dQ backward kernel for Hopper (sm90): warp-specialised, five matmuls per block
pair, dQ reduced into an fp32 buffer by a warp of its own.

Entry point::

    gluon_dkdv_dq(q, k, v, do, lse, delta, dq_acc, dk, dv, *, softmax_scale, causal,
                  [cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k])

dense q/do ``[B, Sq, Hq, D]``, k/v/dk/dv ``[B, Sk, Hk, D]``, lse/delta ``[B, Hq, Sq]`` fp32
(natural-log lse, delta = rowsum(O * dO)), ``dq_acc`` ``[B * Hq * Sq, D]`` fp32 zeroed, rows
head-major (``_triton_bwd``'s fused-dQ layout): the kernel adds the unscaled dQ into it and
writes dK (scaled) and dV. Packed sequences: q/do ``[total_q, Hq, D]``, k/v/dk/dv
``[total_k, Hk, D]``, lse/delta ``[Hq, total_q]``, ``dq_acc`` ``[Hq * total_q, D]``, with int32
``cu_seqlens``. :func:`supports` says which calls it serves.

Why this shape (FlashAttention-3's backward, in Gluon's terms):

* One program per block of 128 keys and KV head; it walks the query heads of its GQA group and
  their 64-row query blocks (from the causal diagonal on). Four partitions: two consumer
  warpgroups, each owning 64 of the 128 keys (its dK and dV accumulators, 64 x D fp32 each, stay
  in registers for the whole program); one producer warp that streams Q and dO through a ring
  of shared buffers (TMA, "ready" / "empty" mbarriers); one warp that takes each finished dQ
  tile from shared memory and adds it to the fp32 buffer with a bulk (TMA) reduce-add, so the
  consumers never wait for that reduce to read its source.
* Tiles are [keys, queries] (S^T = K Q^T): P^T and dS^T stay in registers as the left operand
  of dV += P^T dO and dK += dS^T Q. dQ = dS K needs all 128 keys: both consumers put their
  half of dS^T into one shared tile, and each computes half of dQ's columns from all of it
  (64 x D/2 fp32), which keeps a consumer's registers within the 240 it gets.
* Head dims above 128 (:data:`WIDE_FROM`) take a column split instead: dK and dV of 64 keys at
  256 columns would need 256 fp32 registers a thread. A program holds 64 keys; each consumer
  computes S^T and dP^T of all of them for half of the block's queries, the halves of P^T and
  dS^T meet in shared memory, and each consumer then owns half the columns of dV, dK and dQ
  (FlashAttention-3's head-dim-256 split). K, V, Q, dO, P^T, dS^T and the fp32 dQ tile take
  208 KB at 256 columns, so the Q/dO ring is single-buffered there: its next load waits for
  the step's last product that reads Q.
* Key blocks touched by no mask (the causal diagonal, the keys' ragged end) run without the
  compare and select; query rows past the end get lse +inf, so they add nothing. Packed
  sequences share one ``[1, total, H, D]`` view: a program reads its sequence's bounds from
  ``cu_seqlens``, the next sequence's rows that a box reaches are masked like a ragged end, and
  the dQ box's rows past the end add zeros to the rows after them.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Tuple

import torch

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language import _core as _gl_core
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton._C.libtriton import ir

from ._gluon_fwd import (LOG2E, _descriptor, _sequence_bounds, _thread_barrier, _tma_load, _tma_store,
                         copy_engine_reads, make_descriptor)
from ._launch import Launcher


@_gl_core.builtin
def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):
    """Bulk (TMA) reduce-add of a shared tile into global memory (``cp.reduce.async.bulk.tensor``).

    Gluon 3.6 has the op in its builder but no wrapper (later releases: ``tma.async_atomic_add``);
    completion is tracked like a bulk store's (``tma.store_wait``)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


_tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36


BLOCK_M = 64   # query rows per step (the dQ product's m64 wgmma row block)
BLOCK_N = 128  # keys per program: 64 per consumer warpgroup
HEAD_DIMS = (64, 128, 256)
# (consumer, small partitions, kernel maxnreg) registers per thread: 4 + 4 consumer warps and two
# one-warp partitions (one warpgroup between them) share the 64K-register file as
# 240 x 256 + 24 x 128 <= 168 x 384
REGS = (240, 24, 168)
STAGES = 2     # Q / dO ring
DS_STAGES = 2  # dS^T tiles
DQ_STAGES = 2  # dQ tiles waiting for their reduce
# head dims above WIDE_FROM take the column split (see _step_wide): 64 keys a program, and every
# ring single-buffered, since at 256 columns K, V, Q, dO, P^T, dS^T and the fp32 dQ tile take
# 208 KB of the 227 KB a block may have
WIDE_FROM = 129
WIDE_BLOCK_N = 64
WIDE_STAGES = (1, 1, 1)  # (Q / dO ring, P^T and dS^T tiles, dQ tiles)


def tiles(head_dim: int) -> Tuple[int, int, int, int]:
    """(keys per program, Q/dO stages, P^T/dS^T stages, dQ stages) for head_dim. Raises nothing."""
    if head_dim >= WIDE_FROM:
        return (WIDE_BLOCK_N, *WIDE_STAGES)
    return BLOCK_N, STAGES, DS_STAGES, DQ_STAGES
# dense calls store dK and dV through shared memory and the copy engine (packed ones through
# stores masked at the sequence's end: a bulk copy would overwrite the next sequence's keys)
STORE_DKDV_BY_TMA = True
# The order the GPU dispatches a dense causal call's programs in (one per key block and KV head;
# a free SM takes the next in grid order). A causal key block's program reads the query blocks
# from its diagonal on, so a head's programs run from long (the first key block) to short, and a
# call that ends on the last heads' long programs ends ragged: a model of that dispatch
# (bench/bwd_order.py) puts head order 7 % over balance at 1k and 4k tokens, 14 % at head_dim
# 64 GQA 2k.
# HEAD_ORDER: every head's programs one after another (their Q / dO stays in L2 while they run).
# LIGHTER_HALF_LAST: every head's lighter half of key blocks after all heads' heavier halves;
# modelled within 1 % of balance, measured 0.92x head order at 4k, 0.95x at 16k and 0.74x at
# head_dim 256 (bench/results/repeats/bwd_light_last_0f6c18b.md): the lighter halves, run apart
# from their heads, read Q / dO from memory again.
# LAST_HEADS_BY_BLOCK: head order, but the last heads whose Q / dO fit in TAIL_BYTES of L2 go key
# block by key block (their heaviest programs first), so the call ends on light programs while
# what runs side by side still shares one small set of heads; modelled 1.2 % over balance at 1k,
# 2.2 % at 4k, 1.2 % at head_dim 256, 3.8 % at GQA 2k, and the same Q / dO bytes from memory as
# head order; measured forward+backward 1.03x head order at 1k, 1.05x at 4k, 1.01x at 16k and at
# head_dim 256, 1.06x at head_dim 64 GQA 2k, dK / dV the same bits (bench/results/bwd_order.md).
HEAD_ORDER, LIGHTER_HALF_LAST, LAST_HEADS_BY_BLOCK = 0, 1, 2
ORDER = LAST_HEADS_BY_BLOCK
TAIL_BYTES = 16 * 1024 * 1024  # the last heads' Q and dO (bf16) that LAST_HEADS_BY_BLOCK keeps in L2 at once
_TAIL_BYTES = gl.constexpr(TAIL_BYTES)  # the same, as the kernel reads it


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_bar,
              qdo_ready, qdo_empty, lse_ptr, delta_ptr, stride_lb, stride_lh, seqlen_q, b, hk, n0, q_row0, k_row0,
              group, i_lo, nsteps, STAGES: gl.constexpr):
    BM: gl.constexpr = q_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    BN: gl.constexpr = k_smem.shape[0]
    row_layout: gl.constexpr = gl.BlockedLayout([BM // 32], [32], [1], [0])
    offs = gl.arange(0, BM, layout=row_layout)
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    _tma_load(k_desc, [b, k_row0 + n0, hk, 0], kv_bar, k_smem.reshape([1, BN, 1, D]))
    _tma_load(v_desc, [b, k_row0 + n0, hk, 0], kv_bar, v_smem.reshape([1, BN, 1, D]))
    for t in range(group * nsteps):
        g = t // nsteps
        i = i_lo + t - g * nsteps
        slot = t % STAGES
        # mbarriers start with the phase before 0 complete: the first round of waits passes
        mbarrier.wait(qdo_empty.index(slot), ((t // STAGES) & 1) ^ 1)
        # the rows' lse (log2 units) and delta go into the slot too: the consumers read them from
        # shared memory instead of waiting on global loads in each step; rows past the end get
        # lse +inf and delta 0, so they add nothing
        h = hk * group + g
        offs_m = i * BM + offs
        ok = offs_m < seqlen_q
        row = b * stride_lb + h * stride_lh + q_row0 + offs_m
        lse_smem.index(slot).store(gl.load(lse_ptr + row, mask=ok, other=float("inf")) * 1.4426950408889634)
        delta_smem.index(slot).store(gl.load(delta_ptr + row, mask=ok, other=0.0))
        _thread_barrier()
        mbarrier.expect(qdo_ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        _tma_load(q_desc, [b, q_row0 + i * BM, h, 0], qdo_ready.index(slot),
                  q_smem.index(slot).reshape([1, BM, 1, D]))
        _tma_load(do_desc, [b, q_row0 + i * BM, h, 0], qdo_ready.index(slot),
                  do_smem.index(slot).reshape([1, BM, 1, D]))


@gluon.jit
def _dq_writer(dq_desc, dq_smem, dq_full, dq_empty, acc_row0, acc_rows_head, group, i_lo, nsteps,
               DQ_STAGES: gl.constexpr):
    BM: gl.constexpr = dq_smem.shape[1]
    for t in range(group * nsteps):
        g = t // nsteps
        i = i_lo + t - g * nsteps
        s = t % DQ_STAGES
        mbarrier.wait(dq_full.index(s), (t // DQ_STAGES) & 1)
        _tma_reduce_add(dq_desc, [acc_row0 + g * acc_rows_head + i * BM, 0], dq_smem.index(s))
        # the tile may be rewritten once the copy engine has read it
        tma.store_wait(pendings=0)
        mbarrier.arrive(dq_empty.index(s))


@gluon.jit
def _publish(dst, value, bar):
    """Store a warpgroup's tile for the copy engine or another partition's wgmma, then arrive once
    on ``bar`` for the warpgroup: the fence orders the stores before those async reads, and the
    barrier puts every thread's share in place before the one arrival."""
    dst.store(value)
    fence_async_shared()
    _thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _end_step(t, slot, dslot, dq, qdo_empty, ds_empty, dq_smem, dq_full, dq_empty, W: gl.constexpr,
              DQ_STAGES: gl.constexpr):
    """A consumer's end of ring step t, its products done: hand back the Q/dO slot and the dS^T
    slot, then put its columns of dQ (W-th of two) in the dQ tile for the reduce."""
    mbarrier.arrive(qdo_empty.index(slot))
    mbarrier.arrive(ds_empty.index(dslot))
    qslot = t % DQ_STAGES
    mbarrier.wait(dq_empty.index(qslot), ((t // DQ_STAGES) & 1) ^ 1)
    cols: gl.constexpr = dq.shape[1]
    _publish(dq_smem.index(qslot).slice(W * cols, cols, dim=1), dq, dq_full.index(qslot))


@gluon.jit
def _store_rows(dk_ptr, dv_ptr, dk, dv, b, hk, k_row0, r0, c0, seqlen_k, sm_scale, stride_dkb, stride_dkn,
                stride_dkh, stride_dvb, stride_dvn, stride_dvh):
    """Masked stores of a consumer's dK (scaled) and dV: key rows from r0 (those below seqlen_k),
    columns from c0."""
    layout: gl.constexpr = dk.type.layout
    offs_r = r0 + gl.arange(0, dk.shape[0], layout=gl.SliceLayout(1, layout))
    offs_d = c0 + gl.arange(0, dk.shape[1], layout=gl.SliceLayout(0, layout))
    ok = offs_r[:, None] < seqlen_k
    rows = (k_row0 + offs_r).to(gl.int64)[:, None]
    gl.store(dk_ptr + b.to(gl.int64) * stride_dkb + hk * stride_dkh + rows * stride_dkn + offs_d[None, :],
             (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=ok)
    gl.store(dv_ptr + b.to(gl.int64) * stride_dvb + hk * stride_dvh + rows * stride_dvn + offs_d[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def _step(t, i, kw, vw, k_half, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, qdo_ready, qdo_empty,
          ds_full, ds_empty, dq_full, dq_empty, dk, dv, offs_n, seqlen_q, seqlen_k, qk_scale,
          W: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
          DS_STAGES: gl.constexpr, DQ_STAGES: gl.constexpr):
    """Query block i (ring step t) for one consumer's 64 keys: dV, dK and its half of dQ."""
    BM: gl.constexpr = q_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    KW: gl.constexpr = kw.shape[0]
    HALF_D: gl.constexpr = k_half.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)

    slot = t % STAGES
    mbarrier.wait(qdo_ready.index(slot), (t // STAGES) & 1)
    q = q_smem.index(slot)
    do = do_smem.index(slot)
    s_tok = warpgroup_mma(kw, q.permute((1, 0)), gl.zeros([KW, BM], gl.float32, s_layout), use_acc=False,
                          is_async=True)
    dp_tok = warpgroup_mma(vw, do.permute((1, 0)), gl.zeros([KW, BM], gl.float32, s_layout), use_acc=False,
                           is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    lse2 = lse_smem.index(slot).load(gl.SliceLayout(0, s_layout))
    if MASK:
        offs_m = i * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, s_layout))
        keep = offs_n[:, None] < seqlen_k
        if CAUSAL:
            keep = keep & (offs_n[:, None] <= offs_m[None, :] + (seqlen_k - seqlen_q))
        s = gl.where(keep, s, float("-inf"))
    p = gl.exp2(s * qk_scale - lse2[None, :])
    delta = delta_smem.index(slot).load(gl.SliceLayout(0, s_layout))
    dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
    ds = (p * (dp - delta[None, :])).to(dtype)
    dv = warpgroup_mma(gl.convert_layout(p.to(dtype), a_layout), do, dv, is_async=True)

    dslot = t % DS_STAGES
    mbarrier.wait(ds_empty.index(dslot), ((t // DS_STAGES) & 1) ^ 1)
    _publish(ds_smem.index(dslot).slice(W * KW, KW, dim=0), ds, ds_full.index(dslot))
    dk = warpgroup_mma(gl.convert_layout(ds, a_layout), q, dk, is_async=True)
    mbarrier.wait(ds_full.index(dslot), (t // DS_STAGES) & 1)
    dq_tok = warpgroup_mma(ds_smem.index(dslot).permute((1, 0)), k_half,
                           gl.zeros([BM, HALF_D], gl.float32, dq_layout), use_acc=False, is_async=True)
    dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq_tok))
    _end_step(t, slot, dslot, dq, qdo_empty, ds_empty, dq_smem, dq_full, dq_empty, W, DQ_STAGES)
    return dk, dv


@gluon.jit
def _consumer(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, done_bar, qdo_ready,
              qdo_empty, ds_full, ds_empty, dq_full, dq_empty, dk_desc, dv_desc, dk_ptr, dv_ptr, stride_dkb,
              stride_dkn, stride_dkh,
              stride_dvb, stride_dvn, stride_dvh, b, hk, n0, k_row0, group, i_lo, nsteps, n_mask,
              seqlen_q, seqlen_k, qk_scale, sm_scale, W: gl.constexpr, CAUSAL: gl.constexpr,
              STAGES: gl.constexpr, DS_STAGES: gl.constexpr, DQ_STAGES: gl.constexpr, TMA_OUT: gl.constexpr):
    BN: gl.constexpr = k_smem.shape[0]
    D: gl.constexpr = k_smem.shape[1]
    KW: gl.constexpr = BN // 2
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, q_smem.shape[1], 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    kw = k_smem.slice(W * KW, KW, dim=0)
    vw = v_smem.slice(W * KW, KW, dim=0)
    k_half = k_smem.slice(W * (D // 2), D // 2, dim=1)
    offs_n = n0 + W * KW + gl.arange(0, KW, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([KW, D], gl.float32, acc_layout)
    dv = gl.zeros([KW, D], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    for g in range(group):
        t0 = g * nsteps
        # the blocks a mask touches (the causal diagonal; all of them for the keys' ragged end),
        # then the rest without the compare and select
        for j in range(0, n_mask):
            dk, dv = _step(t0 + j, i_lo + j, kw, vw, k_half, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                           qdo_ready, qdo_empty, ds_full, ds_empty, dq_full, dq_empty, dk, dv, offs_n,
                           seqlen_q, seqlen_k, qk_scale, W, True, CAUSAL, STAGES, DS_STAGES, DQ_STAGES)
        for j in range(n_mask, nsteps):
            dk, dv = _step(t0 + j, i_lo + j, kw, vw, k_half, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                           qdo_ready, qdo_empty, ds_full, ds_empty, dq_full, dq_empty, dk, dv, offs_n,
                           seqlen_q, seqlen_k, qk_scale, W, False, CAUSAL, STAGES, DS_STAGES, DQ_STAGES)
    if TMA_OUT:
        # once both warpgroups are past their last product nothing reads K or V again (both
        # arrive, whichever way they store)
        mbarrier.arrive(done_bar)
        mbarrier.wait(done_bar, 0)
    # a whole half block of keys leaves through the copy engine, this warpgroup's rows of K and V
    # holding its dK and dV: dK / dV seen as [B * Sk, Hk * D], whose boxes do not stop at a
    # batch's end, so a ragged last block takes the masked stores
    if TMA_OUT and n0 + (W + 1) * KW <= seqlen_k:
        kw.store((dk * sm_scale).to(dtype))
        vw.store(dv.to(dtype))
        fence_async_shared()
        _thread_barrier()
        _tma_store(dk_desc, [b * seqlen_k + n0 + W * KW, hk * D], kw)
        _tma_store(dv_desc, [b * seqlen_k + n0 + W * KW, hk * D], vw)
        tma.store_wait(pendings=0)
    else:
        _store_rows(dk_ptr, dv_ptr, dk, dv, b, hk, k_row0, n0 + W * KW, 0, seqlen_k, sm_scale, stride_dkb, stride_dkn,
                    stride_dkh, stride_dvb, stride_dvn, stride_dvh)


@gluon.jit
def _step_wide(t, i, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem, ds_smem, dq_smem, qdo_ready,
               qdo_empty, pt_full, ds_full, pds_empty, dq_full, dq_empty, dk, dv, offs_n, seqlen_q, seqlen_k,
               qk_scale, W: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
               DS_STAGES: gl.constexpr, DQ_STAGES: gl.constexpr):
    """Query block i (ring step t) for the column split (head dims above 128): consumer W
    computes S^T and dP^T for all the program's keys and its half of the block's queries, the
    two halves of P^T and dS^T meet in shared memory, and W then owns columns
    [W * D/2, (W + 1) * D/2) of dV, dK and dQ. Every product reads both operands from shared
    memory, so no consumer holds more than half of any D-wide accumulator."""
    BM: gl.constexpr = q_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    BN: gl.constexpr = k_smem.shape[1]
    HQ: gl.constexpr = BM // 2
    HD: gl.constexpr = D // 2
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HQ, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HD, 16])

    # z is 0 at run time (the grid's third axis has one program) but varies with t for the
    # compiler. With every ring single-buffered, each shared-memory view here would be
    # loop-invariant, and the compiler hoisted all 76 wgmma descriptors (64-bit each) out of the
    # loop, where one consumer spilled them and reloaded ~40 of them every step (ncu: 56 % of
    # the kernel's stalls on local memory; bench/NOTES.md). Views that depend on z are computed
    # in the loop, a few integer adds a step, and nothing spills.
    z = t & gl.program_id(2)
    slot = t % STAGES + z
    mbarrier.wait(qdo_ready.index(slot), (t // STAGES) & 1)
    q = q_smem.index(slot)
    do = do_smem.index(slot)
    k_smem = k_smem.index(z)
    v_smem = v_smem.index(z)
    s_tok = warpgroup_mma(k_smem, q.slice(W * HQ, HQ, dim=0).permute((1, 0)),
                          gl.zeros([BN, HQ], gl.float32, s_layout), use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(v_smem, do.slice(W * HQ, HQ, dim=0).permute((1, 0)),
                           gl.zeros([BN, HQ], gl.float32, s_layout), use_acc=False, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    lse2 = lse_smem.index(slot).slice(W * HQ, HQ).load(gl.SliceLayout(0, s_layout))
    if MASK:
        offs_m = i * BM + W * HQ + gl.arange(0, HQ, layout=gl.SliceLayout(0, s_layout))
        keep = offs_n[:, None] < seqlen_k
        if CAUSAL:
            keep = keep & (offs_n[:, None] <= offs_m[None, :] + (seqlen_k - seqlen_q))
        s = gl.where(keep, s, float("-inf"))
    p = gl.exp2(s * qk_scale - lse2[None, :])
    pslot = t % DS_STAGES + z
    # P^T goes out first: the other consumer's dV product waits on it while this one finishes dS^T
    mbarrier.wait(pds_empty.index(pslot), ((t // DS_STAGES) & 1) ^ 1)
    _publish(pt_smem.index(pslot).slice(W * HQ, HQ, dim=1), p.to(dtype), pt_full.index(pslot))
    delta = delta_smem.index(slot).slice(W * HQ, HQ).load(gl.SliceLayout(0, s_layout))
    dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
    ds = (p * (dp - delta[None, :])).to(dtype)
    mbarrier.wait(pt_full.index(pslot), (t // DS_STAGES) & 1)
    dv = warpgroup_mma(pt_smem.index(pslot), do.slice(W * HD, HD, dim=1), dv, is_async=True)
    _publish(ds_smem.index(pslot).slice(W * HQ, HQ, dim=1), ds, ds_full.index(pslot))
    mbarrier.wait(ds_full.index(pslot), (t // DS_STAGES) & 1)
    dk = warpgroup_mma(ds_smem.index(pslot), q.slice(W * HD, HD, dim=1), dk, is_async=True)
    dq_tok = warpgroup_mma(ds_smem.index(pslot).permute((1, 0)), k_smem.slice(W * HD, HD, dim=1),
                           gl.zeros([BM, HD], gl.float32, dq_layout), use_acc=False, is_async=True)
    dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq_tok))
    _end_step(t, slot, pslot, dq, qdo_empty, pds_empty, dq_smem, dq_full, dq_empty, W, DQ_STAGES)
    return dk, dv


@gluon.jit
def _consumer_wide(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem, ds_smem, dq_smem, kv_bar,
                   qdo_ready, qdo_empty, pt_full, ds_full, pds_empty, dq_full, dq_empty, dk_ptr, dv_ptr, stride_dkb,
                   stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, b, hk, n0, k_row0, group, i_lo,
                   nsteps, n_mask, seqlen_q, seqlen_k, qk_scale, sm_scale, W: gl.constexpr, CAUSAL: gl.constexpr,
                   STAGES: gl.constexpr, DS_STAGES: gl.constexpr, DQ_STAGES: gl.constexpr):
    """The column split's consumer W: dK and dV columns [W * D/2, (W + 1) * D/2) of all the
    program's keys, stored with masked stores at the end."""
    BN: gl.constexpr = k_smem.shape[1]
    D: gl.constexpr = k_smem.shape[2]
    HD: gl.constexpr = D // 2
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, q_smem.shape[1] // 2, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HD, 16])
    offs_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([BN, HD], gl.float32, acc_layout)
    dv = gl.zeros([BN, HD], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    for g in range(group):
        t0 = g * nsteps
        for j in range(0, n_mask):
            dk, dv = _step_wide(t0 + j, i_lo + j, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem,
                                ds_smem, dq_smem, qdo_ready, qdo_empty, pt_full, ds_full, pds_empty, dq_full,
                                dq_empty, dk, dv, offs_n, seqlen_q, seqlen_k, qk_scale, W, True, CAUSAL, STAGES,
                                DS_STAGES, DQ_STAGES)
        for j in range(n_mask, nsteps):
            dk, dv = _step_wide(t0 + j, i_lo + j, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem,
                                ds_smem, dq_smem, qdo_ready, qdo_empty, pt_full, ds_full, pds_empty, dq_full,
                                dq_empty, dk, dv, offs_n, seqlen_q, seqlen_k, qk_scale, W, False, CAUSAL, STAGES,
                                DS_STAGES, DQ_STAGES)
    _store_rows(dk_ptr, dv_ptr, dk, dv, b, hk, k_row0, n0, W * HD, seqlen_k, sm_scale, stride_dkb, stride_dkn,
                stride_dkh, stride_dvb, stride_dvn, stride_dvh)


def tail_heads(n_bh: int, seqlen_q: int, head_dim: int, group: int) -> int:
    """How many last heads :data:`LAST_HEADS_BY_BLOCK` dispatches key block by key block: as many
    as whose Q and dO (bf16, ``group`` query heads each) fit in :data:`TAIL_BYTES`, at least one,
    at most all (``_program_order``'s arithmetic, for the dispatch model and the tests). Raises
    nothing."""
    return min(n_bh, max(TAIL_BYTES // (4 * head_dim) // group // seqlen_q, 1))


@gluon.jit
def _program_order(seqlen_q, group, ORDER: gl.constexpr, D: gl.constexpr):
    """(key block, batch x KV head) of this program under :data:`ORDER`, from its place in
    dispatch order (x fastest)."""
    n_kb = gl.num_programs(0)
    n_bh = gl.num_programs(1)
    t = gl.program_id(1) * n_kb + gl.program_id(0)
    if ORDER == 1:
        # LIGHTER_HALF_LAST: each head's first ceil(n/2) key blocks head by head, then the rest
        # key block by key block across the heads
        heavy = n_kb - n_kb // 2
        main = n_bh * heavy
        if t < main:
            pid_n = t % heavy
            bh = t // heavy
        else:
            pid_n = heavy + (t - main) // n_bh
            bh = (t - main) % n_bh
    else:
        # LAST_HEADS_BY_BLOCK: the heads before the last `tail` in head order, then the last
        # `tail` heads key block by key block; `tail`: how many heads' Q and dO fit in TAIL_BYTES
        # (divided step by step: the product overflows 32 bits at long lengths)
        tail = gl.minimum(n_bh, gl.maximum(_TAIL_BYTES // (4 * D) // group // seqlen_q, 1))
        main = (n_bh - tail) * n_kb
        if t < main:
            pid_n = t % n_kb
            bh = t // n_kb
        else:
            pid_n = (t - main) // tail
            bh = n_bh - tail + (t - main) % tail
    return pid_n, bh


@gluon.jit
def _gluon_attn_bwd(q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc, dk_ptr, dv_ptr, stride_dkb,
                    stride_dkn, stride_dkh,
                    stride_dvb, stride_dvn, stride_dvh, lse_ptr, delta_ptr, stride_lb, stride_lh, cu_seqlens_q,
                    cu_seqlens_k, total_q, seqlen_q, seqlen_k, heads_q, heads_k, qk_scale, sm_scale,
                    CAUSAL: gl.constexpr, STAGES: gl.constexpr, DS_STAGES: gl.constexpr,
                    DQ_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, SMALL_REGS: gl.constexpr,
                    VARLEN: gl.constexpr, TMA_OUT: gl.constexpr, ORDER: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[1]
    D: gl.constexpr = q_desc.block_type.shape[3]
    BN: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    if ORDER != 0:
        pid_n, bh = _program_order(seqlen_q, heads_q // heads_k, ORDER, D)
    else:
        pid_n = gl.program_id(0)
        bh = gl.program_id(1)
    b = bh // heads_k
    hk = bh % heads_k
    group = heads_q // heads_k
    n0 = pid_n * BN
    if VARLEN:
        # packed sequences: one [1, total, H, D] view; this program's sequence starts at row
        # q_row0 / k_row0 of it; the grid spans the longest sequence's keys, shorter ones end sooner
        q_row0, seqlen_q, k_row0, seqlen_k = _sequence_bounds(cu_seqlens_q, cu_seqlens_k, b)
        tb = 0
        live = n0 < seqlen_k
        acc_rows_head = total_q
    else:
        # dense calls take no test and none of the packed-only arguments (their code stays the
        # one measured)
        q_row0 = 0
        k_row0 = 0
        tb = b
        live = True
        acc_rows_head = seqlen_q
    diag = seqlen_k - seqlen_q
    nqb = (seqlen_q + BM - 1) // BM
    if CAUSAL:
        # query m sees key n when n <= m + diag: the first block with a row that sees one of
        # these keys, and the first whose rows all see all of them
        i_lo = gl.minimum(gl.maximum(n0 - diag, 0) // BM, nqb)
        i_full = (gl.maximum(n0 + BN - 1 - diag, 0) + BM - 1) // BM
        n_mask = gl.minimum(gl.maximum(i_full, i_lo), nqb) - i_lo
    else:
        i_lo = 0
        n_mask = 0
    nsteps = nqb - i_lo
    if n0 + BN > seqlen_k:
        n_mask = nsteps
    # the dQ buffer's rows are head-major: (batch, head, token) dense, (head, token) packed
    acc_row0 = (tb * heads_q + hk * group) * acc_rows_head + q_row0

    WIDE: gl.constexpr = D > 128
    qd_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], dtype)
    if WIDE:
        # P^T / dS^T tiles [keys, queries] written in two column halves (one per consumer) of 32
        # queries: a 64-byte swizzle makes each half one whole swizzle span
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    else:
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BM], dtype)
    dq_layout: gl.constexpr = dq_desc.layout
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, D], qd_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, D], qd_layout)
    if WIDE:
        # one-slot buffers, so that the column split's steps can index them with a value the
        # compiler cannot fold (see _step_wide)
        k_all = gl.allocate_shared_memory(dtype, [1, BN, D], kv_layout)
        v_all = gl.allocate_shared_memory(dtype, [1, BN, D], kv_layout)
        k_smem = k_all.index(0)
        v_smem = v_all.index(0)
    else:
        k_smem = gl.allocate_shared_memory(dtype, [BN, D], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [BN, D], kv_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [DS_STAGES, BN, BM], ds_layout)
    if WIDE:
        pt_smem = gl.allocate_shared_memory(dtype, [DS_STAGES, BN, BM], ds_layout)
        pt_full = gl.allocate_shared_memory(gl.int64, [DS_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(DS_STAGES):
            mbarrier.init(pt_full.index(s), count=2)
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_STAGES, BM, D], dq_layout)
    row_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BM], row_smem)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BM], row_smem)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qdo_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_full = gl.allocate_shared_memory(gl.int64, [DS_STAGES, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [DS_STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_STAGES, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(done_bar, count=2)
    for s in gl.static_range(STAGES):
        mbarrier.init(qdo_ready.index(s), count=1)
        mbarrier.init(qdo_empty.index(s), count=2)
    for s in gl.static_range(DS_STAGES):
        mbarrier.init(ds_full.index(s), count=2)
        mbarrier.init(ds_empty.index(s), count=2)
    for s in gl.static_range(DQ_STAGES):
        mbarrier.init(dq_full.index(s), count=2)
        mbarrier.init(dq_empty.index(s), count=1)
    fence_async_shared()

    # the column split and the key split differ in their consumers only (constexpr WIDE); the
    # partition lists are spelled out: warp_specialize takes a list literal, and Gluon 3.6 cannot
    # join argument tuples that hold constants
    if WIDE:
        if live:
            gl.warp_specialize([
                (_consumer_wide, (k_all, v_all, q_smem, do_smem, lse_smem, delta_smem, pt_smem, ds_smem, dq_smem,
                                  kv_bar, qdo_ready, qdo_empty, pt_full, ds_full, ds_empty, dq_full, dq_empty, dk_ptr,
                                  dv_ptr, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, b, hk,
                                  n0, k_row0, group, i_lo, nsteps, n_mask, seqlen_q, seqlen_k, qk_scale, sm_scale, 0,
                                  CAUSAL, STAGES, DS_STAGES, DQ_STAGES)),
                (_consumer_wide, (k_all, v_all, q_smem, do_smem, lse_smem, delta_smem, pt_smem, ds_smem, dq_smem,
                                  kv_bar, qdo_ready, qdo_empty, pt_full, ds_full, ds_empty, dq_full, dq_empty, dk_ptr,
                                  dv_ptr, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, b, hk,
                                  n0, k_row0, group, i_lo, nsteps, n_mask, seqlen_q, seqlen_k, qk_scale, sm_scale, 1,
                                  CAUSAL, STAGES, DS_STAGES, DQ_STAGES)),
                (_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                             kv_bar, qdo_ready, qdo_empty, lse_ptr, delta_ptr, stride_lb, stride_lh, seqlen_q, tb, hk,
                             n0, q_row0, k_row0, group, i_lo, nsteps, STAGES)),
                (_dq_writer, (dq_desc, dq_smem, dq_full, dq_empty, acc_row0, acc_rows_head, group, i_lo, nsteps,
                              DQ_STAGES)),
            ], [4, 1, 1], [CONSUMER_REGS, SMALL_REGS, SMALL_REGS])
    else:
        if live:
            gl.warp_specialize([
                (_consumer, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, done_bar,
                             qdo_ready, qdo_empty, ds_full, ds_empty, dq_full, dq_empty, dk_desc, dv_desc, dk_ptr, dv_ptr,
                             stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, b, hk, n0, k_row0,
                             group, i_lo, nsteps, n_mask, seqlen_q, seqlen_k, qk_scale, sm_scale, 0, CAUSAL, STAGES,
                             DS_STAGES, DQ_STAGES, TMA_OUT)),
                (_consumer, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, done_bar,
                             qdo_ready, qdo_empty, ds_full, ds_empty, dq_full, dq_empty, dk_desc, dv_desc, dk_ptr, dv_ptr,
                             stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, b, hk, n0, k_row0,
                             group, i_lo, nsteps, n_mask, seqlen_q, seqlen_k, qk_scale, sm_scale, 1, CAUSAL, STAGES,
                             DS_STAGES, DQ_STAGES, TMA_OUT)),
                (_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                             kv_bar, qdo_ready, qdo_empty, lse_ptr, delta_ptr, stride_lb, stride_lh, seqlen_q, tb, hk,
                             n0, q_row0, k_row0, group, i_lo, nsteps, STAGES)),
                (_dq_writer, (dq_desc, dq_smem, dq_full, dq_empty, acc_row0, acc_rows_head, group, i_lo, nsteps,
                              DQ_STAGES)),
            ], [4, 1, 1], [CONSUMER_REGS, SMALL_REGS, SMALL_REGS])


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> bool:
    """Whether bf16 q/k/v/do, dense ``[B, S, H, D]`` or packed ``[total, H, D]``, meet this
    kernel's layout needs (a head dim in :data:`HEAD_DIMS`, 16-byte aligned bases and strides,
    unit stride along D). Raises nothing."""
    if not (q.dtype == k.dtype == v.dtype == do.dtype == torch.bfloat16) or q.dim() not in (3, 4):
        return False
    if q.shape[-1] not in HEAD_DIMS or 0 in q.shape or 0 in k.shape:
        return False
    # an ``and`` chain, not all() over a generator: this runs on every training step
    return copy_engine_reads(q) and copy_engine_reads(k) and copy_engine_reads(v) and copy_engine_reads(do)


@functools.lru_cache(maxsize=None)
def _layout_dq() -> gl.NVMMASharedLayout:
    # 128-byte swizzle: the consumers' stores of their dQ halves from wgmma's register layout
    # would hit one bank 8 times over in rows of 512 bytes unswizzled; the copy engine takes the
    # [64, D] tile as D/32 boxes of one swizzle span each
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)


def _rows_descriptor(t: torch.Tensor) -> TensorDescriptor:
    """A contiguous ``[B, S, H, D]`` gradient seen as ``[B * S, H * D]``, in boxes of half a key
    block of one head."""
    b, s, h, d = t.shape
    return make_descriptor(t, [b * s, h * d], [h * d, 1], [BLOCK_N // 2, d], _layout_2d(BLOCK_N // 2, d))


@functools.lru_cache(maxsize=None)
def _layout_2d(rows: int, head_dim: int) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16)


def _launch_args(q, k, v, do, lse, delta, dq_acc, dk, dv, softmax_scale, causal, cu_seqlens_q=None,
                 cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, order=None) -> Tuple[tuple, tuple, dict]:
    """(grid, positional arguments, keyword arguments) of one launch; ``order`` overrides
    :data:`ORDER` (dense causal calls only; the others take head order)."""
    varlen = cu_seqlens_q is not None
    d = q.shape[-1]
    if varlen:
        # one batch of all the tokens: each program finds its sequence's rows in it
        batch, heads_q, heads_k = cu_seqlens_q.numel() - 1, q.shape[1], k.shape[1]
        seqlen_q, seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
        q, k, v, do = (t.unsqueeze(0) for t in (q, k, v, do))
        dk_strides, dv_strides = (0, *dk.stride()[:2]), (0, *dv.stride()[:2])
        lse_strides = (0, lse.stride(0))
        packed = (cu_seqlens_q, cu_seqlens_k, q.shape[1])
    else:
        batch, seqlen_q, heads_q, _ = q.shape
        seqlen_k, heads_k = k.shape[1], k.shape[2]
        dk_strides, dv_strides = dk.stride()[:3], dv.stride()[:3]
        lse_strides = (lse.stride(0), lse.stride(1))
        packed = (None, None, None)  # compile-time None: a dense call's code has none of them
    dq_desc = make_descriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), [BLOCK_M, d], _layout_dq())
    block_n, stages, ds_stages, dq_stages = tiles(d)
    # the column split stores dK / dV with masked stores (each consumer holds half the columns)
    tma_out = STORE_DKDV_BY_TMA and not varlen and d < WIDE_FROM
    # dK / dV leave in halves of the key block, one per consumer; compile-time None when unused
    out_descs = (_rows_descriptor(dk), _rows_descriptor(dv)) if tma_out else (None, None)
    # not triton.cdiv (µs a call); the third axis must stay 1: _step_wide takes program_id(2) as 0
    grid = ((seqlen_k + block_n - 1) // block_n, batch * heads_k, 1)
    args = (_descriptor(q, BLOCK_M, d), _descriptor(k, block_n, d), _descriptor(v, block_n, d),
            _descriptor(do, BLOCK_M, d),
            dq_desc, *out_descs, dk, dv, *dk_strides, *dv_strides, lse, delta, *lse_strides, *packed,
            seqlen_q, seqlen_k, heads_q, heads_k, float(softmax_scale) * LOG2E, float(softmax_scale))
    kwargs = dict(CAUSAL=bool(causal), STAGES=stages, DS_STAGES=ds_stages, DQ_STAGES=dq_stages,
                  CONSUMER_REGS=REGS[0], SMALL_REGS=REGS[1], VARLEN=varlen, TMA_OUT=tma_out,
                  ORDER=(ORDER if order is None else int(order)) if causal and not varlen else HEAD_ORDER,
                  num_warps=4,
                  maxnreg=REGS[2])
    return grid, args, kwargs


def gluon_dkdv_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                  delta: torch.Tensor, dq_acc: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *,
                  softmax_scale: float, causal: bool, **packed) -> None:
    """Launch the kernel (see the module docstring); the caller checked :func:`supports`, made
    ``delta`` and zeroed ``dq_acc``. ``packed``: ``cu_seqlens_q``, ``cu_seqlens_k``,
    ``max_seqlen_q``, ``max_seqlen_k`` for packed sequences. Raises what Triton raises on
    compile errors."""
    grid, args, kwargs = _launch_args(q, k, v, do, lse, delta, dq_acc, dk, dv, softmax_scale, causal, **packed)
    launcher = _launcher(kwargs["VARLEN"], kwargs["TMA_OUT"])
    launcher(grid, args, _constexprs(launcher, kwargs), kwargs["num_warps"], 1)


# the launches through _launch's cached path: a Launcher keys one kind of argument per slot, so
# there is one per (packed, dK/dV by TMA): packed calls hold ints where dense ones hold None, and
# the calls without TMA stores (packed ones, and the column split's) None where the others hold
# dK/dV's descriptors
_LAUNCHERS = {(varlen, tma_out): Launcher(_gluon_attn_bwd, maxnreg=REGS[2])
              for varlen, tma_out in ((False, True), (False, False), (True, False))}


def _launcher(varlen: bool, tma_out: bool) -> Launcher:
    return _LAUNCHERS[(varlen, tma_out)]


def _constexprs(launcher: Launcher, kwargs: dict) -> tuple:
    # one C-level pick of the values per set of names (a generator over the names cost
    # microseconds on every training step)
    pick = _PICKS.get(launcher._constexpr_names)
    if pick is None:
        pick = _PICKS[launcher._constexpr_names] = operator.itemgetter(*launcher._constexpr_names)
    return pick(kwargs)


_PICKS: dict = {}


_AHEAD: set = set()


def compile_ahead(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                  delta: torch.Tensor, dq_acc: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *,
                  softmax_scale: float, causal: bool, **packed) -> list:
    """Start compiling, on flash_attn2's compile threads (``_launch``), the specialisation a
    launch with these arguments needs, once per (device, head_dim, causal) in a process; returns
    the Futures (see ``_launch.compile_all``). The tensors may be ``meta`` tensors shaped like
    the real ones. Raises nothing itself: a compile error surfaces in the Future."""
    from . import _launch

    key = (q.device, q.shape[-1], bool(causal), packed.get("cu_seqlens_q") is not None)
    if _launch.COMPILE_THREADS <= 0 or key in _AHEAD:
        return []
    _AHEAD.add(key)
    grid, args, kwargs = _launch_args(q, k, v, do, lse, delta, dq_acc, dk, dv, softmax_scale, causal, **packed)
    device = q.device

    launcher = _launcher(kwargs["VARLEN"], kwargs["TMA_OUT"])

    def one() -> None:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            launcher.warmup(args, _constexprs(launcher, kwargs), kwargs["num_warps"], 1)

    return [_launch._pool().submit(one)]
