"""dQ through atomics in the dK/dV kernel (``attention_backward(dq_atomic=True)``): the same
gradients as the separate dQ kernel, for every dK/dV formulation ("keys", "queries",
"keys-2pass") and the options that change dS (causal, windows, softcap, ALiBi, dropout, GQA,
varlen, ragged head dims)."""

from __future__ import annotations

import importlib

import pytest
import torch

from flash_ref import load_flash_attn2, rel_err

fa = load_flash_attn2()
fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
bwd = importlib.import_module(fa.__name__ + "._triton_bwd")

CASES = {
    "keys-causal-gqa": dict(d=32, hq=4, hk=2, sq=45, sk=45, opts=dict(causal=True)),
    "keys-ragged-d-window-softcap": dict(d=40, hq=2, hk=2, sq=37, sk=50,
                                         opts=dict(window_size=(9, 3), softcap=5.0)),
    "keys-alibi-dropout": dict(d=32, hq=2, hk=1, sq=33, sk=29, opts=dict(dropout_p=0.2, seed=7), alibi=True),
    "queries-causal": dict(d=128, hq=2, hk=2, sq=30, sk=41, opts=dict(causal=True)),
    "keys-2pass": dict(d=256, hq=2, hk=1, sq=20, sk=24, opts=dict(causal=True)),
}


def _grads(case, dq_atomic, varlen=False):
    torch.manual_seed(0)
    c = CASES[case]
    b = 2
    q = torch.randn(b, c["sq"], c["hq"], c["d"], dtype=torch.float32)
    k = torch.randn(b, c["sk"], c["hk"], c["d"], dtype=torch.float32)
    v = torch.randn(b, c["sk"], c["hk"], c["d"], dtype=torch.float32)
    do = torch.randn_like(q)
    opts = dict(c["opts"], softmax_scale=c["d"] ** -0.5)
    if c.get("alibi"):
        opts["alibi_slopes"] = torch.rand(b, c["hq"], dtype=torch.float32)
    if varlen:
        cu_q = torch.tensor([0, c["sq"], 2 * c["sq"] - 5], dtype=torch.int32)
        cu_k = torch.tensor([0, c["sk"], 2 * c["sk"] - 3], dtype=torch.int32)
        q, do = q.reshape(-1, c["hq"], c["d"])[: int(cu_q[-1])], do.reshape(-1, c["hq"], c["d"])[: int(cu_q[-1])]
        k, v = (t.reshape(-1, c["hk"], c["d"])[: int(cu_k[-1])] for t in (k, v))
        opts.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=c["sq"], max_seqlen_k=c["sk"])
        opts.pop("alibi_slopes", None)
    out, lse = fwd.attention_forward(q, k, v, **opts)
    return bwd.attention_backward(do, q, k, v, out, lse, dq_atomic=dq_atomic, **opts)


@pytest.mark.parametrize("case", sorted(CASES))
def test_atomic_dq_matches_the_dq_kernel(case):
    separate = _grads(case, dq_atomic=False)
    fused = _grads(case, dq_atomic=True)
    assert rel_err(fused[0], separate[0]) < 1e-5  # dq: only the order of fp32 additions differs
    assert torch.equal(fused[1], separate[1]) and torch.equal(fused[2], separate[2])  # dk, dv untouched


@pytest.mark.parametrize("case", ["keys-causal-gqa", "queries-causal"])
def test_atomic_dq_with_varlen(case):
    separate = _grads(case, dq_atomic=False, varlen=True)
    fused = _grads(case, dq_atomic=True, varlen=True)
    assert rel_err(fused[0], separate[0]) < 1e-5
    assert torch.equal(fused[1], separate[1])


def test_atomic_dq_is_off_unless_asked():
    assert bwd.DQ_ATOMIC is False
