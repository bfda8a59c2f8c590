"""Packed sequences on a GPU: the shipped kernel's varlen call beside SDPA on the zero-padded batch.

Random lengths from 128 to 4096 (seeded) packed to 16k tokens, 16 heads, bf16. The kernel takes
them packed (``flash_attn_varlen_func``); SDPA has no packed form, so it gets what a user must
hand it, the batch zero-padded to the longest sequence ``[n, H, max_len, D]`` (cuDNN and
FlashAttention 2 backends). TFLOP/s count the real tokens only (4·H·n²·D per sequence, halved when
causal; 3.5x for forward+backward), so padding is work SDPA does for nothing. ``--baseline DIR``
adds another copy of the kernel package (e.g. the previous commit's) as a column. Writes
``bench/results/varlen.md`` and ``.json``::

    python bench/varlen.py [--baseline /path/to/old/flash-attn2]
"""

from __future__ import annotations

import importlib
from typing import List

import harness

TOKENS = harness.PACKED_TOKENS
lengths = harness.packed_lengths  # the seeded workload (bench/varlen_schedule.py models the same)
HEADS = 16
HEAD_DIMS = (128, 256, 64)
# head dims whose packed forward the dispatch sends to the Gluon kernel on sm90
# (_gluon_dispatch.MEASURED_FASTER_VARLEN); the others also time the Gluon forward beside it
GLUON_VARLEN_DIMS = (128, 256)


def real_flops(lens: List[int], heads: int, dim: int, causal: bool) -> float:
    """Forward FLOPs of the real tokens: 4·H·n²·D per sequence, halved when causal."""
    return sum(4 * heads * n * n * dim for n in lens) / (2 if causal else 1)


def _no_grad(fn):
    """``fn`` run without autograd's bookkeeping: the forward-only timing."""
    import torch

    def run():
        with torch.no_grad():
            return fn()
    return run


