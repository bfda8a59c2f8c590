"""Gluon sm90 forward kernels beside the Triton forward, SDPA cuDNN and SDPA flash, in one GPU run.

``gluon`` is the shipped warp-specialised kernel (``_gluon_fwd``: a producer warp, two consumer
warpgroups of 64 query rows each, three for non-causal head_dim 64: ``_gluon_fwd.NON_CAUSAL``) at
its shipped tile; the other ``gluon_…`` columns are tiles and choices tried beside it, each a
change to what the shipped call takes. First checks each of them (fresh random inputs,
recycled-NaN output memory, float64 reference): out and lse on ragged lengths,
seqlen_q != seqlen_k (bottom-right causal), rows with no key, GQA, transformers' ``[B, H, S, D]``
view; then the gradients of ``flash_attn_func`` with the dispatched Gluon forward under the Triton
backward. Then times bf16, 16 heads, head dims 64/128/256, 1k/4k/16k at 16k tokens per batch,
causal and not (forward = 4·B·H·S²·D FLOPs, halved when causal), the median over interleaved rounds of
``triton.testing.do_bench``; each provider in its native layout::

    PYTHONPATH=. python3 bench/gluon_fwd.py [--out DIR] [--commit SHA]   # sm90 GPU, Triton 3.6

``gluon_nobar`` is the shipped kernel with the warpgroup barriers before its ring waits and
slot releases removed from its PTX (measurement only, an upper bound: ``_strip_ring_barriers``),
checked bit for bit against the shipped kernel over repeated launches.

Each (head_dim, seq) row takes about 40 s with seven contenders: ``--kernels``, ``--head-dims``
and ``--seqs`` pick a subset that fits a time budget.
"""

from __future__ import annotations

import importlib
import json
import math

import torch

import harness

HEADS = 16
HEAD_DIMS = (64, 128, 256)
SEQS = (1024, 4096, 16384)
CAUSAL = (False, True)  # the masks timed (--causal)
TOKENS = 16384

# name -> gluon_attention_forward keyword arguments, per head_dim; "gluon" is the shipped kernel,
# "gluon_per_tile" the same kernel launched one program per tile (what packed calls run); at
# head_dim 128 each tile in use is also forced on every row ("gluon_n128": 128-key blocks, the
# default; "gluon_n64": 64-key blocks, what short causal calls take, _gluon_fwd.call_tile)
KERNELS = {d: {"gluon": {}, "gluon_per_tile": dict(persistent=False)} for d in HEAD_DIMS}
KERNELS[128].update(gluon_n128=dict(tile=(128, 2)), gluon_n64=dict(tile=(64, 4)))
# head_dim 64: three consumer warpgroups (192 query rows a program, FlashAttention-3's head_dim 64
# tile) with 128- and 64-key blocks, beside the shipped two (gluon_fwd_d64_tiles.md has the
# 256-key and 2-stage tiles with two)
KERNELS[64].update(gluon_c3=dict(consumers=3), gluon_c3n64=dict(consumers=3, tile=(64, 4)))
# head_dim 64 with two consumers and 64-key blocks (4 or 8 stages): less of each diagonal block
# masked, for short causal calls (what SHORT_CAUSAL_TILES gives head_dim 128)
KERNELS[64].update(gluon_n64=dict(tile=(64, 4)), gluon_n64s8=dict(tile=(64, 8)))
# head_dim 64, three consumers without the pinned P·V wait: pinned, a consumer's second set of P
# registers does not fit in the 160 a thread three consumers leave, and the kernel spills (120 B
# of stack, bench/results/gluon_sass.md); unpinned it had measured 1.00-1.03x two unpinned consumers at 4k-16k
# (gluon_fwd_d64_consumers.md)
KERNELS[64].update(gluon_c3u=dict(consumers=3, pin_wait=False, pack_p=False))
# every head dim: K and V of a ring slot handed back in one arrival once P·V of that block is done
# (_gluon_fwd.KV_TOGETHER), beside the shipped K-after-S / V-after-P·V arrivals; and the two
# consumers taking turns issuing their matmuls (FlashAttention-3's ping-pong, _gluon_fwd.PINGPONG)
for _d in HEAD_DIMS:
    KERNELS[_d].update(gluon_kvt=dict(kv_together=True), gluon_pp=dict(pingpong=True))
