"""A transformers-contract attention function over any module with the FlashAttention API.

The module may be the ``flash_attn`` package, ``flash_attn_interface`` (FA3), a Hub kernel or our
shipped kernel: anything with ``flash_attn_varlen_func`` (and usually ``flash_attn_func``,
``flash_attn_with_kvcache``). Which options each function takes is read from its signature, so an
option the kernel lacks raises instead of being dropped.

Paths, in order: a 2D padding mask -> unpad, varlen, pad back; explicit ``cu_seq_lens_q/k`` ->
varlen; packed sequences (``position_ids`` restarting: in one row, or in several without a cache,
as transformers reads them) -> varlen; else the dense call.
Causal masks are bottom-right aligned when query and key lengths differ (FlashAttention's rule).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from kernel_loader.attention.backends.contract import kv_groups, resolve_is_causal
from kernel_loader.attention.backends.flash_api import (
    FlashKernel,
    call_options,
    first_output,
    flash_kernel,
    shared_options,
    window_size,
)
from kernel_loader.errors import UnsupportedAttentionOptionError

__all__ = [
    "FlashKernel",
    "flash_kernel",
    "flash_attention_forward",
    "make_flash_attention",
    "unpad_input",
    "pad_input",
    "cu_seqlens_from_position_ids",
]

# ------------------------------------------------------------------------------------------
# unpad / pad
# ------------------------------------------------------------------------------------------


def unpad_input(
    hidden: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Keep the real tokens of ``hidden [B, S, ...]`` given ``mask [B, S]`` (True/1 = real).

    Returns ``(packed [total, ...], indices [total], cu_seqlens [B+1] int32, max_seqlen)``.
    """
    mask = mask.to(torch.bool)
    seqlens = mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    packed = hidden.reshape(-1, *hidden.shape[2:])[indices]
    return packed, indices, cu_seqlens, int(seqlens.max().item()) if seqlens.numel() else 0


def pad_input(packed: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Scatter ``packed [total, ...]`` back to ``[batch, seqlen, ...]`` with zeros at padding."""
    out = packed.new_zeros(batch * seqlen, *packed.shape[1:])
    out[indices] = packed
    return out.view(batch, seqlen, *packed.shape[1:])


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` (int32) and the longest sequence of sequences packed in ``position_ids``.

    ``position_ids`` is ``[batch, len]`` (or 1D). A sequence starts at every row start and wherever
    the position does not follow the previous one by 1 (the rule of the mask builders'
    ``find_packed_sequence_indices``), so rows never run into each other.
    """
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    start_idx = torch.nonzero(starts.flatten()).flatten().to(torch.int32)
    total = torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)
    cu = torch.cat([start_idx, total])
    return cu, int((cu[1:] - cu[:-1]).max().item())


class _PerTensorAnswer:
    """A yes/no question about a tensor, answered once per tensor object (there for speed only;
    docs/attention.md, "What is there for speed").

    Every layer of a model gets the same ``attention_mask`` / ``position_ids`` objects during one
    forward pass; asking the GPU "is this all ones?" in each layer forces a host-device sync per
    layer, which stalls the launch queue (measured: prefill 4 % slower than SDPA on the H200).
    The answer is kept beside a weak reference to the tensor and its in-place version counter, so
    a different tensor, a freed one or one modified in place is asked again.
    """

    def __init__(self, question: Callable[[torch.Tensor], bool]) -> None:
        self._question = question
        self._ref: Any = None
        self._version = -1
        self._answer = False

    def __call__(self, tensor: torch.Tensor) -> bool:
        if self._ref is not None and self._ref() is tensor and tensor._version == self._version:
            return self._answer
        answer = bool(self._question(tensor))
        try:
            self._ref = weakref.ref(tensor)
        except TypeError:  # tensor subclasses without weakref support: just do not remember
            self._ref = None
            return answer
        self._version, self._answer = tensor._version, answer
        return answer


def _restarts(position_ids: torch.Tensor) -> bool:
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    return bool((pos[:, 1:] != pos[:, :-1] + 1).any())


_has_restarts = _PerTensorAnswer(_restarts)
_all_true = _PerTensorAnswer(lambda mask: bool(mask.all()))


def _is_packed(position_ids: torch.Tensor | None, batch: int, q_len: int, use_cache: Any) -> bool:
    """Whether restarting ``position_ids`` mark sequences packed together, as transformers reads them.

    Reading the positions costs a host-device sync (once per tensor, see _PerTensorAnswer), which
    stalls the launch queue mid-forward. transformers looks for packed sequences in one row (its
    FlashAttention path) and, for any batch, only when no cache is in use (its mask builders): a
    cached batch of several rows is never packed, so those calls (prefill and generation) skip it.
    transformers 4.57 hands attention functions ``use_cache=False`` whatever the model was given,
    so there the positions are still read: a sync, never a different answer.
    """
    if position_ids is None or q_len == 1 or position_ids.shape[-1] != q_len:
        return False
    if batch > 1 and use_cache:
        return False
    return _has_restarts(position_ids)


