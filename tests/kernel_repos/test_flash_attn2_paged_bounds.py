"""The paged-KV bound (flash-attention's issue #2709): nothing outside the block table is read or
written. Lengths known on the host raise an error naming ``block_table``; lengths only the device
knows are clamped: a row keeps the new keys that fit and attends to its first ``capacity`` keys."""

from __future__ import annotations

import importlib

import pytest
import torch

from flash_ref import load_flash_attn2, reference, rel_err

fa = load_flash_attn2()
kvcache = importlib.import_module(fa.__name__ + "._kvcache")
decode = importlib.import_module(fa.__name__ + "._triton_decode")

PAGE, D = 16, 32


def _paged(pages=4, heads=1):
    k_cache = torch.randn(pages, PAGE, heads, D, dtype=torch.float16)
    v_cache = torch.randn(pages, PAGE, heads, D, dtype=torch.float16)
    return k_cache, v_cache


@pytest.mark.parametrize("append", [False, True], ids=["read-only", "append"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "cpu-tensor"])
def test_lengths_known_on_the_host_past_the_block_table_raise_naming_it(append, as_tensor):
    k_cache, v_cache = _paged()
    table = torch.zeros(1, 1, dtype=torch.int32)  # one column: 16 addressable keys
    q = torch.randn(1, 1, 1, D, dtype=torch.float16)
    new = torch.randn(1, 1, 1, D, dtype=torch.float16) if append else None
    length = PAGE if append else PAGE + 1
    lens = torch.tensor([length], dtype=torch.int32) if as_tensor else length
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="block_table") as info:
        kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, k=new, v=new, cache_seqlens=lens,
                                        block_table=table)
    assert isinstance(info.value, ValueError)  # an argument error like the others
    assert torch.equal(k_cache, before)  # refused before anything was written
    # exactly at capacity, nothing appended: fine
    out = kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=PAGE, block_table=table)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("lookup", ["preloaded", "blocks", "per-key"])
def test_device_lengths_past_the_capacity_attend_to_the_first_capacity_keys(monkeypatch, lookup):
    """What the kernel does with a length it cannot check (a GPU tensor): it stops at capacity,
    however it finds its pages (``_triton_decode.page_lookup``)."""
    if lookup != "preloaded":
        monkeypatch.setattr(decode, "PRELOAD_MAX", 0)
    if lookup == "per-key":
        monkeypatch.setattr(decode, "PAGE_BLOCKS", False)
    k_cache, v_cache = _paged(pages=6, heads=2)
    table = torch.tensor([[3, 1], [5, 0]], dtype=torch.int32)  # 32 addressable keys per row
    capacity = 2 * PAGE
    q = torch.randn(2, 1, 4, D, dtype=torch.float16)
    lens = torch.tensor([capacity + 40, 9], dtype=torch.int32)
    out, _ = decode.decode_attention(
        q, k_cache, v_cache, total_lens=lens, total_len_uniform=0, capacity=capacity,
        block_table=table, batch_idx=None, leftpad=None, alibi_slopes=None,
        softmax_scale=D ** -0.5, window_left=-1, window_right=-1, softcap=0.0)
    for b, n in ((0, capacity), (1, 9)):
        keys = torch.cat([k_cache[p] for p in table[b].tolist()])[:n]
        vals = torch.cat([v_cache[p] for p in table[b].tolist()])[:n]
        want, _ = reference(q[b:b + 1].double(), keys[None].double(), vals[None].double())
        assert rel_err(out[b:b + 1], want) < 3e-3, b


@pytest.mark.parametrize("start", [2 * PAGE - 2, 2 * PAGE, 2 * PAGE + 5], ids=["crosses", "at-end", "past-end"])
def test_appends_past_the_capacity_are_dropped_and_touch_nothing_else(start):
    k_cache, v_cache = _paged(pages=5)
    table = torch.tensor([[4, 1]], dtype=torch.int32)
    capacity = 2 * PAGE
    k_new = torch.randn(1, 5, 1, D, dtype=torch.float16)
    v_new = torch.randn(1, 5, 1, D, dtype=torch.float16)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    kvcache._append(k_cache, v_cache, k_new, v_new, torch.tensor([start]), capacity, table,
                    torch.arange(1))
    k_want, v_want = k_before.clone(), v_before.clone()
    for t in range(5):
        pos = start + t
        if pos < capacity:
            page = int(table[0, pos // PAGE])
            k_want[page, pos % PAGE] = k_new[0, t]
            v_want[page, pos % PAGE] = v_new[0, t]
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


def test_the_torch_path_stops_at_the_capacity_too(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    k_cache, v_cache = _paged(pages=3)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    q = torch.randn(1, 1, 1, D, dtype=torch.float32)
    out, _ = kvcache._attention_gathered(
        q, k_cache.float(), v_cache.float(), torch.tensor([2 * PAGE + 7]), 0, 2 * PAGE, table, PAGE,
        torch.arange(1), None, None, D ** -0.5, False, (-1, -1), 0.0)
    keys = torch.cat([k_cache[2], k_cache[0]]).float()
    vals = torch.cat([v_cache[2], v_cache[0]]).float()
    want, _ = reference(q.double(), keys[None].double(), vals[None].double())
    assert rel_err(out, want) < 1e-5
