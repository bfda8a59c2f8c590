"""flash_attn_func (and the packed variants) of the shipped flash-attn2 repo vs an fp64 reference.

The Triton kernels run under TRITON_INTERPRET=1 (conftest sets it); the PyTorch path runs with
TRITON_INTERPRET=0 for the call. Inputs are fresh random numbers each run; every buffer the
kernels allocate is NaN-poisoned, so an unwritten element fails. Checked: out, lse, dq, dk, dv.
"""

from __future__ import annotations

import pytest
import torch

from flash_ref import assert_out_and_grads_close, lse_err, load_flash_attn2, poisoned_allocations, reference, rel_err

fa = load_flash_attn2()

# Relative error bounds against fp64: fp16 operands ~1e-3, fp32 far below.
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}
LSE_TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}

# (batch, seq_q, seq_k, heads_q, heads_k, head_dim, dtype, options)
CASES = {
    "plain-d64": (2, 33, 33, 2, 2, 64, torch.float16, {}),
    "causal-sq<sk-gqa-d40": (1, 17, 40, 4, 2, 40, torch.float16, dict(causal=True)),
    "causal-sq>sk-mqa-d80": (1, 40, 17, 2, 1, 80, torch.float32, dict(causal=True)),
    "causal-sq1": (2, 1, 63, 2, 2, 32, torch.float16, dict(causal=True)),
    "window-d96": (1, 100, 100, 2, 2, 96, torch.float16, dict(window_size=(10, 5))),
    "window-left-softcap-d128": (1, 50, 60, 2, 2, 128, torch.float32, dict(window_size=(7, -1), softcap=5.0)),
    "causal-alibi2d-softcap": (2, 30, 37, 4, 2, 32, torch.float16, dict(causal=True, softcap=3.0, alibi=(2, 4))),
    "alibi1d-scale": (1, 45, 45, 2, 2, 64, torch.float16, dict(alibi=(2,), softmax_scale=0.3)),
    "causal-window-sq>sk": (1, 48, 29, 2, 2, 32, torch.float32, dict(causal=True, window_size=(6, -1))),
    "causal-d256": (1, 20, 24, 2, 2, 256, torch.float16, dict(causal=True)),
}


def _inputs(b, sq, sk, hq, hk, d, dtype, noncontig=False):
    if noncontig:
        # [B, H, S, D] storage seen as [B, S, H, D], plus a sliced head_dim: odd strides everywhere.
        q = torch.randn(b, hq, sq, d + 8, dtype=dtype).transpose(1, 2)[..., :d]
        k = torch.randn(b, hk, sk, d, dtype=dtype).transpose(1, 2)
        v = torch.randn(b, sk, 2 * hk, d, dtype=dtype)[:, :, ::2]
    else:
        q = torch.randn(b, sq, hq, d, dtype=dtype)
        k = torch.randn(b, sk, hk, d, dtype=dtype)
        v = torch.randn(b, sk, hk, d, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def _run_and_compare(b, sq, sk, hq, hk, d, dtype, opts, noncontig=False):
    opts = dict(opts)
    alibi = opts.pop("alibi", None)
    slopes = torch.rand(*alibi) if alibi is not None else None
    q, k, v = _inputs(b, sq, sk, hq, hk, d, dtype, noncontig)
    dout = torch.randn(b, sq, hq, d, dtype=dtype)
    with poisoned_allocations():
        out, lse, probs = fa.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **opts)
        out.backward(dout)
    assert probs is None
    assert out.shape == (b, sq, hq, d) and out.dtype == dtype
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, alibi_slopes=slopes, **opts)
    ref_out.backward(dout.double())
    assert_out_and_grads_close(out, ref_out, (q, k, v), (qr, kr, vr), TOL[dtype])
    assert lse_err(lse, ref_lse) < LSE_TOL[dtype]


@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference(case):
    _run_and_compare(*CASES[case])


def test_triton_noncontiguous_inputs():
    _run_and_compare(1, 37, 29, 4, 2, 64, torch.float16, dict(causal=True), noncontig=True)


