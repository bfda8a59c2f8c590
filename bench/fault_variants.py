"""The forward kernel's fault with dropout on sm90, variant by variant.

One varlen forward call (the failing case of flash-attention's tests: kv-packed, fp16, head_dim
80, 4 sequences of up to 512 queries and 256 keys, 6 heads, ALiBi, dropout 0.17, softcap 50,
causal) is run in a fresh process per variant: one feature changed, a head dim, a tile or stage
count, and whether right-bounded rows walk their diagonal in one loop with the bulk (forced) or
as shipped. A CUDA fault poisons its process's context, hence one process per variant; each runs
with ``CUDA_LAUNCH_BLOCKING=1`` so the error belongs to this launch. Writes
``bench/results/fault_variants.md`` and ``.json``::

    python bench/fault_variants.py                                       # on the GPU
    TRITON_INTERPRET=1 python bench/fault_variants.py --smoke --out DIR  # CPU, tiny sizes

``--smoke`` runs a few variants at tiny sizes on the CPU (Triton's interpreter): it checks the
script, not the fault.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List

import harness

BASE = dict(d=80, dtype="fp16", kvpacked=True, dense=False, alibi=True, dropout=0.17, softcap=50.0,
            causal=True, config=None, one_loop=None)
# one_loop: True forces the one-loop build, None takes the shipped choice (two loops with dropout)
VARIANTS: List[Dict[str, Any]] = [
    dict(one_loop=True), {},
    dict(one_loop=True, kvpacked=False), dict(one_loop=True, softcap=0.0), dict(one_loop=True, alibi=False),
    dict(one_loop=True, dtype="bf16"), dict(one_loop=True, dropout=0.0), dict(one_loop=True, causal=False),
    dict(one_loop=True, dense=True), dict(one_loop=True, dense=True, d=128),
    dict(one_loop=True, kvpacked=False, softcap=0.0, alibi=False, d=128), dict(kvpacked=False, softcap=0.0, alibi=False, d=128),
    dict(one_loop=True, config=[64, 64, 4, 2]), dict(one_loop=True, config=[64, 64, 4, 1]),
    dict(one_loop=True, config=[64, 32, 4, 3]), dict(one_loop=True, config=[128, 64, 8, 3]),
    dict(one_loop=True, config=[128, 64, 8, 2]),
    *[v for d in (32, 40, 48, 59, 64, 72, 96, 112, 128, 160, 192, 224, 256)
      for v in (dict(one_loop=True, d=d), dict(d=d))],
]
SMOKE_VARIANTS = [dict(one_loop=True), {}, dict(dense=True, d=64)]
FULL = dict(batch=4, heads=6, sq=512, sk=256)
SMOKE = dict(batch=2, heads=2, sq=48, sk=32)


def run_one(variant: Dict[str, Any], sizes: Dict[str, int], device: str) -> Dict[str, Any]:
    """Run the case with ``variant`` applied, three times, then synchronize; the outcome."""
    import importlib

    import torch

    v = {**BASE, **variant}
    fwd = importlib.import_module(harness.shipped_kernel().__name__ + "._triton_fwd")
    batch, heads, sq, sk, d = sizes["batch"], sizes["heads"], sizes["sq"], sizes["sk"], v["d"]
    lq = torch.randint(max(1, sq // 2), sq + 1, (batch,), generator=torch.Generator().manual_seed(80)).tolist()
    lk = torch.randint(max(1, sk // 2), sk + 1, (batch,), generator=torch.Generator().manual_seed(81)).tolist()
    lq[0], lk[0] = sq, sk
    if v["dense"]:
        lq, lk = [sq] * batch, [sk] * batch
    dtype = torch.float16 if v["dtype"] == "fp16" else torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(sum(lq), heads, d, dtype=dtype, device=device)
    if v["kvpacked"]:
        kv = torch.randn(sum(lk), 2, heads, d, dtype=dtype, device=device)
        k, vv = kv[:, 0], kv[:, 1]
    else:
        k, vv = (torch.randn(sum(lk), heads, d, dtype=dtype, device=device) for _ in range(2))
    slopes = torch.rand(batch, heads, device=device) * 0.3 if v["alibi"] else None
    if v["dense"]:
        q, k, vv = (t.view(batch, -1, *t.shape[1:]) for t in (q, k, vv))
        lengths: Dict[str, Any] = {}
    else:
        cu = lambda ls: torch.tensor([0, *itertools.accumulate(ls)], dtype=torch.int32, device=device)  # noqa: E731
        lengths = dict(cu_seqlens_q=cu(lq), cu_seqlens_k=cu(lk), max_seqlen_q=sq, max_seqlen_k=sk)
    try:
        for _ in range(3):
            out, _ = fwd.attention_forward(q, k, vv, **lengths, causal=v["causal"], softcap=v["softcap"],
                                           alibi_slopes=slopes, dropout_p=v["dropout"], seed=1234,
                                           config=tuple(v["config"]) if v["config"] else None,
                                           merge_diag=v["one_loop"])
        if device == "cuda":
            torch.cuda.synchronize()
        return dict(outcome="ok", max_abs_out=float(out.float().abs().max()))
    except Exception as e:  # the outcome is what this bench records
        return dict(outcome="error", error=f"{type(e).__name__}: {str(e)[:120]}")


def _child(variant: Dict[str, Any], smoke: bool) -> Dict[str, Any]:
    env = harness.child_env(CUDA_LAUNCH_BLOCKING="1")
    cmd = [sys.executable, __file__, "--child", json.dumps(variant)] + (["--smoke"] if smoke else [])
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600 if smoke else 120)
    except subprocess.TimeoutExpired:
        return dict(outcome="error", error="timed out")
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(outcome="error", error=f"exit status {done.returncode}: {tail[:120]}")
    return json.loads(lines[-1])


def _label(variant: Dict[str, Any]) -> str:
    changed = {k: v for k, v in variant.items() if k != "one_loop"}
    return ", ".join(f"{k}={v}" for k, v in changed.items()) or "the case as is"


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (checks the script)")
    parser.add_argument("--jobs", type=int, default=8, help="variants run at once")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one variant, in this process
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    if args.child is not None:
        print(json.dumps(run_one(json.loads(args.child), sizes, "cpu" if args.smoke else "cuda")))
        return
    variants = SMOKE_VARIANTS if args.smoke else VARIANTS
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        outcomes = list(pool.map(lambda v: _child(v, args.smoke), variants))
    rows = [dict(variant=_label(v), loops="one (forced)" if v.get("one_loop") else "as shipped",
                 outcome=o["outcome"], error=o.get("error")) for v, o in zip(variants, outcomes)]
    path = harness.write_results(
        "fault_variants", rows, title="The forward's fault with dropout on sm90, variant by variant",
        columns=dict(variant="change from the case", loops="diagonal loop", outcome="outcome", error="error"),
        out_dir=args.out, commit=args.commit,
        notes=[f"The case: varlen forward, kv-packed, fp16, head_dim 80, {sizes['batch']} sequences of up to "
               f"{sizes['sq']} queries / {sizes['sk']} keys, {sizes['heads']} heads, ALiBi, dropout 0.17, "
               "softcap 50, causal; three calls per process, one process per row, CUDA_LAUNCH_BLOCKING=1. "
               "'one (forced)': right-bounded rows walk the diagonal blocks in the bulk's loop "
               "(merge_diag=True); 'as shipped': the kernel's own choice, two loops whenever dropout is on."],
        extra=dict(base=BASE, sizes=sizes, variants=variants, outcomes=outcomes))
    print(path.read_text())


if __name__ == "__main__":
    main()
