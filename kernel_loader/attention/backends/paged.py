"""Paged KV cache and the ``paged|<backend>`` attention functions.

A :class:`PagedKVCache` stores each layer's keys and values in fixed-size pages
(``[num_blocks, block_size, Hkv, D]``) handed out from a free list; ``block_table[b]`` lists the
pages of sequence ``b`` in order. A decoding step is::

    cache.begin_step(num_new_tokens)      # reserves pages
    ... every layer: attn(module, q, k, v, None, paged_cache=cache, layer_idx=i) ...
    cache.end_step()                      # the new tokens now count as cached

Each attention call writes the step's keys/values into the pages and attends causally (bottom-
right: the new tokens are the last ones of each sequence) over everything cached. The FlashAttention
variant does both in one ``flash_attn_with_kvcache`` call; eager and sdpa gather the pages into a
padded batch with a 4D mask.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from kernel_loader.attention.backends.contract import kv_groups, resolve_is_causal
from kernel_loader.attention.backends.eager import eager_attention_forward
from kernel_loader.attention.backends.flash_api import FlashKernel, call_options, first_output, flash_kernel
from kernel_loader.attention.backends.sdpa import sdpa_attention_forward
from kernel_loader.errors import UnsupportedAttentionOptionError

__all__ = ["PagedKVCache", "make_paged_attention", "paged_eager_attention_forward", "paged_sdpa_attention_forward"]


class PagedKVCache:
    """Per-layer paged key/value storage for a batch of sequences.

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> None:
        for label, n in (("num_layers", num_layers), ("batch_size", batch_size), ("num_blocks", num_blocks),
                         ("block_size", block_size), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if n < 1:
                raise ValueError(f"PagedKVCache: {label} must be >= 1, got {n}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_blocks = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_blocks = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # pages are handed out in a shuffled order when a generator is given, so tests see
        # non-contiguous page tables
        order = torch.randperm(num_blocks, generator=generator) if generator is not None else torch.arange(num_blocks)
        self._free: list[int] = order.tolist()[::-1]
        self._pages: list[list[int]] = [[] for _ in range(batch_size)]
        self.seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(batch_size, 0, dtype=torch.int32, device=device)
        self.step_tokens = 0

    @property
    def batch_size(self) -> int:
        return len(self._pages)

    def begin_step(self, num_new_tokens: int) -> None:
        """Reserve pages so every sequence can take ``num_new_tokens`` more tokens.

        Raises:
            MemoryError: the cache has too few free pages (raise ``num_blocks``).
        """
        self.step_tokens = int(num_new_tokens)
        for b, pages in enumerate(self._pages):
            needed = -(-(int(self.seqlens[b]) + self.step_tokens) // self.block_size)
            while len(pages) < needed:
                if not self._free:
                    raise MemoryError(
                        f"PagedKVCache is out of pages ({self.num_blocks} of {self.block_size} tokens); "
                        "create it with a larger num_blocks."
                    )
                pages.append(self._free.pop())
        width = max(len(p) for p in self._pages)
        table = torch.zeros(self.batch_size, width, dtype=torch.int32)
        for b, pages in enumerate(self._pages):
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.block_table = table.to(self.seqlens.device)

    def end_step(self) -> None:
        """Count the step's tokens as cached."""
        self.seqlens += self.step_tokens
        self.step_tokens = 0

    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[B, S_new, Hkv, D]`` after each sequence's cached tokens."""
        s_new = key.shape[1]
        pos = self.seqlens.long()[:, None] + torch.arange(s_new, device=self.seqlens.device)[None]
        pages = torch.gather(self.block_table.long(), 1, pos // self.block_size)
        slots = pos % self.block_size
        self.key_blocks[layer_idx][pages, slots] = key.to(self.key_blocks[layer_idx].dtype)
        self.value_blocks[layer_idx][pages, slots] = value.to(self.value_blocks[layer_idx].dtype)

    def gather(self, layer_idx: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` positions of every sequence as ``[B, Hkv, length, D]`` (pages read in order)."""
        pos = torch.arange(length, device=self.seqlens.device)[None].expand(self.batch_size, -1)
        width = self.block_table.shape[1]
        page_idx = (pos // self.block_size).clamp(max=max(width - 1, 0))
        pages = torch.gather(self.block_table.long(), 1, page_idx)
        slots = pos % self.block_size
        keys = self.key_blocks[layer_idx][pages, slots]
        values = self.value_blocks[layer_idx][pages, slots]
        return keys.transpose(1, 2), values.transpose(1, 2)


def _cache_from(kwargs: dict[str, Any], name: str) -> PagedKVCache:
    cache = kwargs.pop("paged_cache", None)
    if cache is None:
        cache = kwargs.get("cache")
    if not isinstance(cache, PagedKVCache):
        raise UnsupportedAttentionOptionError(
            f"attn_implementation={name!r} needs a PagedKVCache passed as paged_cache=...; got "
            f"{type(cache).__name__}. Use the name without 'paged|' for ordinary caches."
        )
    return cache


def _layer(module: Any, kwargs: dict[str, Any]) -> int:
    layer_idx = kwargs.pop("layer_idx", None)
    if layer_idx is None:
        layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise ValueError("paged attention needs layer_idx= (or module.layer_idx) to pick the cache layer")
    return int(layer_idx)


def _gathered_mask(cache: PagedKVCache, q_len: int, causal: bool, sliding_window: int | None) -> torch.Tensor:
    past = cache.seqlens.long()[:, None, None]
    total = past + q_len
    length = int(total.max())
    qpos = past + torch.arange(q_len, device=past.device)[None, :, None]
    kv = torch.arange(length, device=past.device)[None, None, :]
    mask = kv < total
    if causal:
        mask = mask & (kv <= qpos)
        if sliding_window is not None:
            mask = mask & (kv > qpos - sliding_window)
    elif sliding_window is not None:
        mask = mask & ((qpos - kv).abs() <= sliding_window)
    return mask[:, None]


def _paged_dense(base: Callable[..., Any], name: str) -> Callable[..., Any]:
    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        cache = _cache_from(kwargs, name)
        layer_idx = _layer(module, kwargs)
        q_len = query.shape[2]
        causal = resolve_is_causal(module, kwargs.pop("is_causal", None))
        sliding_window = kwargs.pop("sliding_window", None)
        cache.write(layer_idx, key.transpose(1, 2), value.transpose(1, 2))
        length = int(cache.seqlens.max()) + q_len
        keys, values = cache.gather(layer_idx, length)
        mask = _gathered_mask(cache, q_len, causal, sliding_window)
        for k in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cache"):
            kwargs.pop(k, None)
        return base(module, query, keys.to(query.dtype), values.to(query.dtype), mask, is_causal=causal, **kwargs)

    attention.__name__ = f"paged_{base.__name__}"
    return attention


paged_eager_attention_forward = _paged_dense(eager_attention_forward, "paged|eager")
paged_sdpa_attention_forward = _paged_dense(sdpa_attention_forward, "paged|sdpa")


def make_paged_attention(kernel: ModuleType | FlashKernel | Callable[[], ModuleType], name: str = "paged|flash") -> Callable[..., Any]:
    """A paged attention function over a FlashAttention kernel's ``flash_attn_with_kvcache``.

    ``kernel`` may be a module, a :class:`FlashKernel`, or a zero-argument callable returning the
    module (resolved on first call, e.g. the FlashAttention fallback chain).

    Raises (when called):
        UnsupportedAttentionOptionError: no ``PagedKVCache`` given, the kernel has no
            ``flash_attn_with_kvcache``, or an option the kernel does not accept.
    """
    resolved: list[FlashKernel] = []

    def get_kernel() -> FlashKernel:
        if not resolved:
            k = kernel if isinstance(kernel, (ModuleType, FlashKernel)) else kernel()
            resolved.append(flash_kernel(k))
        return resolved[0]

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        fk = get_kernel()
        if fk.kvcache is None:
            raise UnsupportedAttentionOptionError(
                f"{name!r}: kernel {fk.name!r} has no flash_attn_with_kvcache, so it cannot read a paged cache. "
                "Use 'paged|sdpa' or a kernel with the full FlashAttention API."
            )
        cache = _cache_from(kwargs, name)
        layer_idx = _layer(module, kwargs)
        kv_groups(query, key)
        causal = resolve_is_causal(module, kwargs.get("is_causal"))
        q_len = query.shape[2]
        opts = call_options(
            fk.kvcache_params,
            fk.name,
            causal=causal,
            kv_length=int(cache.seqlens.max()) + q_len,
            dropout=0.0,
            scaling=kwargs.get("scaling"),
            sliding_window=kwargs.get("sliding_window"),
            softcap=kwargs.get("softcap"),
            s_aux=kwargs.get("s_aux"),
            deterministic=None,
        )
        opts.pop("dropout_p", None)
        # FlashAttention 3 (flash_attn_interface, vllm-flash-attn3) calls the block table page_table
        table_arg = "page_table" if "page_table" in fk.kvcache_params and "block_table" not in fk.kvcache_params \
            else "block_table"
        opts[table_arg] = cache.block_table
        kc, vc = cache.key_blocks[layer_idx], cache.value_blocks[layer_idx]
        out = first_output(
            fk.kvcache(
                query.transpose(1, 2),
                kc,
                vc,
                k=key.transpose(1, 2).to(kc.dtype).contiguous(),
                v=value.transpose(1, 2).to(vc.dtype).contiguous(),
                cache_seqlens=cache.seqlens,
                **opts,
            )
        )
        return out.contiguous(), None

    attention.__name__ = "paged_flash_attention_forward"
    return attention