@pytest.mark.parametrize("layout", ["flash", "transformers"])
def test_out_and_gradients_are_contiguous_whatever_the_inputs_layout(layout):
    """[B, S, H, D] tensors, or transformers' [B, H, S, D] ones seen as [B, S, H, D]: the output
    and the gradients come back contiguous, shaped and typed like the inputs."""
    torch.manual_seed(0)
    if layout == "flash":
        q, k, v = (torch.randn(2, 24, 4, 32, dtype=torch.float16) for _ in range(3))
    else:
        q, k, v = (torch.randn(2, 4, 24, 32, dtype=torch.float16).transpose(1, 2) for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fa.flash_attn_func(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for t in (out, dq, dk, dv):
        assert t.shape == q.shape and t.dtype == q.dtype and t.is_contiguous()
        assert t.stride() == torch.empty(q.shape).stride()


# Inference calls with few query tokens (decode steps) take the split-K decode kernel.
DECODE_CASES = {
    "q1-gqa-causal": (3, 1, 70, 8, 2, 64, torch.float16, dict(causal=True)),
    "q3-mqa-window-softcap": (2, 3, 45, 4, 1, 40, torch.float32, dict(causal=True, window_size=(9, -1), softcap=4.0)),
    "q16-alibi-noncausal": (1, 16, 33, 2, 2, 96, torch.float16, dict(alibi=(2,))),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_inference_with_few_query_tokens_takes_the_decode_kernel(case, monkeypatch):
    import importlib

    autograd = importlib.import_module(fa.__name__ + "._autograd")
    b, sq, sk, hq, hk, d, dtype, opts = DECODE_CASES[case]
    opts = dict(opts)
    alibi = opts.pop("alibi", None)
    slopes = torch.rand(*alibi) if alibi is not None else None
    q, k, v = (t.detach() for t in _inputs(b, sq, sk, hq, hk, d, dtype, noncontig=(sq == 3)))
    calls = []
    real = autograd._decode
    monkeypatch.setattr(autograd, "_decode", lambda *a: calls.append(1) or real(*a))
    with poisoned_allocations(), torch.no_grad():
        out, lse, _ = fa.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **opts)
        plain = fa.flash_attn_func(q, k, v, alibi_slopes=slopes, **opts)
    assert calls == [1, 1]
    ref_out, ref_lse = reference(q.double(), k.double(), v.double(), alibi_slopes=slopes, **opts)
    assert rel_err(out, ref_out) < TOL[dtype]
    assert torch.equal(out, plain)
    assert lse_err(lse, ref_lse) < LSE_TOL[dtype]


@pytest.mark.parametrize("case", ["q1-gqa-causal", "q3-mqa-window-softcap"])
def test_decode_heads_first_equals_flash_attn_func_on_transposed_views(case):
    """transformers' [B, H, S, D] tensors in, the same output as through [B, S, H, D] views."""
    b, sq, sk, hq, hk, d, dtype, opts = DECODE_CASES[case]
    q = torch.randn(b, hq, sq, d, dtype=dtype)
    k = torch.randn(b, hk, sk + 5, d, dtype=dtype)[:, :, :sk]  # a cache with spare slots: odd strides
    v = torch.randn(b, hk, sk, d, dtype=dtype)
    scale = 0.2
    with torch.no_grad(), poisoned_allocations():
        out = fa.flash_attn_decode_heads_first(q, k, v, scale, opts.get("causal", False),
                                               opts.get("window_size", (-1, -1)), opts.get("softcap", 0.0))
        via_func = fa.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                      softmax_scale=scale, **opts)
    assert out.shape == (b, sq, hq, d) and out.is_contiguous()
    assert torch.equal(out, via_func)
    ref, _ = reference(*(t.transpose(1, 2).double() for t in (q, k, v)), softmax_scale=scale, **opts)
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_reads_any_head_dim_stride():
    """The decode kernel reads head_dim contiguously; other strides are copied first, not misread."""
    q = torch.randn(2, 1, 4, 32, 2, dtype=torch.float16)[..., 0]  # stride 2 along head_dim
    k = torch.randn(2, 19, 2, 32, 3, dtype=torch.float16)[..., 1]
    v = torch.randn(2, 19, 2, 32, dtype=torch.float16)
    with torch.no_grad(), poisoned_allocations():
        out = fa.flash_attn_func(q, k, v, causal=True)
    ref, _ = reference(q.double(), k.double(), v.double(), causal=True)
    assert rel_err(out, ref) < TOL[torch.float16]


@pytest.mark.parametrize("why, change", [
    ("17 query tokens", lambda q, k, v: (torch.randn(1, 4, 17, 32, dtype=torch.float16), k, v)),
    ("more queries than keys", lambda q, k, v: (torch.randn(1, 4, 8, 32, dtype=torch.float16), k[:, :, :4], v[:, :, :4])),
    ("gradients needed", lambda q, k, v: (q.clone().requires_grad_(), k, v)),
    ("bfloat16 under the interpreter", lambda q, k, v: (q.bfloat16(), k.bfloat16(), v.bfloat16())),
    ("float64 (no kernel dtype)", lambda q, k, v: (q.double(), k.double(), v.double())),
    ("heads not a multiple", lambda q, k, v: (torch.randn(1, 3, 1, 32, dtype=torch.float16), k, v)),
    ("k and v differ", lambda q, k, v: (q, k, v[:, :, :-1])),
])
def test_decode_heads_first_declines_what_it_does_not_serve(why, change):
    q = torch.randn(1, 4, 1, 32, dtype=torch.float16)
    k = torch.randn(1, 2, 20, 32, dtype=torch.float16)
    v = torch.randn(1, 2, 20, 32, dtype=torch.float16)
    assert fa.flash_attn_decode_heads_first(*change(q, k, v), None, True) is None, why
    # the unchanged call is served (None as softcap means none)
    assert fa.flash_attn_decode_heads_first(q, k, v, None, True, (-1, -1), None).shape == (1, 1, 4, 32)


def test_decode_heads_first_declines_a_scale_flash_attn_func_refuses():
    q = torch.randn(1, 4, 1, 32, dtype=torch.float16)
    k, v = (torch.randn(1, 2, 20, 32, dtype=torch.float16) for _ in range(2))
    assert fa.flash_attn_decode_heads_first(q, k, v, -0.2, True) is None
    with pytest.raises(ValueError, match="softmax_scale"):
        fa.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=-0.2, causal=True)


