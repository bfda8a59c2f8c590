"""flash_attn_with_kvcache of the shipped flash-attn2 kernel repo, against a float64 reference.

Both paths are run: the split-K Triton kernel (under TRITON_INTERPRET=1, set by conftest) and
the PyTorch path (TRITON_INTERPRET unset for the call). Inputs are fresh random numbers each
run; cache slots that no row may read hold NaN so any stray read shows; every buffer the Triton
path writes is poisoned with NaN before the call.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import sys
import types
from pathlib import Path
from typing import Optional

import pytest
import torch

PACKAGE_DIR = (Path(__file__).resolve().parents[2] / "kernel_repos" / "kernels-community"
               / "flash-attn2" / "build" / "torch-universal" / "flash_attn2")


def _load(module: str) -> types.ModuleType:
    """Import one module of the kernel package by path, without the package's __init__.

    The loader core (which normally imports kernel repos) is tested elsewhere; here only the
    kvcache modules and what they import are exercised.
    """
    pkg_name = "_test_flash_attn2_kvcache_pkg"
    if pkg_name not in sys.modules:
        pkg = types.ModuleType(pkg_name)
        pkg.__path__ = [str(PACKAGE_DIR)]
        sys.modules[pkg_name] = pkg
    return importlib.import_module(f"{pkg_name}.{module}")


kvcache = _load("_kvcache")
flash_attn_with_kvcache = kvcache.flash_attn_with_kvcache


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch):
    """Which implementation serves the call; the Triton one gets NaN-poisoned buffers."""
    if request.param == "torch":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        decode = _load("_triton_decode")
        original = decode._alloc

        def poisoned(shape, dtype, device):
            return original(shape, dtype, device).fill_(float("nan"))

        monkeypatch.setattr(decode, "_alloc", poisoned)
        partials = decode._partials

        def poisoned_partials(*args):  # a reused pair holds the last call's values: NaN them too
            return tuple(t.fill_(float("nan")) for t in partials(*args))

        monkeypatch.setattr(decode, "_partials", poisoned_partials)
    return request.param


@dataclasses.dataclass
class Case:
    name: str
    seqlen_q: int = 1
    seqlen_new: int = 1
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 32
    dtype: torch.dtype = torch.float16
    page_size: int = 0  # 0: contiguous cache
    lens: tuple = (0, 7, 16, 33)  # keys already cached per row
    capacity: int = 48  # slots per row (contiguous) / pages * page_size (paged)
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: str = ""  # "", "h" ([H]) or "bh" ([B, H])
    batch_idx: bool = False
    leftpad: bool = False
    rotary: str = ""  # "", "interleaved", "halves"
    int_lens: bool = False  # cache_seqlens as a Python int (lens[0] for every row)
    num_splits: int = 0
    noncontig_q: bool = False


CASES = [
    Case("decode-contig-gqa-causal", causal=True),
    Case("decode-paged16-mqa-fp32", heads=4, kv_heads=1, page_size=16, lens=(0, 15, 16, 40),
         dtype=torch.float32),
    Case("decode-paged8-window-alibi", page_size=8, lens=(3, 0, 29, 40), window=(9, -1),
         alibi="h", seqlen_new=0),
    Case("decode-contig-softcap-splits", lens=(5, 44, 47, 30), softcap=3.0, num_splits=5,
         head_dim=40),
    Case("chunk-contig-causal-window-softcap", seqlen_q=5, seqlen_new=5, causal=True,
         window=(6, 0), softcap=2.0, heads=4, kv_heads=2, head_dim=40, lens=(0, 9, 20, 37)),
    Case("chunk-paged16-alibi-noappend-fp32", seqlen_q=3, seqlen_new=0, page_size=16,
         alibi="bh", causal=True, dtype=torch.float32, lens=(3, 17, 32, 45), noncontig_q=True),
    Case("chunk-tiled-over-q", seqlen_q=40, seqlen_new=40, heads=4, kv_heads=2, causal=True,
         capacity=96, lens=(0, 13, 50, 56), dtype=torch.float32),
    Case("batchidx-leftpad", seqlen_q=2, seqlen_new=2, causal=True, batch_idx=True,
         leftpad=True, lens=(6, 11, 30, 20)),
    Case("rotary-interleaved-paged", seqlen_q=2, seqlen_new=2, causal=True, page_size=16,
         rotary="interleaved", lens=(0, 14, 31, 30)),
    Case("rotary-halves-noncausal-intlen", rotary="halves", int_lens=True, lens=(21,) * 4,
         kv_heads=8, head_dim=48),
]


def _slot(case: Case, cache_row: int, pos: int, table: Optional[torch.Tensor], b: int):
    if case.page_size:
        return int(table[b, pos // case.page_size]), pos % case.page_size
    return cache_row, pos


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """x [H, D] float64 rotated with cos/sin [rot/2] (flash-attn's rotary, written plainly)."""
    out = x.clone()
    half = cos.shape[0]
    for j in range(half):
        a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
        out[:, a] = x[:, a] * cos[j] - x[:, b] * sin[j]
        out[:, b] = x[:, a] * sin[j] + x[:, b] * cos[j]
    return out


def _make_inputs(case: Case, gen: torch.Generator):
    batch = len(case.lens)
    d = case.head_dim

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(case.dtype)

    lens = torch.tensor(case.lens, dtype=torch.int32)
    leftpad = None
    if case.leftpad:
        leftpad = torch.tensor([min(2 + b, int(lens[b])) for b in range(batch)], dtype=torch.int32)
    if case.page_size:
        pages_per_row = case.capacity // case.page_size
        num_blocks = batch * pages_per_row + 3
        perm = torch.randperm(num_blocks, generator=gen)[: batch * pages_per_row]
        table = perm.view(batch, pages_per_row).to(torch.int32)
        cache_shape = (num_blocks, case.page_size, case.kv_heads, d)
    else:
        table = None
        cache_shape = (batch + (2 if case.batch_idx else 0), case.capacity, case.kv_heads, d)
    batch_idx = None
    rows = list(range(batch))
    if case.batch_idx:
        batch_idx = torch.randperm(cache_shape[0], generator=gen)[:batch].to(torch.int32)
        rows = [int(r) for r in batch_idx]
    k_cache = torch.full(cache_shape, float("nan"), dtype=case.dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=case.dtype)
    for b in range(batch):
        first = int(leftpad[b]) if leftpad is not None else 0
        for pos in range(first, int(lens[b])):
            slot = _slot(case, rows[b], pos, table, b)
            k_cache[slot] = rnd(case.kv_heads, d)
            v_cache[slot] = rnd(case.kv_heads, d)
    q = rnd(batch, case.seqlen_q, case.heads, d)
    if case.noncontig_q:
        q = rnd(batch, case.heads, case.seqlen_q, d).transpose(1, 2)
    k_new = rnd(batch, case.seqlen_new, case.kv_heads, d) if case.seqlen_new else None
    v_new = rnd(batch, case.seqlen_new, case.kv_heads, d) if case.seqlen_new else None
    alibi = None
    if case.alibi == "h":
        alibi = torch.rand(case.heads, generator=gen) * 0.5
    elif case.alibi == "bh":
        alibi = torch.rand(batch, case.heads, generator=gen) * 0.5
    cos = sin = None
    if case.rotary:
        angles = torch.rand(case.capacity + case.seqlen_q, d // 4, generator=gen) * 6.0
        cos, sin = torch.cos(angles), torch.sin(angles)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new, lens=lens,
                leftpad=leftpad, table=table, batch_idx=batch_idx, rows=rows, alibi=alibi,
                cos=cos, sin=sin)


def _reference(case: Case, inp: dict):
    """Expected caches after the append, and float64 out [B, Sq, Hq, D] / lse [B, Hq, Sq]."""
    batch, sq, hq, d = inp["q"].shape
    group = hq // case.kv_heads
    k_cache = inp["k_cache"].clone()
    v_cache = inp["v_cache"].clone()
    scale = 1.0 / math.sqrt(d)
    out = torch.empty(batch, sq, hq, d, dtype=torch.float64)
    lse = torch.empty(batch, hq, sq, dtype=torch.float64)
    windowed = case.causal or case.window != (-1, -1)
    for b in range(batch):
        start = int(inp["lens"][b])
        q = inp["q"][b].double()  # [Sq, Hq, D]
        if case.rotary:
            inter = case.rotary == "interleaved"
            for i in range(sq):
                pos = start + i if windowed else start
                q[i] = _rotate_ref(q[i], inp["cos"][pos].double(), inp["sin"][pos].double(), inter)
        for t in range(case.seqlen_new):
            kt = inp["k"][b, t].double()
            if case.rotary:
                kt = _rotate_ref(kt, inp["cos"][start + t].double(), inp["sin"][start + t].double(),
                                 case.rotary == "interleaved")
            slot = _slot(case, inp["rows"][b], start + t, inp["table"], b)
            k_cache[slot] = kt.to(case.dtype)
            v_cache[slot] = inp["v"][b, t]
        first = int(inp["leftpad"][b]) if inp["leftpad"] is not None else 0
        total = start + case.seqlen_new
        length = total - first
        keys = torch.stack([k_cache[_slot(case, inp["rows"][b], p, inp["table"], b)]
                            for p in range(first, total)]).double() if length else None
        vals = torch.stack([v_cache[_slot(case, inp["rows"][b], p, inp["table"], b)]
                            for p in range(first, total)]).double() if length else None
        left, right = case.window
        if case.causal:
            right = 0
        for h in range(hq):
            for i in range(sq):
                if not length:
                    out[b, i, h] = 0.0
                    lse[b, h, i] = math.inf
                    continue
                s = keys[:, h // group] @ q[i, h] * scale
                if case.softcap:
                    s = case.softcap * torch.tanh(s / case.softcap)
                j = torch.arange(length, dtype=torch.float64)
                diag = i + length - sq
                if inp["alibi"] is not None:
                    slope = inp["alibi"][h] if inp["alibi"].dim() == 1 else inp["alibi"][b, h]
                    s = s - float(slope) * (diag - j).abs()
                ok = torch.ones(length, dtype=torch.bool)
                if right >= 0:
                    ok &= j <= diag + right
                if left >= 0:
                    ok &= j >= diag - left
                if not ok.any():
                    out[b, i, h] = 0.0
                    lse[b, h, i] = math.inf
                    continue
                s = s.masked_fill(~ok, -math.inf)
                lse[b, h, i] = torch.logsumexp(s, 0)
                out[b, i, h] = torch.softmax(s, 0) @ vals[:, h // group]
    return k_cache, v_cache, out, lse


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp(min=1e-12))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_float64_reference(case: Case, path: str):
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    inp = _make_inputs(case, gen)
    want_k, want_v, want_out, want_lse = _reference(case, inp)
    lens = int(inp["lens"][0]) if case.int_lens else inp["lens"]
    out, lse = flash_attn_with_kvcache(
        inp["q"], inp["k_cache"], inp["v_cache"], k=inp["k"], v=inp["v"],
        rotary_cos=inp["cos"], rotary_sin=inp["sin"], cache_seqlens=lens,
        cache_batch_idx=inp["batch_idx"], cache_leftpad=inp["leftpad"], block_table=inp["table"],
        causal=case.causal, window_size=case.window, softcap=case.softcap,
        rotary_interleaved=case.rotary != "halves", alibi_slopes=inp["alibi"],
        num_splits=case.num_splits, return_softmax_lse=True,
    )
    assert out.shape == inp["q"].shape and out.dtype == case.dtype
    assert lse.shape == (inp["q"].shape[0], case.heads, case.seqlen_q) and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    tol = 1e-4 if case.dtype == torch.float32 else 4e-3
    assert _rel_err(out, want_out) < tol
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite].double(), want_lse[finite], atol=2e-3, rtol=0)
    assert (out[~finite.transpose(1, 2)] == 0).all()
    # The cache now holds the new keys (rotated ones to rounding) and nothing else changed; NaN
    # slots must still be NaN.
    for got, want in ((inp["k_cache"], want_k), (inp["v_cache"], want_v)):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.allclose(got.nan_to_num(), want.nan_to_num(), atol=2e-3, rtol=2e-3)
        if not case.rotary:
            assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_empty_rows_give_zero_and_inf_lse(path: str):
    """Rows with no cached keys and nothing appended, and query rows outside every window."""
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16)
    k_cache = torch.randn(2, 20, 2, 32, dtype=torch.float16)
    v_cache = torch.randn(2, 20, 2, 32, dtype=torch.float16)
    lens = torch.tensor([0, 12], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                       return_softmax_lse=True)
    assert (out[0] == 0).all() and torch.isinf(lse[0]).all() and (lse[0] > 0).all()
    assert torch.isfinite(lse[1]).all() and out[1].abs().sum() > 0


