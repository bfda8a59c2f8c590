"""The FlashAttention wrapper: unpad/pad, varlen from cu_seq_lens and position_ids, option checks.

Most cases run against ``varlen_only``: a test double of a *kernel* (plain PyTorch, only
``flash_attn_varlen_func``, no softcap parameter) so the paths the wrapper picks and the options
it refuses can be seen. The shipped kernel runs the same paths in test_parity.py.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from kernel_loader.attention import flash_attention_forward, make_flash_attention
from kernel_loader.attention.backends.flash import cu_seqlens_from_position_ids, flash_kernel, pad_input, unpad_input
from kernel_loader.errors import UnsupportedAttentionOptionError, UnusableKernelError

from ..conftest import make_case, module, reference_attention


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
            causal=False, window_size=(-1, -1)):
    calls.append(("varlen", [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]))
    out = torch.zeros_like(q)
    rep = q.shape[1] // k.shape[1]
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi = q[qs:qe].transpose(0, 1).double()
        ki = k[ks:ke].repeat_interleave(rep, 1).transpose(0, 1).double()
        vi = v[ks:ke].repeat_interleave(rep, 1).transpose(0, 1).double()
        s = qi @ ki.transpose(-1, -2) * (softmax_scale or 1 / math.sqrt(q.shape[-1]))
        lq, lk = qe - qs, ke - ks
        qpos = torch.arange(lq)[:, None] + (lk - lq)  # bottom-right
        kpos = torch.arange(lk)[None]
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            allowed &= kpos <= qpos
        if window_size[0] >= 0:
            allowed &= kpos >= qpos - window_size[0]
        if window_size[1] >= 0:
            allowed &= kpos <= qpos + window_size[1]
        s = s.masked_fill(~allowed, float("-inf"))
        out[qs:qe] = (s.softmax(-1).nan_to_num(0) @ vi).transpose(0, 1).to(q.dtype)
    return out


calls: list = []
varlen_only = types.ModuleType("varlen_only_kernel")
varlen_only.flash_attn_varlen_func = _varlen


@pytest.fixture(autouse=True)
def _clear_calls():
    calls.clear()


def test_dense_input_goes_through_varlen_when_no_dense_function():
    case = make_case(b=2, hq=4, hkv=2, sq=5)
    out, w = flash_attention_forward(module(), case.q, case.k, case.v, None, kernel=varlen_only)
    assert w is None and out.shape == (2, 5, 4, 16) and out.is_contiguous()
    assert calls == [("varlen", [0, 5, 10], [0, 5, 10])]
    torch.testing.assert_close(out.double(), reference_attention(case.q, case.k, case.v), atol=1e-5, rtol=1e-5)


def test_padding_mask_unpads_and_pads_back():
    case = make_case(b=2, hq=2, hkv=2, sq=6, padding=[(2, 0), (0, 1)])
    out, _ = flash_attention_forward(module(), case.q, case.k, case.v, case.padding, kernel=varlen_only)
    assert calls[0][1] == [0, 4, 9]
    ref = reference_attention(case.q, case.k, case.v, padding=case.padding)
    torch.testing.assert_close(out.double()[case.padding], ref[case.padding], atol=1e-5, rtol=1e-5)
    assert float(out[~case.padding].abs().max()) == 0.0  # padded positions stay zero


def test_explicit_cu_seq_lens_and_position_ids():
    case = make_case(b=1, hq=2, hkv=1, sq=7)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    a, _ = flash_attention_forward(module(), case.q, case.k, case.v, None, kernel=varlen_only,
                                   cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4, max_length_k=4)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    b, _ = flash_attention_forward(module(), case.q, case.k, case.v, None, kernel=varlen_only, position_ids=pos)
    assert calls[0][1] == calls[1][1] == [0, 3, 7]
    torch.testing.assert_close(a, b)
    seq_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    ref = reference_attention(case.q, case.k, case.v, seq_ids=seq_ids, positions=pos)
    torch.testing.assert_close(a.double(), ref, atol=1e-5, rtol=1e-5)


def test_cu_seqlens_from_position_ids():
    cu, longest = cu_seqlens_from_position_ids(torch.tensor([[0, 1, 0, 1, 2, 0]]))
    assert cu.tolist() == [0, 2, 5, 6] and longest == 3 and cu.dtype == torch.int32
    # rows never merge, even when the numbering continues across them
    cu, _ = cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2], [3, 4, 5]]))
    assert cu.tolist() == [0, 3, 6]


def test_packed_sequences_in_several_rows():
    case = make_case(b=2, hq=2, hkv=2, sq=5)
    pos = torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 3, 0]])
    out, _ = flash_attention_forward(module(), case.q, case.k, case.v, None, kernel=varlen_only, position_ids=pos)
    assert calls[0][1] == [0, 2, 5, 9, 10]
    seq_ids = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    ref = reference_attention(case.q, case.k, case.v, seq_ids=seq_ids, positions=pos)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_several_rows_with_a_cache_are_not_packed_and_their_positions_are_not_read():
    """As in transformers, a cached batch of several rows is never packed; the wrapper does not
    even read the positions (a meta tensor has no values to read: reading would raise)."""
    case = make_case(b=2, hq=2, hkv=2, sq=5)
    pos = torch.empty(2, 5, dtype=torch.long, device="meta")
    out, _ = flash_attention_forward(module(), case.q, case.k, case.v, None, kernel=varlen_only, position_ids=pos,
                                     use_cache=True)
    assert calls == [("varlen", [0, 5, 10], [0, 5, 10])]  # one sequence per row
    torch.testing.assert_close(out.double(), reference_attention(case.q, case.k, case.v), atol=1e-5, rtol=1e-5)


def test_one_packed_row_is_packed_with_or_without_a_cache():
    case = make_case(b=1, hq=2, hkv=2, sq=5)
    pos = torch.tensor([[0, 1, 0, 1, 2]])
    out, _ = flash_attention_forward(module(), case.q, case.k, case.v, None, kernel=varlen_only, position_ids=pos,
                                     use_cache=True)
    assert calls[0][1] == [0, 2, 5]
    ref = reference_attention(case.q, case.k, case.v, seq_ids=torch.tensor([[0, 0, 1, 1, 1]]), positions=pos)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_unpad_pad_roundtrip():
    x = torch.randn(2, 4, 3)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    packed, idx, cu, longest = unpad_input(x, mask)
    assert packed.shape == (5, 3) and cu.tolist() == [0, 3, 5] and longest == 3
    back = pad_input(packed, idx, 2, 4)
    torch.testing.assert_close(back[mask], x[mask])
    assert float(back[~mask].abs().max()) == 0.0


def test_options_the_kernel_lacks_raise():
    case = make_case(b=1, hq=2, hkv=2, sq=4)
    with pytest.raises(UnsupportedAttentionOptionError, match="softcap"):
        flash_attention_forward(module(), case.q, case.k, case.v, None, kernel=varlen_only, softcap=30.0)
    with pytest.raises(UnsupportedAttentionOptionError, match="sinks"):
        flash_attention_forward(module(), case.q, case.k, case.v, None, kernel=varlen_only, s_aux=torch.zeros(2))
    with pytest.raises(UnsupportedAttentionOptionError, match="2D padding mask"):
        flash_attention_forward(module(), case.q, case.k, case.v, torch.ones(1, 1, 4, 4, dtype=torch.bool),
                                kernel=varlen_only)
    with pytest.raises(UnsupportedAttentionOptionError, match="weights"):
        flash_attention_forward(module(), case.q, case.k, case.v, None, kernel=varlen_only, output_attentions=True)
    # a window shorter than the keys is passed, not dropped
    flash_attention_forward(module(), case.q, case.k, case.v, None, kernel=varlen_only, sliding_window=2)


def test_extra_transformers_kwargs_are_tolerated():
    case = make_case(b=1, hq=2, hkv=2, sq=3)
    fn = make_flash_attention(varlen_only)
    out, _ = fn(module(), case.q, case.k, case.v, None, cache_position=torch.arange(3), layer_idx=0,
                output_attentions=False, some_future_kwarg=1)
    assert out.shape == (1, 3, 2, 16)


def test_module_without_varlen_is_unusable():
    with pytest.raises(UnusableKernelError, match="flash_attn_varlen_func"):
        flash_kernel(types.ModuleType("nothing_here"))


def test_flash_attn_package_refuses_cpu_and_fp32():
    fake = types.ModuleType("flash_attn")  # named like the CUDA-only package
    fake.flash_attn_varlen_func = _varlen
    case = make_case(b=1, hq=2, hkv=2, sq=3)
    with pytest.raises(UnsupportedAttentionOptionError, match="CUDA"):
        flash_attention_forward(module(), case.q, case.k, case.v, None, kernel=fake)


def test_value_head_dim_smaller_than_query():
    case = make_case(b=1, hq=2, hkv=2, sq=4)
    v = case.v[..., :8]
    out, _ = flash_attention_forward(module(), case.q, case.k, v, None, kernel=varlen_only)
    assert out.shape == (1, 4, 2, 8)
    torch.testing.assert_close(out.double(), reference_attention(case.q, case.k, v), atol=1e-5, rtol=1e-5)


def test_per_forward_checks_ask_the_device_once_per_tensor_and_again_after_a_change():
    # Each layer gets the same mask object; asking "all ones?" per layer would sync per layer.
    from kernel_loader.attention.backends.flash import _PerTensorAnswer

    asked = []

    def question(t):
        asked.append(t)
        return bool(t.all())

    all_true = _PerTensorAnswer(question)
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert all_true(mask) and all_true(mask) and all_true(mask)
    assert len(asked) == 1
    mask[0, 0] = False  # in place: the version counter moves, so the answer is recomputed
    assert not all_true(mask)
    assert len(asked) == 2
    other = torch.ones(2, 5, dtype=torch.bool)  # equal content, another object: asked again
    assert all_true(other)
    assert len(asked) == 3


def _spy_on(kernel):
    """The shipped kernel's FlashAttention functions, each call recorded by name."""
    spy = types.ModuleType("spy_kernel")
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_decode_heads_first"):
        real = getattr(kernel, name)

        def recorded(*args, _real=real, _name=name, **kwargs):
            calls.append((_name,))
            return _real(*args, **kwargs)

        recorded.__signature__ = __import__("inspect").signature(real)
        setattr(spy, name, recorded)
    return spy


