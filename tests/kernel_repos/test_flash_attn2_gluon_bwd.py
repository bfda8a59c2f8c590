"""When the flash-attn2 backward runs the Gluon sm90 kernel (``_gluon_bwd``), and that everything
else keeps the Triton backward.

The kernel itself runs only on an sm90 GPU (``bench/check_gpu.py`` and flash-attention's own tests
check it there, ``bench/attention.py`` times it beside the Triton backward); here the CPU walks
the dispatch rule, the host code around the launch (the dQ buffer and the epilogue that scales
and lays it out), the compile-ahead, and compiles the kernel for sm90 with the installed Triton
to see the instructions it is built on.
"""

from __future__ import annotations

import importlib
import re
from collections import Counter

import pytest
import torch

from flash_ref import (assert_out_and_grads_close, load_flash_attn2, poisoned_allocations, reference,
                       run_compiling_child)
from launch_record import recording

fa = load_flash_attn2()
dispatch = importlib.import_module(fa.__name__ + "._gluon_dispatch")
bwd = importlib.import_module(fa.__name__ + "._triton_bwd")
launch_mod = importlib.import_module(fa.__name__ + "._launch")

PLAIN = dict(capability=(9, 0), gluon_ok=True, head_dim=128, causal=True, seqlen_k=4096, plain=True, bf16=True,
             deterministic=False)


def _gluon_bwd():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    return importlib.import_module(fa.__name__ + "._gluon_bwd")


def test_measured_head_dims_run_the_gluon_backward_on_sm90():
    for head_dim, causal in ((64, False), (64, True), (128, False), (128, True), (256, False), (256, True)):
        assert dispatch.wants_gluon_backward(**{**PLAIN, "head_dim": head_dim, "causal": causal, "seqlen_k": 1})
        assert dispatch.wants_gluon_backward(**{**PLAIN, "head_dim": head_dim, "causal": causal, "seqlen_k": 1},
                                             varlen=True)


