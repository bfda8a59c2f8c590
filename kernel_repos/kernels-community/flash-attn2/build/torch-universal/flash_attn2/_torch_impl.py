"""The PyTorch path: exact FlashAttention semantics in plain tensor ops.

It serves CPU tensors (so the embedded kernel works on a laptop) and GPUs the Triton kernels do
not support. It materialises the full score matrix, so it is meant for correctness, not speed.
Autograd differentiates it directly, dropout included (the mask comes from torch's own RNG).

Public to sibling modules:

``attention_torch(q, k, v, *, softmax_scale, causal, window_size, softcap, alibi_slopes,
seqlens_k=None, dropout_p=0.0, dropout_mask=None, generator=None) -> (out, lse)``
    q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hk, D]`` (Hq % Hk == 0). ``seqlens_k`` (int tensor
    ``[B]``) marks how many leading keys of each row are valid; causal and window masks are then
    bottom-right aligned to that length. Returns out ``[B, Sq, Hq, D]`` in q's dtype and lse
    ``[B, Hq, Sq]`` float32 (natural log). A query row that sees no key gets out 0 and lse +inf,
    as flash-attn 2 does.

``varlen_attention_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, ...) -> (out, lse)``
    The same on packed ``[total, H, D]`` input; lse is ``[Hq, total_q]``.

``allowed_mask(sq, sk, causal, window_size, device, seqlen_k=None) -> bool [sq, sk]``
    Which (query, key) pairs may attend, bottom-right aligned.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def allowed_mask(
    sq: int,
    sk: int,
    causal: bool,
    window_size: Tuple[int, int],
    device: torch.device,
    seqlen_k: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Boolean ``[sq, sk]`` (or ``[B, sq, sk]`` with ``seqlen_k``) of allowed pairs.

    Query ``i`` sits at key position ``i + valid_k - sq`` (bottom-right alignment); key ``j`` is
    allowed when ``j`` lies in ``[pos - left, pos + right]`` (-1 = unbounded; causal means
    right = 0) and ``j < valid_k``.
    """
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(sq, device=device).view(-1, 1)
    j = torch.arange(sk, device=device).view(1, -1)
    if seqlen_k is None:
        valid = torch.full((1, 1, 1), sk, device=device, dtype=torch.long)
    else:
        valid = seqlen_k.to(device=device, dtype=torch.long).view(-1, 1, 1)
    pos = i.unsqueeze(0) + valid - sq  # [B or 1, sq, 1]
    ok = (j.unsqueeze(0) < valid).expand(valid.shape[0], sq, sk)
    if right >= 0:
        ok = ok & (j.unsqueeze(0) <= pos + right)
    if left >= 0:
        ok = ok & (j.unsqueeze(0) >= pos - left)
    if seqlen_k is None:
        return ok[0]
    return ok


def _alibi_bias(
    alibi_slopes: torch.Tensor, batch: int, heads: int, sq: int, sk: int, seqlen_k: Optional[torch.Tensor]
) -> torch.Tensor:
    """``-slope * |i + Sk - Sq - j|`` as ``[B, H, sq, sk]`` float32 (flash-attn's ALiBi)."""
    slopes = alibi_slopes.to(torch.float32)
    if slopes.dim() == 1:
        slopes = slopes.view(1, heads).expand(batch, heads)
    device = slopes.device
    i = torch.arange(sq, device=device, dtype=torch.float32).view(1, 1, -1, 1)
    j = torch.arange(sk, device=device, dtype=torch.float32).view(1, 1, 1, -1)
    if seqlen_k is None:
        valid = torch.full((batch, 1, 1, 1), float(sk), device=device)
    else:
        valid = seqlen_k.to(device=device, dtype=torch.float32).view(-1, 1, 1, 1)
    dist = (i + valid - sq - j).abs()
    return -slopes.view(batch, heads, 1, 1) * dist


def attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    seqlens_k: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    dropout_mask: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense attention with flash-attn semantics; see the module docstring.

    ``dropout_mask`` (bool ``[B, Hq, Sq, Sk]``, True = keep) overrides the random mask drawn for
    ``dropout_p``; tests use it to replay a kernel's mask. Computes in float32 (float64 inputs
    stay float64). Raises ValueError when the head counts do not divide.
    """
    batch, sq, hq, dim = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if hq % hk != 0:
        raise ValueError(f"number of query heads ({hq}) must be divisible by key/value heads ({hk})")
    if softmax_scale is None:
        softmax_scale = dim ** -0.5
    cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if sk == 0 or sq == 0:
        # No keys: every row sees nothing (out 0, lse +inf); still connect the graph for autograd.
        out = (q * 0).to(q.dtype) + (k.sum() + v.sum()) * 0
        lse = torch.full((batch, hq, sq), float("inf"), device=q.device, dtype=torch.float32)
        return out, lse
    qf = q.to(cdtype).transpose(1, 2)  # [B, Hq, Sq, D]
    group = hq // hk
    kf = k.to(cdtype).transpose(1, 2).repeat_interleave(group, dim=1)
    vf = v.to(cdtype).transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * softmax_scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        scores = scores + _alibi_bias(alibi_slopes, batch, hq, sq, sk, seqlens_k).to(cdtype)
    ok = allowed_mask(sq, sk, causal, window_size, q.device, seqlens_k)
    ok = ok.view(1, 1, sq, sk) if ok.dim() == 2 else ok.unsqueeze(1)
    scores = scores.masked_fill(~ok, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    # Rows with no allowed key keep max -inf; shifting by 0 instead keeps exp() at 0, not NaN.
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    lse = torch.where(denom > 0, row_max + torch.log(denom), torch.full_like(denom, float("inf")))
    probs = probs / torch.where(denom > 0, denom, torch.ones_like(denom))
    if dropout_mask is not None or dropout_p > 0.0:
        if dropout_mask is None:
            keep_p = torch.full(probs.shape, 1.0 - dropout_p, device=probs.device, dtype=cdtype)
            dropout_mask = torch.bernoulli(keep_p, generator=generator).bool()
        probs = probs.masked_fill(~dropout_mask.to(probs.device), 0.0) / (1.0 - dropout_p)
    out = torch.matmul(probs, vf).transpose(1, 2).to(q.dtype)
    return out, lse.squeeze(-1).to(torch.float32 if cdtype == torch.float32 else cdtype).detach()


def varlen_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed-sequence attention: one :func:`attention_torch` call per sequence.

    Returns out ``[total_q, Hq, D]`` and lse ``[Hq, total_q]`` float32. Query tokens past
    ``cu_seqlens_q[-1]`` (a batch padded to a fixed size) belong to no sequence: out 0, lse +inf.
    """
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    outs = []
    lses = []
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        o, l = attention_torch(
            q[qs:qe].unsqueeze(0),
            k[ks:ke].unsqueeze(0),
            v[ks:ke].unsqueeze(0),
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            alibi_slopes=slopes,
            dropout_p=dropout_p,
            generator=generator,
        )
        outs.append(o[0])
        lses.append(l[0])
    hq = q.shape[1]
    if not outs:
        return q.new_zeros(q.shape), torch.zeros(hq, 0, device=q.device, dtype=torch.float32)
    tail = q.shape[0] - cq[-1]
    if tail > 0:
        outs.append(q.new_zeros((tail,) + tuple(q.shape[1:])))
        lses.append(torch.full((hq, tail), float("inf"), device=q.device, dtype=torch.float32))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)
