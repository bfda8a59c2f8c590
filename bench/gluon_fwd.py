"""Gluon sm90 forward kernels beside the Triton forward, SDPA cuDNN and SDPA flash, in one GPU run.

``gluon`` is the shipped warp-specialised kernel (``_gluon_fwd``: a producer warp, two consumer
warpgroups of 64 query rows each) at its shipped tile; the other ``gluon_…`` columns are
(BLOCK_N, STAGES) tiles tried beside it. First checks each of them (fresh random inputs,
recycled-NaN output memory, float64 reference): out and lse on ragged lengths,
seqlen_q != seqlen_k (bottom-right causal), rows with no key, GQA, transformers' ``[B, H, S, D]``
view; then the gradients of ``flash_attn_func`` with the dispatched Gluon forward under the Triton
backward. Then times bf16, 16 heads, head dims 64/128/256, 1k/4k/16k at 16k tokens per batch,
causal and not (forward = 4·B·H·S²·D FLOPs, halved when causal), median of
``triton.testing.do_bench``; each provider in its native layout::

    PYTHONPATH=. python3 bench/gluon_fwd.py [--out DIR] [--commit SHA]   # sm90 GPU, Triton 3.6
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
TOKENS = 16384

# name -> gluon_attention_forward keyword arguments, per head_dim; "gluon" is the shipped tile
KERNELS = {
    64: {"gluon": {}, "gluon_n128s2": dict(tile=(128, 2))},
    128: {"gluon": {}, "gluon_n64s4": dict(tile=(64, 4))},
    256: {"gluon": {}},
}


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
                    scale = d ** -0.5
                    assert gf.supports(q, k, v), (d, layout)
                    _poison_allocator()
                    out, lse = gf.gluon_attention_forward(q, k, v, softmax_scale=scale, causal=causal, **kwargs)
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


def check_autograd(gf, pkg, dispatch) -> list:
    """Gradients of flash_attn_func with the Gluon forward (dispatch forced) vs the Triton forward."""
    rows = []
    for d in HEAD_DIMS:
        for causal in (False, True):
            torch.manual_seed(d + causal)
            q, k, v = (torch.randn(2, 513, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn(2, 513, 4, d, device="cuda", dtype=torch.bfloat16)
            grads, calls = [], []
            real = gf.gluon_attention_forward
            counted = []
            gf.gluon_attention_forward = lambda *a, **kw: counted.append(1) or real(*a, **kw)
            saved = dispatch.MEASURED_FASTER
            try:
                for faster in ({}, {(d, causal): 0}):
                    dispatch.MEASURED_FASTER = faster
                    before = len(counted)
                    out = pkg.flash_attn_func(q, k, v, causal=causal)
                    grads.append([out] + list(torch.autograd.grad(out, (q, k, v), dout)))
                    calls.append(len(counted) - before)
            finally:
                dispatch.MEASURED_FASTER = saved
                gf.gluon_attention_forward = real
            rels = [_rel(a.detach(), b.detach()) for a, b in zip(grads[1], grads[0])]
            rows.append(dict(head_dim=d, causal=causal, gluon_calls=calls, rel_out_dq_dk_dv=rels,
                             ok=calls == [0, 1] and max(rels) <= 1e-2))
    return rows


def timing(gf, fwd) -> list:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    rows = []
    for d in HEAD_DIMS:
        for seq in SEQS:
            batch = TOKENS // seq
            for causal in (False, True):
                torch.manual_seed(seq + d)
                q, k, v = (torch.randn(batch, seq, HEADS, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
                scale = d ** -0.5
                flops = fwd_flops(batch, HEADS, seq, seq, d, causal)
                row = dict(head_dim=d, seq=seq, batch=batch, causal=causal)
                provs = {name: (lambda kw=kw: gf.gluon_attention_forward(q, k, v, softmax_scale=scale, causal=causal,
                                                                         **kw))
                         for name, kw in KERNELS[d].items()}
                provs["triton"] = lambda: fwd.attention_forward(q, k, v, softmax_scale=scale, causal=causal)
                for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                    def run(backend=backend):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
                    provs[name] = run
                for name, fn in provs.items():
                    try:
                        row[name] = flops / harness.time_us(fn) / 1e6
                    except Exception as exc:  # a backend SDPA lacks for this shape
                        row[name] = None
                        row[name + "_error"] = f"{type(exc).__name__}: {exc}"[:200]
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


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--kernels", help="comma-separated kernel names to keep (default: all of KERNELS)")
    parser.add_argument("--head-dims", help="comma-separated head dims to check and time (default: 64,128,256)")
    args = parser.parse_args()
    if args.head_dims:
        global HEAD_DIMS
        HEAD_DIMS = tuple(int(d) for d in args.head_dims.split(","))
    if args.kernels:
        keep = set(args.kernels.split(","))
        for d in HEAD_DIMS:
            KERNELS[d] = {n: kw for n, kw in KERNELS[d].items() if n in keep}
    pkg = harness.shipped_kernel()
    gf = importlib.import_module(pkg.__name__ + "._gluon_fwd")
    fwd = importlib.import_module(pkg.__name__ + "._triton_fwd")
    checks = check(gf)
    bad = [r for r in checks if not r["ok"]]
    print(f"checks: {len(checks) - len(bad)}/{len(checks)} ok", flush=True)
    for r in bad:
        print("FAIL", json.dumps(r), flush=True)
    grads = check_autograd(gf, pkg, importlib.import_module(pkg.__name__ + "._gluon_dispatch"))
    print("autograd:", json.dumps(grads), flush=True)
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
