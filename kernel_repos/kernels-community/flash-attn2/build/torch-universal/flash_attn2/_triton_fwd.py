"""Triton forward kernel: one program per (block of queries, batch row, query head).

Entry point for sibling modules (the kvcache path uses it too)::

    attention_forward(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                      max_seqlen_k=None, seqused_k=None, softmax_scale, causal=False,
                      window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                      seed=0) -> (out, lse)

* dense: q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hk, D]`` -> out like q, lse ``[B, Hq, Sq]`` fp32;
* packed (``cu_seqlens_q``/``cu_seqlens_k`` int32 ``[B+1]``, max lengths given): q
  ``[total_q, Hq, D]``, k/v ``[total_k, Hk, D]`` -> out like q, lse ``[Hq, total_q]`` fp32;
* ``seqused_k`` (int32 ``[B]``, dense only): keys past it are ignored and causal/window masks
  align to it, as flash-attn's ``seqused_k``.

Any strides are accepted (no copies). lse is the natural-log sum of exp of the scaled scores;
rows that see no key get out 0 and lse +inf (flash-attn 2 does the same). The caller validates
arguments (``_validate.py``); this module assumes they are consistent.

Algorithm (why it is fast): exp2 with ``scale*log2(e)`` folded into one multiply (the scale
must be > 0: the row max is taken on raw scores); q stays in registers; key blocks that need no
mask (the bulk) run without ``where`` or bounds checks, and the few that cross a causal/window
diagonal or the sequence end mask raw scores with one compare and select. Rows bounded on the
right walk bulk and diagonal in one loop up to ``MERGE_DIAG_MAX_KEYS`` keys, so the software
pipeline does not drain at the diagonal. Causal prefill at head_dim <= 64 launches the heaviest
row blocks of all heads first, in L2-sized chunks of heads (``_row_order``), so the last wave is
short. Tile sizes: ``_configs.pick_fwd``.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from . import _configs
from ._launch import Launcher
from ._triton_tile import (_allowed, _dropout_keep, _key_range, _load_tile, _row_offsets, _scores, _seq_bounds,
                           needs_wide_offsets)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Launch orders of the (row block, batch row * head) programs. Under a causal (or right-window)
# mask a row block's cost grows with its index, so the order decides how ragged the last wave
# is. HEAVY_FIRST starts the last row block of every head in a chunk of heads, then the one
# before, and so on (longest-job-first: the tail is made of the cheapest blocks); chunks run one
# after the other and are sized so the K/V they stream fits in L2. PER_HEAD reverses the row
# blocks inside each head only, which leaves heavy blocks of the last heads for the end;
# IN_ORDER is for rows whose blocks all cost about the same, where neighbours share K/V in L2.
_IN_ORDER, _PER_HEAD, _HEAVY_FIRST = 0, 1, 2
ORDER_IN_ORDER: tl.constexpr = tl.constexpr(_IN_ORDER)
ORDER_PER_HEAD: tl.constexpr = tl.constexpr(_PER_HEAD)
ORDER_HEAVY_FIRST: tl.constexpr = tl.constexpr(_HEAVY_FIRST)
_ORDERS = {"in_order": _IN_ORDER, "per_head": _PER_HEAD, "heavy_first": _HEAVY_FIRST}
# How ``_fwd_inner`` masks the key blocks it walks (see there).
MASK_NONE: tl.constexpr = tl.constexpr(0)
MASK_ALL: tl.constexpr = tl.constexpr(1)
MASK_FROM: tl.constexpr = tl.constexpr(2)
# Rows bounded on the right (causal, right windows) walk the bulk and the diagonal blocks in one
# loop (MASK_FROM) when the keys are at most this long, and in two loops above it. One loop
# saves the pipeline's drain and refill at the diagonal, once per program; its branch costs a
# little on every step, which outweighs the saving on long rows (bench/NOTES.md, Kernel tuning).
MERGE_DIAG_MAX_KEYS = 8192
# K and V bytes one HEAVY_FIRST chunk of heads may stream. An H100/H200 has 50 MB of L2 in two
# halves; FlashAttention 3's scheduler sizes its head groups with 32 MB; half of that kept more
# of a chunk's K/V resident here (bench/NOTES.md, Kernel tuning). Benchmarks may change it.
L2_BUDGET_BYTES = 16 << 20
# CUDA's limit on grid.y and grid.z, where HEAVY_FIRST puts the row blocks and the chunks.
_MAX_GRID_YZ = 65535


@triton.jit
def _masked(x, n0, mask_from, offs_m, offs_n, win, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
            MASKED: tl.constexpr, EVEN_N: tl.constexpr):
    """The tile ``x`` (keys from ``n0``) with the scores its rows may not see set to -inf: in every
    block (MASK_ALL), in blocks from ``mask_from`` on (MASK_FROM), or nowhere (MASK_NONE)."""
    if MASKED == MASK_ALL:
        x = tl.where(_allowed(offs_m, offs_n, win, HAS_LEFT, HAS_RIGHT, False, EVEN_N), x, float("-inf"))
    elif MASKED == MASK_FROM:
        if n0 >= mask_from:
            x = tl.where(_allowed(offs_m, offs_n, win, HAS_LEFT, HAS_RIGHT, False, EVEN_N), x, float("-inf"))
    return x


@triton.jit
def _fwd_inner(state, q, kv, offs_m, offs_d, blocks, head_dim, win, sc, rng,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
               MASKED: tl.constexpr, EVEN_N: tl.constexpr, WIDE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over key blocks ``blocks = (start, end, mask_from)``; ``state = (acc, l_i,
    m_i)``, ``kv = (k_base, v_base, stride_kn, stride_vn)``, the other tuples as in _triton_tile.

    MASKED: MASK_NONE (the bulk), MASK_ALL, or MASK_FROM (one loop through the bulk and into the
    diagonal: blocks from ``mask_from`` on are masked, so the software pipeline runs on instead
    of draining and refilling at the diagonal)."""
    acc, l_i, m_i = state
    k_base, v_base, stride_kn, stride_vn = kv
    start, end, mask_from = blocks
    seqlen_k = win[0]
    # Key rows past seqlen_k exist only in masked blocks of a ragged (not EVEN_N) length.
    ROW_MASK: tl.constexpr = MASKED != MASK_NONE and not EVEN_N
    offs_nb = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_nb
        k = _load_tile(k_base + _row_offsets(offs_n[:, None], stride_kn, WIDE) + offs_d[None, :], offs_n, seqlen_k,
                       offs_d, head_dim, ROW_MASK, EVEN_D)
        qk = tl.dot(q, tl.trans(k))
        if HAS_SOFTCAP or HAS_ALIBI:
            s = _scores(qk, offs_m, offs_n, win[1], sc, HAS_SOFTCAP, HAS_ALIBI)
            s = _masked(s, n0, mask_from, offs_m, offs_n, win, HAS_LEFT, HAS_RIGHT, MASKED, EVEN_N)
            m_new = tl.maximum(m_i, tl.max(s, 1))
        else:
            # Scores stay raw: the scale (> 0, checked by the caller) folds into the max and
            # into one fused multiply-add before exp2; a masked score is -inf either way.
            qk = _masked(qk, n0, mask_from, offs_m, offs_n, win, HAS_LEFT, HAS_RIGHT, MASKED, EVEN_N)
            s = qk * sc[0]
            m_new = tl.maximum(m_i, tl.max(qk, 1) * sc[0])
        if MASKED != MASK_NONE:
            # A row with nothing allowed yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            p = tl.where(_dropout_keep(rng, offs_m, offs_n), p, 0.0)
        v = _load_tile(v_base + _row_offsets(offs_n[:, None], stride_vn, WIDE) + offs_d[None, :], offs_n, seqlen_k,
                       offs_d, head_dim, ROW_MASK, EVEN_D)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, K, V, Out, Lse, CuQ, CuK, SeqUsedK, Alibi,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh, stride_lm,
    stride_ab, stride_ah,
    seqlen_q_dense, seqlen_k_dense, n_heads_q, group, head_dim,
    qk_scale, softcap_scale, softcap, window_left, window_right,
    dropout_p, seed, rng_sq, rng_sk,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
    EVEN_N: tl.constexpr, MERGE_DIAG: tl.constexpr, ORDER: tl.constexpr, STORE_LSE: tl.constexpr,
    WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEADS: tl.constexpr,
):
    # HEADS query heads of one GQA group share a program (``_configs.pick_fwd_paired``): the tile's
    # BLOCK_M rows are HEADS runs of POS query positions, head by head, all reading the same K/V
    # block, so each K/V load serves BLOCK_M rows while the causal diagonal stays POS rows tall.
    POS: tl.constexpr = BLOCK_M // HEADS
    # ORDER picks which program the GPU starts first (it dispatches in grid order, x fastest);
    # see ``_row_order`` on the host.
    if ORDER == ORDER_HEAVY_FIRST:
        # grid (heads in a chunk, row blocks, chunks)
        pid_bh = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    elif ORDER == ORDER_PER_HEAD:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
        pid_bh = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
    if HEADS == 1:  # the one-head form written out, so its PTX stays the measured kernel's
        b = pid_bh // n_heads_q
        h = pid_bh % n_heads_q
    else:
        b = pid_bh // (n_heads_q // HEADS)
        h = (pid_bh % (n_heads_q // HEADS)) * HEADS  # the program's first query head
    hk = h // group
    q_start, seqlen_q, k_start, seqlen_k = _seq_bounds(b, CuQ, CuK, SeqUsedK, seqlen_q_dense,
                                                       seqlen_k_dense, IS_VARLEN, HAS_SEQUSED)
    m0 = pid_m * POS
    if m0 >= seqlen_q:
        return
    diag = seqlen_k - seqlen_q
    b64 = b.to(tl.int64)
    if HEADS == 1:
        offs_m = m0 + tl.arange(0, BLOCK_M)
    else:
        offs_m = m0 + tl.arange(0, BLOCK_M) % POS
        head_of_row = tl.arange(0, BLOCK_M) // POS  # relative to h
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm
    if HEADS > 1:
        q_base += (head_of_row * stride_qh)[:, None]
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn
    q_mask = offs_m[:, None] < seqlen_q
    if not EVEN_D:
        q_mask = q_mask & (offs_d[None, :] < head_dim)
    q = tl.load(q_base + _row_offsets(offs_m[:, None], stride_qm, WIDE) + offs_d[None, :], mask=q_mask, other=0.0)

    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(Alibi + b * stride_ab + h * stride_ah).to(tl.float32) * 1.4426950408889634
    win = (seqlen_k, diag, window_left, window_right)
    sc = (qk_scale, softcap_scale, softcap, slope2)
    rng = (seed, (b64 * n_heads_q + h) * rng_sq * rng_sk, rng_sk, dropout_p)
    kv = (k_base, v_base, stride_kn, stride_vn)
    state = (tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
             tl.full([BLOCK_M], float("-inf"), dtype=tl.float32))

    lo, hi, flo, fhi = _key_range(m0, seqlen_q, seqlen_k, diag, window_left, window_right,
                                  POS, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    # Masked blocks at the window's left edge, the unmasked bulk, then the diagonal / end.
    state = _fwd_inner(state, q, kv, offs_m, offs_d, (lo, flo, flo), head_dim, win, sc, rng,
                       HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D,
                       MASK_ALL, EVEN_N, WIDE, BLOCK_N)
    if MERGE_DIAG:
        # blocks from fhi on are masked
        state = _fwd_inner(state, q, kv, offs_m, offs_d, (flo, hi, fhi), head_dim, win, sc, rng,
                           HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D,
                           MASK_FROM, EVEN_N, WIDE, BLOCK_N)
    else:
        state = _fwd_inner(state, q, kv, offs_m, offs_d, (flo, fhi, fhi), head_dim, win, sc, rng,
                           HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D,
                           MASK_NONE, EVEN_N, WIDE, BLOCK_N)
        state = _fwd_inner(state, q, kv, offs_m, offs_d, (fhi, hi, fhi), head_dim, win, sc, rng,
                           HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D,
                           MASK_ALL, EVEN_N, WIDE, BLOCK_N)
    acc, l_i, m_i = state

    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)

    o_base = Out + b64 * stride_ob + h.to(tl.int64) * stride_oh + q_start.to(tl.int64) * stride_om
    if HEADS > 1:
        o_base += (head_of_row * stride_oh)[:, None]
    tl.store(o_base + _row_offsets(offs_m[:, None], stride_om, WIDE) + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=q_mask)
    if STORE_LSE:
        l_base = Lse + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start.to(tl.int64) * stride_lm
        if HEADS > 1:
            l_base += head_of_row * stride_lh
        tl.store(l_base + offs_m * stride_lm, lse, mask=offs_m < seqlen_q)


@triton.jit
def _dropout_mask_kernel(Mask, seed, dropout_p, n_heads_q, rng_sq, rng_sk,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads_q
    h = pid_bh % n_heads_q
    rng = (seed, (b.to(tl.int64) * n_heads_q + h) * rng_sq * rng_sk, rng_sk, dropout_p)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    base = Mask + pid_bh.to(tl.int64) * rng_sq * rng_sk
    for n0 in range(0, rng_sk, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        keep = _dropout_keep(rng, offs_m, offs_n)
        ptrs = base + offs_m[:, None] * rng_sk + offs_n[None, :]
        tl.store(ptrs, keep.to(tl.int8), mask=(offs_m[:, None] < rng_sq) & (offs_n[None, :] < rng_sk))


def dropout_keep_mask(seed: int, batch: int, heads_q: int, rng_sq: int, rng_sk: int,
                      dropout_p: float, device: torch.device) -> torch.Tensor:
    """The keep mask ``[B, Hq, rng_sq, rng_sk]`` (bool) the kernels draw for ``seed``.

    A debug hook: tests replay it through the PyTorch reference to check that forward and
    backward use the same mask. For packed input, row ``b`` covers that sequence's positions
    relative to its start, with ``rng_sq``/``rng_sk`` the max lengths.
    """
    mask = torch.empty(batch, heads_q, rng_sq, rng_sk, dtype=torch.int8, device=device)
    grid = (triton.cdiv(rng_sq, 16), batch * heads_q)
    _dropout_mask_kernel[grid](mask, seed, dropout_p, heads_q, rng_sq, rng_sk, BLOCK_M=16, BLOCK_N=16)
    return mask.bool()


_CAPABILITY: dict = {}


def capability_of(device: torch.device) -> Tuple[int, int]:
    """A CUDA device's capability, asked once per device: the query costs host time per launch."""
    cap = _CAPABILITY.get(device)
    if cap is None:
        cap = _CAPABILITY[device] = torch.cuda.get_device_capability(device)
    return cap


def device_capability(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    """GPU capability of ``t``'s device, or None when running under the interpreter (CPU)."""
    device = t.device
    return capability_of(device) if device.type == "cuda" else None


def fresh_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``t``'s shape, dtype and device. Raises nothing.

    Why not ``torch.empty(t.shape, dtype=..., device=...)`` always: ``empty_like`` skips that
    call's argument parsing, a few µs of host time per allocation on every step, and gives the
    same contiguous layout when ``t`` is contiguous (otherwise it would copy ``t``'s strides).
    """
    return torch.empty_like(t) if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def next_pow2_dim(d: int) -> int:
    # plain int arithmetic: triton.next_power_of_2 is a jit-wrapped helper whose call costs
    # microseconds on every launch, and decode steps are bound by host time
    return max(16, 1 << (int(d) - 1).bit_length())


def _row_order(masked_right: bool, window_left: bool, block_d: int, row_blocks: int, programs_bh: int,
               heads_per_chunk: int) -> int:
    """The launch order (an ``ORDER_*`` value) for a call.

    HEAVY_FIRST only for rows bounded on the right alone (causal, a right window) at padded head
    dims up to 64, where short row blocks make the last wave ragged; wider heads and rows with a
    left window too (blocks of about equal cost) keep PER_HEAD (bench/NOTES.md, Kernel tuning).
    HEAVY_FIRST also needs the row blocks and the chunks to fit
    CUDA's grid.y / grid.z limits (they do below 8M tokens at 128-row blocks).
    """
    if not masked_right:
        return _IN_ORDER
    if (window_left or block_d > 64 or row_blocks > _MAX_GRID_YZ
            or programs_bh // heads_per_chunk > _MAX_GRID_YZ):
        return _PER_HEAD
    return _HEAVY_FIRST


def _one_loop(masked_right: bool, keys: int, dropout: bool = False) -> bool:
    """Whether rows bounded on the right walk the bulk and the diagonal blocks in one loop
    (``MERGE_DIAG_MAX_KEYS``); rows without a right bound have no diagonal.

    With dropout, two loops: on sm90 with Triton 3.6 the one-loop build faults at its first
    launch (misaligned address) for varlen calls with head dims 80-128; the two-loop build of
    the same calls does not (``bench/results/fault_variants.md``).
    """
    return masked_right and keys <= MERGE_DIAG_MAX_KEYS and not dropout


@functools.lru_cache(maxsize=64)
def _heads_per_chunk(programs_bh: int, group: int, kv_head_bytes: int, budget: int) -> int:
    """How many (batch row, query head) programs one HEAVY_FIRST chunk holds.

    The largest divisor of ``programs_bh`` that is a whole number of GQA groups (query heads
    sharing a K/V head stay together: they read the same K/V) and whose distinct K/V heads fit
    in ``budget`` bytes; at least one group.
    """
    cap = max(1, budget // max(kv_head_bytes, 1)) * group
    if cap >= programs_bh:
        return programs_bh
    best = group
    for d in range(group, min(cap, programs_bh) + 1, group):
        if programs_bh % d == 0:
            best = d
    return best


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
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
    out: Optional[torch.Tensor] = None,
    config: Optional[Tuple[int, int, int, int]] = None,
    store_lse: bool = True,
    row_order: Optional[str] = None,
    merge_diag: Optional[bool] = None,
    heads_per_program: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run the forward kernel; see the module docstring for layouts. Returns ``(out, lse)``.

    ``store_lse=False`` (inference callers that drop it) skips the lse buffer: lse is None.
    ``heads_per_program`` (benchmarks and tests) puts that many query heads of a GQA group in one
    program, the config's BLOCK_M rows split among them; it must divide the group, and calls with
    ALiBi or dropout take 1. By default: two with the shipped tiles where
    ``_configs.pick_fwd_paired`` says so (sm90), else one, and one with a ``config`` given.

    Raises ValueError for a ``heads_per_program`` the call cannot take.

    ``config`` (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the shipped table,
    ``row_order`` ("in_order", "per_head", "heavy_first") the launch order, and ``merge_diag``
    whether right-bounded rows walk the bulk and the diagonal in one loop (benchmarks and tests;
    the defaults are :func:`_row_order`'s choice and ``MERGE_DIAG_MAX_KEYS``).
    """
    varlen = cu_seqlens_q is not None
    head_dim = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    if out is None:
        out = fresh_like(q)
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        total_q, hq, _ = q.shape
        hk = k.shape[1]
        sq_max, sk_max = int(max_seqlen_q), int(max_seqlen_k)
        lse = torch.empty(hq, total_q, device=q.device, dtype=torch.float32) if store_lse else None
        strides = ((0,) + q.stride()[:2] + (0,) + k.stride()[:2] + (0,) + v.stride()[:2]
                   + (0,) + out.stride()[:2] + ((0,) + lse.stride() if store_lse else (0, 0, 0)))
    else:
        batch, sq_max, hq, _ = q.shape
        sk_max, hk = k.shape[1], k.shape[2]
        lse = torch.empty(batch, hq, sq_max, device=q.device, dtype=torch.float32) if store_lse else None
        strides = (q.stride()[:3] + k.stride()[:3] + v.stride()[:3] + out.stride()[:3]
                   + (lse.stride() if store_lse else (0, 0, 0)))
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    if alibi_slopes is not None:
        strides += (alibi_slopes.stride(0), alibi_slopes.stride(1)) if alibi_slopes.dim() == 2 else (0, alibi_slopes.stride(0))
    else:
        strides += (0, 0)
    if sq_max == 0 or batch == 0:
        return out, lse
    block_d = next_pow2_dim(head_dim)
    cap = device_capability(q)
    softcap = float(softcap)
    # Absent optional pointers are passed as None: Triton makes them compile-time constants, so
    # the launch neither reads nor validates them (each validated pointer is host time per call).
    args = (
        q, k, v, out, lse,
        cu_seqlens_q if varlen else None, cu_seqlens_k if varlen else None,
        seqused_k, alibi_slopes,
        *strides,
        sq_max, sk_max, hq, hq // hk, head_dim,
        float(softmax_scale) * LOG2E, float(softmax_scale) / softcap if softcap > 0 else 1.0, softcap,
        left, right,
        float(dropout_p), int(seed), sq_max, sk_max,
    )
    flags = (varlen, seqused_k is not None, left >= 0, right >= 0, softcap > 0,
             alibi_slopes is not None, dropout_p > 0.0, block_d == head_dim)
    # row strides of q, k, v, out sit at 1, 4, 7, 10 of ``strides``; rows: all a tensor holds
    rows_q, rows_k = (total_q, k.shape[0]) if varlen else (sq_max, sk_max)
    wide = needs_wide_offsets(rows_q * max(strides[1], strides[10]), rows_k * max(strides[4], strides[7]))

    heads = 1 if heads_per_program is None else int(heads_per_program)
    shipped = paired = None
    if config is None:
        if heads_per_program is None:
            paired = _configs.pick_fwd_paired(cap, block_d, right >= 0, hq // hk, not varlen and left < 0
                                              and alibi_slopes is None and dropout_p == 0.0)
        if paired is not None:
            shipped, heads = paired, 2
        else:
            shipped = _configs.pick_fwd(cap, block_d, right >= 0, hq // hk, sk_max)
    if heads != 1 and ((hq // hk) % heads or alibi_slopes is not None or dropout_p > 0.0):
        raise ValueError(f"heads_per_program={heads}: it must divide the GQA group ({hq // hk} query heads a "
                         "K/V head), and calls with ALiBi or dropout take 1")
    programs_bh = batch * hq // heads
    chunk = programs_bh
    if right >= 0:
        chunk = _heads_per_chunk(programs_bh, hq // hk // heads, sk_max * head_dim * 2 * q.element_size(),
                                 L2_BUDGET_BYTES)

    def launch(cfg):
        bm_, bn_, w_, s_ = cfg
        if bm_ % heads:
            raise ValueError(f"heads_per_program={heads} does not divide the tile's {bm_} rows")
        positions = bm_ // heads  # query positions a program covers
        blocks = (sq_max + positions - 1) // positions
        order = (_row_order(right >= 0, left >= 0, block_d, blocks, programs_bh, chunk) if row_order is None
                 else _ORDERS[row_order])
        grid = (chunk, blocks, programs_bh // chunk) if order == _HEAVY_FIRST else (blocks, programs_bh, 1)
        # EVEN_N: every key block ends inside every sequence (dense keys only: varlen and seqused
        # lengths vary per row)
        even_n = not varlen and seqused_k is None and sk_max % bn_ == 0
        _FWD(grid, args, flags + (even_n, merge, order, store_lse, wide, bm_, bn_, block_d, heads), w_, s_)

    merge = (_one_loop(right >= 0, sk_max, dropout_p > 0.0) if merge_diag is None
             else right >= 0 and bool(merge_diag))
    shape_class = (q.dtype, causal, left >= 0, right >= 0, softcap > 0, alibi_slopes is not None)
    launch(_configs.choose("fwd", cap, block_d, shape_class, config,
                           lambda c: triton.testing.do_bench(lambda: launch(c)), shipped))
    return out, lse


_FWD = Launcher(_fwd_kernel)