def test_inference_without_lse_returns_the_same_output():
    q, k, v = (t.detach() for t in _inputs(2, 40, 50, 4, 2, 64, torch.float16))
    with torch.no_grad(), poisoned_allocations():
        with_lse, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        without = fa.flash_attn_func(q, k, v, causal=True)
    assert lse is not None and torch.equal(with_lse, without)


@pytest.mark.parametrize("case", ["plain-d64", "causal-sq>sk-mqa-d80", "window-left-softcap-d128", "causal-alibi2d-softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_reference(case, dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    b, sq, sk, hq, hk, d, _, opts = CASES[case]
    _run_and_compare(b, sq, sk, hq, hk, d, dtype, opts)


def test_triton_dropout_mask_is_shared_by_forward_and_backward():
    """Replay the kernels' own mask through the reference: out and all grads must agree."""
    import importlib

    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    autograd = importlib.import_module(fa.__name__ + "._autograd")
    b, sq, sk, hq, hk, d, p = 1, 29, 37, 2, 1, 32, 0.25
    q, k, v = _inputs(b, sq, sk, hq, hk, d, torch.float32)
    dout = torch.randn(b, sq, hq, d)
    torch.manual_seed(1234)
    seed = autograd.draw_seed()
    torch.manual_seed(1234)
    with poisoned_allocations():
        out = fa.flash_attn_func(q, k, v, dropout_p=p, causal=True)
        out.backward(dout)
    keep = fwd.dropout_keep_mask(seed, b, hq, sq, sk, p, q.device)
    kept = keep.float().mean().item()
    assert abs(kept - (1 - p)) < 0.05, kept  # 2146 draws: sigma ~0.009
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, _ = reference(qr, kr, vr, causal=True, keep_mask=keep, dropout_p=p)
    ref_out.backward(dout.double())
    for got, want in ((out, ref_out), (q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        assert rel_err(got, want) < 1e-5
    # Without the mask the result must differ: dropout really was applied.
    plain, _ = reference(qr, kr, vr, causal=True)
    assert rel_err(out, plain) > 0.05


def test_torch_path_dropout_is_seeded_and_unbiased(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (torch.randn(1, 64, 2, 16) for _ in range(3))
    torch.manual_seed(7)
    a = fa.flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(7)
    b = fa.flash_attn_func(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)
    # Averaged over many masks, inverted dropout is unbiased.
    mean = torch.stack([fa.flash_attn_func(q, k, v, dropout_p=0.5) for _ in range(200)]).mean(0)
    assert rel_err(mean, reference(q, k, v)[0]) < 0.1


def test_packed_variants_match_unpacked():
    qkv = torch.randn(2, 19, 3, 2, 32, dtype=torch.float16, requires_grad=True)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    out.sum().backward()
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    ref = fa.flash_attn_func(q, k, v, causal=True)
    ref.sum().backward()
    assert torch.equal(out, ref)
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=2))
    kv = torch.randn(2, 23, 2, 1, 32, dtype=torch.float16)
    out2 = fa.flash_attn_kvpacked_func(q, kv, window_size=(4, 4))
    assert torch.equal(out2, fa.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], window_size=(4, 4)))


def test_empty_key_rows_give_zero_and_inf_lse():
    """Causal with seq_q > seq_k: the first rows see no key (flash-attn: out 0, lse +inf)."""
    q, k, v = (torch.randn(1, n, 2, 32, dtype=torch.float16) for n in (9, 4, 4))
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out[0, :5], torch.zeros_like(out[0, :5]))
    assert torch.isinf(lse[0, :, :5]).all() and torch.isfinite(lse[0, :, 5:]).all()


