"""What bounds the rows below their cuDNN target: our kernels and SDPA cuDNN's under Nsight Compute.

For each case (the head_dim 64 forward rows, which miss the 1.0x target; a head_dim 128 row,
which meets it, for contrast; paged decode at 4k and 32k context) one call of each provider runs
inside a ``cudaProfilerStart``/``Stop`` range after three warm calls, and ``ncu --clock-control
none --profile-from-start off`` reads every kernel of that range: duration, launch shape
(threads, registers, shared memory, blocks an SM holds), achieved occupancy, the pipes' shares
of their peak (tensor cores, the special-function unit that computes exp2, FMA, ALU), issue-slot
use, DRAM throughput and the largest stall reasons. One row per kernel; the call's main kernel
is its longest. Needs ``ncu`` on the PATH and an sm90 GPU. Writes ``bench/results/ncu_limits.md``
and ``.json``; ``--raw DIR`` keeps each report's raw CSV page::

    python bench/ncu_limits.py [--raw DIR] [--cases fwd-d64-4k,decode-paged-4k,...]
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

# case -> what one call computes; providers: "ours" (the default call), "ours_gluon" (the Gluon
# forward called directly, where the dispatch keeps Triton), "ours_contiguous" (decode on a dense
# cache), "cudnn" (SDPA's cuDNN backend, the target's reference)
CASES = {
    "fwd-d64-4k": dict(kind="fwd", d=64, hq=16, hk=16, seq=4096, causal=False,
                       providers=("ours", "ours_gluon", "cudnn")),
    "fwd-d64-4k-causal": dict(kind="fwd", d=64, hq=16, hk=16, seq=4096, causal=True,
                              providers=("ours", "ours_gluon", "cudnn")),
    "fwd-d128-4k": dict(kind="fwd", d=128, hq=16, hk=16, seq=4096, causal=False, providers=("ours", "cudnn")),
    "decode-paged-4k": dict(kind="decode", ctx=4096, providers=("ours", "ours_contiguous", "cudnn")),
    "decode-paged-32k": dict(kind="decode", ctx=32768, providers=("ours", "ours_contiguous", "cudnn")),
}
TOKENS = 16384  # per forward batch, as in bench/attention.py

# metric (raw page name) -> result key; the first name present wins where several are listed
METRICS = {
    "duration": ("gpu__time_duration.sum",),
    "threads": ("launch__block_size",),
    "grid": ("launch__grid_size",),
    "registers": ("launch__registers_per_thread",),
    "shared_kb": ("launch__shared_mem_per_block_dynamic",),
    "occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "issue_pct": ("sm__issue_active.avg.pct_of_peak_sustained_elapsed",
                  "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    "tensor_pct": ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                   "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                   "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                   "sm__inst_executed_pipe_tensor.avg.pct_of_peak_sustained_active"),
    "xu_pct": ("sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
               "sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active"),
    "fma_pct": ("sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
                "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"),
    "alu_pct": ("sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
                "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"),
    "dram_pct": ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                 "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    "instructions": ("smsp__inst_executed.sum",),
}
# kept in the JSON besides METRICS: every pipe's share, issue and stall figure the sections give
KEEP = re.compile(r"pipe_|issue_active|issue_stalled|warp_latency|inst_executed\.sum|dram__|throughput|"
                  r"launch__|warps_active|duration|sm__cycles")
# what limits the blocks one SM holds: the smallest of these
OCCUPANCY_LIMITS = ("launch__occupancy_limit_blocks", "launch__occupancy_limit_registers",
                    "launch__occupancy_limit_shared_mem", "launch__occupancy_limit_warps")
# cycles a warp spent stalled for each reason per instruction issued
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "Occupancy",
            "LaunchStats", "WarpStateStats", "InstructionStats")


def _call(case: dict, provider: str):
    """The zero-argument call to profile, on fresh inputs."""
    import torch
    from torch.nn.attention import SDPBackend

    fa = harness.shipped_kernel()
    bf = dict(device="cuda", dtype=torch.bfloat16)
    if case["kind"] == "fwd":
        b, d = TOKENS // case["seq"], case["d"]
        q = torch.randn(b, case["seq"], case["hq"], d, **bf)
        k = torch.randn(b, case["seq"], case["hk"], d, **bf)
        v = torch.randn_like(k)
        if provider == "ours":
            return lambda: fa.flash_attn_func(q, k, v, causal=case["causal"])
        if provider == "ours_gluon":
            gluon = importlib.import_module(fa.__name__ + "._gluon_fwd")
            return lambda: gluon.gluon_attention_forward(q, k, v, softmax_scale=d ** -0.5, causal=case["causal"])
        return harness.sdpa(SDPBackend.CUDNN_ATTENTION, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    case["causal"])
    q, k, v, lens, kp, vp, table = harness.decode_inputs(case["ctx"])
    if provider == "ours_contiguous":
        return lambda: fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
    if provider == "ours":  # paged: the same keys scattered over pages in random order
        return lambda: fa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)
    return harness.sdpa(SDPBackend.CUDNN_ATTENTION, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), False)


def _child(case_name: str, provider: str) -> None:
    import torch

    call = _call(CASES[case_name], provider)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _ncu(*args: str) -> str:
    done = subprocess.run(["ncu", *args], capture_output=True, text=True, timeout=400)
    if done.returncode != 0:
        raise RuntimeError(f"ncu {' '.join(args[:6])} ... failed: {done.stderr[-2000:]}")
    return done.stdout


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _kernel_rows(raw_csv: str) -> list[dict]:
    """One dict per profiled kernel from ``ncu --page raw --csv``: name, METRICS, kept raw metrics."""
    header, units, data = harness.ncu_raw_table(raw_csv)
    out = []
    for r in data:
        values = dict(zip(header, r))
        row: dict = {"kernel_name": values.get("Kernel Name", "?")}
        for key, names in METRICS.items():
            name = next((n for n in names if n in values and _number(values[n]) is not None), None)
            if name is None:
                continue
            value = _number(values[name])
            unit = units[header.index(name)]
            if key == "duration":  # to microseconds
                value *= {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit, 1.0)
            if key == "shared_kb":
                value /= {"byte/block": 1024, "Kbyte/block": 1, "Mbyte/block": 1 / 1024}.get(unit, float("nan"))
            row[key] = value
        limits = [_number(values[n]) for n in OCCUPANCY_LIMITS if n in values and _number(values[n]) is not None]
        if limits:
            row["blocks_per_sm"] = min(limits)
        # "selected" is the issue itself (1 per instruction), not a stall
        stalls = {STALL.match(h).group(1): _number(values[h]) for h in header
                  if STALL.match(h) and _number(values[h]) and STALL.match(h).group(1) != "selected"}
        top = sorted(stalls.items(), key=lambda kv: -kv[1])[:4]
        row["top_stalls"] = ", ".join(f"{k} {v:.1f}" for k, v in top)
        row["raw"] = {h: values[h] for h in header if KEEP.search(h) and values[h] != ""}
        out.append(row)
    return out


def _short(name: str) -> str:
    """A kernel's name without its template arguments and parameter list."""
    return re.sub(r"[<(].*$", "", name)[:60]