@pytest.mark.parametrize("change", [
    dict(capability=(8, 0)), dict(capability=(10, 0)), dict(capability=None), dict(gluon_ok=False),
    dict(plain=False), dict(bf16=False), dict(deterministic=True), dict(head_dim=96),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_anything_else_keeps_the_triton_backward(change):
    assert not dispatch.wants_gluon_backward(**{**PLAIN, **change})


def test_the_tables_list_only_head_dims_the_kernel_is_built_for():
    gb = _gluon_bwd()
    for table in (dispatch.MEASURED_FASTER_BWD, dispatch.MEASURED_FASTER_BWD_VARLEN):
        assert table and {d for d, _ in table} <= set(gb.HEAD_DIMS)


def test_a_backward_pair_can_require_a_minimum_of_keys():
    table = {(128, True): 2048}
    assert not dispatch.wants_gluon_backward(**{**PLAIN, "seqlen_k": 2047}, faster=table)
    assert dispatch.wants_gluon_backward(**{**PLAIN, "seqlen_k": 2048}, faster=table)
    assert not dispatch.wants_gluon_backward(**PLAIN, faster={})


def _as_sm90_with_gluon(monkeypatch):
    _gluon_bwd()
    monkeypatch.setattr(dispatch, "_GLUON_AVAILABLE", True)
    monkeypatch.setattr(bwd, "GLUON_BWD", None)


def _dense(d=128, dtype=torch.bfloat16, hq=4, hk=2):
    q = torch.randn(2, 100, hq, d, dtype=dtype)
    k = torch.randn(2, 90, hk, d, dtype=dtype)
    return q, k, torch.randn_like(k), torch.randn_like(q)


def _wanted(q, k, v, do, *, varlen=False, seqused=False, left=-1, right=-1, softcap=0.0, alibi=False, dropout=0.0,
            causal=True, deterministic=False, cap=(9, 0)):
    if causal:
        right = 0
    flags = (varlen, seqused, left >= 0, right >= 0, softcap > 0, alibi, dropout > 0, True)
    return bwd._gluon_wanted(q, k, v, do, cap, varlen, flags, causal, k.shape[1], deterministic)


def test_only_plain_dense_bf16_calls_reach_the_gluon_backward(monkeypatch):
    _as_sm90_with_gluon(monkeypatch)
    q, k, v, do = _dense()
    assert _wanted(q, k, v, do) and _wanted(q, k, v, do, causal=False)
    for change in (dict(seqused=True), dict(left=8), dict(causal=False, right=4),
                   dict(softcap=5.0), dict(alibi=True), dict(dropout=0.1), dict(deterministic=True),
                   dict(cap=(8, 0)), dict(cap=None)):
        assert not _wanted(q, k, v, do, **change), change
    assert not _wanted(*_dense(dtype=torch.float16))
    assert not _wanted(*_dense(d=96))
    odd = torch.randn(2, 100, 4, 129, dtype=torch.bfloat16)[..., :128]  # rows 258 bytes apart: no TMA
    assert not _wanted(odd, k, v, do)
    # a gradient that is a broadcast (stride 0 along tokens) is read by the Triton kernels
    assert not _wanted(q, k, v, torch.randn(1, 1, 4, 128, dtype=torch.bfloat16).expand(2, 100, 4, 128))
    monkeypatch.setattr(bwd, "GLUON_BWD", False)
    assert not _wanted(q, k, v, do)
    # forced on, it still serves only what it can: not a deterministic call, not a window
    monkeypatch.setattr(bwd, "GLUON_BWD", True)
    monkeypatch.setattr(dispatch, "MEASURED_FASTER_BWD", {})
    assert _wanted(q, k, v, do) and not _wanted(q, k, v, do, deterministic=True) and not _wanted(q, k, v, do, left=8)


def test_packed_calls_follow_their_own_table(monkeypatch):
    _as_sm90_with_gluon(monkeypatch)
    q = torch.randn(300, 4, 128, dtype=torch.bfloat16)  # [total, heads, dim]
    k = torch.randn(280, 2, 128, dtype=torch.bfloat16)
    v, do = torch.randn_like(k), torch.randn_like(q)
    assert _wanted(q, k, v, do, varlen=True)
    monkeypatch.setattr(dispatch, "MEASURED_FASTER_BWD_VARLEN", {})
    assert not _wanted(q, k, v, do, varlen=True)
    assert _wanted(*_dense())  # the dense table still decides for dense calls
    monkeypatch.setattr(dispatch, "MEASURED_FASTER_BWD_VARLEN", {(128, True): 281})
    assert not _wanted(q, k, v, do, varlen=True)  # the longest sequence's keys (here 280) count


@pytest.mark.parametrize("varlen", [False, True])
def test_the_sm90_host_path_scales_and_lays_out_the_reduced_dq(varlen, monkeypatch):
    """What an sm90 GPU would run for a plain call: the delta kernel, then the Gluon kernel with a
    zeroed fp32 buffer of head-major rows; dQ is that buffer times the softmax scale, laid out
    like q. The kernel's part is played by a fill of the buffer with known values."""
    gb = _gluon_bwd()
    _as_sm90_with_gluon(monkeypatch)
    if varlen:
        cu = torch.tensor([0, 70, 200], dtype=torch.int32)
        q = torch.randn(200, 4, 128, dtype=torch.bfloat16)
        k = torch.randn(200, 2, 128, dtype=torch.bfloat16)
        v, do = torch.randn_like(k), torch.randn_like(q)
        lse = torch.randn(4, 200)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=130, max_seqlen_k=130)
        batches, tokens = 1, 200  # the buffer's rows: (head, token) over all the packed tokens
    else:
        q, k, v, do = _dense()
        lse = torch.randn(2, 4, 100)
        kw = {}
        batches, tokens = 2, 100
    seen = {}

    def kernel(q_, k_, v_, do_, lse_, delta_, dq_acc, dk, dv, *, softmax_scale, causal, **packed):
        seen.update(zeroed=bool((dq_acc == 0).all()), shape=tuple(dq_acc.shape), dtype=dq_acc.dtype,
                    scale=softmax_scale, causal=causal, packed=sorted(packed))
        dq_acc.copy_(_pattern(dq_acc.shape))
        dk.fill_(1.0)
        dv.fill_(2.0)

    monkeypatch.setattr(gb, "gluon_dkdv_dq", kernel)
    with poisoned_allocations(), recording(fa, monkeypatch) as recorded:
        record = launch_mod.Launcher.__call__

        def record_and_run_delta(self, grid, args, constexprs, num_warps, num_stages):
            # the delta kernel runs here (the interpreter), so the buffer the Gluon kernel sees is
            # what it would see on the GPU: a dense call's buffer is zeroed by this launch alone
            record(self, grid, args, constexprs, num_warps, num_stages)
            if self._fn.__name__ == "_delta_kernel":
                self._fn[grid](*args, *constexprs, num_warps=num_warps)

        monkeypatch.setattr(launch_mod.Launcher, "__call__", record_and_run_delta)
        dq, dk, dv = bwd.attention_backward(do, q, k, v, do, lse, causal=True, softmax_scale=0.25, **kw)
    launched = [l for l in recorded if l.grid is not None]
    assert [l.name for l in launched] == ["_delta_kernel", "_dq_cast_kernel"]
    # dense: the delta launch takes the buffer and zeroes it (no fill kernel); packed: a fill does
    delta_zeroes = dict(zip(launched[0].launcher._constexpr_names, launched[0].constexprs))["ZERO_DQA"]
    assert delta_zeroes == (not varlen)
    cast = launched[1]
    # run here (the recording keeps Launchers from running)
    cast.launcher._fn[cast.grid](*cast.args, *cast.constexprs, num_warps=cast.num_warps)
    assert seen == dict(zeroed=True, shape=(batches * 4 * tokens, 128), dtype=torch.float32, scale=0.25,
                        causal=True, packed=sorted(kw))
    # buffer row (b, h, token) -> dq[b, token, h], times the scale
    want = _pattern((batches * 4 * tokens, 128)).view(batches, 4, tokens, 128)
    want = (want.transpose(1, 2) * 0.25).to(torch.bfloat16)
    assert torch.equal(dq, want[0] if varlen else want)
    assert dq.shape == q.shape and bool((dk == 1).all()) and bool((dv == 2).all())
    # an lse whose rows are not contiguous (not the forward's own) takes the Triton backward
    seen.clear()
    strided = lse.t().contiguous().t() if varlen else lse.transpose(1, 2).contiguous().transpose(1, 2)
    with recording(fa, monkeypatch) as recorded:
        bwd.attention_backward(do, q, k, v, do, strided, causal=True, softmax_scale=0.25, **kw)
    assert seen == {} and "_bwd_dkdv_kernel" in [l.name for l in recorded]


@pytest.mark.parametrize("head_dim, keys_per_program, stages, tma_out", [(128, 128, (2, 2, 2), True),
                                                                         (256, 64, (1, 1, 1), False)])
def test_the_launch_takes_the_split_of_its_head_dim(head_dim, keys_per_program, stages, tma_out):
    """Up to 128 columns a program holds 128 keys (64 a consumer) with double-buffered rings and
    stores dK / dV through the copy engine; at 256 the column split holds 64 keys with every ring
    single-buffered and masked stores."""
    gb = _gluon_bwd()
    q = torch.empty(2, 300, 4, head_dim, dtype=torch.bfloat16)
    k = torch.empty(2, 200, 2, head_dim, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 300)
    acc = torch.empty(2 * 4 * 300, head_dim)
    grid, args, kwargs = gb._launch_args(q, k, k, q, lse, lse, acc, k, k, 0.1, True)
    assert grid == (-(-200 // keys_per_program), 2 * 2, 1)
    assert (kwargs["STAGES"], kwargs["DS_STAGES"], kwargs["DQ_STAGES"]) == stages
    assert kwargs["TMA_OUT"] == tma_out
    assert args[1].block_shape == [1, keys_per_program, 1, head_dim]  # K's box


def _dispatch_order(n_kb: int, n_bh: int, order: int, tail: int = 0) -> list:
    """(key block, batch x KV head) of each program in dispatch order (x fastest), by the
    kernel's own arithmetic (_gluon_bwd._program_order)."""
    out = []
    for y in range(n_bh):
        for x in range(n_kb):
            t = y * n_kb + x
            if order == 1:
                heavy = n_kb - n_kb // 2
                main = n_bh * heavy
                out.append((t % heavy, t // heavy) if t < main else (heavy + (t - main) // n_bh, (t - main) % n_bh))
            else:
                main = (n_bh - tail) * n_kb
                out.append((t % n_kb, t // n_kb) if t < main else ((t - main) // tail, n_bh - tail + (t - main) % tail))
    return out


@pytest.mark.parametrize("n_kb, n_bh", [(8, 256), (32, 64), (1, 5), (2, 3), (7, 4), (64, 1)])
def test_lighter_half_last_dispatches_every_program_once_the_lighter_half_of_every_head_last(n_kb, n_bh):
    order = _dispatch_order(n_kb, n_bh, 1)
    assert sorted(order) == [(kb, bh) for kb in range(n_kb) for bh in range(n_bh)]
    heavy = n_kb - n_kb // 2
    # first each head's heavier key blocks (the left ones read the most query blocks), head by
    # head; then the lighter ones, key block by key block across the heads
    assert order[:n_bh * heavy] == [(kb, bh) for bh in range(n_bh) for kb in range(heavy)]
    assert order[n_bh * heavy:] == [(kb, bh) for kb in range(heavy, n_kb) for bh in range(n_bh)]


@pytest.mark.parametrize("n_kb, n_bh, tail", [(8, 256, 32), (32, 64, 8), (3, 5, 5), (7, 4, 1), (64, 1, 1)])
def test_last_heads_by_block_keeps_head_order_but_deals_the_last_heads_key_block_by_key_block(n_kb, n_bh, tail):
    order = _dispatch_order(n_kb, n_bh, 2, tail)
    assert sorted(order) == [(kb, bh) for kb in range(n_kb) for bh in range(n_bh)]
    main = (n_bh - tail) * n_kb
    assert order[:main] == [(kb, bh) for bh in range(n_bh - tail) for kb in range(n_kb)]
    assert order[main:] == [(kb, bh) for kb in range(n_kb) for bh in range(n_bh - tail, n_bh)]


def test_the_last_heads_are_as_many_as_fit_the_tail_bytes():
    gb = _gluon_bwd()
    # Q and dO of one head at 4k tokens, head_dim 128: 2 MB, so 8 fit in 16 MB; GQA groups count
    # every query head of the group; at least one head, at most all
    assert gb.TAIL_BYTES == 16 << 20
    assert gb.tail_heads(64, 4096, 128, 1) == 8
    assert gb.tail_heads(256, 1024, 128, 1) == 32
    assert gb.tail_heads(64, 2048, 64, 4) == 8
    assert gb.tail_heads(64, 4096, 256, 1) == 4
    assert gb.tail_heads(16, 1 << 20, 256, 8) == 1
    assert gb.tail_heads(3, 64, 64, 1) == 3


def test_program_orders_other_than_head_order_are_taken_by_dense_causal_calls_only(monkeypatch):
    gb = _gluon_bwd()
    q = torch.empty(2, 300, 4, 128, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 300)
    acc = torch.empty(2 * 4 * 300, 128)
    order = lambda causal, **kw: gb._launch_args(q, q, q, q, lse, lse, acc, q, q, 0.1, causal, **kw)[2]["ORDER"]  # noqa: E731
    # the last heads key block by key block by default (timed 1.01-1.06x head order:
    # bench/results/bwd_order.md); any order is taken by dense causal calls only
    assert gb.ORDER == gb.LAST_HEADS_BY_BLOCK and order(True) == 2 and order(False) == 0
    assert order(True, order=gb.HEAD_ORDER) == 0 and order(False, order=gb.LAST_HEADS_BY_BLOCK) == 0
    monkeypatch.setattr(gb, "ORDER", gb.LIGHTER_HALF_LAST)
    assert order(True) == 1 and order(False) == 0 and order(True, order=gb.HEAD_ORDER) == 0
    packed = torch.empty(600, 4, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 300, 600], dtype=torch.int32)
    kwargs = gb._launch_args(packed, packed, packed, packed, torch.empty(4, 600), torch.empty(4, 600),
                             torch.empty(4 * 600, 128), packed, packed, 0.1, True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                             max_seqlen_q=300, max_seqlen_k=300)[2]
    assert kwargs["ORDER"] == 0  # a packed grid spans the longest sequence: no fixed order to reshape


def test_calls_sharing_a_launcher_put_the_same_kind_of_argument_in_every_slot():
    """A Launcher keys one kind of argument per slot (a descriptor, a tensor, an int, None): the
    calls it serves, dense or packed, at every head dim, must agree slot by slot, or a cached
    launch would read a descriptor from None."""
    gb = _gluon_bwd()

    def kind(a):
        return type(a).__name__

    seen = {}
    for head_dim in gb.HEAD_DIMS:
        for varlen in (False, True):
            if varlen:
                q = torch.empty(300, 4, head_dim, dtype=torch.bfloat16)
                lse = torch.empty(4, 300)
                cu = torch.tensor([0, 100, 300], dtype=torch.int32)
                packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=200)
            else:
                q = torch.empty(2, 150, 4, head_dim, dtype=torch.bfloat16)
                lse = torch.empty(2, 4, 150)
                packed = {}
            acc = torch.empty(2 * 4 * 150, head_dim)
            _, args, kwargs = gb._launch_args(q, q, q, q, lse, lse, acc, q, q, 0.1, True, **packed)
            launcher = gb._launcher(kwargs["VARLEN"], kwargs["TMA_OUT"])
            seen.setdefault(id(launcher), set()).add(tuple(kind(a) for a in args))
    assert len(seen) == 3  # dense with TMA stores, dense without (head_dim 256), packed
    assert all(len(kinds) == 1 for kinds in seen.values()), seen


def _pattern(shape):
    """Buffer values that tell rows and columns apart and stay exact in bf16 once scaled by 1/4
    (integers below 256: the interpreter rounds bf16 casts toward zero, the GPU to nearest)."""
    rows, cols = shape
    r = torch.arange(rows, dtype=torch.float32)[:, None] % 61
    c = torch.arange(cols, dtype=torch.float32)[None, :] % 4
    return r * 4 + c


def test_compile_ahead_starts_the_gluon_compile_once_per_class(monkeypatch):
    gb = _gluon_bwd()
    _as_sm90_with_gluon(monkeypatch)
    monkeypatch.setattr(gb, "_AHEAD", set())
    launch_mod = importlib.import_module(fa.__name__ + "._launch")
    monkeypatch.setattr(launch_mod, "COMPILE_THREADS", 2)
    warmed = []
    real = gb._launcher(False, True)

    class Launcher:  # the dense calls' Launcher, compiling nothing
        _constexpr_names = real._constexpr_names

        @staticmethod
        def warmup(args, constexprs, num_warps, num_stages):
            warmed.append((dict(zip(real._constexpr_names, constexprs))["CAUSAL"], len(args), num_warps))

    monkeypatch.setattr(gb, "_launcher", lambda varlen, tma_out: Launcher)
    q, k, v, _ = _dense()
    with recording(fa, monkeypatch) as recorded:
        first = bwd.prepare_backward(q, k, v, causal=True, softmax_scale=0.1)
        again = bwd.prepare_backward(q, k, v, causal=True, softmax_scale=0.1)
    for f in first + again:
        f.result()
    # one compile, causal, of the four-warp kernel
    assert [(causal, warps) for causal, _, warps in warmed] == [(True, 4)]
    assert len(first) == 1 and again == []  # the Gluon compile (the recording starts no delta compile)
    # the delta and dQ cast kernels are asked for as well (recorded as compiles, grid None); no
    # Triton dK/dV or dQ
    assert [l.name for l in recorded] == ["_delta_kernel", "_dq_cast_kernel"] * 2


def test_the_interpreter_never_reaches_the_gluon_backward(monkeypatch):
    gb = _gluon_bwd()
    calls = []
    monkeypatch.setattr(gb, "gluon_dkdv_dq", lambda *a, **kw: calls.append(1))
    monkeypatch.setattr(dispatch, "_GLUON_AVAILABLE", True)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 24, 2, 64, dtype=torch.float16).requires_grad_() for _ in range(3))
    out = fa.flash_attn_func(q, k, v, causal=True)
    do = torch.randn_like(out)
    out.backward(do)
    assert calls == []
    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, _ = reference(rq, rk, rv, causal=True)
    ref_out.backward(do.double())
    assert_out_and_grads_close(out, ref_out, (q, k, v), (rq, rk, rv), 3e-3)


# Compiles in a child process (flash_ref.run_compiling_child)
_COMPILE_FOR_SM90 = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
import _fa2_sm90._gluon_bwd as gb

head_dim, causal, varlen = int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
if len(sys.argv) > 5:  # else the shipped order
    gb.ORDER = int(sys.argv[5])

if varlen:
    q = torch.empty(600, 4, head_dim, dtype=torch.bfloat16)
    lse = torch.empty(4, 600, dtype=torch.float32)
    cu = torch.zeros(3, dtype=torch.int32)
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=300, max_seqlen_k=300)
else:
    q = torch.empty(2, 256, 4, head_dim, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 256, dtype=torch.float32)
    packed = {}
acc = torch.empty(q.shape[-3] * 4 * (1 if varlen else 2), head_dim, dtype=torch.float32)
grid, args, kwargs = gb._launch_args(q, q, q, q, lse, lse, acc, q, q, 0.1, causal, **packed)
fn = gb._gluon_attn_bwd
names = list(fn.arg_names)
constants = {n: kwargs[n] for n in names if n in kwargs}
values = dict(zip([n for n in names if n not in constants], args))
constants.update({n: None for n, a in values.items() if a is None})  # a dense call's packed-only arguments
signature = {n: "constexpr" if n in constants else mangle_type(values[n]) for n in names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
c = triton.compile(GluonASTSource(fn, signature, {(names.index(n),): v for n, v in constants.items()}, attrs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=gb.REGS[2]))
# the stack frame ptxas gave the kernel (spilled registers live there): cuobjdump ships with Triton
import os, pathlib, re, subprocess, tempfile
cubin = pathlib.Path(tempfile.mkdtemp()) / "k.cubin"
cubin.write_bytes(c.asm["cubin"])
tool = pathlib.Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
stack = int(re.search(r"STACK:(\\d+)", usage).group(1))
sys.stdout.write(f"SHARED {c.metadata.shared} STACK {stack}\\n" + c.asm["ptx"])
"""


def _products_per_loop(head_dim: int) -> Counter:
    """wgmma instructions (by n) one consumer issues per query block."""
    if head_dim <= 128:
        # the key split: S^T and dP^T (n = 64 queries, k over head_dim), dV and dK (n = head_dim,
        # k over 64 queries), its half of dQ (n = head_dim / 2, k over all 128 keys)
        return Counter({64: 2 * (head_dim // 16)}) + Counter({head_dim: 2 * (64 // 16)}) + Counter(
            {head_dim // 2: 128 // 16})
    # the column split: S^T and dP^T for its 32 queries (n = 32, k over head_dim), then its half of
    # the columns of dV, dK (k over 64 queries) and dQ (k over 64 keys), n = head_dim / 2 each
    return Counter({32: 2 * (head_dim // 16)}) + Counter({head_dim // 2: 3 * (64 // 16)})


@pytest.mark.parametrize("head_dim, causal, varlen", [(128, True, False), (64, False, False), (128, True, True),
                                                      (256, True, False), (256, False, True)])
def test_kernel_compiles_for_sm90_to_five_wgmma_products_and_a_bulk_reduce(head_dim, causal, varlen, tmp_path):
    _gluon_bwd()
    done = run_compiling_child(_COMPILE_FOR_SM90, (head_dim, int(causal), int(varlen)), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes, ptx = done.stdout.split("\n", 1)
    assert int(sizes.split()[1]) <= 227 * 1024  # what one Hopper block may take
    if head_dim > 128:
        # the column split's 76 wgmma descriptors are computed in its loop (the views depend on
        # a value the compiler cannot fold); hoisted out of it they spilled, 864 bytes a thread,
        # reloaded every step
        assert int(sizes.split()[3]) <= 64
    # per query block and consumer, in a masked and an unmasked loop for each of two consumers
    shapes = Counter(int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx))
    assert shapes == Counter({n: 4 * c for n, c in _products_per_loop(head_dim).items()})
    # dQ leaves through the copy engine's reduce-add (one box per 128-byte swizzle span)
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.tensor\.2d\.global\.shared::cta\.add", ptx)) == head_dim // 32
    assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::\w+\.global", ptx)  # Q, K, V, dO loads
    # dK / dV: through the copy engine in dense calls (the ragged last block through masked
    # stores), only masked stores for packed sequences (a box would reach the next sequence) and
    # for the column split (each consumer holds half the columns)
    bulk_store = re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta\.bulk_group \[", ptx)
    assert (bulk_store is None) == (varlen or head_dim > 128)
    assert re.search(r"@%p\d+ st\.global", ptx)
    assert ".local" not in ptx
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    assert re.search(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+240;", ptx)
    # the key block and head straight from the grid's axes where the call keeps head order
    # (non-causal, packed); the shipped order of dense causal calls (LAST_HEADS_BY_BLOCK) works
    # them out from both axes
    assert ("%nctaid.y" in ptx) == (causal and not varlen)


@pytest.mark.parametrize("order", [0, 1])
def test_the_other_program_orders_compile_for_sm90(order, tmp_path):
    # HEAD_ORDER reads the key block and head from the grid's axes; LIGHTER_HALF_LAST works them
    # out from both, as the shipped LAST_HEADS_BY_BLOCK does
    _gluon_bwd()
    done = run_compiling_child(_COMPILE_FOR_SM90, (128, 1, 0, order), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("%nctaid.y" in done.stdout) == (order != 0) and ".local" not in done.stdout
