"""``flash_attn_with_kvcache``: attention of new query tokens over a (paged) KV cache.

The steps, in flash-attn 2's order: rotate the new q/k (when rotary tables are given), write the
new k/v into the cache in place at ``cache_seqlens[b]`` (through ``block_table`` when paged),
then attend over ``cache_seqlens + S_new`` keys. Padding rows (negative ``cache_seqlens``) and
unallocated pages (negative ``block_table`` entries) are neither read nor written. The attention
runs in the split-K Triton kernel of ``_triton_decode`` on CUDA (sm80+) and under
``TRITON_INTERPRET=1``; otherwise the cache is gathered into dense tensors and handed to the
PyTorch path in ``_torch_impl``. Backend choice
and dtype limits are the package's (``_autograd.backend_for``, ``_validate``), so every entry
point dispatches alike.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import _compiled, _validate
from ._autograd import backend_for
from ._torch_impl import attention_torch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class CacheBoundsError(ValueError, RuntimeError):
    """cache_seqlens (plus the new keys) reach past what the cache or its block table addresses.

    A ValueError like every argument error here, and a RuntimeError as flash-attn raises for the
    same contract (its test for issue #2709 expects one naming ``block_table``)."""
_MAX_HEAD_DIM = _validate.MAX_HEAD_DIM


def _check_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor],
    cache_batch_idx: Optional[torch.Tensor],
    cache_leftpad: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    window_size: Tuple[int, int],
    softcap: float,
    num_splits: int,
) -> None:
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(
            f"flash_attn_with_kvcache: q must be [batch, seqlen_q, heads, head_dim] and the caches "
            f"[batch_cache, seqlen_cache, kv_heads, head_dim] (or [num_blocks, page_size, kv_heads, "
            f"head_dim] with block_table); got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"flash_attn_with_kvcache: k_cache {tuple(k_cache.shape)} and v_cache "
            f"{tuple(v_cache.shape)} must have the same shape"
        )
    batch, _, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != dim:
        raise ValueError(
            f"flash_attn_with_kvcache: head_dim of q ({dim}) and k_cache ({k_cache.shape[3]}) differ"
        )
    if dim > _MAX_HEAD_DIM or dim < 1:
        raise ValueError(
            f"flash_attn_with_kvcache: head_dim {dim} is outside the supported 1..{_MAX_HEAD_DIM}"
        )
    if heads % kv_heads != 0:
        raise ValueError(
            f"flash_attn_with_kvcache: query heads ({heads}) must be a multiple of key/value heads "
            f"({kv_heads})"
        )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is None:
            continue
        if t.dtype not in _DTYPES:
            raise ValueError(
                f"flash_attn_with_kvcache: {name} has dtype {t.dtype}; supported: float16, "
                f"bfloat16, float32"
            )
        if t.dtype != q.dtype:
            raise ValueError(
                f"flash_attn_with_kvcache: {name} is {t.dtype} but q is {q.dtype}; pass one dtype"
            )
        if t.device != q.device:
            raise ValueError(
                f"flash_attn_with_kvcache: {name} is on {t.device} but q is on {q.device}"
            )
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache: pass both k and v to append, or neither")
    if k is not None:
        if k.dim() != 4 or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:] \
                or v.shape != k.shape:
            raise ValueError(
                f"flash_attn_with_kvcache: new k/v must be [batch={batch}, seqlen_new, "
                f"kv_heads={kv_heads}, head_dim={dim}]; got k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
    if block_table is not None:
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(
                f"flash_attn_with_kvcache: block_table must be [batch={batch}, max_blocks]; got "
                f"{tuple(block_table.shape)}"
            )
        if block_table.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"flash_attn_with_kvcache: block_table must be int32; got {block_table.dtype}"
            )
        if cache_batch_idx is not None:
            raise ValueError(
                "flash_attn_with_kvcache: cache_batch_idx cannot be combined with block_table; "
                "the block table already says which pages belong to each row"
            )
    elif cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ValueError(
            f"flash_attn_with_kvcache: k_cache holds {k_cache.shape[0]} rows but q has batch "
            f"{batch}; pass cache_batch_idx to pick rows"
        )
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None and (t.shape != (batch,) or t.dtype not in (torch.int32, torch.int64)):
            raise ValueError(
                f"flash_attn_with_kvcache: {name} must be an int32 tensor of shape [{batch}]; got "
                f"{t.dtype} {tuple(t.shape)}"
            )
    _validate.check_options(0.0, window_size, softcap, alibi_slopes, batch, heads, q.device)
    if num_splits < 0:
        raise ValueError(f"flash_attn_with_kvcache: num_splits must be >= 0; got {num_splits}")


