"""flash-attention's own tests (its ``tests/test_flash_attn.py``), run against the shipped kernel on a GPU.

The parametrization below is flash-attention's, read as facts: the value lists of each test's
``@pytest.mark.parametrize`` (head dims, sequence-length pairs, features). From them a sample is
drawn that covers every head dim and every pair of feature values of each test (a greedy pairwise
covering array, seeded), and each case is checked the way flash-attention checks it: the error of
our output (and gradients) against a float64 reference must stay within a multiple of the error
of the same reference computed in the input's own precision (2x for outputs, 3x for gradients,
plus 1e-5), which is the error any correct low-precision kernel makes. The reference is the
repo's own (``tests/kernel_repos/flash_ref.py``).

Cases run in ``--workers`` processes that share one Triton cache (compiling is most of the time)
and pull cases from one queue; a case that ends its process's CUDA context (a device fault) is
recorded as that failure and a fresh process takes the cases after it. ``--only 18 --blocking``
(or ``--case '<json>' --blocking``) reruns one case with CUDA_LAUNCH_BLOCKING=1, so the error
names the launch that faulted.
Writes ``bench/results/flash_attn_tests.md`` and ``.json``::

    python bench/flash_attn_tests.py --workers 12
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import multiprocessing as mp
import os
import random
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List

import harness

sys.path.insert(0, str(harness.REPO_ROOT / "tests" / "kernel_repos"))

# flash-attention's parametrization (tests/test_flash_attn.py), per test. 16 is added to every
# dense list: flash-attention accepts any head dim up to 256, and its bwd_overflow test uses 16.
HEAD_DIMS = [16, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
SEQLENS_OUTPUT = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
                  (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)]
SEQLENS_KVCACHE = [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048),
                   (16, 20000), (128, 128)]
FAMILIES: Dict[str, Dict[str, list]] = {
    "test_flash_attn_output": dict(
        d=HEAD_DIMS, seqlens=SEQLENS_OUTPUT, kvpacked=[True, False], dtype=["fp16", "bf16"],
        mha_type=["mha", "mqa", "gqa"], alibi=[False, True], local=[False, True], causal=[False, True],
        dropout_p=[0.0, 0.17], softcap=[0.0, 50.0]),
    "test_flash_attn_varlen_output": dict(
        d=HEAD_DIMS, seqlens=SEQLENS_OUTPUT, kvpacked=[True, False], dtype=["fp16", "bf16"],
        mha_type=["mha", "mqa", "gqa"], alibi=[False, True], local=[False, True], causal=[False, True],
        dropout_p=[0.0, 0.17], softcap=[0.0, 50.0]),
    "test_flash_attn_kvcache": dict(
        d=[16, 32, 59, 64, 80, 128, 256], seqlens=SEQLENS_KVCACHE, num_splits=[1, 0],
        mha_type=["mha", "mqa", "gqa"], new_kv=[False, True], alibi=[False, True], local=[False, True],
        causal=[False, True], seqlen_new_eq_seqlen_q=[True, False], rotary_interleaved=[False, True],
        rotary_fraction=[0.0, 0.5, 1.0], paged_kv_block_size=[None, 256], has_leftpad=[False, True]),
    "test_flash_attn_bwd_overflow": dict(d=[16, 32, 64], seqlen=[1, 2, 5, 17, 128], causal=[False, True]),
    "test_flash_attn_kvcache_paged_block_table_bounds": dict(append_knew=[False, True]),
}


def pairwise(factors: Dict[str, list], seed: int = 0, tries: int = 40,
             valid=lambda case: True) -> List[Dict[str, Any]]:
    """A small list of ``valid`` cases in which every pair of (factor, value) settings that some
    valid case holds occurs at least once."""
    rng = random.Random(seed)
    names = list(factors)
    if len(names) == 1:
        return [{names[0]: v} for v in factors[names[0]]]
    pool = [dict(zip(names, idx)) for idx in itertools.product(*(range(len(factors[n])) for n in names))]
    pool = [p for p in pool if valid({n: factors[n][k] for n, k in p.items()})]
    todo = {((a, p[a]), (b, p[b])) for p in pool for a, b in itertools.combinations(names, 2)}
    cases = []
    while todo:
        (a, i), (b, j) = min(todo)  # start from an uncovered pair so every round makes progress
        best, best_gain = None, -1
        candidates = [p for p in pool if p[a] == i and p[b] == j]
        for pick in rng.sample(candidates, k=min(tries, len(candidates))):
            gain = sum(((x, pick[x]), (y, pick[y])) in todo for x, y in itertools.combinations(names, 2))
            if gain > best_gain:
                best, best_gain = pick, gain
        todo -= {((x, best[x]), (y, best[y])) for x, y in itertools.combinations(names, 2)}
        cases.append({n: factors[n][k] for n, k in best.items()})
    return cases


def _within(ours, ref, low, mult) -> tuple:
    err = (ours.double() - ref.double()).abs().max().item()
    base = (low.double() - ref.double()).abs().max().item()
    return err <= mult * base + 1e-5, err, base


def _heads(mha_type: str, nheads: int = 6) -> int:
    return {"mha": nheads, "mqa": 1, "gqa": 3 if nheads % 3 == 0 else 2}[mha_type]


def run_output(fa, case: dict, varlen: bool) -> dict:
    import torch
    from flash_ref import reference

    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    autograd = importlib.import_module(fa.__name__ + "._autograd")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[case["dtype"]]
    sq, sk = case["seqlens"]
    d, batch, hq = case["d"], 4 if case["d"] <= 128 else 2, 6
    hk = _heads(case["mha_type"], hq)
    g = torch.Generator(device="cuda").manual_seed(hash(str(case)) % 2**31)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=g).requires_grad_()  # noqa: E731
    q, k, v = mk(batch, sq, hq, d), mk(batch, sk, hk, d), mk(batch, sk, hk, d)
    window = (-1, -1)
    if case["local"]:
        window = tuple(int(x) for x in torch.randint(0, sk, (2,), generator=torch.Generator().manual_seed(sq + d)))
    slopes = torch.rand(batch, hq, device="cuda", generator=g) * 0.3 if case["alibi"] else None
    opts = dict(causal=case["causal"], window_size=window, softcap=case["softcap"], alibi_slopes=slopes)
    p = case["dropout_p"]
    if varlen:
        # every row a random length up to the max, as flash-attention's random padding masks
        lq = torch.randint(max(1, sq // 2), sq + 1, (batch,), generator=torch.Generator().manual_seed(d)).tolist()
        lk = torch.randint(max(1, sk // 2), sk + 1, (batch,), generator=torch.Generator().manual_seed(d + 1)).tolist()
        lq[0], lk[0] = sq, sk
    torch.manual_seed(d * 7 + sq)
    seed = autograd.draw_seed()
    torch.manual_seed(d * 7 + sq)
    if varlen:
        cu = lambda ls: torch.tensor([0] + list(itertools.accumulate(ls)), device="cuda", dtype=torch.int32)  # noqa: E731
        packed = [torch.cat([t[b, :n] for b, n in enumerate(ls)]) for t, ls in ((q, lq), (k, lk), (v, lk))]
        if case["kvpacked"]:
            kv = torch.stack(packed[1:], dim=1)
            out = fa.flash_attn_varlen_kvpacked_func(packed[0], kv, cu(lq), cu(lk), sq, sk, dropout_p=p, **opts)
        else:
            out = fa.flash_attn_varlen_func(packed[0], packed[1], packed[2], cu(lq), cu(lk), sq, sk, dropout_p=p, **opts)
    elif case["kvpacked"]:
        out = fa.flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), dropout_p=p, **opts)
    else:
        out = fa.flash_attn_func(q, k, v, dropout_p=p, **opts)
    dout = torch.randn_like(out)
    out.backward(dout)
    keep = fwd.dropout_keep_mask(seed, batch, hq, sq, sk, p, q.device) if p > 0 else None
    ok, worst = True, {}
    rows = range(batch) if varlen else [None]
    starts = [0] + list(itertools.accumulate(lq)) if varlen else None
    for b in rows:
        sl = slice(None) if b is None else slice(b, b + 1)
        nq, nk = (sq, sk) if b is None else (lq[b], lk[b])
        qb, kb, vb = q[sl, :nq], k[sl, :nk], v[sl, :nk]
        ob = out if b is None else out[starts[b]:starts[b] + nq][None]
        db = dout if b is None else dout[starts[b]:starts[b] + nq][None]
        kw = dict(opts, alibi_slopes=None if slopes is None else slopes[sl],
                  keep_mask=None if keep is None else keep[sl], dropout_p=p)
        grads = {}
        for name, dt in (("ref", torch.float64), ("low", dtype)):
            leaves = [t.detach().clone().requires_grad_() for t in (qb, kb, vb)]
            o, _ = reference(*leaves, dtype=dt, **kw)
            o.backward(db.to(o.dtype))
            grads[name] = (o, *[t.grad for t in leaves])
        ours = (ob, q.grad[sl, :nq], k.grad[sl, :nk], v.grad[sl, :nk])
        for i, what in enumerate(("out", "dq", "dk", "dv")):
            good, err, base = _within(ours[i], grads["ref"][i], grads["low"][i], 2 if i == 0 else 3)
            ok &= good
            if what not in worst or err - base > worst[what][0] - worst[what][1]:
                worst[what] = (err, base)
    return dict(passed=bool(ok), errors={w: dict(err=e, low_precision_err=bl) for w, (e, bl) in worst.items()})


def _rotary(x, cos, sin, positions, interleaved: bool):
    """Rotary embedding of the first 2*cos.shape[1] dims of x [1, S, H, D] at ``positions``."""
    import torch

    rot = 2 * cos.shape[1]
    c, s = cos[positions.to(cos.device)].float()[None, :, None], sin[positions.to(cos.device)].float()[None, :, None]
    xr = x[..., :rot].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        y = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
        y = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((y.to(x.dtype), x[..., rot:]), dim=-1)


def runs_upstream(family: str, case: dict) -> bool:
    """Whether flash-attention runs this combination (its test skips the others)."""
    if family != "test_flash_attn_kvcache":
        return True
    return not ((not case["new_kv"] and case["rotary_fraction"] > 0)
                or (case["has_leftpad"] and case["paged_kv_block_size"] is not None))


def run_kvcache(fa, case: dict) -> dict:
    import torch
    from flash_ref import reference

    sq, sk = case["seqlens"]
    if ((sq > sk and case["new_kv"]) or (not case["new_kv"] and case["rotary_fraction"] > 0)
            or (case["has_leftpad"] and case["paged_kv_block_size"] is not None)):
        return dict(passed=None, skipped="flash-attention skips this combination")
    dtype, d, batch, hq = torch.float16, case["d"], 2, 6
    hk = _heads(case["mha_type"], hq)
    g = torch.Generator(device="cuda").manual_seed(hash(str(case)) % 2**31)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    cpu = torch.Generator().manual_seed(d + sq)
    rotary_dim = math.floor(int(case["rotary_fraction"] * d) / 16) * 16
    seqlen_new = sq if case["seqlen_new_eq_seqlen_q"] else int(torch.randint(1, sq + 1, (1,), generator=cpu))
    q = rnd(batch, sq, hq, d)
    k_new = rnd(batch, seqlen_new, hk, d) if case["new_kv"] else None
    v_new = rnd(batch, seqlen_new, hk, d) if case["new_kv"] else None
    page = case["paged_kv_block_size"]
    if page is None:
        k_cache, v_cache, table = rnd(batch, sk, hk, d), rnd(batch, sk, hk, d), None
    else:
        blocks = math.ceil(sk / page) * batch * 3
        k_cache, v_cache = rnd(blocks, page, hk, d), rnd(blocks, page, hk, d)
        table = torch.randperm(blocks, generator=cpu)[: batch * math.ceil(sk / page)].view(batch, -1).to("cuda", torch.int32)
    hi = (sk - (sq if (case["causal"] or case["local"]) and rotary_dim > 1 else seqlen_new) + 1) if case["new_kv"] else sk + 1
    lens = torch.randint(0 if case["new_kv"] else 1, hi, (batch,), generator=cpu, dtype=torch.int32)
    pad = None
    if case["has_leftpad"]:
        pad = torch.tensor([int(torch.randint(0, int(n), (1,), generator=cpu)) if n > 0 else 0 for n in lens], dtype=torch.int32)
    window = tuple(int(x) for x in torch.randint(0, sk, (2,), generator=cpu)) if case["local"] else (-1, -1)
    slopes = torch.rand(batch, hq, device="cuda", generator=g) * 0.3 if case["alibi"] else None
    cos = sin = None
    if rotary_dim:
        angle = torch.rand(sk if page is None else k_cache.shape[0] * page, rotary_dim // 2, generator=cpu) * 2 * math.pi
        cos, sin = angle.cos().to("cuda", dtype), angle.sin().to("cuda", dtype)
    # the dense view of each row's cache as it is before the call
    rows_k = [k_cache[b] if table is None else k_cache[table[b].long()].flatten(0, 1)[:sk] for b in range(batch)]
    rows_v = [v_cache[b] if table is None else v_cache[table[b].long()].flatten(0, 1)[:sk] for b in range(batch)]
    rows_k, rows_v = [t.clone() for t in rows_k], [t.clone() for t in rows_v]
    out = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=lens.cuda(), cache_leftpad=None if pad is None else pad.cuda(), block_table=table,
        causal=case["causal"], window_size=window, rotary_interleaved=case["rotary_interleaved"],
        alibi_slopes=slopes, num_splits=case["num_splits"])
    ok, worst = True, (0.0, 0.0)
    for b in range(batch):
        n, p0 = int(lens[b]), 0 if pad is None else int(pad[b])
        qb, kb = q[b:b + 1], k_new[b:b + 1] if k_new is not None else None
        if rotary_dim:
            windowed = case["causal"] or case["local"]
            base = int(lens[b])
            q_pos = torch.arange(sq) + base if windowed else torch.full((sq,), base)
            qb = _rotary(qb, cos, sin, q_pos, case["rotary_interleaved"])
            kb = _rotary(kb, cos, sin, torch.arange(seqlen_new) + base, case["rotary_interleaved"])
        keys, vals = rows_k[b][:n], rows_v[b][:n]
        if kb is not None:
            keys, vals = torch.cat([keys, kb[0]]), torch.cat([vals, v_new[b]])
        keys, vals = keys[p0:], vals[p0:]
        kw = dict(causal=case["causal"], window_size=window, alibi_slopes=None if slopes is None else slopes[b:b + 1])
        ref, _ = reference(qb, keys[None], vals[None], **kw)
        low, _ = reference(qb, keys[None], vals[None], dtype=dtype, **kw)
        good, err, base = _within(out[b:b + 1], ref, low, 3)
        ok &= good
        worst = max(worst, (err, base))
    return dict(passed=bool(ok), errors=dict(out=dict(err=worst[0], low_precision_err=worst[1])))


def run_bwd_overflow(fa, case: dict) -> dict:
    """Rows past a length that is not a multiple of the tile must not turn dQ into NaN: q scaled
    by 5, k/v by 3, fp16, gradients within 5x the low-precision reference's error + 1e-3."""
    import torch
    from flash_ref import reference

    d, s = case["d"], case["seqlen"]
    g = torch.Generator(device="cuda").manual_seed(d * 1000 + s)
    q = (torch.randn(2, s, 5, d, device="cuda", dtype=torch.float16, generator=g) * 5).requires_grad_()
    k, v = ((torch.randn(2, s, 5, d, device="cuda", dtype=torch.float16, generator=g) * 3).requires_grad_()
            for _ in range(2))
    out = fa.flash_attn_func(q, k, v, causal=case["causal"])
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
    out.backward(dout)
    refs = {}
    for name, dt in (("ref", torch.float64), ("low", torch.float16)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o, _ = reference(*leaves, causal=case["causal"], dtype=dt)
        o.backward(dout.to(o.dtype))
        refs[name] = (o, *[t.grad for t in leaves])
    ok, errors = True, {}
    for i, (what, ours) in enumerate(zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad))):
        err = (ours.double() - refs["ref"][i].double()).abs().max().item()
        base = (refs["low"][i].double() - refs["ref"][i].double()).abs().max().item()
        ok &= err <= (2 * base if i == 0 else 5 * base + 1e-3)
        errors[what] = dict(err=err, low_precision_err=base)
    return dict(passed=bool(ok), errors=errors)