def test_num_splits_do_not_change_the_result(path: str):
    """1 split, several, and more splits than key blocks (empty slices) agree."""
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    q = torch.randn(3, 1, 8, 32, generator=gen)
    k_cache = torch.randn(3, 120, 2, 32, generator=gen)
    v_cache = torch.randn(3, 120, 2, 32, generator=gen)
    lens = torch.tensor([120, 1, 77], dtype=torch.int32)
    results = [flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                       num_splits=n, return_softmax_lse=True) for n in (1, 3, 11)]
    for out, lse in results[1:]:
        assert torch.allclose(out, results[0][0], atol=1e-5)
        assert torch.allclose(lse, results[0][1], atol=1e-5)


def test_the_last_slice_merges_in_the_same_launch_and_leaves_the_counters_at_zero(monkeypatch):
    """Several slices per row: one launch, whose last slice per tile merges them, gives what the
    split kernel followed by the combine kernel gives (empty rows and empty slices included), and
    puts every arrival counter back to zero for the next launch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    decode = _load("_triton_decode")
    monkeypatch.setattr(decode, "_COUNTERS", {})
    monkeypatch.setattr(decode, "_PARTIALS", {})
    launches = []
    for attr in ("_SPLIT", "_COMBINE"):
        def counted(*args, _attr=attr, _launch=getattr(decode, attr)):
            launches.append(_attr)
            return _launch(*args)
        monkeypatch.setattr(decode, attr, counted)
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    q = torch.randn(3, 2, 8, 32, generator=gen)
    k_cache = torch.randn(3, 120, 2, 32, generator=gen)
    v_cache = torch.randn(3, 120, 2, 32, generator=gen)
    lens = torch.tensor([120, 0, 77], dtype=torch.int32)
    results = {}
    for merge in (True, False):
        monkeypatch.setattr(decode, "MERGE_IN_KERNEL", merge)
        launches.clear()
        results[merge] = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                                 num_splits=5, return_softmax_lse=True)
        assert launches == (["_SPLIT"] if merge else ["_SPLIT", "_COMBINE"])
    (out, lse), (want_out, want_lse) = results[True], results[False]
    assert torch.allclose(out, want_out, atol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)) and (out[1] == 0).all()
    assert torch.allclose(lse[1:2].isinf().float(), torch.ones(1)) and (lse[1] > 0).all()
    assert torch.allclose(lse[[0, 2]], want_lse[[0, 2]], atol=1e-5)
    (counters,) = decode._COUNTERS.values()
    assert counters.numel() >= 3 * 2 and not counters.any()
    # without the LSE the merge writes the output alone
    out_only = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, num_splits=5)
    assert torch.allclose(out_only, want_out, atol=1e-5) and not counters.any()


def test_arrival_counters_are_one_buffer_per_stream_and_a_captured_graph_gets_its_own(monkeypatch):
    """Calls on two streams at once must not count on the same counters; a buffer grows when a
    launch needs more; a CUDA graph being captured gets zeroed counters of its own, so that no
    replay shares them with eager calls."""
    decode = _load("_triton_decode")
    monkeypatch.setattr(decode, "_COUNTERS", {})
    monkeypatch.setattr(decode, "_PARTIALS", {})
    device = torch.device("cpu")
    first = decode._counters(device, 10, 7)
    assert decode._counters(device, 10, 7) is first and first.numel() >= 10 and not first.any()
    other = decode._counters(device, 10, 8)
    assert other is not first
    grown = decode._counters(device, 5000, 7)
    assert grown.numel() >= 5000 and grown is not first and decode._counters(device, 10, 7) is grown
    assert decode._counters(device, 10, 8) is other
    # while a CUDA graph is captured each launch gets counters of the graph's own, none cached
    captured = decode._arrival_counters(device, 10, 7, capturing=True)
    assert captured.numel() >= 10 and not captured.any()
    assert captured is not decode._arrival_counters(device, 10, 7, capturing=True)
    assert all(buf is not captured for buf in decode._COUNTERS.values())


def test_partials_are_one_pair_per_stream_kept_between_calls_and_a_captured_graph_gets_its_own(monkeypatch):
    """A call read in several slices writes its partial results into its stream's pair, kept for
    the next call of the same shape (no allocation on the host's path), replaced when the shape
    changes; other streams, a CUDA graph being captured and ``REUSE_PARTIALS = False`` get fresh
    ones, none cached."""
    decode = _load("_triton_decode")
    monkeypatch.setattr(decode, "_PARTIALS", {})
    device, shape = torch.device("cpu"), (5, 3, 8, 2, 32)
    o, lse = decode._partials(device, shape, 7, False)
    assert o.shape == shape and lse.shape == shape[:-1] and o.dtype == lse.dtype == torch.float32
    again = decode._partials(device, shape, 7, False)
    assert again[0] is o and again[1] is lse
    other = decode._partials(device, shape, 8, False)
    assert other[0] is not o
    grown = decode._partials(device, (6, 3, 8, 2, 32), 7, False)
    assert grown[0].shape == (6, 3, 8, 2, 32) and grown[0] is not o
    assert decode._partials(device, (6, 3, 8, 2, 32), 7, False)[0] is grown[0]
    captured = decode._partials(device, (6, 3, 8, 2, 32), 7, True)
    assert captured[0] is not grown[0] and all(pair[0] is not captured[0] for pair in decode._PARTIALS.values())
    monkeypatch.setattr(decode, "REUSE_PARTIALS", False)
    assert decode._partials(device, (6, 3, 8, 2, 32), 7, False)[0] is not grown[0]


def test_the_default_stream_is_never_asked_whether_a_graph_is_being_captured(monkeypatch):
    """CUDA refuses to capture a graph on the default stream (raw handle 0), so a call there is
    answered 'not capturing' without the driver query that costs host time on every sliced
    decode call; any other stream is asked."""
    decode = _load("_triton_decode")
    asked = []

    def query():
        asked.append(True)
        return True

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", query)
    assert decode._capturing(0) is False and not asked
    assert decode._capturing(12345) is True and asked == [True]


def test_a_call_after_a_longer_one_reads_nothing_the_longer_one_left_in_the_partials(monkeypatch):
    """The kept partials of a call over long rows, poisoned, then a call of the same shape over
    shorter rows (slices past a row's end, an empty row): every slice writes its own partial, so
    the result equals the one computed with fresh buffers."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    decode = _load("_triton_decode")
    monkeypatch.setattr(decode, "_PARTIALS", {})
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    q = torch.randn(3, 2, 8, 32, generator=gen)
    k_cache = torch.randn(3, 120, 2, 32, generator=gen)
    v_cache = torch.randn(3, 120, 2, 32, generator=gen)
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([120, 120, 120], dtype=torch.int32),
                            num_splits=5)
    (kept,) = decode._PARTIALS.values()
    for t in kept:
        t.fill_(float("nan"))
    short = torch.tensor([30, 0, 77], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=short, causal=True, num_splits=5,
                                       return_softmax_lse=True)
    assert decode._PARTIALS[next(iter(decode._PARTIALS))][0] is kept[0]  # the same pair was used
    monkeypatch.setattr(decode, "REUSE_PARTIALS", False)
    want_out, want_lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=short, causal=True,
                                                 num_splits=5, return_softmax_lse=True)
    assert not out.isnan().any() and torch.allclose(out, want_out, atol=1e-6)
    assert torch.equal(lse, want_lse)


