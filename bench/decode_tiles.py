"""Decode tiles and split counts beside SDPA cuDNN, in one GPU run: which (keys per block, warps,
stages) and how many key slices read the KV cache fastest, paged and contiguous, at 4k and 32k;
the paged cache also with up to ``PRELOAD_BIG`` block-table entries preloaded per split (the
shipped limit, ``_triton_decode.PRELOAD_MAX``, leaves 32k rows on per-key page lookups).

The shape and the paged layout are ``bench/decode.py``'s (batch 32, GQA 32/8, head_dim 128,
256-key pages in random order). Each tile is forced through the public call
(``flash_attn_with_kvcache``, ``num_splits`` given) by setting the decode module's per-device
setup for head_dim 128; every variant's output is first checked against the shipped call's.
The median over interleaved rounds of ``triton.testing.do_bench`` medians, TB/s of K+V read.
Writes ``bench/results/decode_tiles.md`` and ``.json``::

    python bench/decode_tiles.py [--tiles 128x4x2,128x4x3] [--splits 1,2] [--contexts 32768]

``--tiles`` / ``--splits`` / ``--contexts`` time a subset (default: every tile of TILES at every
split count of SPLITS, at both contexts).
"""

from __future__ import annotations

import importlib

import harness

BATCH, HQ, HK, D, PAGE = harness.DECODE_SHAPE
CONTEXTS = harness.DECODE_CONTEXTS

# (BLOCK_N, num_warps, num_stages); the first is the shipped tile (_triton_decode._config_for)
TILES = ((64, 4, 4), (64, 4, 3), (64, 4, 2), (32, 4, 4), (32, 4, 6), (128, 4, 2), (128, 8, 2), (64, 8, 4))
SPLITS = (1, 2, 3, 4)
# a third layout: the paged cache with up to this many block-table entries preloaded per split
# (_triton_decode.PRELOAD_MAX ships 32, so at 32k a 2-split row looks every key's page up)
PRELOAD_BIG = 128


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--tiles", help="comma-separated BLOCK_NxWARPSxSTAGES tiles (default: TILES)")
    parser.add_argument("--splits", help="comma-separated split counts (default: 1,2,3,4)")
    parser.add_argument("--contexts", help="comma-separated context lengths (default: decode.py's)")
    args = parser.parse_args()
    tiles = tuple(tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")) if args.tiles else TILES
    splits_tried = tuple(int(x) for x in args.splits.split(",")) if args.splits else SPLITS
    contexts = tuple(int(x) for x in args.contexts.split(",")) if args.contexts else CONTEXTS
    import torch
    from torch.nn.attention import SDPBackend

    fa = harness.shipped_kernel()
    decode = importlib.import_module(fa.__name__ + "._triton_decode")
    harness.warm_gpu()
    device = torch.device("cuda", torch.cuda.current_device())
    shipped_setup = decode._device_setup(D, device)

    def with_tile(tile, call):
        def run():
            decode._SETUP[(D, device)] = tuple(tile) + shipped_setup[3:-1] + (None,)  # the tile at every split count
            try:
                return call()
            finally:
                decode._SETUP[(D, device)] = shipped_setup
        return run

    rows = []
    for ctx in contexts:
        kv_bytes = 2 * BATCH * ctx * HK * D * 2
        q, k, v, lens, kp, vp, table = harness.decode_inputs(ctx)
        layouts = {
            "paged": lambda s: fa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table,
                                                         num_splits=s),
            "contiguous": lambda s: fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=s),
            # up to PRELOAD_BIG block-table entries in registers instead of the shipped PRELOAD_MAX
            f"paged, preload <= {PRELOAD_BIG}": lambda s: harness.with_setting(
                decode, "PRELOAD_MAX", PRELOAD_BIG,
                lambda: fa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=s)),
        }
        want = layouts["contiguous"](0).float()
        runs, wrong = {}, []
        for layout, call in layouts.items():
            runs[(layout, "shipped", 0)] = lambda c=call: c(0)
            for tile in tiles:
                for splits in splits_tried:
                    run = with_tile(tile, lambda c=call, s=splits: c(s))
                    try:
                        got = run().float()
                    except Exception as exc:  # a tile that does not fit: reported, not timed
                        wrong.append(f"{layout} {tile} x{splits}: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    if not torch.allclose(got, want, atol=2e-2):
                        wrong.append(f"{layout} {tile} x{splits}: max error {(got - want).abs().max().item():.3g}")
                        continue
                    runs[(layout, tile, splits)] = run
        runs[("cudnn", "-", 0)] = harness.sdpa(SDPBackend.CUDNN_ATTENTION, q.transpose(1, 2), k.transpose(1, 2),
                                       v.transpose(1, 2), False)
        medians, errors, _ = harness.interleaved_us(runs)
        cudnn = kv_bytes / medians[("cudnn", "-", 0)] / 1e6
        for (layout, tile, splits), us in sorted(medians.items(), key=lambda kv: kv[1]):
            tbs = kv_bytes / us / 1e6
            rows.append(dict(context=ctx, layout=layout, tile=str(tile), splits=splits or "shipped", tb_s=tbs,
                             vs_cudnn=tbs / cudnn, us=us))
        for message in wrong + [f"{key}: {e}" for key, e in errors.items()]:
            rows.append(dict(context=ctx, layout="not timed", tile=message))
        print([r for r in rows if r["context"] == ctx][:8], flush=True)
    columns = dict(context="context", layout="layout", tile="tile (keys, warps, stages)", splits="splits",
                   tb_s="TB/s", vs_cudnn="÷ cuDNN", us="µs")
    path = harness.write_results(
        "decode_tiles", rows, title=f"Decode tiles and splits, TB/s of K+V read (bf16, batch {BATCH}, GQA {HQ}/{HK}, "
        f"head_dim {D})", columns=columns, out_dir=args.out, commit=args.commit,
        notes=[f"Fastest first within each context. 'shipped': the call's own tile and split count; cuDNN reads the "
               f"dense cache. Paged: {PAGE}-key pages in random order. The median over {harness.ROUNDS} interleaved "
               "rounds of triton.testing.do_bench medians, after the GPU was kept busy for 2 s."])
    print(path.read_text())


if __name__ == "__main__":
    main()