@pytest.mark.parametrize("order, l2_budget", [("in_order", None), ("per_head", None), ("heavy_first", None),
                                              ("heavy_first", 1)], ids=["in_order", "per_head", "heavy_first",
                                                                        "heavy_first-chunk-per-group"])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(5, 3)), dict(window_size=(4, -1))],
                         ids=["causal", "window", "left-window"])
def test_every_launch_order_computes_every_row_block_of_every_head(order, l2_budget, opts, monkeypatch):
    """The order only decides which programs start first: each writes its own rows."""
    import importlib

    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    if l2_budget is not None:  # one GQA group per chunk: 3 x 4 heads run as 6 chunks of 2
        monkeypatch.setattr(fwd, "L2_BUDGET_BYTES", l2_budget)
    q = torch.randn(3, 53, 4, 32, dtype=torch.float16)  # 4 row blocks of 16 under the interpreter
    k, v = (torch.randn(3, 47, 2, 32, dtype=torch.float16) for _ in range(2))
    with poisoned_allocations():
        out, lse = fwd.attention_forward(q, k, v, softmax_scale=32 ** -0.5, row_order=order,
                                         causal=opts.get("causal", False),
                                         window_size=opts.get("window_size", (-1, -1)))
    ref_out, ref_lse = reference(q.double(), k.double(), v.double(), **opts)
    assert rel_err(out, ref_out) < TOL[torch.float16]
    assert lse_err(lse, ref_lse) < LSE_TOL[torch.float16]


@pytest.mark.parametrize("one_loop", [True, False], ids=["one-loop", "two-loops"])
@pytest.mark.parametrize("sk", [48, 47], ids=["keys-multiple-of-block", "ragged-keys"])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(5, 3)), dict(causal=True, window_size=(9, -1)),
                                  dict(causal=True, softcap=4.0)],
                         ids=["causal", "window", "causal-left-window", "causal-softcap"])
