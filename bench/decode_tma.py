"""Decode with K/V blocks copied by TMA: does the tensor-memory accelerator read a paged cache
faster than the shipped kernel's pointer loads? A probe, not a shipped path.

The shipped split kernel (``_triton_decode``) computes an address a key and copies K/V with
``cp.async``; on the H100 its paged call trails cuDNN by ~1.3 % and its contiguous call by
~0.3 % (``bench/results/decode.md``). A TMA copy takes one coordinate a block, so a block of 128
keys costs one instruction and no address registers, and a page (256 keys) is two boxes of a 2-D
descriptor over the pool viewed as ``[pages * page_size, kv_heads * head_dim]``.

The probe kernel is the decode step of ``bench/decode.py``'s shape only (one query token, batch
32, GQA 32/8, head_dim 128, 256-key pages, every row full), read in one slice a row: one program
per (row, KV head), its four query heads padded to a 16-row tile. It loads K/V by TMA or by
pointers (``ptr``, the same kernel otherwise, so the difference is the copy alone), paged (one
table entry a block, loaded a step ahead as the shipped kernel does) or contiguous. Each variant
is checked against the shipped call, then every call is timed back to back (no L2 flush, as a
decode loop runs) in interleaved rounds beside the shipped calls and SDPA cuDNN on the contiguous
cache. Writes ``bench/results/decode_tma.md`` and ``.json``::

    python bench/decode_tma.py [--tiles 128x4x2,64x4x4]
    python bench/decode_tma.py --ncu [--context 32768]
    python bench/decode_tma.py --graphs [--baseline OLD_KERNEL_REPO_DIR]

``--ncu``: instead of timing, one launch of the shipped call and of the probe (alone and with the
shipped kernel's ways, paged and contiguous) under Nsight Compute (``--clock-control none``):
duration, DRAM throughput, L2 hit rate, registers, achieved occupancy, issue
activity, instructions and the largest stall reasons, into ``decode_tma_ncu.md`` / ``.json``.
Needs ``ncu`` on the PATH.

``--graphs``: the shipped calls (also in the one-slice tiles of ``ONE_SPLIT_TILES``), the probe
(alone and with the shipped kernel's ways) and cuDNN, each as a CUDA graph of the same
back-to-back calls replayed, so no host time spaces the launches; into ``decode_tma_graphs.md`` /
``.json``.

The shipped paged call is timed as shipped and with one table entry a block at 4k too
(``PRELOAD_MAX`` 0), the probe's way of finding pages. The probe also takes the shipped kernel's
ways one at a time and all together (``SHIPPED_WAYS``), to find what the difference is made of.
"""

from __future__ import annotations


import harness
import triton
import triton.language as tl

BATCH, HQ, HK, D, PAGE = harness.DECODE_SHAPE
GROUP = HQ // HK
BLOCK_M = 16  # the group's 4 query heads padded to the smallest tensor-core tile
# (BLOCK_N, warps, stages, TMA too); the first is the shipped one-slice tile (ONE_SPLIT_CONFIG_SM90).
# Each leaves room for two programs a SM (offline sm90 compile: 70-102 KB of shared memory), so the
# 256 programs run in one wave; 128 keys in 3 stages take 136 KB and would run in two
TILES = ((128, 4, 2, True), (64, 4, 3, False))
ROUNDS, CALLS = 12, 20
# --graphs: the shipped call also in these one-slice tiles (the shipped one is (128, 4, 2))
ONE_SPLIT_TILES = ((64, 4, 3), (64, 4, 4), (128, 8, 2))
# the shipped kernel's ways the probe can take, each alone and all together (probe()'s options)
SHIPPED_WAYS = {"+lens": dict(lens=True), "+grid3": dict(grid3=True), "+stride": dict(runtime_stride=True),
                "+pagemask": dict(page_mask=True),
                "+all four": dict(lens=True, grid3=True, runtime_stride=True, page_mask=True)}
_LOG2E = 1.4426950408889634


@triton.jit
def _probe_rows(PTR, DESC, row0, col, rows, offs_d, keep, TMA: tl.constexpr, MASK: tl.constexpr):
    """One block of K or V: the TMA box at (row0, col), or the cache rows ``rows`` by pointer
    loads, those not ``keep`` read as zeros when MASK."""
    if TMA:
        block = DESC.load([row0, col])
    elif MASK:
        block = tl.load(PTR + rows[:, None] + offs_d[None, :], mask=keep[:, None], other=0.0)
    else:
        block = tl.load(PTR + rows[:, None] + offs_d[None, :])
    return block


