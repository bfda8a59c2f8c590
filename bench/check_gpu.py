"""Correctness of the shipped kernel on a GPU: against a float64 reference, and against a baseline
copy of the package (``--baseline``: a kernel repo folder, e.g. the previous commit's) in the
same run. Every output and gradient of the two is compared element by element. The calls
compiled with torch.compile are compared with the same calls eager (``check_compiled``), and the
packed Gluon forward walking a tile list with the same call one program a tile
(``check_packed_walk``). The dense Gluon forward walking the host's tile table is compared with
the formula's deal bit for bit (``check_scheduled_walk``), also where the table is handed to
another stream or to a CUDA graph capture (``check_table_handoff``).

Writes ``bench/results/check_gpu.md`` and ``.json``; exits 1 when a check fails::

    python bench/check_gpu.py --baseline /path/to/old/flash-attn2
"""

from __future__ import annotations

import sys

import harness

sys.path.insert(0, str(harness.REPO_ROOT / "tests" / "kernel_repos"))

TOL = 2e-2  # bf16 operands: relative error against float64 lands between 1e-3 and 1e-2
# (name, batch, seq_q, seq_k, heads_q, heads_k, head_dim, options); varlen packs the batch
CASES = [
    ("plain-d128", 2, 384, 384, 4, 4, 128, {}),
    ("causal-gqa-d64", 2, 300, 300, 8, 2, 64, dict(causal=True)),  # two query heads a program on sm90
    ("causal-sq<sk-gqa2-softcap-d64", 2, 200, 333, 4, 2, 64, dict(causal=True, softcap=20.0)),  # paired, softcap
    ("causal-sq>sk-gqa-d60", 1, 333, 200, 8, 2, 60, dict(causal=True)),  # paired, a padded head dim
    ("gqa-ragged-d64", 2, 300, 700, 8, 2, 64, {}),  # the Gluon forward on three consumers on sm90 (_gluon_fwd.NON_CAUSAL)
    ("causal-gqa-d64-4k", 1, 4100, 4100, 4, 2, 64, dict(causal=True)),  # causal from 4k queries: Gluon too
    ("causal-sq<sk-d128", 1, 200, 517, 4, 4, 128, dict(causal=True)),
    ("window-softcap-d96", 2, 256, 256, 4, 2, 96, dict(window_size=(37, 11), softcap=30.0)),
    ("alibi-causal-d256", 1, 250, 250, 2, 2, 256, dict(causal=True, alibi=True)),
    ("causal-gqa-d256", 2, 300, 300, 8, 2, 256, dict(causal=True)),
    ("causal-sq>sk-d256", 1, 517, 200, 2, 2, 256, dict(causal=True)),
    ("gqa-ragged-d256", 2, 300, 333, 8, 2, 256, {}),
    ("d16-causal", 2, 333, 333, 4, 4, 16, dict(causal=True)),
    ("d59-mqa", 2, 129, 257, 6, 1, 59, {}),
    ("varlen-causal-d128", 3, 300, 300, 4, 2, 128, dict(causal=True, varlen=True)),
    ("varlen-d128", 3, 300, 300, 4, 2, 128, dict(varlen=True)),
    ("varlen-causal-sq<sk-d256", 2, 200, 517, 2, 2, 256, dict(causal=True, varlen=True)),
    ("varlen-d256", 3, 300, 300, 4, 2, 256, dict(varlen=True)),
]
QUICK = {"plain-d128", "causal-gqa-d64", "window-softcap-d96", "d16-causal", "varlen-causal-d128", "paged-gqa-d128"}
DECODE = [("paged-gqa-d128", 8, 1000, 32, 8, 128, 256), ("dense-gqa-d128", 8, 1000, 32, 8, 128, None),
          ("paged-d64-3q", 4, 700, 8, 8, 64, 256)]


