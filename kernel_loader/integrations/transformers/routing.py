"""Routing: which attention names the bridge handles, and what each becomes in transformers.

A kernel id is parsed once, here, into a :class:`~kernel_loader.refs.KernelRef` that travels to
``kernel_backends`` and the loader. ``flash_attention_2`` / ``flash_attention_3`` are handled only
when transformers' own check says the FlashAttention package is not usable; they become the kernel
id the FlashAttention fallback chain chose. Each name's attention function and mask formatter are
registered in transformers' ``ALL_ATTENTION_FUNCTIONS`` / ``ALL_MASK_ATTENTION_FUNCTIONS``, and what
they replaced is kept in :class:`BridgeState` so that ``disable()`` can put it back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kernel_loader.integrations.transformers.mask_labels import adapt_mask_formatter, describer_for
from kernel_loader.refs import KernelRef, looks_like_kernel_ref

logger = logging.getLogger(__name__)

__all__ = ["BridgeState", "MISSING", "route", "route_subconfigs", "rewrite_request", "restore_registries"]

FLASH_NAMES = ("flash_attention_2", "flash_attention_3")
MISSING = object()


@dataclass
class BridgeState:
    """What an enabled bridge did: the patches, the registry entries it replaced, its routes."""

    version: str
    flavor: str  # "4.57" (mask formatters take cache_position) or "5" (q_length / q_offset)
    patches: list[Any] = field(default_factory=list)
    # (registry global mapping, name) -> what was there before the bridge registered the name
    saved_entries: dict[tuple[int, str], tuple[dict, Any]] = field(default_factory=dict)
    # name asked for -> name registered in transformers (differs for the FlashAttention fallback)
    routes: dict[str, str] = field(default_factory=dict)
    flash_kernels: set[str] = field(default_factory=set)


def restore_registries(state: BridgeState) -> None:
    """Put back every transformers registry entry the bridge added or replaced."""
    for (_, name), (mapping, previous) in state.saved_entries.items():
        if previous is MISSING:
            mapping.pop(name, None)
        else:
            mapping[name] = previous


def _split_wrapper(name: str) -> tuple[str | None, str]:
    if "|" in name:
        wrapper, base = name.split("|", 1)
        return wrapper, base
    return None, name


def _flash_package_usable(name: str) -> bool:
    """transformers' own verdict on the ``flash_attn`` / ``flash_attn_interface`` package."""
    from transformers.utils import import_utils

    check = import_utils.is_flash_attn_2_available if name.endswith("2") else import_utils.is_flash_attn_3_available
    try:
        return bool(check())
    except Exception:
        return False


def _supports_flash(model: Any) -> bool:
    return bool(getattr(model, "_supports_flash_attn", False) or getattr(model, "_supports_flash_attn_2", False))


def _put(state: BridgeState, registry: Any, name: str, value: Callable[..., Any]) -> None:
    mapping = registry._global_mapping
    key = (id(mapping), name)
    if key not in state.saved_entries:
        state.saved_entries[key] = (mapping, mapping.get(name, MISSING))
    # Class-level registration, as transformers' own ``register`` does: every instance sees it.
    mapping[name] = value


def _register_in_transformers(
    state: BridgeState, name: str, attention: Callable[..., Any], mask: Callable[..., Any]
) -> None:
    import transformers.masking_utils as masking_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _put(state, ALL_ATTENTION_FUNCTIONS, name, attention)
    formatter = adapt_mask_formatter(mask, describer_for(masking_utils), state.flavor)
    _put(state, masking_utils.ALL_MASK_ATTENTION_FUNCTIONS, name, formatter)