@triton.jit
def _probe_block(q, K, V, KD, VD, TABLE, b, hk, stride_bt, seqlen, cache_len, scale_log2, start, page, m_i, l_i, acc,
                 stride_row, HK: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                 TMA: tl.constexpr, MASKED: tl.constexpr, PAGE_MASK: tl.constexpr):
    """One block of keys from ``start``: the running (m, l, acc) updated, and the next block's
    table entry (paged). Only the last block (MASKED) masks keys past ``seqlen``: where on every
    block, the mask on TMA-copied V took V from shared memory through registers and back
    (sm90 SASS, 813 instructions a step against 587 for the pointer loads). PAGE_MASK (whole
    blocks only, the caller sees to it): the shipped kernel's way, an unallocated page's keys
    left out by a splat mask a block."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    keep = start + offs_n < seqlen
    if PAGE_MASK:
        keep = tl.zeros([BLOCK_N], dtype=tl.int32) + page >= 0
        page = tl.maximum(page, 0)
    if PAGE > 0:
        row0 = page * PAGE + start % PAGE
        # the next block's entry a step ahead, so this step's copies wait on no table load
        nxt = (start + BLOCK_N) // PAGE
        page = tl.load(TABLE + b * stride_bt + nxt, mask=start + BLOCK_N < seqlen, other=0)
    else:
        row0 = b * cache_len + start
    rows = (row0 + offs_n).to(tl.int64) * stride_row + hk * D
    k = _probe_rows(K, KD, row0, hk * D, rows, offs_d, keep, TMA, MASKED or PAGE_MASK)
    s = tl.dot(q, tl.trans(k)) * scale_log2
    if MASKED or PAGE_MASK:
        s = tl.where(keep[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if PAGE_MASK:  # a row with no key yet keeps m = -inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
    else:
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _probe_rows(V, VD, row0, hk * D, rows, offs_d, keep, TMA, MASKED or PAGE_MASK)
    if TMA and MASKED:
        # keys past the row's end lie in the pool too (another row's, or never written): zeroed,
        # so that a NaN there cannot reach the sum through p = 0
        v = tl.where(keep[:, None], v, 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc, page


@triton.jit
def _probe_kernel(Q, K, V, KD, VD, TABLE, LENS, O, stride_bt, seqlen, cache_len, scale_log2, stride_row,
                  HK: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  D: tl.constexpr, PAGE: tl.constexpr, TMA: tl.constexpr, GRID3: tl.constexpr,
                  RUNTIME_STRIDE: tl.constexpr, PAGE_MASK: tl.constexpr):
    # What the shipped kernel does and the probe need not, each on its own switch: the row's
    # length read from a tensor (LENS given), the programs on the grid's third axis (GRID3), the
    # cache's row stride a runtime value (RUNTIME_STRIDE; passed divided by 16, as ALIGNED does),
    # an unallocated page's keys left out (PAGE_MASK, paged pointer loads only: a negative table
    # entry, checked a block)
    if GRID3:
        pid = tl.program_id(2)
    else:
        pid = tl.program_id(0)
    if RUNTIME_STRIDE:
        stride_row *= 16
    else:
        stride_row = HK * D
    b = pid // HK
    hk = pid % HK
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < GROUP
    q_rows = (b * HK + hk) * GROUP + offs_m
    if LENS is not None:
        seqlen = tl.load(LENS + b)
    q = tl.load(Q + q_rows[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    page = 0
    if PAGE > 0:
        page = tl.load(TABLE + b * stride_bt)
    full = seqlen // BLOCK_N * BLOCK_N
    for start in range(0, full, BLOCK_N):
        m_i, l_i, acc, page = _probe_block(q, K, V, KD, VD, TABLE, b, hk, stride_bt, seqlen, cache_len, scale_log2,
                                           start, page, m_i, l_i, acc, stride_row, HK, BLOCK_N, D, PAGE, TMA, False,
                                           PAGE_MASK)
    if full < seqlen:
        m_i, l_i, acc, page = _probe_block(q, K, V, KD, VD, TABLE, b, hk, stride_bt, seqlen, cache_len, scale_log2,
                                           full, page, m_i, l_i, acc, stride_row, HK, BLOCK_N, D, PAGE, TMA, True,
                                           False)
    out = acc / l_i[:, None]
    tl.store(O + q_rows[:, None] * D + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])


def probe(q, k2d, v2d, table, seqlen: int, cache_len: int, tile: tuple, tma: bool, *, kv_heads: int = HK,
          page_size: int = PAGE, lens=None, grid3: bool = False, runtime_stride: bool = False,
          page_mask: bool = False):
    """A call of the probe kernel (every row ``seqlen`` keys long): ``q [B, 1, Hq, D]``, ``k2d`` /
    ``v2d`` the cache viewed as ``[rows, kv_heads * D]`` (the pool's pages of ``page_size`` keys, or
    B x ``cache_len`` rows), ``table`` the block table ``[B, pages a row]`` or None (contiguous).
    ``lens`` (int32 ``[B]``, read on the device instead of ``seqlen``), ``grid3``,
    ``runtime_stride`` and ``page_mask``: the shipped kernel's ways, one at a time (see the kernel). Returns the
    call; the TMA descriptors are built once, outside it. Raises nothing itself."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_n, warps, stages = tile
    batch, _, heads, d = q.shape
    out = torch.empty_like(q)
    kd = TensorDescriptor.from_tensor(k2d, [block_n, d]) if tma else None
    vd = TensorDescriptor.from_tensor(v2d, [block_n, d]) if tma else None
    page = page_size if table is not None else 0
    stride_bt = table.stride(0) if table is not None else 0
    scale = d ** -0.5 * _LOG2E

    grid = (1, 1, batch * kv_heads) if grid3 else (batch * kv_heads,)

    def run():
        _probe_kernel[grid](q, k2d, v2d, kd, vd, table, lens, out, stride_bt, seqlen, cache_len, scale,
                            k2d.stride(0) // 16, HK=kv_heads, GROUP=heads // kv_heads, BLOCK_M=BLOCK_M,
                            BLOCK_N=block_n, D=d, PAGE=page, TMA=tma, GRID3=grid3, RUNTIME_STRIDE=runtime_stride,
                            PAGE_MASK=page_mask and page > 0 and not tma, num_warps=warps, num_stages=stages)
        return out
    return run


