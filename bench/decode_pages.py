"""Decode over a paged cache: what the pages' placement in memory costs. Batch 32, GQA 32/8, head_dim 128, 256-key pages; the same keys paged in random order, in random
order by groups of 4 or 16 consecutive pages (2 / 8 MB of K), and in memory order, beside the
contiguous cache and SDPA cuDNN on it. Every call is timed back to back (no L2 flush between
calls, as a decode loop runs them) in interleaved rounds. Writes ``bench/results/decode_pages.md``
and ``.json``::

    python bench/decode_pages.py
"""

from __future__ import annotations


import harness

BATCH, HQ, HK, D, PAGE = harness.DECODE_SHAPE
CONTEXTS = harness.DECODE_CONTEXTS
GROUPS = (1, 4, 16)  # consecutive pages kept together in the random order
ROUNDS, CALLS = 12, 20


def main() -> None:
    args = harness.arguments(__doc__).parse_args()
    import torch
    from torch.nn.attention import SDPBackend

    fa = harness.shipped_kernel()
    harness.warm_gpu()
    rows = []
    for ctx in CONTEXTS:
        kv_bytes = 2 * BATCH * ctx * HK * D * 2
        q, k, v, lens, *random = harness.decode_inputs(ctx)
        runs = {"contiguous": lambda: fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)}
        in_order = torch.arange(BATCH * ctx // PAGE, device="cuda", dtype=torch.int32).view(BATCH, -1)
        layouts = {"in order": (k.view(-1, PAGE, HK, D), v.view(-1, PAGE, HK, D), in_order)}
        layouts.update({f"random by {g}": harness.scattered_pages(k, v, g) if g > 1 else random for g in GROUPS})
        for name, (kp, vp, table) in layouts.items():
            runs[name] = lambda kp=kp, vp=vp, table=table: fa.flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=lens, block_table=table)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        runs["cudnn"] = harness.sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, False)
        want = runs["contiguous"]().float()
        mismatched = [n for n, fn in runs.items() if n != "cudnn"
                      and not torch.allclose(fn().float(), want, atol=2e-2)]
        samples = harness.paired(runs, rounds=ROUNDS, calls=CALLS)
        for name in samples:
            rows.append(dict(context=ctx, call=name, **harness.bandwidth_vs(samples, name, kv_bytes),
                             equals_contiguous=name not in mismatched if name != "cudnn" else None))
            print(rows[-1], flush=True)
    path = harness.write_results(
        "decode_pages", rows,
        title=f"Decode over a paged cache: where the pages lie (bf16, batch {BATCH}, GQA {HQ}/{HK}, "
              f"head_dim {D}, {PAGE}-key pages)",
        columns=dict(context="context", call="call", **harness.BANDWIDTH_COLUMNS,
                     equals_contiguous="equals contiguous"),
        out_dir=args.out, commit=args.commit,
        notes=["TB/s of K+V read. 'random by N': the pages in random order by runs of N consecutive pages; "
               "'in order': the contiguous cache read through the table 0, 1, 2, ...; cuDNN reads "
               f"the contiguous cache. {CALLS} calls back to back between two CUDA events (no L2 flush), {ROUNDS} "
               "interleaved rounds; the ratio is the median of the per-round ratios with a 95 % bootstrap "
               "interval."])
    print(path.read_text())


if __name__ == "__main__":
    main()
