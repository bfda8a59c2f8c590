"""The Gluon backward's causal programs in three dispatch orders (``_gluon_bwd.ORDER``) beside SDPA
cuDNN: forward+backward TFLOP/s (bf16, 16k tokens per batch, causal).

Why: one program per (key block, KV head); the GPU hands each free SM the next program in grid
order. A causal key block's program reads the query blocks from its diagonal on, so a head's
programs run from long (the first key block) to short, and a call whose grid ends on the last
heads' programs ends ragged. The orders:

* ``head``: every head's programs one after another;
* ``lighter_half_last``: every head's lighter half of key blocks after all heads' heavier halves;
* ``last_heads_by_block``: head order, but the last heads whose Q and dO fit in
  ``_gluon_bwd.TAIL_BYTES`` (16 MB) key block by key block (the shipped order).

Model (list scheduling over 132 SMs, a program costing its query blocks plus one;
``model_overhang``): head order 7 % over balance at 1k and 4k tokens, 14 % at head_dim 64 GQA 2k,
1-3 % at 16k and head_dim 256; the lighter half last 0.1-1.2 %; the last heads by block 1.2 % at
1k, 2.2 % at 4k, 1.2 % at head_dim 256, 3.8 % at GQA 2k. The model leaves out L2: the lighter
half last measured 0.74-0.95x head order from 4k (``repeats/bwd_light_last_0f6c18b.md``), its
lighter halves reading their heads' Q and dO from memory again; the last heads by block keep what
runs side by side within 16 MB of Q and dO. A second model counts that (``model_hbm_mb``: Q and
dO read through a 50 MB LRU cache in the dispatch model's timing): head order and the last heads
by block read each block of Q and dO from memory once (134 MB at head_dim 128, 268 at 256); the
lighter half last 1.7-2.1x that at head_dim 128 and 7.4x at 256, the order of its measured
losses. Prediction for the last heads by block: 2-5 % faster where head order's modelled
overhang is 7 % or more, no change at 16k; measured (``bench/results/bwd_order.md``) 1.03x at 1k,
1.05x at 4k, 1.06x at GQA 2k, 1.01x at 16k and at head_dim 256, 1.02x at head_dim 64 4k.

Each row checks dK and dV bit for bit and dQ within 1e-2 (relative) between each order and head
order (dQ's fp32 reduce-adds land in another order), then times them and cuDNN: ``do_bench``
medians over interleaved rounds, and back to back (10 calls between two CUDA events, ``--paired``
interleaved rounds) with each ratio to head order as the median of per-round ratios and its 95 %
bootstrap interval::

    python bench/bwd_order.py [--out DIR] [--commit SHA] [--rounds 4] [--paired 16]
"""

from __future__ import annotations

import heapq
import importlib

import harness

TOKENS = 16384
SMS = 132
# (head_dim, query heads, kv heads, seq)
ROWS = [(128, 16, 16, 1024), (128, 16, 16, 4096), (128, 16, 16, 16384), (256, 16, 16, 4096),
        (64, 32, 8, 2048), (64, 16, 16, 4096)]
ORDERS = ("head", "lighter_half_last", "last_heads_by_block")  # _gluon_bwd.ORDER 0, 1, 2


def programs(n_kb: int, n_bh: int, order: str, tail: int = 1) -> list:
    """(batch x KV head, key block) of each program in dispatch order (``_gluon_bwd._program_order``;
    ``tail``: the last heads ``last_heads_by_block`` deals key block by key block). Raises
    ValueError for an unknown order."""
    if order == "head":
        return [(bh, j) for bh in range(n_bh) for j in range(n_kb)]
    if order == "lighter_half_last":
        heavy = n_kb - n_kb // 2
        return ([(bh, j) for bh in range(n_bh) for j in range(heavy)]
                + [(bh, j) for j in range(heavy, n_kb) for bh in range(n_bh)])
    if order == "last_heads_by_block":
        return ([(bh, j) for bh in range(n_bh - tail) for j in range(n_kb)]
                + [(bh, j) for j in range(n_kb) for bh in range(n_bh - tail, n_bh)])
    raise ValueError(f"unknown order {order!r}; one of {', '.join(ORDERS)}")


def dispatch(n_kb: int, n_bh: int, order: str, tail: int = 1) -> list:
    """Key block index of each program in dispatch order (see :func:`programs`). Raises
    ValueError for an unknown order."""
    return [j for _, j in programs(n_kb, n_bh, order, tail)]


def model_overhang(n_kb: int, n_bh: int, order: str, tail: int = 1, blocks_per_key_block: int = 2,
                   sms: int = SMS) -> float:
    """The modelled call length over perfect balance: programs dealt in dispatch order to the SM
    that frees first, key block j costing ``blocks_per_key_block`` · (n_kb - j) + 1 (its query
    blocks, one more for the rest). Raises ValueError as :func:`dispatch`."""
    cost = [blocks_per_key_block * (n_kb - j) + 1 for j in range(n_kb)]
    ends = [0] * sms
    for j in dispatch(n_kb, n_bh, order, tail):
        heapq.heapreplace(ends, ends[0] + cost[j])
    return max(ends) / (n_bh * sum(cost) / sms)


