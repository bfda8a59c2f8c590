"""Paged KV cache: prefill then decode steps through paged|eager, paged|sdpa and the paged flash
function over the shipped kernel, against full attention over the whole sequence."""

from __future__ import annotations

import warnings

import pytest
import torch

from kernel_loader.attention import ALL_ATTENTION_FUNCTIONS, PagedKVCache, make_paged_attention
from kernel_loader.errors import UnsupportedAttentionOptionError

from ..conftest import make_case, module, reference_attention


@pytest.fixture(scope="module")
def shipped():
    from kernel_loader.loader import get_bundled_kernel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_bundled_kernel("kernels-community/flash-attn2")


def _run_steps(fn, case, steps, window=None, layers=2):
    b, hq, total, d = case.q.shape
    cache = PagedKVCache(num_layers=layers, batch_size=b, num_kv_heads=case.k.shape[1], head_dim=d, num_blocks=16,
                         block_size=4, dtype=case.q.dtype, generator=torch.Generator().manual_seed(3))
    outs = []
    start = 0
    for n in steps:
        cache.begin_step(n)
        sl = slice(start, start + n)
        for layer in range(layers):
            out, _ = fn(module(layer_idx=layer), case.q[:, :, sl], case.k[:, :, sl], case.v[:, :, sl], None,
                        paged_cache=cache, sliding_window=window)
        outs.append(out)
        cache.end_step()
        start += n
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("name", ["paged|eager", "paged|sdpa", "flash"])
def test_paged_prefill_and_decode_match_full_attention(name, shipped):
    case = make_case(b=2, hq=4, hkv=2, sq=9)
    fn = make_paged_attention(shipped) if name == "flash" else ALL_ATTENTION_FUNCTIONS[name]
    out, cache = _run_steps(fn, case, [5, 1, 1, 2])
    ref = reference_attention(case.q, case.k, case.v, causal=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    assert cache.seqlens.tolist() == [9, 9]
    # pages were shuffled: the block table is not simply 0, 1, 2, ...
    assert cache.block_table.shape == (2, 3)
    assert cache.block_table.flatten().tolist() != list(range(6))


def test_paged_sliding_window(shipped):
    case = make_case(b=1, hq=2, hkv=1, sq=8)
    ref = reference_attention(case.q, case.k, case.v, causal=True, window=3)
    for fn in (ALL_ATTENTION_FUNCTIONS["paged|sdpa"], make_paged_attention(shipped)):
        out, _ = _run_steps(fn, case, [4, 1, 1, 1, 1], window=3, layers=1)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_paged_needs_a_paged_cache_and_layer():
    case = make_case(b=1, hq=2, hkv=2, sq=2)
    with pytest.raises(UnsupportedAttentionOptionError, match="PagedKVCache"):
        ALL_ATTENTION_FUNCTIONS["paged|sdpa"](module(), case.q, case.k, case.v, None)


def test_cache_runs_out_of_pages():
    cache = PagedKVCache(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=4, num_blocks=2, block_size=2)
    cache.begin_step(2)
    cache.end_step()
    with pytest.raises(MemoryError, match="num_blocks"):
        cache.begin_step(1)


def test_fa3_style_page_table_argument(shipped):
    """FlashAttention 3 names the block table ``page_table``; the paged function follows the signature."""
    import types

    seen = []

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, page_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
        seen.append(page_table is not None)
        return shipped.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                                               block_table=page_table, softmax_scale=softmax_scale, causal=causal,
                                               window_size=window_size, softcap=softcap), None

    fa3 = types.ModuleType("fa3_like")
    fa3.flash_attn_varlen_func = shipped.flash_attn_varlen_func
    fa3.flash_attn_with_kvcache = flash_attn_with_kvcache
    case = make_case(b=2, hq=4, hkv=2, sq=6)
    out, _ = _run_steps(make_paged_attention(fa3), case, [4, 1, 1], layers=1)
    assert seen and all(seen)
    torch.testing.assert_close(out.double(), reference_attention(case.q, case.k, case.v), atol=2e-5, rtol=2e-5)
