"""The shipped kernels' sm90 machine code under several Triton releases, compiled without a GPU.

Why: the Gluon kernels run only under the Triton releases they were checked and timed on
(``_gluon_dispatch.MEASURED_TRITON``), while torch 2.12 and 2.13 require Triton 3.7, under which the
Triton kernels run instead. Each Python given (each with its own Triton) compiles, in a child
process, one compile at a time into an empty cache: the dense Gluon forward and the Gluon dK/dV/dQ
kernel at head_dim 64, 128 and 256, causal and not, and the Triton kernels of a forward and a
backward (the Triton backward) at head_dim 64 and 128, causal and not, as the package launches
them on an sm90 GPU (bf16, 16 heads, 4k tokens; launches recorded from its host code, as
``direct_launch_equivalence.py`` records them). The table sets each release's code beside the
first one's: instructions in the kernel, registers and stack a thread, compile seconds, and for
the Gluon forward its unmasked key loop per key block (instructions, exp2-unit exponentials,
register moves, byte permutes), the opcodes whose counts differ most, and whether the two
listings are identical::

    python bench/triton_releases.py PYTHON [PYTHON ...] [--out DIR] [--commit SHA]

Writes ``bench/results/triton_releases.md`` and ``.json``.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import harness

HEAD_DIMS = (64, 128, 256)  # the Gluon kernels'
TRITON_HEAD_DIMS = (64, 128)  # the Triton kernels'


def _opcode(line: str) -> str:
    words = line.split()
    return words[1] if words[0].startswith("@") else words[0]  # a predicated instruction: @P0 OP ...


def _row(triton_version: str, kernel: str, head_dim: int, causal: bool, seconds: float, cubin: bytes,
         step: Callable[[str], dict]) -> dict:
    listing = harness.sass(cubin, "-sass")
    lines = [re.sub(r"\s+", " ", m.group(1)).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", listing)]
    usage = re.search(r"REG:(\d+) STACK:(\d+)", harness.sass(cubin, "-res-usage"))
    return dict(triton=triton_version, kernel=kernel, head_dim=head_dim, causal=causal, compile_s=seconds,
                instructions=len(lines), registers=int(usage.group(1)), stack=int(usage.group(2)),
                step=step(listing), lines=lines)


def _timed(compile_one: Callable[[], Any]) -> tuple:
    """``compile_one()`` into an empty Triton cache: (compiled kernel, seconds)."""
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        start = time.perf_counter()
        compiled = compile_one()
        return compiled, time.perf_counter() - start


def _triton_launches(fa: Any) -> list:
    """(kernel name, head_dim, causal, launch) of the Triton forward and backward kernels, as the
    package's host code launches them on an sm90 GPU, recorded on CPU tensors (none runs)."""
    import importlib

    import pytest
    import torch

    sys.path[:0] = [str(harness.REPO_ROOT / "tests" / "kernel_repos"), str(harness.REPO_ROOT / "tests")]
    from launch_record import recording

    tf = importlib.import_module(fa.__name__ + "._triton_fwd")
    tb = importlib.import_module(fa.__name__ + "._triton_bwd")
    found = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(tb, "GLUON_BWD", False)  # the Triton backward's kernels
        for head_dim in TRITON_HEAD_DIMS:
            for causal in (False, True):
                q, k, v, do, out = (torch.empty(1, 4096, 16, head_dim, dtype=torch.bfloat16) for _ in range(5))
                with recording(fa, monkeypatch) as recorded:
                    tf.attention_forward(q, k, v, softmax_scale=0.1, causal=causal)
                    tb.attention_backward(do, q, k, v, out, torch.empty(1, 16, 4096), causal=causal,
                                          softmax_scale=0.1)
                seen = set()
                for launch in recorded:
                    if launch.grid is not None and launch.name not in seen:
                        seen.add(launch.name)
                        found.append((launch.name, head_dim, causal, launch))
    return found