def model_hbm_mb(n_kb: int, n_bh: int, order: str, tail: int, seqlen: int, head_dim: int, group: int,
                 key_block: int = 128, l2_bytes: int = 50 << 20, sms: int = SMS) -> float:
    """MB of Q and dO read from memory (not L2) in a model: programs dealt as in
    :func:`model_overhang`, each reading its query blocks (64 rows of Q and dO for every query
    head of its group) one a time unit from its start, through an LRU cache of ``l2_bytes``.
    What it leaves out: K, V, lse and the writes (the same in every order), and the L2's own
    policy. Raises ValueError as :func:`programs`."""
    unit = 64 * head_dim * 2 * 2 * group
    n_qb = -(-seqlen // 64)
    per_key_block = key_block // 64
    ends = [0] * sms
    reads = []
    for bh, j in programs(n_kb, n_bh, order, tail):
        start, first = ends[0], j * per_key_block
        reads.extend((start + i - first, bh, i) for i in range(first, n_qb))
        heapq.heapreplace(ends, start + n_qb - first + 1)
    reads.sort()
    cache: dict = {}  # insertion order is the LRU order
    capacity, misses = l2_bytes // unit, 0
    for _, bh, i in reads:
        if cache.pop((bh, i), None) is None:
            misses += 1
            if cache and len(cache) >= capacity:
                del cache[next(iter(cache))]
        if capacity:
            cache[(bh, i)] = True
    return misses * unit / 1e6


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--rounds", type=int, default=harness.ROUNDS)
    parser.add_argument("--paired", type=int, default=16)
    args = parser.parse_args()
    import torch
    from torch.nn.attention import SDPBackend

    fa = harness.shipped_kernel()
    gb = importlib.import_module(fa.__name__ + "._gluon_bwd")
    shipped = gb.ORDER
    harness.warm_gpu()
    rows = []
    for d, hq, hk, s in ROWS:
        b = TOKENS // s
        torch.manual_seed(0)
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        do = torch.randn_like(q)

        def step(order: int):
            def run():
                gb.ORDER = order
                return torch.autograd.grad(fa.flash_attn_func(q, k, v, causal=True), (q, k, v), do)
            return run

        contenders = {name: step(i) for i, name in enumerate(ORDERS)}
        grads = {name: fn() for name, fn in contenders.items()}
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        dot = do.transpose(1, 2)
        sdpa = harness.sdpa([SDPBackend.CUDNN_ATTENTION], qt, kt, vt, True)
        contenders["cudnn"] = lambda: torch.autograd.grad(sdpa(), (qt, kt, vt), dot)
        flop = 3.5 * 4.0 * b * hq * s * s * d / 2
        us, errors, _ = harness.interleaved_us(contenders, rounds=args.rounds)
        samples = harness.paired({n: contenders[n] for n in ORDERS}, rounds=args.paired)
        gb.ORDER = shipped
        wide = d >= gb.WIDE_FROM
        n_kb = -(-s // (gb.WIDE_BLOCK_N if wide else gb.BLOCK_N))
        tail = gb.tail_heads(b * hk, s, d, hq // hk)
        row = dict(d=d, heads=f"{hq}/{hk}", seq=s, tail_heads=tail, errors=errors or None,
                   **{f"{n}_tflops": flop / t / 1e6 for n, t in us.items()})
        dq0, dk0, dv0 = grads["head"]
        checked = True
        for name in ORDERS:
            row[f"model_{name}"] = model_overhang(n_kb, b * hk, name, tail, 1 if wide else 2)
            row[f"model_mb_{name}"] = model_hbm_mb(n_kb, b * hk, name, tail, s, d, hq // hk,
                                                   gb.WIDE_BLOCK_N if wide else gb.BLOCK_N)
            if name == "head":
                continue
            dq, dk, dv = grads[name]
            same = bool(torch.equal(dk, dk0) and torch.equal(dv, dv0))
            dq_err = float((dq.float() - dq0.float()).norm() / dq0.float().norm())
            checked = checked and same and dq_err < 1e-2
            r = harness.ratio(samples["head"], samples[name])
            row.update({f"{name}_dkdv_same_bits": same, f"{name}_dq_rel_diff": dq_err,
                        f"{name}_vs_head": us["head"] / us[name], f"paired_{name}_vs_head": r.median,
                        f"paired_{name}_low": r.low, f"paired_{name}_high": r.high})
        row["checked"] = checked
        row["head_vs_cudnn"] = us["cudnn"] / us["head"]
        rows.append(row)
        print(row, flush=True)
    columns = dict(d="d", heads="heads", seq="seq", tail_heads="last heads by block",
                   model_head="model: head order", model_lighter_half_last="model: lighter half last",
                   model_last_heads_by_block="model: last heads by block", model_mb_head="L2 model: Q/dO MB from memory, head order",
                   model_mb_lighter_half_last="lighter half last", model_mb_last_heads_by_block="last heads by block",
                   checked="dK, dV same bits; dQ within 1e-2",
                   head_tflops="head order f+b TFLOP/s", lighter_half_last_tflops="lighter half last",
                   last_heads_by_block_tflops="last heads by block", cudnn_tflops="cuDNN",
                   paired_lighter_half_last_vs_head="back to back: lighter half last ÷ head",
                   paired_last_heads_by_block_vs_head="back to back: last heads by block ÷ head",
                   paired_last_heads_by_block_low="95 % low", paired_last_heads_by_block_high="95 % high",
                   head_vs_cudnn="head order ÷ cuDNN")
    path = harness.write_results(
        "bwd_order", rows, title="Gluon backward: the dispatch order of causal programs, beside cuDNN",
        columns=columns, out_dir=args.out, commit=args.commit,
        notes=[f"bf16, causal, {TOKENS} tokens a batch; forward+backward TFLOP/s 3.5·4·B·H·S²·D/2, the median over "
               f"{args.rounds} interleaved rounds of do_bench medians; back to back: 10 calls between two CUDA "
               f"events, {args.paired} interleaved rounds, median of per-round speed ratios and its 95 % "
               "bootstrap interval. The model: bench/bwd_order.py's model_overhang, ÷ perfect balance."])
    print(path.read_text())
    if not all(r["checked"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
