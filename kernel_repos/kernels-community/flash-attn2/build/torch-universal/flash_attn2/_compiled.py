"""The attention as torch custom operators, for code that torch.compile traces.

Why: torch.compile cannot trace into the kernels' launch path (Triton's launcher, the launch
caches, lazy imports), so without these operators it cuts the graph at every attention call, and
``fullgraph=True`` raises. The public functions call :func:`attention` instead of the eager path
while ``torch.compiler.is_compiling()`` is true: the compiler sees one opaque operator with known
output shapes (its fake implementation) and a registered backward, and CUDA graphs (``mode=
"reduce-overhead"``) can then hold the whole step, so the host's cost per call is paid once, at
capture. Eager calls never come here: an operator's dispatch costs host time, which eager
decoding pays on every layer.

The operators live in a namespace of their own per imported copy of the package (two revisions of
the kernel can be loaded side by side): ``torch.ops.<NAMESPACE>.fwd`` / ``.fwd_dropout`` /
``.bwd`` / ``.with_kvcache`` / ``.varlen_paged``.

The attention functions' PyTorch fallback (no Triton kernels for the device) does not come here:
it is plain torch operations, which the compiler traces as they are. ``flash_attn_with_kvcache``
goes through its operator on every backend (its checks read lengths on the host).
"""

import hashlib
import sys
from typing import Optional, Tuple

import torch

from . import _launch
from ._lazy import module as _module

# compiles of backward kernels that a forward started ahead (_autograd._backward_ahead), which the
# next backward waits for: an operator's context holds only tensors and plain values
_AHEAD: list = []


def _namespace() -> Tuple[str, "torch.library.Library"]:
    """A fresh operator namespace for this copy of the package, and its library handle.

    The name is derived from the package's module name (the same in every process, so compiled
    graphs that name the operators stay valid across processes); a copy imported again under the
    same name (tests do) gets the next free suffix."""
    base = "flash_attn2_" + hashlib.sha256((__package__ or "flash_attn2").encode()).hexdigest()[:10]
    for n in range(1000):
        name = base if n == 0 else f"{base}_{n}"
        try:
            return name, torch.library.Library(name, "DEF")
        except RuntimeError:  # taken by an earlier import of this package in this process
            continue
    raise RuntimeError(f"flash-attn2: no free torch operator namespace {base}_N")


NAMESPACE, _LIBRARY = _namespace()  # the handle holds the namespace for as long as the module lives


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    # the fake implementations promise contiguous outputs (what the kernels allocate); a layout
    # the kernels left otherwise (the PyTorch fallback inside the interpreter) is copied to match
    return t if t.is_contiguous() else t.contiguous()


def _lse_shape(q: torch.Tensor, packed: bool) -> Tuple[int, ...]:
    # flash-attn's layouts: [heads, total_q] packed, [batch, heads, seqlen_q] dense
    return (q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])


def _no_lse(q: torch.Tensor) -> torch.Tensor:
    # what an operator returns in place of an lse nobody asked for (its outputs are all tensors)
    return q.new_empty((0,), dtype=torch.float32)


def _max_lengths(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                 max_seqlen_k: int) -> Tuple[int, int]:
    # 0: not given to the traced call, learnt here at run time (reading them in the graph would
    # make the host wait for the GPU there)
    if max_seqlen_q > 0:
        return max_seqlen_q, max_seqlen_k
    return int(cu_seqlens_q.diff().max()), int(cu_seqlens_k.diff().max())


def _forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
             causal, window_left, window_right, softcap, dropout_p, train, need_lse, deterministic, seed):
    """Both forward operators' work: (out, lse) as their docstrings say."""
    autograd = _module("_autograd")
    packed = cu_seqlens_q is not None
    window = (window_left, window_right)
    lse: Optional[torch.Tensor]
    if not train and autograd.takes_decode(q, k, packed, dropout_p):
        out, lse = autograd._decode(q, k, v, alibi_slopes, softmax_scale, causal, window, softcap, need_lse)
    else:
        if packed:
            max_seqlen_q, max_seqlen_k = _max_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        opts = dict(max_seqlen_q=max_seqlen_q if packed else None, max_seqlen_k=max_seqlen_k if packed else None,
                    softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap,
                    dropout_p=dropout_p, seed=seed)
        if train and q.is_cuda:  # the backward's kernels compile while the forward compiles and runs
            _AHEAD.extend(autograd._backward_ahead(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, None, opts,
                                                   deterministic))
        out, lse = autograd._triton_forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, None, opts,
                                            train or need_lse)[3:]
    if lse is None or not (train or need_lse):
        lse = _no_lse(q)
    return _contiguous(out), _contiguous(lse)


