"""Where the Gluon backward's warps wait: one launch of ``_gluon_attn_bwd`` profiled with Nsight
Compute (``ncu --clock-control none``, warp-state sampling per SASS instruction), for the
shipped kernel and, with ``--baseline DIR``, another build of the kernel repo folder beside it.
Each row: the kernel's duration under the profiler, the share of stall samples per reason, and
how many local-memory (spill) loads and stores the kernel executed and how many samples sat on
them. Needs ``ncu`` on the PATH and an sm90 GPU. Writes ``bench/results/ncu_gluon_bwd.md`` and
``.json``::

    python bench/ncu_gluon_bwd.py [--baseline DIR] [--head-dim 256] [--non-causal]
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

import harness

SHAPE = dict(batch=4, seq=4096, heads=16)  # the attention table's 4k row


def _child(kernel_dir: str, head_dim: int, causal: bool) -> None:
    """Run one forward+backward twice (the profiler takes the second backward's launch)."""
    import torch
    import kernel_loader

    fa = kernel_loader.get_local_kernel(kernel_dir) if kernel_dir else harness.shipped_kernel()
    q, k, v = (torch.randn(SHAPE["batch"], SHAPE["seq"], SHAPE["heads"], head_dim, device="cuda",
                           dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    for _ in range(2):
        fa.flash_attn_func(q, k, v, causal=causal).backward(do)
    torch.cuda.synchronize()


def _profile(name: str, kernel_dir: str, head_dim: int, causal: bool, work: Path) -> dict:
    child = [sys.executable, __file__, "--child", kernel_dir or "", str(head_dim), str(int(causal))]
    duration_ms, header, data = harness.ncu_source_page("_gluon_attn_bwd", child, work / f"{name}.ncu-rep")
    src, samples, executed = (header.index(c) for c in ("Source", harness.NCU_SAMPLES, "Instructions Executed"))
    total = sum(int(r[samples] or 0) for r in data)
    by_reason = harness.ncu_stall_shares(header, data)
    local = [r for r in data if re.search(r"\b(LDL|STL)\b", r[src])]
    row = dict(kernel=name, head_dim=head_dim, causal=causal, duration_ms=duration_ms,
               local_instructions_executed=sum(int(r[executed] or 0) for r in local),
               local_samples_share=sum(int(r[samples] or 0) for r in local) / total,
               instructions_executed=sum(int(r[executed] or 0) for r in data))
    top = sorted(by_reason.items(), key=lambda kv: -kv[1])[:4]
    row.update({f"stall_{k}": v for k, v in by_reason.items()})
    row["top_stalls"] = ", ".join(f"{k} {v:.0%}" for k, v in top)
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")
        return
    parser = harness.arguments(__doc__, baseline=True)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--non-causal", action="store_true")
    args = parser.parse_args()
    if shutil.which("ncu") is None:
        raise SystemExit("ncu (Nsight Compute) is not on the PATH")
    causal = not args.non_causal
    work = Path(tempfile.mkdtemp())
    rows = [_profile("shipped", "", args.head_dim, causal, work)]
    if args.baseline:
        rows.append(_profile("baseline", str(Path(args.baseline).resolve()), args.head_dim, causal, work))
    for r in rows:
        print(r, flush=True)
    columns = dict(kernel="kernel", head_dim="head_dim", causal="causal", duration_ms="duration under ncu ms",
                   top_stalls="largest stall reasons (share of samples)",
                   local_instructions_executed="local loads/stores executed",
                   local_samples_share="samples on local loads/stores",
                   instructions_executed="instructions executed")
    path = harness.write_results(
        "ncu_gluon_bwd", rows, title="The Gluon backward under Nsight Compute: where its warps wait",
        columns=columns, out_dir=args.out, commit=args.commit,
        notes=[f"One launch of _gluon_attn_bwd, bf16, batch {SHAPE['batch']} x {SHAPE['seq']} tokens x "
               f"{SHAPE['heads']} heads, the second backward of the process; `ncu --clock-control none` with "
               "warp-state sampling; every warp's samples count (the producer and dQ-writer warps wait most "
               "of the time by design). 'baseline': the kernel repo folder given with --baseline."])
    print(path.read_text())


if __name__ == "__main__":
    main()
