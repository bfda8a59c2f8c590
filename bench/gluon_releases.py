"""The Gluon kernels' sm90 machine code under several Triton releases, compiled without a GPU.

Why: the Gluon kernels run only under the Triton releases they were checked and timed on
(``_gluon_dispatch.MEASURED_TRITON``), while torch 2.12 and 2.13 require Triton 3.7. Each Python
given (each with its own Triton) compiles the dense Gluon forward and the Gluon dK/dV/dQ kernel at
head_dim 64, 128 and 256, causal and not, in a child process, one compile at a time into an
empty cache. The table sets each release's code beside the first one's: instructions in the
kernel, registers and stack a thread, compile seconds, and for the forward its unmasked key loop
per key block (instructions, exp2-unit exponentials, register moves, byte permutes), the opcodes
whose counts differ most, and whether the two listings are identical::

    python bench/gluon_releases.py PYTHON [PYTHON ...] [--out DIR] [--commit SHA]

Writes ``bench/results/gluon_releases.md`` and ``.json``.
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

import harness

HEAD_DIMS = (64, 128, 256)
KINDS = ("forward", "backward")


def _opcode(line: str) -> str:
    words = line.split()
    return words[1] if words[0].startswith("@") else words[0]  # a predicated instruction: @P0 OP ...


def compile_all() -> list:
    """Every configuration compiled with this process's Triton: one dict each (the child's work)."""
    import importlib

    import triton
    from triton.runtime.cache import triton_key

    package = harness.shipped_kernel().__name__
    gf = importlib.import_module(package + "._gluon_fwd")
    gb = importlib.import_module(package + "._gluon_bwd")
    triton_key()  # Triton's hash of its own compiler, once, outside the timings
    rows = []
    for kind in KINDS:
        for head_dim in HEAD_DIMS:
            for causal in (False, True):
                with tempfile.TemporaryDirectory() as cache:
                    os.environ["TRITON_CACHE_DIR"] = cache
                    start = time.perf_counter()
                    compiled = (harness.compile_gluon_forward(gf, head_dim, causal) if kind == "forward"
                                else harness.compile_gluon_backward(gb, head_dim, causal))
                    seconds = time.perf_counter() - start
                listing = harness.sass(compiled.asm["cubin"], "-sass")
                lines = [re.sub(r"\s+", " ", m.group(1)).strip()
                         for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", listing)]
                usage = re.search(r"REG:(\d+) STACK:(\d+)", harness.sass(compiled.asm["cubin"], "-res-usage"))
                step = harness.key_step(listing, head_dim, gf.TILES[head_dim][0]) if kind == "forward" else {}
                rows.append(dict(triton=triton.__version__, kernel=kind, head_dim=head_dim, causal=causal,
                                 compile_s=seconds, instructions=len(lines), registers=int(usage.group(1)),
                                 stack=int(usage.group(2)), step=step, lines=lines))
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
    rows = [compare(base, other) for run in releases for base, other in zip(releases[0], run)]
    path = harness.write_results(
        "gluon_releases", rows, title="The Gluon kernels' sm90 machine code under each Triton release (no GPU)",
        columns=dict(triton="Triton", kernel="kernel", head_dim="head_dim", causal="causal", compile_s="compile s",
                     instructions="instructions", registers="kernel registers", stack="stack B",
                     step_instructions="key step: instructions", step_exp2="key step: MUFU.EX2",
                     step_moves="key step: moves", step_permutes="key step: PRMT",
                     identical=f"identical to {releases[0][0]['triton']}",
                     differences=f"opcodes counted differently from {releases[0][0]['triton']}"),
        out_dir=args.out, commit=args.commit,
        notes=["Dense kernels, bf16, the package's shipped tiles and per-head-dim choices. 'key step': the "
               "forward's unmasked key loop per key block and per warp (harness.key_step). 'kernel registers' is "
               "the kernel's maxnreg (the warpgroups re-divide the file with setmaxnreg); a stack above 0 is a spill. "
               "Compile seconds: one compile at a time into an empty cache, on the machine named below."],
        extra={"listings_differ": {f"{r['triton']} {r['kernel']} d{r['head_dim']} causal={r['causal']}":
                                   r["identical"] == "no" for r in rows}})
    print(path.read_text())


if __name__ == "__main__":
    main()