def _forward_fake(q, cu_seqlens_q, train, need_lse):
    lse_shape = _lse_shape(q, cu_seqlens_q is not None) if (train or need_lse) else (0,)
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::fwd", mutates_args=())
def _fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int,
    max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int, window_right: int,
    softcap: float, train: bool, need_lse: bool, deterministic: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) without dropout: out like q (contiguous); lse float32 in flash-attn's layout, or
    empty when neither ``train`` nor ``need_lse``. ``deterministic`` is the backward's."""
    return _forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal, window_left, window_right, softcap, 0.0, train, need_lse, deterministic, 0)


@_fwd.register_fake
def _fwd_fake(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
              causal, window_left, window_right, softcap, train, need_lse, deterministic):
    return _forward_fake(q, cu_seqlens_q, train, need_lse)


@torch.library.custom_op(f"{NAMESPACE}::fwd_dropout", mutates_args=())
def _fwd_dropout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int,
    max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int, window_right: int,
    softcap: float, dropout_p: float, train: bool, need_lse: bool, deterministic: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_fwd` with dropout: also the seed this call drew (from torch's default CPU
    generator, as eager calls do), an int64 scalar on the CPU that the backward replays.

    A separate operator because a CPU output keeps a graph out of CUDA graphs; calls without
    dropout (:func:`_fwd`) have none."""
    seed = _module("_autograd").draw_seed()
    out, lse = _forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, causal, window_left, window_right, softcap, dropout_p, train, need_lse,
                        deterministic, seed)
    return out, lse, torch.tensor(seed, dtype=torch.int64)


@_fwd_dropout.register_fake
def _fwd_dropout_fake(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, causal, window_left, window_right, softcap, dropout_p, train, need_lse,
                      deterministic):
    return (*_forward_fake(q, cu_seqlens_q, train, need_lse), torch.empty((), dtype=torch.int64, device="cpu"))


@torch.library.custom_op(f"{NAMESPACE}::bwd", mutates_args=())
def _bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, seed: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int,
    max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int, window_right: int,
    softcap: float, dropout_p: float, deterministic: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), each contiguous in its input's shape."""
    ahead, _AHEAD[:] = list(_AHEAD), []
    try:
        _launch.wait(ahead)  # the kernels the forward set compiling
    except Exception:  # compiled from a guess of dO's layout: the launches below compile what they
        pass  # need themselves, and raise there if the error is real
    packed = cu_seqlens_q is not None
    if packed:
        max_seqlen_q, max_seqlen_k = _max_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # the forward read these through unit-stride copies; the backward wants the same layouts
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    dq, dk, dv = _module("_triton_bwd").attention_backward(
        dout if dout.stride(-1) == 1 else dout.contiguous(), q, k, v, out, lse,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q if packed else None, max_seqlen_k=max_seqlen_k if packed else None,
        alibi_slopes=alibi_slopes, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, dropout_p=dropout_p,
        seed=0 if seed is None else int(seed), deterministic=deterministic)
    return _contiguous(dq), _contiguous(dk), _contiguous(dv)


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, seed, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    # inputs: q, k, v, then alibi_slopes, cu_seqlens_q, cu_seqlens_k (tensors or None), then the
    # options the backward takes too (max_seqlen_q ... softcap, and dropout_p in the dropout
    # operator), train, need_lse, deterministic
    q, k, v, alibi, cu_q, cu_k, *options = inputs
    out, lse, *seed = output
    dropout = len(options) == 11
    ctx.save_for_backward(q, k, v, out, lse, seed[0] if seed else None, alibi, cu_q, cu_k)
    ctx.options = tuple(options[:8]) if dropout else (*options[:7], 0.0)
    ctx.deterministic = options[-1]
    ctx.inputs = len(inputs)
    ctx.mark_non_differentiable(lse, *seed)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, *_unused):
    if dout is None:  # only lse reached the loss: nothing flows back
        return (None,) * ctx.inputs
    q, k, v, out, lse, seed, alibi, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _bwd(dout, q, k, v, out, lse, seed, alibi, cu_q, cu_k, *ctx.options, ctx.deterministic)
    return (dq, dk, dv) + (None,) * (ctx.inputs - 3)


_fwd.register_autograd(_backward, setup_context=_setup_context)
_fwd_dropout.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(f"{NAMESPACE}::with_kvcache", mutates_args=("k_cache", "v_cache"))
def _with_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
    v: Optional[torch.Tensor], rotary_cos: Optional[torch.Tensor], rotary_sin: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor], cache_seqlens_int: Optional[int], cache_batch_idx: Optional[torch.Tensor],
    cache_leftpad: Optional[torch.Tensor], block_table: Optional[torch.Tensor], softmax_scale: Optional[float],
    causal: bool, window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
    alibi_slopes: Optional[torch.Tensor], num_splits: int, return_softmax_lse: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_with_kvcache`` (new keys and values written into the caches): (out, lse), lse
    empty unless ``return_softmax_lse``; ``cache_seqlens`` as a tensor or ``cache_seqlens_int``."""
    result = _module("_kvcache").flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
        cache_seqlens if cache_seqlens is not None else cache_seqlens_int, cache_batch_idx, cache_leftpad,
        block_table, softmax_scale, causal, (window_left, window_right), softcap, rotary_interleaved, alibi_slopes,
        num_splits, return_softmax_lse)
    out, lse = result if return_softmax_lse else (result, _no_lse(q))
    return _contiguous(out), _contiguous(lse)


@_with_kvcache.register_fake
def _with_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int,
                       cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_left, window_right,
                       softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, False), dtype=torch.float32) if return_softmax_lse \
        else _no_lse(q)


def with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                 return_softmax_lse):
    """``_kvcache.flash_attn_with_kvcache`` through its operator (its arguments and result; the
    checks run inside the operator, when the step runs). Raises what that function raises."""
    tensor_lens = isinstance(cache_seqlens, torch.Tensor)
    out, lse = _with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens if tensor_lens else None,
        None if tensor_lens or cache_seqlens is None else int(cache_seqlens), cache_batch_idx, cache_leftpad,
        block_table, None if softmax_scale is None else float(softmax_scale), bool(causal), int(window_size[0]),
        int(window_size[1]), float(softcap), bool(rotary_interleaved), alibi_slopes, int(num_splits),
        bool(return_softmax_lse))
    return (out, lse) if return_softmax_lse else out


@torch.library.custom_op(f"{NAMESPACE}::varlen_paged", mutates_args=())
def _varlen_paged(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, block_table: torch.Tensor,
    softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
    alibi_slopes: Optional[torch.Tensor], return_lse: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_varlen_func`` over paged caches (``block_table``), inference only: (out, lse),
    lse empty unless ``return_lse``. An operator because gathering the pages has a length read
    from ``cu_seqlens_k``, which a traced graph cannot hold."""
    result = sys.modules[__package__].flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
        causal=causal, window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        return_attn_probs=return_lse, block_table=block_table)
    out, lse = result[:2] if return_lse else (result, _no_lse(q))
    return _contiguous(out), _contiguous(lse)


@_varlen_paged.register_fake
def _varlen_paged_fake(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                       softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, return_lse):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, True), dtype=torch.float32) if return_lse else _no_lse(q)


def varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                 softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs):
    """``flash_attn_varlen_func`` with ``block_table``, no gradients, through its operator (the
    function's arguments and result). Raises what that function raises."""
    out, lse = _varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                             block_table, None if softmax_scale is None else float(softmax_scale), bool(causal),
                             int(window_size[0]), int(window_size[1]), float(softcap), alibi_slopes,
                             bool(return_attn_probs))
    return (out, lse, None) if return_attn_probs else out


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, alibi_slopes: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int], softmax_scale: float, causal: bool, window_size: Tuple[int, int], softcap: float,
    dropout_p: float, need_lse: bool, deterministic: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``_autograd.attention``'s kernel path through the operators (arguments checked there).

    Returns ``(out, lse)``; lse is None for an inference call that did not ask for it. Raises
    what the kernels raise."""
    train = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # 0 for an absent length: the operator learns it from cu_seqlens at run time
    args = (q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q or 0), int(max_seqlen_k or 0),
            float(softmax_scale), bool(causal), int(window_size[0]), int(window_size[1]), float(softcap))
    flags = (train, bool(need_lse), bool(deterministic))
    if dropout_p > 0.0:
        out, lse, _seed = _fwd_dropout(*args, float(dropout_p), *flags)
    else:
        out, lse = _fwd(*args, *flags)
    return out, (lse if train or need_lse else None)