def run_bounds(fa, case: dict) -> dict:
    """Issue #2709. flash-attention syncs to read ``cache_seqlens``; we do not (a sync per decode
    step), so a GPU length past the block table cannot raise. Checked instead, as documented: a
    host-known length raises RuntimeError naming block_table, a GPU one is clamped (no crash, no
    NaN, nothing outside the table written), and exactly-at-capacity works."""
    import torch

    page, d = 256, 64
    k_cache = torch.randn(4, page, 1, d, device="cuda", dtype=torch.float16)
    v_cache = torch.randn(4, page, 1, d, device="cuda", dtype=torch.float16)
    table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    q = torch.randn(1, 1, 1, d, device="cuda", dtype=torch.float16)
    new = torch.randn(1, 1, 1, d, device="cuda", dtype=torch.float16) if case["append_knew"] else None
    length = page if case["append_knew"] else page + 1
    try:
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=new, v=new, cache_seqlens=length, block_table=table)
        raised = False
    except RuntimeError as e:
        raised = "block_table" in str(e)
    untouched = [k_cache[i].clone() for i in (1, 2, 3)]
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=new, v=new, block_table=table,
                                     cache_seqlens=torch.tensor([length], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    safe = bool(torch.isfinite(out).all()) and all(torch.equal(k_cache[i], t) for i, t in zip((1, 2, 3), untouched))
    ok_at_capacity = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(
        [page], dtype=torch.int32, device="cuda"), block_table=table)
    return dict(passed=raised and safe and bool(torch.isfinite(ok_at_capacity).all()),
                host_length_raises=raised, device_length_clamped_safely=safe, adapted=True)


