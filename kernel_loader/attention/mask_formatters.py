"""Turn a mask pattern (a mask function + a 2D padding mask) into what each backend consumes.

All formatters share the signature registered in ``AttentionMaskInterface``::

    fmt(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
        mask_function=causal_mask_function, attention_mask=None, **kwargs)

* ``sdpa_mask``   -> 4D bool ``[B, 1, q, kv]`` (True attends) or None when sdpa's ``is_causal``
  (or no mask at all) gives the same result.
* ``eager_mask``  -> 4D float, 0 where attended and ``finfo(dtype).min`` elsewhere.
* ``flash_attention_mask`` -> the 2D padding mask, or None; refuses patterns FlashAttention
  cannot express (transformers drops them silently).
* ``flex_attention_mask``  -> a FlexAttention ``BlockMask``.
* ``paged_attention_mask`` -> None: paged backends derive masking from the cache's lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernel_loader.attention.mask_functions import (
    MaskFunction,
    add_offsets_to_mask_function,
    and_masks,
    causal_mask_function,
    mask_kinds,
    padding_mask_function,
)
from kernel_loader.attention.mask_equivalence import KERNEL_KINDS, MASK_CHECK_CELLS, first_difference, kernel_pattern
from kernel_loader.errors import UnsupportedAttentionOptionError

__all__ = [
    "sdpa_mask",
    "eager_mask",
    "flash_attention_mask",
    "flex_attention_mask",
    "paged_attention_mask",
    "materialize_mask",
]


def _pad_padding_mask(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int) -> torch.Tensor | None:
    """Right-pad a 2D padding mask with False so every ``kv_idx + kv_offset`` can be indexed."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask.to(torch.bool)
    missing = kv_length + kv_offset - attention_mask.shape[-1]
    if missing > 0:
        attention_mask = torch.nn.functional.pad(attention_mask, (0, missing), value=False)
    return attention_mask


def _can_use_sdpa_is_causal(
    padding_mask: torch.Tensor | None, q_length: int, kv_length: int, q_offset: Any, kv_offset: int, local_size: int | None
) -> bool:
    """Whether sdpa's own ``is_causal`` (top-left aligned) reproduces the causal pattern exactly."""
    if torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    if local_size is not None and kv_length >= local_size:
        return False
    if padding_mask is not None:
        padding_mask = padding_mask[:, kv_offset : kv_offset + kv_length]
    no_padding = padding_mask is None or bool(padding_mask.all())
    if (q_length == 1 or kv_length == q_length) and no_padding:
        return True
    # Empty-cache prefill into a static cache: the keys after q_length are future slots, which
    # top-left causal never reaches.
    if q_offset == 0 and (
        padding_mask is None or (bool(padding_mask[:, :q_length].all()) and not bool(padding_mask[:, q_length:].any()))
    ):
        return True
    return False


def _is_causal_pattern(
    mask_function: MaskFunction, batch_size: int, q_length: int, kv_length: int, q_offset: int, kv_offset: int,
    padding: torch.Tensor | None, device: Any, budget: int,
) -> bool:
    """Whether sdpa's ``is_causal`` computes ``mask_function`` here (else the mask must be built).

    The builders never allow the shortcut with a custom part; a direct caller may, and then the
    pattern is evaluated rather than dropped (the rule of ``flash_attention_mask``).
    """
    if not _unrecognised(mask_function):
        return True
    return first_difference(
        mask_function, causal_mask_function, batch_size=batch_size, q_length=q_length, kv_length=kv_length,
        q_offset=q_offset, kv_offset=kv_offset, padding=padding, device=device, budget=budget,
        kernel_label="sdpa's is_causal",
    ) is None


