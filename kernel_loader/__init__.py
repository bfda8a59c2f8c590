"""kernel_loader: fetch, check and load compute kernels by id, and use them as attention backends.

The public names are listed in ``_EXPORTS`` and imported on first use, so ``import kernel_loader``
stays cheap (it does not import torch or huggingface_hub until a function needs them).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # loader core
    "get_kernel": "kernel_loader.loader",
    "get_local_kernel": "kernel_loader.loader",
    "has_kernel": "kernel_loader.loader",
    "load_kernel": "kernel_loader.loader",
    "resolve_kernel": "kernel_loader.loader",
    "KernelRef": "kernel_loader.refs",
    "Resolution": "kernel_loader.resolution",
    "VariantDecision": "kernel_loader.resolution",
    "Machine": "kernel_loader.machine",
    "detect_machine": "kernel_loader.machine",
    # errors
    "KernelLoaderError": "kernel_loader.errors",
    "InvalidKernelRefError": "kernel_loader.errors",
    "InvalidArgumentError": "kernel_loader.errors",
    "KernelFunctionNotFoundError": "kernel_loader.errors",
    "CacheError": "kernel_loader.errors",
    "KernelNotFoundError": "kernel_loader.errors",
    "OfflineKernelMissingError": "kernel_loader.errors",
    "NoCompatibleVariantError": "kernel_loader.errors",
    "KernelIntegrityError": "kernel_loader.errors",
    "UntrustedKernelError": "kernel_loader.errors",
    "MissingDependencyError": "kernel_loader.errors",
    "KernelImportError": "kernel_loader.errors",
    "LockfileError": "kernel_loader.errors",
    "UnusableKernelError": "kernel_loader.errors",
    "CacheNotWritableError": "kernel_loader.errors",
    "CacheFullError": "kernel_loader.errors",
    "CacheLockError": "kernel_loader.errors",
    "KernelDownloadError": "kernel_loader.errors",
    "SettingError": "kernel_loader.errors",
    # attention registry
    "AttentionInterface": "kernel_loader.attention",
    "AttentionMaskInterface": "kernel_loader.attention",
    "ALL_ATTENTION_FUNCTIONS": "kernel_loader.attention",
    "ALL_MASK_ATTENTION_FUNCTIONS": "kernel_loader.attention",
    "create_causal_mask": "kernel_loader.attention",
    "create_sliding_window_causal_mask": "kernel_loader.attention",
    "create_chunked_causal_mask": "kernel_loader.attention",
    "create_bidirectional_mask": "kernel_loader.attention",
    "register_kernel_backend": "kernel_loader.attention",
    "explain_chain": "kernel_loader.attention",
    "PagedKVCache": "kernel_loader.attention",
    # import flash_attn without the flash-attn package
    "install_flash_attn": "kernel_loader.flash_attn_compat",
    "uninstall_flash_attn": "kernel_loader.flash_attn_compat",
    "UnknownAttentionBackendError": "kernel_loader.errors",
    "UnsupportedAttentionOptionError": "kernel_loader.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kernel_loader' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return __all__