RUNNERS = {
    "test_flash_attn_output": lambda fa, c: run_output(fa, c, False),
    "test_flash_attn_varlen_output": lambda fa, c: run_output(fa, c, True),
    "test_flash_attn_kvcache": run_kvcache,
    "test_flash_attn_bwd_overflow": run_bwd_overflow,
    "test_flash_attn_kvcache_paged_block_table_bounds": run_bounds,
}


# Factors taken in turn rather than paired: each head dim and length pair appears, and the
# features are paired with each other (pairing them with every head dim too would triple the
# sample: each head dim compiles its own kernels, and compiling is most of the time).
CYCLED = ("d", "seqlens", "seqlen")


def all_cases(samples: int = 1) -> List[tuple]:
    """The (family, case) list: ``samples`` pairwise samples of each test, sample s drawn with seed
    s and its head dims and lengths turned s places against the feature sets, so a head dim
    meets other features in each; a case that an earlier sample holds is not repeated. Sample 0
    is the list a run without ``--samples`` takes. Raises nothing."""
    out = []
    for family, factors in FAMILIES.items():
        paired = {n: v for n, v in factors.items() if n not in CYCLED}
        cycled = {n: v for n, v in factors.items() if n in CYCLED}
        seen = set()
        for s in range(samples):
            base = (pairwise(paired, seed=s, valid=lambda c, f=family: runs_upstream(f, c)) if paired
                    else [{}])
            count = max([len(base)] + [len(v) for v in cycled.values()])
            for i in range(count):
                case = dict(base[i % len(base)])
                case.update({n: v[(i + s) % len(v)] for n, v in cycled.items()})
                key = json.dumps(case, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    out.append((family, case))
    return out


# What a CUDA error that poisons the process's context looks like, from torch or from Triton.
_POISONED = ("CUDA error", "Triton Error [CUDA]", "CUDA_ERROR")


def _worker(wid: int, jobs, results, load=None, runners=None) -> None:
    """Run cases from ``jobs`` until a None; a CUDA error ends this process (its context is
    unusable), and the parent starts a fresh worker for the cases left. ``load`` / ``runners``
    replace the shipped kernel / RUNNERS (tests of the harness itself)."""
    fa = (load or harness.shipped_kernel)()
    runners = runners or RUNNERS
    import torch

    while True:
        job = jobs.get()
        if job is None:
            return
        index, family, case = job
        results.put(("start", wid, index))
        start = time.perf_counter()
        try:
            result = runners[family](fa, case)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # inside: an asynchronous CUDA error belongs to this case
        except Exception as e:  # a crash is a failure of that case, recorded with its message
            result = dict(passed=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-4000:])
        result.update(index=index, family=family, case=case, seconds=round(time.perf_counter() - start, 2))
        results.put(("done", wid, result))
        if any(p in result.get("error", "") for p in _POISONED):
            return