@pytest.mark.parametrize("sq", [53, 40], ids=["sq>sk", "sq<sk"])
def test_diagonal_blocks_in_one_loop_or_two_give_the_reference(one_loop, sk, opts, sq):
    """Right-bounded rows walk the bulk and the diagonal in one loop (masking from the diagonal
    on) or in two; either way every row is right, whether or not the keys fill the last block."""
    import importlib

    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    q = torch.randn(2, sq, 4, 32, dtype=torch.float16)
    k, v = (torch.randn(2, sk, 2, 32, dtype=torch.float16) for _ in range(2))
    with poisoned_allocations():
        out, lse = fwd.attention_forward(q, k, v, softmax_scale=32 ** -0.5, merge_diag=one_loop,
                                         causal=opts.get("causal", False), softcap=opts.get("softcap", 0.0),
                                         window_size=opts.get("window_size", (-1, -1)))
    ref_out, ref_lse = reference(q.double(), k.double(), v.double(), **opts)
    assert rel_err(out, ref_out) < TOL[torch.float16]
    assert lse_err(lse, ref_lse) < LSE_TOL[torch.float16]


@pytest.mark.parametrize("heads", [2, 4], ids=["two-heads", "four-heads"])
@pytest.mark.parametrize("order", ["in_order", "per_head", "heavy_first"])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(), dict(window_size=(5, 3)), dict(causal=True, softcap=4.0)],
                         ids=["causal", "full", "window", "causal-softcap"])
@pytest.mark.parametrize("sq, sk", [(53, 47), (40, 53)], ids=["sq>sk", "sq<sk"])
def test_heads_sharing_a_program_give_each_head_its_own_rows(heads, order, opts, sq, sk):
    """With several query heads of a GQA group in one program (the tile's rows split among
    them, each head its own run of query positions), every head still gets its own output and
    lse rows, ragged ends and diagonals included, in every launch order."""
    import importlib

    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    q = torch.randn(3, sq, 8, 32, dtype=torch.float16)  # 2 K/V heads: groups of 4
    k, v = (torch.randn(3, sk, 2, 32, dtype=torch.float16) for _ in range(2))
    with poisoned_allocations():
        out, lse = fwd.attention_forward(q, k, v, softmax_scale=32 ** -0.5, heads_per_program=heads,
                                         row_order=order, config=(32, 16, 4, 1),
                                         causal=opts.get("causal", False), softcap=opts.get("softcap", 0.0),
                                         window_size=opts.get("window_size", (-1, -1)))
    ref_out, ref_lse = reference(q.double(), k.double(), v.double(), **opts)
    assert rel_err(out, ref_out) < TOL[torch.float16]
    assert lse_err(lse, ref_lse) < LSE_TOL[torch.float16]


def test_heads_sharing_a_program_in_packed_sequences_and_strided_views():
    """Packed sequences (per-sequence bounds) and views with odd strides read and write each
    head's rows through its own stride when two heads share a program."""
    import importlib

    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    lens = [19, 1, 34]
    cu = torch.tensor([0, 19, 20, 54], dtype=torch.int32)
    q = torch.randn(54, 4, 40, dtype=torch.float16)
    k = torch.randn(54, 2, 48, dtype=torch.float16)[..., :40]
    v = torch.randn(54, 4, 40, dtype=torch.float16)[:, ::2]
    with poisoned_allocations():
        out, lse = fwd.attention_forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=34,
                                         max_seqlen_k=34, softmax_scale=0.2, causal=True,
                                         heads_per_program=2, config=(32, 16, 4, 1))
    start = 0
    for n in lens:
        rows = slice(start, start + n)
        ref_out, ref_lse = reference(q[None, rows].double(), k[None, rows].double(), v[None, rows].double(),
                                     causal=True, softmax_scale=0.2)
        assert rel_err(out[rows], ref_out[0]) < TOL[torch.float16]
        assert lse_err(lse[:, rows], ref_lse[0]) < LSE_TOL[torch.float16]
        start += n


