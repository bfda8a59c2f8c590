"""Gluon sm90 forward beside the Triton forward, SDPA cuDNN and SDPA flash, in one GPU run.

First checks (fresh random inputs, recycled-NaN output memory, float64 reference): out and lse
of the Gluon kernel on ragged lengths, seqlen_q != seqlen_k (bottom-right causal), rows with no
key, GQA, transformers' ``[B, H, S, D]`` view, then the gradients of ``flash_attn_func`` with the
Gluon forward under the Triton backward. Then times bf16, 16 heads, head dims 64/128/256, 1k/4k/16k
at 16k tokens per batch, causal and not (forward = 4·B·H·S²·D FLOPs, halved when causal), median
of ``triton.testing.do_bench``; each provider in its native layout.

    PYTHONPATH=. python3 bench/gluon_fwd.py OUT_DIR     # on an sm90 GPU with Triton >= 3.6
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import HEADS, HEAD_DIMS, SEQS, TOKENS, bench_ms, fwd_flops, load_package  # noqa: E402


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


def check(gf, pkg) -> list:
    rows = []
    cases = [  # (batch, sq, sk, hq, hk, layout)
        (2, 300, 300, 4, 4, "bshd"), (2, 257, 1000, 4, 2, "bshd"), (1, 1000, 333, 4, 1, "bshd"),
        (3, 128, 128, 2, 2, "bhsd"), (1, 777, 777, 8, 2, "bhsd"), (2, 64, 64, 2, 2, "bshd"),
    ]
    for d in HEAD_DIMS:
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
                out, lse = gf.gluon_attention_forward(q, k, v, softmax_scale=scale, causal=causal)
                torch.cuda.synchronize()
                ref_o, ref_l = _reference(q, k, v, scale, causal)
                finite = torch.isfinite(ref_l)
                row = dict(head_dim=d, causal=causal, batch=batch, sq=sq, sk=sk, hq=hq, hk=hk, layout=layout,
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


# tiles tried beside the shipped one, (BLOCK_M, BLOCK_N, STAGES, num_warps) per head_dim
VARIANTS = {64: [(128, 64, 4, 8)], 128: [], 256: []}


def check_variants(gf) -> list:
    rows = []
    for d, tiles in VARIANTS.items():
        for tile in tiles:
            for causal in (False, True):
                for batch, sq, sk in ((2, 333, 333), (1, 257, 1000), (1, 1000, 300)):
                    q = torch.randn(batch, sq, 4, d, device="cuda", dtype=torch.bfloat16)
                    k, v = (torch.randn(batch, sk, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                    _poison_allocator()
                    out, lse = gf.gluon_attention_forward(q, k, v, softmax_scale=d ** -0.5, causal=causal, tile=tile)
                    ref_o, ref_l = _reference(q, k, v, d ** -0.5, causal)
                    fin = torch.isfinite(ref_l)
                    rel = _rel(out, ref_o)
                    lerr = float((lse.double() - ref_l)[fin].abs().max()) if fin.any() else 0.0
                    rows.append(dict(head_dim=d, tile=tile, causal=causal, sq=sq, sk=sk, rel_out=rel, lse_err=lerr,
                                     ok=rel <= 1e-2 and lerr <= 2e-2 and not bool(out.isnan().any())))
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
                t0 = time.perf_counter()
                gf.gluon_attention_forward(q, k, v, softmax_scale=scale, causal=causal)
                torch.cuda.synchronize()
                row["gluon_first_call_s"] = time.perf_counter() - t0
                provs = {
                    "gluon": lambda: gf.gluon_attention_forward(q, k, v, softmax_scale=scale, causal=causal),
                    "triton": lambda: fwd.attention_forward(q, k, v, softmax_scale=scale, causal=causal),
                }
                for tile in VARIANTS[d]:
                    provs["gluon" + "x".join(map(str, tile))] = (
                        lambda tile=tile: gf.gluon_attention_forward(q, k, v, softmax_scale=scale, causal=causal,
                                                                     tile=tile))
                for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                    def run(backend=backend):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
                    provs[name] = run
                outs = {}
                for name, fn in provs.items():
                    try:
                        outs[name] = fn()
                        ms = bench_ms(fn)
                        row[name] = flops / ms / 1e9
                    except Exception as exc:  # a backend SDPA lacks for this shape
                        row[name] = None
                        row[name + "_error"] = f"{type(exc).__name__}: {exc}"[:200]
                if "gluon" in outs and "cudnn" in outs:
                    row["rel_gluon_vs_cudnn"] = _rel(outs["gluon"][0], outs["cudnn"].transpose(1, 2))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(out_dir: str) -> None:
    import triton

    pkg = load_package()
    gf = importlib.import_module(pkg.__name__ + "._gluon_fwd")
    fwd = importlib.import_module(pkg.__name__ + "._triton_fwd")
    info = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
                triton=triton.__version__, gpu=torch.cuda.get_device_name(), tiles=gf.TILES)
    print(json.dumps(info), flush=True)
    checks = check(gf, pkg)
    bad = [r for r in checks if not r["ok"]]
    print(f"checks: {len(checks) - len(bad)}/{len(checks)} ok", flush=True)
    for r in bad:
        print("FAIL", json.dumps(r), flush=True)
    grads = check_autograd(gf, pkg, importlib.import_module(pkg.__name__ + "._gluon_dispatch"))
    print("autograd:", json.dumps(grads), flush=True)
    variants = check_variants(gf)
    print(f"variant checks: {sum(r['ok'] for r in variants)}/{len(variants)} ok", flush=True)
    for r in variants:
        if not r["ok"]:
            print("FAIL", json.dumps(r), flush=True)
    rows = timing(gf, fwd)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    Path(out_dir, "gluon_fwd.json").write_text(json.dumps(dict(info=info, checks=checks, autograd=grads,
                                                                variant_checks=variants, rows=rows), indent=1))
    print("\n| hd | seq | causal | gluon | triton | cudnn | flash | gluon/cudnn | gluon/triton |")
    for r in rows:
        g, t, c = r.get("gluon"), r.get("triton"), r.get("cudnn")
        fmt = lambda x: "—" if x is None else f"{x:.0f}"
        print(f"| {r['head_dim']} | {r['seq']} | {r['causal']} | {fmt(g)} | {fmt(t)} | {fmt(c)} | {fmt(r.get('flash'))}"
              f" | {g / c if g and c else math.nan:.2f} | {g / t if g and t else math.nan:.2f} |"
              + "".join(f" {k}={v:.0f}" for k, v in r.items() if k.startswith("gluon") and k[5:6].isdigit()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out")