def run_cases(jobs: List[tuple], workers: int, deadline: float = None, load=None, runners=None) -> List[dict]:
    """Run ``jobs`` ``(index, family, case)`` in ``workers`` processes pulling from one queue.

    A worker stopped by a CUDA error (or killed) is replaced by a fresh process, so the cases
    after it still run; the case it was running is recorded as that failure. Cases still
    running or queued at ``deadline`` seconds are recorded as not run. ``load`` and ``runners``
    go to the workers (picklable; defaults: the shipped kernel and RUNNERS).
    """
    import queue as queues

    ctx = mp.get_context("spawn")
    # results through a manager: its put returns once delivered, so what a worker reported
    # survives the worker being killed a moment later (a plain Queue's feeder thread would not)
    manager = ctx.Manager()
    todo, results = ctx.Queue(), manager.Queue()
    for job in jobs:
        todo.put(job)
    procs: Dict[int, Any] = {}
    running: Dict[int, int] = {}  # worker id -> index of the case it runs
    poisoned: set = set()  # workers that stopped at a CUDA error
    ids = itertools.count()

    def spawn() -> None:
        wid = next(ids)
        todo.put(None)  # this worker's stop mark, behind every case still queued
        procs[wid] = ctx.Process(target=_worker, args=(wid, todo, results, load, runners))
        procs[wid].start()

    for _ in range(min(workers, len(jobs))):
        spawn()
    stop = time.monotonic() + deadline if deadline else None
    done: Dict[int, dict] = {}
    while len(done) < len(jobs):
        if stop is not None and time.monotonic() > stop:
            break
        try:
            kind, wid, payload = results.get(timeout=1.0)
            if kind == "start":
                running[wid] = payload
            else:
                done[payload["index"]] = payload
                running.pop(wid, None)
                if any(p in payload.get("error", "") for p in _POISONED):
                    poisoned.add(wid)
            continue
        except queues.Empty:
            pass
        for wid, p in list(procs.items()):
            if p.is_alive():
                continue
            p.join()
            del procs[wid]
            index = running.pop(wid, None)
            if index is not None and index not in done:  # it died inside a case without reporting it
                family, case = next((f, c) for i, f, c in jobs if i == index)
                done[index] = dict(index=index, family=family, case=case, passed=False,
                                   error=f"worker process ended (exit code {p.exitcode}) inside this case")
            if (wid in poisoned or p.exitcode != 0) and len(done) + len(running) < len(jobs):
                spawn()  # the cases still queued need a worker with a fresh CUDA context
        if not procs:
            break
    for p in procs.values():
        p.terminate()
        p.join()
    manager.shutdown()
    stopped = "not run: --deadline" if stop is not None and time.monotonic() > stop else "not run: no worker left"
    return sorted(list(done.values()) + [dict(index=i, family=f, case=c, passed=None, skipped=stopped)
                                         for i, f, c in jobs if i not in done], key=lambda r: r["index"])


