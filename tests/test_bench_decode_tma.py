"""bench/decode_tma.py's probe decode kernel, run under the interpreter: copying K/V by TMA
descriptor or by pointer loads, from a paged cache whose pages lie in random order or from a
contiguous one, it computes the attention of one query token over each row's keys, and what lies
past a row's end (NaN here) never reaches the output."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package

import decode_tma  # noqa: E402

BATCH, KV_HEADS, GROUP, D, PAGE, CAPACITY = 2, 2, 4, 32, 32, 96


def _reference(q, k, v, seqlens):
    out = []
    for b, n in enumerate(seqlens):
        keys = k[b:b + 1, :n].transpose(1, 2).float().repeat_interleave(GROUP, 1)
        values = v[b:b + 1, :n].transpose(1, 2).float().repeat_interleave(GROUP, 1)
        attn = torch.nn.functional.scaled_dot_product_attention(q[b:b + 1].transpose(1, 2).float(), keys, values)
        out.append(attn.transpose(1, 2))
    return torch.cat(out)


@pytest.mark.parametrize("way", [None, *decode_tma.SHIPPED_WAYS])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("seqlen", [CAPACITY, 80], ids=["full", "ragged-last-block"])
def test_probe_equals_attention_over_the_rows_keys(tma, paged, seqlen, way):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, 1, KV_HEADS * GROUP, D, generator=gen, dtype=torch.float16)
    k = torch.randn(BATCH, CAPACITY, KV_HEADS, D, generator=gen, dtype=torch.float16)
    v = torch.randn(BATCH, CAPACITY, KV_HEADS, D, generator=gen, dtype=torch.float16)
    opts = dict(decode_tma.SHIPPED_WAYS[way]) if way else {}
    # read from a tensor, the lengths may differ between rows
    seqlens = [seqlen, seqlen - 13] if opts.get("lens") else [seqlen] * BATCH
    if opts.get("lens"):
        opts["lens"] = torch.tensor(seqlens, dtype=torch.int32)
    want = _reference(q, k, v, seqlens)
    k_read, v_read = k.clone(), v.clone()
    for b, n in enumerate(seqlens):
        k_read[b, n:] = float("nan")  # past the end: never to be read into the sum
        v_read[b, n:] = float("nan")
    table = None
    if paged:
        pages = BATCH * CAPACITY // PAGE
        perm = torch.randperm(pages, generator=gen)
        pool_k = torch.full((pages, PAGE, KV_HEADS, D), float("nan"), dtype=k.dtype)
        pool_v = pool_k.clone()
        pool_k[perm] = k_read.reshape(pages, PAGE, KV_HEADS, D)
        pool_v[perm] = v_read.reshape(pages, PAGE, KV_HEADS, D)
        k_read, v_read, table = pool_k, pool_v, perm.view(BATCH, -1).to(torch.int32)
    call = decode_tma.probe(q, k_read.view(-1, KV_HEADS * D), v_read.view(-1, KV_HEADS * D), table, seqlen,
                            CAPACITY, (32, 4, 2), tma, kv_heads=KV_HEADS, page_size=PAGE, **opts)
    got = call().float()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_probe_with_the_page_mask_leaves_an_unallocated_pages_keys_out():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(BATCH, 1, KV_HEADS * GROUP, D, generator=gen, dtype=torch.float16)
    k = torch.randn(BATCH, CAPACITY, KV_HEADS, D, generator=gen, dtype=torch.float16)
    v = torch.randn(BATCH, CAPACITY, KV_HEADS, D, generator=gen, dtype=torch.float16)
    table = torch.arange(BATCH * CAPACITY // PAGE, dtype=torch.int32).view(BATCH, -1).clone()
    table[1, 1] = -1  # row 1's keys 32-63: never allocated
    call = decode_tma.probe(q, k.view(-1, KV_HEADS * D), v.view(-1, KV_HEADS * D), table, CAPACITY, CAPACITY,
                            (32, 4, 2), False, kv_heads=KV_HEADS, page_size=PAGE, page_mask=True)
    got = call().float()
    keep = torch.cat([torch.arange(0, PAGE), torch.arange(2 * PAGE, CAPACITY)])
    want = _reference(q, k, v, [CAPACITY] * BATCH)
    want[1] = _reference(q[1:], k[1:, keep], v[1:, keep], [len(keep)])[0]
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
