"""The Gluon forward's variants compiled for sm90 without a GPU: what each one's key step is made of
in machine code, and what it costs the first call to compile.

Each variant (the shipped kernel, and the per-head-dim choices of ``_gluon_fwd`` switched on one at
a time) is compiled into an empty Triton cache, Triton's compiler hash computed beforehand so the
seconds are the compile's own. From its SASS (``cuobjdump``): registers and stack a thread, and in
the consumers' unmasked key loop, per key block: instructions, exponentials on the exp2 unit
(MUFU.EX2), exponentials emulated on the FMA units (one FADD rounding down each), register moves
(MOV, IMAD.MOV) and byte permutes (PRMT). Counts are per warp, the same in every warp of a
consumer. Needs Triton with Gluon (the H200's is 3.6)::

    python bench/gluon_sass.py [--out DIR] [--commit SHA]

Writes ``bench/results/gluon_sass.md`` and ``.json``.
"""

from __future__ import annotations

import importlib
import os
import re
import tempfile
import time

import harness

# name -> (head_dim, causal, compile_gluon_forward keyword arguments)
VARIANTS = {
    "d64 shipped (three consumers, unpinned, PACK_P)": (64, False, {}),
    "d64 causal shipped": (64, True, {}),
    "d64 shipped + EXP2_POLY 1": (64, False, dict(EXP2_POLY=1)),
    "d64 two consumers, pinned wait": (64, False, dict(consumers=2, PIN_WAIT=True, PACK_P=False)),
    "d64 EXP2_POLY 1": (64, False, dict(consumers=2, PIN_WAIT=True, PACK_P=False, EXP2_POLY=1)),
    "d64 EXP2_POLY 2": (64, False, dict(consumers=2, PIN_WAIT=True, PACK_P=False, EXP2_POLY=2)),
    "d64 UNROLL2": (64, False, dict(consumers=2, PIN_WAIT=True, PACK_P=False, UNROLL2=True)),
    "d64 UNROLL2 + EXP2_POLY 1": (64, False, dict(consumers=2, PIN_WAIT=True, PACK_P=False, UNROLL2=True,
                                                  EXP2_POLY=1)),
    "d64 DEFERRED_STORE": (64, False, dict(consumers=2, PIN_WAIT=True, PACK_P=False, DEFERRED_STORE=True)),
    "d64 three consumers, pinned wait": (64, False, dict(consumers=3, PIN_WAIT=True)),
    "d64 three consumers, unpinned": (64, False, dict(consumers=3, PIN_WAIT=False, PACK_P=False)),
    "d64 three consumers, unpinned, PACK_P": (64, False, dict(consumers=3, PIN_WAIT=False, PACK_P=True)),
    "d64 unpinned": (64, False, dict(consumers=2, PIN_WAIT=False, PACK_P=False)),
    "d64 unpinned, PACK_P": (64, False, dict(consumers=2, PIN_WAIT=False, PACK_P=True)),
    "d64 unpinned, PACK_P, EXP2_POLY 1": (64, False, dict(consumers=2, PIN_WAIT=False, PACK_P=True, EXP2_POLY=1)),
    "d128 causal shipped": (128, True, {}),
    "d128 causal UNROLL2": (128, True, dict(UNROLL2=True)),
    "d128 causal PACK_P": (128, True, dict(PACK_P=True)),
    "d256 shipped": (256, False, {}),
    "d256 PACK_P": (256, False, dict(PACK_P=True)),
}


def main() -> None:
    args = harness.arguments(__doc__).parse_args()
    from triton.runtime.cache import triton_key

    gf = importlib.import_module(harness.shipped_kernel().__name__ + "._gluon_fwd")
    triton_key()  # Triton's hash of its own compiler, once, outside the timings
    rows = []
    for name, (head_dim, causal, kwargs) in VARIANTS.items():
        with tempfile.TemporaryDirectory() as cache:
            os.environ["TRITON_CACHE_DIR"] = cache
            start = time.perf_counter()
            compiled = harness.compile_gluon_forward(gf, head_dim, causal, **kwargs)
            seconds = time.perf_counter() - start
        usage = re.search(r"REG:(\d+) STACK:(\d+)", harness.sass(compiled.asm["cubin"], "-res-usage"))
        row = dict(variant=name, compile_s=seconds, registers=int(usage.group(1)), stack=int(usage.group(2)),
                   **harness.key_step(harness.sass(compiled.asm["cubin"], "-sass"), head_dim, gf.TILES[head_dim][0]))
        rows.append(row)
        print(row, flush=True)
    path = harness.write_results(
        "gluon_sass", rows, title="The Gluon forward's variants in sm90 machine code (compiled without a GPU)",
        columns=dict(variant="variant", compile_s="compile s", registers="kernel registers", stack="stack B",
                     instructions="instructions a key block", exp2_unit="MUFU.EX2 a block",
                     emulated="emulated exp2 a block", moves="register moves a block", permutes="PRMT a block",
                     blocks_a_trip="blocks a loop trip"),
        out_dir=args.out, commit=args.commit,
        notes=["Per warp, in the consumers' unmasked key loop (head_dim 64: 64 probabilities and 2 rescale "
               "factors a thread a block); non-causal unless named causal; 'kernel registers' is the kernel's "
               "maxnreg (the consumers take more through setmaxnreg); a stack above 0 is a spill. Compile "
               "seconds: one compile at a time into an empty cache, on the machine named below."])
    print(path.read_text())


if __name__ == "__main__":
    main()
