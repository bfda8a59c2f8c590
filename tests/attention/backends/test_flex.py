"""flex_attention_forward on the CPU (uncompiled: see the module docstring for the timing)."""

from __future__ import annotations

import pytest
import torch

from kernel_loader.attention import flex_attention_forward
from kernel_loader.errors import UnsupportedAttentionOptionError

from ..conftest import make_case, module, reference_attention


def test_refuses_dropout_sinks_and_weights():
    case = make_case(b=1, hq=2, hkv=2, sq=3)
    with pytest.raises(UnsupportedAttentionOptionError, match="dropout"):
        flex_attention_forward(module(training=True), case.q, case.k, case.v, None, dropout=0.1)
    with pytest.raises(UnsupportedAttentionOptionError, match="sinks"):
        flex_attention_forward(module(), case.q, case.k, case.v, None, s_aux=torch.zeros(2))
    with pytest.raises(UnsupportedAttentionOptionError):
        flex_attention_forward(module(), case.q, case.k, case.v, None, output_attentions=True)


def test_mask_none_is_causal_and_float_mask_goes_through_score_mod():
    case = make_case(b=1, hq=4, hkv=2, sq=5)
    out, _ = flex_attention_forward(module(), case.q, case.k, case.v, None, softcap=3.0)
    ref = reference_attention(case.q, case.k, case.v, causal=True, softcap=3.0)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    pad = torch.tensor([[False, True, True, True, True]])
    allowed = torch.ones(5, 5, dtype=torch.bool).tril() & pad[:, None, :]
    float_mask = torch.zeros(1, 1, 5, 5).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    out, _ = flex_attention_forward(module(), case.q, case.k, case.v, float_mask)
    ref = reference_attention(case.q, case.k, case.v, causal=True, padding=pad)
    torch.testing.assert_close(out.double()[pad], ref[pad], atol=2e-5, rtol=2e-5)


def test_non_power_of_two_heads_repeat_kv():
    case = make_case(b=1, hq=6, hkv=2, sq=4)
    out, _ = flex_attention_forward(module(), case.q, case.k, case.v, None)
    torch.testing.assert_close(out.double(), reference_attention(case.q, case.k, case.v), atol=2e-5, rtol=2e-5)


def test_compiled_flex_on_cpu_matches():
    """torch.compile(flex_attention) works on the CPU too; it is only slow to compile (see flex.py)."""
    import time

    case = make_case(b=1, hq=2, hkv=2, sq=16)
    start = time.perf_counter()
    out, _ = flex_attention_forward(module(), case.q, case.k, case.v, None, flex_compile=True)
    compile_s = time.perf_counter() - start
    torch.testing.assert_close(out.double(), reference_attention(case.q, case.k, case.v), atol=2e-5, rtol=2e-5)
    print(f"compiled flex_attention, first call on this CPU: {compile_s:.1f} s")
