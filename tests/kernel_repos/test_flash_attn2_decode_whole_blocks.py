"""The decode kernel reads the blocks of keys that every row of its tile sees whole without a key
mask (``WHOLE_BLOCKS``) and masks only the rest: a slice's last, partial block, the blocks a
causal bound or a window cuts for some query row, a paged cache's unallocated pages. Whichever
blocks take which path, the attention is the one every block masked gives, bit for bit, and the
one a float64 reference gives."""

from __future__ import annotations

import importlib

import pytest
import torch

from flash_ref import load_flash_attn2

fa = load_flash_attn2()
decode = importlib.import_module(fa.__name__ + "._triton_decode")

PAGE = 16
CASES = {
    # name: (seqlen_q, head_dim, lens, splits, window_left, window_right, leftpad, paged, alibi, softcap)
    "one token, ragged lengths": (1, 32, [80, 37, 16], 1, -1, -1, False, False, False, 0.0),
    "one token, three slices": (1, 32, [80, 61, 5], 3, -1, -1, False, False, False, 0.0),
    "speculative tokens, causal": (5, 32, [80, 44, 23], 1, -1, 0, False, False, False, 0.0),
    "speculative tokens, sliding window": (5, 32, [80, 70, 33], 2, 19, 0, False, False, False, 0.0),
    "head_dim short of the tile": (1, 24, [80, 50, 17], 1, -1, -1, False, False, False, 0.0),
    "left padding": (2, 32, [80, 64, 40], 1, -1, 0, True, False, False, 0.0),
    "paged, an unallocated page inside a row": (1, 32, [80, 64, 48], 1, -1, -1, False, True, False, 0.0),
    "paged, speculative, causal, slices": (3, 32, [80, 47, 30], 2, -1, 0, False, True, False, 0.0),
    "alibi and softcap": (2, 32, [80, 33, 71], 1, -1, 0, False, False, True, 30.0),
}


def _inputs(seqlen_q, head_dim, lens, paged, leftpad, alibi, seed):
    gen = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, capacity = len(lens), 4, 2, 80
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=gen, dtype=torch.float16)
    k = torch.randn(batch, capacity, kv_heads, head_dim, generator=gen, dtype=torch.float16)
    v = torch.randn(batch, capacity, kv_heads, head_dim, generator=gen, dtype=torch.float16)
    table = None
    if paged:
        cols = capacity // PAGE
        perm = torch.randperm(batch * cols, generator=gen)
        k_pool = torch.empty(batch * cols, PAGE, kv_heads, head_dim, dtype=k.dtype)
        v_pool = torch.empty_like(k_pool)
        k_pool[perm] = k.reshape(-1, PAGE, kv_heads, head_dim)
        v_pool[perm] = v.reshape(-1, PAGE, kv_heads, head_dim)
        table = perm.view(batch, cols).to(torch.int32)
        table[1, 1] = -1  # row 1's keys 16-31: a page never allocated, left out
        k, v = k_pool, v_pool
    pads = torch.tensor([0, 9, 21][:batch], dtype=torch.int32) if leftpad else None
    slopes = torch.rand(batch, heads, generator=gen) if alibi else None
    return q, k, v, table, pads, slopes, capacity


def _reference(q, k, v, table, pads, slopes, lens, window_left, window_right, softcap):
    """float64 attention over each row's keys (bottom-right aligned), as flash-attn defines it."""
    batch, seqlen_q, heads, head_dim = q.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        if table is not None:
            keep = [p for p in table[b].tolist()]
            kb = torch.cat([k[max(p, 0)] for p in keep]).double()
            vb = torch.cat([v[max(p, 0)] for p in keep]).double()
            valid = torch.cat([torch.full((PAGE,), p >= 0) for p in keep])
        else:
            kb, vb = k[b].double(), v[b].double()
            valid = torch.ones(kb.shape[0], dtype=torch.bool)
        pad = int(pads[b]) if pads is not None else 0
        n = lens[b] - pad
        kb, vb, valid = kb[pad:lens[b]], vb[pad:lens[b]], valid[pad:lens[b]]
        group = heads // kb.shape[1]
        kk = kb.repeat_interleave(group, 1).transpose(0, 1)  # [H, n, D]
        vv = vb.repeat_interleave(group, 1).transpose(0, 1)
        s = (q[b].double().transpose(0, 1) @ kk.transpose(1, 2)) * head_dim ** -0.5  # [H, Sq, n]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        rel = (torch.arange(seqlen_q)[:, None] + n - seqlen_q) - torch.arange(n)[None, :]
        if slopes is not None:
            s = s - slopes[b].double()[:, None, None] * rel.abs()
        mask = valid[None, :].expand(seqlen_q, n).clone()
        if window_right >= 0:
            mask &= rel >= -window_right
        if window_left >= 0:
            mask &= rel <= window_left
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.nan_to_num(s.softmax(-1))
        out[b] = (p @ vv).transpose(0, 1)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_whole_blocks_give_the_masked_attention_bit_for_bit(monkeypatch, case):
    seqlen_q, head_dim, lens, splits, wl, wr, leftpad, paged, alibi, softcap = CASES[case]
    q, k, v, table, pads, slopes, capacity = _inputs(seqlen_q, head_dim, lens, paged, leftpad, alibi,
                                                      seed=len(case))

    def run():
        out, lse = decode.decode_attention(
            q, k, v, total_lens=torch.tensor(lens, dtype=torch.int32), total_len_uniform=0, capacity=capacity,
            block_table=table, batch_idx=None, leftpad=pads, alibi_slopes=slopes, softmax_scale=head_dim ** -0.5,
            window_left=wl, window_right=wr, softcap=softcap, num_splits=splits)
        return out, lse

    assert decode.WHOLE_BLOCKS
    whole_out, whole_lse = run()
    monkeypatch.setattr(decode, "WHOLE_BLOCKS", False)
    masked_out, masked_lse = run()
    assert torch.equal(whole_out, masked_out)
    assert torch.equal(whole_lse, masked_lse)
    want = _reference(q, k, v, table, pads, slopes, lens, wl, wr, softcap)
    torch.testing.assert_close(whole_out.double(), want, atol=2e-3, rtol=2e-3)
