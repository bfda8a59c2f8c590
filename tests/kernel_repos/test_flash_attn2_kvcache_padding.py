"""The padded batches transformers' continuous batching builds when CUDA graphs are on, through the
shipped kernel's ``flash_attn_with_kvcache`` and ``flash_attn_varlen_func``.

With graphs on, transformers (5.17-5.25) pads every batch to a fixed size. A decode batch of n
requests becomes a power of two rows; a padding row has ``cache_seqlens = -1`` (its
``cu_seq_lens_k`` entries repeat, and transformers subtracts the new token) and a block-table row
of -1, and the real rows' unused block-table columns are -1 too. A prefill (varlen) batch gets
query tokens past ``cu_seqlens_q[-1]``, sequences of length 0 (repeated ``cu_seqlens`` values),
more key rows than ``cu_seqlens_k[-1]`` and a ``max_seqlen_k`` padded to a power of two (at least
1024), larger than the key tensor.

What must hold: the real rows give what the unpadded call gives, a padding row gives out 0 and LSE
+inf, and no byte of the cache changes but the real rows' new keys. Both implementations run: the
Triton kernels (under TRITON_INTERPRET=1) and the PyTorch path.
"""

from __future__ import annotations

import pytest
import torch

from flash_ref import load_flash_attn2, reference, rel_err

fa = load_flash_attn2()
PAGE, HK, H, D = 16, 2, 4, 32
PAGES = 12


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch):
    """Which implementation serves the calls: the Triton kernels (interpreter) or the PyTorch path."""
    {"triton": lambda: monkeypatch.setenv("TRITON_INTERPRET", "1"),
     "torch": lambda: monkeypatch.delenv("TRITON_INTERPRET", raising=False)}[request.param]()
    return request.param


def _paged_cache(gen, dtype=torch.float16):
    k_cache = torch.randn(PAGES, PAGE, HK, D, generator=gen).to(dtype)
    v_cache = torch.randn(PAGES, PAGE, HK, D, generator=gen).to(dtype)
    return k_cache, v_cache