def _dense(fa, q, k, v, opts):
    import itertools

    import torch

    slopes = opts.get("slopes")
    kw = dict(causal=opts.get("causal", False), window_size=opts.get("window_size", (-1, -1)),
              softcap=opts.get("softcap", 0.0), alibi_slopes=slopes)
    if not opts.get("varlen"):
        return fa.flash_attn_func(q, k, v, **kw)
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    lens_q, lens_k = [sq - 37 * i for i in range(b)], [sk - 37 * i for i in range(b)]
    cu = lambda ls: torch.tensor([0, *itertools.accumulate(ls)], device="cuda", dtype=torch.int32)  # noqa: E731
    pack = lambda t, ls: torch.cat([t[i, :n] for i, n in enumerate(ls)])  # noqa: E731
    out = fa.flash_attn_varlen_func(pack(q, lens_q), pack(k, lens_k), pack(v, lens_k), cu(lens_q), cu(lens_k),
                                    sq, sk, **kw)
    full = torch.zeros_like(q)
    for i, n in enumerate(lens_q):  # back to [B, S, H, D]; rows past a length stay 0
        full[i, :n] = out[int(cu(lens_q)[i]):int(cu(lens_q)[i]) + n]
    return full


def check_dense(kernels: dict, case) -> dict:
    import torch
    from flash_ref import reference, rel_err

    name, b, sq, sk, hq, hk, d, opts = case
    g = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for s, h in ((sq, hq), (sk, hk), (sk, hk))]
    dout = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["slopes"] = torch.rand(b, hq, device="cuda", generator=g) * 0.3
    results, failures = {}, {}
    for label, fa in kernels.items():
        if label != "ours":
            try:  # a baseline that refuses the case (say, a head dim it lacks) is noted, not fatal
                _dense(fa, *(t.clone() for t in base), opts)
            except Exception as e:
                failures[label] = f"{type(e).__name__}: {e}"
                continue
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = _dense(fa, q, k, v, opts)
        if opts.get("varlen"):  # padded rows carry no gradient
            mask = torch.zeros_like(out)
            for i in range(b):
                mask[i, :sq - 37 * i] = 1
            out = out * mask
        out.backward(dout)
        results[label] = [out.detach(), q.grad, k.grad, v.grad]
    qr, kr, vr = (t.double().requires_grad_() for t in base)
    ref_kw = dict(causal=opts.get("causal", False), window_size=opts.get("window_size", (-1, -1)),
                  softcap=opts.get("softcap", 0.0), alibi_slopes=opts.get("slopes"))
    if opts.get("varlen"):
        errs = {w: 0.0 for w in ("out", "dq", "dk", "dv")}
        for i in range(b):
            nq, nk = sq - 37 * i, sk - 37 * i
            qi, ki, vi = (t.detach()[i:i + 1, :n].clone().requires_grad_() for t, n in ((qr, nq), (kr, nk), (vr, nk)))
            ro, _ = reference(qi, ki, vi, **ref_kw)
            ro.backward(dout[i:i + 1, :nq].double())
            ours = results["ours"]
            for w, got, want in (("out", ours[0][i:i + 1, :nq], ro), ("dq", ours[1][i:i + 1, :nq], qi.grad),
                                 ("dk", ours[2][i:i + 1, :nk], ki.grad), ("dv", ours[3][i:i + 1, :nk], vi.grad)):
                errs[w] = max(errs[w], rel_err(got, want))
    else:
        ro, _ = reference(qr, kr, vr, **ref_kw)
        ro.backward(dout.double())
        errs = {w: rel_err(got, want) for w, got, want in zip(("out", "dq", "dk", "dv"), results["ours"],
                                                              (ro, qr.grad, kr.grad, vr.grad))}
    row = dict(case=name, worst_rel_err=max(errs.values()), passed=max(errs.values()) < TOL, **errs)
    if "baseline" in failures:
        row.update(max_abs_diff_vs_baseline=None, identical_to_baseline=f"baseline raised {failures['baseline']}")
    if "baseline" in results:
        diff = max(float((a.float() - c.float()).abs().max()) for a, c in zip(results["ours"], results["baseline"]))
        row.update(max_abs_diff_vs_baseline=diff, identical_to_baseline=diff == 0.0)
    return row


