"""flash_attn_varlen_func (and its packed variants) of the shipped flash-attn2 repo.

Each packed batch holds empty and length-1 sequences beside odd lengths; every sequence is
checked against the fp64 reference run on it alone (out, lse, dq, dk, dv), with NaN-poisoned
kernel allocations. Triton under the interpreter, and the PyTorch path.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from flash_ref import assert_out_and_grads_close, lse_err, load_flash_attn2, poisoned_allocations, reference

fa = load_flash_attn2()
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}


def _cu(lengths):
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)


def _check(lens_q, lens_k, hq, hk, d, dtype, opts, keep=None, dropout_p=0.0, seed_hook=None):
    opts = dict(opts)
    alibi = opts.pop("alibi", None)
    slopes = torch.rand(*alibi) if alibi is not None else None
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, hq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(tk, hk, d, dtype=dtype, requires_grad=True)
    v = torch.randn(tk, hk, d, dtype=dtype, requires_grad=True)
    dout = torch.randn(tq, hq, d, dtype=dtype)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    if seed_hook is not None:
        seed_hook()
    with poisoned_allocations():
        out, lse, _ = fa.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dropout_p=dropout_p, alibi_slopes=slopes,
            return_attn_probs=True, **opts,
        )
        out.backward(dout)
    assert out.shape == q.shape and lse.shape == (hq, tq) and lse.dtype == torch.float32
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_outs, ref_lses = [], []
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        qs, ks = int(cu_q[b]), int(cu_k[b])
        sl = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
        o, l = reference(
            qr[qs:qs + sq].unsqueeze(0), kr[ks:ks + sk].unsqueeze(0), vr[ks:ks + sk].unsqueeze(0),
            alibi_slopes=sl, keep_mask=None if keep is None else keep[b:b + 1], dropout_p=dropout_p, **opts,
        )
        ref_outs.append(o[0])
        ref_lses.append(l[0])
    ref_out = torch.cat(ref_outs)
    ref_out.backward(dout.double())
    assert_out_and_grads_close(out, ref_out, (q, k, v), (qr, kr, vr), TOL[dtype])
    assert lse_err(lse, torch.cat(ref_lses, dim=1)) < (2e-3 if dtype != torch.float32 else 1e-5)


# (seqlens_q, seqlens_k, heads_q, heads_k, head_dim, dtype, options)
CASES = {
    "causal-empty-and-len1": ([0, 1, 17, 33, 5], [5, 1, 17, 40, 0], 2, 2, 32, torch.float16, dict(causal=True)),
    "gqa-window-alibi2d": ([20, 1, 0, 35], [31, 3, 4, 35], 4, 2, 40, torch.float16,
                           dict(window_size=(6, 2), alibi=(4, 4))),
    "softcap-noncausal-fp32": ([13, 0, 29], [9, 7, 29], 2, 1, 64, torch.float32, dict(softcap=4.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_varlen_matches_reference(case):
    _check(*CASES[case])


@pytest.mark.parametrize("case", ["causal-empty-and-len1", "gqa-window-alibi2d"])
def test_torch_path_varlen_matches_reference(case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lens_q, lens_k, hq, hk, d, _, opts = CASES[case]
    _check(lens_q, lens_k, hq, hk, d, torch.bfloat16, opts)


def test_triton_varlen_dropout_replays_kernel_mask():
    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    autograd = importlib.import_module(fa.__name__ + "._autograd")
    lens_q, lens_k, hq, p = [7, 0, 19], [11, 3, 19], 2, 0.3
    torch.manual_seed(99)
    seed = autograd.draw_seed()
    keep = fwd.dropout_keep_mask(seed, len(lens_q), hq, max(lens_q), max(lens_k), p, torch.device("cpu"))
    _check(lens_q, lens_k, hq, 1, 32, torch.float32, dict(causal=True), keep=keep, dropout_p=p,
           seed_hook=lambda: torch.manual_seed(99))


def test_varlen_packed_variants_and_paged_keys():
    lens = [3, 0, 21, 1]
    cu = _cu(lens)
    qkv = torch.randn(sum(lens), 3, 2, 32, dtype=torch.float16)
    out = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True)
    q, k, v = qkv.unbind(1)
    want = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    assert torch.equal(out, want)
    kv = torch.stack([k, v], dim=1)
    assert torch.equal(fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max(lens), max(lens), causal=True), want)
    # The same keys scattered over pages of 4 slots in a shuffled pool.
    page, n_pages = 4, 16
    k_cache = torch.randn(n_pages, page, 2, 32, dtype=torch.float16)
    v_cache = torch.randn(n_pages, page, 2, 32, dtype=torch.float16)
    perm = torch.randperm(n_pages)
    table = torch.zeros(len(lens), 6, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        for j in range((n + page - 1) // page):
            blk = int(perm[used])
            used += 1
            table[b, j] = blk
            seg = slice(int(cu[b]) + j * page, min(int(cu[b]) + (j + 1) * page, int(cu[b + 1])))
            cnt = seg.stop - seg.start
            k_cache[blk, :cnt] = k[seg]
            v_cache[blk, :cnt] = v[seg]
    paged = fa.flash_attn_varlen_func(q, k_cache, v_cache, cu, cu, max(lens), max(lens), causal=True,
                                      block_table=table)
    assert torch.equal(paged, want)


def test_cu_seqlens_must_be_int32():
    q = torch.randn(5, 2, 32)
    cu = torch.tensor([0, 5])
    with pytest.raises(ValueError, match="int32"):
        fa.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5)
