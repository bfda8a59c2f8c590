"""bench/compile_report.py --phases: what each of Triton's compile phases took, and on which thread.

The timers are installed in a child Python (Triton compiles there for real, for sm90, without a
GPU: the tests' own process interprets kernels) that compiles one small kernel on its main thread
and another on a worker thread, as the package's compile threads do beside the first call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package

import compile_report as phases  # noqa: E402


def test_each_phase_is_summed_per_thread_and_the_window_picks_the_intervals():
    intervals = [
        ("compile (whole kernel)", "", "MainThread", 10.0, 12.5),
        ("compile (whole kernel)", "", "flash_attn2-compile_0", 10.0, 13.0),
        ("stage: LLVM IR", "", "MainThread", 11.0, 11.5),
        ("C module built or loaded", "cuda_utils", "MainThread", 2.0, 3.0),
        ("C module built or loaded", "__triton_launcher", "flash_attn2-compile_0", 13.0, 13.25),
    ]
    rows = phases.summarise(intervals, "MainThread", since=10.0)
    assert rows == [
        dict(phase="compile (whole kernel)", calls=2, caller_s=2.5, other_threads_s=3.0),
        dict(phase="stage: LLVM IR", calls=1, caller_s=0.5, other_threads_s=0.0),
        dict(phase="C module built or loaded (__triton_launcher)", calls=1, caller_s=0.0, other_threads_s=0.25),
    ]
    before = phases.summarise(intervals, "MainThread", until=10.0)
    assert before == [dict(phase="C module built or loaded (cuda_utils)", calls=1, caller_s=1.0, other_threads_s=0.0)]


_CHILD = r"""
import json, sys, threading
sys.path.insert(0, sys.argv[1])
import compile_report as phases
intervals = phases.install()
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def add(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < N) + 1, mask=offs < N)

def build(block):
    src = ASTSource(fn=add, signature={"X": "*fp32", "Y": "*fp32", "N": "i32", "BLOCK": "constexpr"},
                    constexprs={"BLOCK": block})
    triton.compile(src, target=GPUTarget("cuda", 90, 32))

build(128)
worker = threading.Thread(target=build, args=(256,), name="compile-worker")
worker.start()
worker.join()
print(json.dumps(dict(caller=threading.current_thread().name, rows=phases.summarise(intervals, threading.current_thread().name))))
"""


def test_triton_compiles_are_timed_by_stage_on_the_thread_that_ran_them(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    script = tmp_path / "child.py"  # a file: Triton reads a jit function's source from one
    script.write_text(_CHILD)
    done = subprocess.run([sys.executable, str(script), str(Path(phases.__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["phase"]: row for row in json.loads(done.stdout.strip().splitlines()[-1])["rows"]}
    for stage in ("compile (whole kernel)", "stage: TTIR", "stage: TTGIR", "stage: LLVM IR", "stage: PTX",
                  "stage: cubin (ptxas)"):
        # one compile on each thread, each with its own share of time
        assert rows[stage]["calls"] == 2, (stage, rows[stage])
        assert rows[stage]["caller_s"] > 0 and rows[stage]["other_threads_s"] > 0, (stage, rows[stage])
    whole = rows["compile (whole kernel)"]
    stages = sum(rows[s]["caller_s"] for s in rows if s.startswith("stage:"))
    assert stages <= whole["caller_s"]  # the stages run inside the compile
    # the compiler hash is computed once (Triton caches it), by whichever compile came first
    assert rows["Triton's compiler hash"]["calls"] >= 1


def test_the_other_batch_row_reads_the_forwards_other_build():
    """The prepared folder is warmed at the first-call shape's batch; the second prepared row's
    batch must take the other build of the forward (the tile table) on an H100's 132 SMs, or the
    row would not show that warmup compiled it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "kernel_repos"))
    import importlib

    from flash_ref import load_flash_attn2

    name = load_flash_attn2().__name__
    sched, gf = (importlib.import_module(f"{name}.{m}") for m in ("_schedule", "_gluon_fwd"))
    s = phases.SHAPE
    preset = gf.call_choices(s["head_dim"], s["causal"], False) or {}
    tile_m = (preset.get("consumers") or gf.CONSUMERS.get(s["head_dim"], 2)) * gf.ROWS
    block_n = gf.call_tile(s["head_dim"], s["causal"], s["seq"], False)[0]
    n_m = -(-s["seq"] // tile_m)
    kinds = [sched.deal(batch * s["heads"], n_m, tile_m, block_n, s["seq"], s["seq"], s["causal"], 132)[0]
             for batch in (s["batch"], phases.OTHER_BATCH)]
    assert kinds == ["formula", "list"]