def test_heads_sharing_a_program_with_seqused_k():
    """seqused_k (per-row key counts, as the KV-cache path passes them) bounds each row's keys and
    aligns its causal mask when two heads share a program."""
    import importlib

    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    q = torch.randn(2, 20, 4, 32, dtype=torch.float16)
    k, v = (torch.randn(2, 30, 2, 32, dtype=torch.float16) for _ in range(2))
    used = torch.tensor([17, 30], dtype=torch.int32)
    with poisoned_allocations():
        out, lse = fwd.attention_forward(q, k, v, seqused_k=used, softmax_scale=0.2, causal=True,
                                         heads_per_program=2, config=(32, 16, 4, 1))
    for b, n in enumerate(used.tolist()):
        ref_out, ref_lse = reference(q[b:b + 1].double(), k[b:b + 1, :n].double(), v[b:b + 1, :n].double(),
                                     causal=True, softmax_scale=0.2)
        assert rel_err(out[b:b + 1], ref_out) < TOL[torch.float16]
        assert lse_err(lse[b:b + 1], ref_lse) < LSE_TOL[torch.float16]


@pytest.mark.parametrize("call, message", [
    (dict(heads_per_program=3), "must divide the GQA group"),
    (dict(heads_per_program=2, dropout_p=0.1), "ALiBi or dropout"),
    (dict(heads_per_program=2, alibi_slopes=torch.rand(4)), "ALiBi or dropout"),
    (dict(heads_per_program=4, config=(16, 16, 4, 1)), None),
    (dict(heads_per_program=3, config=(16, 16, 4, 1)), "does not divide the tile's 16 rows"),
], ids=["not-a-divisor", "dropout", "alibi", "four-heads-in-16-rows", "three-heads-in-16-rows"])
def test_heads_per_program_refuses_what_it_cannot_split(call, message):
    """Heads share a program only where they split the tile's rows evenly and share every
    per-head input; anything else is refused before a launch, naming the reason."""
    import importlib

    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    heads = 3 if call["heads_per_program"] == 3 and "config" in call else 4  # a group of 3 for the tile case
    q = torch.randn(1, 20, heads, 32, dtype=torch.float16)
    k, v = (torch.randn(1, 20, 1, 32, dtype=torch.float16) for _ in range(2))
    if message is None:
        out, _ = fwd.attention_forward(q, k, v, softmax_scale=0.2, causal=True, **call)
        ref_out, _ = reference(q.double(), k.double(), v.double(), causal=True, softmax_scale=0.2)
        assert rel_err(out, ref_out) < TOL[torch.float16]
        return
    with pytest.raises(ValueError, match=message):
        fwd.attention_forward(q, k, v, softmax_scale=0.2, causal=True, **call)


def test_diagonal_loop_rule():
    """One loop for right-bounded rows up to MERGE_DIAG_MAX_KEYS keys, two above; unbounded rows
    have no diagonal; dropout always takes two (its one-loop build faults on sm90)."""
    import importlib

    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    limit = fwd.MERGE_DIAG_MAX_KEYS
    assert fwd._one_loop(True, limit) and fwd._one_loop(True, 1)
    assert not fwd._one_loop(True, limit + 1)
    assert not fwd._one_loop(False, 1024)
    assert not fwd._one_loop(True, 1, dropout=True)


