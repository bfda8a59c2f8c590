"""Random packed (varlen) calls, forward and backward, with the GPU's tile sizes, bounds-checked.

Each example draws sequence lengths (empty ones included, queries longer or shorter than keys),
GQA, a head dim from 1 to 256 (ragged ones padded), causal or windowed masks, softcap, ALiBi,
dropout and kv-packed input, and runs it under the interpreter with the sm90 tile table (the
shapes the GPU compiles; the interpreter's own tiles are smaller). Every load and store must stay
inside the launch's tensors (``interpreter_bounds``, active for every kernel test) and the output
must match the float64 reference on every sequence. The normal suite runs a few examples;
``pytest -m fuzz tests/kernel_repos/test_flash_attn2_bounds_fuzz.py`` runs the long budget.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools

import torch
from hypothesis import strategies as st

from flash_ref import load_flash_attn2, reference
from kernel_fuzz import fuzz_tests

fa = load_flash_attn2()
configs = importlib.import_module(fa.__name__ + "._configs")
SM90 = (9, 0)


@contextlib.contextmanager
def gpu_tiles(capability=SM90):
    """The shipped tile table of ``capability`` for interpreted launches (capability None)."""
    real_pick, real_pick_fwd = configs.pick, configs.pick_fwd

    def pick(kind, cap, block_d):
        return real_pick(kind, capability if cap is None else cap, block_d)

    def pick_fwd(cap, block_d, masked_right, group, keys):
        return real_pick_fwd(capability if cap is None else cap, block_d, masked_right, group, keys)

    configs.pick, configs.pick_fwd = pick, pick_fwd
    try:
        yield
    finally:
        configs.pick, configs.pick_fwd = real_pick, real_pick_fwd


calls = st.fixed_dictionaries(dict(
    lens_q=st.lists(st.integers(0, 150), min_size=1, max_size=3),
    lens_k=st.lists(st.integers(0, 150), min_size=3, max_size=3),
    heads=st.sampled_from([(2, 1), (2, 2), (3, 1)]),
    d=st.sampled_from([1, 16, 40, 64, 80, 128, 200, 256]),
    mask=st.sampled_from(["none", "causal", "window"]),
    window=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    softcap=st.sampled_from([0.0, 30.0]),
    alibi=st.booleans(),
    dropout=st.sampled_from([0.0, 0.2]),
    kvpacked=st.booleans(),
    dtype=st.sampled_from([torch.float16, torch.float32]),
))


def _run(call: dict) -> None:
    lens_q = call["lens_q"]
    lens_k = call["lens_k"][: len(lens_q)]
    hq, hk = call["heads"]
    d, dtype = call["d"], call["dtype"]
    cu = lambda ls: torch.tensor([0] + list(itertools.accumulate(ls)), dtype=torch.int32)  # noqa: E731
    g = torch.Generator().manual_seed(sum(lens_q) * 7 + d)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype).requires_grad_()
    kv = torch.randn(sum(lens_k), 2, hk, d, generator=g).to(dtype)
    if call["kvpacked"]:
        kv.requires_grad_()
        k, v = kv[:, 0], kv[:, 1]
    else:
        k, v = kv[:, 0].clone().requires_grad_(), kv[:, 1].clone().requires_grad_()
    opts = dict(causal=call["mask"] == "causal", softcap=call["softcap"],
                window_size=call["window"] if call["mask"] == "window" else (-1, -1),
                alibi_slopes=torch.rand(len(lens_q), hq, generator=g) * 0.3 if call["alibi"] else None)
    p = call["dropout"]
    with gpu_tiles():
        if call["kvpacked"]:
            out = fa.flash_attn_varlen_kvpacked_func(q, kv, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                                     dropout_p=p, **opts)
        else:
            out = fa.flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                            dropout_p=p, **opts)
        out.backward(torch.randn_like(out))
    assert torch.isfinite(out).all()
    if p > 0:
        return  # the mask replay is checked by the varlen tests; here the bounds are the point
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    starts_q, starts_k = cu(lens_q).tolist(), cu(lens_k).tolist()
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nq == 0:
            continue
        sl = slice(b, b + 1)
        qb = q.detach()[starts_q[b]:starts_q[b] + nq][None]
        kb = k.detach()[starts_k[b]:starts_k[b] + nk][None]
        vb = v.detach()[starts_k[b]:starts_k[b] + nk][None]
        want, _ = reference(qb, kb, vb, **dict(opts, alibi_slopes=None if opts["alibi_slopes"] is None
                                                else opts["alibi_slopes"][sl]))
        got = out.detach()[starts_q[b]:starts_q[b] + nq][None].double()
        assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item()), (b, nq, nk)


# the suite's few examples, and the long budget under -m fuzz
(test_packed_calls_with_gpu_tiles_stay_in_bounds,
 test_packed_calls_with_gpu_tiles_stay_in_bounds_long) = fuzz_tests(_run, calls, "packed fwd+bwd calls, sm90 tiles")