def test_a_decode_launch_is_derived_once_per_shape_and_follows_the_split_rule_it_was_given(monkeypatch):
    """Every layer of a decode step makes the same call: the launch's shape is derived once and
    kept (keyed on the shapes, strides, lengths and options, and on the split rule and page
    choices, which benchmarks change), the keeping bounded."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    decode = _load("_triton_decode")
    monkeypatch.setattr(decode, "_PLANS", {})
    monkeypatch.setattr(decode, "_PARTIALS", {})
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 32, generator=gen)
    k_cache, v_cache = torch.randn(2, 64, 2, 32, generator=gen), torch.randn(2, 64, 2, 32, generator=gen)

    def call(length=64):
        return decode.decode_attention(q, k_cache, v_cache, total_lens=None, total_len_uniform=length,
                                       capacity=64, block_table=None, batch_idx=None, leftpad=None,
                                       alibi_slopes=None, softmax_scale=0.2, window_left=-1, window_right=0,
                                       softcap=0.0)

    first = call()
    again = call()
    assert len(decode._PLANS) == 1 and torch.equal(first[0], again[0])
    call(40)  # another length: another launch
    assert len(decode._PLANS) == 2
    (plan,) = [p for key, p in decode._PLANS.items() if 40 not in key]
    assert plan[2] > 1  # the interpreter's pretend GPU slices these rows
    monkeypatch.setattr(decode, "choose_num_splits", lambda *a, **k: 1)
    one = call()
    assert len(decode._PLANS) == 3 and torch.allclose(one[0], first[0], atol=1e-5)
    assert [p[2] for key, p in decode._PLANS.items() if 40 not in key] == [plan[2], 1]
    monkeypatch.setattr(decode, "_PLANS_MAX", 3)
    call(30)
    assert len(decode._PLANS) == 1  # full: cleared, then the new one kept


class _SpyLauncher:
    """Stands in for the split kernel's Launcher on a pretend GPU: records what the decode asks."""

    def __init__(self):
        self.calls: list = []

    def __call__(self, grid, args, constexprs, num_warps, num_stages):
        self.calls.append(("launch", constexprs))

    def keep(self, args, constexprs, num_warps, num_stages):
        self.calls.append(("keep", constexprs))
        return ("kept", constexprs)

    def launch_kept(self, kept, grid, args):
        self.calls.append(("kept", kept[1]))
        return True


