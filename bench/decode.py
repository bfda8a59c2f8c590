"""Decode on a GPU: one query token per row over a KV cache, the shipped kernel (paged and
contiguous cache) beside SDPA cuDNN and SDPA flash. Bandwidth counts the K and V bytes a step
must read. ``--baseline DIR`` adds another copy of the kernel package. Writes
``bench/results/decode.md`` and ``.json``::

    python bench/decode.py [--baseline /path/to/old/flash-attn2]
"""

from __future__ import annotations

import importlib
import statistics

import harness

BATCH, HQ, HK, D, PAGE = harness.DECODE_SHAPE
CONTEXTS = harness.DECODE_CONTEXTS
SPLITS_TRIED = (1, 2)
# back-to-back timing (no L2 flush between calls): rounds x calls a sample
STEADY_ROUNDS, STEADY_CALLS = 16, 20
STEADY = ("ours_paged", "ours_contiguous", "sdpa_cudnn")


def main() -> None:
    parser = harness.arguments(__doc__, baseline=True)
    args = parser.parse_args()
    import torch
    from torch.nn.attention import SDPBackend

    kernels = harness.kernels(args.baseline)
    harness.warm_gpu()
    decode = importlib.import_module(kernels["ours"].__name__ + "._triton_decode")
    rows = []
    for ctx in CONTEXTS:
        kv_bytes = 2 * BATCH * ctx * HK * D * 2
        q, k, v, lens, kp, vp, table = harness.decode_inputs(ctx)
        runs = {}
        for name, fa in kernels.items():
            runs[f"{name}_contiguous"] = lambda fa=fa: fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
            runs[f"{name}_paged"] = lambda fa=fa: fa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens,
                                                                           block_table=table)
        # the contiguous cache itself read as pages in order (its [B * pages, PAGE, HK, D] view, the
        # table 0, 1, 2, ...): the paged path's own cost, apart from where the random pages lie
        in_order = torch.arange(table.numel(), device="cuda", dtype=torch.int32).view_as(table)
        runs["ours_paged_in_order"] = lambda: kernels["ours"].flash_attn_with_kvcache(
            q, k.view(kp.shape), v.view(vp.shape), cache_seqlens=lens, block_table=in_order)
        for splits in SPLITS_TRIED:  # the split count forced, beside the shipped choice
            runs[f"ours_paged_split{splits}"] = lambda s=splits: kernels["ours"].flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=s)
            runs[f"ours_contiguous_split{splits}"] = lambda s=splits: kernels["ours"].flash_attn_with_kvcache(
                q, k, v, cache_seqlens=lens, num_splits=s)
            runs[f"ours_paged_lookup_split{splits}"] = lambda s=splits: harness.with_setting(
                decode, "PAGE_BLOCKS", False, lambda: kernels["ours"].flash_attn_with_kvcache(
                    q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=s))
        # each block's one entry picked out of the preloaded ones (PRELOADED_BLOCKS) where they are
        # preloaded (4k); where they are not (32k) the shipped call itself
        runs["ours_paged_preloaded_blocks"] = lambda: harness.with_setting(
            decode, "PRELOADED_BLOCKS", True, lambda: kernels["ours"].flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=lens, block_table=table))
        # the rule before PAGE_BLOCKS: table entries preloaded or looked up per key, whole rows dense only
        runs["ours_paged_lookup"] = lambda: harness.with_setting(decode, "PAGE_BLOCKS", False, lambda: kernels["ours"].flash_attn_with_kvcache(
            q, kp, vp, cache_seqlens=lens, block_table=table))
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        runs["sdpa_cudnn"] = harness.sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, False)
        runs["sdpa_flash"] = harness.sdpa(SDPBackend.FLASH_ATTENTION, qt, kt, vt, False)
        want = runs["ours_contiguous"]().float()
        same = bool(torch.allclose(runs["ours_paged"]().float(), want, atol=2e-2))
        same_lookup = all(bool(torch.allclose(runs[n]().float(), want, atol=2e-2))
                          for n in ("ours_paged_lookup", "ours_paged_in_order", "ours_paged_preloaded_blocks",
                                    *(f"ours_paged_lookup_split{s}" for s in SPLITS_TRIED)))
        row = dict(context=ctx, paged_equals_contiguous=same, paged_lookup_equals_contiguous=same_lookup,
                   sdpa_expanded_kv=[n for n in ("sdpa_cudnn", "sdpa_flash") if runs[n].expanded_kv])
        medians, errors, _ = harness.interleaved_us(runs)
        row.update({name: kv_bytes / us / 1e6 for name, us in medians.items()})  # TB/s
        row.update({f"{name}_error": message for name, message in errors.items()})  # a dash in the table
        for name in ("ours_contiguous", "ours_paged"):
            if row.get(name) and row.get("sdpa_cudnn"):
                row[f"{name}_vs_cudnn"] = row[name] / row["sdpa_cudnn"]
        # The same calls back to back, as a decode loop runs them: do_bench zeroes a 256 MB buffer
        # before each call, and the dirty lines it leaves in L2 are written back during the call
        # timed, a cost of the same µs for every contender (a larger share of the 4k call)
        steady = harness.paired({n: runs[n] for n in STEADY if n not in errors}, rounds=STEADY_ROUNDS,
                                calls=STEADY_CALLS)
        row["steady_rounds_us"] = {n: [round(x, 2) for x in t] for n, t in steady.items()}
        for name, t in steady.items():
            row[f"steady_{name}"] = kv_bytes / statistics.median(t) / 1e6
        for name in ("ours_contiguous", "ours_paged"):
            if name in steady and "sdpa_cudnn" in steady:
                r = harness.ratio(steady["sdpa_cudnn"], steady[name])  # time ratio: bandwidth ours / cuDNN
                row[f"steady_{name}_vs_cudnn"] = r.median
                row[f"steady_{name}_vs_cudnn_ci"] = r.interval
        rows.append(row)
        print(row, flush=True)
    columns = dict(context="context", ours_paged="ours paged", ours_paged_lookup="ours paged, lookups",
                   ours_paged_preloaded_blocks="ours paged, preloaded blocks",
                   ours_paged_in_order="ours paged, pages in order",
                   ours_contiguous="ours contiguous",
                   sdpa_cudnn="cuDNN", sdpa_flash="FA2", ours_paged_vs_cudnn="paged/cuDNN",
                   ours_contiguous_vs_cudnn="contiguous/cuDNN",
                   steady_ours_paged="back to back: ours paged", steady_ours_contiguous="back to back: ours contiguous",
                   steady_sdpa_cudnn="back to back: cuDNN",
                   steady_ours_paged_vs_cudnn="back to back: paged/cuDNN",
                   steady_ours_paged_vs_cudnn_ci="paged, 95 % interval",
                   steady_ours_contiguous_vs_cudnn="back to back: contiguous/cuDNN",
                   steady_ours_contiguous_vs_cudnn_ci="contiguous, 95 % interval")
    columns.update({f"ours_{lay}_split{s}": f"{lay.replace('_', ' ')} {s} split{'s' * (s > 1)}"
                    for lay in ("paged", "paged_lookup", "contiguous") for s in SPLITS_TRIED})
    if args.baseline:
        columns.update(baseline_paged="baseline paged", baseline_contiguous="baseline contiguous")
    path = harness.write_results(
        "decode", rows, title=f"Decode, TB/s of K+V read (bf16, batch {BATCH}, GQA {HQ}/{HK}, head_dim {D})",
        columns=columns, out_dir=args.out, commit=args.commit,
        notes=[f"One query token per row; paged: {PAGE}-key pages in random order ('ours paged' and 'paged N "
               "split(s)': the shipped choice, _triton_decode.page_lookup: a split's table entries preloaded "
               "when they fit in registers, else one entry a block of keys; 'lookup(s)': PAGE_BLOCKS off, "
               "every key looking its page up past the preload limit; 'preloaded blocks': PRELOADED_BLOCKS on, each block "
               "of keys picking its one entry out of the preloaded ones instead of gathering one a key; 'pages in order': the contiguous cache "
               "read through a block table 0, 1, 2, ..., so its pages lie in memory order); SDPA has no paged "
               "form: its columns read the contiguous cache. The median over "
               f"{harness.ROUNDS} interleaved rounds (balanced order: each pair of rounds runs one order and its reverse) of triton.testing.do_bench medians, "
               "after the GPU was kept busy for 2 s. 'back to back': "
               f"{STEADY_CALLS} calls in a row between two CUDA events, no L2 flush between them (as a decode loop "
               f"runs), {STEADY_ROUNDS} interleaved rounds; the ratios are medians of the per-round ratios with a "
               "95 % bootstrap interval."])
    print(path.read_text())


if __name__ == "__main__":
    main()
