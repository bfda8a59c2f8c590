"""The head_dim 256 backward on a GPU: forward+backward with the Gluon column split (the
shipped single-buffered rings, and P^T/dS^T double-buffered), the Triton backward, and SDPA
cuDNN, in interleaved rounds. Writes ``bench/results/gluon_bwd_wide.md`` and ``.json``::

    python bench/gluon_bwd_wide.py
"""

from __future__ import annotations

import importlib

import harness

D = 256
SHAPES = ((4, 4096, 16, False), (4, 4096, 16, True), (16, 1024, 16, True), (1, 16384, 16, False))


def main() -> None:
    args = harness.arguments(__doc__).parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fa = harness.kernels()["ours"]
    tb = importlib.import_module(fa.__name__ + "._triton_bwd")
    gb = importlib.import_module(fa.__name__ + "._gluon_bwd")
    shipped = gb.WIDE_STAGES
    harness.warm_gpu()
    rows = []
    for batch, seq, heads, causal in SHAPES:
        q, k, v = (torch.randn(batch, seq, heads, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        qt, kt, vt, dot = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v, do))

        def ours(gluon: bool, stages: tuple):
            def run():
                tb.GLUON_BWD, gb.WIDE_STAGES = gluon, stages
                q.grad = k.grad = v.grad = None
                fa.flash_attn_func(q, k, v, causal=causal).backward(do)
            return run

        def cudnn():
            qt.grad = kt.grad = vt.grad = None
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).backward(dot)

        runs = {"gluon": ours(True, shipped), "gluon_pds2": ours(True, (shipped[0], 2, shipped[2])),
                "triton": ours(False, shipped), "cudnn": cudnn}
        try:
            medians, errors, _ = harness.interleaved_us(runs)
        finally:
            tb.GLUON_BWD, gb.WIDE_STAGES = None, shipped
        row = dict(batch=batch, seq=seq, heads=heads, causal=causal)
        row.update({f"{n}_ms": us / 1e3 for n, us in medians.items()})
        row.update({f"{n}_error": m for n, m in errors.items()})
        for n in ("gluon", "gluon_pds2", "triton"):
            if row.get(f"{n}_ms") and row.get("cudnn_ms"):
                row[f"{n}_vs_cudnn"] = row["cudnn_ms"] / row[f"{n}_ms"]
        rows.append(row)
        print(row, flush=True)
    columns = dict(batch="batch", seq="seq", heads="heads", causal="causal", gluon_ms="Gluon (shipped rings) ms",
                   gluon_pds2_ms="Gluon, P^T/dS^T double-buffered ms", triton_ms="Triton backward ms",
                   cudnn_ms="cuDNN ms", gluon_vs_cudnn="Gluon/cuDNN", gluon_pds2_vs_cudnn="P^T/dS^T x2/cuDNN",
                   triton_vs_cudnn="Triton/cuDNN")
    path = harness.write_results(
        "gluon_bwd_wide", rows, title="head_dim 256 forward+backward: the Gluon column split beside the Triton "
        "backward and SDPA cuDNN (bf16, ms per call)", columns=columns, out_dir=args.out, commit=args.commit,
        notes=[f"The median over {harness.ROUNDS} interleaved rounds (balanced order: each pair of rounds runs one order and its reverse) of triton.testing.do_bench "
               "medians, after the GPU was kept busy for 2 s; the forward is the shipped one in every column. "
               "x/cuDNN is cuDNN's time over x's."])
    print(path.read_text())


if __name__ == "__main__":
    main()
