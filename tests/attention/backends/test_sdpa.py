"""sdpa_attention_forward: what it refuses, is_causal handling, GQA with and without masks."""

from __future__ import annotations

import pytest
import torch

from kernel_loader.attention import sdpa_attention_forward
from kernel_loader.errors import UnsupportedAttentionOptionError

from ..conftest import make_case, module, reference_attention


@pytest.mark.parametrize(
    "kwargs,match",
    [({"softcap": 30.0}, "softcap"), ({"s_aux": torch.zeros(4)}, "sinks"), ({"output_attentions": True}, "eager")],
)
def test_refuses_what_it_cannot_do(kwargs, match):
    case = make_case(b=1, hq=4, hkv=2, sq=3)
    with pytest.raises(UnsupportedAttentionOptionError, match=match):
        sdpa_attention_forward(module(), case.q, case.k, case.v, None, **kwargs)


def test_causal_without_mask_and_gqa_with_mask():
    case = make_case(b=2, hq=4, hkv=2, sq=6, dtype=torch.float64, padding=[(2, 0), (0, 0)])
    out, w = sdpa_attention_forward(module(), case.q, case.k, case.v, None)
    assert w is None
    torch.testing.assert_close(out, reference_attention(case.q, case.k, case.v, causal=True))
    mask = (torch.ones(6, 6, dtype=torch.bool).tril() & case.padding[:, None, :])[:, None]
    out, _ = sdpa_attention_forward(module(), case.q, case.k, case.v, mask)
    ref = reference_attention(case.q, case.k, case.v, causal=True, padding=case.padding)
    torch.testing.assert_close(out[case.padding], ref[case.padding])


def test_decode_token_sees_every_key_and_window_is_applied():
    case = make_case(b=1, hq=2, hkv=1, sq=1, skv=6, dtype=torch.float64)
    out, _ = sdpa_attention_forward(module(), case.q, case.k, case.v, None)
    torch.testing.assert_close(out, reference_attention(case.q, case.k, case.v, causal=True))
    out, _ = sdpa_attention_forward(module(), case.q, case.k, case.v, None, sliding_window=2)
    torch.testing.assert_close(out, reference_attention(case.q, case.k, case.v, causal=True, window=2))


def test_position_bias_is_added():
    case = make_case(b=1, hq=2, hkv=2, sq=4, dtype=torch.float64)
    bias = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    out, _ = sdpa_attention_forward(module(), case.q, case.k, case.v, None, position_bias=bias)
    scores = case.q @ case.k.transpose(-1, -2) / 4.0 + bias
    scores = scores.masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
    ref = (scores.softmax(-1) @ case.v).transpose(1, 2)
    torch.testing.assert_close(out, ref)
