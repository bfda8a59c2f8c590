"""The persistent Gluon forward with its tiles dealt by the host's table (``_schedule``) beside the
formula's deal (pairs of tiles in turn) and SDPA cuDNN (bf16, 16k tokens per batch).

Why: one program per SM walks a fixed run of tiles. By the formula, 2048 tiles (every
head_dim 128 / 256 row of the attention table, and head_dim 64 causal) make 1024 pairs over 132
SMs: 100 programs walk 8 pairs, 32 walk 7, so the call lasts 8 pairs for 7.76 pairs of work. At
head_dim 64 non-causal (three consumers, 192-row tiles) 4k tokens give 1408 tiles: 44 programs
walk 6 pairs, 88 walk 5. The table deals single tiles by a model of the GPU's dispatch, causal
calls' shortest tiles last. Prediction from that model (``_schedule.deal``: the makespan of its
deal against the formula's): causal rows 1.02-1.03x the formula's deal, head_dim 64 non-causal 4k and 16k
1.09x; the other non-causal rows and 1k causal keep the formula (both columns the same kernel).

Each row checks the table's output and lse against the formula's, element by element, then
times the two deals and cuDNN: ``triton.testing.do_bench`` medians over interleaved rounds, and
back to back (10 calls between two CUDA events, ``--paired`` interleaved rounds) with the ratio
table ÷ formula as the median of per-round ratios and its 95 % bootstrap interval. Writes
``fwd_schedule.md`` / ``.json``::

    python bench/fwd_schedule.py [--out DIR] [--commit SHA] [--rounds 4] [--paired 20]
"""

from __future__ import annotations

import importlib

import harness

TOKENS = 16384
# (head_dim, query heads, kv heads, seq, causal)
ROWS = [
    (128, 16, 16, 1024, True), (128, 16, 16, 4096, True), (128, 16, 16, 16384, True),
    (256, 16, 16, 4096, True), (64, 16, 16, 4096, True), (64, 16, 16, 16384, True),
    (64, 16, 16, 4096, False), (64, 16, 16, 16384, False), (128, 16, 16, 1024, False), (128, 16, 16, 4096, False),
    (256, 16, 16, 4096, False),
]


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--rounds", type=int, default=harness.ROUNDS)
    parser.add_argument("--paired", type=int, default=20)
    args = parser.parse_args()
    import torch
    from torch.nn.attention import SDPBackend

    fa = harness.shipped_kernel()
    gf = importlib.import_module(fa.__name__ + "._gluon_fwd")
    sched = importlib.import_module(fa.__name__ + "._schedule")
    harness.warm_gpu()
    rows = []
    for d, hq, hk, s, causal in ROWS:
        b = TOKENS // s
        torch.manual_seed(0)
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        scale = d ** -0.5
        call = {deal: (lambda deal=deal: gf.gluon_attention_forward(q, k, v, softmax_scale=scale, causal=causal,
                                                                   schedule=deal == "table"))
                for deal in ("formula", "table")}
        sched._TABLES.clear()
        o_t, l_t = call["table"]()  # the table built here, outside the timings
        taken = any(t is not None for t in sched._TABLES.values())  # None: the formula's deal
        o_f, l_f = call["formula"]()
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        contenders = {**call, "cudnn": harness.sdpa([SDPBackend.CUDNN_ATTENTION], qt, kt, vt, causal)}
        flop = 4.0 * b * hq * s * s * d / (2 if causal else 1)
        us, errors, _ = harness.interleaved_us(contenders, rounds=args.rounds)
        row = dict(d=d, heads=f"{hq}/{hk}", seq=s, causal=causal, table_taken=taken,
                   same_bits=bool(torch.equal(o_t, o_f) and torch.equal(l_t, l_f)),
                   **{f"{name}_tflops": flop / t / 1e6 for name, t in us.items()}, errors=errors or None)
        row["table_vs_formula"] = us["formula"] / us["table"]
        row["table_vs_cudnn"] = us["cudnn"] / us["table"]
        row["formula_vs_cudnn"] = us["cudnn"] / us["formula"]
        if args.paired:
            samples = harness.paired({"table": call["table"], "formula": call["formula"]}, rounds=args.paired)
            r = harness.ratio(samples["formula"], samples["table"])
            row.update(paired_table_vs_formula=r.median, paired_low=r.low, paired_high=r.high)
        rows.append(row)
        print(row, flush=True)
    columns = dict(d="d", heads="heads", seq="seq", causal="causal", table_taken="model's deal (else the formula's)",
                   same_bits="table = formula, bit for bit", formula_tflops="formula TFLOP/s",
                   table_tflops="table TFLOP/s", cudnn_tflops="cuDNN TFLOP/s",
                   table_vs_formula="table ÷ formula (speed)", paired_table_vs_formula="back to back: table ÷ formula",
                   paired_low="95 % low", paired_high="95 % high", formula_vs_cudnn="formula ÷ cuDNN",
                   table_vs_cudnn="table ÷ cuDNN")
    path = harness.write_results(
        "fwd_schedule", rows, title="Gluon forward: tiles dealt by the host's table beside the formula's pairs",
        columns=columns, out_dir=args.out, commit=args.commit,
        notes=[f"bf16, {TOKENS} tokens a batch; TFLOP/s 4·B·H·S²·D (halved when causal), the median over "
               f"{args.rounds} interleaved rounds of do_bench medians; back to back: 10 calls between two CUDA "
               f"events, {args.paired} interleaved rounds, median of per-round speed ratios and its 95 % "
               "bootstrap interval. \"model's deal\": the model found a deal 2 % shorter than the formula's "
               "(_schedule.LIST_MIN_GAIN); else both columns run the formula in the kernel."])
    print(path.read_text())


if __name__ == "__main__":
    main()