def _check_ranges(
    lens: Optional[torch.Tensor],
    uniform_len: int,
    seqlen_new: int,
    capacity: int,
    block_table: Optional[torch.Tensor],
    cache_batch_idx: Optional[torch.Tensor],
    cache_rows: int,
    device: torch.device,
) -> None:
    """Lengths and indices the kernel trusts. Checking a device tensor would cost a sync per decode
    step, so only an int length and CPU tensors are checked here; device values are made safe
    instead (see ``_append`` and ``_triton_append``: writes that would land outside the cache
    are dropped; the kernel reads no key past the capacity).

    A negative entry of a length tensor marks a padding row, and a negative block table entry a
    page that is not allocated: both are allowed, but a row's keys must not reach such a page.

    Raises CacheBoundsError (a ValueError and RuntimeError) for lengths past the capacity, naming
    ``block_table`` for a paged cache, and for a negative int length; ValueError for indices
    outside the cache and for a row whose keys reach an unallocated page."""
    if lens is None:
        longest, shortest = uniform_len, uniform_len
    elif device.type == "cpu" and lens.numel():
        longest, shortest = int(lens.max()), 0
    else:
        longest, shortest = 0, 0
    if shortest < 0 or longest + seqlen_new > capacity:
        if block_table is not None:
            where = (f"block_table addresses {capacity} keys: {block_table.shape[1]} columns x page "
                     f"size {capacity // max(block_table.shape[1], 1)}; give block_table more columns")
        else:
            where = f"cache of {capacity} slots per row"
        raise CacheBoundsError(
            f"flash_attn_with_kvcache: cache_seqlens must lie in 0..{capacity - seqlen_new} "
            f"({where}, {seqlen_new} new keys; a negative entry of a tensor marks a padding row); "
            f"got {min(shortest, longest)}..{longest}"
        )
    if device.type != "cpu":
        return
    if cache_batch_idx is not None and cache_batch_idx.numel() and not (
            0 <= int(cache_batch_idx.min()) and int(cache_batch_idx.max()) < cache_rows):
        raise ValueError(
            f"flash_attn_with_kvcache: cache_batch_idx entries must lie in 0..{cache_rows - 1} (the "
            f"cache's first dimension); got {int(cache_batch_idx.min())}..{int(cache_batch_idx.max())}"
        )
    if block_table is None or not block_table.numel():
        return
    if int(block_table.max()) >= cache_rows:
        raise ValueError(
            f"flash_attn_with_kvcache: block_table entries must lie in 0..{cache_rows - 1} (the "
            f"cache's first dimension; -1 marks a page that is not allocated); got up to "
            f"{int(block_table.max())}"
        )
    page_size = capacity // max(block_table.shape[1], 1)
    keys = (lens.long() if lens is not None
            else torch.full((block_table.shape[0],), uniform_len, dtype=torch.long))
    keys = torch.where(keys >= 0, keys + seqlen_new, 0)
    reached = torch.arange(block_table.shape[1]).view(1, -1) * page_size < keys.view(-1, 1)
    missing = (reached & (block_table < 0)).nonzero()
    if missing.numel():
        row, col = (int(x) for x in missing[0])
        raise ValueError(
            f"flash_attn_with_kvcache: block_table[{row}, {col}] is {int(block_table[row, col])} (no "
            f"page), but row {row} holds {int(keys[row])} keys, which reach that column; give the row "
            f"a page there, or mark the row as padding with a negative cache_seqlens"
        )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of the first ``2 * cos.shape[-1]`` dims of ``x`` [B, S, H, D].

    ``cos``/``sin`` are per position ``[B, S, rotary_dim / 2]``; computed in float32 and cast
    back, as flash-attn does before it stores rotated keys.
    """
    rot = 2 * cos.shape[-1]
    xf = x[..., :rot].float()
    c = cos.float().unsqueeze(2)
    s = sin.float().unsqueeze(2)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        r1 = x1 * c - x2 * s
        r2 = x1 * s + x2 * c
        rotated = torch.stack((r1, r2), dim=-1).flatten(-2)
    else:
        x1, x2 = xf[..., : rot // 2], xf[..., rot // 2:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rot:]), dim=-1)


def _apply_rotary(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    rotary_cos: Optional[torch.Tensor],
    rotary_sin: Optional[torch.Tensor],
    lens: Optional[torch.Tensor],
    uniform_len: int,
    windowed: bool,
    interleaved: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q and the new k, at flash-attn's positions (see the public docstring).

    Raises ValueError for tables without new k/v, of the wrong shape, or (CPU) too short.
    """
    batch, seqlen_q, _, dim = q.shape
    device = q.device
    if rotary_cos is None or rotary_sin is None or k is None:
        raise ValueError(
            "flash_attn_with_kvcache: rotary needs rotary_cos, rotary_sin and new k/v to rotate"
        )
    if rotary_cos.shape != rotary_sin.shape or rotary_cos.dim() != 2 \
            or 2 * rotary_cos.shape[1] > dim:
        raise ValueError(
            f"flash_attn_with_kvcache: rotary_cos/sin must both be [seqlen_ro, rotary_dim/2] "
            f"with rotary_dim <= head_dim ({dim}); got {tuple(rotary_cos.shape)} and "
            f"{tuple(rotary_sin.shape)}"
        )
    base = lens.long().clamp(min=0) if lens is not None else torch.full(
        (batch,), uniform_len, device=device, dtype=torch.long)  # padding rows (< 0) rotate at 0
    seqlen_new = k.shape[1]
    k_pos = base.view(-1, 1) + torch.arange(seqlen_new, device=device).view(1, -1)
    if windowed:
        q_pos = base.view(-1, 1) + torch.arange(seqlen_q, device=device).view(1, -1)
    else:
        q_pos = base.view(-1, 1).expand(batch, seqlen_q)
    if device.type == "cpu" and batch > 0:
        needed = max(int(k_pos.max()) if seqlen_new else 0,
                     int(q_pos.max()) if seqlen_q else 0)
        if needed >= rotary_cos.shape[0]:
            raise ValueError(
                f"flash_attn_with_kvcache: rotary tables have {rotary_cos.shape[0]} positions "
                f"but position {needed} is needed"
            )
    return (_rotate(q, rotary_cos[q_pos], rotary_sin[q_pos], interleaved),
            _rotate(k, rotary_cos[k_pos], rotary_sin[k_pos], interleaved))


