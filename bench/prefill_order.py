"""Launch order of the causal forward kernel: heaviest row blocks of all heads first vs per head.

    PYTHONPATH=. python3 bench/prefill_order.py OUT_DIR [--shapes=all|d64|d128] [--budgets=0,16]
                                                        [--configs=64x64x4x3,...] [--sweep]

Why: under a causal mask the cost of a row block grows with its index. The forward kernel used to
reverse row blocks inside each head (``per_head``): the GPU starts programs in grid order, so the
heavy blocks of the last heads still ran in the final wave and left SMs idle. ``heavy_first``
starts the last row block of every head, then the one before, so the final wave is made of the
cheapest blocks. A list-scheduling model of 8 x 2048, 32 heads, 128-row blocks on 264 slots (132
SMs x 2 programs) puts the per_head tail ~7 % above the ideal and heavy_first within 0.3 %.

What it measures, interleaved (every round times each contender once, in rotating order; medians
over rounds): our forward with each order, and SDPA's default backend on the transposed views of
the same tensors (cuDNN on the H200), for several causal shapes, plus non-causal controls and a
sliding-window row. heavy_first runs with the kernel's L2 budget for its chunks of heads and with
each ``--budgets`` value (MB; 0 = one chunk of every head); ``--configs`` adds tile configs timed
with each order. Results and the shipped choices: bench/results/prefill-order-2026-11-30.md.
Outputs of the orders must be bitwise equal (each program writes its own rows); the run fails
otherwise. Writes OUT_DIR/prefill-order.json and prints a table.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path
from statistics import median_high

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attention as A  # noqa: E402

# (batch, seq, heads_q, heads_k, head_dim, causal, window_left)
SHAPES = [
    (8, 2048, 32, 8, 64, True, -1),     # the 1.24B Llama's prefill (bench/e2e_transformers.py)
    (16, 1024, 32, 8, 64, True, -1),
    (2, 8192, 32, 8, 64, True, -1),
    (1, 16384, 32, 8, 64, True, -1),
    (8, 2048, 32, 8, 128, True, -1),
    (4, 4096, 32, 32, 128, True, -1),
    (8, 2048, 32, 8, 64, False, -1),    # control: unmasked rows keep in_order
    (8, 2048, 32, 8, 128, False, -1),
    (2, 8192, 32, 8, 64, True, 1024),   # sliding window (Mistral-style): no SDPA equivalent
]
D128_SHAPES = [
    (8, 2048, 32, 8, 128, True, -1),
    (1, 16384, 32, 8, 128, True, -1),
    (4, 4096, 32, 32, 128, True, -1),
    (4, 4096, 16, 16, 128, False, -1),  # the shape the d=128 config was first tuned on (2026-11-29)
    (4, 4096, 16, 16, 128, True, -1),
    (8, 2048, 32, 8, 128, False, -1),
]
ROUNDS = 11


def _option(name: str, default: str) -> str:
    for a in sys.argv[2:]:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return default


# --shapes=all|d64|d128: which rows; --budgets=MB,...: heavy_first chunk budgets to time beside
# the kernel's own (0 = unchunked); --configs=BMxBNxWxS,...: tile configs timed with each order.
# --sweep = --shapes=all with ten tile configs at head_dim 128 (the first d=128 run).
SWEEP = "--sweep" in sys.argv
SHAPE_SET = _option("shapes", "all")
if SHAPE_SET == "d64":
    SHAPES = [r for r in SHAPES if r[4] == 64 and r[5] and r[6] < 0]
elif SHAPE_SET == "d128":
    SHAPES = D128_SHAPES
BUDGETS_MB = [int(x) for x in _option("budgets", "0,16").split(",") if x]
SWEEP_CONFIGS = [(128, 64, 8, 2), (128, 64, 8, 4), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4),
                 (64, 128, 4, 2), (64, 128, 4, 3), (128, 32, 8, 3), (64, 32, 4, 3), (128, 128, 8, 2)]
CONFIGS = SWEEP_CONFIGS if SWEEP else [tuple(int(v) for v in c.split("x"))
                                       for c in _option("configs", "").split(",") if c]
DEFAULT_BUDGET = 32 << 20  # replaced by the kernel's own default at start
CALLS = 10


def timed_us(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / CALLS * 1000.0


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    fwd = A.forward_module()
    global DEFAULT_BUDGET
    DEFAULT_BUDGET = fwd.L2_BUDGET_BYTES
    import triton

    result = {
        "date": datetime.date.today().isoformat(),
        "command": "PYTHONPATH=. python3 bench/prefill_order.py $OUT " + " ".join(sys.argv[2:]),
        "commit": os.environ.get("BENCH_COMMIT", "unknown"),
        "environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "triton": triton.__version__, "cuda": torch.version.cuda},
        "rows": [],
    }
    t0 = time.time()
    for b, s, hq, hk, d, causal, left in SHAPES:
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
        window = (left, 0 if causal else -1)
        scale = d ** -0.5

        def ours(order, cfg=None, budget=DEFAULT_BUDGET):
            def run():
                fwd.L2_BUDGET_BYTES = budget
                try:
                    return fwd.attention_forward(q, k, v, softmax_scale=scale, causal=causal,
                                                 window_size=window, store_lse=False,
                                                 row_order=order, config=cfg)[0]
                finally:
                    fwd.L2_BUDGET_BYTES = DEFAULT_BUDGET
            return run

        contenders = {}
        if not causal:
            orders = ["in_order", "heavy_first"]
        elif left >= 0:
            orders = ["per_head", "heavy_first", "in_order"]
        else:
            orders = ["heavy_first", "per_head"]
        for order in orders:
            contenders[order] = ours(order)
        if causal and left < 0:
            # other L2 budgets for the chunks of heads (0: one chunk of every head)
            for mb in BUDGETS_MB:
                contenders["heavy_first " + (f"{mb}MB" if mb else "unchunked")] = ours(
                    "heavy_first", budget=(mb << 20) if mb else 1 << 40)
        if left < 0:
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            contenders["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                        scale=scale, enable_gqa=True)
        if CONFIGS and (d == 128 or not SWEEP):
            for cfg in CONFIGS:
                variants = [(order, DEFAULT_BUDGET, order) for order in orders[:2]]
                if causal and left < 0 and not SWEEP:
                    variants += [(f"heavy_first {mb}MB" if mb else "heavy_first unchunked", (mb << 20) if mb else 1 << 40,
                                  "heavy_first") for mb in BUDGETS_MB]
                for label, budget, order in variants:
                    fn = ours(order, cfg, budget)
                    try:
                        fn()
                        torch.cuda.synchronize()
                    except Exception as exc:  # a config that does not fit is reported, not fatal
                        print(f"config {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        break
                    contenders[f"{label} " + "x".join(map(str, cfg))] = fn
        outs = {name: fn() for name, fn in contenders.items() if name != "sdpa"}
        torch.cuda.synchronize()
        first = outs[orders[0]]
        equal = {name: bool(torch.equal(o, first)) for name, o in outs.items() if "x" not in name.split()[-1]}
        if not all(equal.values()):
            raise SystemExit(f"launch orders disagree at {(b, s, hq, hk, d, causal, left)}: {equal}")
        if "sdpa" in contenders:
            ref = contenders["sdpa"]().transpose(1, 2)
            maxabs = {name: float((o.float() - ref.float()).abs().max()) for name, o in outs.items()}
        else:
            maxabs = {}
        for fn in contenders.values():  # warm-up
            fn()
        torch.cuda.synchronize()
        samples = {name: [] for name in contenders}
        names = list(contenders)
        for r in range(ROUNDS):
            for name in names[r % len(names):] + names[:r % len(names)]:
                samples[name].append(timed_us(contenders[name]))
        us = {name: median_high(v) for name, v in samples.items()}
        flops = A.fwd_flops(b, hq, s, s, d, causal) if left < 0 else None
        base = us["per_head"] if causal else us["in_order"]
        row = {"shape": {"batch": b, "seq": s, "heads": f"{hq}/{hk}", "head_dim": d, "causal": causal,
                         "window_left": left},
               "us": {n: round(t, 1) for n, t in us.items()},
               "vs_sdpa": {n: round(us["sdpa"] / t, 3) for n, t in us.items()} if "sdpa" in us else None,
               "vs_old_order": {n: round(base / t, 3) for n, t in us.items()},
               "tflops": {n: round(flops / t / 1e6, 1) for n, t in us.items()} if flops else None,
               "maxabs_vs_sdpa": maxabs, "orders_bitwise_equal": equal,
               "samples_us": {n: [round(x, 1) for x in v] for n, v in samples.items()}}
        result["rows"].append(row)
        print(f"[{time.time() - t0:5.1f}s] {b}x{s} {hq}/{hk} d={d} causal={causal} left={left}: "
              + "  ".join(f"{n} {t:.1f}us" + (f" ({us['sdpa'] / t:.3f}x sdpa)" if "sdpa" in us else "")
                          for n, t in us.items()), flush=True)
        (out_dir / "prefill-order.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
