"""Kernel ids as attention backends: ``"org/repo[@rev][:fn]"`` and ``"paged|org/repo"``.

Looking such a name up in ``AttentionInterface`` or ``AttentionMaskInterface`` loads the kernel
through the loader and registers, under that exact string, an attention function and its mask
formatter:

* ``:fn`` given -> ``kernel.fn`` itself (it must follow transformers' attention-function contract);
  its mask format comes from ``fn.mask_format`` / ``kernel.ATTENTION_MASK_FORMAT`` (``"sdpa"``,
  ``"eager"``, ``"flash"`` or ``"flex"``), default ``"sdpa"`` (a 4D bool mask). ``:fn`` naming a
  raw FlashAttention entry point (``flash_attn_varlen_func``...) gets the FlashAttention wrapper.
* otherwise a kernel with ``flash_attn_varlen_func`` -> the FlashAttention wrapper and the 2D
  padding mask (``flash_attention_mask``).
* ``paged|`` -> the paged FlashAttention function over ``flash_attn_with_kvcache``.

Anything else raises :class:`UnusableKernelError` naming what was looked for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kernel_loader.attention.backends.flash import make_flash_attention
from kernel_loader.attention.backends.flash_api import FLASH_API
from kernel_loader.attention.backends.paged import make_paged_attention
from kernel_loader.attention.mask_formatters import (
    eager_mask,
    flash_attention_mask,
    flex_attention_mask,
    paged_attention_mask,
    sdpa_mask,
)
from kernel_loader.attention.registry import AttentionInterface, AttentionMaskInterface
from kernel_loader.errors import InvalidKernelRefError, UnusableKernelError
from kernel_loader.refs import KernelRef, looks_like_kernel_ref

__all__ = [
    "KernelBackend",
    "register_kernel_backend",
    "register_kernel_name",
    "kernel_attention_function",
    "registered_kernel_backends",
    "MASK_FORMATS",
]

MASK_FORMATS: dict[str, Callable[..., Any]] = {
    "sdpa": sdpa_mask,
    "eager": eager_mask,
    "flash": flash_attention_mask,
    "flex": flex_attention_mask,
}
_WRAPPERS = (None, "paged")


@dataclass(frozen=True)
class KernelBackend:
    """What a kernel id registered: the name, the module, the function and the mask formatter."""

    name: str
    kernel: ModuleType
    attention: Callable[..., Any]
    mask_formatter: Callable[..., Any]
    description: str


_registered: dict[str, KernelBackend] = {}
_lock = threading.RLock()


def _mask_format(fn: Any, kernel: ModuleType, name: str) -> Callable[..., Any]:
    fmt = getattr(fn, "mask_format", None) or getattr(kernel, "ATTENTION_MASK_FORMAT", None) or "sdpa"
    if fmt not in MASK_FORMATS:
        raise UnusableKernelError(
            f"{name}: mask format {fmt!r} is not one of {', '.join(MASK_FORMATS)} (set by the kernel's "
            "mask_format / ATTENTION_MASK_FORMAT)."
        )
    return MASK_FORMATS[fmt]


def kernel_attention_function(name: str, kernel: ModuleType, function: str | None, wrapper: str | None) -> KernelBackend:
    """Pick the attention function and mask formatter for a loaded kernel (nothing is registered).

    Raises:
        UnusableKernelError: the kernel lacks the named function, or exports no FlashAttention API
            and no function was named.
    """
    if wrapper == "paged":
        if getattr(kernel, "flash_attn_with_kvcache", None) is None or getattr(kernel, "flash_attn_varlen_func", None) is None:
            raise UnusableKernelError(
                f"{name}: a 'paged|' backend needs flash_attn_with_kvcache and flash_attn_varlen_func, and "
                f"{kernel.__name__} lacks them. Drop 'paged|' or use a kernel with the FlashAttention API."
            )
        return KernelBackend(name, kernel, make_paged_attention(kernel, name), paged_attention_mask,
                             "paged FlashAttention over flash_attn_with_kvcache")
    if function is not None:
        fn = getattr(kernel, function, None)
        if fn is None or not callable(fn):
            public = sorted(n for n in dir(kernel) if not n.startswith("_") and callable(getattr(kernel, n, None)))
            raise UnusableKernelError(
                f"{name}: the kernel has no function {function!r}. It exports: {', '.join(public) or 'nothing callable'}."
            )
        if function in FLASH_API:
            return KernelBackend(name, kernel, make_flash_attention(kernel, name), flash_attention_mask,
                                 "FlashAttention wrapper")
        return KernelBackend(name, kernel, fn, _mask_format(fn, kernel, name), f"{kernel.__name__}.{function}")
    if getattr(kernel, "flash_attn_varlen_func", None) is not None:
        return KernelBackend(name, kernel, make_flash_attention(kernel, name), flash_attention_mask,
                             "FlashAttention wrapper")
    raise UnusableKernelError(
        f"{name}: the kernel exports nothing usable as attention. Looked for flash_attn_varlen_func (the "
        "FlashAttention API); name a function that follows the attention-function contract with "
        f"'{name}:<function>' instead."
    )


def register_kernel_backend(name: str | KernelRef, **loader_kwargs: Any) -> KernelBackend:
    """Load the kernel ``name`` refers to and register it in both attention registries (globally).

    ``name`` is a kernel id or the :class:`KernelRef` parsed from one (then it is not parsed
    again); the registered name is ``str(ref)``. ``loader_kwargs`` go to
    :func:`kernel_loader.loader.get_kernel` (``trust_remote_code``, ``local_files_only``,
    ``backend``...). Registering the same name twice returns the first result.

    Raises:
        InvalidKernelRefError: ``name`` is not a kernel id, or has an unknown ``wrapper|`` prefix.
        KernelNotFoundError, NoCompatibleVariantError, UntrustedKernelError, ...: loading failed.
        UnusableKernelError: the kernel exports nothing usable as attention.
    """
    from kernel_loader.loader import get_kernel

    text = str(name)
    with _lock:
        if text in _registered:
            return _registered[text]
        ref = name if isinstance(name, KernelRef) else KernelRef.parse(name)
        if ref.wrapper not in _WRAPPERS:
            raise InvalidKernelRefError(
                f"{text!r}: unknown prefix {ref.wrapper + '|'!r}; the only attention wrapper is 'paged|'."
            )
        kernel = get_kernel(ref.repo_id, ref.revision, **loader_kwargs)
        backend = kernel_attention_function(text, kernel, ref.function, ref.wrapper)
        AttentionInterface.register(text, backend.attention)
        AttentionMaskInterface.register(text, backend.mask_formatter)
        _registered[text] = backend
        return backend


def register_kernel_name(name: str) -> bool:
    """The registries' name resolver: register ``name`` when it is a kernel id (see registry).

    Returns False for names of another shape (``"sdpa"``, a typo), so the registry can say they
    are unknown.

    Raises:
        InvalidKernelRefError, KernelNotFoundError, UnusableKernelError, ...: as
            :func:`register_kernel_backend`, for a name that looks like a kernel id.
    """
    if not looks_like_kernel_ref(name):
        return False
    register_kernel_backend(name)
    return True


def registered_kernel_backends() -> dict[str, KernelBackend]:
    """Kernel ids registered so far in this process."""
    return dict(_registered)
