"""Row offsets past 2**31 elements: the kernels switch to 64-bit offsets for tensors that large.

A row offset is a row index times a row stride. In 32 bits it wraps once the product passes
2**31 elements, which transformers' continuous batching reaches in its CUDA-graph warm-up (one
sequence of 8192 queries over a 14.5M-row paged cache, row stride 256), and any layout with
half a million tokens of 32 heads of 128. ``needs_wide_offsets`` decides on the host from each
tensor's rows and stride; only such tensors compile the 64-bit variant, so every other call keeps
the code it had (checked offline: ``bench/ptx_equivalence.py`` reports identical PTX).

On the CPU the kernels run under the interpreter with every load and store checked against the
launch's buffers (``interpreter_bounds``); a key tensor whose rows are 2**30 elements apart (a
view of a 4 GiB buffer whose pages are never touched) puts its third row past the limit.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from flash_ref import load_flash_attn2, reference
from interpreter_bounds import caused_by_out_of_bounds, within_arguments

fa = load_flash_attn2()
tile = importlib.import_module(fa.__name__ + "._triton_tile")
fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
bwd = importlib.import_module(fa.__name__ + "._triton_bwd")

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the bounds checks need the Triton interpreter (TRITON_INTERPRET=1)")
ROW_STRIDE = 2**30  # row 2 of the key tensor starts at element 2**31


def test_needs_wide_offsets_flips_where_a_row_offset_reaches_2_to_the_31():
    # spans: row count times row stride, as the callers hold them
    assert not tile.needs_wide_offsets((2**31 // 4096 - 1) * 4096)  # [B, S, 32, 128], S just below
    assert tile.needs_wide_offsets((2**31 // 4096) * 4096)
    assert tile.needs_wide_offsets(14518528 * 256)  # transformers' warm-up: [total, 4, 64]
    assert not tile.needs_wide_offsets((2**31 // 256 - 1) * 256, 100 * 4096)


def _sparse_keys(rows: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k and v ``[1, rows, 1, d]`` whose rows lie ROW_STRIDE elements apart in one buffer (v one
    vector after k), and compact copies of them for the reference."""
    buffer = torch.empty((rows - 1) * ROW_STRIDE + 2 * d, dtype=dtype)  # virtual: pages untouched
    k = buffer.as_strided((1, rows, 1, d), (0, ROW_STRIDE, d, 1))
    v = buffer.as_strided((1, rows, 1, d), (0, ROW_STRIDE, d, 1), storage_offset=d)
    g = torch.Generator().manual_seed(0)
    for r in range(rows):
        k[0, r, 0] = torch.randn(d, generator=g).to(dtype)
        v[0, r, 0] = torch.randn(d, generator=g).to(dtype)
    return k, v, buffer


@interpreted
def test_forward_and_backward_read_keys_past_2_to_the_31_elements():
    rows, d, dtype = 3, 16, torch.float16
    k, v, _buffer = _sparse_keys(rows, d, dtype)
    assert tile.needs_wide_offsets(k.shape[1] * k.stride(1))
    q = torch.randn(1, 5, 1, d, dtype=dtype, requires_grad=True)
    with within_arguments() as seen:
        out = fa.flash_attn_func(q, k, v)
        out.backward(torch.ones_like(out))
    assert seen["accesses"] > 0
    qr = q.detach().clone().requires_grad_()
    want, _ = reference(qr, k.contiguous(), v.contiguous())
    want.backward(torch.ones_like(want))
    torch.testing.assert_close(out.double(), want, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(q.grad.double(), qr.grad.double(), atol=3e-3, rtol=3e-3)


@interpreted
def test_varlen_forward_reads_keys_past_2_to_the_31_elements():
    rows, d, dtype = 3, 16, torch.float16
    k4, v4, _buffer = _sparse_keys(rows, d, dtype)
    k, v = k4[0], v4[0]  # packed [total_k, H, D] with row stride 2**30
    q = torch.randn(4, 1, d, dtype=dtype)
    cu_q = torch.tensor([0, 4], dtype=torch.int32)
    cu_k = torch.tensor([0, rows], dtype=torch.int32)
    with within_arguments():
        out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, rows)
    want, _ = reference(q[None], k4.contiguous(), v4.contiguous())
    torch.testing.assert_close(out.double(), want[0], atol=2e-3, rtol=2e-3)


@interpreted
def test_32_bit_offsets_would_read_outside_the_key_buffer(monkeypatch):
    """The control: with the 64-bit variant switched off, the same call reads before the buffer
    (on a GPU: an illegal memory access, or another tensor's bytes)."""
    k, v, _buffer = _sparse_keys(3, 16, torch.float16)
    q = torch.randn(1, 5, 1, 16, dtype=torch.float16)
    monkeypatch.setattr(fwd, "needs_wide_offsets", lambda *spans: False)
    with within_arguments(), pytest.raises(Exception) as raised:
        fa.flash_attn_func(q, k, v)
    assert caused_by_out_of_bounds(raised.value), raised.value


@interpreted
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_the_64_bit_variant_gives_the_same_bits(monkeypatch, varlen):
    """Only address arithmetic differs between the two variants: outputs and gradients match
    bit for bit on ordinary tensors (causal, GQA, ragged head dim, softcap)."""
    torch.manual_seed(1)
    d, hq, hk = 40, 4, 2
    opts = dict(causal=True, softcap=20.0)
    if varlen:
        lens = [5, 0, 9]
        cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
        shape_q, shape_k = (14, hq, d), (14, hk, d)
    else:
        shape_q, shape_k = (2, 9, hq, d), (2, 9, hk, d)
    q0, k0, v0 = torch.randn(*shape_q), torch.randn(*shape_k), torch.randn(*shape_k)
    dout = torch.randn(*shape_q)

    def run():
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        if varlen:
            out = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), **opts)
        else:
            out = fa.flash_attn_func(q, k, v, **opts)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    narrow = run()
    monkeypatch.setattr(fwd, "needs_wide_offsets", lambda *spans: True)
    monkeypatch.setattr(bwd, "needs_wide_offsets", lambda *spans: True)
    wide = run()
    for a, b in zip(narrow, wide):
        assert torch.equal(a, b)
