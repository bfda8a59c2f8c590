"""Attention backends by name: registries, masks, FlashAttention kernels and their fallback.

    from kernel_loader.attention import ALL_ATTENTION_FUNCTIONS, create_causal_mask

    mask = create_causal_mask(config, hidden_states, attention_mask)      # per config._attn_implementation
    attn = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation)
    out, weights = attn(module, q, k, v, mask, scaling=..., sliding_window=...)

Names: ``eager``, ``sdpa``, ``flex_attention``, ``flash_attention_2``, ``flash_attention_3``,
``paged|eager``, ``paged|sdpa``, ``paged|flash_attention_2``, ``paged|flash_attention_3``, any
name you register, and kernel ids (``"kernels-community/flash-attn2"``, ``"org/repo@v1:fn"``,
``"paged|org/repo"``) which are loaded and registered on first lookup.

Layers, each importing only the ones before it (``tests/attention/test_layers.py`` checks it):
``mask_functions`` (predicates) -> ``registry`` (name -> function maps) -> ``mask_builders``
(``create_*_mask``) -> ``mask_equivalence`` (is a predicate what a kernel computes?) ->
``mask_formatters`` (a pattern in each backend's format) -> ``backends/``
(``contract``, ``flash_api``; ``eager``, ``sdpa``, ``flex``, ``flash``; ``paged``) ->
``kernel_backends`` (kernel ids as backends) -> ``fallback`` (the FlashAttention chain) -> this
module, which registers the built-ins and installs the kernel-id resolver into the registry.
"""

from __future__ import annotations

from kernel_loader.attention import registry
from kernel_loader.attention.backends.contract import implicit_mask, kv_groups, repeat_kv, resolve_is_causal
from kernel_loader.attention.backends.eager import eager_attention_forward
from kernel_loader.attention.backends.flash import flash_attention_forward, make_flash_attention
from kernel_loader.attention.backends.flex import flex_attention_forward
from kernel_loader.attention.backends.paged import (
    PagedKVCache,
    make_paged_attention,
    paged_eager_attention_forward,
    paged_sdpa_attention_forward,
)
from kernel_loader.attention.backends.sdpa import sdpa_attention_forward
from kernel_loader.attention.fallback import (
    FallbackOutcome,
    FallbackStep,
    chain_attention,
    explain_chain,
    flash_chain_kernel,
    reset_fallback_cache,
    resolve_flash_chain,
)
from kernel_loader.attention.kernel_backends import KernelBackend, register_kernel_backend, register_kernel_name
from kernel_loader.attention.mask_formatters import (
    BUILTIN_MASK_FORMATTERS,
    eager_mask,
    flash_attention_mask,
    flex_attention_mask,
    materialize_mask,
    paged_attention_mask,
    sdpa_mask,
)
from kernel_loader.attention.mask_builders import (
    MaskOptions,
    create_bidirectional_mask,
    create_bidirectional_sliding_window_mask,
    create_causal_mask,
    create_chunked_causal_mask,
    create_masks_for_generate,
    create_recurrent_attention_mask,
    create_sliding_window_causal_mask,
)
from kernel_loader.attention.mask_functions import (
    add_offsets_to_mask_function,
    and_masks,
    bidirectional_mask_function,
    blockwise_overlay,
    causal_mask_function,
    chunked_causal_mask_function,
    chunked_overlay,
    find_packed_sequence_indices,
    or_masks,
    packed_sequence_mask_function,
    padding_mask_function,
    sliding_window_bidirectional_mask_function,
    sliding_window_bidirectional_overlay,
    sliding_window_causal_mask_function,
    sliding_window_overlay,
)
from kernel_loader.attention.registry import (
    ALL_ATTENTION_FUNCTIONS,
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionInterface,
    AttentionMaskInterface,
)

BUILTIN_ATTENTION_FUNCTIONS = {
    "eager": eager_attention_forward,
    "sdpa": sdpa_attention_forward,
    "flex_attention": flex_attention_forward,
    "flash_attention_2": chain_attention("flash_attention_2"),
    "flash_attention_3": chain_attention("flash_attention_3"),
    "paged|eager": paged_eager_attention_forward,
    "paged|sdpa": paged_sdpa_attention_forward,
    "paged|flash_attention_2": make_paged_attention(lambda: flash_chain_kernel("flash_attention_2"), "paged|flash_attention_2"),
    "paged|flash_attention_3": make_paged_attention(lambda: flash_chain_kernel("flash_attention_3"), "paged|flash_attention_3"),
}

for _name, _fn in BUILTIN_ATTENTION_FUNCTIONS.items():
    AttentionInterface.register(_name, _fn)
for _name, _fmt in BUILTIN_MASK_FORMATTERS.items():
    AttentionMaskInterface.register(_name, _fmt)
del _name, _fn, _fmt
# Kernel ids become backends on first lookup; the registry itself knows nothing of kernels.
registry.install_name_resolver(register_kernel_name)

__all__ = [
    "ALL_ATTENTION_FUNCTIONS",
    "ALL_MASK_ATTENTION_FUNCTIONS",
    "AttentionInterface",
    "AttentionMaskInterface",
    "BUILTIN_ATTENTION_FUNCTIONS",
    "BUILTIN_MASK_FORMATTERS",
    "FallbackOutcome",
    "FallbackStep",
    "KernelBackend",
    "MaskOptions",
    "PagedKVCache",
    "add_offsets_to_mask_function",
    "and_masks",
    "bidirectional_mask_function",
    "blockwise_overlay",
    "causal_mask_function",
    "chunked_causal_mask_function",
    "chunked_overlay",
    "create_bidirectional_mask",
    "create_bidirectional_sliding_window_mask",
    "create_causal_mask",
    "create_chunked_causal_mask",
    "create_masks_for_generate",
    "create_recurrent_attention_mask",
    "create_sliding_window_causal_mask",
    "eager_attention_forward",
    "eager_mask",
    "explain_chain",
    "find_packed_sequence_indices",
    "flash_attention_forward",
    "flash_attention_mask",
    "flash_chain_kernel",
    "flex_attention_forward",
    "flex_attention_mask",
    "implicit_mask",
    "kv_groups",
    "make_flash_attention",
    "make_paged_attention",
    "materialize_mask",
    "or_masks",
    "packed_sequence_mask_function",
    "padding_mask_function",
    "paged_attention_mask",
    "paged_eager_attention_forward",
    "paged_sdpa_attention_forward",
    "register_kernel_backend",
    "repeat_kv",
    "reset_fallback_cache",
    "resolve_flash_chain",
    "resolve_is_causal",
    "sdpa_attention_forward",
    "sdpa_mask",
    "sliding_window_bidirectional_mask_function",
    "sliding_window_bidirectional_overlay",
    "sliding_window_causal_mask_function",
    "sliding_window_overlay",
]