def compile_all() -> list:
    """Every configuration compiled with this process's Triton: one dict each (the child's work)."""
    import importlib

    import triton
    from triton.runtime.cache import triton_key

    fa = harness.shipped_kernel()
    gf = importlib.import_module(fa.__name__ + "._gluon_fwd")
    gb = importlib.import_module(fa.__name__ + "._gluon_bwd")
    triton_key()  # Triton's hash of its own compiler, once, outside the timings
    rows = []
    for head_dim in HEAD_DIMS:
        for causal in (False, True):
            block_n = gf.TILES[head_dim][0]
            compiled, seconds = _timed(lambda: harness.compile_gluon_forward(gf, head_dim, causal))
            rows.append(_row(triton.__version__, "_gluon_attn_fwd", head_dim, causal, seconds, compiled.asm["cubin"],
                             lambda listing: harness.key_step(listing, head_dim, block_n)))
            compiled, seconds = _timed(lambda: harness.compile_gluon_backward(gb, head_dim, causal))
            rows.append(_row(triton.__version__, "_gluon_attn_bwd", head_dim, causal, seconds, compiled.asm["cubin"],
                             lambda listing: {}))
    for name, head_dim, causal, launch in _triton_launches(fa):
        (_, compiled), seconds = _timed(
            lambda: harness.compile_launch(launch.launcher, launch.args, launch.constexprs, launch.num_warps))
        rows.append(_row(triton.__version__, name, head_dim, causal, seconds, compiled.asm["cubin"], lambda listing: {}))
    return rows


def compare(base: dict, other: dict) -> dict:
    """One table row: ``other``'s figures, and how its listing differs from ``base``'s."""
    ours = collections.Counter(map(_opcode, other["lines"]))
    theirs = collections.Counter(map(_opcode, base["lines"]))
    moved = sorted(((op, ours[op] - theirs[op]) for op in ours | theirs if ours[op] != theirs[op]),
                   key=lambda item: (-abs(item[1]), item[0]))
    step = other["step"]
    return dict(triton=other["triton"], kernel=other["kernel"], head_dim=other["head_dim"],
                causal="yes" if other["causal"] else "no", compile_s=other["compile_s"],
                instructions=other["instructions"], registers=other["registers"], stack=other["stack"],
                step_instructions=step.get("instructions"), step_exp2=step.get("exp2_unit"),
                step_moves=step.get("moves"), step_permutes=step.get("permutes"),
                identical="yes" if other["lines"] == base["lines"] else "no",
                differences=", ".join(f"{op} {n:+d}" for op, n in moved[:6]) or "—")


def main() -> None:
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(compile_all()))
        return
    parser = harness.arguments(__doc__)
    parser.add_argument("pythons", nargs="+", help="Python interpreters, each with the Triton release to compile with")
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(harness.REPO_ROOT), TRITON_INTERPRET="0")
    releases = []
    for python in args.pythons:
        done = subprocess.run([python, __file__, "--child"], capture_output=True, text=True, env=env, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{python}: the compile failed:\n{done.stderr[-3000:]}")
        releases.append(json.loads(done.stdout.strip().splitlines()[-1]))
    def config(row: dict) -> tuple:
        return row["kernel"], row["head_dim"], row["causal"]

    first = {config(row): row for row in releases[0]}
    rows = [compare(first[config(row)], row) for run in releases for row in run if config(row) in first]
    path = harness.write_results(
        "triton_releases", rows, title="The shipped kernels' sm90 machine code under each Triton release (no GPU)",
        columns=dict(triton="Triton", kernel="kernel", head_dim="head_dim", causal="causal", compile_s="compile s",
                     instructions="instructions", registers="kernel registers", stack="stack B",
                     step_instructions="key step: instructions", step_exp2="key step: MUFU.EX2",
                     step_moves="key step: moves", step_permutes="key step: PRMT",
                     identical=f"identical to {releases[0][0]['triton']}",
                     differences=f"opcodes counted differently from {releases[0][0]['triton']}"),
        out_dir=args.out, commit=args.commit,
        notes=["Dense kernels, bf16, the package's shipped tiles and per-head-dim choices; the Triton kernels (_fwd_kernel, "
               "_delta_kernel, _bwd_*) as the package launches them for 16 heads and 4k tokens on sm90. 'key step': the "
               "Gluon forward's unmasked key loop per key block and per warp (harness.key_step). For the Gluon kernels "
               "'kernel registers' is the kernel's maxnreg (the warpgroups re-divide the file with setmaxnreg); a stack "
               "above 0 is a spill. "
               "Compile seconds: one compile at a time into an empty cache, on the machine named below."],
        extra={"listings_differ": {f"{r['triton']} {r['kernel']} d{r['head_dim']} causal={r['causal']}":
                                   r["identical"] == "no" for r in rows}})
    print(path.read_text())


if __name__ == "__main__":
    main()