def test_forward_tile_rule():
    """sm90 gives rows bounded on the right 64-row tiles (at d=128 only with GQA or short keys);
    everything else takes the per-head-dim table."""
    import importlib

    cfg = importlib.import_module(fa.__name__ + "._configs")
    small, table = (64, 64, 4, 3), cfg.pick("fwd", (9, 0), 128)
    assert table != small
    assert cfg.pick_fwd((9, 0), 64, True, 1, 16384) == small
    assert cfg.pick_fwd((9, 0), 128, True, 4, 16384) == small
    assert cfg.pick_fwd((9, 0), 128, True, 1, 2048) == small
    assert cfg.pick_fwd((9, 0), 128, True, 1, 4096) == table
    assert cfg.pick_fwd((9, 0), 128, False, 4, 2048) == table
    assert cfg.pick_fwd((9, 0), 256, True, 4, 2048) == cfg.pick("fwd", (9, 0), 256)
    assert cfg.pick_fwd((8, 0), 64, True, 4, 2048) == cfg.pick("fwd", (8, 0), 64)
    assert cfg.pick_fwd(None, 64, True, 4, 2048) == cfg.pick("fwd", None, 64)


def test_two_heads_a_program_rule():
    """On sm90, causal (right-bounded) dense rows at head_dim 64 with an even GQA group put two
    query heads in a 128-row program; MHA, odd groups, other head dims, unbounded rows, calls
    with a left window, ALiBi, dropout or packed sequences, and other GPUs keep one head."""
    import importlib

    cfg = importlib.import_module(fa.__name__ + "._configs")
    paired = (128, 64, 8, 3)
    assert cfg.pick_fwd_paired((9, 0), 64, True, 4, True) == paired
    assert cfg.pick_fwd_paired((9, 0), 64, True, 2, True) == paired
    assert cfg.pick_fwd_paired((9, 0), 64, True, 1, True) is None
    assert cfg.pick_fwd_paired((9, 0), 64, True, 3, True) is None
    assert cfg.pick_fwd_paired((9, 0), 64, False, 4, True) is None
    assert cfg.pick_fwd_paired((9, 0), 64, True, 4, False) is None
    assert cfg.pick_fwd_paired((9, 0), 128, True, 4, True) is None
    assert cfg.pick_fwd_paired((9, 0), 32, True, 4, True) is None
    assert cfg.pick_fwd_paired((8, 0), 64, True, 4, True) is None
    assert cfg.pick_fwd_paired(None, 64, True, 4, True) is None


def test_launch_order_rule():
    """Causal rows at head_dim <= 64 start heaviest-first; wider heads, a left window or a grid
    past CUDA's limits keep the per-head order; unmasked rows run in order."""
    import importlib

    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    heavy, per_head, in_order = (fwd._ORDERS[k] for k in ("heavy_first", "per_head", "in_order"))
    assert fwd._row_order(False, False, 64, 16, 256, 256) == in_order
    assert fwd._row_order(True, False, 64, 16, 256, 256) == heavy
    assert fwd._row_order(True, False, 32, 16, 256, 256) == heavy
    assert fwd._row_order(True, False, 128, 16, 256, 256) == per_head
    assert fwd._row_order(True, True, 64, 16, 256, 256) == per_head
    assert fwd._row_order(True, False, 64, 65535, 256, 256) == heavy
    assert fwd._row_order(True, False, 64, 65536, 256, 256) == per_head
    assert fwd._row_order(True, False, 64, 16, 4 * 65536, 4) == per_head