# every head dim: ring slots (and ping-pong turns) handed back by every consumer thread's own
# arrival instead of one thread's after a warpgroup barrier (_gluon_fwd.THREAD_ARRIVE), alone,
# with the ping-pong turns, and at head_dim 64 with three consumers
for _d in HEAD_DIMS:
    KERNELS[_d].update(gluon_ta=dict(thread_arrive=True), gluon_ta_pp=dict(thread_arrive=True, pingpong=True))
KERNELS[64].update(gluon_ta_c3=dict(thread_arrive=True, consumers=3))
# every head dim: the shipped kernel with the warpgroup barriers before its ring waits and slot
# releases taken out of the PTX (an upper bound of what arriving without them gives; see
# _strip_ring_barriers)
for _d in HEAD_DIMS:
    KERNELS[_d].update(gluon_nobar=dict(strip=True))

# every head dim: the P·V wait kept after the softmax (_gluon_fwd.PIN_WAIT), alone and with the
# row maxima folded pairwise (_gluon_fwd.TREE_MAX); both compute what the shipped kernel computes,
# bit for bit (check_identical)
for _d in HEAD_DIMS:
    KERNELS[_d].update(gluon_pin=dict(pin_wait=True), gluon_pint=dict(pin_wait=True, tree_max=True),
                       gluon_tree=dict(tree_max=True))
# head_dim 64: a row's max kept until a block's is 2**8 above it, and the rescale of O skipped by
# warps whose rows all kept theirs (_gluon_fwd.LAZY_RESCALE; the same softmax, rounded differently)
KERNELS[64].update(gluon_lazy=dict(lazy_rescale=True))
# every head dim: 1 or 2 of every 8 exponentials of P by a cubic on the FMA units instead of the
# exp2 unit (_gluon_fwd.EXP2_POLY, FlashAttention-4's emulation; results within 8.6e-5 of the
# shipped kernel's probabilities, not bit for bit)
for _d in HEAD_DIMS:
    KERNELS[_d].update(gluon_poly1=dict(exp2_poly=1), gluon_poly2=dict(exp2_poly=2))
# every head dim: two key blocks a trip of the unmasked loop (_gluon_fwd.UNROLL2: no moves of P
# between register sets; the same bits), alone and with 1 of 8 exponentials on the FMA units
for _d in HEAD_DIMS:
    KERNELS[_d].update(gluon_u2=dict(unroll2=True), gluon_u2p1=dict(unroll2=True, exp2_poly=1))
# head dims with two sets of Q buffers: a tile's output copy waited for inside the next tile
# (_gluon_fwd.DEFERRED_STORE; the same bits)
for _d in (64, 128):
    KERNELS[_d].update(gluon_ds=dict(deferred_store=True))
# head_dim 128 and 256: P converted to bf16 two values an instruction (_gluon_fwd.PACK_P: under
# Triton 3.6 no PRMT half swaps, 32 / 16 a key step, bench/results/gluon_sass.md; the same bits)
for _d in (128, 256):
    KERNELS[_d].update(gluon_pk=dict(pack_p=True))
# head_dim 64: the P·V wait unpinned (so P_j takes P_{j-1}'s registers: no moves) with P converted
# in pairs (no PRMT): 421 instructions a key step against the shipped 464 (gluon_sass.md), with two
# consumers and with three
KERNELS[64].update(gluon_unpin_pk=dict(consumers=2, pin_wait=False, pack_p=True),
                   gluon_c3u_pk=dict(consumers=3, pin_wait=False, pack_p=True))
# ... and 1 of 8 exponentials on the FMA units besides: 478 instructions and 58 MUFU.EX2 a step, the
# issue slots (~956 a scheduler) and the exp2 unit's clocks (~928) about even, where the shipped
# kernel's exp2 unit (~1,056 clocks) bounds its ~928 issue slots (NOTES)
KERNELS[64].update(gluon_unpin_pk_p1=dict(consumers=2, pin_wait=False, pack_p=True, exp2_poly=1))
# head_dim 64: the two consumers with the pinned wait, what non-causal calls ran before they took
# _gluon_fwd.NON_CAUSAL's three (causal calls still run it: there it is "gluon")
KERNELS[64].update(gluon_c2=dict(consumers=2, pin_wait=True, pack_p=False))
# keyword arguments of variants whose results must equal the shipped kernel's bit for bit
SAME_BITS = ("strip", "pin_wait", "tree_max", "unroll2", "deferred_store", "pack_p")