def test_a_decode_call_repeats_its_kept_launch_only_where_the_key_is_vouched_for(monkeypatch):
    """On a GPU, transformers' decode (no optional tensors) keeps the launch its first call of a
    plan took and repeats it on the next calls; a call whose q, k or v is not 16-byte aligned, or
    whose options differ, or that has optional tensors (a paged cache) goes through the
    Launcher's own key."""
    decode = _load("_triton_decode")
    device = torch.device("cpu")  # plays a GPU: the launches are recorded, never run
    monkeypatch.setattr(decode, "_PLANS", {})
    monkeypatch.setattr(decode, "_PARTIALS", {})
    monkeypatch.setattr(decode, "_COUNTERS", {})
    monkeypatch.setattr(decode, "_current_stream", lambda device: 0)
    monkeypatch.setitem(decode._SETUP, (32, device), decode.gpu_setup(32, (9, 0), 132))
    monkeypatch.setattr(decode, "KEEP_LAUNCHES", True)  # on unless FLASH_ATTN2_KEEP_LAUNCHES=0
    spy = _SpyLauncher()
    monkeypatch.setattr(decode, "_SPLIT", spy)
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16)
    k_cache, v_cache = torch.randn(2, 64, 2, 32, dtype=torch.float16), torch.randn(2, 64, 2, 32, dtype=torch.float16)

    def call(q=q, k=k_cache, v=v_cache, softcap=0.0, block_table=None):
        decode.decode_attention(q, k, v, total_lens=None, total_len_uniform=64, capacity=64,
                                block_table=block_table, batch_idx=None, leftpad=None, alibi_slopes=None,
                                softmax_scale=0.2, window_left=-1, window_right=0, softcap=softcap)
        calls, spy.calls[:] = list(spy.calls), []
        return [kind for kind, _ in calls], calls

    kinds, first = call()
    assert kinds == ["launch", "keep"]
    kinds, again = call()
    assert kinds == ["kept"] and again[0][1] == first[0][1]  # the first call's constants
    # a q at an address not a multiple of 16 bytes: the kept launch assumed one
    unaligned = torch.randn(2 * 4 * 32 + 1, dtype=torch.float16)[1:].view(2, 1, 4, 32)
    assert call(q=unaligned)[0] == ["launch"]
    assert call(softcap=5.0)[0] == ["launch", "keep"]  # other options: their own kept launch
    assert call(softcap=5.0)[0] == ["kept"]
    monkeypatch.setattr(decode, "KEEP_LAUNCHES", False)  # switched off: the Launcher's key every call
    assert call()[0] == ["launch"]
    monkeypatch.setattr(decode, "KEEP_LAUNCHES", True)
    # a paged cache (block table): the Launcher's own key on every call
    pages = torch.randn(8, 16, 2, 32, dtype=torch.float16)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    assert call(k=pages, v=pages, block_table=table)[0] == ["launch"]
    assert call(k=pages, v=pages, block_table=table)[0] == ["launch"]
    # a stand-in launcher without keep (a benchmark's no-op) is called every time
    monkeypatch.setattr(decode, "_SPLIT", lambda *a: spy.calls.append(("stand-in", None)))
    assert call()[0] == ["stand-in"] and call()[0] == ["stand-in"]
    # another launcher put in its place (a benchmark's clock) keeps launches of its own
    other = _SpyLauncher()
    other.calls = spy.calls
    monkeypatch.setattr(decode, "_SPLIT", other)
    assert call()[0] == ["launch", "keep"] and call()[0] == ["kept"]