def _where(result: dict) -> str:
    """' (raised at FILE:LINE in FUNCTION)' for the innermost frame of the kernel package in a
    failure's traceback (with --blocking, the launch that faulted), else ''."""
    frames = re.findall(r'File "([^"]*flash_attn2[^"]*)", line (\d+), in (\w+)', result.get("trace", ""))
    if not frames:
        return ""
    path, line, fn = frames[-1]
    where = f" (raised at {Path(path).name}:{line} in {fn}"
    # a launch helper says which kernel faulted only through its caller: name that too
    callers = [f for f in frames if Path(f[0]).name != "_launch.py"]
    if Path(path).name == "_launch.py" and callers:
        where += ", launched from {}:{} in {}".format(Path(callers[-1][0]).name, *callers[-1][1:])
    return where + ")"


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None, help="run only the first N cases (smoke test)")
    parser.add_argument("--samples", type=int, default=1,
                        help="pairwise samples drawn per test, each with its own seed (more cases, more coverage)")
    parser.add_argument("--only", default=None, help="comma-separated case indices to run (the indices of the JSON)")
    parser.add_argument("--case", default=None,
                        help="run one case given as JSON, its family under \"family\" (a case of an older "
                             "sample, as a results JSON records it)")
    parser.add_argument("--blocking", action="store_true",
                        help="CUDA_LAUNCH_BLOCKING=1 in the workers: a CUDA error names the launch that made it")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which cases still running are stopped and counted as not run")
    args = parser.parse_args()
    if args.blocking:
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"  # inherited by the spawned workers
    cases = all_cases(args.samples)[: args.limit]
    jobs = [(i, f, c) for i, (f, c) in enumerate(cases)]
    if args.only:
        wanted = {int(x) for x in args.only.split(",")}
        jobs = [j for j in jobs if j[0] in wanted]
    if args.case:
        case = json.loads(args.case)
        family = case.pop("family")
        if "seqlens" in case:
            case["seqlens"] = tuple(case["seqlens"])
        jobs = [(0, family, case)]
    results = run_cases(jobs, args.workers, args.deadline)
    rows = []
    for family in FAMILIES:
        mine = [r for r in results if r["family"] == family]
        rows.append(dict(test=family, cases=len(mine), passed=sum(r["passed"] is True for r in mine),
                         failed=sum(r["passed"] is False for r in mine),
                         skipped=sum(r["passed"] is None and "not run" not in r.get("skipped", "") for r in mine),
                         not_run=sum("not run" in r.get("skipped", "") for r in mine)))
    failures = [r for r in results if r["passed"] is False]
    drawn = "one pairwise sample" if args.samples == 1 else f"{args.samples} pairwise samples (seeds 0-{args.samples - 1})"
    notes = [f"{len(results)} cases drawn from flash-attention's parametrization, {drawn} per test (each: every "
             "head dim and every pair of feature values); tolerance as flash-attention's: error vs float64 "
             "within 2x (outputs) / 3x (gradients) the low-precision reference's error + 1e-5.",
             "test_flash_attn_kvcache_paged_block_table_bounds is adapted: flash-attention reads a GPU "
             "cache_seqlens on the host to raise; the shipped kernel raises for host-known lengths and "
             "clamps GPU ones (docs/performance.md)."]
    notes += [f"FAILED {r['family']} {r['case']}: {r.get('error') or r.get('errors')}{_where(r)}" for r in failures[:20]]
    path = harness.write_results("flash_attn_tests", rows, title="flash-attention's tests against the shipped kernel",
                                 columns=dict(test="test", cases="cases", passed="passed", failed="failed",
                                              skipped="skipped (as upstream)", not_run="not run (time limit or worker stopped)"),
                                 out_dir=args.out, commit=args.commit, notes=notes, extra=dict(cases=results))
    print(path.read_text())


if __name__ == "__main__":
    main()