def _kernel_loader_backend(ref: KernelRef, trust: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """kernel_loader's attention function and mask formatter for ``ref`` (loaded if need be)."""
    from kernel_loader.attention import ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS, kernel_backends

    name = str(ref)
    if name not in ALL_ATTENTION_FUNCTIONS:
        # transformers' allow_all_kernels=True is the user's consent to run code from any org.
        kernel_backends.register_kernel_backend(ref, **({"trust_remote_code": True} if trust else {}))
    return ALL_ATTENTION_FUNCTIONS[name], ALL_MASK_ATTENTION_FUNCTIONS[name]


def _load_kernel_backend(state: BridgeState, ref: KernelRef, trust: bool) -> str:
    """Load the kernel ``ref`` names through kernel_loader and register it in transformers.

    Raises:
        KernelNotFoundError, NoCompatibleVariantError, UntrustedKernelError, UnusableKernelError,
        ...: the kernel cannot be had or used (see the loader's errors).
    """
    from kernel_loader.attention.mask_formatters import flash_attention_mask

    name = str(ref)
    attention, mask = _kernel_loader_backend(ref, trust)
    _register_in_transformers(state, name, attention, mask)
    if mask is flash_attention_mask:
        state.flash_kernels.add(name)
    state.routes[name] = name
    return name


def _flash_fallback(state: BridgeState, requested: str, trust: bool) -> str | None:
    """Resolve ``flash_attention_2`` / ``flash_attention_3`` (package unusable) to a kernel.

    Walks kernel_loader's fallback chain (Hub kernel, then the shipped copy) and returns the
    kernel id now registered in transformers -- what the model's config will hold, as when the
    ``kernels`` package provides transformers' fallback. None when the chain picked the
    FlashAttention package itself (transformers then uses it natively).

    Raises:
        KernelNotFoundError: no option of the chain is usable here (the message holds every reason).
    """
    from kernel_loader.attention import fallback, make_flash_attention
    from kernel_loader.attention.mask_formatters import flash_attention_mask

    wrapper, base = _split_wrapper(requested)
    module = fallback.flash_chain_kernel(base)
    resolution = getattr(module, "__kernel_resolution__", None)
    repo_id = getattr(resolution, "repo_id", None)
    if repo_id is None:
        return None  # the flash_attn / flash_attn_interface package: transformers' own path
    if wrapper is None:
        name = repo_id
        attention, mask = make_flash_attention(module, name), flash_attention_mask
    else:
        name = f"{wrapper}|{repo_id}"
        attention, mask = _kernel_loader_backend(KernelRef.parse(name), trust)
    _register_in_transformers(state, name, attention, mask)
    state.flash_kernels.add(name)
    if state.routes.get(requested) != name:
        # kernel_loader's fallback chain already warned about its choice; this records the name.
        logger.info(
            "attn_implementation=%r: the %s package is not usable here, so transformers will use %s (source: %s) "
            "through kernel_loader. `kernel-loader explain %s` shows the whole fallback chain.",
            requested,
            "flash_attn" if base.endswith("2") else "flash_attn_interface",
            name,
            getattr(resolution, "source", "?"),
            base,
        )
    state.routes[requested] = name
    return name


def route(state: BridgeState, model: Any, requested: Any, trust: bool) -> str | None:
    """The name to use instead of ``requested`` when the bridge handles it; None otherwise.

    ``model`` is None when the name is meant for a sub-config whose model is not known yet; the
    model's own check runs when it is built.

    Raises:
        InvalidKernelRefError: ``requested`` looks like a kernel id but is malformed (before
            anything is fetched).
        ValueError: ``model`` does not support FlashAttention and the kernel is a FlashAttention
            kernel (transformers' own rule).
        KernelLoaderError: the kernel cannot be loaded (see the loader's errors).
    """
    if not isinstance(requested, str):
        return None
    wrapper, base = _split_wrapper(requested)
    compatible = getattr(model, "_compatible_flash_implementations", None) if model is not None else None
    if compatible and "flash" in base and base not in compatible:
        # transformers 5.x rule: a model that lists the FlashAttention kernels it works with gets
        # the first of them instead of another flash implementation.
        logger.warning("%s works with %s only; using %s instead of %s.", type(model).__name__, compatible, compatible[0], base)
        base = compatible[0]
        requested = base if wrapper is None else f"{wrapper}|{base}"
        trust = True  # listed by the model's authors, as transformers treats it
    if base in FLASH_NAMES:
        if _flash_package_usable(base):
            return None  # the real package is there: transformers uses it natively
        if model is not None and not _supports_flash(model):
            return None  # transformers raises its own, precise error for this model
        return _flash_fallback(state, requested, trust)
    if not looks_like_kernel_ref(requested):
        return None
    name = _load_kernel_backend(state, KernelRef.parse(requested), trust)
    if model is not None and name in state.flash_kernels and not _supports_flash(model):
        raise ValueError(
            f"{type(model).__name__} does not support FlashAttention, so it cannot use the FlashAttention kernel "
            f"{requested!r}. Use attn_implementation='sdpa' or 'eager' for this model."
        )
    return name


def route_subconfigs(state: BridgeState, config: Any, trust: bool, seen: set[int] | None = None) -> None:
    """Resolve kernel ids held by sub-configs (per-backbone dict form) before sub-models use them.

    Sub-models that are ``PreTrainedModel``s run the wrapped check themselves; this also covers
    backbones built as plain modules, whose name transformers never checks.
    """
    seen = set() if seen is None else seen
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is None or id(sub) in seen:
            continue
        seen.add(id(sub))
        routed = route(state, None, getattr(sub, "_attn_implementation", None), trust)
        if routed is not None:
            sub._attn_implementation_internal = routed
        route_subconfigs(state, sub, trust, seen)


def rewrite_request(state: BridgeState, request: Any, trust: bool, top: bool = True) -> Any:
    """The ``set_attn_implementation`` argument with every sub-config's kernel id registered.

    Dict values for sub-configs are replaced by the name the bridge registered (transformers
    checks them against its registry without loading anything); the top-level value is left to
    the wrapped check, which knows the model.
    """
    if isinstance(request, Mapping):
        rewritten = {}
        for key, value in request.items():
            if key == "" and top:
                rewritten[key] = value
            else:
                rewritten[key] = rewrite_request(state, value, trust, top=False)
        return rewritten
    if top:
        return request
    routed = route(state, None, request, trust)
    return request if routed is None else routed
