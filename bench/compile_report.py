"""First call (forward + backward) in a fresh process on a GPU: with an empty Triton cache, as
shipped (the backward's kernels compile on the compile threads while the forward compiles) and
beside it compiling on the calling thread (``FLASH_ATTN2_COMPILE_THREADS=0``, the way Triton
compiles by itself); then with a folder prepared by ``kernel-loader warmup``, made read-only,
checking that the job only reads it (no file added or changed: it can be shared read-only), at
the batch it was warmed with and at a batch whose forward takes the tile-table build.
About 30-40 s of GPU time. Writes ``bench/results/compile_report.md`` and ``.json``::

    python bench/compile_report.py [--phases]

``--phases`` also writes ``compile_report_phases.md`` / ``.json``: where the seconds of the two
empty-cache runs go, from timers around Triton's compile and its stages, its compiler hash, the
C modules it builds with the system compiler (its CUDA utilities, each kernel's launcher), the
loading of each compiled kernel, and the package's waits for its compile threads. Each interval
is kept with the thread it ran on, so the table shows what the calling thread itself spent (the
first call's critical path) apart from what the compile threads did beside it. Intervals nest (a
compile holds its stages; loading a kernel can build its launcher): each row is inclusive; the
JSON keeps every interval.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import harness

SHAPE = dict(head_dim=128, heads=16, seq=4096, causal=True, batch=1)  # the first-call row
# the prepared folder is warmed at SHAPE's batch; a job at this batch takes the forward's other build (the
# host's tile table, _schedule.deal: batch 1 keeps the formula, 4 x 16 heads x 4k causal is dealt by the
# model), which warmup compiles too (FLASH_ATTN2_WARMUP)
OTHER_BATCH = 4
_PROBE = r"""
import json, sys, threading, time
t0 = time.perf_counter()
intervals = None
if len(sys.argv) > 3:  # --phases: timers in place before anything of Triton's runs
    sys.path.insert(0, sys.argv[3])
    import compile_report
    intervals = compile_report.install()
import torch, kernel_loader
fa = kernel_loader.get_local_kernel(sys.argv[1])
if intervals is not None:
    launch = sys.modules[fa.__name__ + "._launch"]
    compile_report.install([(launch.__name__, "wait", "waiting for the compile threads"),
                            (launch.__name__, "_hash_compiler_once", "waiting for the compiler hash")], intervals)
