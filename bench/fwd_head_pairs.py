"""The Triton forward with several query heads of a GQA group in one program, beside the
one-head programs (64- and 128-row tiles), the Gluon forward, the package's own call and SDPA
cuDNN (bf16, 16k tokens per batch; GQA 32/8 and MHA 16/16; causal by default).

Why: at head_dim 64 a 64-row tile reads a 16 KB K/V block for every 1 MFLOP it computes; at
~370 TFLOP/s that is ~5.7 TB/s out of L2, near what the L2 delivers. Two heads of a group in one
program (the tile's rows: 64 positions of one head, then the same 64 of the next) read each block
once for 128 rows, and keep the 64-row causal diagonal that made 64-row tiles beat 128-row ones.
Prediction: where the L2 bounds the 64-row tile, up to 2x less L2 traffic and a few % faster;
where the softmax bounds it (as in the Gluon kernel), no change.

Every variant's output and lse are compared with the shipped one-head program's. Writes
``bench/results/fwd_head_pairs.md`` and ``.json``::

    python bench/fwd_head_pairs.py [--head-dims 64,128] [--seqs 1024,2048,4096,8192] [--heads 32/8,16/16]
                                   [--variants t64,t2h128w4,...] [--rounds 4] [--paired 40]

``--paired N`` times the calls back to back instead (10 calls between two CUDA events, N
interleaved rounds, no L2 flush) and gives each ratio as the median of its per-round ratios with a
95 % bootstrap interval: the forward's own timings move by 5-10 % from round to round at the
GPU's power limit, more than the differences between these tiles.
"""

from __future__ import annotations

import importlib
import statistics

import harness

