"""The decode kernel's key loop in SASS, per way of finding a paged cache's pages, compiled for
sm90 with this process's Triton (no GPU needed): how many instructions one block of keys costs
each program, beside the dense cache's loop. The tile is the shipped one-slice sm90 tile
(``_triton_decode.ONE_SPLIT_CONFIG_SM90``, what batch 32 x GQA 32/8 x head_dim 128 reads at 4k
and 32k), 256-key pages. ``--baseline DIR`` adds another copy of the kernel repo (a
``flash-attn2`` folder, e.g. an earlier commit's). Writes ``bench/results/decode_sass.md`` and ``.json``::

    python bench/decode_sass.py [--baseline OLD_KERNEL_REPO_DIR]

The loop is the longest backward branch of the kernel's SASS (``cuobjdump`` from Triton's own
CUDA tools); the decode kernel is bound by memory, so these counts say where its issue slots go,
not how fast it runs.
"""

from __future__ import annotations

import importlib

import harness

PAGE = 256
GROUP, HEAD_DIM = 4, 128
# way of finding pages -> the constexprs that choose it (PAGE_SIZE, PRELOAD, PAGE_BLOCKS)
MODES = {
    "dense cache": (0, 0, False),
    "preloaded entries, gathered a key (shipped at 4k)": (PAGE, 32, False),
    "preloaded entries, picked a block (PRELOADED_BLOCKS)": (PAGE, 32, True),
    "an entry loaded a block (shipped at 32k)": (PAGE, 0, True),
    "an entry looked up a key": (PAGE, 0, False),
}


def longest_loop(sass: str) -> list[str]:
    """The instructions of the longest loop in ``sass`` (``cuobjdump -sass`` text); empty when
    there is none. Raises nothing."""
    return max(harness.sass_loops(sass), key=len, default=[])


def compile_split_kernel(decode, mode: tuple) -> str:
    """SASS (``cuobjdump -sass``) of ``decode._split_kernel`` (a ``_triton_decode`` module) for
    one slice a row in the one-slice sm90 tile, paged as ``mode`` says (a MODES value). Raises
    what Triton or cuobjdump raise."""
    page_size, preload, page_blocks = mode
    block_n, warps, stages = decode.ONE_SPLIT_CONFIG_SM90[HEAD_DIM]
    consts = dict(GROUP=GROUP, BLOCK_M=16, BLOCK_N=block_n, BLOCK_D=HEAD_DIM, PAGE_SIZE=page_size,
                  PRELOAD=preload, PAGE_BLOCKS=page_blocks, NUM_SPLITS=1, HAS_LENS=True, HAS_BATCH_IDX=False,
                  HAS_LEFTPAD=False, HAS_ALIBI=False, HAS_SOFTCAP=False, HAS_WINDOW_LEFT=False,
                  HAS_WINDOW_RIGHT=False, FINAL=True, STORE_LSE=False, ALIGNED=True, MERGE=False,
                  MERGE_LSE=False, MERGE_CHUNK=1)
    absent = {"BATCH_IDX", "LEFTPAD", "ALIBI", "LSE", "COUNTERS", "O_FINAL", "LSE_FINAL"}
    if not page_size:
        absent.add("BLOCK_TABLE")
    compiled = harness.compile_triton_sm90(decode._split_kernel, consts, absent, warps, stages)
    return harness.sass(compiled.asm["cubin"], "-sass")


def rows_for(name: str, decode, modes: tuple = tuple(MODES)) -> list[dict]:
    """One row per mode (names of MODES, the dense cache first) for the package ``name``'s decode
    module. Raises what :func:`compile_split_kernel` raises."""
    rows = []
    for mode_name in modes:
        loop = longest_loop(compile_split_kernel(decode, MODES[mode_name]))
        rows.append(dict(package=name, mode=mode_name, loop=len(loop), copies=sum("LDGSTS" in ins for ins in loop)))
    for row in rows:
        row["vs_dense"] = row["loop"] / rows[0]["loop"]
    return rows


def main() -> None:
    parser = harness.arguments(__doc__, baseline=True)
    args = parser.parse_args()
    rows = []
    for name, fa in harness.kernels(args.baseline).items():
        rows += rows_for(name, importlib.import_module(fa.__name__ + "._triton_decode"))
        print(rows[-len(MODES):], flush=True)
    columns = dict(package="package", mode="pages found by", loop="loop instructions", vs_dense="÷ dense",
                   copies="K/V async copies")
    path = harness.write_results(
        "decode_sass", rows, title="Decode kernel's key loop in sm90 SASS, per way of finding pages",
        columns=columns, out_dir=args.out, commit=args.commit,
        notes=[f"One slice a row in the one-slice sm90 tile (ONE_SPLIT_CONFIG_SM90[{HEAD_DIM}]), GQA group {GROUP}, "
               f"bf16, {PAGE}-key pages; compiled offline with this Triton, counted in cuobjdump's listing: the longest "
               "loop's instructions and its K/V async copies (LDGSTS: one block of keys' K and V a trip). The "
               "kernel is bound by memory: these are issue slots, not time. 'baseline': the kernel repo folder given "
               "with --baseline."])
    print(path.read_text())


if __name__ == "__main__":
    main()
