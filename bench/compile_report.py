"""First call (forward + backward) in a fresh process on a GPU: with an empty Triton cache, as
shipped (the backward's kernels compile on the compile threads while the forward compiles) and
beside it compiling on the calling thread (``FLASH_ATTN2_COMPILE_THREADS=0``, the way Triton
compiles by itself); then with a folder prepared by ``kernel-loader warmup``, made read-only,
checking that the job only reads it (no file added or changed: it can be shared read-only).
About 30-40 s of GPU time. Writes ``bench/results/compile_report.md`` and ``.json``::

    python bench/compile_report.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import harness

SHAPE = dict(head_dim=128, heads=16, seq=4096, causal=True)  # the first-call row
_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, kernel_loader
fa = kernel_loader.get_local_kernel(sys.argv[1])
s = json.loads(sys.argv[2])
mk = lambda: torch.randn(1, s["seq"], s["heads"], s["head_dim"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
q, k, v = mk(), mk(), mk()
torch.cuda.synchronize()
ta = time.perf_counter()
# torch's first backward with a gradient tensor passed in imports sympy (seconds), whatever the
# kernel (a training loop's loss.backward() does not): done here on a tensor of its own, so that
# 'first call' is the kernel's part; timed on its own
w = torch.ones(2, device="cuda", requires_grad=True) * 2
w.backward(torch.ones_like(w))
torch.cuda.synchronize()
t1 = time.perf_counter()
out = fa.flash_attn_func(q, k, v, causal=s["causal"])
torch.cuda.synchronize()
t2 = time.perf_counter()
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
t3 = time.perf_counter()
print(json.dumps(dict(setup_s=ta - t0, autograd_s=t1 - ta, forward_s=t2 - t1, backward_s=t3 - t2, first_call_s=t3 - t1)))
"""


def _probe(cache_dir: Path, threads: Optional[int] = None) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir), PYTHONPATH=str(harness.REPO_ROOT))
    env.pop("FLASH_ATTN2_COMPILE_THREADS", None)
    if threads is not None:
        env["FLASH_ATTN2_COMPILE_THREADS"] = str(threads)
    kernel = harness.REPO_ROOT / "kernel_repos" / "kernels-community" / "flash-attn2"
    out = subprocess.run([sys.executable, "-c", _PROBE, str(kernel), json.dumps(SHAPE)], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _read_only(folder: Path, on: bool) -> None:
    """Take write permission off (or give it back to) ``folder`` and everything in it. A root
    process ignores permissions, so the snapshot comparison is the check that counts."""
    for p in [folder, *folder.rglob("*")]:
        mode = p.stat().st_mode
        p.chmod(mode & ~0o222 if on else mode | 0o200)


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def main() -> None:
    args = harness.arguments(__doc__).parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cold, serial, prepared = Path(tmp) / "cold", Path(tmp) / "serial", Path(tmp) / "prepared"
        rows.append(dict(case="empty cache", **_probe(cold)))
        rows.append(dict(case="empty cache, compiling on the calling thread", **_probe(serial, threads=0)))
        env = dict(os.environ, PYTHONPATH=str(harness.REPO_ROOT))
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "kernel_loader.cli", "warmup", "--into", str(prepared),
                        "--head-dims", str(SHAPE["head_dim"]), "--seqlens", str(SHAPE["seq"]),
                        "--heads", f"{SHAPE['heads']}/{SHAPE['heads']}", "--causal", "yes"],
                       env=env, check=True, timeout=300)
        warm_s = time.perf_counter() - start
        before = _snapshot(prepared)
        _read_only(prepared, True)
        try:
            row = dict(case="after kernel-loader warmup (folder read-only)", **_probe(prepared))
        finally:
            _read_only(prepared, False)  # so the temporary folder can be removed
        after = _snapshot(prepared)
        row.update(warmup_s=warm_s, cache_files=len(before),
                   files_written=len(set(after) - set(before)) + sum(after[k] != before[k] for k in before if k in after))
        rows.append(row)
    path = harness.write_results(
        "compile_report", rows, title="First call in a fresh process (fwd+bwd, bf16, d=128, 16 heads, 4k, causal)",
        columns=dict(case="Triton cache", forward_s="first forward s", backward_s="first backward s",
                     first_call_s="first call s", setup_s="import + load s",
                     autograd_s="torch's first backward s", warmup_s="warmup run s",
                     cache_files="files in folder", files_written="files written by the job"),
        out_dir=args.out, commit=args.commit,
        notes=["Each row is a new process; 'first call' is the first forward + backward, synchronized; "
               "'compiling on the calling thread' is FLASH_ATTN2_COMPILE_THREADS=0 (no compile pool). "
               "'files written by the job' counts files the job added to or changed in the prepared "
               "folder (0: it only reads, so the folder can be shared read-only). \"torch's first "
               "backward\" is a two-element backward run before the first call, unrelated to the kernel: "
               "torch's first backward(gradient) in a process imports sympy, and counting it would "
               "charge the kernel for it."])
    print(path.read_text())


if __name__ == "__main__":
    main()