# The launches of the "strip" variants carry this num_stages (a Gluon kernel has no software
# pipeliner, so the value changes nothing else): it keys them apart in Triton's caches and tells
# the compile hook which PTX to edit
STRIP_STAGES = 2


def _strip_ring_barriers(ptx: str) -> str:
    """The PTX without each ``bar.sync`` whose next instruction is an mbarrier wait or a plain
    (one-thread) mbarrier arrive.

    Measurement only. Gluon puts a warpgroup barrier before every mbarrier arrive and before the
    wait that follows one. A wait runs in every thread, so the barrier before it orders nothing
    the wait needs; a consumer releases a K/V slot after its own ``wgmma.wait_group``, and the
    warpgroup's matmul (which alone reads the slot) completes for the four warps together, the
    assumption CUTLASS's pipelines make when one thread of a warpgroup releases a stage. The
    epilogue's barriers (before the output's store, and the one after the copy engine's read)
    are followed by other instructions and stay.
    """
    lines = ptx.split("\n")

    def no_code(line: str) -> bool:  # blank, line info, a label or a comment (an inline asm's start is code)
        text = line.strip()
        return not text or text.startswith((".loc", "$L__tmp")) or (text.startswith("//") and "begin inline asm" not in text)

    keep = []
    for i, line in enumerate(lines):
        if line.strip().startswith("bar.sync"):
            j = next((n for n in range(i + 1, len(lines)) if not no_code(lines[n])), len(lines))
            block = " ".join(lines[j:j + 8])
            if "begin inline asm" in block[:40] and ("mbarrier.try_wait" in block
                                                     or "mbarrier.arrive.shared::cta.b64 _," in block):
                continue
        keep.append(line)
    return "\n".join(keep)


def _install_strip_hook() -> None:
    """Edit the PTX of the Gluon forward's launches made with STRIP_STAGES (chained after any
    hook set before)."""
    from triton import knobs
    from triton.backends.compiler import Language

    prev = knobs.runtime.add_stages_inspection_hook

    def hook(backend, stages, options, language, capability):
        if prev is not None:
            prev(backend, stages, options, language, capability)
        if language == Language.GLUON and options.num_stages == STRIP_STAGES:
            make_ptx = stages["ptx"]

            def ptx(src, metadata):
                out = make_ptx(src, metadata)  # names the kernel in metadata
                return _strip_ring_barriers(out) if metadata.get("name") == "_gluon_attn_fwd" else out

            stages["ptx"] = ptx

    knobs.runtime.add_stages_inspection_hook = hook


class _StripLaunch:
    """A Launcher of _gluon_fwd._LAUNCHERS whose launches carry STRIP_STAGES."""

    def __init__(self, launcher) -> None:
        self.launcher = launcher

    def __call__(self, grid, args, constexprs, num_warps, num_stages):
        return self.launcher(grid, args, constexprs, num_warps, STRIP_STAGES)


def forward(gf, q, k, v, *, strip: bool = False, **kwargs):
    """gluon_attention_forward, or with ``strip`` the same call on the barrier-stripped PTX."""
    if not strip:
        return gf.gluon_attention_forward(q, k, v, **kwargs)
    saved = gf._LAUNCHERS
    gf._LAUNCHERS = {key: _StripLaunch(launcher) for key, launcher in saved.items()}
    try:
        return gf.gluon_attention_forward(q, k, v, **kwargs)
    finally:
        gf._LAUNCHERS = saved


def fwd_flops(batch: int, heads: int, sq: int, sk: int, d: int, causal: bool) -> float:
    return 4.0 * batch * heads * sq * sk * d / (2 if causal else 1)


def _poison_allocator(nbytes: int = 1 << 30) -> None:
    # the next torch.empty calls get memory that held NaN: an unwritten output element shows
    torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").fill_(float("nan"))


