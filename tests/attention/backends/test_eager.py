"""eager_attention_forward: the contract, weights, masks of both kinds, sinks."""

from __future__ import annotations

import torch

from kernel_loader.attention import eager_attention_forward, repeat_kv

from ..conftest import make_case, module, reference_attention


def test_shapes_weights_and_contiguity():
    case = make_case(b=2, hq=4, hkv=2, sq=5)
    out, w = eager_attention_forward(module(), case.q, case.k, case.v, None)
    assert out.shape == (2, 5, 4, 16) and out.is_contiguous()
    assert w.shape == (2, 4, 5, 5)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 5))
    # mask None + causal module: causality is applied, not dropped
    assert float(w[..., 0, 1:].abs().max()) == 0.0


def test_is_causal_false_and_bool_vs_float_masks():
    case = make_case(b=1, hq=2, hkv=2, sq=4, dtype=torch.float64)
    out, _ = eager_attention_forward(module(is_causal=False), case.q, case.k, case.v, None)
    torch.testing.assert_close(out, reference_attention(case.q, case.k, case.v, causal=False))
    bool_mask = torch.tensor([[[[True, False, True, True]]]]).expand(1, 1, 4, 4)
    float_mask = torch.zeros(1, 1, 4, 4, dtype=torch.float64).masked_fill(~bool_mask, torch.finfo(torch.float64).min)
    a, _ = eager_attention_forward(module(), case.q, case.k, case.v, bool_mask)
    b, _ = eager_attention_forward(module(), case.q, case.k, case.v, float_mask)
    torch.testing.assert_close(a, b)


def test_sinks_take_probability_mass():
    case = make_case(b=1, hq=2, hkv=2, sq=3)
    _, w = eager_attention_forward(module(), case.q, case.k, case.v, None, s_aux=torch.tensor([5.0, -50.0]))
    totals = w.sum(-1)
    assert bool((totals[0, 0] < 0.5).all())  # a big sink absorbs most of head 0's mass
    torch.testing.assert_close(totals[0, 1], torch.ones(3), atol=1e-6, rtol=0)


def test_repeat_kv_matches_repeat_interleave():
    x = torch.randn(2, 3, 4, 5)
    torch.testing.assert_close(repeat_kv(x, 2), x.repeat_interleave(2, dim=1))
