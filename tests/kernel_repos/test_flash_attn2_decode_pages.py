"""How the split-K decode kernel finds a paged cache's pages: a split preloads its block-table
entries into registers when they are few (``PRELOAD_MAX``); past that, when every block of keys
lies in one page (``PAGE_BLOCKS``), a block reads one entry, else each key looks its page up. All
give the same attention, with left padding, windows and splits that start mid-page."""

from __future__ import annotations

import importlib

import pytest
import torch

from flash_ref import load_flash_attn2, rel_err

fa = load_flash_attn2()
decode = importlib.import_module(fa.__name__ + "._triton_decode")

PAGE, D = 16, 32


@pytest.mark.parametrize("capacity, page, block_n, splits, expected", [
    (4096, 256, 64, 1, 32),    # 16 pages + 1 for a mid-page start -> 32
    (4096, 256, 64, 2, 16),    # 2048 keys per split: 8 + 1 -> 16
    (32768, 256, 64, 2, 0),    # 64 + 1 pages per split: past PRELOAD_MAX, none preloaded
    (100, 16, 16, 1, 8),       # 7 blocks of 16 keys: 7 + 1 -> 8
    (4096, 0, 64, 1, 0),       # not paged
])
def test_pages_preloaded_per_split(capacity, page, block_n, splits, expected):
    assert decode.preload_pages(capacity, page, block_n, splits) == expected