# ------------------------------------------------------------------------------------------
# the attention function
# ------------------------------------------------------------------------------------------


def _varlen(
    fk: FlashKernel, qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, cu_q: Any, cu_k: Any, mq: int, mk: int,
    opts: Callable[[frozenset[str], int], dict[str, Any]],
) -> torch.Tensor:
    return first_output(
        fk.varlen(qp, kp, vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(mq), max_seqlen_k=int(mk),
                  **opts(fk.varlen_params, int(mk)))
    )


def flash_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    kernel: ModuleType | FlashKernel,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """FlashAttention through ``kernel`` (transformers' attention-function contract).

    ``query [B, Hq, Sq, D]``, ``key``/``value [B, Hkv, Skv, D]`` (GQA is the kernel's: Hq must be a
    multiple of Hkv). ``attention_mask`` is the 2D padding mask from ``flash_attention_mask``
    (True/1 = real token) or None.

    Keyword options (as transformers passes them; others are ignored): ``dropout`` (0.0),
    ``scaling`` (None: 1/sqrt(D)), ``sliding_window``, ``softcap``, ``is_causal`` (None: the
    module's ``is_causal``, else True), ``position_ids`` (packed sequences when they restart, in
    one row or, when ``use_cache`` is false or absent, in several), ``use_cache``,
    ``cu_seq_lens_q``/``cu_seq_lens_k``/``max_length_q``/``max_length_k`` (packed input given
    directly), ``s_aux`` (attention sinks), ``deterministic``, ``output_attentions``.

    Returns:
        ``(out [B, Sq, Hq, D] contiguous, None)``.

    Raises:
        UnsupportedAttentionOptionError: a 4D mask, ``output_attentions=True``, an option the
            kernel's functions do not accept (softcap, window, dropout, sinks), or a ``flash_attn``
            package asked to run off-GPU or in float32.
        UnusableKernelError: ``kernel`` has no ``flash_attn_varlen_func``.
    """
    return _forward(flash_kernel(kernel), module, query, key, value, attention_mask, kwargs)