class _FakeSplitKernel:
    """Plays Triton for the split kernel (its real argument names, constexpr positions and
    do_not_specialize list): one compiled kernel per constexpr values and launch options, each
    recording the argument lists its launches were handed."""

    def __init__(self, real, constexprs, do_not_specialize):
        # under the interpreter the kernel object carries neither list: they are handed in
        self.arg_names, self.constexprs, self.do_not_specialize = real.arg_names, constexprs, do_not_specialize
        self.compiled: dict = {}

    def _pick(self, kwargs):
        key = tuple(sorted((k, v) for k, v in kwargs.items()))
        if key not in self.compiled:
            self.compiled[key] = types.SimpleNamespace(function="function", packed_metadata="metadata", runs=[])
            self.compiled[key].run = lambda *args, c=self.compiled[key]: c.runs.append(args)
        return self.compiled[key]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._pick(kwargs)

    def warmup(self, *args, grid, **kwargs):
        return self._pick(kwargs)


def test_a_kept_launch_hands_the_kernel_the_arguments_the_launchers_own_path_hands_it(monkeypatch):
    """Through the real Launcher (Triton played by a stand-in): the second decode call of a plan
    repeats the kept launch, the third (kept launches off) works the key out; the kernel gets the
    same argument list either way, and check mode finds the same key."""
    decode = _load("_triton_decode")
    launch = _load("_launch")
    driver_module = sys.modules["triton.runtime.driver"]
    monkeypatch.setattr(driver_module, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 1234)))
    device = torch.device("cpu")  # plays a GPU
    for name, value in (("_PLANS", {}), ("_PARTIALS", {}), ("_COUNTERS", {}), ("KEEP_LAUNCHES", True)):
        monkeypatch.setattr(decode, name, value)
    monkeypatch.setattr(decode, "_current_stream", lambda device: 0)
    monkeypatch.setitem(decode._SETUP, (32, device), decode.gpu_setup(32, (9, 0), 132))
    fake = _FakeSplitKernel(decode._split_kernel, launch._constexpr_positions(decode._split_kernel),
                            decode._SPLIT_RUNTIME_SCALARS)
    launcher = launch.Launcher(fake)
    launcher._fast = True  # conftest's TRITON_INTERPRET=1 turns the cached path off
    launcher._check = True  # launch_kept works the key out and compares
    monkeypatch.setattr(decode, "_SPLIT", launcher)
    kept_calls = []
    real_kept = launcher.launch_kept
    monkeypatch.setattr(launcher, "launch_kept", lambda *a: kept_calls.append(1) or real_kept(*a))
    q = torch.randn(4, 32, 1, 32, dtype=torch.float16)
    k, v = torch.randn(4, 8, 500, 32, dtype=torch.float16), torch.randn(4, 8, 500, 32, dtype=torch.float16)

    def call():
        decode.decode_attention(q, k, v, total_lens=None, total_len_uniform=500, capacity=500, block_table=None,
                                batch_idx=None, leftpad=None, alibi_slopes=None, softmax_scale=0.2, window_left=-1,
                                window_right=0, softcap=0.0, need_lse=False, heads_first=True)

    call()  # compiles (the stand-in), caches and keeps
    call()  # the kept launch
    monkeypatch.setattr(decode, "KEEP_LAUNCHES", False)
    call()  # the Launcher's cached path, key worked out
    assert kept_calls == [1]
    (compiled,) = fake.compiled.values()
    kept_run, keyed_run = compiled.runs

    def shape(args):  # tensors by dtype and shape (the output is a new one each call)
        return [(a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else a for a in args]
    assert shape(kept_run) == shape(keyed_run)
    assert kept_run[9] is q and kept_run[10] is k and kept_run[11] is v  # after grid, stream, function, metadata, hooks


def test_argument_errors_name_the_problem():
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16)
    cache = torch.randn(2, 16, 2, 32, dtype=torch.float16)
    new = torch.randn(2, 1, 2, 32, dtype=torch.float16)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    table = torch.zeros(2, 1, dtype=torch.int32)
    cos = torch.randn(32, 8)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        flash_attn_with_kvcache(torch.randn(2, 1, 3, 32, dtype=torch.float16), cache, cache)
    with pytest.raises(ValueError, match="rotary needs"):
        flash_attn_with_kvcache(q, cache, cache, rotary_cos=cos, rotary_sin=cos,
                                cache_seqlens=lens)
    with pytest.raises(ValueError, match="cache_batch_idx cannot be combined with block_table"):
        flash_attn_with_kvcache(q, cache, cache, block_table=table,
                                cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="needs cache_seqlens"):
        flash_attn_with_kvcache(q, cache, cache.clone(), k=new, v=new)
    # (a negative entry of a tensor is a padding row: test_flash_attn2_kvcache_padding.py)
    for bad in (torch.tensor([3, 16], dtype=torch.int32), 16, -1):
        with pytest.raises(ValueError, match=r"cache_seqlens must lie in 0\.\.15"):
            flash_attn_with_kvcache(q, cache, cache.clone(), k=new, v=new, cache_seqlens=bad)
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in 0\.\.16"):
        flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=17)
    with pytest.raises(ValueError, match=r"block_table entries must lie in 0\.\.1"):
        flash_attn_with_kvcache(q, cache, cache, block_table=table + 2, cache_seqlens=lens)
    with pytest.raises(ValueError, match=r"cache_batch_idx entries must lie in 0\.\.1"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens,
                                cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="both k and v"):
        flash_attn_with_kvcache(q, cache, cache.clone(), k=new, cache_seqlens=lens)
    with pytest.raises(ValueError, match="q is torch.float16"):
        flash_attn_with_kvcache(q, cache.float(), cache.float())