def test_preload_covers_every_page_a_split_touches():
    for capacity in range(16, 400, 16):
        for splits in (1, 2, 3, 5):
            n = decode.preload_pages(capacity, PAGE, 16, splits)
            if n:
                keys = -(-(-(-capacity // 16)) // splits) * 16
                # worst case: the split starts on a page's last key
                assert n >= (PAGE - 1 + keys + PAGE - 1) // PAGE


# the interpreter's tile, and sm90's one-split tile (128-key blocks: one covers 8 of these pages)
@pytest.mark.parametrize("config", [None, (128, 4, 2)], ids=["cpu-tile", "one-split-tile"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [-1, 21])
def test_preloaded_and_per_key_page_lookups_agree(monkeypatch, splits, window, config):
    torch.manual_seed(splits + window)
    pages = 12
    k_cache = torch.randn(pages, PAGE, 2, D, dtype=torch.float16)
    v_cache = torch.randn(pages, PAGE, 2, D, dtype=torch.float16)
    table = torch.stack([torch.randperm(pages)[:5] for _ in range(3)]).to(torch.int32)
    capacity = 5 * PAGE
    lens = torch.tensor([capacity, 37, 61], dtype=torch.int32)
    leftpad = torch.tensor([0, 5, 13], dtype=torch.int32)  # splits start mid-page
    q = torch.randn(3, 1, 4, D, dtype=torch.float16)

    def run():
        out, lse = decode.decode_attention(
            q, k_cache, v_cache, total_lens=lens, total_len_uniform=0, capacity=capacity,
            block_table=table, batch_idx=None, leftpad=leftpad, alibi_slopes=None,
            softmax_scale=D ** -0.5, window_left=window, window_right=-1, softcap=0.0,
            num_splits=splits, config=config)
        return out.float(), lse

    assert decode.preload_pages(capacity, PAGE, config[0] if config else 16, splits) > 0
    pre_out, pre_lse = run()
    monkeypatch.setattr(decode, "PRELOAD_MAX", 0)
    key_out, key_lse = run()
    assert rel_err(pre_out, key_out) < 1e-3
    assert torch.allclose(pre_lse, key_lse, atol=1e-3)
    # and both are attention over the keys the table names
    for b in range(3):
        keys = torch.cat([k_cache[p] for p in table[b].tolist()])[leftpad[b]:lens[b]]
        vals = torch.cat([v_cache[p] for p in table[b].tolist()])[leftpad[b]:lens[b]]
        if window >= 0:
            keys, vals = keys[-(window + 1):], vals[-(window + 1):]
        kk = keys.float().repeat_interleave(2, 1).transpose(0, 1)  # [4, n, D]
        vv = vals.float().repeat_interleave(2, 1).transpose(0, 1)
        scores = (q[b, 0].float()[:, None, :] @ kk.transpose(1, 2)) * D ** -0.5
        ref = (scores.softmax(-1) @ vv)[:, 0]
        assert rel_err(pre_out[b, 0], ref) < 3e-3


def test_a_block_reads_one_table_entry_only_where_its_keys_share_a_page(monkeypatch):
    assert decode.page_blocks(256, 128, leftpad=False, window_left=-1)
    assert decode.page_blocks(256, 256, leftpad=False, window_left=-1)
    assert not decode.page_blocks(0, 64, leftpad=False, window_left=-1)  # not paged
    assert not decode.page_blocks(16, 64, leftpad=False, window_left=-1)  # a block spans 4 pages
    assert not decode.page_blocks(96, 64, leftpad=False, window_left=-1)  # every other block straddles two
    # blocks start where left padding or a left window puts the first key: anywhere in a page
    assert not decode.page_blocks(256, 64, leftpad=True, window_left=-1)
    assert not decode.page_blocks(256, 64, leftpad=False, window_left=100)
    monkeypatch.setattr(decode, "PAGE_BLOCKS", False)
    assert not decode.page_blocks(256, 128, leftpad=False, window_left=-1)


def test_a_split_preloads_its_entries_when_few_else_reads_one_a_block():
    # 4k keys in one slice of 128-key blocks: 16 + 1 pages fit in registers
    assert decode.page_lookup(4096, 256, 128, 1, leftpad=False, window_left=-1) == (32, False)
    # 32k keys: 128 + 1 pages do not; whole blocks in a page: an entry a block
    assert decode.page_lookup(32768, 256, 128, 1, leftpad=False, window_left=-1) == (0, True)
    # left padding puts blocks across page boundaries: an entry a key
    assert decode.page_lookup(32768, 256, 128, 1, leftpad=True, window_left=-1) == (0, False)
    assert decode.page_lookup(32768, 0, 128, 1, leftpad=False, window_left=-1) == (0, False)  # dense


def test_preloaded_entries_serve_whole_blocks_only_when_asked(monkeypatch):
    # 4k keys in 128-key blocks of 256-key pages: preloaded, and each block picks its entry out
    monkeypatch.setattr(decode, "PRELOADED_BLOCKS", True)
    assert decode.page_lookup(4096, 256, 128, 1, leftpad=False, window_left=-1) == (32, True)
    # left padding: blocks straddle pages, so the preloaded entries are gathered a key
    assert decode.page_lookup(4096, 256, 128, 1, leftpad=True, window_left=-1) == (32, False)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window_right", [-1, 0])
@pytest.mark.parametrize("entries", ["loaded a block", "preloaded"])
def test_a_table_entry_a_block_reads_what_per_key_lookups_read(monkeypatch, splits, window_right, entries):
    """Pages of 64 keys, blocks of 16 (the interpreter's tile): 4 blocks a page, read through one
    entry each, loaded a step ahead or picked out of the split's preloaded entries
    (PRELOADED_BLOCKS); lengths that end mid-page and mid-block, a right window (causal over 3
    queries)."""
    torch.manual_seed(splits)
    page, pages = 64, 12
    k_cache = torch.randn(pages, page, 2, D, dtype=torch.float16)
    v_cache = torch.randn(pages, page, 2, D, dtype=torch.float16)
    table = torch.stack([torch.randperm(pages)[:4] for _ in range(3)]).to(torch.int32)
    capacity = 4 * page
    lens = torch.tensor([capacity, 37, 150], dtype=torch.int32)
    q = torch.randn(3, 3, 4, D, dtype=torch.float16)
    if entries == "preloaded":
        monkeypatch.setattr(decode, "PRELOADED_BLOCKS", True)
        assert decode.page_lookup(capacity, page, 16, splits, leftpad=False, window_left=-1)[1]
        assert decode.page_lookup(capacity, page, 16, splits, leftpad=False, window_left=-1)[0] > 0
    else:
        monkeypatch.setattr(decode, "PRELOAD_MAX", 0)  # these few entries would be preloaded
        assert decode.page_lookup(capacity, page, 16, splits, leftpad=False, window_left=-1) == (0, True)

    def run():
        out, lse = decode.decode_attention(
            q, k_cache, v_cache, total_lens=lens, total_len_uniform=0, capacity=capacity,
            block_table=table, batch_idx=None, leftpad=None, alibi_slopes=None,
            softmax_scale=D ** -0.5, window_left=-1, window_right=window_right, softcap=0.0,
            num_splits=splits)
        return out.float(), lse

    block_out, block_lse = run()
    monkeypatch.setattr(decode, "PAGE_BLOCKS", False)
    key_out, key_lse = run()
    assert rel_err(block_out, key_out) < 1e-3
    assert torch.allclose(block_lse, key_lse, atol=1e-3)
    for b in range(3):
        n = int(lens[b])
        keys = torch.cat([k_cache[p] for p in table[b].tolist()])[:n].float().repeat_interleave(2, 1)
        vals = torch.cat([v_cache[p] for p in table[b].tolist()])[:n].float().repeat_interleave(2, 1)
        scores = torch.einsum("qhd,khd->hqk", q[b].float(), keys) * D ** -0.5
        if window_right == 0:  # bottom-right aligned: query i sees keys up to n - 3 + i
            seen = torch.arange(n)[None, :] <= (n - 3 + torch.arange(3))[:, None]
            scores = scores.masked_fill(~seen, float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
        assert rel_err(block_out[b], ref) < 3e-3


@pytest.mark.parametrize("lookup", ["blocks", "preloaded", "preloaded blocks", "per-key"])
def test_keys_on_unallocated_pages_are_left_out_never_read(monkeypatch, lookup):
    """A -1 block-table entry inside a row's length (a length only the device knows): the keys on
    that page are left out of the attention and nothing is read through page -1."""
    if lookup == "preloaded blocks":
        monkeypatch.setattr(decode, "PRELOADED_BLOCKS", True)
    elif lookup != "preloaded":
        monkeypatch.setattr(decode, "PRELOAD_MAX", 0)
    if lookup == "per-key":
        monkeypatch.setattr(decode, "PAGE_BLOCKS", False)
    torch.manual_seed(3)
    pages = 6
    k_cache = torch.randn(pages, PAGE, 1, D, dtype=torch.float16)
    v_cache = torch.randn(pages, PAGE, 1, D, dtype=torch.float16)
    k_cache[-1] = float("nan")  # page -1 would wrap here
    v_cache[-1] = float("nan")
    table = torch.tensor([[2, -1, 4]], dtype=torch.int32)
    lens = torch.tensor([3 * PAGE], dtype=torch.int32)
    q = torch.randn(1, 1, 2, D, dtype=torch.float16)
    out, _ = decode.decode_attention(
        q, k_cache, v_cache, total_lens=lens, total_len_uniform=0, capacity=3 * PAGE,
        block_table=table, batch_idx=None, leftpad=None, alibi_slopes=None,
        softmax_scale=D ** -0.5, window_left=-1, window_right=-1, softcap=0.0)
    assert torch.isfinite(out).all()
    keys = torch.cat([k_cache[2], k_cache[4]]).float()[:, 0]  # [2 * PAGE, D]
    vals = torch.cat([v_cache[2], v_cache[4]]).float()[:, 0]
    ref = ((q[0, 0].float() @ keys.T) * D ** -0.5).softmax(-1) @ vals
    assert rel_err(out[0, 0].float(), ref) < 3e-3