def _profile(case_name: str, provider: str, work: Path, raw_dir: Path | None) -> list[dict]:
    report = work / f"{case_name}-{provider}"
    child = [sys.executable, __file__, "--child", case_name, provider]
    sections = [a for s in SECTIONS for a in ("--section", s)]
    _ncu("--profile-from-start", "off", "--clock-control", "none", *sections, "-f", "-o", str(report), *child)
    raw = _ncu("-i", str(report) + ".ncu-rep", "--page", "raw", "--csv")
    if raw_dir is not None:
        raw_dir.mkdir(parents=True, exist_ok=True)
        (raw_dir / f"{case_name}-{provider}.csv").write_text(raw)
    rows = _kernel_rows(raw)
    longest = max((r.get("duration") or 0.0 for r in rows), default=0.0)
    for r in rows:
        r.update(case=case_name, provider=provider, kernel=_short(r["kernel_name"]),
                 main=(r.get("duration") or 0.0) == longest)
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
        return
    BATCH, HQ, HK, D, PAGE = harness.DECODE_SHAPE  # bench/decode.py's step

    parser = harness.arguments(__doc__)
    parser.add_argument("--raw", type=Path, default=None, help="keep each report's raw CSV page here")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    args = parser.parse_args()
    if shutil.which("ncu") is None:
        raise SystemExit("ncu (Nsight Compute) is not on the PATH")
    work = Path(tempfile.mkdtemp())
    rows, failures = [], []
    for case_name in args.cases.split(","):
        for provider in CASES[case_name]["providers"]:
            try:
                got = _profile(case_name, provider, work, args.raw)
            except (RuntimeError, subprocess.TimeoutExpired, StopIteration) as exc:
                failures.append(dict(case=case_name, provider=provider, error=str(exc)[-500:]))
                print("FAILED", case_name, provider, str(exc)[-500:], flush=True)
                continue
            for r in got:
                print({k: v for k, v in r.items() if k != "raw"}, flush=True)
            rows += got
    columns = dict(case="case", provider="provider", kernel="kernel", main="main", duration="µs under ncu",
                   grid="programs", threads="threads", registers="registers", shared_kb="shared KB",
                   blocks_per_sm="blocks/SM", occupancy_pct="warps active %",
                   issue_pct="issue slots %", tensor_pct="tensor %", xu_pct="exp2 (XU) %", fma_pct="FMA %",
                   alu_pct="ALU %", dram_pct="DRAM %", instructions="instructions (warp)",
                   top_stalls="largest stalls (cycles per issued instruction)")
    path = harness.write_results(
        "ncu_limits", rows, title="Where the rows below target are bound: our kernels and cuDNN's under Nsight Compute",
        columns=columns, out_dir=args.out, commit=args.commit, extra=dict(failures=failures),
        notes=[f"One call per provider after three warm ones, every kernel of it profiled (`ncu --clock-control none "
               f"--profile-from-start off`, sections {', '.join(SECTIONS)}). Forward: bf16, {TOKENS} tokens per "
               f"batch; decode: batch {BATCH}, GQA {HQ}/{HK}, head_dim {D}, "
               f"{PAGE}-key pages in random order ('ours_contiguous': the same keys in a dense cache; cuDNN "
               "reads the dense cache). Pipe figures are shares of each pipe's peak over the cycles the SMs were "
               "active; 'main' marks a call's longest kernel."])
    print(path.read_text())


if __name__ == "__main__":
    main()