def test_bf16_under_interpreter_is_refused_before_touching_the_cache(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.randn(1, 1, 2, 32, dtype=torch.bfloat16)
    cache = torch.randn(1, 8, 2, 32, dtype=torch.bfloat16)
    before = cache.clone()
    new = torch.randn(1, 1, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="TRITON_INTERPRET"):
        flash_attn_with_kvcache(q, cache, cache, k=new, v=new, cache_seqlens=4)
    assert torch.equal(cache, before)


def test_public_package_exports_it():
    """The package's __init__ re-exports this function (not its 'unavailable' stub)."""
    spec = importlib.util.spec_from_file_location(
        "_test_flash_attn2_kvcache_public", PACKAGE_DIR / "__init__.py",
        submodule_search_locations=[str(PACKAGE_DIR)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pkg
    spec.loader.exec_module(pkg)
    q = torch.randn(2, 1, 4, 32)
    cache = torch.randn(2, 24, 2, 32)
    lens = torch.tensor([24, 9], dtype=torch.int32)
    got = pkg.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, causal=True)
    want = flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, causal=True)
    assert torch.equal(got, want)


def test_bf16_on_the_torch_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    q = torch.randn(2, 1, 4, 32, generator=gen)
    cache = torch.randn(2, 24, 1, 32, generator=gen)
    lens = torch.tensor([24, 9], dtype=torch.int32)
    out = flash_attn_with_kvcache(q.bfloat16(), cache.bfloat16(), cache.bfloat16(),
                                  cache_seqlens=lens)
    want = flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens)
    assert out.dtype == torch.bfloat16
    assert _rel_err(out.float(), want.double()) < 2e-2


