"""Split-K ("flash decoding") Triton kernels for attention over a KV cache.

Decode steps have one (or a few) query tokens per sequence, so the work is reading K and V once
at memory speed. One program handles every query head of one KV head (GQA/MQA read K/V once
for the whole group) over one slice of the keys; several slices ("splits") per row keep all
SMs busy when batch x kv_heads alone would not; in eager calls the last slice of a tile to
finish merges them all through their log-sum-exp (one launch: each slice counts itself in on a
per-tile counter, and the one that completes the count reads the others' partial results), in
a CUDA graph a second kernel does (see MERGE_IN_KERNEL). Larger query chunks are
tiled over q (grid axis 1), so the same kernel also serves speculative / chunked-prefill steps.

Entry point: ``decode_attention(...)`` below; the argument checking and the writing of new keys
into the cache happen in ``_kvcache.py``.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ._launch import Launcher
from ._launch import capturing as _capturing
from ._launch import current_stream as _current_stream
from ._triton_fwd import capability_of as _capability
from ._triton_fwd import next_pow2_dim

_LOG2E = 1.4426950408889634
_I32_MAX = 2**31 - 1


# Every runtime scalar is left unspecialised: the launch cache then keys them on their width
# alone (a key per integer's divisibility was several us of the host time a decode step pays per
# layer (bench/NOTES.md, Kernel tuning)). What specialisation bought is restored explicitly:
# head_dim is contiguous (no stride argument), and ALIGNED says every row stride is a multiple of
# 16 elements, and so is head_dim (all passed divided by 16), which the vectorised loads need.
_SPLIT_RUNTIME_SCALARS = (
    "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh",
    "stride_vb", "stride_vs", "stride_vh", "stride_btb", "stride_alb",
    "stride_os", "stride_ob", "stride_oh", "stride_oq", "stride_ls", "stride_lb", "stride_lh", "stride_lq",
    "seqlen_q", "num_kv_heads", "head_dim", "total_len_uniform", "capacity",
    "scale_log2", "softcap", "window_left", "window_right",
)


@triton.jit
def _key_slice(pid_m, pid_split, seqlen_q, kv_len, shift, window_left, window_right,
               GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               NUM_SPLITS: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr):
    """Keys [start, end) this split of this query tile reads: the tile's visible keys (windows
    bound them) cut into NUM_SPLITS slices of whole blocks."""
    first_q = pid_m * BLOCK_M // GROUP
    last_q = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, seqlen_q - 1)
    hi = kv_len
    if HAS_WINDOW_RIGHT:
        hi = tl.minimum(hi, last_q + shift + window_right + 1)
    lo = 0
    if HAS_WINDOW_LEFT:
        lo = tl.maximum(lo, first_q + shift - window_left)
    n_blocks = tl.maximum(tl.cdiv(hi - lo, BLOCK_N), 0)
    blocks_per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    start = lo + pid_split * blocks_per_split * BLOCK_N
    end = tl.minimum(hi, start + blocks_per_split * BLOCK_N)
    return start, end


@triton.jit
def _kv_rows(BLOCK_TABLE, b, stride_btb, cache_b, pos, n_ok, stride_kb, stride_ks, stride_vb, stride_vs,
             pages, first_page, block_start, PAGE_SIZE: tl.constexpr, PRELOAD: tl.constexpr,
             PAGE_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offsets of the K and V rows at cache positions ``pos``, and which of them exist:
    through the row's block table when paged (PAGE_SIZE > 0), else in cache row ``cache_b``.
    With PAGE_BLOCKS the block of keys from position ``block_start`` lies in one page (the host
    saw to it, see :data:`PAGE_BLOCKS`): ``pages`` is that page's table entry (loaded a step
    earlier by the caller, or picked out of the preloaded ones, :data:`PRELOADED_BLOCKS`) and
    serves the whole block. With PRELOAD > 0 the page numbers come
    from ``pages`` (the split's table entries from column ``first_page``, loaded before the
    loop), so no load in the loop waits on another load.
    A negative entry is a page not allocated (CUDA-graph padding): its keys are left out, never
    read."""
    if PAGE_SIZE > 0 and PAGE_BLOCKS:
        page = pages.to(tl.int64)
        # in-page rows as scalar + arange: the compiler sees the block's rows consecutive
        in_page = (block_start % PAGE_SIZE) + tl.arange(0, BLOCK_N)
        # page >= 0 splat to a block (a scalar mask term fails under the interpreter). Not
        # page * PAGE_SIZE + in_page >= 0, which says the same but costs 64-bit arithmetic a key:
        # the key loop 870 -> 692 sm90 SASS instructions with Triton 3.6 (dense: 660), bench/results/decode_sass.md
        n_ok = n_ok & (tl.zeros([BLOCK_N], dtype=tl.int32) + pages.to(tl.int32) >= 0)
        page = tl.maximum(page, 0)
        k_row = page * stride_kb + in_page * stride_ks
        v_row = page * stride_vb + in_page * stride_vs
    elif PAGE_SIZE > 0:
        if PRELOAD > 0:
            col = tl.minimum(tl.maximum(pos // PAGE_SIZE - first_page, 0), PRELOAD - 1)
            page = tl.gather(pages, col, axis=0)
        else:
            page = tl.load(BLOCK_TABLE + b * stride_btb + pos // PAGE_SIZE, mask=n_ok, other=0)
        n_ok = n_ok & (page >= 0)
        page = tl.maximum(page, 0)
        k_row = page.to(tl.int64) * stride_kb + (pos % PAGE_SIZE) * stride_ks
        v_row = page.to(tl.int64) * stride_vb + (pos % PAGE_SIZE) * stride_vs
    else:
        k_row = cache_b * stride_kb + pos.to(tl.int64) * stride_ks
        v_row = cache_b * stride_vb + pos.to(tl.int64) * stride_vs
    return k_row, v_row, n_ok


@triton.jit
def _decode_scores(s, rel, n_ok, slope, scale_log2, softcap, window_left, window_right,
                   HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr):
    """Raw q.k -> masked scores in log2 units; ``rel`` = query position - key position."""
    if HAS_SOFTCAP:
        # tanh through exp: portable to the interpreter and every Triton version we ship for
        t = s * (scale_log2 / (softcap * 1.4426950408889634))
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * t) + 1.0)) * 1.4426950408889634
    else:
        s = s * scale_log2
    if HAS_ALIBI:
        s = s - (slope[:, None] * tl.abs(rel).to(tl.float32)) * 1.4426950408889634
    keep = n_ok[None, :]
    if HAS_WINDOW_RIGHT:
        keep = keep & (rel >= -window_right)
    if HAS_WINDOW_LEFT:
        keep = keep & (rel <= window_left)
    return tl.where(keep, s, float("-inf"))