def materialize_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: MaskFunction = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Evaluate ``mask_function`` (AND the padding mask) on every cell: bool ``[B, 1, q, kv]``.

    Index tensors are broadcast rather than vmapped, which works for every index-based predicate
    (including ones indexing tensors with ``batch_idx``).
    """
    padding = _pad_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        mask_function = and_masks(mask_function, padding_mask_function(padding))
    b = torch.arange(batch_size, device=device)[:, None, None, None]
    h = torch.arange(1, device=device)[None, :, None, None]
    q = (torch.arange(q_length, device=device) + q_offset)[None, None, :, None]
    kv = (torch.arange(kv_length, device=device) + kv_offset)[None, None, None, :]
    mask = torch.as_tensor(mask_function(b, h, q, kv), device=device).to(torch.bool)
    return mask.expand(batch_size, 1, q_length, kv_length)


def sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: MaskFunction = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> torch.Tensor | None:
    """4D bool mask ``[B, 1, q, kv]`` (True attends), or None when sdpa needs none.

    None means: plain causal (use ``is_causal``) when ``allow_is_causal_skip``, or full attention
    without padding when ``allow_is_bidirectional_skip``.
    """
    padding = _pad_padding_mask(attention_mask, kv_length, kv_offset)
    if (allow_is_causal_skip and _can_use_sdpa_is_causal(padding, q_length, kv_length, q_offset, kv_offset, local_size)
            and _is_causal_pattern(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, padding,
                                   device, kwargs.get("mask_check_cells", MASK_CHECK_CELLS))):
        return None
    if allow_is_bidirectional_skip and not torch.compiler.is_compiling():
        window_irrelevant = local_size is None or kv_length < local_size
        sliced = None if padding is None else padding[:, kv_offset : kv_offset + kv_length]
        if window_irrelevant and (sliced is None or bool(sliced.all())):
            return None
    return materialize_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, padding, device)


def eager_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: MaskFunction = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    allow_is_bidirectional_skip: bool = False,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> torch.Tensor | None:
    """4D additive float mask: 0 where attended, ``torch.finfo(dtype).min`` where masked.

    The minimum rather than -inf keeps fully masked rows (padding queries) finite after softmax.
    Only a bidirectional mask without padding may be skipped (None).
    """
    kwargs.pop("allow_is_causal_skip", None)
    mask = sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        mask_function,
        attention_mask,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=allow_is_bidirectional_skip,
        device=device,
        **kwargs,
    )
    if mask is None:
        return None
    zero = torch.zeros((), device=mask.device, dtype=dtype)
    return torch.where(mask, zero, torch.finfo(dtype).min)


_MASK_BACKENDS = "'sdpa', 'eager' or 'flex_attention'"


def _unrecognised(mask_function: MaskFunction) -> set[str]:
    return mask_kinds(mask_function) - KERNEL_KINDS


def flash_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: MaskFunction = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    config: Any = None,
    mask_check_cells: int = MASK_CHECK_CELLS,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> torch.Tensor | None:
    """The 2D padding mask ``[B, kv]`` (bool) FlashAttention unpads with, or None without padding.

    FlashAttention expresses causality, sliding windows and packed sequences through its own
    arguments (``is_causal``, ``sliding_window``, ``position_ids``) — not through this mask. A
    pattern with anything else in it (a custom predicate, chunks, blocks) is evaluated on this
    call's (query, key) grid and accepted when it equals what the kernel computes there (see
    :mod:`kernel_loader.attention.mask_equivalence`: the budget, the sampled check, the cache).

    Raises:
        UnsupportedAttentionOptionError: the pattern differs from what the kernel computes; the
            message names the first differing cell and the backends that can apply the pattern
            (transformers silently drops the pattern in that case).
    """
    unrecognised = _unrecognised(mask_function)
    if unrecognised:
        # only a pattern to check needs the padded mask (a cast, and a pad, on every forward)
        padding = _pad_padding_mask(attention_mask, kv_length, kv_offset)
        causal_default = bool(getattr(config, "is_causal", True))
        expected = kernel_pattern(mask_function, causal_default)
        difference = first_difference(
            mask_function, expected, batch_size=batch_size, q_length=q_length, kv_length=kv_length,
            q_offset=q_offset, kv_offset=kv_offset, padding=padding, device=device, budget=mask_check_cells,
            kernel_label="FlashAttention's",
        )
        if difference is not None:
            kernel_kinds = sorted(mask_kinds(expected) & KERNEL_KINDS - {"padding"})
            raise UnsupportedAttentionOptionError(
                f"FlashAttention cannot apply the mask pattern {sorted(unrecognised)}: it computes "
                f"{'+'.join(kernel_kinds)} attention (with the padding mask), and {difference.describe()}. Dropping "
                f"the pattern would change the results; use attn_implementation={_MASK_BACKENDS} for this model."
            )
    if attention_mask is None:
        return None
    if attention_mask.shape[-1] > kv_length:
        attention_mask = attention_mask[:, -kv_length:]
    # one device-to-host read either way; all() on the mask as given needs no bool copy first
    if attention_mask.shape[-1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask.to(torch.bool)


def flex_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: MaskFunction = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> Any:
    """A FlexAttention ``BlockMask`` for the pattern (with padding and offsets applied).

    The block mask is built without ``torch.compile`` on the CPU (compiling it costs ~30 s there
    and buys nothing for small masks) and compiled on accelerators.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    if attention_mask is not None and not bool(attention_mask.all()):
        padding = _pad_padding_mask(attention_mask, kv_length, kv_offset)
        mask_function = and_masks(mask_function, padding_mask_function(padding))
    if q_offset or kv_offset:
        mask_function = add_offsets_to_mask_function(mask_function, q_offset, kv_offset)
    device = torch.device(device)
    return create_block_mask(
        mask_mod=mask_function,
        B=batch_size,
        H=None,
        Q_LEN=q_length,
        KV_LEN=kv_length,
        device=device,
        _compile=device.type != "cpu",
    )


def paged_attention_mask(*args: Any, **kwargs: Any) -> None:
    """Always None: paged backends mask from the cache's per-sequence lengths (causal)."""
    return None


BUILTIN_MASK_FORMATTERS: dict[str, Callable[..., Any]] = {
    "eager": eager_mask,
    "sdpa": sdpa_mask,
    "flex_attention": flex_attention_mask,
    "flash_attention_2": flash_attention_mask,
    "flash_attention_3": flash_attention_mask,
    "paged|eager": paged_attention_mask,
    "paged|sdpa": paged_attention_mask,
    "paged|flash_attention_2": paged_attention_mask,
    "paged|flash_attention_3": paged_attention_mask,
}