s = json.loads(sys.argv[2])
mk = lambda: torch.randn(s["batch"], s["seq"], s["heads"], s["head_dim"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
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
row = dict(setup_s=ta - t0, autograd_s=t1 - ta, forward_s=t2 - t1, backward_s=t3 - t2, first_call_s=t3 - t1)
if intervals is not None:
    row.update(start=t1, caller=threading.current_thread().name, intervals=intervals)
print(json.dumps(row))
"""


# (module, attribute path, label): what is timed. Module-level functions are also replaced where
# other modules imported them by name (see install).
WATCHED: Tuple[Tuple[str, str, str], ...] = (
    ("triton.runtime.cache", "triton_key", "Triton's compiler hash"),
    ("triton.compiler.compiler", "compile", "compile (whole kernel)"),
    ("triton.backends.nvidia.compiler", "CUDABackend.make_ttir", "stage: TTIR"),
    ("triton.backends.nvidia.compiler", "CUDABackend.make_ttgir", "stage: TTGIR"),
    ("triton.backends.nvidia.compiler", "CUDABackend.gluon_to_ttgir", "stage: Gluon to TTGIR"),
    ("triton.backends.nvidia.compiler", "CUDABackend.make_llir", "stage: LLVM IR"),
    ("triton.backends.nvidia.compiler", "CUDABackend.make_ptx", "stage: PTX"),
    ("triton.backends.nvidia.compiler", "CUDABackend.make_cubin", "stage: cubin (ptxas)"),
    ("triton.runtime.build", "compile_module_from_src", "C module built or loaded"),
    ("triton.compiler.compiler", "CompiledKernel._init_handles", "kernel loaded (module, launcher)"),
)


def install(watched=WATCHED, intervals: Optional[list] = None) -> list:
    """Replace each watched callable with a timer around it; returns the list that collects
    ``(label, detail, thread name, start s, end s)`` per call (``time.perf_counter``). ``detail``:
    the C module's name for module builds, else empty. Modules are imported here; a watched name
    that this Triton lacks is skipped. Raises nothing."""
    import importlib

    intervals = [] if intervals is None else intervals
    for module_name, path, label in watched:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owner_name, _, attr = path.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if raw is None:
            continue
        static = isinstance(raw, staticmethod)
        fn = raw.__func__ if static else raw
        timed = _timer(fn, label, intervals)
        setattr(owner, attr, staticmethod(timed) if static else timed)
        if not owner_name:  # also where other modules hold it under a name of their own
            for other in list(sys.modules.values()):
                for key, value in list(getattr(other, "__dict__", {}).items()):
                    if value is fn:
                        setattr(other, key, timed)
    return intervals


def _timer(fn: Callable, label: str, intervals: list) -> Callable:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            detail = kwargs.get("name", args[1] if len(args) > 1 and isinstance(args[1], str) else "") \
                if label.startswith("C module") else ""
            intervals.append((label, detail, threading.current_thread().name, start, time.perf_counter()))
    return timed


def summarise(intervals: List[tuple], caller: str, since: float = float("-inf"),
              until: float = float("inf")) -> List[Dict[str, Any]]:
    """Per label (and C module name): calls, seconds on the ``caller`` thread, seconds on every
    other thread, over the intervals that started in ``[since, until)``; in first-seen order."""
    rows: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for label, detail, thread, start, end in intervals:
        if not since <= start < until:
            continue
        row = rows.setdefault((label, detail), dict(phase=f"{label} ({detail})" if detail else label, calls=0,
                                                    caller_s=0.0, other_threads_s=0.0))
        row["calls"] += 1
        row["caller_s" if thread == caller else "other_threads_s"] += end - start
    return list(rows.values())


def _probe(cache_dir: Path, threads: Optional[int] = None, phases: bool = False, batch: Optional[int] = None) -> dict:
    env = harness.child_env(TRITON_CACHE_DIR=str(cache_dir))
    env.pop("FLASH_ATTN2_COMPILE_THREADS", None)
    if threads is not None:
        env["FLASH_ATTN2_COMPILE_THREADS"] = str(threads)
    kernel = harness.REPO_ROOT / "kernel_repos" / "kernels-community" / "flash-attn2"
    out = subprocess.run([sys.executable, "-c", _PROBE, str(kernel), json.dumps({**SHAPE, "batch": batch or SHAPE["batch"]}),
                          *([str(Path(__file__).parent)] if phases else [])], env=env,
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


def _write_phases(runs: Dict[str, dict], args: Any) -> None:
    rows = []
    for case, run in runs.items():
        rows.append(dict(case=case, phase="first call (forward + backward)", calls=1, caller_s=run["first_call_s"],
                         other_threads_s=None))
        rows.append(dict(case=case, phase="first forward", calls=1, caller_s=run["forward_s"], other_threads_s=None))
        rows += [dict(case=case, **row) for row in summarise(run["intervals"], run["caller"], since=run["start"])]
        rows += [dict(case=case, **{**row, "phase": f"before the call: {row['phase']}"})
                 for row in summarise(run["intervals"], run["caller"], until=run["start"])]
    harness.write_results(
        "compile_report_phases", rows,
        title="Where the first call's seconds go (fwd+bwd, bf16, d=128, 16 heads, 4k, causal, empty Triton cache)",
        columns=dict(case="run", phase="phase (inclusive)", calls="calls", caller_s="calling thread s",
                     other_threads_s="other threads s"),
        out_dir=args.out, commit=args.commit,
        notes=["The empty-cache runs of compile_report.md, each a fresh process; 'compiling on the calling "
               "thread' is FLASH_ATTN2_COMPILE_THREADS=0, 'four compile threads' =4. Phases are timers around Triton's functions (the "
               "script's WATCHED) and the package's waits; they nest, so rows overlap. 'before the call': "
               "intervals that started before the first call (the package's import and set-up)."],
        extra=dict(runs=runs))


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--phases", action="store_true", help="also time the empty-cache runs by phase")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cold, serial, prepared = Path(tmp) / "cold", Path(tmp) / "serial", Path(tmp) / "prepared"
        runs = {"empty cache": _probe(cold, phases=args.phases),
                "empty cache, compiling on the calling thread": _probe(serial, threads=0, phases=args.phases),
                # more threads compiling beside the forward: more of the GIL's time taken from its
                # Python front end (the shipped pool has two)
                "empty cache, four compile threads": _probe(Path(tmp) / "four", threads=4, phases=args.phases)}
        for case, run in runs.items():
            rows.append(dict(case=case, **{k: v for k, v in run.items() if k.endswith("_s")}))
        if args.phases:
            _write_phases(runs, args)
        env = harness.child_env()
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "kernel_loader.cli", "warmup", "--into", str(prepared),
                        "--head-dims", str(SHAPE["head_dim"]), "--seqlens", str(SHAPE["seq"]),
                        "--heads", f"{SHAPE['heads']}/{SHAPE['heads']}", "--causal", "yes"],
                       env=env, check=True, timeout=300)
        warm_s = time.perf_counter() - start
        before = _snapshot(prepared)
        _read_only(prepared, True)
        for case, batch in (("after kernel-loader warmup (folder read-only)", None),
                            (f"the same folder, a job at batch {OTHER_BATCH} (the tile-table build)", OTHER_BATCH)):
            _read_only(prepared, True)
            try:
                row = dict(case=case, **_probe(prepared, batch=batch))
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
               "'compiling on the calling thread' is FLASH_ATTN2_COMPILE_THREADS=0 (no compile pool), "
               "'four compile threads' FLASH_ATTN2_COMPILE_THREADS=4 (the shipped pool has 2). "
               "'files written by the job' counts files the job added to or changed in the prepared "
               "folder (0: it only reads, so the folder can be shared read-only). \"torch's first "
               "backward\" is a two-element backward run before the first call, unrelated to the kernel: "
               "torch's first backward(gradient) in a process imports sympy, and counting it would "
               "charge the kernel for it.",
               f"The batch-{OTHER_BATCH} row reads the folder warmed at batch 1 only: its forward takes the "
               "build that walks the host's tile table, which warmup compiles beside the one its own calls "
               "take; 0 files written means the job found both."])
    print(path.read_text())


if __name__ == "__main__":
    main()