def test_split_count_fills_the_gpu_and_keeps_short_contexts_over_a_wave_whole():
    dec = _load("_triton_decode")
    sms = 132  # an H100's / H200's SM count
    # batch 32 x 8 kv heads (256 programs, about two waves) over 4k keys: one split
    assert dec.choose_num_splits(256, 4096, sms, True, 64) == 1
    assert dec.choose_num_splits(sms, 2304, sms, True, 64) == 1
    # batch 8 x 8 kv heads (64 programs, under a wave) over 2.3k keys: split to fill the SMs,
    # never into slices under two blocks
    assert dec.choose_num_splits(64, 2304, sms, True, 64) == 7
    assert dec.choose_num_splits(64, 256, sms, True, 64) == 2
    # the same programs over 32k keys, or a single row: split to fill the SMs
    assert dec.choose_num_splits(64, 32768, sms, True, 128) > 1
    assert dec.choose_num_splits(8, 2304, sms, True, 128) > 1
    # short contexts are sliced only where their programs leave over a tenth of a wave idle
    assert dec.choose_num_splits(100, 4096, sms, True, 64) > 1
    assert dec.choose_num_splits(128, 4096, sms, True, 64) == 1  # batch 16 x 8 kv heads
    assert dec.choose_num_splits(sms + 1, 4096, sms, True, 64) == 1
    assert dec.choose_num_splits(sms + 1, 4097, sms, True, 64) > 1
    # enough programs for every SM: never split
    assert dec.choose_num_splits(3 * 132, 32768, sms, True, 128) == 1
    # the interpreter's pretend GPU keeps splitting short contexts, so the CPU tests cover merging
    assert dec.choose_num_splits(6, 70, 4, False, 16) > 1


