"""The shipped flash-attn2 under torch.compile: whole graphs, the same numbers as eager calls.

Under compilation the public functions reach the kernels through torch custom operators
(``_compiled``), so ``fullgraph=True`` holds and the compiled step computes exactly what the eager
call computes: the same kernels run either way (under TRITON_INTERPRET=1 here), so outputs, lse
and gradients are compared bit for bit. Eager calls do not pass through the operators.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flash_ref import load_flash_attn2

fa = load_flash_attn2()
ops = fa._compiled

# (batch, seq_q, seq_k, heads_q, heads_k, head_dim, dtype, options)
CASES = {
    "causal-gqa": (2, 33, 33, 4, 2, 32, torch.float16, dict(causal=True)),
    "window-softcap-alibi": (1, 40, 47, 2, 2, 64, torch.float32,
                             dict(window_size=(7, 3), softcap=4.0, alibi=(2,), softmax_scale=0.3)),
    "causal-sq>sk-d40": (1, 40, 17, 2, 1, 40, torch.float16, dict(causal=True)),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # every test compiles its own function: no recompile limit shared between tests
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(b, sq, sk, hq, hk, d, dtype, grad=True, noncontig=False):
    if noncontig:  # [B, H, S, D] storage seen as [B, S, H, D], and a sliced head_dim
        q = torch.randn(b, hq, sq, d + 8, dtype=dtype).transpose(1, 2)[..., :d]
        k = torch.randn(b, hk, sk, d, dtype=dtype).transpose(1, 2)
        v = torch.randn(b, sk, 2 * hk, d, dtype=dtype)[:, :, ::2]
    else:
        q, k, v = (torch.randn(b, s, h, d, dtype=dtype) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x, y), (x - y).abs().max()


class _OpsSeen(TorchDispatchMode):
    """The operator names an eager call dispatches."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("noncontig", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("case", list(CASES))
def test_flash_attn_func_compiles_to_one_graph_with_eager_numbers(case, noncontig):
    b, sq, sk, hq, hk, d, dtype, opts = CASES[case]
    opts = dict(opts)
    alibi = opts.pop("alibi", None)
    slopes = torch.rand(*alibi) if alibi is not None else None
    q, k, v = _qkv(b, sq, sk, hq, hk, d, dtype, noncontig=noncontig)
    dout = torch.randn(b, sq, hq, d, dtype=dtype)

    def step(q, k, v):
        return fa.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **opts)[:2]

    out, lse = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v)
    grads = _grads(out, (q, k, v), dout)
    eager_out, eager_lse = step(q, k, v)
    _assert_same((out, lse), (eager_out, eager_lse))
    _assert_same(grads, _grads(eager_out, (q, k, v), dout))
    assert lse.shape == (b, hq, sq)


def test_varlen_compiles_to_one_graph_with_eager_numbers():
    lens = [5, 17, 1, 30]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total, hq, hk, d = sum(lens), 4, 2, 32
    q, k, v = (torch.randn(total, h, d, dtype=torch.float16).requires_grad_() for h in (hq, hk, hk))
    dout = torch.randn(total, hq, d, dtype=torch.float16)

    def step(q, k, v):
        return fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                         return_attn_probs=True)[:2]

    out, lse = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v)
    eager_out, eager_lse = step(q, k, v)
    _assert_same((out, lse), (eager_out, eager_lse))
    assert lse.shape == (hq, total)
    _assert_same(_grads(out, (q, k, v), dout), _grads(eager_out, (q, k, v), dout))


def test_dropout_draws_its_seed_at_run_time_like_eager():
    q, k, v = _qkv(1, 24, 24, 2, 2, 32, torch.float16)
    dout = torch.randn(1, 24, 2, 32, dtype=torch.float16)

    def step(q, k, v):
        return fa.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(q, k, v)  # compiled once before the seeded calls
    torch.manual_seed(7)
    first = compiled(q, k, v)
    first_grads = _grads(first, (q, k, v), dout)
    second = compiled(q, k, v)
    torch.manual_seed(7)
    eager = step(q, k, v)
    # a seed fixed when the graph was traced would give every step the same mask
    assert not torch.equal(first, second)
    _assert_same((first,), (eager,))
    _assert_same(first_grads, _grads(eager, (q, k, v), dout))


