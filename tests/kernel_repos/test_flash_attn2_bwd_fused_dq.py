"""The backward's fused dQ: the dK/dV kernel adds each block pair's dS.K into an fp32 buffer and no
dQ kernel runs (``_triton_bwd.dq_mode``).

On sm90 the additions are bulk (TMA) reduce-adds; the interpreter has none, so here the same
kernel runs its per-element atomic form (mode 1), which shares everything but the final add.
The sm90 host path (descriptor, launches, compile-ahead) is checked through recorded launches.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from flash_ref import assert_out_and_grads_close, load_flash_attn2, poisoned_allocations, reference
from launch_record import recording, triton_specialisation

fa = load_flash_attn2()
bwd = importlib.import_module(fa.__name__ + "._triton_bwd")
configs = importlib.import_module(fa.__name__ + "._configs")

TOL = {torch.float16: 3e-3, torch.float32: 1e-5}

# (batch, seq_q, seq_k, heads_q, heads_k, head_dim, dtype, options): every dK/dV formulation the
# interpreter picks ("keys" below 128, "queries" at 128), masks, GQA, ragged head dims
CASES = {
    "causal-gqa-d64": (2, 33, 40, 4, 2, 64, torch.float16, dict(causal=True)),
    "causal-sq>sk-mqa-d80": (1, 40, 17, 2, 1, 80, torch.float32, dict(causal=True)),
    "window-softcap-d128": (1, 50, 60, 2, 2, 128, torch.float32, dict(window_size=(7, 3), softcap=5.0)),
    "alibi-d40": (2, 30, 37, 4, 2, 40, torch.float16, dict(alibi=(2, 4), causal=True)),
    "plain-one-row-d32": (1, 1, 45, 2, 2, 32, torch.float16, {}),
}


def _grads(fused, b, sq, sk, hq, hk, d, dtype, opts, monkeypatch, seed=0):
    monkeypatch.setattr(bwd, "FUSED_DQ", fused)
    gen = torch.Generator().manual_seed(seed)
    opts = dict(opts)
    alibi = opts.pop("alibi", None)
    slopes = torch.rand(*alibi, generator=gen) if alibi is not None else None
    q, k, v = (torch.randn(b, s, h, d, generator=gen, dtype=dtype).requires_grad_()
               for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    dout = torch.randn(b, sq, hq, d, generator=gen, dtype=dtype)
    with poisoned_allocations():
        out = fa.flash_attn_func(q, k, v, alibi_slopes=slopes, **opts)
        out.backward(dout)
    return out, (q, k, v), dout, slopes, opts


@pytest.mark.parametrize("case", list(CASES))
def test_fused_dq_matches_the_reference_and_leaves_dk_dv_unchanged(case, monkeypatch):
    b, sq, sk, hq, hk, d, dtype, opts = CASES[case]
    out, qkv, dout, slopes, plain_opts = _grads(True, *CASES[case], monkeypatch)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in qkv)
    ref_out, _ = reference(qr, kr, vr, alibi_slopes=slopes, **plain_opts)
    ref_out.backward(dout.double())
    assert_out_and_grads_close(out, ref_out, qkv, (qr, kr, vr), TOL[dtype])
    # dK and dV come out of the same products either way
    _, qkv0, _, _, _ = _grads(False, *CASES[case], monkeypatch)
    assert torch.equal(qkv[1].grad, qkv0[1].grad) and torch.equal(qkv[2].grad, qkv0[2].grad)


def test_fused_dq_on_packed_sequences(monkeypatch):
    monkeypatch.setattr(bwd, "FUSED_DQ", True)
    lens_q, lens_k, hq, hk, d = [5, 0, 17, 9], [7, 3, 17, 20], 4, 2, 64
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lens_q), hq, d, generator=gen, dtype=torch.float16).requires_grad_()
    k = torch.randn(sum(lens_k), hk, d, generator=gen, dtype=torch.float16).requires_grad_()
    v = torch.randn(sum(lens_k), hk, d, generator=gen, dtype=torch.float16).requires_grad_()
    dout = torch.randn(sum(lens_q), hq, d, generator=gen, dtype=torch.float16)
    with poisoned_allocations():
        out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
        out.backward(dout)
    for i in range(len(lens_q)):
        if lens_q[i] == 0:
            continue
        sl_q, sl_k = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        qi, ki, vi = (t.detach()[s].double().unsqueeze(0).requires_grad_() for t, s in ((q, sl_q), (k, sl_k), (v, sl_k)))
        ro, _ = reference(qi, ki, vi, causal=True)
        ro.backward(dout[sl_q].double().unsqueeze(0))
        # a sequence's dQ rows get nothing from its neighbours' key blocks
        for got, want in ((out[sl_q], ro[0]), (q.grad[sl_q], qi.grad[0]), (k.grad[sl_k], ki.grad[0]),
                          (v.grad[sl_k], vi.grad[0])):
            err = (got.double() - want).norm() / want.norm().clamp_min(1e-12)
            assert err < TOL[torch.float16], (i, err)


def test_deterministic_keeps_the_dq_kernel(monkeypatch):
    monkeypatch.setattr(bwd, "FUSED_DQ", True)
    seen = []
    real = bwd._DQ

    def dq_launch(*args):
        seen.append("dq")
        return real(*args)

    monkeypatch.setattr(bwd, "_DQ", dq_launch)
    q, k, v = (torch.randn(1, 20, 2, 32, dtype=torch.float16).requires_grad_() for _ in range(3))
    fa.flash_attn_func(q, k, v, causal=True).sum().backward()
    assert seen == []
    fa.flash_attn_func(q, k, v, causal=True, deterministic=True).sum().backward()
    assert seen == ["dq"]


def test_dq_mode_rule(monkeypatch):
    monkeypatch.setattr(bwd, "FUSED_DQ", None)
    monkeypatch.setattr(configs, "FUSED_DQ_SM90", {(128, True): 4096})
    assert bwd.dq_mode((9, 0), 128, "keys", False, True, 4096) == 2
    assert bwd.dq_mode((9, 0), 128, "keys", False, True, 4095) == 0  # fewer keys than measured faster
    assert bwd.dq_mode((9, 0), 128, "keys", False, False, 4096) == 0  # not causal: not in the table
    assert bwd.dq_mode((9, 0), 128, "keys", True, True, 4096) == 0  # deterministic
    assert bwd.dq_mode((9, 0), 64, "keys", False, True, 4096) == 0  # head dim not in the table
    assert bwd.dq_mode((8, 0), 128, "keys", False, True, 4096) == 0  # no bulk reduce before sm90
    assert bwd.dq_mode((10, 0), 128, "keys", False, True, 4096) == 0  # measured on sm90 only
    assert bwd.dq_mode(None, 128, "queries", False, True, 4096) == 0  # the interpreter follows the default...
    monkeypatch.setattr(bwd, "FUSED_DQ", True)
    assert bwd.dq_mode(None, 128, "queries", False) == 1  # ...unless forced, then atomics
    assert bwd.dq_mode((8, 0), 128, "keys", False) == 1  # forced before sm90: atomics, no bulk reduce
    assert bwd.dq_mode((9, 0), 256, "keys-2pass", False) == 0  # two passes: dK's pass is alone
    assert bwd.dq_mode((9, 0), 128, "keys", True) == 0
    monkeypatch.setattr(bwd, "FUSED_DQ", False)
    assert bwd.dq_mode((9, 0), 128, "keys", False, True, 1 << 20) == 0


@pytest.mark.parametrize("varlen", [False, True])
def test_sm90_launches_one_dkdv_kernel_with_a_reduce_descriptor(varlen, monkeypatch):
    """What an sm90 GPU would launch for a head dim the table lists: delta, then dK/dV with a
    TMA descriptor over the fp32 accumulator (one box = one query block of one head); no dQ
    kernel. The compile-ahead asks for the same specialisations."""
    monkeypatch.setattr(configs, "FUSED_DQ_SM90", {(128, True): 64})
    hq, hk, d = 4, 2, 128
    if varlen:
        lens = [70, 3, 130]
        cu = torch.tensor([0, 70, 73, 203], dtype=torch.int32)
        q = torch.randn(203, hq, d, dtype=torch.bfloat16)
        k = torch.randn(203, hk, d, dtype=torch.bfloat16)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
        rows = hq * 203
    else:
        q = torch.randn(2, 100, hq, d, dtype=torch.bfloat16)
        k = torch.randn(2, 100, hk, d, dtype=torch.bfloat16)
        kw = {}
        rows = 2 * hq * 100
    v = torch.randn_like(k)
    out = torch.randn_like(q)
    lse = torch.randn(hq, 203) if varlen else torch.randn(2, hq, 100)
    with recording(fa, monkeypatch) as recorded:
        bwd.attention_backward(out, q, k, v, out, lse, causal=True, **kw)
    launches = [l for l in recorded if l.grid is not None]  # the rest: compiles started first
    assert [l.name for l in launches] == ["_delta_kernel", "_bwd_dkdv_kernel", "_dq_cast_kernel"]
    dkdv = launches[1]
    assert dkdv.launcher is bwd._DKDV_TMA
    desc = dkdv.args[12]
    bm = configs.pick("bwd", (9, 0), 128)[0][0]
    assert type(desc).__name__ == "TensorDescriptor"
    assert list(desc.shape) == [rows, 128] and list(desc.block_shape) == [bm, 128]
    assert desc.base.dtype == torch.float32
    assert dkdv.constexprs[-1] == 2
    with recording(fa, monkeypatch) as ahead:
        bwd.prepare_backward(q, k, v, causal=True, **kw)
    assert [triton_specialisation(l) for l in ahead] == [triton_specialisation(l) for l in launches]


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_cast_kernel_turns_the_head_major_buffer_into_dq_scaled(varlen, dtype):
    """The fused modes' last step: buffer rows (batch, head, token) of block_d columns become dq
    [batch, token, head, head_dim] times the softmax scale, rounded once (as torch rounds
    ``scale * buffer``); the padding columns past head_dim are not written."""
    batch, heads, tokens, head_dim, block_d = (1, 3, 70, 80, 128) if varlen else (2, 3, 70, 80, 128)
    acc = torch.randn(batch * heads * tokens, block_d, generator=torch.Generator().manual_seed(1))
    dq = torch.full((tokens, heads, head_dim) if varlen else (batch, tokens, heads, head_dim), 7.0, dtype=dtype)
    strides = (0, *dq.stride()[:2]) if varlen else dq.stride()[:3]
    bwd._DQ_CAST(((tokens + 63) // 64, batch * heads, 1), (acc, dq, *strides, tokens, heads, head_dim, 0.3),
                 (64, block_d), 4, 1)
    want = (acc.view(batch, heads, tokens, block_d)[..., :head_dim].transpose(1, 2) * 0.3).to(dtype)
    assert torch.equal(dq, want[0] if varlen else want)
