"""Where a forward kernel's warps wait, instruction by instruction: one launch of the shipped
kernel's forward and one of SDPA cuDNN's, side by side under Nsight Compute's warp-state sampling
(``ncu --clock-control none``, the source page in SASS). Per kernel: its duration under the
profiler, the largest stall reasons, the share of samples on each kind of instruction (matmul
issue, waits for matmuls, mbarrier waits, exponentials, other float work, ...) and the
instructions that hold the most samples with their largest reason. Needs ``ncu`` on the PATH and
an sm90 GPU. Writes ``bench/results/ncu_source.md`` and ``.json``::

    python bench/ncu_source.py [--head-dim 64] [--seq 4096] [--causal] [--top 12]
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

import harness

TOKENS = 16384  # per batch, as in bench/attention.py
HEADS = 16
# provider -> the kernel to read in its call (a regex on the kernel's name)
KERNELS = {"ours": "_gluon_attn_fwd|_fwd_kernel", "cudnn": "flash_fprop"}
# what each SASS instruction counts as: the first kind one of whose prefixes starts its opcode's
# first part (``WARPGROUP`` of ``WARPGROUP.DEPBAR.LE``)
KINDS = (
    ("matmul issue", ("HGMMA", "HMMA")),
    ("matmul wait", ("WARPGROUP", "WARPSYNC")),
    ("mbarrier", ("SYNCS",)),
    ("barrier", ("BAR",)),
    ("exp2", ("MUFU",)),
    ("float", ("FMNMX", "FADD", "FMUL", "FFMA", "FSEL", "FSETP", "F2FP")),
    ("shuffle", ("SHFL",)),
    ("memory", ("LD", "ST", "UTMA", "UBLKCP", "RED", "ATOM")),
    ("branch", ("BRA", "BSSY", "BSYNC", "EXIT", "RET", "CALL")),
)


def opcode(sass: str) -> str:
    """The instruction's opcode with its modifiers (``FMUL``, ``WARPGROUP.DEPBAR.LE``), its
    predicate (``@P0``, ``@!P1``) left out."""
    parts = sass.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].rstrip(";") if parts else ""


def kind(sass: str) -> str:
    """Which of :data:`KINDS` a SASS instruction is ("other" if none)."""
    base = opcode(sass).split(".")[0]
    for name, prefixes in KINDS:
        if base.startswith(prefixes):
            return name
    return "other"


def summarise(header: list, data: list, top: int) -> dict:
    """The source page of one kernel summarised: stall reasons, each kind's share of the samples,
    and the ``top`` instructions by samples as ``(share, largest reason, SASS)``."""
    src, samples = header.index("Source"), header.index(harness.NCU_SAMPLES)
    reasons = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(int(r[samples] or 0) for r in data) or 1
    kinds: dict = {}
    for r in data:
        kinds[kind(r[src])] = kinds.get(kind(r[src]), 0) + int(r[samples] or 0) / total
    ranked = sorted(data, key=lambda r: -int(r[samples] or 0))[:top]
    hot = []
    for r in ranked:
        reason = max(reasons, key=lambda i: int(r[i] or 0)) if reasons else None
        hot.append((round(int(r[samples] or 0) / total, 4), header[reason][len("stall_"):] if reason else "",
                    re.sub(r"\s+", " ", r[src]).strip()))
    return dict(stalls=harness.ncu_stall_shares(header, data), kinds=dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
                hot=hot)


def _child(provider: str, head_dim: int, seq: int, causal: bool) -> None:
    """Two calls (the profiler reads the second launch of the kernel)."""
    import torch
    from torch.nn.attention import SDPBackend

    bf = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(TOKENS // seq, seq, HEADS, head_dim, **bf) for _ in range(3))
    if provider == "ours":
        fa = harness.shipped_kernel()
        call = lambda: fa.flash_attn_func(q, k, v, causal=causal)  # noqa: E731
    else:
        call = harness.sdpa(SDPBackend.CUDNN_ATTENTION, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal)
    for _ in range(2):
        call()
    torch.cuda.synchronize()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1")
        return
    parser = harness.arguments(__doc__)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    if shutil.which("ncu") is None:
        raise SystemExit("ncu (Nsight Compute) is not on the PATH")
    work = Path(tempfile.mkdtemp())
    rows = []
    for provider, regex in KERNELS.items():
        child = [sys.executable, __file__, "--child", provider, str(args.head_dim), str(args.seq), str(int(args.causal))]
        duration_ms, header, data = harness.ncu_source_page(regex, child, work / f"{provider}.ncu-rep")
        summary = summarise(header, data, args.top)
        row = dict(provider=provider, head_dim=args.head_dim, seq=args.seq, causal=args.causal,
                   duration_us=round(duration_ms * 1e3, 1),
                   top_stalls=", ".join(f"{k} {v:.0%}" for k, v in sorted(summary["stalls"].items(),
                                                                          key=lambda kv: -kv[1])[:4]),
                   kinds=", ".join(f"{k} {v:.0%}" for k, v in summary["kinds"].items() if v >= 0.01),
                   **summary)
        print({k: row[k] for k in ("provider", "duration_us", "top_stalls", "kinds")}, flush=True)
        rows.append(row)
    hot = [f"**{r['provider']}**: " + "; ".join(f"`{sass}` {share:.1%} ({reason})" for share, reason, sass in r["hot"])
           for r in rows]
    path = harness.write_results(
        "ncu_source", rows, title="Forward kernels under Nsight Compute, instruction by instruction",
        columns=dict(provider="provider", head_dim="head_dim", seq="seq", causal="causal",
                     duration_us="duration under ncu µs", top_stalls="largest stall reasons (share of samples)",
                     kinds="samples by kind of instruction"),
        out_dir=args.out, commit=args.commit,
        notes=[f"One launch each (the second of its process), bf16, {TOKENS // args.seq} x {args.seq} tokens x "
               f"{HEADS} heads; `ncu --clock-control none`, warp-state sampling, every warp's samples (a "
               "producer warp waits most of the time by design).", "The instructions holding the most samples:",
               *hot])
    print(path.read_text())


if __name__ == "__main__":
    main()