def _forward(
    fk: FlashKernel, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, kw: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    # Takes transformers' keyword arguments as the dict they arrived in: re-binding a dozen
    # keywords per call is host time on every layer of every decode step.
    get = kw.get
    if get("output_attentions"):
        raise UnsupportedAttentionOptionError(
            "FlashAttention returns no attention weights; use attn_implementation='eager' for output_attentions."
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise UnsupportedAttentionOptionError(
            f"FlashAttention takes a 2D padding mask [batch, kv_len], got a {attention_mask.dim()}D mask "
            f"{tuple(attention_mask.shape)}. Build masks with the 'flash_attention_2' formatter "
            "(create_causal_mask with config._attn_implementation set to the flash backend), or use "
            "'sdpa'/'eager' for arbitrary 4D masks."
        )
    q_shape = query.shape
    if 0 in q_shape:
        raise ValueError(f"FlashAttention got an empty query {tuple(q_shape)}")
    if fk.cuda_half_only:
        if query.device.type != "cuda":
            raise UnsupportedAttentionOptionError(
                f"{fk.name} runs only on CUDA GPUs, and the inputs are on {query.device}. Use "
                "'flash_attention_2' (it falls back to a kernel for this device) or 'sdpa'."
            )
        if query.dtype not in (torch.float16, torch.bfloat16):
            raise UnsupportedAttentionOptionError(
                f"{fk.name} supports float16 and bfloat16 only, got {query.dtype}. Cast the model "
                "(model.to(torch.bfloat16)) or use 'sdpa'."
            )
    if key.shape[1] == 0 or q_shape[1] % key.shape[1]:
        kv_groups(query, key)  # raises with a readable message

    batch, q_len = q_shape[0], q_shape[2]
    is_causal = get("is_causal")
    causal = bool(is_causal) if is_causal is not None else resolve_is_causal(module, None)
    dropout, scaling, sliding_window = get("dropout", 0.0), get("scaling"), get("sliding_window")
    softcap, s_aux, deterministic = get("softcap"), get("s_aux"), get("deterministic")
    cu_seq_lens_q, position_ids = get("cu_seq_lens_q"), get("position_ids")
    if (fk.decode_heads_first is not None and attention_mask is None and cu_seq_lens_q is None
            and (position_ids is None or q_len == 1) and not dropout and s_aux is None):
        # a decode step into a kernel that takes transformers' layout as it is; None: not served
        kv_len = key.shape[2]
        window = window_size(sliding_window, causal) if sliding_window is not None and kv_len > sliding_window \
            else (-1, -1)
        out = fk.decode_heads_first(query, key, value, scaling, causal, window, softcap or 0.0)
        if out is not None:
            return out, None
    # FlashAttention layout: [B, S, H, D]
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    head_dim, v_head_dim = q_shape[-1], v.shape[-1]
    if v_head_dim != head_dim:  # e.g. MLA: pad V up to the QK head dim, crop the output below
        v = torch.nn.functional.pad(v, (0, head_dim - v_head_dim))

    def opts(params: frozenset[str], kv_len: int) -> dict[str, Any]:
        if s_aux is None:  # every layer, every step: the cached dict, unpacked by the call
            return shared_options(params, fk.name, causal, kv_len, dropout, scaling, sliding_window, softcap,
                                   deterministic)
        return call_options(params, fk.name, causal=causal, kv_length=kv_len, dropout=dropout, scaling=scaling,
                        sliding_window=sliding_window, softcap=softcap, s_aux=s_aux, deterministic=deterministic)

    if attention_mask is None and cu_seq_lens_q is None and (position_ids is None or q_len == 1) and fk.func is not None:
        # the common case first (every decode step): one dense call, nothing else to decide
        out = first_output(fk.func(q, k, v, **opts(fk.func_params, k.shape[1])))
    elif attention_mask is not None and not (attention_mask.shape[-1] == k.shape[1] and _all_true(attention_mask)):
        mask = attention_mask.to(torch.bool)
        if k.shape[1] > mask.shape[-1]:  # static cache: keys beyond the mask are unused slots
            k, v = k[:, : mask.shape[-1]], v[:, : mask.shape[-1]]
        kp, idx_k, cu_k, max_k = unpad_input(k, mask)
        vp = v.reshape(-1, *v.shape[2:])[idx_k]
        if q_len == mask.shape[-1]:
            qp, idx_q, cu_q, max_q = unpad_input(q, mask)
        else:
            qp, idx_q, cu_q, max_q = unpad_input(q, mask[:, -q_len:])
        out = _varlen(fk, qp, kp, vp, cu_q, cu_k, max_q, max_k, opts)
        out = pad_input(out, idx_q, batch, q_len)
    elif (cu_seq_lens_q is not None and get("cu_seq_lens_k") is not None and get("max_length_q") is not None
          and get("max_length_k") is not None):
        flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
        out = _varlen(fk, *flat, cu_seq_lens_q, kw["cu_seq_lens_k"], kw["max_length_q"], kw["max_length_k"], opts)
        out = out.view(batch, -1, *out.shape[1:])
    elif q_len == k.shape[1] and _is_packed(position_ids, batch, q_len, get("use_cache")):
        cu, max_len = cu_seqlens_from_position_ids(position_ids.expand(batch, -1))
        cu = cu.to(q.device)
        flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
        out = _varlen(fk, *flat, cu, cu, max_len, max_len, opts).view(batch, q_len, *q.shape[2:])
    elif fk.func is not None:
        out = first_output(fk.func(q, k, v, **opts(fk.func_params, k.shape[1])))
    else:
        kv_len = k.shape[1]
        cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=q.device)
        cu_k = torch.arange(0, (batch + 1) * kv_len, kv_len, dtype=torch.int32, device=q.device)
        flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
        out = _varlen(fk, *flat, cu_q, cu_k, q_len, kv_len, opts).view(batch, q_len, *q.shape[2:])

    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out.contiguous(), None


def make_flash_attention(kernel: ModuleType | FlashKernel, name: str | None = None) -> Callable[..., Any]:
    """An attention function ``fn(module, query, key, value, attention_mask, **kw)`` bound to ``kernel``.

    The function depends on nothing but ``kernel``, so it can be registered in transformers'
    ``AttentionInterface`` as well as ours.

    Raises:
        UnusableKernelError: ``kernel`` has no ``flash_attn_varlen_func``.
    """
    fk = flash_kernel(kernel)

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        kwargs.pop("kernel", None)
        return _forward(fk, module, query, key, value, attention_mask, kwargs)

    attention.__name__ = "flash_attention_forward"
    attention.__qualname__ = f"flash_attention_forward[{name or fk.name}]"
    attention.__doc__ = f"FlashAttention through {fk.name} (see kernel_loader.attention.backends.flash.flash_attention_forward)."
    attention.flash_kernel = fk  # type: ignore[attr-defined]
    return attention
