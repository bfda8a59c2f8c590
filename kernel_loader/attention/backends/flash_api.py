"""The FlashAttention API of a kernel module: its entry points, the options they take, their calls.

Shared by the FlashAttention backend (``flash``) and the paged one (``paged``). A kernel module
(the ``flash_attn`` package, ``flash_attn_interface``, a Hub kernel, our shipped kernel) is
described once (:func:`flash_kernel`); :func:`call_options` builds the keyword arguments of one
call and refuses an option the kernel's function does not take instead of dropping it.

Speed: the description and the options are cached in three levels (``flash_kernel``,
``_static_options``, ``shared_options``); docs/attention.md, "What is there for speed", says why.
The values never differ from computing them afresh.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from kernel_loader.errors import UnsupportedAttentionOptionError, UnusableKernelError

__all__ = [
    "FLASH_API",
    "DECODE_HEADS_FIRST",
    "FlashKernel",
    "flash_kernel",
    "call_options",
    "shared_options",
    "window_size",
    "first_output",
]

FLASH_API = ("flash_attn_varlen_func", "flash_attn_func", "flash_attn_with_kvcache")
# Optional extension (our shipped kernel has it): a decode step on transformers' [B, H, S, D]
# tensors, returning None when it does not serve the call. See _forward.
DECODE_HEADS_FIRST = "flash_attn_decode_heads_first"
# packages that run only on CUDA in half precision; Hub and shipped kernels say what they need
_CUDA_HALF_ONLY = {"flash_attn", "flash_attn_interface"}


def _params(fn: Callable[..., Any] | None) -> frozenset[str]:
    if fn is None:
        return frozenset()
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # compiled functions without a signature: assume the reference API
        return frozenset(
            {"dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic"}
        )


@dataclass(frozen=True)
class FlashKernel:
    """The FlashAttention entry points of a kernel module and the options each accepts."""

    name: str
    func: Callable[..., Any] | None
    varlen: Callable[..., Any]
    kvcache: Callable[..., Any] | None
    func_params: frozenset[str] = field(default_factory=frozenset)
    varlen_params: frozenset[str] = field(default_factory=frozenset)
    kvcache_params: frozenset[str] = field(default_factory=frozenset)
    cuda_half_only: bool = False
    decode_heads_first: Callable[..., Any] | None = None


@functools.lru_cache(maxsize=64)
def _describe(kernel: ModuleType) -> FlashKernel:
    varlen = getattr(kernel, "flash_attn_varlen_func", None)
    if varlen is None:
        raise UnusableKernelError(
            f"Kernel module {getattr(kernel, '__name__', kernel)!r} has no flash_attn_varlen_func, so it cannot "
            f"back a FlashAttention backend (looked for {', '.join(FLASH_API)}). Pick a kernel with the "
            "FlashAttention API, e.g. 'kernels-community/flash-attn2', or name a function with 'org/repo:fn'."
        )
    func = getattr(kernel, "flash_attn_func", None)
    kvcache = getattr(kernel, "flash_attn_with_kvcache", None)
    top = getattr(kernel, "__name__", "").split(".")[0]
    return FlashKernel(
        name=getattr(kernel, "__name__", repr(kernel)),
        func=func,
        varlen=varlen,
        kvcache=kvcache,
        func_params=_params(func),
        varlen_params=_params(varlen),
        kvcache_params=_params(kvcache),
        cuda_half_only=top in _CUDA_HALF_ONLY,
        decode_heads_first=getattr(kernel, DECODE_HEADS_FIRST, None),
    )


def flash_kernel(kernel: ModuleType | FlashKernel) -> FlashKernel:
    """Describe ``kernel``'s FlashAttention entry points (cached per module).

    Raises:
        UnusableKernelError: the module has no ``flash_attn_varlen_func``.
    """
    return kernel if isinstance(kernel, FlashKernel) else _describe(kernel)


# ------------------------------------------------------------------------------------------
# options
# ------------------------------------------------------------------------------------------


def call_options(
    params: frozenset[str],
    kernel_name: str,
    *,
    causal: bool,
    kv_length: int,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    s_aux: torch.Tensor | None,
    deterministic: bool | None,
) -> dict[str, Any]:
    """The keyword arguments of a FlashAttention call (a fresh dict the caller may change).

    Raises:
        UnsupportedAttentionOptionError: the kernel's function does not take a needed option.
    """
    opts = dict(shared_options(params, kernel_name, causal, kv_length, dropout, scaling, sliding_window, softcap,
                                deterministic))
    if s_aux is not None:
        if "s_aux" in params:
            opts["s_aux"] = s_aux
        elif "learnable_sink" in params:
            opts["learnable_sink"] = s_aux
        else:
            raise _refuse(kernel_name, "attention sinks (s_aux)")
    return opts


def shared_options(
    params: frozenset[str], kernel_name: str, causal: bool, kv_length: int, dropout: float, scaling: float | None,
    sliding_window: int | None, softcap: float | None, deterministic: bool | None,
) -> dict[str, Any]:
    """The options without attention sinks, from the per-combination cache: unpack, never change."""
    window = sliding_window if sliding_window is not None and kv_length > sliding_window else None
    if torch.compiler.is_compiling():  # traced: the cache's wrapper means nothing to the compiler, which warns
        return _static_options.__wrapped__(params, kernel_name, causal, dropout, scaling, window, softcap,
                                           deterministic)
    return _static_options(params, kernel_name, causal, dropout, scaling, window, softcap, deterministic)


def window_size(window: int, causal: bool) -> tuple[int, int]:
    """FlashAttention's ``window_size=(left, right)`` for a transformers ``sliding_window``."""
    # mask_functions.sliding_window_overlay: causal sees q-kv < w; bidirectional sees |q-kv| <= w
    left = window - 1 if causal else window
    return (left, left)


def _refuse(kernel_name: str, option: str) -> UnsupportedAttentionOptionError:
    return UnsupportedAttentionOptionError(
        f"FlashAttention kernel {kernel_name!r} does not accept {option}, so it cannot be applied. Use "
        "'eager' or 'sdpa', or a kernel that supports it (e.g. 'kernels-community/flash-attn2')."
    )


# Every layer of a model asks for the same options on every call: computed once per combination
# (the decode loop is bound by host time). Callers copy or unpack the dict, never change it.
@functools.lru_cache(maxsize=256)
def _static_options(
    params: frozenset[str],
    kernel_name: str,
    causal: bool,
    dropout: float,
    scaling: float | None,
    window: int | None,
    softcap: float | None,
    deterministic: bool | None,
) -> dict[str, Any]:
    opts: dict[str, Any] = {"causal": causal, "softmax_scale": scaling}
    if dropout:
        if "dropout_p" not in params:
            raise _refuse(kernel_name, f"dropout={dropout}")
        opts["dropout_p"] = dropout
    elif "dropout_p" in params:
        opts["dropout_p"] = 0.0
    if window is not None:
        if "window_size" not in params:
            raise _refuse(kernel_name, f"sliding_window={window}")
        opts["window_size"] = window_size(window, causal)
    if softcap is not None and softcap != 0.0:
        if "softcap" not in params:
            raise _refuse(kernel_name, f"softcap={softcap}")
        opts["softcap"] = softcap
    if deterministic is not None and "deterministic" in params:
        opts["deterministic"] = deterministic
    return opts


def first_output(out: Any) -> torch.Tensor:
    """The attention output of a FlashAttention call (some return ``(out, lse, ...)``)."""
    return out[0] if isinstance(out, (tuple, list)) else out