def test_heavy_first_chunks_hold_whole_gqa_groups_within_the_l2_budget():
    import importlib

    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    mb = 1 << 20
    # 8 x 32 query heads, groups of 4; 512 KB of K/V per K/V head: 64 heads fit in 32 MB -> all.
    assert fwd._heads_per_chunk(256, 4, mb // 2, 32 * mb) == 256
    # 1 MB per K/V head: 32 K/V heads = 128 query heads per chunk.
    assert fwd._heads_per_chunk(256, 4, mb, 32 * mb) == 128
    # The budget allows 5 groups (20 heads); 20 does not divide 96, so 16.
    assert fwd._heads_per_chunk(96, 4, mb, 5 * mb) == 16
    # Too big for the budget: one group per chunk, never less.
    assert fwd._heads_per_chunk(96, 4, 64 * mb, 32 * mb) == 4


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda: fa.flash_attn_func(*(torch.randn(1, 4, 2, 288, dtype=torch.float16) for _ in range(3))),
         ValueError, "head_dim 288"),
        (lambda: fa.flash_attn_func(*(torch.randn(1, 4, 2, 32, dtype=torch.bfloat16) for _ in range(3))),
         NotImplementedError, "TRITON_INTERPRET"),
        (lambda: fa.flash_attn_func(torch.randn(1, 4, 3, 32), torch.randn(1, 4, 2, 32), torch.randn(1, 4, 2, 32)),
         ValueError, "multiple of key/value heads"),
        (lambda: fa.flash_attn_func(*(torch.randn(1, 4, 2, 32) for _ in range(3)), dropout_p=1.0),
         ValueError, "dropout_p"),
        (lambda: fa.flash_attn_func(*(torch.randn(1, 4, 2, 32) for _ in range(3)), alibi_slopes=torch.rand(3)),
         ValueError, "alibi_slopes"),
        (lambda: fa.flash_attn_func(*(torch.randn(4, 2, 32) for _ in range(3))), ValueError, "4-D"),
        (lambda: fa.flash_attn_func(*(torch.randn(1, 4, 2, 32) for _ in range(3)), softmax_scale=-0.1),
         ValueError, "softmax_scale must be a finite number > 0"),
        (lambda: fa.flash_attn_func(*(torch.randn(1, 4, 2, 32) for _ in range(3)), softmax_scale=float("nan")),
         ValueError, "softmax_scale"),
        (lambda: fa.flash_attn_with_kvcache(torch.randn(1, 1, 2, 32), torch.randn(1, 8, 2, 32),
                                            torch.randn(1, 8, 2, 32), softmax_scale=0.0),
         ValueError, "softmax_scale"),
    ],
)
def test_unsupported_input_raises_clear_error(make, exc, words):
    with pytest.raises(exc, match=words):
        make()


class _FakeCuda:
    """Stands in for a CUDA tensor where only ``.device`` is read (no GPU on the CI machine)."""

    device = torch.device("cuda", 0)


def test_dispatch_rules(monkeypatch):
    import importlib

    autograd = importlib.import_module(fa.__name__ + "._autograd")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(autograd, "_CUDA_BACKENDS", {})
    assert autograd.backend_for(_FakeCuda()) == "gpu"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert autograd.backend_for(_FakeCuda()) == "gpu", "answered once per device and process"
    monkeypatch.setattr(autograd, "_CUDA_BACKENDS", {})
    monkeypatch.setattr(autograd, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="below 8.0"):
        assert autograd.backend_for(_FakeCuda()) == "torch"
    cpu = torch.zeros(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert autograd.backend_for(cpu) == "interpreter"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert autograd.backend_for(cpu) == "torch"


def test_opt_in_autotune_keeps_the_fastest_config_that_runs():
    import importlib

    configs = importlib.import_module(fa.__name__ + "._configs")
    times = {}

    def time_fn(cfg):
        if cfg[0] == 64:  # pretend these do not fit in shared memory
            raise RuntimeError("out of resources")
        times[cfg] = 1.0 + 0.01 * cfg[2] + (0.0 if cfg[:2] == (128, 32) else 0.5)
        return times[cfg]

    key = ("test-key", id(time_fn))
    best = configs.tuned(key, (128, 64, 8, 3), "fwd", 128, time_fn)
    assert best == min(times, key=times.get) and best[0] == 128 and best[1] == 32
    calls = len(times)
    assert configs.tuned(key, (128, 64, 8, 3), "fwd", 128, time_fn) == best and len(times) == calls


def test_package_imports_without_the_kvcache_module(tmp_path):
    import importlib.util
    import shutil
    import sys

    pkg = tmp_path / "flash_attn2"
    shutil.copytree(fa.__path__[0], pkg)
    (pkg / "_kvcache.py").unlink(missing_ok=True)
    spec = importlib.util.spec_from_file_location("_fa2_no_kvcache", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    q = torch.randn(1, 3, 2, 16)
    assert mod.flash_attn_func(q, q, q).shape == q.shape
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache"):
        mod.flash_attn_with_kvcache(q, q, q)