@pytest.mark.parametrize("sm90", [True, False], ids=["sm90", "sm80"])
def test_a_row_read_in_one_slice_takes_the_one_split_tile_on_sm90(monkeypatch, sm90):
    """head_dim 128: a call whose rows are each read by one program (one split) takes the
    128-key, 2-stage tile on sm90 (measured faster there, ONE_SPLIT_CONFIG_SM90), and a contiguous
    cache is read that way at any length once the programs fill whole waves of one per SM, and so
    is a paged one whose blocks each lie in one page (one table entry a block); split calls, paged
    rows that look every key's page up (left padding) and other GPUs keep the 64-key, 4-stage
    tile. The calls run on fake CUDA tensors with the launches recorded, as on an H200 (132 SMs)
    or an A100-like sm80 GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    decode = _load("_triton_decode")
    launches = []
    monkeypatch.setattr(decode, "_SPLIT", lambda grid, args, constexprs, warps, stages:
                        launches.append((grid[0], (constexprs[2], warps, stages))))
    monkeypatch.setattr(decode, "_COMBINE", lambda *args: None)
    monkeypatch.setattr(decode, "_current_stream", lambda device: 0)
    monkeypatch.setattr(decode, "_capturing", lambda stream: False)
    monkeypatch.setattr(decode, "_COUNTERS", {})
    monkeypatch.setattr(decode, "_PARTIALS", {})
    device = torch.device("cuda", 0)
    monkeypatch.setitem(decode._SETUP, (128, device), decode.gpu_setup(128, (9, 0) if sm90 else (8, 0), 132))

    def call(batch, keys, paged, leftpad=None):
        q = torch.empty(batch, 1, 32, 128, dtype=torch.bfloat16, device=device)
        table = torch.empty(batch, keys // 256, dtype=torch.int32, device=device) if paged else None
        cache = torch.empty(batch * keys // 256, 256, 8, 128, dtype=torch.bfloat16, device=device) if paged else \
            torch.empty(batch, keys, 8, 128, dtype=torch.bfloat16, device=device)
        decode.decode_attention(q, cache, cache, total_lens=None, total_len_uniform=keys, capacity=keys,
                                block_table=table, batch_idx=None, leftpad=leftpad, alibi_slopes=None,
                                softmax_scale=0.1, window_left=-1, window_right=-1, softcap=0.0)
        return launches.pop()

    one_split, split = (128, 4, 2) if sm90 else (64, 4, 4), (64, 4, 4)
    with FakeTensorMode():
        assert call(32, 4096, paged=False) == (1, one_split)  # 256 programs over short rows
        assert call(32, 4096, paged=True) == (1, one_split)
        assert call(1, 32768, paged=False)[1] == split  # 8 programs: the rows are sliced
        splits, tile = call(32, 32768, paged=False)  # 256 programs: 0.97 of two waves of 132
        assert (splits, tile) == (1, one_split) if sm90 else (splits > 1 and tile == split)
        splits, tile = call(32, 32768, paged=True)  # 256-key pages hold whole 128-key blocks
        assert (splits, tile) == (1, one_split) if sm90 else (splits > 1 and tile == split)
        pads = torch.zeros(32, dtype=torch.int32, device=device)
        splits, tile = call(32, 32768, paged=True, leftpad=pads)  # blocks may straddle pages: sliced
        assert splits > 1 and tile == split
    assert decode.choose_num_splits(140, 32768, 132, True, 64, whole_rows=True) > 1  # 140 of 264 slots: sliced