def main() -> None:
    args = harness.arguments(__doc__, baseline=True).parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = harness.kernels(args.baseline)
    lens = lengths()
    max_len = max(lens)
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
    harness.warm_gpu()  # the first row's timings do not meet an idle GPU's clocks
    rows = []
    for dim in HEAD_DIMS:
        q, k, v = (torch.randn(TOKENS, HEADS, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        pq, pk, pv = (torch.zeros(len(lens), HEADS, max_len, dim, device="cuda", dtype=torch.bfloat16,
                                  requires_grad=True) for _ in range(3))
        pdo = torch.randn_like(pq)
        for causal in (False, True):
            flop = real_flops(lens, HEADS, dim, causal)
            row = dict(head_dim=dim, causal=causal, sequences=len(lens), max_len=max_len)
            calls = {name: (lambda fa=fa: fa.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal),
                            (q, k, v), do) for name, fa in kernels.items()}
            for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
                def padded(backend=backend, causal=causal):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(pq, pk, pv, is_causal=causal)
                calls[name] = (padded, (pq, pk, pv), pdo)
            timed = {name: (_no_grad(fwd), lambda fwd=fwd, leaves=leaves, grad=grad:
                            torch.autograd.grad(fwd(), leaves, grad))
                     for name, (fwd, leaves, grad) in calls.items()}

            # the same kernel asked for a bitwise-repeatable backward (the Triton kernels, dQ in
            # its own kernel) beside its default (on sm90 where the dispatch table says: Gluon)
            def deterministic(fa=kernels["ours"], causal=causal):
                out = fa.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal, deterministic=True)
                torch.autograd.grad(out, (q, k, v), do)
            timed["ours_det"] = (None, deterministic)
            # the Gluon forward called directly, one program a tile and walking its sorted tile
            # list persistently (PERSISTENT_VARLEN; check_gpu compares the two element by element);
            # at a head dim the dispatch keeps on the Triton kernel, what moving it would give
            gf = importlib.import_module(kernels["ours"].__name__ + "._gluon_fwd")
            # and one a tile without the LSE, as the dispatched inference call runs it (need_lse off):
            # a gap between 'ours' and the direct call is then the wrapper's or the LSE's
            for name, persistent, lse in (("gluon", False, True), ("walk", True, True), ("gluon_nolse", False, False)):
                timed[name] = (_no_grad(lambda gf=gf, causal=causal, dim=dim, persistent=persistent, lse=lse:
                                        gf.gluon_attention_forward(
                                            q, k, v, softmax_scale=dim ** -0.5, causal=causal, cu_seqlens_q=cu,
                                            cu_seqlens_k=cu, max_seqlen_q=max_len, persistent=persistent,
                                            store_lse=lse)), None)
            rows.append(harness.attention_row(row, timed, flop))
            if row.get("ours_fwdbwd") and row.get("ours_det_fwdbwd"):
                row["vs_det_fwdbwd"] = row["ours_fwdbwd"] / row["ours_det_fwdbwd"]
            if row.get("gluon_fwd") and row.get("ours_fwd") and dim not in GLUON_VARLEN_DIMS:
                row["gluon_vs_ours_fwd"] = row["gluon_fwd"] / row["ours_fwd"]
            if row.get("gluon_nolse_fwd") and row.get("ours_fwd"):
                row["ours_vs_nolse_fwd"] = row["ours_fwd"] / row["gluon_nolse_fwd"]
            if row.get("walk_fwd") and row.get("gluon_fwd"):
                row["walk_vs_gluon_fwd"] = row["walk_fwd"] / row["gluon_fwd"]
            print(row, flush=True)
        del q, k, v, pq, pk, pv
        torch.cuda.empty_cache()
    columns = dict(head_dim="d", causal="causal", sequences="sequences", max_len="longest",
                   ours_fwd="ours fwd", sdpa_cudnn_fwd="cuDNN fwd (padded)", sdpa_flash_fwd="FA2 fwd (padded)",
                   ours_fwdbwd="ours f+b", sdpa_cudnn_fwdbwd="cuDNN f+b (padded)",
                   sdpa_flash_fwdbwd="FA2 f+b (padded)", ours_det_fwdbwd="ours f+b deterministic",
                   ratio_fwd="ours/cuDNN fwd", ratio_fwdbwd="ours/cuDNN f+b", vs_det_fwdbwd="ours/deterministic f+b",
                   gluon_fwd="Gluon fwd, a program a tile", gluon_vs_ours_fwd="Gluon/ours fwd (not dispatched)",
                   walk_fwd="Gluon fwd, persistent walk", walk_vs_gluon_fwd="walk/a program a tile",
                   gluon_nolse_fwd="Gluon fwd, a program a tile, no LSE",
                   ours_vs_nolse_fwd="ours/Gluon no LSE fwd")
    if args.baseline:
        columns.update(harness.BASELINE_COLUMNS)
    path = harness.write_results(
        "varlen", rows, title="Packed sequences: varlen beside SDPA on the zero-padded batch, TFLOP/s of real tokens (bf16)",
        columns=columns, out_dir=args.out, commit=args.commit,
        notes=[f"{len(lens)} sequences of 128-4096 tokens (seeded), {TOKENS} tokens in all, {HEADS} heads; "
               f"the median over {harness.ROUNDS} interleaved rounds (balanced order: each pair of rounds runs one order and its reverse) of triton.testing.do_bench "
               "medians. FLOPs of the real tokens only (4·H·n²·D per "
               "sequence, halved when causal; 3.5x for forward+backward). 'deterministic': the kernel called "
               "with deterministic=True, which runs the Triton backward (dQ in its own kernel); the default runs "
               "the Gluon backward where _gluon_dispatch.MEASURED_FASTER_BWD_VARLEN lists the head dim. 'Gluon fwd': "
               "the Gluon forward called directly, one program a tile (what the dispatch runs at head dims "
               f"{', '.join(map(str, GLUON_VARLEN_DIMS))}) and walking its tile list, sorted longest first on "
               "the GPU, one program per SM (_gluon_fwd.PERSISTENT_VARLEN); 'Gluon/ours' at a head dim whose "
               "packed forward the dispatch keeps on the Triton kernel; 'no LSE': the direct call without "
               "the LSE, as the dispatched inference call runs (ours/Gluon no LSE below 1 at a dispatched "
               "head dim: the wrapper's cost)."],
        extra=dict(lengths=lens))
    print(path.read_text())


if __name__ == "__main__":
    main()