@triton.jit(do_not_specialize=_SPLIT_RUNTIME_SCALARS)
def _split_kernel(
    Q, K, V, BLOCK_TABLE, TOTAL_LENS, BATCH_IDX, LEFTPAD, ALIBI,
    O, LSE, COUNTERS, O_FINAL, LSE_FINAL,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb,
    stride_alb,
    stride_os, stride_ob, stride_oh, stride_oq,
    stride_ls, stride_lb, stride_lh, stride_lq,
    seqlen_q, num_kv_heads, head_dim, total_len_uniform, capacity,
    scale_log2, softcap, window_left, window_right,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PRELOAD: tl.constexpr, PAGE_BLOCKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_LENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    FINAL: tl.constexpr, STORE_LSE: tl.constexpr, ALIGNED: tl.constexpr,
    MERGE: tl.constexpr, MERGE_LSE: tl.constexpr, MERGE_CHUNK: tl.constexpr,
):
    if ALIGNED:
        # the row strides came divided by 16: multiplying here is how the compiler learns they
        # are multiples of 16 (a hint on an argument itself does not reach its alignment analysis)
        stride_qb *= 16
        stride_qs *= 16
        stride_qh *= 16
        stride_kb *= 16
        stride_ks *= 16
        stride_kh *= 16
        stride_vb *= 16
        stride_vs *= 16
        stride_vh *= 16
        stride_os *= 16
        stride_ob *= 16
        stride_oh *= 16
        stride_oq *= 16
        head_dim *= 16  # so the head_dim mask is known constant over each 16-element vector
    pid_split = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // num_kv_heads
    hk = pid_bh % num_kv_heads

    # Row r of the tile is (query token r // GROUP, head r % GROUP of this kv head's group), so a
    # tile covers consecutive query tokens and causal bounds stay tight when tiling over q.
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = offs_m // GROUP
    head = hk * GROUP + offs_m % GROUP
    row_ok = q_idx < seqlen_q
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim

    if HAS_LENS:
        # A length past what the cache (the block table) addresses is known only on the device:
        # reading stops at the capacity, so such a row attends to its first `capacity` keys.
        total = tl.minimum(tl.load(TOTAL_LENS + b), capacity)
    else:
        total = total_len_uniform
    if HAS_LEFTPAD:
        pad = tl.load(LEFTPAD + b)
    else:
        pad = 0
    # Keys are numbered relative to the left pad; causal/window/alibi positions use these
    # numbers, aligned so that the last query token sits on the last key (bottom-right).
    kv_len = total - pad
    shift = kv_len - seqlen_q
    start, end = _key_slice(pid_m, pid_split, seqlen_q, kv_len, shift, window_left, window_right,
                            GROUP, BLOCK_M, BLOCK_N, NUM_SPLITS, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)

    q_ptrs = Q + b * stride_qb + q_idx[:, None] * stride_qs + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    if HAS_BATCH_IDX:
        cache_b = tl.load(BATCH_IDX + b).to(tl.int64)
    else:
        cache_b = b.to(tl.int64)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + b * stride_alb + head, mask=row_ok, other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    first_page = (start + pad) // PAGE_SIZE if PAGE_SIZE > 0 else 0
    pages = 0
    if PAGE_SIZE > 0 and PRELOAD > 0:
        cols = first_page + tl.arange(0, PRELOAD)
        pages = tl.load(BLOCK_TABLE + b * stride_btb + cols, mask=cols < capacity // PAGE_SIZE, other=0)
    if PAGE_SIZE > 0 and PAGE_BLOCKS and PRELOAD == 0:
        # the first block's table entry; each step then loads the next block's, so the K/V copies
        # never wait on a table load of their own step
        page_cols = capacity // PAGE_SIZE
        pages = tl.load(BLOCK_TABLE + b * stride_btb + first_page, mask=first_page < page_cols, other=0)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        block_pages = pages
        if PAGE_SIZE > 0 and PAGE_BLOCKS and PRELOAD > 0:
            # the block's one entry picked out of the preloaded ones (PRELOADED_BLOCKS): no load in
            # the loop, and one page for the block's keys instead of a gather a key
            col = (start_n + pad) // PAGE_SIZE - first_page
            block_pages = tl.sum(tl.where(tl.arange(0, PRELOAD) == col, pages, 0), axis=0)
        k_row, v_row, n_ok = _kv_rows(BLOCK_TABLE, b, stride_btb, cache_b, offs_n + pad, n_ok,
                                      stride_kb, stride_ks, stride_vb, stride_vs, block_pages, first_page,
                                      start_n + pad, PAGE_SIZE, PRELOAD, PAGE_BLOCKS, BLOCK_N)
        if PAGE_SIZE > 0 and PAGE_BLOCKS and PRELOAD == 0:
            next_col = (start_n + BLOCK_N + pad) // PAGE_SIZE
            pages = tl.load(BLOCK_TABLE + b * stride_btb + next_col, mask=next_col < page_cols, other=0)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + hk * stride_kh + k_row[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = _decode_scores(tl.dot(q, tl.trans(k)), q_idx[:, None] + shift - offs_n[None, :], n_ok,
                           slope, scale_log2, softcap, window_left, window_right,
                           HAS_ALIBI, HAS_SOFTCAP, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; subtracting 0 then keeps p = 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + hk * stride_vh + v_row[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
    if FINAL:
        # flash-attn's convention for a row that sees no key: output 0, LSE +inf.
        lse = tl.where(has_keys, lse, float("inf"))
    else:
        lse = tl.where(has_keys, lse, float("-inf"))
    o_ptrs = (O + pid_split * stride_os + b * stride_ob + head[:, None] * stride_oh
              + q_idx[:, None] * stride_oq + offs_d[None, :])
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if STORE_LSE:
        l_ptrs = LSE + pid_split * stride_ls + b * stride_lb + head * stride_lh + q_idx * stride_lq
        tl.store(l_ptrs, lse, mask=row_ok)
    if MERGE:
        # Every thread's partial stores come before the tile's arrival (the barrier), and the
        # arrival releases them at GPU scope; the slice that completes the count acquires the
        # others' and merges. No slice waits for another, so no launch order can deadlock.
        tl.debug_barrier()
        counter = COUNTERS + pid_m * tl.num_programs(2) + pid_bh
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:
            _merge_splits(O, LSE, O_FINAL, LSE_FINAL, b, head, q_idx, row_ok, offs_d, d_ok,
                          stride_os, stride_ob, stride_oh, stride_oq, stride_ls, stride_lb, stride_lh, stride_lq,
                          seqlen_q, num_kv_heads * GROUP, head_dim, NUM_SPLITS, MERGE_LSE, BLOCK_M, BLOCK_D,
                          MERGE_CHUNK)
            tl.atomic_xchg(counter, 0)  # back to zero for the next launch that uses this buffer


@triton.jit
def _merge_splits(O, LSE, O_FINAL, LSE_FINAL, b, head, q_idx, row_ok, offs_d, d_ok,
                  stride_os, stride_ob, stride_oh, stride_oq, stride_ls, stride_lb, stride_lh, stride_lq,
                  seqlen_q, num_heads, head_dim, NUM_SPLITS: tl.constexpr, STORE_LSE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """One tile's rows merged over its NUM_SPLITS partial results (natural-log LSE each, -inf for a
    slice that saw no key) into out ``[B, Sq, Hq, D]`` and, with STORE_LSE, lse ``[B, Hq, Sq]``
    (+inf for a row that saw no key).

    CHUNK slices' partial results are loaded a step (see MERGE_CHUNK). One program merges alone
    and waits out the L2 latency once a step, which is why this merge costs GPU time the
    two-kernel one does not (see MERGE_IN_KERNEL).
    """
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_lse = b * stride_lb + head * stride_lh + q_idx * stride_lq
    row_o = b * stride_ob + head[:, None] * stride_oh + q_idx[:, None] * stride_oq + offs_d[None, :]
    mask = row_ok[:, None] & d_ok[None, :]
    for first in range(0, NUM_SPLITS, CHUNK):
        offs_s = first + tl.arange(0, CHUNK)
        s_ok = offs_s < NUM_SPLITS
        # .cg: read through L2, where the other slices' stores are, never a stale L1 line
        lse_c = tl.load(LSE + offs_s[:, None] * stride_ls + row_lse[None, :], mask=s_ok[:, None] & row_ok[None, :],
                        other=float("-inf"), cache_modifier=".cg")
        o_c = tl.load(O + offs_s[:, None, None] * stride_os + row_o[None, :, :],
                      mask=s_ok[:, None, None] & mask[None, :, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse_c, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        keep = tl.exp(m - m_safe)
        w = tl.exp(lse_c - m_safe[None, :])
        acc = acc * keep[:, None] + tl.sum(o_c * w[:, :, None], 0)
        total = total * keep + tl.sum(w, 0)
        m = m_new
    seen = total > 0.0
    total_safe = tl.where(seen, total, 1.0)
    out = acc / total_safe[:, None]
    o_ptrs = O_FINAL + ((b * seqlen_q + q_idx[:, None]) * num_heads + head[:, None]) * head_dim + offs_d[None, :]
    tl.store(o_ptrs, out.to(O_FINAL.dtype.element_ty), mask=mask)
    if STORE_LSE:
        lse = tl.where(seen, m + tl.log(total_safe), float("inf"))
        tl.store(LSE_FINAL + (b * num_heads + head) * seqlen_q + q_idx, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    O_PART, LSE_PART, O, LSE,
    stride_ps, stride_pb, stride_ph, stride_pq, stride_pd,
    stride_qs, stride_qb, stride_qh, stride_qq,
    stride_ob, stride_oq, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lq,
    num_heads, seqlen_q, head_dim,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid % seqlen_q
    h = (pid // seqlen_q) % num_heads
    b = pid // (seqlen_q * num_heads)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < head_dim
    lse = tl.load(LSE_PART + offs_s * stride_qs + b * stride_qb + h * stride_qh + i * stride_qq,
                  mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, 0)
    parts = tl.load(O_PART + offs_s[:, None] * stride_ps + b * stride_pb + h * stride_ph
                    + i * stride_pq + offs_d[None, :] * stride_pd,
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total_safe = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(parts * w[:, None], 0) / total_safe
    out_lse = tl.where(total > 0.0, m_safe + tl.log(total_safe), float("inf"))
    tl.store(O + b * stride_ob + i * stride_oq + h * stride_oh + offs_d * stride_od,
             out.to(O.dtype.element_ty), mask=d_ok)
    if STORE_LSE:
        tl.store(LSE + b * stride_lb + h * stride_lh + i * stride_lq, out_lse)


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernels write; one place so tests can poison them."""
    return torch.empty(shape, dtype=dtype, device=device)


SHORT_CONTEXT = 4096


def choose_num_splits(programs: int, capacity: int, sms: int, on_gpu: bool, block_n: int,
                      whole_rows: bool = False) -> int:
    """How many key slices per row: enough programs for a few per SM, never slices under ~2 blocks.

    Chosen from the cache capacity rather than the actual lengths, so no host sync is needed;
    slices past a row's length end at once. ``whole_rows``: one slice per row is an option at any
    length (a contiguous cache with :data:`ONE_SPLIT_CONFIG_SM90`'s tile), taken when the
    programs fill whole waves of one per SM to :data:`WHOLE_ROWS_MIN_FILL`.
    """
    target = 3 * sms
    if programs >= target:
        return 1
    if whole_rows and programs >= sms and programs / (-(-programs // sms) * sms) >= WHOLE_ROWS_MIN_FILL:
        return 1
    if on_gpu and capacity <= SHORT_CONTEXT and programs >= WHOLE_ROWS_MIN_FILL * sms:
        # Short contexts over a wave of programs (or nearly one) or more: one split. Slicing them
        # ends in a partly filled last wave and a merge (batch 32 x 4k, 256 programs on 132 SMs:
        # 175 us of GPU time in one slice against 180 in two, bench/results/decode_merge.md).
        # Well under a wave, one slice leaves SMs idle: batch 8 x 2304 keys (64 programs) took
        # 46.7 us in one slice against 34.0 in seven (CUDA graph, second kernel) and 37.7 merged
        # in the launch, whose host time is 30.2 against 28.9 us.
        return 1
    by_fill = math.ceil(target / max(programs, 1))
    by_length = max(1, capacity // (2 * block_n))
    return max(1, min(by_fill, by_length, 64))


# The most block-table entries a paged split loads before its loop (a power of two). Up to this
# many pages per split, the page numbers sit in registers and the K/V loads' addresses depend on
# no load of the same iteration; past it (long contexts on few splits) a block reads one entry
# (PAGE_BLOCKS) or, where a block may straddle pages, each key looks its page up.
PRELOAD_MAX = 32


# A paged cache whose pages hold whole key blocks (the page size a multiple of the tile's keys,
# and every block starting on a multiple of its size: no left padding, no left window) and whose
# split has too many table entries to preload (PRELOAD_MAX) reads one entry a block, a scalar
# load issued a step ahead, instead of one a key; such a cache may then be read in one slice per
# row like a dense one (WHOLE_ROWS_MIN_FILL). On the H200 (bench/results/decode_page_blocks.md,
# batch 32 x GQA 32/8, 256-key pages): 32k keys in one slice 4.50 TB/s against 4.35 with per-key
# lookups and 4.47 for the two slices those took; at 4k, where the entries fit in registers,
# preloading stayed ahead (4.00 against 3.96-3.97). False: every paged cache the earlier way.
# Read per call, so benchmarks can compare both.
PAGE_BLOCKS = True


# Where a split's entries are preloaded and its blocks lie in pages, each block picks its one
# entry out of the preloaded ones (a reduction over them, no load in the loop) and addresses its
# keys like a dense block, instead of gathering an entry per key. Off: as fast as the gather on
# the H100 (batch 32 x 4k: 2.877 against 2.875 TB/s, bench/results/decode.md, 'preloaded blocks'),
# so the gather, the longer-measured path, stays. Read per call.
PRELOADED_BLOCKS = False


def page_blocks(page_size: int, block_n: int, leftpad: bool, window_left: int) -> bool:
    """Whether every ``block_n``-key block of a paged cache of ``page_size`` keys a page lies in
    one page (:data:`PAGE_BLOCKS` on); ``leftpad``: the call has left padding."""
    return (PAGE_BLOCKS and page_size > 0 and page_size % block_n == 0 and not leftpad
            and window_left < 0)


def preload_pages(capacity: int, page_size: int, block_n: int, splits: int) -> int:
    """Block-table entries one split preloads (0: look pages up per key; see PRELOAD_MAX).

    A split reads at most ceil(ceil(capacity / block_n) / splits) blocks, which start anywhere in
    a page (left padding, windows), so they touch at most that many keys' pages plus one.
    """
    if page_size <= 0:
        return 0
    keys = -(-(-(-capacity // block_n)) // splits) * block_n
    pages = -(-keys // page_size) + 1
    preload = 1 << (pages - 1).bit_length()
    return preload if preload <= PRELOAD_MAX else 0


def page_lookup(capacity: int, page_size: int, block_n: int, splits: int, leftpad: bool,
                window_left: int) -> tuple[int, bool]:
    """How a split finds its pages: ``(preload, by_block)``, the table entries it preloads
    (:func:`preload_pages`) and whether it reads one entry a block instead (:data:`PAGE_BLOCKS`);
    ``(0, False)``: each key looks its page up. Raises nothing."""
    preload = preload_pages(capacity, page_size, block_n, splits)
    blocks = page_blocks(page_size, block_n, leftpad, window_left)
    return preload, blocks and (not preload or PRELOADED_BLOCKS)


# Several slices per row are merged by the last of them to finish (a per-tile arrival counter)
# in eager calls, and by a second kernel (``_combine_kernel``) while a CUDA graph is captured;
# False: always by the second kernel. Why both (bench/results/decode_merge.md, batch 1-32 over
# 2k-32k keys): one launch fewer saves host time, which paces eager decoding (34-39 against 44-73
# us a call), while the one program that merges costs GPU time, which is all a graph replay pays
# (18 against 37 us at 50 slices, 26 against 32 at 13, 3-4 us at 2-7)
MERGE_IN_KERNEL = True
# slices the merging program loads at once at BLOCK_M=16, fewer for taller tiles (a power of two).
# One: on the H200 four at a time made a 50-slice merge slower, not faster (bench/results/
# decode_merge.md); offline sm90 compile, 4 warps: 118 registers without the merge, 128 with it
MERGE_CHUNK = 1

# (device, stream) -> int32 arrival counters, all zero between launches: each merging slice puts
# its tile's counter back to zero. One buffer per stream, so calls that run at the same time on
# two streams never count on the same counters; it only grows.
_COUNTERS: dict = {}


def _arrival_counters(device: torch.device, n: int, stream: int, capturing: bool) -> torch.Tensor:
    """The zeroed arrival counters of one launch: the current stream's buffer (:func:`_counters`),
    or, while a CUDA graph is being captured (a merge asked for there by ``merge_in_kernel=True``),
    a buffer of the graph's own, zeroed at every replay (a graph may be replayed on any stream,
    beside eager calls on the one it was captured on; ``stream``: :func:`_current_stream`'s answer,
    0 on the CPU; ``capturing``: :func:`_capturing`'s answer)."""
    if capturing:
        return torch.zeros(n, dtype=torch.int32, device=device)
    return _counters(device, n, stream)


def _counters(device: torch.device, n: int, stream: int) -> torch.Tensor:
    """At least ``n`` zeroed arrival counters for launches on ``device``'s ``stream``
    (:func:`_current_stream`; 0 for the CPU under the interpreter)."""
    key = (device, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        # the old buffer goes back to torch's allocator, which hands it out again on this stream
        # only, after the launches already queued on it; no graph holds it (_arrival_counters)
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


# The partial outputs and LSEs of a call read in several slices live in a buffer per (device,
# stream), kept from one call to the next; False: fresh ones each call. Why: eager decoding is
# paced by the host (a Llama-3-8B-shaped decode step, bench/results/e2e_transformers_*.md), and
# two allocations a call were the host cost the split path adds over a one-slice call. Safe to
# reuse: a call's slices and its merge run on the stream that the next call on that stream
# waits for; every slice writes its partial, an empty one too, so nothing of an earlier call is
# read. A graph being captured gets its own (a replay may run beside eager calls). Size: splits
# x the output in float32 (0.85 MB at batch 4 x 32 heads x d128 in 13 slices; splits shrink as
# the programs grow, so the automatic choice stays under ~50 MB); read per call.
REUSE_PARTIALS = True
# (device, stream) -> (partial outputs, partial LSEs) of the last split call on that stream
_PARTIALS: dict = {}


def _partials(device: torch.device, shape: tuple[int, int, int, int, int], stream: int,
              capturing: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 partial outputs ``shape`` = ``[splits, B, Hq, Sq, D]`` and partial LSEs
    ``[splits, B, Hq, Sq]`` of one split launch: the current stream's pair when
    :data:`REUSE_PARTIALS` is on and not capturing a CUDA graph (replaced when the shape
    changes), else fresh ones. ``stream``: :func:`_current_stream`'s answer, 0 on the CPU. Raises
    nothing."""
    if capturing or not REUSE_PARTIALS:
        return _alloc(shape, torch.float32, device), _alloc(shape[:-1], torch.float32, device)
    key = (device, stream)
    held = _PARTIALS.get(key)
    if held is None or held[0].shape != shape:
        # the old pair goes back to torch's allocator, reused on this stream only after the
        # launches queued on it (the same reasoning as the arrival counters)
        held = _PARTIALS[key] = (_alloc(shape, torch.float32, device), _alloc(shape[:-1], torch.float32, device))
    return held


_SETUP: dict = {}

# sm90, head_dim 65-128: the tile of a call that reads each row in one slice. With one split the
# launch holds one program per (row, KV head) and each streams its whole row: 128-key blocks in
# 2 stages kept the copies in flight better than the 64-key, 4-stage tile the split calls take
# (batch 32 x GQA 32/8 x 4k, bench/results/decode_tiles.md: 0.99x cuDNN against 0.97-0.98x, paged
# and contiguous alike)
ONE_SPLIT_CONFIG_SM90 = {128: (128, 4, 2)}
# A contiguous cache is read in one slice per row at any length when its programs fill this share
# of whole waves of one program per SM (the one-split tile's shared memory leaves room for one):
# 256 programs on 132 SMs (0.97) read 32k keys at 1.00x cuDNN in one slice against 0.98x in two
# (bench/results/decode.md, 'contiguous 1 split'). So is a paged cache read without per-key
# lookups (page_lookup; one entry a block at 32k: 4.50 TB/s in one slice against 4.47 in two);
# one that looks every key's page up keeps its slices (0.95x cuDNN in one slice: one program
# per SM hides less of that latency).
WHOLE_ROWS_MIN_FILL = 0.9


def _device_setup(head_dim: int, device: torch.device) -> tuple:
    """(BLOCK_N, num_warps, num_stages, BLOCK_D, SM count, on a GPU, one-split config or None) for
    head_dim on device.

    Computed once per (head_dim, device): device queries on every decode step are host time.
    The configs are the ones fast on both cache layouts, contiguous and paged (bench/NOTES.md, Kernel tuning).
    Deep pipelines need the 164-228 KB of shared
    memory of sm80/sm90; other GPUs (about 100 KB) get 2 stages. Under the interpreter: small
    tiles and a pretend GPU of 4 SMs, so the CPU tests exercise several splits.
    """
    key = (head_dim, device)
    setup = _SETUP.get(key)
    if setup is None:
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            setup = gpu_setup(head_dim, _capability(device), sms)
        else:
            setup = (16, 1, 1, next_pow2_dim(head_dim), 4, False, None)
        _SETUP[key] = setup
    return setup


def gpu_setup(head_dim: int, capability: tuple, sms: int) -> tuple:
    """:func:`_device_setup`'s answer for a GPU of ``capability`` with ``sms`` SMs. Raises nothing."""
    config = _config_for(head_dim, capability in ((8, 0), (9, 0)))
    one_split = None
    if capability == (9, 0) and head_dim > 64:
        one_split = ONE_SPLIT_CONFIG_SM90.get(next_pow2_dim(head_dim))
    return config + (next_pow2_dim(head_dim), sms, True, one_split)


def _config_for(head_dim: int, big_smem: bool) -> tuple[int, int, int]:
    if head_dim <= 64:
        return 128, 4, 4 if big_smem else 2
    if head_dim <= 128:
        return 64, 4, 4 if big_smem else 2
    return 32, 4, 3 if big_smem else 2


# Everything a decode launch's shape depends on -> that shape (see _plan). Why: in eager decoding
# the host's time per call paces the step, and every layer of a step makes the same call on the
# same shapes; deriving the launch once per step, not once per layer, takes that Python off the
# other layers' calls. Cleared when full (the context grows by a token each step).
_PLANS: dict = {}
_PLANS_MAX = 256


def _plan(q_shape: tuple, k_shape: tuple, sq: tuple, sk: tuple, sv: tuple, setup: tuple, heads_first: bool,
          capacity: int, paged: bool, leftpad: bool, window_left: int, num_splits: int, block_m: int | None,
          config: tuple | None) -> tuple:
    """The launch of one decode call, from what it depends on (:func:`decode_attention`'s
    arguments; ``setup``: :func:`_device_setup`'s answer): ``(out shape, partials shape, splits,
    grid or None when there is nothing to compute, the nine q/k/v strides passed (divided by 16
    when aligned), the output's and LSE's strides, KV heads, head_dim passed, BLOCK_M, BLOCK_N,
    warps, stages, BLOCK_D, page size, preloaded table entries, one entry a block, aligned,
    arrival counters needed, on a GPU, kept launches)``; kept launches: a dict the call fills
    (:func:`_kept_launch`), None when there is nothing to compute. Raises nothing."""
    if heads_first:  # [B, H, S, D] views: read them through permuted strides, no transposed views
        batch, num_heads, seqlen_q, head_dim = q_shape
        num_kv_heads = k_shape[1]
        qb, qh, qs = sq[0], sq[1], sq[2]
        kb, kh, ks = sk[0], sk[1], sk[2]
        vb, vh, vs = sv[0], sv[1], sv[2]
    else:
        batch, seqlen_q, num_heads, head_dim = q_shape
        num_kv_heads = k_shape[2]
        qb, qs, qh = sq[0], sq[1], sq[2]
        kb, ks, kh = sk[0], sk[1], sk[2]
        vb, vs, vh = sv[0], sv[1], sv[2]
    group = num_heads // num_kv_heads
    out_shape = (batch, seqlen_q, num_heads, head_dim)
    block_n, num_warps, num_stages, block_d, sms, on_gpu, one_split = setup
    if batch == 0 or seqlen_q == 0:
        return (out_shape, None, 1, None, (), (), (), num_kv_heads, head_dim, 16, block_n, num_warps, num_stages,
                block_d, 0, 0, False, False, 0, on_gpu, None)
    if config is not None:
        block_n, num_warps, num_stages = config
    rows = group * seqlen_q
    if block_m is None:
        block_m = max(16, min(64, 1 << (rows - 1).bit_length()))
    m_blocks = (rows + block_m - 1) // block_m
    programs = batch * num_kv_heads * m_blocks
    page_size = k_shape[1] if paged else 0
    # how a paged row read in one slice (the one-split tile) would find its pages: it may be read
    # so only without per-key lookups, and then this is the launch's answer too
    whole_lookup = page_lookup(capacity, page_size, one_split[0], 1, leftpad, window_left) \
        if page_size and one_split is not None and config is None and num_splits <= 0 else None
    if num_splits > 0:
        splits = num_splits
    else:  # a dense cache, or a paged one read without per-key lookups, may be read whole (WHOLE_ROWS_MIN_FILL)
        whole_rows = one_split is not None and config is None and (not paged or any(whole_lookup))
        splits = choose_num_splits(programs, capacity, sms, on_gpu, block_n, whole_rows)
    if splits == 1 and config is None and one_split is not None:
        block_n, num_warps, num_stages = one_split
    if not page_size:  # a dense cache: nothing to ask
        preload, by_block = 0, False
    elif whole_lookup is not None and splits == 1:  # the same question, answered above
        preload, by_block = whole_lookup
    else:
        preload, by_block = page_lookup(capacity, page_size, block_n, splits, leftpad, window_left)
    if seqlen_q == 1:
        qs = 0  # never multiplied by anything but 0; whatever it was must not cost the alignment
    # Row strides, each divisible by 16 when `aligned` (then passed divided by 16, see the kernel).
    # The output strides are multiples of head_dim, so head_dim stands for them in the test.
    aligned = not ((qb | qs | qh | kb | ks | kh | vb | vs | vh | head_dim) & 15)
    unit = 16 if aligned else 1
    hd = head_dim // unit
    if splits == 1:  # out [B, Sq, Hq, D] (contiguous) and lse [B, Hq, Sq]
        partial_shape = None
        o_strides = (0, seqlen_q * num_heads * hd, hd, num_heads * hd)
        l_strides = (0, num_heads * seqlen_q, seqlen_q, 1)
    else:  # partials [splits, B, Hq, Sq, D] and [splits, B, Hq, Sq]
        partial_shape = (splits, batch, num_heads, seqlen_q, head_dim)
        o_strides = (batch * num_heads * seqlen_q * hd, num_heads * seqlen_q * hd, seqlen_q * hd, hd)
        l_strides = (batch * num_heads * seqlen_q, num_heads * seqlen_q, seqlen_q, 1)
    strides = (qb // unit, qs // unit, qh // unit, kb // unit, ks // unit, kh // unit, vb // unit, vs // unit,
               vh // unit)
    return (out_shape, partial_shape, splits, (splits, m_blocks, batch * num_kv_heads), strides, o_strides, l_strides,
            num_kv_heads, hd, block_m, block_n, num_warps, num_stages, block_d, page_size, preload, by_block, aligned,
            m_blocks * batch * num_kv_heads, on_gpu, {} if on_gpu else None)


# A decode call without optional tensors (transformers' layout) repeats the launch the first call
# of its plan took (_kept_launch) instead of working the launcher's key out. Why: eager decoding
# is paced by the host, and that key was the largest part of the launch's host time. On the H100
# (bench/results/decode_host.md) 18.5 us of host time a call against 22.6 with the key worked out
# each call (sdpa 21.7); bench/check_gpu.py under FLASH_ATTN2_LAUNCH_CHECK=1 works every kept
# launch's key out and compares. FLASH_ATTN2_KEEP_LAUNCHES=0 turns it off; read per call, so
# benchmarks can time both.
KEEP_LAUNCHES = os.environ.get("FLASH_ATTN2_KEEP_LAUNCHES", "1") != "0"


def _kept_launch(launch: Launcher, kept: tuple, grid: tuple, args: tuple, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, window_right: int) -> bool:
    """Launch the split kernel through ``launch``'s ``kept`` launch (``Launcher.keep``'s answer
    for an earlier call of the same plan and flags, see :func:`decode_attention`); False where it
    cannot vouch for the key, launching nothing. Raises RuntimeError in launch check mode if the
    key differs.

    Why the key holds here: the plan and the flags fix every constexpr, which pointer slots are
    None and each pointer's dtype (q, k and v are in the flags; the partials, LSEs and counters
    are float32 / int32, the output q's dtype); the plan fixes every stride and size passed, and
    ``Launcher.keep`` kept only a launch whose integers were 32-bit and pointers 16-byte aligned.
    The lengths (``total_len_uniform``, ``capacity``) and the left window are in the plan's key,
    so they are the kept call's. What a call can change: the addresses of q, k and v (checked
    here), the right window (checked here), and the buffers this module allocates, which start on
    512-byte boundaries (torch's CUDA allocator rounds every block to 512 bytes).
    """
    if (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) & 15 or window_right > _I32_MAX:
        return False
    return launch.launch_kept(kept, grid, args)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    total_lens: torch.Tensor | None,
    total_len_uniform: int,
    capacity: int,
    block_table: torch.Tensor | None,
    batch_idx: torch.Tensor | None,
    leftpad: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int = 0,
    block_m: int | None = None,
    config: tuple[int, int, int] | None = None,
    need_lse: bool = True,
    heads_first: bool = False,
    merge_in_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``q`` over a (possibly paged) KV cache whose new keys are already written.

    q is ``[B, Sq, Hq, D]``; the caches are ``[B_cache, S, Hk, D]`` or, with ``block_table``
    (``[B, max_blocks]`` int32), ``[num_blocks, page_size, Hk, D]``. Row b attends to keys
    ``leftpad[b] .. total_lens[b]-1`` (or ``total_len_uniform`` when ``total_lens`` is None).
    ``window_right`` / ``window_left`` are -1 for unbounded; causal is ``window_right=0``.
    ``capacity`` (keys a row can hold: the block table's columns times the page size, or the
    dense cache's length) sizes the split count and caps ``total_lens``: a row whose length the
    caller could not check on the host (a device tensor) reads no key past it. ``config`` /
    ``block_m`` override the tuned tile choice (benchmark sweeps); ``merge_in_kernel`` overrides
    the rule of :data:`MERGE_IN_KERNEL` (True: the last slice merges, in a CUDA graph too; False:
    a second kernel merges).

    With ``heads_first=True`` q is ``[B, Hq, Sq, D]`` and the (dense) caches ``[B, Hk, S, D]``
    (transformers' layout); the output layout does not change. The caller passes ints and floats
    as Python ``int``/``float`` (they key the launch cache).

    Returns ``(out [B, Sq, Hq, D] in q's dtype, lse [B, Hq, Sq] float32)``; rows without any
    visible key get out 0 and LSE +inf, as flash-attn does. With ``need_lse=False`` no lse is
    written and None is returned in its place. Raises nothing itself: the caller checks shapes
    and dtypes.
    """
    sq, sk, sv = q.stride(), k_cache.stride(), v_cache.stride()
    if sq[3] != 1 or sk[3] != 1 or sv[3] != 1:  # the kernel reads head_dim contiguously: copy the rare rest
        q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
        sq, sk, sv = q.stride(), k_cache.stride(), v_cache.stride()
    device = q.device
    setup = _SETUP.get((q.shape[3], device)) or _device_setup(q.shape[3], device)
    # what _plan reads, and the settings benchmarks change (per-call values stay out of the key)
    key = (q.shape, k_cache.shape, sq, sk, sv, setup, heads_first, total_len_uniform, capacity,
           block_table is not None, leftpad is not None, window_left, num_splits, block_m, config,
           choose_num_splits, PAGE_BLOCKS, PRELOAD_MAX, PRELOADED_BLOCKS)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_MAX:  # a decode's context grows every step: keep the recent ones
            _PLANS.clear()
        plan = _PLANS[key] = _plan(q.shape, k_cache.shape, sq, sk, sv, setup, heads_first, capacity,
                                   block_table is not None, leftpad is not None, window_left, num_splits,
                                   block_m, config)
    (out_shape, partial_shape, splits, grid, strides, o_strides, l_strides, num_kv_heads, hd, block_m, block_n,
     num_warps, num_stages, block_d, page_size, preload, by_block, aligned, n_tiles, on_gpu, launches) = plan
    batch, seqlen_q, num_heads = out_shape[0], out_shape[1], out_shape[2]
    out = _alloc(out_shape, q.dtype, device)
    lse = _alloc((batch, num_heads, seqlen_q), torch.float32, device) if need_lse else None
    if grid is None:  # nothing to compute
        return out, lse
    if splits == 1:  # straight into out [B, Sq, Hq, D] (contiguous) and lse [B, Hq, Sq]
        o_target, l_target, stream, capturing = out, lse, 0, False
    else:  # partials [splits, B, Hq, Sq, D] and [splits, B, Hq, Sq], merged below
        stream = _current_stream(device) if on_gpu else 0
        capturing = on_gpu and _capturing(stream)
        o_target, l_target = _partials(device, partial_shape, stream, capturing)
    if merge_in_kernel is None:  # the shipped rule: merged in the launch, but not inside a CUDA graph
        merge = splits > 1 and MERGE_IN_KERNEL and not capturing
    else:
        merge = splits > 1 and merge_in_kernel
    args = (
        # absent optional pointers stay None: compile-time constants the launch skips
        q, k_cache, v_cache, block_table, total_lens, batch_idx, leftpad, alibi_slopes,
        o_target, l_target, _arrival_counters(device, n_tiles, stream, capturing) if merge else None,
        out if merge else None, lse if merge and need_lse else None,
        *strides, block_table.stride(0) if block_table is not None else 0,
        alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
        *o_strides, *l_strides, seqlen_q, num_kv_heads, hd, total_len_uniform,
        capacity, softmax_scale * _LOG2E, softcap, window_left, window_right,
    )
    launch = _SPLIT
    # Only calls without optional tensors keep their launch (transformers' decode); see _kept_launch
    flags = (device, q.dtype, k_cache.dtype, v_cache.dtype, softcap > 0.0, window_right >= 0, need_lse, merge,
             MERGE_CHUNK) if KEEP_LAUNCHES and launches is not None and block_table is None and total_lens is None \
        and batch_idx is None and leftpad is None and alibi_slopes is None else None
    kept = launches.get(flags) if flags is not None else None
    if not (kept is not None and kept[0] is launch
            and _kept_launch(launch, kept[1], grid, args, q, k_cache, v_cache, window_right)):
        constexprs = (
            num_heads // num_kv_heads, block_m, block_n, block_d, page_size, preload, by_block, splits,
            total_lens is not None, batch_idx is not None, leftpad is not None, alibi_slopes is not None,
            softcap > 0.0, window_left >= 0, window_right >= 0, splits == 1, need_lse or splits > 1, aligned, merge,
            merge and need_lse, min(max(MERGE_CHUNK * 16 // block_m, 1), 1 << (splits - 1).bit_length()) if merge else 1,
        )
        launch(grid, args, constexprs, num_warps, num_stages)
        if flags is not None and (kept is None or kept[0] is not launch):
            keep = getattr(launch, "keep", None)  # a benchmark's or test's stand-in may have none
            kept = keep(args, constexprs, num_warps, num_stages) if keep is not None else None
            if kept is not None:
                launches[flags] = (launch, kept)
    if splits > 1 and not merge:
        _COMBINE(
            (batch * num_heads * seqlen_q, 1, 1),
            (o_target, l_target, out, lse, *o_target.stride(), *l_target.stride(), *out.stride(),
             *(lse.stride() if need_lse else (0, 0, 0)), num_heads, seqlen_q, out_shape[3]),
            (splits, max(2, 1 << (splits - 1).bit_length()), block_d, need_lse),
            1 if device.type != "cuda" else 4, 3,  # Triton's default stage count
        )
    return out, lse


_SPLIT = Launcher(_split_kernel)
_COMBINE = Launcher(_combine_kernel)