def _graph_shaped_decode(gen, dtype=torch.float16):
    """3 requests padded to 4 rows, as transformers' decode fast path builds them.

    Request lengths (keys already cached): 5, 16 (the new key opens a fresh page), 33. The last
    page (PAGES - 1) belongs to nobody: ``-1`` wrapping around (Python-style indexing) lands
    there."""
    past = [5, 16, 33]
    table = torch.full((4, 4), -1, dtype=torch.int32)
    table[0, :1] = torch.tensor([7])
    table[1, :2] = torch.tensor([2, 9])
    table[2, :3] = torch.tensor([4, 0, 5])
    # cu_seq_lens_k counts each request's keys including the new one; padding rows repeat the total
    cu_k = torch.tensor([0] + [sum(p + 1 for p in past[:i + 1]) for i in range(3)] + [sum(past) + 3],
                        dtype=torch.int32)
    cache_seqlens = cu_k[1:] - cu_k[:-1] - 1  # transformers' formula: [5, 16, 33, -1]
    q = torch.randn(4, 1, H, D, generator=gen).to(dtype)
    k = torch.randn(4, 1, HK, D, generator=gen).to(dtype)
    v = torch.randn(4, 1, HK, D, generator=gen).to(dtype)
    return q, k, v, cache_seqlens, table, past


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_transformers_padded_decode_batch(path):
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache = _paged_cache(gen)
    q, k, v, cache_seqlens, table, past = _graph_shaped_decode(gen)
    assert cache_seqlens.tolist() == [5, 16, 33, -1]
    k_cache[PAGES - 1] = float("nan")  # the page -1 would wrap to: any read of it shows as NaN
    v_cache[PAGES - 1] = float("nan")
    k_unpadded, v_unpadded = k_cache.clone(), v_cache.clone()
    k_before, v_before = k_cache.clone(), v_cache.clone()

    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                                          block_table=table, causal=True, num_splits=2,
                                          return_softmax_lse=True)
    want_out, want_lse = fa.flash_attn_with_kvcache(
        q[:3], k_unpadded, v_unpadded, k=k[:3], v=v[:3], cache_seqlens=cache_seqlens[:3],
        block_table=table[:3], causal=True, num_splits=2, return_softmax_lse=True)

    assert torch.equal(out[:3], want_out) and torch.equal(lse[:3], want_lse)
    assert (out[3] == 0).all() and torch.isinf(lse[3]).all() and (lse[3] > 0).all()
    # the whole cache: exactly the unpadded call's (three new keys), nothing else written
    assert _nan_equal(k_cache, k_unpadded) and _nan_equal(v_cache, v_unpadded)
    changed = (k_cache != k_before).any(dim=(2, 3)) & ~k_before.isnan().any(dim=(2, 3))
    assert sorted(map(tuple, changed.nonzero().tolist())) == [(5, 1), (7, 5), (9, 0)]
    # and against an fp64 reference over each request's keys
    for b, n in enumerate(past):
        pages = table[b, : (n + PAGE) // PAGE].tolist()
        keys = torch.cat([k_cache[p] for p in pages])[: n + 1]
        vals = torch.cat([v_cache[p] for p in pages])[: n + 1]
        ref, _ = reference(q[b:b + 1], keys[None], vals[None], causal=True)
        assert rel_err(out[b:b + 1], ref) < 4e-3, b


@pytest.mark.parametrize("seqlen_new", [0, 1, 3], ids=["read-only", "one-new", "three-new"])
def test_negative_cache_seqlens_are_empty_rows_that_write_nothing(path, seqlen_new):
    """Any negative length, with or without new keys: nothing appended, out 0, LSE +inf; the
    row beside it is unaffected (dense cache, so a stray write would land in a real row)."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(3, 24, HK, D, generator=gen).half()
    v_cache = torch.randn(3, 24, HK, D, generator=gen).half()
    q = torch.randn(3, 2, H, D, generator=gen).half()
    new = (torch.randn(3, seqlen_new, HK, D, generator=gen).half() if seqlen_new else None)
    lens = torch.tensor([-1, 9, -7], dtype=torch.int32)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    if new is not None:
        k_want[1, 9:9 + seqlen_new] = new[1]
        v_want[1, 9:9 + seqlen_new] = new[1]
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=new, v=new, cache_seqlens=lens,
                                          causal=True, return_softmax_lse=True)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
    for b in (0, 2):
        assert (out[b] == 0).all() and torch.isinf(lse[b]).all() and (lse[b] > 0).all()
    ref, _ = reference(q[1:2], k_want[1:2, :9 + seqlen_new], v_want[1:2, :9 + seqlen_new], causal=True)
    assert rel_err(out[1:2], ref) < 4e-3


def test_a_batch_of_padding_rows_only_touches_nothing(path):
    """Every row padding (a graph captured for more rows than are running)."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = _paged_cache(gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q = torch.randn(2, 1, H, D, generator=gen).half()
    new = torch.randn(2, 1, HK, D, generator=gen).half()
    table = torch.full((2, 3), -1, dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=new, v=new.clone(),
                                     cache_seqlens=torch.tensor([-1, -1], dtype=torch.int32),
                                     block_table=table, causal=True)
    assert (out == 0).all()
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


def test_a_real_row_reaching_an_unallocated_page_is_refused_on_the_host():
    """-1 marks a page that is not allocated: a row whose keys reach it is a caller error, named
    (checked where it costs no device sync: a CPU block table); the cache is left untouched."""
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = _paged_cache(gen)
    before = k_cache.clone()
    table = torch.tensor([[3, -1, -1]], dtype=torch.int32)
    new = torch.randn(1, 1, HK, D, generator=gen).half()
    q = torch.randn(1, 1, H, D, generator=gen).half()
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] is -1 \(no page\), but row 0 holds 17 keys"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=new, v=new, block_table=table,
                                   cache_seqlens=torch.tensor([PAGE], dtype=torch.int32))
    assert torch.equal(k_cache, before)
    # one key short of the page boundary: the row stays on its own page, fine
    fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=new, v=new, block_table=table,
                               cache_seqlens=torch.tensor([PAGE - 1], dtype=torch.int32))
    assert torch.equal(k_cache[3, PAGE - 1], new[0, 0])


def test_device_writes_through_invalid_pages_are_dropped(path):
    """What the device does with entries it cannot check on the host (here handed to the append
    directly): a -1 page or one past the cache is never written; the valid write still lands."""
    kvcache = __import__(fa.__name__ + "._kvcache", fromlist=["_append"])
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = _paged_cache(gen)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    table = torch.tensor([[-1], [PAGES + 3], [6]], dtype=torch.int32)
    new_k = torch.randn(3, 1, HK, D, generator=gen).half()
    new_v = torch.randn(3, 1, HK, D, generator=gen).half()
    start = torch.tensor([2, 2, 2])
    if path == "torch":
        kvcache._append(k_cache, v_cache, new_k, new_v, start, PAGE, table, torch.arange(3))
    else:
        from importlib import import_module

        append = import_module(fa.__name__ + "._triton_append")
        total = append.append_kv(k_cache, v_cache, new_k, new_v, start.int(), 0, PAGE, table, None)
        assert total.tolist() == [3, 3, 3]
    k_want[6, 2], v_want[6, 2] = new_k[2, 0], new_v[2, 0]
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