def _shipped_spy():
    import warnings

    from kernel_loader.loader import get_bundled_kernel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _spy_on(get_bundled_kernel("kernels-community/flash-attn2"))


@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_steps_take_the_heads_first_entry_and_training_steps_flash_attn_func(q_len):
    """A kernel with ``flash_attn_decode_heads_first`` (ours) gets decode steps in transformers'
    layout, skipping the transposed views; calls that need gradients use flash_attn_func."""
    fn = make_flash_attention(_shipped_spy())
    case = make_case(b=2, hq=8, hkv=2, sq=q_len, skv=37, d=32, seed=11)
    mod = module()
    ref = reference_attention(case.q, case.k, case.v, causal=True, window=20)

    with torch.no_grad():
        out, _ = fn(mod, case.q, case.k, case.v, None, is_causal=True, sliding_window=20)
    assert calls == [("flash_attn_decode_heads_first",)]
    assert out.shape == (2, q_len, 8, 32) and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)

    calls.clear()
    q = case.q.clone().requires_grad_()
    out, _ = fn(mod, q, case.k, case.v, None, is_causal=True, sliding_window=20)
    assert calls == [("flash_attn_decode_heads_first",), ("flash_attn_func",)]  # declined, then served
    torch.testing.assert_close(out.detach().double(), ref, atol=2e-5, rtol=2e-5)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_calls_the_heads_first_entry_declines_take_flash_attn_func():
    fn = make_flash_attention(_shipped_spy())
    case = make_case(b=1, hq=4, hkv=2, sq=20, skv=30, d=16, seed=3)  # 20 query tokens: not a decode step
    with torch.no_grad():
        out, _ = fn(module(), case.q, case.k, case.v, None, is_causal=True)
    assert calls == [("flash_attn_decode_heads_first",), ("flash_attn_func",)]
    torch.testing.assert_close(out.double(), reference_attention(case.q, case.k, case.v, causal=True),
                               atol=2e-5, rtol=2e-5)