# the --ncu mode's calls, each a (paged, probe ways or None for the shipped call) pair
NCU_CALLS = {
    "shipped paged": (True, None), "probe paged": (True, {}), "probe paged +all four": (True, "+all four"),
    "shipped contiguous": (False, None), "probe contiguous": (False, {}),
    "probe contiguous +all four": (False, "+all four"),
}
# (result key, raw metric names, the first present wins)
NCU_METRICS = (
    ("duration_us", ("gpu__time_duration.sum",)),
    ("dram_pct", ("dram__throughput.avg.pct_of_peak_sustained_elapsed",
                  "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed")),
    ("l2_hit_pct", ("lts__t_sector_hit_rate.pct",)),
    ("registers", ("launch__registers_per_thread",)),
    ("occupancy_pct", ("sm__warps_active.avg.pct_of_peak_sustained_active",)),
    ("issue_pct", ("smsp__issue_active.avg.pct_of_peak_sustained_active",
                   "sm__issue_active.avg.pct_of_peak_sustained_elapsed")),
    ("instructions", ("smsp__inst_executed.sum",)),
)
# units the raw page may give -> factor to the result key's unit
_NCU_SCALES = {"duration_us": {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}}
NCU_SECTIONS = ("MemoryWorkloadAnalysis", "LaunchStats", "Occupancy", "InstructionStats", "ComputeWorkloadAnalysis")


def _ncu_call(name: str, ctx: int):
    """The zero-argument call ``name`` (a key of NCU_CALLS) at ``ctx`` keys, on fresh inputs."""
    paged, way = NCU_CALLS[name]
    q, k, v, lens, kp, vp, table = harness.decode_inputs(ctx)
    tile = TILES[0][:3]
    if way is None:
        fa = harness.shipped_kernel()
        if paged:
            return lambda: fa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)
        return lambda: fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
    opts = dict(SHIPPED_WAYS[way]) if way else {}
    if opts.get("lens"):
        opts["lens"] = lens
    if paged:
        return probe(q, kp.view(-1, HK * D), vp.view(-1, HK * D), table, ctx, 0, tile, False, **opts)
    return probe(q, k.view(-1, HK * D), v.view(-1, HK * D), None, ctx, ctx, tile, False, **opts)


