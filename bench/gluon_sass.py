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
import subprocess
import tempfile
import time

import harness

# name -> (head_dim, causal, compile_gluon_forward keyword arguments)
VARIANTS = {
    "d64 shipped": (64, False, {}),
    "d64 EXP2_POLY 1": (64, False, dict(EXP2_POLY=1)),
    "d64 EXP2_POLY 2": (64, False, dict(EXP2_POLY=2)),
    "d64 UNROLL2": (64, False, dict(UNROLL2=True)),
    "d64 UNROLL2 + EXP2_POLY 1": (64, False, dict(UNROLL2=True, EXP2_POLY=1)),
    "d64 DEFERRED_STORE": (64, False, dict(DEFERRED_STORE=True)),
    "d64 three consumers, pinned wait": (64, False, dict(consumers=3, PIN_WAIT=True)),
    "d64 three consumers, unpinned": (64, False, dict(consumers=3, PIN_WAIT=False)),
    "d128 causal shipped": (128, True, {}),
    "d128 causal UNROLL2": (128, True, dict(UNROLL2=True)),
}


def _sass(cubin: bytes, *flags: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True, check=True).stdout


def key_step(sass: str, head_dim: int, block_n: int) -> dict:
    """Per key block of the first unmasked key loop in ``sass`` (the innermost loop that issues
    wgmma and exponentials and no compares of key positions): its counts (see the module
    docstring) divided by the blocks one trip handles (its wgmma over a block's head_dim/16 +
    block_n/16)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    per_block = head_dim // 16 + block_n // 16
    for at, text in ins:
        m = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", text)
        if not (m and int(m.group(1), 16) < at):
            continue
        body = [t.strip() for a, t in ins if int(m.group(1), 16) <= a <= at]
        wgmma = sum("HGMMA" in t for t in body)
        if not wgmma or wgmma % per_block or not any("MUFU.EX2" in t for t in body) or \
                any(t.split()[0].startswith("FSEL") for t in body) or wgmma > 2 * per_block:
            continue
        blocks = wgmma // per_block
        return dict(instructions=len(body) / blocks,
                    exp2_unit=sum("MUFU.EX2" in t for t in body) / blocks,
                    emulated=sum("FADD.FTZ.RM" in t for t in body) / blocks,
                    moves=sum(bool(re.search(r"\b(IMAD\.MOV\S*|MOV)\s+R", t)) for t in body) / blocks,
                    permutes=sum(t.split()[0].startswith("PRMT") for t in body) / blocks,
                    blocks_a_trip=blocks)
    return {}


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
        usage = re.search(r"REG:(\d+) STACK:(\d+)", _sass(compiled.asm["cubin"], "-res-usage"))
        row = dict(variant=name, compile_s=seconds, registers=int(usage.group(1)), stack=int(usage.group(2)),
                   **key_step(_sass(compiled.asm["cubin"], "-sass"), head_dim, gf.TILES[head_dim][0]))
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
