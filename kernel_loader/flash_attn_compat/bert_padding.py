"""``flash_attn.bert_padding``: moving between padded ``[batch, seqlen, ...]`` tensors and the packed
``[total_tokens, ...]`` layout of the varlen functions, with flash-attn 2.7+'s return tuples.

Plain PyTorch (indexing is differentiable, so no custom autograd is needed). torch is imported
inside each function so that importing the stand-in stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "index_first_axis",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
]


def index_first_axis(input: Any, indices: Any) -> Any:
    """Rows ``indices`` of ``input`` ``[first_axis, ...]`` (at least 2-D): ``[len(indices), ...]``.

    Raises:
        ValueError: ``input`` has fewer than two dimensions.
    """
    if input.dim() < 2:
        raise ValueError(f"index_first_axis needs a tensor of at least 2 dimensions, got shape {tuple(input.shape)}")
    return input[indices]


def index_put_first_axis(values: Any, indices: Any, first_axis_dim: int) -> Any:
    """A zero ``[first_axis_dim, ...]`` tensor with ``values`` ``[len(indices), ...]`` at rows ``indices``.

    Raises:
        ValueError: ``indices`` is not 1-D or ``values`` has fewer than two dimensions.
    """
    import torch

    if indices.dim() != 1 or values.dim() < 2:
        raise ValueError(
            f"index_put_first_axis needs 1-D indices and values of at least 2 dimensions, got indices "
            f"{tuple(indices.shape)} and values {tuple(values.shape)}"
        )
    output = torch.zeros(first_axis_dim, *values.shape[1:], device=values.device, dtype=values.dtype)
    return output.index_put((indices,), values)


def _packing(lengths: Any, keep: Any) -> tuple[Any, Any, int]:
    """(indices of kept tokens in the flattened batch, int32 cu_seqlens, max length as int)."""
    import torch

    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(lengths.max().item()) if lengths.numel() else 0
    return indices, cu_seqlens, max_seqlen


def unpad_input(hidden_states: Any, attention_mask: Any, unused_mask: Any = None) -> tuple[Any, Any, Any, int, Any]:
    """Pack the tokens ``attention_mask`` (plus ``unused_mask``) selects.

    Args:
        hidden_states: ``[batch, seqlen, ...]``.
        attention_mask: ``[batch, seqlen]`` bool/int, nonzero = a real token.
        unused_mask: optional ``[batch, seqlen]``, nonzero = allocated but unused (kept in the
            packing, not counted in ``seqused``).

    Returns:
        ``(hidden_states [total, ...], indices [total], cu_seqlens int32 [batch + 1],
        max_seqlen_in_batch int, seqused int32 [batch])``; ``indices`` index the flattened
        ``[batch * seqlen]`` positions.
    """
    import torch

    selected = attention_mask if unused_mask is None else attention_mask + unused_mask
    lengths = selected.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices, cu_seqlens, max_seqlen = _packing(lengths, selected)
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, used


def unpad_input_for_concatenated_sequences(hidden_states: Any, attention_mask_in_length: Any) -> tuple[Any, Any, Any, int]:
    """Pack rows that each hold several sequences back to back.

    ``attention_mask_in_length`` ``[batch, seqlen]`` int lists each row's sequence lengths from the
    left, zeros after (``[[2, 3, 0, 0, 0, 0]]``: two sequences of 2 and 3 tokens, then padding).

    Returns:
        ``(hidden_states [total, ...], indices [total], cu_seqlens int32 [num_sequences + 1],
        max_seqlen_in_batch int)``, one cu_seqlens entry per sequence, not per row.
    """
    import torch

    lengths_2d = attention_mask_in_length
    row_tokens = lengths_2d.sum(dim=-1)
    seqlen = lengths_2d.shape[-1]
    positions = torch.arange(seqlen, device=lengths_2d.device, dtype=row_tokens.dtype)
    keep = positions.expand(lengths_2d.shape[0], seqlen) < row_tokens.unsqueeze(1)
    lengths = lengths_2d.flatten()
    lengths = lengths[lengths != 0].to(torch.int32)
    indices, cu_seqlens, max_seqlen = _packing(lengths, keep)
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen


def pad_input(hidden_states: Any, indices: Any, batch: int, seqlen: int) -> Any:
    """Undo :func:`unpad_input`: ``[total, ...]`` back to ``[batch, seqlen, ...]``, zeros elsewhere."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])