def _ncu_rows(ctx: int) -> list[dict]:
    """One row per NCU_CALLS entry: its second launch under Nsight Compute (the first compiles)."""
    import sys
    import tempfile
    from pathlib import Path

    rows = []
    with tempfile.TemporaryDirectory() as work:
        for i, name in enumerate(NCU_CALLS):
            report = Path(work) / f"call{i}.ncu-rep"
            child = [sys.executable, __file__, "--child", name, str(ctx)]
            _, header, data = harness.ncu_source_page("_split_kernel|_probe_kernel", child, report, NCU_SECTIONS)
            raw = harness.ncu_raw(report)
            row = dict(context=ctx, call=name)
            for key, names in NCU_METRICS:
                value, unit = next((raw[n] for n in names if n in raw), (None, ""))
                if value is not None and key in _NCU_SCALES:
                    value *= _NCU_SCALES[key].get(unit.split("/")[0], float("nan"))
                row[key] = value
            stalls = sorted(harness.ncu_stall_shares(header, data).items(), key=lambda kv: -kv[1])[:4]
            row["top_stalls"] = ", ".join(f"{k} {v:.0%}" for k, v in stalls)
            rows.append(row)
            print(row, flush=True)
    return rows


def _one_split_tile(decode, tile: tuple, call):
    """``call()`` with the decode module's one-slice tile for head_dim D set to ``tile``
    (BLOCK_N, warps, stages) instead of ONE_SPLIT_CONFIG_SM90's."""
    import torch

    key = (D, torch.device("cuda", torch.cuda.current_device()))
    shipped = decode._SETUP.get(key) or decode._device_setup(D, key[1])
    decode._SETUP[key] = shipped[:-1] + (tuple(tile),)
    try:
        return call()
    finally:
        decode._SETUP[key] = shipped