TOKENS = 16384
# key -> (label, heads a program, (BLOCK_M, BLOCK_N, warps, stages)); BLOCK_M counts rows of all
# heads. The first is the reference the others are compared with.
VARIANTS = {
    "t64": ("Triton 1 head, 64 rows, 4 warps", 1, (64, 64, 4, 3)),
    "t2h128w8": ("Triton 2 heads, 128 rows, 8 warps", 2, (128, 64, 8, 3)),
    "t2h128w4": ("Triton 2 heads, 128 rows, 4 warps", 2, (128, 64, 4, 3)),
    "t2h128w8s2": ("Triton 2 heads, 128 rows, 8 warps, 2 stages", 2, (128, 64, 8, 2)),
    "t2h128n128": ("Triton 2 heads, 128 rows, 128 keys, 8 warps", 2, (128, 128, 8, 2)),
    "t4h256": ("Triton 4 heads, 256 rows, 8 warps", 4, (256, 64, 8, 2)),
    "t128w8": ("Triton 1 head, 128 rows, 8 warps", 1, (128, 64, 8, 3)),
    "t128w4": ("Triton 1 head, 128 rows, 4 warps", 1, (128, 64, 4, 3)),
}


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqs", default="1024,2048,4096,8192")
    parser.add_argument("--heads", default="32/8", help="query/kv heads, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}; t64 always")
    parser.add_argument("--gluon", action="store_true", help="the Gluon forward as well")
    parser.add_argument("--rounds", type=int, default=harness.ROUNDS)
    parser.add_argument("--paired", type=int, default=0, help="rounds of paired back-to-back timing")
    parser.add_argument("--masks", default="causal", help="causal, full or both")
    args = parser.parse_args()
    picked = {key: VARIANTS[key] for key in ["t64"] + [v for v in args.variants.split(",") if v != "t64"]}
    import torch
    from torch.nn.attention import SDPBackend

    fa = harness.shipped_kernel()
    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    gluon = importlib.import_module(fa.__name__ + "._gluon_fwd")
    reference = picked["t64"][0]
    harness.warm_gpu()
    rows = []
    masks = {"causal": (True,), "full": (False,), "both": (False, True)}[args.masks]
    shapes = [(d, hq, hk, seq, causal) for d in (int(x) for x in args.head_dims.split(","))
              for hq, hk in (tuple(int(n) for n in h.split("/")) for h in args.heads.split(","))
              for seq in (int(x) for x in args.seqs.split(",")) for causal in masks]
    for d, hq, hk, seq, causal in shapes:
        b = TOKENS // seq
        q = torch.randn(b, seq, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, seq, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        scale = d ** -0.5
        calls = {label: (lambda h=h, cfg=cfg: fwd.attention_forward(
            q, k, v, softmax_scale=scale, causal=causal, heads_per_program=h, config=cfg))
            for label, h, cfg in picked.values() if (hq // hk) % h == 0}
        if args.gluon:
            calls["Gluon"] = lambda: gluon.gluon_attention_forward(q, k, v, softmax_scale=scale, causal=causal)
        calls["package"] = lambda: fa.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)[:2]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        calls["cudnn"] = harness.sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, causal)
        want_out, want_lse = calls[reference]()
        checks = {}
        for label, fn in calls.items():
            if label == "cudnn":
                continue
            try:
                out, lse = fn()
                checks[label] = (float((out.float() - want_out.float()).abs().max()),
                                 float((lse - want_lse).abs().max()))
            except Exception as e:  # a tile that does not compile or fit: reported, not timed
                checks[label] = f"{type(e).__name__}: {str(e)[:160]}"
        runnable = {label: fn for label, fn in calls.items() if not isinstance(checks.get(label), str)}
        if args.paired:
            samples = harness.paired(runnable, rounds=args.paired, calls=10)
            medians, errors = {label: statistics.median(t) for label, t in samples.items()}, {}
        else:
            medians, errors, samples = harness.interleaved_us(runnable, rounds=args.rounds)
        flop = 4 * b * hq * seq * seq * d / (2 if causal else 1)
        for label in calls:
            check = checks.get(label)
            row = dict(head_dim=d, heads=f"{hq}/{hk}", seq=seq, causal=causal, call=label, tflops=None,
                       vs_cudnn=None, vs_shipped=None, max_out_diff=None, max_lse_diff=None, error=errors.get(label))
            if isinstance(check, str):
                row["error"] = check
            elif check is not None:
                row["max_out_diff"], row["max_lse_diff"] = check
            if label in medians:
                row["tflops"] = flop / medians[label] / 1e6
                row["vs_cudnn"] = medians["cudnn"] / medians[label] if "cudnn" in medians else None
                row["vs_shipped"] = medians[reference] / medians[label]
                if args.paired:  # time ratios: the speed of ``label`` over the other's
                    for key, other in (("vs_cudnn", "cudnn"), ("vs_shipped", reference)):
                        r = harness.ratio(samples[other], samples[label])
                        row[key], row[f"{key}_interval"] = r.median, r.interval
                row["rounds_us"] = [round(x, 2) for x in samples[label]]
            rows.append(row)
            print(row, flush=True)
    path = harness.write_results(
        "fwd_head_pairs", rows,
        title=f"Forward tiles: query heads of a GQA group sharing a Triton program, beside one-head "
              f"programs, the Gluon forward and cuDNN (bf16, {TOKENS} tokens a batch)",
        columns=dict(head_dim="d", heads="heads", seq="seq", causal="causal", call="call", tflops="TFLOP/s",
                     vs_cudnn="÷ cuDNN",
                     **({"vs_cudnn_interval": "95 % interval"} if args.paired else {}),
                     vs_shipped="÷ 1-head Triton",
                     **({"vs_shipped_interval": "95 % interval"} if args.paired else {}),
                     max_out_diff="max |out diff|", max_lse_diff="max |lse diff|", error="error"),
        out_dir=args.out, commit=args.commit,
        notes=["Forward only, FLOPs 4·B·H·S²·D, halved when causal. The variants call the Triton forward "
               "directly with the tile and heads a program given; 'package' is flash_attn_func as shipped "
               "(its dispatch picks Triton or Gluon); 'Gluon' the Gluon forward called directly; diffs are against the "
               "one-head 64-row program's output and lse. "
               + (f"10 calls back to back between two CUDA events (no L2 flush), {args.paired} interleaved rounds; "
                  "ratios are medians of per-round ratios with a 95 % bootstrap interval." if args.paired else
                  f"Median of {args.rounds} interleaved rounds of do_bench medians.")])
    print(path.read_text())


if __name__ == "__main__":
    main()