def _reference(q, k, v, scale, causal):
    """float64 out [B, Sq, H, D] and lse [B, H, Sq] (bottom-right causal; empty rows: 0 / +inf)."""
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    group = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    sq, sk = s.shape[-2:]
    if causal:
        keep = torch.arange(sk, device=s.device)[None, :] <= torch.arange(sq, device=s.device)[:, None] + (sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return (p @ vd).transpose(1, 2), lse


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check(gf) -> list:
    rows = []
    cases = [  # (batch, sq, sk, hq, hk, layout)
        (2, 300, 300, 4, 4, "bshd"), (2, 257, 1000, 4, 2, "bshd"), (1, 1000, 333, 4, 1, "bshd"),
        (3, 128, 128, 2, 2, "bhsd"), (1, 777, 777, 8, 2, "bhsd"), (2, 64, 64, 2, 2, "bshd"),
        (2, 300, 1000, 4, 2, "ramp"),
    ]
    for d in HEAD_DIMS:
        for name, kwargs in KERNELS[d].items():
            for causal in (False, True):
                for batch, sq, sk, hq, hk, layout in cases:
                    torch.manual_seed(hash((d, causal, sq, sk)) % 2**31)
                    if layout == "bhsd":  # transformers' layout, viewed as [B, S, H, D]
                        q = torch.randn(batch, hq, sq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                        k = torch.randn(batch, hk, sk, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                        v = torch.randn(batch, hk, sk, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                    else:
                        q = torch.randn(batch, sq, hq, d, device="cuda", dtype=torch.bfloat16)
                        k = torch.randn(batch, sk, hk, d, device="cuda", dtype=torch.bfloat16)
                        v = torch.randn(batch, sk, hk, d, device="cuda", dtype=torch.bfloat16)
                    if layout == "ramp":  # scores that grow along the keys: row maxima rise block after block
                        ramp = 1 + 6 * torch.arange(sk, device="cuda", dtype=torch.float32) / sk
                        k = (k.float() * ramp[None, :, None, None]).to(torch.bfloat16)
                        q = q * 2
                    scale = d ** -0.5
                    assert gf.supports(q, k, v), (d, layout)
                    _poison_allocator()
                    out, lse = forward(gf, q, k, v, softmax_scale=scale, causal=causal, **kwargs)
                    torch.cuda.synchronize()
                    ref_o, ref_l = _reference(q, k, v, scale, causal)
                    finite = torch.isfinite(ref_l)
                    row = dict(kernel=name, head_dim=d, causal=causal, batch=batch, sq=sq, sk=sk, hq=hq, hk=hk, layout=layout,
                               out_nan=bool(out.isnan().any()), rel_out=_rel(out, ref_o),
                               lse_max_abs=float((lse.double() - ref_l)[finite].abs().max()) if finite.any() else 0.0,
                               lse_inf_ok=bool((lse[~finite] == float("inf")).all()))
                    row["ok"] = (not row["out_nan"] and row["rel_out"] <= 1e-2 and row["lse_max_abs"] <= 2e-2
                                 and row["lse_inf_ok"])
                    rows.append(row)
    return rows


VARLEN_CASES = [  # (lengths of q, lengths of k, hq, hk, kv packed in one tensor)
    ([300, 1, 0, 129, 1000, 128], None, 4, 4, False),
    ([257, 64, 700, 5], [1000, 64, 333, 0], 4, 2, False),
    ([128, 2048, 77], None, 2, 1, True),
]


def check_identical(gf, repeats: int = 20) -> list:
    """Each variant that only schedules the shipped kernel's arithmetic differently (a
    :data:`SAME_BITS` argument) beside the shipped kernel on the same inputs, ``repeats`` launches
    of each at a timed size: the forward's arithmetic runs in a fixed order, so any output or lse
    that differs from the shipped kernel's in one bit is a race (removed barriers, a wait moved)
    or a changed result."""
    rows = []
    for d in HEAD_DIMS:
        for name, kwargs in KERNELS[d].items():
            if not any(kwargs.get(key) for key in SAME_BITS):
                continue
            for causal in (False, True):
                torch.manual_seed(d + causal)
                q, k, v = (torch.randn(4, 4096, HEADS, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                plain = {key: value for key, value in kwargs.items() if key not in SAME_BITS}
                ref_o, ref_l = forward(gf, q, k, v, softmax_scale=d ** -0.5, causal=causal, **plain)
                differ = 0
                for _ in range(repeats):
                    out, lse = forward(gf, q, k, v, softmax_scale=d ** -0.5, causal=causal, **kwargs)
                    differ += int(not (torch.equal(out, ref_o) and torch.equal(lse, ref_l)))
                torch.cuda.synchronize()
                rows.append(dict(kernel=name, head_dim=d, causal=causal, launches=repeats, differ=differ,
                                 ok=differ == 0))
    return rows


def check_varlen(gf) -> list:
    """Packed sequences through the Gluon forward, per sequence against the float64 reference:
    empty and one-token sequences, lengths off the 128-row and key-block grid, seqlen_q != seqlen_k
    per sequence (bottom-right causal; rows that see no key), GQA, kv-packed views. Output memory
    is recycled NaN, so a row left unwritten or a row written by the wrong sequence shows."""
    import itertools

    rows = []
    for d in (dd for dd in HEAD_DIMS if dd in gf.TILES and dd != 64):
        for causal in (False, True):
            for lens_q, lens_k, hq, hk, kv_packed in VARLEN_CASES:
                lens_k = lens_k or lens_q
                torch.manual_seed(sum(lens_q) + d + causal)
                cu = lambda ls: torch.tensor([0, *itertools.accumulate(ls)], device="cuda", dtype=torch.int32)  # noqa: E731
                q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=torch.bfloat16)
                if kv_packed:
                    kv = torch.randn(sum(lens_k), 2, hk, d, device="cuda", dtype=torch.bfloat16)
                    k, v = kv[:, 0], kv[:, 1]
                else:
                    k, v = (torch.randn(sum(lens_k), hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                scale = d ** -0.5
                assert gf.supports(q, k, v), (d, kv_packed)
                _poison_allocator()
                out, lse = gf.gluon_attention_forward(q, k, v, softmax_scale=scale, causal=causal,
                                                      cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k),
                                                      max_seqlen_q=max(lens_q))
                torch.cuda.synchronize()
                worst_out, worst_lse, inf_ok, nan = 0.0, 0.0, True, bool(out.isnan().any())
                for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
                    if nq == 0:
                        continue
                    q0, k0 = sum(lens_q[:i]), sum(lens_k[:i])
                    qi, ki, vi = q[q0:q0 + nq][None], k[k0:k0 + nk][None], v[k0:k0 + nk][None]
                    if nk == 0:
                        ref_o = torch.zeros_like(qi, dtype=torch.float64)
                        ref_l = torch.full((1, hq, nq), float("inf"), dtype=torch.float64, device="cuda")
                    else:
                        ref_o, ref_l = _reference(qi, ki, vi, scale, causal)
                    got_o, got_l = out[q0:q0 + nq][None], lse[:, q0:q0 + nq][None]
                    finite = torch.isfinite(ref_l)
                    if ref_o.abs().max() > 0:
                        worst_out = max(worst_out, _rel(got_o, ref_o))
                    else:
                        worst_out = max(worst_out, float(got_o.double().abs().max()))
                    if finite.any():
                        worst_lse = max(worst_lse, float((got_l.double() - ref_l)[finite].abs().max()))
                    inf_ok = inf_ok and bool((got_l[~finite] == float("inf")).all())
                row = dict(kernel="gluon varlen", head_dim=d, causal=causal, lens_q=lens_q, lens_k=lens_k, hq=hq,
                           hk=hk, kv_packed=kv_packed, out_nan=nan, rel_out=worst_out, lse_max_abs=worst_lse,
                           lse_inf_ok=inf_ok)
                row["ok"] = not nan and worst_out <= 1e-2 and worst_lse <= 2e-2 and inf_ok
                rows.append(row)
    return rows


def _gluon_against_triton(gf, dispatch, table: str, key, run, leaves, dout) -> dict:
    """``run()`` (a flash_attn call) and its gradients with the dispatch table ``table`` emptied
    (Triton forward) and then holding only ``key`` (Gluon forward); how often Gluon ran in each,
    the relative differences of out, dq, dk, dv, and ok."""
    grads, calls, counted = [], [], []
    real = gf.gluon_attention_forward
    gf.gluon_attention_forward = lambda *a, **kw: counted.append(1) or real(*a, **kw)
    saved = getattr(dispatch, table)
    try:
        for faster in ({}, {key: 0}):
            setattr(dispatch, table, faster)
            before = len(counted)
            out = run()
            grads.append([out] + list(torch.autograd.grad(out, leaves, dout)))
            calls.append(len(counted) - before)
    finally:
        setattr(dispatch, table, saved)
        gf.gluon_attention_forward = real
    rels = [_rel(a.detach(), b.detach()) for a, b in zip(grads[1], grads[0])]
    return dict(gluon_calls=calls, rel_out_dq_dk_dv=rels, ok=calls == [0, 1] and max(rels) <= 1e-2)


def check_autograd_varlen(gf, pkg, dispatch) -> list:
    """flash_attn_varlen_func's output and gradients with the Gluon forward (dispatch forced) vs the
    Triton forward, under the Triton backward."""
    import itertools

    rows = []
    lens = [513, 1, 1200, 77]
    cu = torch.tensor([0, *itertools.accumulate(lens)], device="cuda", dtype=torch.int32)
    for d in (dd for dd in HEAD_DIMS if dd in gf.TILES and dd != 64):
        for causal in (False, True):
            torch.manual_seed(d + causal)
            q, k, v = (torch.randn(sum(lens), 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn(sum(lens), 4, d, device="cuda", dtype=torch.bfloat16)
            run = lambda: pkg.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)  # noqa: E731
            rows.append(dict(head_dim=d, causal=causal, varlen=True,
                             **_gluon_against_triton(gf, dispatch, "MEASURED_FASTER_VARLEN", (d, causal), run,
                                                     (q, k, v), dout)))
    return rows


def check_autograd(gf, pkg, dispatch) -> list:
    """Gradients of flash_attn_func with the Gluon forward (dispatch forced) vs the Triton forward."""
    rows = []
    for d in HEAD_DIMS:
        for causal in (False, True):
            torch.manual_seed(d + causal)
            q, k, v = (torch.randn(2, 513, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn(2, 513, 4, d, device="cuda", dtype=torch.bfloat16)
            run = lambda: pkg.flash_attn_func(q, k, v, causal=causal)  # noqa: E731
            rows.append(dict(head_dim=d, causal=causal,
                             **_gluon_against_triton(gf, dispatch, "MEASURED_FASTER", (d, causal), run, (q, k, v),
                                                     dout)))
    return rows


def timing(gf, fwd) -> list:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    rows = []
    for d in HEAD_DIMS:
        for seq in SEQS:
            batch = TOKENS // seq
            for causal in CAUSAL:
                torch.manual_seed(seq + d)
                q, k, v = (torch.randn(batch, seq, HEADS, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
                scale = d ** -0.5
                flops = fwd_flops(batch, HEADS, seq, seq, d, causal)
                row = dict(head_dim=d, seq=seq, batch=batch, causal=causal)
                provs = {name: (lambda kw=kw: forward(gf, q, k, v, softmax_scale=scale, causal=causal,
                                                                         **kw))
                         for name, kw in KERNELS[d].items()}
                provs["triton"] = lambda: fwd.attention_forward(q, k, v, softmax_scale=scale, causal=causal)
                for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                    def run(backend=backend):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
                    provs[name] = run
                # interleaved rounds: a clock ramp or heat falls on every provider alike
                medians, errors, _ = harness.interleaved_us(provs)
                for name in provs:
                    row[name] = flops / medians[name] / 1e6 if name in medians else None
                    if name in errors:  # a backend SDPA lacks for this shape
                        row[name + "_error"] = errors[name]
                best = max((n for n in KERNELS[d] if row.get(n)), key=lambda n: row[n], default=None)
                row["best"] = best
                if best and row.get("cudnn"):
                    row["best_vs_cudnn"] = row[best] / row["cudnn"]
                for other in ("cudnn", "triton"):
                    if row.get("gluon") and row.get(other):
                        row[f"gluon_vs_{other}"] = row["gluon"] / row[other]
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    return rows


def keep_kernels(names, head_dims) -> None:
    """Keep only ``names`` in :data:`KERNELS` at ``head_dims``. Raises ValueError naming any name
    that no kernel of those head dims has (a typo would otherwise drop a column from a GPU run)."""
    known = {n for d in head_dims for n in KERNELS[d]}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"--kernels: no kernel named {', '.join(unknown)} at head dims "
                         f"{', '.join(map(str, head_dims))}; known: {', '.join(sorted(known))}")
    for d in head_dims:
        KERNELS[d] = {n: kw for n, kw in KERNELS[d].items() if n in names}


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--kernels", help="comma-separated kernel names to keep (default: all of KERNELS)")
    parser.add_argument("--head-dims", help="comma-separated head dims to check and time (default: 64,128,256)")
    parser.add_argument("--seqs", help="comma-separated sequence lengths to time (default: 1024,4096,16384)")
    parser.add_argument("--checks-only", action="store_true", help="run the checks, print them, time nothing")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both",
                        help="time causal rows, non-causal rows or both (default)")
    args = parser.parse_args()
    global HEAD_DIMS, SEQS, CAUSAL
    CAUSAL = {"both": (False, True), "yes": (True, ), "no": (False, )}[args.causal]
    if args.head_dims:
        HEAD_DIMS = tuple(int(d) for d in args.head_dims.split(","))
    if args.seqs:
        SEQS = tuple(int(s) for s in args.seqs.split(","))
    if args.kernels:
        try:
            keep_kernels(args.kernels.split(","), HEAD_DIMS)
        except ValueError as e:
            parser.error(str(e))
    _install_strip_hook()
    pkg = harness.shipped_kernel()
    gf = importlib.import_module(pkg.__name__ + "._gluon_fwd")
    fwd = importlib.import_module(pkg.__name__ + "._triton_fwd")
    checks = check(gf)
    bad = [r for r in checks if not r["ok"]]
    print(f"checks: {len(checks) - len(bad)}/{len(checks)} ok", flush=True)
    for r in bad:
        print("FAIL", json.dumps(r), flush=True)
    varlen_checks = check_varlen(gf)
    bad = [r for r in varlen_checks if not r["ok"]]
    print(f"varlen checks: {len(varlen_checks) - len(bad)}/{len(varlen_checks)} ok", flush=True)
    for r in bad:
        print("FAIL", json.dumps(r), flush=True)
    checks += varlen_checks
    same = check_identical(gf)
    print("identical to the shipped kernel:", json.dumps(same), flush=True)
    checks += same
    bad = [r for r in checks if not r["ok"]]
    dispatch = importlib.import_module(pkg.__name__ + "._gluon_dispatch")
    grads = check_autograd(gf, pkg, dispatch) + check_autograd_varlen(gf, pkg, dispatch)
    print("autograd:", json.dumps(grads), flush=True)
    if args.checks_only:
        return
    rows = timing(gf, fwd)
    names = sorted({n for d in HEAD_DIMS for n in KERNELS[d]}, key=lambda n: (n != "gluon", n))
    columns = dict(head_dim="head_dim", seq="seq", causal="causal", **{n: n for n in names}, triton="triton",
                   cudnn="SDPA cuDNN", flash="SDPA flash", gluon_vs_cudnn="gluon / cuDNN",
                   gluon_vs_triton="gluon / triton", best="best",
                   best_vs_cudnn="best / cuDNN")
    failed = sorted({(r["kernel"], r["head_dim"]) for r in bad})
    notes = [f"Forward TFLOP/s, bf16, {HEADS} heads, {TOKENS} tokens per batch; correctness checks: "
             f"{len(checks) - len(bad)}/{len(checks)} passed" + (f" (failed: {failed})" if failed else "")
             + f"; autograd with the dispatched Gluon forward: {sum(r['ok'] for r in grads)}/{len(grads)} ok.",
             f"Kernel variants: {json.dumps({d: KERNELS[d] for d in HEAD_DIMS})}; shipped tiles "
             f"{gf.TILES} (BLOCK_N, STAGES)."]
    path = harness.write_results("gluon_fwd", rows, title="Gluon sm90 forward kernels vs Triton, SDPA cuDNN and "
                                 "SDPA flash", columns=columns, out_dir=args.out, commit=args.commit, notes=notes,
                                 extra=dict(checks=checks, autograd=grads))
    print(path.read_text())


if __name__ == "__main__":
    main()