def _graphed(call, torch):
    """``call`` run CALLS times back to back, captured as one CUDA graph: its replay (warmed on a
    side stream first, as CUDA graph capture asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            call()
    return graph.replay


def main() -> None:
    import sys

    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        import torch

        call = _ncu_call(sys.argv[2], int(sys.argv[3]))
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        return
    parser = harness.arguments(__doc__, baseline=True)
    parser.add_argument("--tiles", help="comma-separated BLOCK_NxWARPSxSTAGES tiles (default: TILES)")
    parser.add_argument("--ncu", action="store_true", help="profile under Nsight Compute instead of timing")
    parser.add_argument("--context", type=int, default=32768, help="keys a row for --ncu (default 32768)")
    parser.add_argument("--graphs", action="store_true", help="time each call as a replayed CUDA graph of the calls")
    args = parser.parse_args()
    if args.ncu:
        rows = _ncu_rows(args.context)
        path = harness.write_results(
            "decode_tma_ncu", rows,
            title=f"Decode, the shipped call and the probe under Nsight Compute (bf16, batch {BATCH}, GQA {HQ}/{HK}, "
                  f"head_dim {D}, {args.context} keys, {PAGE}-key pages in random order)",
            columns=dict(call="call", duration_us="µs", dram_pct="DRAM % of peak",
                         l2_hit_pct="L2 hit %", registers="registers", occupancy_pct="warps active %",
                         issue_pct="issue active %", instructions="instructions", top_stalls="largest stalls"),
            out_dir=args.out, commit=args.commit,
            notes=["One launch each (the second of its process) under `ncu --clock-control none`; 'probe': the "
                   "probe kernel with pointer loads in the shipped one-slice tile, alone or with the shipped "
                   "kernel's four ways (SHIPPED_WAYS); stalls: shares of the warp-state samples."])
        print(path.read_text())
        return
    tiles = tuple(tuple(int(x) for x in t.split("x")) + (True,) for t in args.tiles.split(",")) \
        if args.tiles else TILES
    import importlib

    import torch
    from torch.nn.attention import SDPBackend

    loaded = harness.kernels(args.baseline)
    fa = loaded["ours"]
    decode = importlib.import_module(fa.__name__ + "._triton_decode")
    harness.warm_gpu()
    rows = []
    for ctx in harness.DECODE_CONTEXTS:
        kv_bytes = 2 * BATCH * ctx * HK * D * 2
        q, k, v, lens, kp, vp, table = harness.decode_inputs(ctx)
        paged = lambda: fa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)  # noqa: E731
        contiguous = lambda: fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)  # noqa: E731
        runs = {"shipped paged": paged, "shipped contiguous": contiguous,
                "shipped paged, an entry a block": lambda: harness.with_setting(decode, "PRELOAD_MAX", 0, paged)}
        for *tile, with_tma in tiles:
            name = "x".join(map(str, tile))
            for tma in (True, False) if with_tma else (False,):
                how = "tma" if tma else "ptr"
                runs[f"{how} paged {name}"] = probe(q, kp.view(-1, HK * D), vp.view(-1, HK * D), table, ctx, 0,
                                                    tuple(tile), tma)
                runs[f"{how} contiguous {name}"] = probe(q, k.view(-1, HK * D), v.view(-1, HK * D), None, ctx, ctx,
                                                         tuple(tile), tma)
        # the first tile with the shipped kernel's ways, one at a time and all three
        first = tuple(tiles[0][:3])
        for way, opts in SHIPPED_WAYS.items():
            opts = {**opts, "lens": lens if opts.get("lens") else None}
            runs[f"ptr paged {'x'.join(map(str, first))} {way}"] = probe(
                q, kp.view(-1, HK * D), vp.view(-1, HK * D), table, ctx, 0, first, False, **opts)
            runs[f"ptr contiguous {'x'.join(map(str, first))} {way}"] = probe(
                q, k.view(-1, HK * D), v.view(-1, HK * D), None, ctx, ctx, first, False, **opts)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        runs["cudnn"] = harness.sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, False)
        want = runs["shipped contiguous"]().float()
        errors = {n: (fn().float() - want).abs().max().item() for n, fn in runs.items() if n != "cudnn"}
        if args.graphs:
            first_name = "x".join(map(str, first))
            keep = ("shipped paged", "shipped contiguous", "shipped paged, an entry a block", f"ptr paged {first_name}",
                    f"ptr contiguous {first_name}", f"ptr paged {first_name} +all four",
                    f"ptr contiguous {first_name} +all four", "cudnn")
            graphs = {name: _graphed(runs[name], torch) for name in keep}
            if "baseline" in loaded:  # the same calls through another copy of the kernel repo (--baseline)
                base = loaded["baseline"]
                for layout, call in (("paged", lambda: base.flash_attn_with_kvcache(
                        q, kp, vp, cache_seqlens=lens, block_table=table)),
                                     ("contiguous", lambda: base.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens))):
                    errors[f"baseline {layout}"] = (call().float() - want).abs().max().item()
                    graphs[f"baseline {layout}"] = _graphed(call, torch)
            for tile in ONE_SPLIT_TILES:  # the shipped call in other one-slice tiles
                for layout, call in (("paged", paged), ("contiguous", contiguous)):
                    name = f"shipped {layout}, tile {'x'.join(map(str, tile))}"
                    errors[name] = (_one_split_tile(decode, tile, call).float() - want).abs().max().item()
                    graphs[name] = _graphed(lambda call=call, tile=tile: _one_split_tile(decode, tile, call), torch)
            samples = {n: [x / CALLS for x in t] for n, t in harness.paired(graphs, rounds=ROUNDS, calls=1).items()}
        else:
            samples = harness.paired(runs, rounds=ROUNDS, calls=CALLS)
        for name in samples:
            rows.append(dict(context=ctx, call=name, **harness.bandwidth_vs(samples, name, kv_bytes),
                             max_error=errors.get(name)))
            print({k_: v_ for k_, v_ in rows[-1].items() if k_ != "rounds_us"}, flush=True)
    timed = (f"each call as a CUDA graph of {CALLS} calls back to back, replayed (no host time between launches), "
             if args.graphs else f"{CALLS} calls back to back between two CUDA events (no L2 flush), ")
    path = harness.write_results(
        "decode_tma_graphs" if args.graphs else "decode_tma", rows,
        title=f"Decode with TMA copies of K/V, a probe (bf16, batch {BATCH}, GQA {HQ}/{HK}, head_dim {D}, "
              f"{PAGE}-key pages in random order)",
        columns=dict(context="context", call="call", **harness.BANDWIDTH_COLUMNS,
                     max_error="max |out - shipped contiguous|"),
        out_dir=args.out, commit=args.commit,
        notes=["'tma' / 'ptr': the probe kernel (one slice a row, BLOCK_N x warps x stages as named) copying K/V "
               "by TMA or by pointer loads ('+lens': each row's length read from a tensor; '+grid3': the programs on "
               "the grid's third axis; '+stride': the cache's row stride a runtime value; '+pagemask': a block of an "
               "unallocated page left out, a mask a block; the shipped kernel does all four); 'shipped': "
               "flash_attn_with_kvcache as shipped, or paged with one table entry a block at 4k too (PRELOAD_MAX 0); "
               "cuDNN reads the contiguous cache. "
               f"TB/s of K+V read. Timed {timed}{ROUNDS} interleaved rounds; the ratio is the median of the "
               "per-round ratios with a 95 % bootstrap interval."])
    print(path.read_text())


if __name__ == "__main__":
    main()