def check_decode(kernels: dict, case) -> dict:
    import torch
    from flash_ref import reference, rel_err

    name, b, ctx, hq, hk, d, page = case
    g = torch.Generator(device="cuda").manual_seed(1)
    sq = 3 if name.endswith("3q") else 1
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.randint(ctx // 2, ctx, (b,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    if page:
        pages = -(-ctx // page)
        k_cache = torch.randn(b * pages, page, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(b * pages, generator=torch.Generator().manual_seed(3)).view(b, pages).to("cuda", torch.int32)
        rows = lambda c, i: c[table[i].long()].flatten(0, 1)  # noqa: E731
    else:
        k_cache = torch.randn(b, ctx, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v_cache, table = torch.randn_like(k_cache), None
        rows = lambda c, i: c[i]  # noqa: E731
    outs = {label: fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens.cuda(), block_table=table,
                                              causal=True) for label, fa in kernels.items()}
    err = 0.0
    for i in range(b):
        n = int(lens[i])
        want, _ = reference(q[i:i + 1], rows(k_cache, i)[:n][None], rows(v_cache, i)[:n][None], causal=True)
        err = max(err, rel_err(outs["ours"][i:i + 1], want))
    row = dict(case=f"decode-{name}", worst_rel_err=err, out=err, passed=err < TOL)
    if "baseline" in outs:
        diff = float((outs["ours"].float() - outs["baseline"].float()).abs().max())
        row.update(max_abs_diff_vs_baseline=diff, identical_to_baseline=diff == 0.0)
    return row


def check_decode_heads_first(fa, device: str = "cuda", dtype=None, small: bool = False) -> dict:
    """transformers' decode through ``flash_attn_decode_heads_first``: q ``[B, Hq, 1, D]`` over a
    dense cache ``[B, Hk, S, D]`` that grows a token a step (contiguous, as transformers' dynamic
    cache is), each step's call made three times (a model's layers), the third on a q whose
    address is not a multiple of 16 bytes; every output against float64. On a GPU, with kept
    launches on (the default; ``FLASH_ATTN2_KEEP_LAUNCHES=0`` turns them off), the repeated calls go through the launch the first one kept
    (``_triton_decode._kept_launch``): the row counts the plans that kept one, and fails if none
    did. ``small``: interpreter-sized shapes.
    Raises nothing of its own."""
    import importlib

    import torch
    from flash_ref import reference, rel_err

    dtype = dtype or torch.bfloat16
    b, hq, hk, d, start, steps = (2, 4, 2, 32, 40, 3) if small else (4, 32, 8, 128, 4090, 4)
    g = torch.Generator(device=device).manual_seed(6)
    rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=g)  # noqa: E731
    decode = importlib.import_module(fa.__name__ + "._triton_decode")
    cache_k, cache_v = rnd(b, hk, start + steps, d), rnd(b, hk, start + steps, d)
    err, served = 0.0, True
    for step in range(steps):
        k, v = cache_k[:, :, :start + step].contiguous(), cache_v[:, :, :start + step].contiguous()
        for layer in range(3):
            q = rnd(b, hq, 1, d) if layer < 2 else rnd(b * hq * d + 1)[1:].view(b, hq, 1, d)
            out = fa.flash_attn_decode_heads_first(q, k, v, None, True, (-1, -1), 0.0)
            if out is None:
                served = False
                continue
            want, _ = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
            err = max(err, rel_err(out, want))
    kept = sum(len(plan[-1]) for plan in decode._PLANS.values() if plan[-1])
    return dict(case="decode-heads-first-gqa", worst_rel_err=err, out=err, kept_launches=kept,
                passed=served and err < TOL and (kept > 0 or device != "cuda" or not decode.KEEP_LAUNCHES))


def check_compiled(fa, device: str = "cuda", dtype=None, small: bool = False) -> list:
    """Rows: the kernel's calls compiled (``torch.compile(fullgraph=True)``, ``aot_eager``) against
    the same calls eager, element by element: a packed training step (``deterministic=True``, so
    the gradients repeat bit for bit), an inference prefill and a paged KV-cache decode step that
    appends keys (the caches compared too). ``bench/compiled.py`` checks dense training steps
    under CUDA graphs. ``small``: shapes small enough for the Triton interpreter (the tests).
    Raises what torch.compile raises."""
    import torch

    dtype = dtype or torch.bfloat16
    g = torch.Generator(device=device).manual_seed(4)
    rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=g)  # noqa: E731
    rows = []

    def compare(case, fn, *inputs, dout=None, fresh=False):
        # dout given: the inputs' gradients too (taken outside the compiled function); fresh: each
        # run gets copies of the inputs (the call writes into them)
        def run(f):
            args = [t.clone() for t in inputs] if fresh else inputs
            outs = f(*args)
            grads = torch.autograd.grad(outs[0], args, dout) if dout is not None else ()
            return [*outs, *grads]
        torch._dynamo.reset()
        got = run(torch.compile(fn, backend="aot_eager", fullgraph=True))
        want = run(fn)
        diff = max(float((a.detach().float() - b.detach().float()).abs().max()) for a, b in zip(got, want))
        rows.append(dict(case=f"compiled-{case}", max_abs_diff_vs_eager=diff, passed=diff == 0.0))

    d, lens, seq, page, ctx = (32, [30, 17, 1], 20, 16, [40, 5, 60]) if small else \
        (128, [300, 263, 1], 200, 256, [700, 5, 1000])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device, dtype=torch.int32)
    q, k, v = (rnd(sum(lens), h, d).requires_grad_() for h in (4, 2, 2))

    def packed(q, k, v):
        return (fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, deterministic=True),)
    compare("varlen-causal-train", packed, q, k, v, dout=rnd(sum(lens), 4, d))

    def prefill(q, k, v):
        with torch.no_grad():
            return fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]
    compare("prefill-gqa", prefill, rnd(2, seq, 8, d // 2), rnd(2, seq, 2, d // 2), rnd(2, seq, 2, d // 2))

    pages, b = 4, 3
    table = torch.randperm(b * pages, generator=torch.Generator().manual_seed(5)).view(b, pages).to(device, torch.int32)
    caches = (rnd(b * pages, page, 2, d), rnd(b * pages, page, 2, d))
    new_kv = (rnd(b, 1, 2, d), rnd(b, 1, 2, d))
    lens_k = torch.tensor(ctx, device=device, dtype=torch.int32)

    def decode(q, k_cache, v_cache):
        out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, *new_kv, cache_seqlens=lens_k, block_table=table,
                                         causal=True)
        return out, k_cache, v_cache  # the appended keys and values are compared too
    compare("decode-paged-append", decode, rnd(b, 1, 8, d), *caches, fresh=True)
    torch._dynamo.reset()
    return rows


def _guarded(check, kernels: dict, case) -> dict:
    """``check(kernels, case)``; a case that raises is a failed row naming the error, so the other
    cases still run and the table is still written."""
    try:
        return check(kernels, case)
    except Exception as e:  # noqa: BLE001 - any error of the kernel is this case's result
        return dict(case=case[0], passed=False, error=f"{type(e).__name__}: {e}"[:300])


def check_packed_walk(fa) -> list:
    """Rows: the Gluon forward on packed sequences walking its sorted tile list persistently
    (``persistent=True``, ``_gluon_fwd.PERSISTENT_VARLEN``) against the same call one program a
    tile: output and lse equal element by element (each tile's arithmetic is the same). Lengths
    with an empty and a one-token sequence, fewer live tiles than SMs and many more. Raises what
    the kernel raises."""
    import importlib

    import torch

    gf = importlib.import_module(fa.__name__ + "._gluon_fwd")
    rows = []
    g = torch.Generator().manual_seed(5)
    few = [0, 1, 129, 300]
    many = [int(n) for n in torch.randint(1, 3000, (24,), generator=g)] + [0, 1]
    for d, causal, lens in ((128, True, many), (128, False, many), (256, True, many), (64, False, many),
                            (128, True, few)):
        cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
        q, k, v = (torch.randn(int(cu[-1]), 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        run = lambda persistent: gf.gluon_attention_forward(  # noqa: E731
            q, k, v, softmax_scale=d ** -0.5, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
            max_seqlen_q=max(lens), persistent=persistent)
        (walk, walk_lse), (tile, tile_lse) = run(True), run(False)
        diff = max(float((walk.float() - tile.float()).abs().max()), float((walk_lse - tile_lse).abs().max()))
        rows.append(dict(case=f"packed-walk-d{d}{'-causal' if causal else ''}-{len(lens)}seq",
                         max_abs_diff_vs_eager=diff, passed=torch.equal(walk, tile) and torch.equal(walk_lse, tile_lse)))
    return rows


def check_scheduled_walk(fa) -> list:
    """Rows: the dense Gluon forward walking the host's table (``_schedule``, ``schedule=True``)
    against the formula's deal (``schedule=False``): output and lse equal element by element (each
    tile's arithmetic is the same). Causal with the shortest tiles dealt last, sq < sk and sq > sk,
    three consumers' 192-row tiles non-causal, fewer tiles than SMs; each row names the deal its
    table holds ("list": the model's, "formula": the formula's written out). Raises what the
    kernel raises."""
    import importlib

    import torch

    gf = importlib.import_module(fa.__name__ + "._gluon_fwd")
    sched = importlib.import_module(fa.__name__ + "._schedule")
    rows = []
    torch.manual_seed(6)
    for d, b, sq, sk, h, causal in ((128, 4, 4096, 4096, 16, True), (64, 4, 4096, 4096, 16, True),
                                    (64, 4, 4096, 4096, 16, False), (256, 2, 1000, 1700, 8, True),
                                    (128, 3, 1500, 700, 8, True), (128, 1, 900, 900, 3, True)):
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        sched._TABLES.clear()
        run = lambda schedule: gf.gluon_attention_forward(  # noqa: E731
            q, k, v, softmax_scale=d ** -0.5, causal=causal, schedule=schedule)
        dealt, dealt_lse = run(True)
        listed = any(t is not None for t in sched._TABLES.values())  # None: the formula's deal
        formula, formula_lse = run(False)
        diff = max(float((dealt.float() - formula.float()).abs().max()),
                   float((dealt_lse - formula_lse).abs().max()))
        rows.append(dict(case=f"scheduled-walk-d{d}{'-causal' if causal else ''}-{b}x{sq}/{sk}x{h}-"
                              f"{'list' if listed else 'formula'}",
                         max_abs_diff_vs_eager=diff,
                         passed=torch.equal(dealt, formula) and torch.equal(dealt_lse, formula_lse)))
    return rows


def check_table_handoff(fa) -> list:
    """Rows: the tile table on its way to the GPU (``_schedule.device_table``), each result equal
    bit for bit to the formula's deal. 'side-stream': the call that builds the table launches on
    one stream and a second call at once on another (it must wait for the table's copy);
    'graph-with-table': a CUDA graph captured right after the call that built the table (the
    capture takes it without waiting), replayed on new inputs; 'graph-without-table': a capture of a shape with no table yet (the
    capture keeps the formula), replayed, and the eager call after it builds the table. Raises
    what the kernel raises."""
    import importlib

    import torch

    gf = importlib.import_module(fa.__name__ + "._gluon_fwd")
    sched = importlib.import_module(fa.__name__ + "._schedule")
    torch.manual_seed(7)
    d, b, s, h = 128, 4, 4096, 16  # a shape the model deals ("list"), as in check_scheduled_walk
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    run = lambda schedule: gf.gluon_attention_forward(  # noqa: E731
        q, k, v, softmax_scale=d ** -0.5, causal=True, schedule=schedule)
    built = lambda: any(t is not None for t in sched._TABLES.values())  # noqa: E731
    formula = run(False)
    rows = []

    sched._TABLES.clear()
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(first):
        a = run(True)
    with torch.cuda.stream(second):
        c = run(True)
    torch.cuda.synchronize()
    same = all(torch.equal(x, y) for got in (a, c) for x, y in zip(got, formula))
    rows.append(dict(case="table-side-stream", passed=same and built()))

    def replayed() -> tuple:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph):
                static = run(True)
        torch.cuda.current_stream().wait_stream(stream)
        q.copy_(torch.randn_like(q))  # new inputs, read by the replay
        graph.replay()
        torch.cuda.synchronize()
        return static

    sched._TABLES.clear()
    run(True)  # builds the table; its copy not yet waited for when the capture takes it
    got = replayed()
    want = run(False)
    rows.append(dict(case="table-graph-with-table", passed=built() and all(
        torch.equal(x, y) for x, y in zip(got, want))))
    sched._TABLES.clear()
    got = replayed()
    want = run(False)
    kept_formula = not built()
    again = run(True)  # eager: now the table is built
    rows.append(dict(case="table-graph-without-table", passed=kept_formula and built() and all(
        torch.equal(x, y) for pair in ((got, want), (again, want)) for x, y in zip(*pair))))
    return rows


def main() -> None:
    parser = harness.arguments(__doc__, baseline=True)
    parser.add_argument("--quick", action="store_true", help="the cases marked QUICK only (each case compiles)")
    args = parser.parse_args()
    kernels = harness.kernels(args.baseline)
    pick = (lambda cases: [c for c in cases if c[0] in QUICK]) if args.quick else (lambda cases: cases)
    rows = [_guarded(check_dense, kernels, c) for c in pick(CASES)] + [
        _guarded(check_decode, kernels, c) for c in pick(DECODE)]
    rows.append(_guarded(lambda kernels, case: check_decode_heads_first(kernels["ours"]), kernels,
                         ("decode-heads-first-gqa",)))
    for case, check in (("compiled", check_compiled), ("packed-walk", check_packed_walk),
                        ("scheduled-walk", check_scheduled_walk), ("table-handoff", check_table_handoff)):
        try:
            rows += check(kernels["ours"])
        except Exception as e:  # noqa: BLE001 - a compile or kernel that fails is this check's result
            rows.append(dict(case=case, passed=False, error=f"{type(e).__name__}: {e}"[:300]))
    columns = dict(case="case", out="out", dq="dq", dk="dk", dv="dv", passed="within 2e-2 (compiled: equal)",
                   max_abs_diff_vs_eager=("compiled: max |compiled - eager|; packed walk: max |walk - per tile|; "
                                          "scheduled walk: max |table - formula|"),
                   kept_launches="heads-first decode: plans whose launch was kept",
                   error="error")
    if args.baseline:
        columns.update(max_abs_diff_vs_baseline="max |ours - baseline|", identical_to_baseline="bitwise equal")
    path = harness.write_results(
        "check_gpu", rows, title="Shipped kernel on the GPU: relative error vs float64" + (
            ", and element-wise vs the baseline package" if args.baseline else ""),
        columns=columns, out_dir=args.out, commit=args.commit,
        notes=[f"bf16; errors are ‖ours − ref‖/‖ref‖ against float64; baseline: `{args.baseline}`"
               if args.baseline else "bf16; errors are ‖ours − ref‖/‖ref‖ against float64"])
    print(path.read_text())
    if not all(r["passed"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