def _cache_slots(
    positions: torch.Tensor,
    block_table: Optional[torch.Tensor],
    page_size: int,
    rows: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(index into dim 0, index into dim 1) of the cache for ``positions`` [B, S] of each row."""
    if block_table is None:
        return rows.view(-1, 1).expand_as(positions), positions
    pages = torch.gather(block_table.long(), 1, positions // page_size)
    return pages, positions % page_size


def _append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: torch.Tensor,
    capacity: int,
    block_table: Optional[torch.Tensor],
    rows: torch.Tensor,
) -> None:
    """Write new keys/values at positions ``start[b] + t`` of each row, in place, with no host sync
    (the PyTorch path; the Triton backends use ``_triton_append``, which drops the same writes).

    A new key is written when its row is not a padding row (``start[b] >= 0``), its position is
    below ``capacity`` and the cache row it lands in (the block table's page, or ``rows[b]``) is one
    of the cache's rows. Every other write is dropped without a data-dependent shape: it is aimed
    at the slot of the first kept write and carries that write's value (at slot (0, 0) carrying
    what it holds when nothing is kept), so all writes to one slot agree and nothing else changes.
    """
    batch, seqlen_new = k.shape[:2]
    page_size = k_cache.shape[1]
    if capacity == 0 or k_cache.shape[0] == 0 or batch * seqlen_new == 0:
        return
    positions = start.view(-1, 1) + torch.arange(seqlen_new, device=k.device).view(1, -1)
    keep = (start.view(-1, 1) >= 0) & (positions < capacity)
    dim0, dim1 = _cache_slots(positions.clamp(0, capacity - 1), block_table, page_size, rows)
    keep = keep & (dim0 >= 0) & (dim0 < k_cache.shape[0])
    flat = keep.flatten()
    first = flat.to(torch.int32).argmax()  # the first kept write (0 when none is)
    any_kept = flat.any()
    dim0 = torch.where(keep, dim0, torch.where(any_kept, dim0.flatten()[first], 0))
    dim1 = torch.where(keep, dim1, torch.where(any_kept, dim1.flatten()[first], 0))
    for cache, new in ((k_cache, k), (v_cache, v)):
        sink = torch.where(any_kept, new.flatten(0, 1)[first], cache[0, 0])
        cache[dim0, dim1] = torch.where(keep.view(batch, seqlen_new, 1, 1), new, sink)


def _totals(lens: torch.Tensor, seqlen_new: int, capacity: int) -> torch.Tensor:
    """Each row's key count after appending ``seqlen_new`` keys: 0 for a padding row (< 0)."""
    return torch.where(lens >= 0, (lens + seqlen_new).clamp(max=capacity), 0).to(torch.int32)


def _lengths(
    cache_seqlens: Optional[Union[int, torch.Tensor]],
    appending: bool,
    batch: int,
    capacity: int,
    device: torch.device,
) -> Tuple[Optional[torch.Tensor], int]:
    """(lens as an int32 device tensor or None, the uniform length when lens is None).

    Raises ValueError for a missing length while appending, or a tensor of the wrong shape/dtype.
    """
    if cache_seqlens is None:
        if appending:
            raise ValueError(
                "flash_attn_with_kvcache: appending k/v needs cache_seqlens (where each row's new "
                "keys go)"
            )
        return None, capacity
    if isinstance(cache_seqlens, int):
        return None, cache_seqlens
    if cache_seqlens.shape != (batch,) or cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"flash_attn_with_kvcache: cache_seqlens must be an int or an int32 tensor of shape "
            f"[{batch}]; got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}"
        )
    return cache_seqlens.to(device=device, dtype=torch.int32), 0


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention of ``q`` over a KV cache, appending new keys/values first (flash-attn 2 API).

    Args:
        q: ``[B, Sq, Hq, D]``.
        k_cache, v_cache: ``[B_cache, S_cache, Hk, D]``, or with ``block_table`` a paged cache
            ``[num_blocks, page_size, Hk, D]``. Updated in place when ``k``/``v`` are given.
        k, v: optional new keys/values ``[B, S_new, Hk, D]``, written at positions
            ``cache_seqlens[b] ..`` of row b (through ``block_table`` when paged).
        rotary_cos, rotary_sin: optional ``[seqlen_ro, rotary_dim / 2]`` tables; only with
            ``k``/``v``. New keys are rotated at positions ``cache_seqlens[b] + t``; queries at
            ``cache_seqlens[b] + i`` when causal or windowed, else all at ``cache_seqlens[b]``.
        cache_seqlens: int or int32 ``[B]``: keys already in each row's cache (default: the
            whole cache). Attention covers ``cache_seqlens + S_new`` keys. A negative entry of
            the tensor marks a padding row (transformers pads CUDA-graph batches with -1): nothing
            is appended for it, it attends to no key (out 0, LSE +inf) and reads nothing.
        cache_batch_idx: optional int32 ``[B]``: which row of a contiguous cache each batch
            entry uses (default ``arange(B)``).
        cache_leftpad: optional int32 ``[B]``: first valid cache position of each row; keys
            before it are ignored and positions (causal, window, alibi) count from it.
        block_table: optional int32 ``[B, max_blocks]``: the pages of each row, in order. A
            negative entry marks a page that is not allocated: nothing is read from or written
            through it, and a row's keys must not reach it (refused on the host for a CPU table).
        softmax_scale: default ``1 / sqrt(D)``.
        causal: bottom-right aligned mask (query i sees keys up to ``i + L - Sq``).
        window_size: ``(left, right)`` local attention, -1 = unbounded.
        softcap: ``softcap * tanh(scores / softcap)`` when > 0.
        rotary_interleaved: rotate pairs (0, 1), (2, 3), ... (True) or the two halves (False).
        alibi_slopes: float32 ``[Hq]`` or ``[B, Hq]``; adds ``-slope * |i + L - Sq - j|``.
        num_splits: key slices per row in the split-K kernel; 0 chooses from the GPU size.
        return_softmax_lse: also return the log-sum-exp ``[B, Hq, Sq]`` float32.

    Returns:
        ``out`` ``[B, Sq, Hq, D]`` in q's dtype, or ``(out, softmax_lse)``. A query row that sees
        no key gets out 0 and LSE +inf.

    The call needs no host sync on the GPU and can be captured in a CUDA graph: whether each
    new key is written is decided on the device (see ``_triton_append``), and no shape depends on
    a tensor's values.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit together, rotary tables without
            new k/v, float32 on the GPU kernels (as flash-attn; cast to bf16/fp16); a CPU block
            table whose entries reach past the cache or whose unallocated page (-1) a row's keys
            reach.
        CacheBoundsError: (a ValueError and a RuntimeError) cache_seqlens (+ the new keys)
            past the cache's capacity, ``block_table.shape[1] * page_size`` when paged, where
            that is known without a device sync: an int, or a tensor on the CPU; a negative int. A device tensor
            is not read on the host (that would cost a sync per decode step); a row past the
            capacity then keeps only the new keys that fit and attends to its first
            ``capacity`` keys, and nothing outside the cache or block table is read or written.
        NotImplementedError: bfloat16 under ``TRITON_INTERPRET=1``.
    """
    if isinstance(window_size, list):
        window_size = tuple(window_size)
    if torch.compiler.is_compiling():  # traced by torch.compile: this whole call as one operator
        return _compiled.with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                      cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                      window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                                      return_softmax_lse)
    _check_args(q, k_cache, v_cache, k, v, block_table, cache_batch_idx, cache_leftpad,
                alibi_slopes, window_size, softcap, num_splits)
    # Before anything is written into the cache, so a refused call leaves it untouched.
    backend = backend_for(q)
    _validate.check_backend_dtype(q.dtype, backend)
    batch, seqlen_q, heads, dim = q.shape
    device = q.device
    paged = block_table is not None
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    seqlen_new = k.shape[1] if k is not None else 0
    softmax_scale = dim ** -0.5 if softmax_scale is None else _validate.check_softmax_scale(softmax_scale)
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0

    lens, uniform_len = _lengths(cache_seqlens, k is not None, batch, capacity, device)
    _check_ranges(lens, uniform_len, seqlen_new, capacity, block_table, cache_batch_idx,
                  k_cache.shape[0], device)

    if rotary_cos is not None or rotary_sin is not None:
        q, k = _apply_rotary(q, k, rotary_cos, rotary_sin, lens, uniform_len,
                             causal or left >= 0 or right >= 0, rotary_interleaved)

    rows = None  # cache row of each batch entry; only the PyTorch append and path need it
    if backend == "torch":
        rows = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(batch, device=device)
    total_lens = lens  # keys per row once the new ones are in (None: total_uniform for all)
    if k is not None and seqlen_new > 0:
        if backend != "torch":
            from . import _triton_append  # Triton is imported on first use only
        if backend != "torch" and _triton_append.supported(k_cache, v_cache, k, v):
            total_lens = _triton_append.append_kv(k_cache, v_cache, k, v, lens, uniform_len, capacity,
                                                  block_table, cache_batch_idx)
        else:
            if rows is None:
                rows = (cache_batch_idx.long() if cache_batch_idx is not None
                        else torch.arange(batch, device=device))
            start = lens.long() if lens is not None else torch.full((batch,), uniform_len,
                                                                    device=device, dtype=torch.long)
            _append(k_cache, v_cache, k, v, start, capacity, block_table, rows)
            total_lens = _totals(lens, seqlen_new, capacity) if lens is not None else None
    total_uniform = uniform_len + seqlen_new
    leftpad = cache_leftpad.to(torch.int32) if cache_leftpad is not None else None
    slopes = alibi_slopes.to(torch.float32) if alibi_slopes is not None else None

    if backend != "torch":
        from ._triton_decode import decode_attention

        out, lse = decode_attention(
            q, k_cache, v_cache,
            total_lens=total_lens, total_len_uniform=total_uniform, capacity=capacity,
            block_table=block_table if paged else None,
            batch_idx=cache_batch_idx if cache_batch_idx is not None else None,
            leftpad=leftpad, alibi_slopes=slopes, softmax_scale=float(softmax_scale),
            window_left=left, window_right=right, softcap=float(softcap), num_splits=num_splits,
            need_lse=bool(return_softmax_lse),
        )
    else:
        out, lse = _attention_gathered(
            q, k_cache, v_cache, total_lens, total_uniform, capacity, block_table, page_size,
            rows, leftpad, slopes, float(softmax_scale), causal, (left, right), float(softcap),
        )
    return (out, lse) if return_softmax_lse else out


def _attention_gathered(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    total_lens: Optional[torch.Tensor],
    total_uniform: int,
    capacity: int,
    block_table: Optional[torch.Tensor],
    page_size: int,
    rows: torch.Tensor,
    leftpad: Optional[torch.Tensor],
    slopes: Optional[torch.Tensor],
    softmax_scale: float,
    causal: bool,
    window_size: Tuple[int, int],
    softcap: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch path: gather each row's valid keys to the front of a dense tensor."""
    batch = q.shape[0]
    device = q.device
    total = (total_lens.long() if total_lens is not None
             else torch.full((batch,), total_uniform, device=device, dtype=torch.long))
    total = total.clamp(max=capacity)  # unchecked device lengths: as the kernel, stop at capacity
    pad = leftpad.long() if leftpad is not None else torch.zeros_like(total)
    valid = (total - pad).clamp(min=0)
    width = int(valid.max()) if batch > 0 else 0
    if width == 0 or capacity == 0:
        out = torch.zeros_like(q)
        lse = torch.full((batch, q.shape[2], q.shape[1]), float("inf"), device=device)
        return out, lse
    positions = pad.view(-1, 1) + torch.arange(width, device=device).view(1, -1)
    # Slots past a row's length are masked by seqlens_k; clamping only keeps the gather in range.
    positions = positions.clamp(max=max(capacity - 1, 0))
    dim0, dim1 = _cache_slots(positions, block_table, page_size, rows)
    dim0 = dim0.clamp(0, max(k_cache.shape[0] - 1, 0))  # unallocated pages (-1) are read as page 0, then masked
    # Slots past a row's end may hold anything (torch.empty caches hold NaN at times), and NaN
    # times a zero probability is still NaN: zero them before the matmuls.
    outside = (torch.arange(width, device=device).view(1, -1) >= valid.view(-1, 1))
    outside = outside.view(batch, width, 1, 1)
    keys = k_cache[dim0, dim1].masked_fill(outside, 0)
    values = v_cache[dim0, dim1].masked_fill(outside, 0)
    return attention_torch(
        q, keys, values, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=slopes, seqlens_k=valid.to(torch.int32),
    )
