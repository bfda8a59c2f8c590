"""The Gluon backward with every head's lighter half of causal key blocks dispatched last
(``_gluon_bwd.LIGHT_LAST``) beside the same kernel in head order and SDPA cuDNN: forward+backward
TFLOP/s (bf16, 16k tokens per batch, causal).

Why: one program per (key block, KV head); the GPU hands each free SM the next program in grid
order. A causal key block's program reads the query blocks from its diagonal on, so a head's
programs run from long (the first key block) to short, and a call whose grid ends on the last
heads' programs ends ragged. Model (list scheduling of the programs over 132 SMs, a program costing
its 64-row query blocks plus one; ``model_overhang``): 7 % over balance at 1k and 4k tokens, 14 %
at head_dim 64 GQA 2k (64 programs of 4 query heads each per key block column), 1-3 % at 16k and
head_dim 256; with the lighter half last 0.1-1.2 %. Prediction: the backward kernel 3-6 % faster
where the model says 7 %, less where the dispatch tail is short against the whole call.

Each row checks dK and dV bit for bit and dQ within 1e-2 (relative) between the two orders (dQ's
fp32 reduce-adds land in another order), then times both and cuDNN: ``do_bench`` medians over
interleaved rounds, and back to back (10 calls between two CUDA events, ``--paired`` interleaved
rounds) with the ratio as the median of per-round ratios and its 95 % bootstrap interval::

    python bench/bwd_light_last.py [--out DIR] [--commit SHA] [--rounds 4] [--paired 16]
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


def model_overhang(n_kb: int, n_bh: int, light_last: bool, sms: int = SMS) -> float:
    """The modelled call length over perfect balance: programs dealt in dispatch order to the SM
    that frees first, key block j costing 2·(n_kb - j) + 1 (its 64-row query blocks, one more for
    the rest). Raises nothing."""
    cost = [2 * (n_kb - j) + 1 for j in range(n_kb)]
    heavy = n_kb - n_kb // 2 if light_last else n_kb
    order = [cost[j] for bh in range(n_bh) for j in range(heavy)]
    order += [cost[j] for j in range(heavy, n_kb) for _ in range(n_bh)]
    ends = [0] * sms
    for c in order:
        heapq.heapreplace(ends, ends[0] + c)
    return max(ends) / (n_bh * sum(cost) / sms)


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--rounds", type=int, default=harness.ROUNDS)
    parser.add_argument("--paired", type=int, default=16)
    args = parser.parse_args()
    import torch
    from torch.nn.attention import SDPBackend

    fa = harness.shipped_kernel()
    gb = importlib.import_module(fa.__name__ + "._gluon_bwd")
    shipped = gb.LIGHT_LAST
    harness.warm_gpu()
    rows = []
    for d, hq, hk, s in ROWS:
        b = TOKENS // s
        torch.manual_seed(0)
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        do = torch.randn_like(q)

        def step(light: bool):
            def run():
                gb.LIGHT_LAST = light
                return torch.autograd.grad(fa.flash_attn_func(q, k, v, causal=True), (q, k, v), do)
            return run

        contenders = {"light_last": step(True), "head_order": step(False)}
        (dq1, dk1, dv1), (dq0, dk0, dv0) = contenders["light_last"](), contenders["head_order"]()
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        dot = do.transpose(1, 2)
        sdpa = harness.sdpa([SDPBackend.CUDNN_ATTENTION], qt, kt, vt, True)
        contenders["cudnn"] = lambda: torch.autograd.grad(sdpa(), (qt, kt, vt), dot)
        flop = 3.5 * 4.0 * b * hq * s * s * d / 2
        us, errors, _ = harness.interleaved_us(contenders, rounds=args.rounds)
        samples = harness.paired({n: contenders[n] for n in ("light_last", "head_order")}, rounds=args.paired)
        gb.LIGHT_LAST = shipped
        r = harness.ratio(samples["head_order"], samples["light_last"])
        n_kb = -(-s // (gb.WIDE_BLOCK_N if d >= gb.WIDE_FROM else gb.BLOCK_N))
        dq_err = float((dq1.float() - dq0.float()).norm() / dq0.float().norm())
        row = dict(d=d, heads=f"{hq}/{hk}", seq=s,
                   model_head_order=model_overhang(n_kb, b * hk, False), model_light_last=model_overhang(n_kb, b * hk, True),
                   dkdv_same_bits=bool(torch.equal(dk1, dk0) and torch.equal(dv1, dv0)), dq_rel_diff=dq_err,
                   checked=bool(torch.equal(dk1, dk0) and torch.equal(dv1, dv0) and dq_err < 1e-2),
                   **{f"{n}_tflops": flop / t / 1e6 for n, t in us.items()}, errors=errors or None,
                   light_vs_head=us["head_order"] / us["light_last"], paired_light_vs_head=r.median,
                   paired_low=r.low, paired_high=r.high,
                   light_vs_cudnn=us["cudnn"] / us["light_last"], head_vs_cudnn=us["cudnn"] / us["head_order"])
        rows.append(row)
        print(row, flush=True)
    columns = dict(d="d", heads="heads", seq="seq", model_head_order="model: head order ÷ balance",
                   model_light_last="model: lighter half last ÷ balance", dkdv_same_bits="dK, dV bit for bit",
                   dq_rel_diff="dQ relative difference", light_last_tflops="lighter half last f+b TFLOP/s",
                   head_order_tflops="head order f+b TFLOP/s", cudnn_tflops="cuDNN f+b TFLOP/s",
                   light_vs_head="lighter half last ÷ head order (speed)",
                   paired_light_vs_head="back to back: lighter half last ÷ head order", paired_low="95 % low",
                   paired_high="95 % high", light_vs_cudnn="lighter half last ÷ cuDNN",
                   head_vs_cudnn="head order ÷ cuDNN")
    path = harness.write_results(
        "bwd_light_last", rows, title="Gluon backward: the lighter half of causal key blocks last, beside head order",
        columns=columns, out_dir=args.out, commit=args.commit,
        notes=[f"bf16, causal, {TOKENS} tokens a batch; forward+backward TFLOP/s 3.5·4·B·H·S²·D/2, the median over "
               f"{args.rounds} interleaved rounds of do_bench medians; back to back: 10 calls between two CUDA "
               f"events, {args.paired} interleaved rounds, median of per-round speed ratios and its 95 % "
               "bootstrap interval. The model: bench/bwd_light_last.py's model_overhang."])
    print(path.read_text())
    if not all(r["checked"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
