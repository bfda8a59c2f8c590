"""Argument checks shared by every public function; errors name the limit and the fix."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

MAX_HEAD_DIM = 256
GPU_DTYPES = (torch.float16, torch.bfloat16)
INTERPRETER_DTYPES = (torch.float16, torch.float32)
TORCH_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: bool) -> None:
    """Shapes, dtypes, devices and head counts of q/k/v.

    Raises TypeError for a non-tensor, ValueError on a mismatch (the message names both shapes).
    """
    # One combined test first: this runs on every decode step of every layer, and the detailed
    # checks below, which word the error, cost several times as much host time.
    try:
        qs, ks = q.shape, k.shape
        want = 3 if packed else 4
        if (len(qs) == want and len(ks) == want and ks == v.shape and q.dtype == k.dtype == v.dtype
                and q.dtype in TORCH_DTYPES and q.device == k.device == v.device
                and (packed or qs[0] == ks[0]) and ks[-2] > 0 and qs[-2] % ks[-2] == 0
                and ks[-1] == qs[-1] and 1 <= qs[-1] <= MAX_HEAD_DIM):
            return
    except AttributeError:
        pass
    _explain_qkv(q, k, v, packed)
    raise ValueError(f"unsupported q/k/v: shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def _explain_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: bool) -> None:
    want = 3 if packed else 4
    layout = "[total_tokens, heads, head_dim]" if packed else "[batch, seqlen, heads, head_dim]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != want:
            raise ValueError(f"{name} must be {want}-D {layout}, got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not packed and (q.shape[0] != k.shape[0]):
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    hq, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or hq % hk != 0:
        raise ValueError(
            f"number of query heads ({hq}) must be a multiple of key/value heads ({hk}) (GQA/MQA)"
        )
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"q and k must have the same head_dim, got {d} and {k.shape[-1]}")
    if d > MAX_HEAD_DIM or d < 1:
        raise ValueError(
            f"head_dim {d} is not supported: flash-attn2 handles head dims 1..{MAX_HEAD_DIM}; "
            "use attn_implementation='sdpa' for larger heads"
        )
    if q.dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported; use float16, bfloat16 or float32")


def check_options(
    dropout_p: float,
    window_size: Tuple[int, int],
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    batch: int,
    heads_q: int,
    device: torch.device,
) -> None:
    """Option ranges. Raises ValueError naming the bad option and its allowed range."""
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if len(window_size) != 2 or int(window_size[0]) < -1 or int(window_size[1]) < -1:
        raise ValueError(f"window_size must be (left, right) with each >= -1 (-1 = unbounded), got {window_size}")
    if float(softcap) < 0.0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    if alibi_slopes is not None:
        if alibi_slopes.shape not in ((heads_q,), (batch, heads_q)):
            raise ValueError(
                f"alibi_slopes must have shape [{heads_q}] or [{batch}, {heads_q}], "
                f"got {tuple(alibi_slopes.shape)}"
            )
        if alibi_slopes.device != device:
            raise ValueError(f"alibi_slopes must be on {device}, got {alibi_slopes.device}")


def check_softmax_scale(softmax_scale: float) -> float:
    """The scale as a float. Raises ValueError unless it is finite and > 0: the kernels take the
    row maximum of the raw scores and scale it after, which only holds for a positive scale."""
    scale = float(softmax_scale)
    if not 0.0 < scale < float("inf"):
        raise ValueError(f"softmax_scale must be a finite number > 0 (default 1/sqrt(head_dim)), got {softmax_scale}")
    return scale


def check_cu_seqlens(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_q: int,
    total_k: int,
    device: torch.device,
) -> None:
    """cu_seqlens must be int32 1-D [batch+1] on q's device. Raises ValueError otherwise."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} must be a 1-D tensor [batch + 1] of cumulative lengths")
        if cu.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 (as flash-attn requires), got {cu.dtype}")
        if cu.device != device:
            raise ValueError(f"{name} must be on {device} like q, got {cu.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length, got "
            f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}"
        )


def check_backend_dtype(dtype: torch.dtype, backend: str) -> None:
    """The dtypes each backend computes in.

    Raises NotImplementedError for bf16 under the Triton interpreter (its tl.dot has no bf16)
    and ValueError for float32 on the GPU kernels (flash-attn's own limit).
    """
    if backend == "interpreter" and dtype not in INTERPRETER_DTYPES:
        raise NotImplementedError(
            f"{dtype} is not supported under TRITON_INTERPRET=1 (the interpreter has no bf16 "
            "matrix product); use float16/float32, or unset TRITON_INTERPRET to use the PyTorch path"
        )
    if backend == "gpu" and dtype not in GPU_DTYPES:
        raise ValueError(
            f"the flash-attn2 GPU kernels support float16 and bfloat16, got {dtype}; cast q/k/v "
            "with .to(torch.bfloat16) or use attn_implementation='sdpa'"
        )