@pytest.mark.parametrize("sq", [1, 40], ids=["decode", "prefill"])
def test_inference_calls_compile_with_eager_numbers(sq):
    q, k, v = _qkv(2, sq, 40, 4, 2, 32, torch.float16, grad=False)

    def step(q, k, v):
        return fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]

    with torch.no_grad():
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v)
        _assert_same(got, step(q, k, v))


def test_transformers_attention_function_compiles_to_one_graph():
    from kernel_loader.attention.backends.flash import make_flash_attention

    attend = make_flash_attention(fa)
    module = torch.nn.Module()
    module.is_causal = True
    compiled = torch.compile(lambda q, k, v: attend(module, q, k, v, None, scaling=0.2)[0],
                             backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for q_len in (1, 9):  # a decode step (the heads-first entry when eager) and a prefill
            q = torch.randn(2, 4, q_len, 32, dtype=torch.float16)  # transformers' [B, H, S, D]
            k, v = (torch.randn(2, 2, 9, 32, dtype=torch.float16) for _ in range(2))
            _assert_same((compiled(q, k, v),), (attend(module, q, k, v, None, scaling=0.2)[0],))


def _cache_call(paged: bool, lens_as_tensor: bool):
    """A decode step appending 2 new keys per row (with rotary tables) into a contiguous or paged
    cache: the call's keyword arguments, the caches being fresh copies each time."""
    b, hq, hk, d, page = 2, 4, 2, 32, 16
    g = torch.Generator().manual_seed(5)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float16)  # noqa: E731
    if paged:
        k_cache, v_cache = rnd(6, page, hk, d), rnd(6, page, hk, d)
        table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
    else:
        k_cache, v_cache, table = rnd(b, 40, hk, d), rnd(b, 40, hk, d), None
    lens = torch.tensor([9, 30], dtype=torch.int32) if lens_as_tensor else 17
    angles = torch.rand(48, d // 4, generator=g) * 3
    return dict(q=rnd(b, 2, hq, d), k_cache=k_cache, v_cache=v_cache, k=rnd(b, 2, hk, d), v=rnd(b, 2, hk, d),
                rotary_cos=angles.cos().half(), rotary_sin=angles.sin().half(), cache_seqlens=lens,
                block_table=table, causal=True, return_softmax_lse=True)


@pytest.mark.parametrize("lens_as_tensor", [True, False], ids=["lengths-tensor", "lengths-int"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_with_kvcache_compiles_to_one_graph_and_writes_the_caches_like_eager(paged, lens_as_tensor):
    compiled_call, eager_call = _cache_call(paged, lens_as_tensor), _cache_call(paged, lens_as_tensor)
    step = lambda call: fa.flash_attn_with_kvcache(**call)  # noqa: E731
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(compiled_call)
    want = step(eager_call)
    _assert_same(got, want)
    assert got[1].shape == (2, 4, 2)
    # the new keys and values went into the caches, as the eager call put them
    _assert_same((compiled_call["k_cache"], compiled_call["v_cache"]), (eager_call["k_cache"], eager_call["v_cache"]))
    assert not torch.equal(compiled_call["k_cache"], _cache_call(paged, lens_as_tensor)["k_cache"])


def test_with_kvcache_errors_still_name_the_problem_when_compiled():
    call = _cache_call(False, False)
    call["cache_seqlens"] = 39  # 39 + 2 new keys past the 40-key cache
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in 0\.\.38"):
        torch.compile(lambda call: fa.flash_attn_with_kvcache(**call), backend="aot_eager", fullgraph=True)(call)


def test_one_graph_serves_every_sequence_length_when_compiled_dynamic():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True), backend=backend,
                             fullgraph=True, dynamic=True)
    for seq in (17, 33, 64):
        q, k, v = _qkv(2, seq, seq, 4, 2, 32, torch.float16)
        dout = torch.randn(2, seq, 4, 32, dtype=torch.float16)
        out = compiled(q, k, v)
        want = fa.flash_attn_func(q, k, v, causal=True)
        _assert_same((out,), (want,))
        _assert_same(_grads(out, (q, k, v), dout), _grads(want, (q, k, v), dout))
    assert len(graphs) == 1


def test_packed_sequences_over_paged_caches_compile_for_inference():
    # flash_attn_varlen_func with block_table (transformers' continuous batching prefill)
    g = torch.Generator().manual_seed(9)
    lens_q, lens_k, page = [5, 12], [20, 33], 16
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(lens_q), 4, 32, generator=g, dtype=torch.float16)
    k_cache, v_cache = (torch.randn(7, page, 2, 32, generator=g, dtype=torch.float16) for _ in range(2))
    table = torch.tensor([[3, 0, 6], [1, 5, 2]], dtype=torch.int32)

    def step(q, k_cache, v_cache):
        return fa.flash_attn_varlen_func(q, k_cache, v_cache, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                         causal=True, block_table=table, return_attn_probs=True)[:2]

    with torch.no_grad():
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k_cache, v_cache)
        _assert_same(got, step(q, k_cache, v_cache))
    torch.library.opcheck(ops._varlen_paged, (q, k_cache, v_cache, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                              table, None, True, -1, -1, 0.0, None, True))