def test_transformers_padded_varlen_batch(path):
    """A prefill batch padded for a CUDA graph: 2 real sequences, 2 empty ones, query tokens past
    cu_seqlens_q[-1], key rows past cu_seqlens_k[-1], max_seqlen_k larger than the key tensor."""
    gen = torch.Generator().manual_seed(11)
    q_lens, k_lens = [5, 7], [9, 11]  # each sequence reads cached keys before its own
    total_q, total_k = 16, 32  # padded sizes (real: 12 and 20)
    q = torch.randn(total_q, H, D, generator=gen).half()
    k = torch.randn(total_k, HK, D, generator=gen).half()
    v = torch.randn(total_k, HK, D, generator=gen).half()
    cu_q = torch.tensor([0, 5, 12, 12, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 20, 20, 20], dtype=torch.int32)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, total_q, 1024, causal=True)
    want = fa.flash_attn_varlen_func(q[:12], k[:20], v[:20], cu_q[:3], cu_k[:3], 7, 11, causal=True)
    assert out.shape == q.shape
    torch.testing.assert_close(out[:12], want, atol=2e-3, rtol=0)
    for i, (sq, sk) in enumerate(zip(q_lens, k_lens)):
        qs, ks = int(cu_q[i]), int(cu_k[i])
        ref, _ = reference(q[None, qs:qs + sq], k[None, ks:ks + sk], v[None, ks:ks + sk], causal=True)
        assert rel_err(out[None, qs:qs + sq], ref) < 4e-3, i


def test_the_gpu_path_reads_no_device_value_on_the_host(monkeypatch):
    """What lets a CUDA graph capture these calls: on the GPU path no tensor value reaches the
    host (no .item(), no data-dependent shape, no branch on a device value). The calls run on fake
    CUDA tensors, which have shapes but no values (reading one raises), with the kernel launches
    recorded instead of run; the GPU's properties are given."""
    from importlib import import_module

    from torch._subclasses.fake_tensor import FakeTensorMode

    autograd = import_module(fa.__name__ + "._autograd")
    decode = import_module(fa.__name__ + "._triton_decode")
    append = import_module(fa.__name__ + "._triton_append")
    fwd = import_module(fa.__name__ + "._triton_fwd")
    launches = []

    def recorder(name):
        def launch(grid, args, constexprs, num_warps, num_stages):
            assert all(a is None or isinstance(a, (torch.Tensor, int, float)) for a in args), name
            launches.append(name)
        return launch

    for module, attr in ((append, "_APPEND"), (decode, "_SPLIT"), (decode, "_COMBINE"), (fwd, "_FWD")):
        monkeypatch.setattr(module, attr, recorder(attr))
    device = torch.device("cuda", 0)
    monkeypatch.setattr(decode, "_current_stream", lambda device: 0)  # host values: no GPU here to ask
    monkeypatch.setattr(decode, "_capturing", lambda stream: False)
    monkeypatch.setattr(decode, "_COUNTERS", {})  # the fake counters stay in this test
    monkeypatch.setattr(decode, "_PARTIALS", {})  # so do the fake partials
    monkeypatch.setitem(autograd._CUDA_BACKENDS, device, "gpu")
    monkeypatch.setitem(decode._SETUP, (D, device), decode.gpu_setup(D, (9, 0), 132))  # an H100/H200's
    monkeypatch.setitem(fwd._CAPABILITY, device, (9, 0))
    with FakeTensorMode():
        def empty(*shape, dtype=torch.float16):
            return torch.empty(*shape, dtype=dtype, device=device)

        # the padded decode batch: 4 rows, lengths on the device (one -1), block table with -1 rows
        out = fa.flash_attn_with_kvcache(
            empty(4, 1, H, D), empty(PAGES, PAGE, HK, D), empty(PAGES, PAGE, HK, D), k=empty(4, 1, HK, D),
            v=empty(4, 1, HK, D), cache_seqlens=empty(4, dtype=torch.int32), block_table=empty(4, 4, dtype=torch.int32),
            causal=True)
        assert out.shape == (4, 1, H, D)
        # split-K over many keys: the slices merge in the same launch, and while a CUDA graph is
        # captured in a second one (the graph's replays pay GPU time only)
        for capturing in (False, True):
            monkeypatch.setattr(decode, "_capturing", lambda stream, capturing=capturing: capturing)
            fa.flash_attn_with_kvcache(
                empty(1, 1, H, D), empty(64, PAGE, HK, D), empty(64, PAGE, HK, D), k=empty(1, 1, HK, D),
                v=empty(1, 1, HK, D), cache_seqlens=empty(1, dtype=torch.int32),
                block_table=empty(1, 64, dtype=torch.int32), causal=True)
        monkeypatch.setattr(decode, "_capturing", lambda stream: False)
        # the padded prefill batch, max lengths given as host ints
        out = fa.flash_attn_varlen_func(empty(64, H, D), empty(320, HK, D), empty(320, HK, D),
                                        empty(5, dtype=torch.int32), empty(5, dtype=torch.int32), 64, 1024, causal=True)
        assert out.shape == (64, H, D)
    assert launches == ["_APPEND", "_SPLIT", "_APPEND", "_SPLIT", "_APPEND", "_SPLIT", "_COMBINE", "_FWD"]
