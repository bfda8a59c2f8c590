"""Backend choice and the autograd glue between the public API and the kernels.

Dispatch: CUDA tensors on sm80+ run the Triton kernels (older GPUs and ROCm fall back to the
PyTorch path with a one-time warning); CPU tensors run the Triton kernels under
``TRITON_INTERPRET=1`` (how the CPU test suite exercises them) and the PyTorch path otherwise.
Triton is imported lazily so the package imports on machines without it.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional, Tuple

import torch

from . import _compiled, _gluon_dispatch, _launch, _torch_impl, _validate
from ._lazy import module as _module

_WARNED = set()
_INF = float("inf")
_CUDA_BACKENDS: dict = {}  # device -> backend: the answer cannot change within a process


def backend_for(t: torch.Tensor) -> str:
    """"gpu", "interpreter" or "torch": which implementation serves tensors like ``t``."""
    return backend_of(t.device)


def backend_of(device: torch.device) -> str:
    """:func:`backend_for` tensors on ``device``."""
    if device.type == "cuda":
        backend = _CUDA_BACKENDS.get(device)
        if backend is None:
            backend = _CUDA_BACKENDS[device] = _cuda_backend(device)
        return backend
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "interpreter"
    return "torch"


def _cuda_backend(device: torch.device) -> str:
    if getattr(torch.version, "hip", None):
        _warn_once("rocm", "flash-attn2: the Triton kernels are not tuned/tested on ROCm; using the PyTorch path")
        return "torch"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 0):
        _warn_once(
            cap,
            f"flash-attn2: GPU capability {cap[0]}.{cap[1]} is below 8.0 (the Triton kernels "
            "need Ampere or newer); using the slower PyTorch path",
        )
        return "torch"
    return "gpu"


def _backend_when_compiling(device_type: str, index: Optional[int]) -> str:
    # torch.compile cannot trace the capability query; the answer is fixed per device and process
    return backend_of(torch.device(device_type, index))


# torch.compiler.assume_constant_result(_backend_when_compiling), written out: the decorator's
# module imports torch._dynamo, and with it Triton (a second at the package's import); setting
# this attribute is all it does (tests/kernel_repos/test_flash_attn2_compiled.py checks that)
_backend_when_compiling._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _warn_once(key, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def draw_seed() -> int:
    """The dropout seed of one call, drawn from torch's default CPU generator.

    ``torch.manual_seed(s)`` therefore makes dropout reproducible; tests call this after the same
    ``manual_seed`` to learn the seed a call used and replay its mask.
    """
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def _triton_forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, opts, store_lse=True):
    # The kernels take any batch/token/head strides but assume unit stride along head_dim.
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if q.is_cuda and _gluon_wanted(q, k, v, alibi_slopes, cu_seqlens_q, seqused_k, opts):
        out, lse = _module("_gluon_fwd").gluon_attention_forward(
            q, k, v, softmax_scale=opts["softmax_scale"], causal=opts["causal"], store_lse=store_lse,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=opts["max_seqlen_q"])
        return q, k, v, out, lse
    out, lse = _module("_triton_fwd").attention_forward(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
        alibi_slopes=alibi_slopes, store_lse=store_lse, **opts,
    )
    return q, k, v, out, lse


def _gluon_wanted(q, k, v, alibi_slopes, cu_seqlens_q, seqused_k, opts) -> bool:
    """Whether this forward goes to the Gluon sm90 kernel (the rule: ``_gluon_dispatch``)."""
    varlen = cu_seqlens_q is not None
    if not (_gluon_dispatch.MEASURED_FASTER_VARLEN if varlen else _gluon_dispatch.MEASURED_FASTER):
        return False
    plain = (seqused_k is None and alibi_slopes is None and not opts["dropout_p"]
             and not opts["softcap"] and tuple(opts["window_size"]) == (-1, -1))
    if not (plain and _gluon_dispatch.gluon_available()):
        if plain and "gluon-release" not in _WARNED and q.dtype == torch.bfloat16 \
                and _module("_triton_fwd").capability_of(q.device) == (9, 0):
            note = _gluon_dispatch.untimed_release_note()
            if note is not None:  # no silent step down to the slower kernels
                _warn_once("gluon-release", note)
        return False
    seqlen_q = opts["max_seqlen_q"] if varlen else q.shape[1]
    # the layout check last: it reads every stride, and most calls are decided before it
    return (_gluon_dispatch.wants_gluon(_module("_triton_fwd").capability_of(q.device), True, q.shape[-1],
                                        opts["causal"], seqlen_q, plain, q.dtype == torch.bfloat16, True,
                                        varlen=varlen)
            and _module("_gluon_fwd").supports(q, k, v))


# Dense inference calls with at most this many query tokens per row take the split-K decode
# kernel: one program serves every query head of a KV head (GQA reads K/V once, not once per query
# head) and long contexts are split over the SMs. The general forward would give each query head
# its own 128-row tile with one real row, several times the GPU time (bench/NOTES.md, Kernel tuning).
DECODE_MAX_QUERY = 16


def takes_decode(q: torch.Tensor, k: torch.Tensor, packed: bool, dropout_p: float) -> bool:
    """Whether an inference call on the kernels goes to the split-K decode kernel (dense, no
    dropout, at most DECODE_MAX_QUERY query tokens and no more than keys). Raises nothing."""
    return not packed and not dropout_p and q.shape[1] <= DECODE_MAX_QUERY and q.shape[1] <= k.shape[1]


def _decode(q, k, v, alibi_slopes, softmax_scale, causal, window_size, softcap, need_lse):
    decode_attention = _module("_triton_decode").decode_attention

    seqlen_k = k.shape[1]
    return decode_attention(
        q, k, v, total_lens=None, total_len_uniform=seqlen_k, capacity=seqlen_k, block_table=None,
        batch_idx=None, leftpad=None,
        alibi_slopes=alibi_slopes.contiguous() if alibi_slopes is not None else None,
        softmax_scale=softmax_scale, window_left=window_size[0], window_right=0 if causal else window_size[1],
        softcap=softcap, need_lse=need_lse,
    )


def decode_heads_first(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float],
    causal: bool,
    window_size: Tuple[int, int],
    softcap: float,
) -> Optional[torch.Tensor]:
    """Inference attention for a few query tokens, inputs in transformers' ``[B, H, S, D]`` layout.

    Returns ``out [B, Sq, Hq, D]`` (contiguous), or None when the call is not one this path
    serves: more than DECODE_MAX_QUERY query tokens or more queries than keys, gradients
    required, the PyTorch backend, or input the checks of ``attention`` would refuse (call
    :func:`attention` on ``[B, S, H, D]`` views then; it computes or raises). Raises nothing.
    """
    # Why a second entry: in eager decoding every layer pays the host cost of this call, and the
    # three transposed views flash-attn's layout needs cost more than the rest of the checks.
    if torch.compiler.is_compiling():  # the views cost nothing in a compiled graph: the caller's
        return None  # flash_attn_func then reaches the operator of _compiled
    qs, ks = q.shape, k.shape
    softcap = 0.0 if softcap is None else softcap
    if not (len(qs) == 4 and len(ks) == 4 and ks == v.shape and qs[0] == ks[0] and qs[3] == ks[3]
            and ks[1] > 0 and qs[1] % ks[1] == 0 and 0 < qs[2] <= DECODE_MAX_QUERY and qs[2] <= ks[2]
            and 1 <= qs[3] <= _validate.MAX_HEAD_DIM and q.dtype == k.dtype == v.dtype
            and q.device == k.device == v.device and softcap >= 0.0
            and window_size[0] >= -1 and window_size[1] >= -1
            and (softmax_scale is None or 0.0 < softmax_scale < _INF)):
        return None
    backend = backend_for(q)
    if backend == "torch" or q.dtype not in (_validate.GPU_DTYPES if backend == "gpu" else _validate.INTERPRETER_DTYPES):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    decode_attention = _module("_triton_decode").decode_attention
    seqlen_k = ks[2]
    return decode_attention(
        q, k, v, total_lens=None, total_len_uniform=seqlen_k, capacity=seqlen_k, block_table=None,
        batch_idx=None, leftpad=None, alibi_slopes=None,
        softmax_scale=float(softmax_scale) if softmax_scale is not None else qs[3] ** -0.5,
        window_left=int(window_size[0]), window_right=0 if causal else int(window_size[1]),
        softcap=float(softcap), need_lse=False, heads_first=True,
    )[0]


# Feature classes of forward calls whose backward kernels were already set compiling in this
# process (one tuple lookup per training forward; see _backward_ahead).
_BACKWARD_AHEAD: set = set()


def _backward_ahead(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, opts,
                    deterministic=False) -> list:
    """The first forward (on a GPU) of each feature class starts compiling its backward kernels
    on the compile threads, so they compile while the forward compiles and runs (a cold first
    training step pays for the slower of the two, not their sum). Returns the Futures to wait
    for before the backward launches (usually none)."""
    cls = (q.device, q.dtype, q.shape[-1], k.shape[-2] != q.shape[-2], cu_seqlens_q is not None,
           seqused_k is not None, alibi_slopes is not None, opts["causal"], tuple(opts["window_size"]),
           opts["softcap"] > 0, opts["dropout_p"] > 0, deterministic)
    if cls in _BACKWARD_AHEAD:
        return []
    _BACKWARD_AHEAD.add(cls)
    from ._triton_bwd import prepare_backward

    # the forward copies these first; the copies' layout is what the backward sees
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return prepare_backward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            seqused_k=seqused_k, alibi_slopes=alibi_slopes, deterministic=deterministic,
                            **opts)


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, opts, deterministic=False):
        ctx.compiling = (_backward_ahead(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, opts,
                                         deterministic) if q.is_cuda else [])
        q, k, v, out, lse = _triton_forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, opts)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k)
        ctx.opts = opts
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        # lse's gradient is never used: without this autograd would allocate and zero-fill one
        # for every backward (host time and a kernel launch)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # only lse reached the loss (grads are not materialised): nothing flows back
            return None, None, None, None, None, None, None, None, None
        try:
            _launch.wait(ctx.compiling)  # the kernels compiled ahead
        except Exception:  # compiled from a guess of dO's layout: the launches below compile
            pass  # what they need themselves, and raise there if the error is real
        q, k, v, out, lse, alibi_slopes, cu_q, cu_k, seqused_k = ctx.saved_tensors
        dq, dk, dv = _module("_triton_bwd").attention_backward(
            dout, q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k,
            alibi_slopes=alibi_slopes, deterministic=ctx.deterministic, **ctx.opts,
        )
        return dq, dk, dv, None, None, None, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    need_lse: bool = True,
    deterministic: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Validate, choose the backend and run; returns ``(out, lse)`` with flash-attn layouts.

    ``need_lse=False`` lets an inference call on the GPU kernels skip writing lse (then None).
    ``deterministic=True`` keeps the backward bitwise repeatable (``_triton_bwd.dq_mode``).
    Raises ValueError / NotImplementedError from ``_validate`` for unsupported input.
    """
    packed = cu_seqlens_q is not None
    _validate.check_qkv(q, k, v, packed)
    if packed:
        _validate.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], q.device)
        batch = cu_seqlens_q.numel() - 1
    else:
        batch = q.shape[0]
    # every decode step of every layer passes here: the range checks only when an option is set
    if dropout_p or softcap or alibi_slopes is not None or window_size != (-1, -1):
        _validate.check_options(dropout_p, window_size, softcap, alibi_slopes, batch, q.shape[-2], q.device)
        window_size = (int(window_size[0]), int(window_size[1]))
    else:
        window_size = (-1, -1)  # plain ints, whatever equal-to--1 values came in
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    elif not 0.0 < softmax_scale < _INF:
        _validate.check_softmax_scale(softmax_scale)
    if torch.compiler.is_compiling():
        # traced by torch.compile: the kernels as one opaque operator (_compiled); the PyTorch
        # path below is plain torch operations, which the compiler traces as they are
        backend = _backend_when_compiling(q.device.type, q.device.index)
        if backend != "torch":
            _validate.check_backend_dtype(q.dtype, backend)
            return _compiled.attention(
                q, k, v, alibi_slopes=None if alibi_slopes is None else alibi_slopes.to(torch.float32),
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                softcap=softcap, dropout_p=dropout_p, need_lse=need_lse, deterministic=deterministic)
    seed = draw_seed() if dropout_p > 0.0 else 0
    backend = backend_for(q)
    if backend == "torch":
        return _torch_path(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal,
                           window_size, float(softcap), alibi_slopes, seed)
    _validate.check_backend_dtype(q.dtype, backend)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(torch.float32)
    if packed:
        max_seqlen_q = int(max_seqlen_q) if max_seqlen_q is not None else int(cu_seqlens_q.diff().max())
        max_seqlen_k = int(max_seqlen_k) if max_seqlen_k is not None else int(cu_seqlens_k.diff().max())
    inference = not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    if inference and takes_decode(q, k, packed, dropout_p):
        return _decode(q, k, v, alibi_slopes, float(softmax_scale), bool(causal), window_size, float(softcap),
                       need_lse)
    opts = dict(
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=float(softmax_scale),
        causal=bool(causal), window_size=window_size, softcap=float(softcap),
        dropout_p=float(dropout_p), seed=seed,
    )
    if inference:
        # inference skips autograd.Function's bookkeeping: in eager decoding the host's cost per
        # call, not the GPU's, sets the pace
        return _triton_forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, None, opts, need_lse)[3:]
    return _TritonAttention.apply(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, None, opts,
                                  bool(deterministic))


def _torch_path(q, k, v, cu_q, cu_k, dropout_p, scale, causal, window, softcap, alibi, seed):
    gen = None
    if dropout_p > 0.0:
        gen = torch.Generator(device=q.device)
        gen.manual_seed(seed)
    common = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                  alibi_slopes=alibi, dropout_p=dropout_p, generator=gen)
    if cu_q is not None:
        return _torch_impl.varlen_attention_torch(q, k, v, cu_q, cu_k, **common)
    return _torch_impl.attention_torch(q, k, v, **common)