def test_eager_calls_do_not_pass_through_the_operators():
    q, k, v = _qkv(1, 20, 20, 2, 2, 32, torch.float16)
    with _OpsSeen() as seen:
        fa.flash_attn_func(q, k, v, causal=True).sum().backward()
    assert seen.names and not any(ops.NAMESPACE in name for name in seen.names)


def test_compiled_graph_calls_the_operators():
    q, k, v = _qkv(1, 20, 20, 2, 2, 32, torch.float16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch.compile(lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True), backend=backend, fullgraph=True)(q, k, v)
    assert len(graphs) == 1 and f"{ops.NAMESPACE}.fwd" in graphs[0]


@pytest.mark.parametrize("dropout", [False, True], ids=["fwd", "fwd_dropout"])
def test_operators_pass_torch_opcheck(dropout):
    q, k, v = _qkv(2, 20, 26, 4, 2, 32, torch.float16)
    head = (q, k, v, None, None, None, 0, 0, 0.25, True, -1, -1, 0.0)
    flags = (True, False, False)
    if dropout:
        # the seed comes from the CPU generator on every run, so outputs differ between runs:
        # opcheck's checks that compare two runs' numbers are left out
        torch.library.opcheck(ops._fwd_dropout, (*head, 0.2, *flags),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    else:
        torch.library.opcheck(ops._fwd, (*head, *flags))
    seed = torch.tensor(0, dtype=torch.int64)
    out, lse = ops._fwd(*head, *flags)
    torch.library.opcheck(ops._bwd, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(),
                                     lse, seed, None, None, None, 0, 0, 0.25, True, -1, -1, 0.0, 0.0, False))


def test_the_cache_operator_passes_torch_opcheck():
    call = _cache_call(True, True)
    args = (call["q"], call["k_cache"], call["v_cache"], call["k"], call["v"], call["rotary_cos"], call["rotary_sin"],
            call["cache_seqlens"], None, None, None, call["block_table"], None, True, -1, -1, 0.0, True, None, 0, True)
    torch.library.opcheck(ops._with_kvcache, args)


def test_each_loaded_copy_has_its_own_operators():
    other = load_flash_attn2()
    assert other._compiled.NAMESPACE != ops.NAMESPACE
    q, k, v = _qkv(1, 12, 12, 2, 2, 32, torch.float16, grad=False)
    with torch.no_grad():
        got = torch.compile(lambda q, k, v: other.flash_attn_func(q, k, v, causal=True), backend="aot_eager",
                            fullgraph=True)(q, k, v)
        _assert_same((got,), (fa.flash_attn_func(q, k, v, causal=True),))


def test_the_backend_is_a_constant_to_the_compiler_without_importing_it():
    # the package marks its backend query as torch.compiler.assume_constant_result does, without
    # importing that decorator's module (torch._dynamo, which imports Triton) at its own import
    marked = torch.compiler.assume_constant_result(lambda: None)
    assert vars(marked) == {"_dynamo_marked_constant": True}
    assert fa._autograd._backend_when_compiling._dynamo_marked_constant is True
