"""Offline check that a change to the kernels keeps their code: compile two copies of the package
for sm90 (no GPU needed) and compare the PTX of 14 Triton kernel configurations and, where both
copies ship it and this Triton has Gluon, 4 of the dense Gluon forward's, debug info dropped.

    python bench/ptx_equivalence.py OLD_PACKAGE_DIR NEW_PACKAGE_DIR OUT_DIR [config ...]

A package dir is the folder holding ``__init__.py`` (``.../build/torch-universal/flash_attn2``).
Prints per configuration: identical, same instruction multiset (order or register numbers
differ), or the instruction counts that differ.
"""
import importlib
import importlib.util
import re
import sys
from collections import Counter
from pathlib import Path

import harness


def load(pkg_dir: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return tuple(importlib.import_module(f"{name}.{m}") for m in ("_triton_fwd", "_triton_bwd", "_triton_decode"))


def compile_one(fn, consts, none_ptrs, num_warps, num_stages, o_f32=False):
    c = harness.compile_triton_sm90(fn, consts, none_ptrs, num_warps, num_stages, o_f32)
    return _ptx_lines(c.asm["ptx"]), c.metadata.n_regs if hasattr(c.metadata, "n_regs") else None


def _ptx_lines(ptx: str) -> list:
    """The PTX's instruction lines, debug sections, locations and label names dropped."""
    lines = []
    skip = False
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".section") and "debug" in s:
            skip = True
        if skip:
            if s == "}":
                skip = False
            continue
        if s.startswith((".loc", ".file", "//", "$L__")) or not s:
            continue
        lines.append(re.sub(r"\$L__\w+", "L", s))
    return lines


def gluon_configurations(name: str) -> dict:
    """The dense Gluon forward at head_dim 64 / 128 / 256, causal and not: name -> (module, head_dim,
    causal); empty when the package or this Triton lacks it."""
    try:
        gf = importlib.import_module(f"{name}._gluon_fwd")
    except ImportError:
        return {}
    return {f"gluon_fwd_d{d}{'_causal' if causal else ''}": (gf, d, causal) for d in (64, 128, 256) for causal in (False, True)}


def compile_gluon(gf, head_dim: int, causal: bool) -> list:
    """PTX lines of the dense Gluon forward for sm90 (harness.compile_gluon_forward)."""
    return _ptx_lines(harness.compile_gluon_forward(gf, head_dim, causal).asm["ptx"])



def configurations(F, B, D) -> dict:
    fwd_base = dict(IS_VARLEN=False, HAS_SEQUSED=False, HAS_LEFT=False, HAS_RIGHT=False, HAS_SOFTCAP=False, HAS_ALIBI=False,
                    HAS_DROPOUT=False, EVEN_D=True, EVEN_N=True, MERGE_DIAG=False, ORDER=0, STORE_LSE=True,
                    BLOCK_M=128, BLOCK_N=64, BLOCK_D=128)
    if "WIDE" in F._fwd_kernel.arg_names:  # 64-bit row offsets (newer packages): the default is off
        fwd_base["WIDE"] = False
    if "HEADS" in F._fwd_kernel.arg_names:  # query heads a program (newer packages): the default is one
        fwd_base["HEADS"] = 1
    cases = {
        "fwd_d128": (F._fwd_kernel, fwd_base, {"CuQ", "CuK", "SeqUsedK", "Alibi"}, 8, 3),
        "fwd_d128_causal_merge": (F._fwd_kernel, {**fwd_base, "HAS_RIGHT": True, "MERGE_DIAG": True, "ORDER": 1, "BLOCK_M": 64, "STORE_LSE": False}, {"CuQ", "CuK", "SeqUsedK", "Alibi"}, 4, 3),
        "fwd_d64_causal_heavy": (F._fwd_kernel, {**fwd_base, "HAS_RIGHT": True, "MERGE_DIAG": False, "ORDER": 2, "BLOCK_D": 64, "BLOCK_M": 64}, {"CuQ", "CuK", "SeqUsedK", "Alibi"}, 4, 3),
        "fwd_varlen_all": (F._fwd_kernel, {**fwd_base, "IS_VARLEN": True, "HAS_LEFT": True, "HAS_RIGHT": True, "HAS_SOFTCAP": True, "HAS_ALIBI": True, "HAS_DROPOUT": True, "EVEN_D": False, "EVEN_N": False, "BLOCK_D": 64}, {"SeqUsedK"}, 4, 2),
        "fwd_seqused": (F._fwd_kernel, {**fwd_base, "HAS_SEQUSED": True, "EVEN_N": False}, {"CuQ", "CuK", "Alibi"}, 8, 3),
    }
    bwd_base = dict(IS_VARLEN=False, HAS_SEQUSED=False, HAS_LEFT=False, HAS_RIGHT=False, HAS_SOFTCAP=False, HAS_ALIBI=False,
                    HAS_DROPOUT=False, EVEN_D=True)
    if "WIDE" in B._bwd_dq_kernel.arg_names:
        bwd_base["WIDE"] = False
    cases.update({
        "dkdv_d128_keys": (B._bwd_dkdv_kernel, {**bwd_base, "HAS_RIGHT": True, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_D": 128, "KEYS_AS_ROWS": True, "TWO_PASS": False}, {"CuQ", "CuK", "SeqUsedK", "Alibi"}, 8, 3),
        "dkdv_d256_2pass": (B._bwd_dkdv_kernel, {**bwd_base, "BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_D": 256, "KEYS_AS_ROWS": True, "TWO_PASS": True}, {"CuQ", "CuK", "SeqUsedK", "Alibi"}, 8, 2),
        "dkdv_varlen_queries_all": (B._bwd_dkdv_kernel, {**bwd_base, "IS_VARLEN": True, "HAS_LEFT": True, "HAS_RIGHT": True, "HAS_SOFTCAP": True, "HAS_ALIBI": True, "HAS_DROPOUT": True, "EVEN_D": False, "BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_D": 64, "KEYS_AS_ROWS": False, "TWO_PASS": False}, {"SeqUsedK"}, 4, 2),
        "dq_d128": (B._bwd_dq_kernel, {**bwd_base, "HAS_RIGHT": True, "REVERSE": True, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 128}, {"CuQ", "CuK", "SeqUsedK", "Alibi"}, 8, 3),
        "dq_varlen_all": (B._bwd_dq_kernel, {**bwd_base, "IS_VARLEN": True, "HAS_LEFT": True, "HAS_RIGHT": True, "HAS_SOFTCAP": True, "HAS_ALIBI": True, "HAS_DROPOUT": True, "EVEN_D": False, "REVERSE": False, "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_D": 64}, {"SeqUsedK"}, 4, 2),
        "delta": (B._delta_kernel, {"IS_VARLEN": True, "BLOCK_M": 64, "BLOCK_D": 128}, set(), 4, 3),
    })
    if "ZERO_DQA" in B._delta_kernel.arg_names:  # the delta kernel zeroes a dense fused-dQ buffer (newer packages): off
        fn, consts, nones, w, st = cases["delta"]
        cases["delta"] = (fn, {**consts, "ZERO_DQA": False}, nones | {"DQA"}, w, st)
    if "DQ_MODE" in B._bwd_dkdv_kernel.arg_names:  # dQ inside dK/dV (newer packages): the default is off
        for name in [n for n in cases if n.startswith("dkdv")]:
            fn, consts, nones, w, st = cases[name]
            cases[name] = (fn, {**consts, "DQ_MODE": 0}, nones | {"DQA"}, w, st)
    dec_base = dict(GROUP=4, BLOCK_M=16, BLOCK_N=64, BLOCK_D=128, PAGE_SIZE=256, NUM_SPLITS=4, HAS_LENS=True, HAS_BATCH_IDX=False,
                    HAS_LEFTPAD=False, HAS_ALIBI=False, HAS_SOFTCAP=False, HAS_WINDOW_LEFT=False, HAS_WINDOW_RIGHT=False,
                    FINAL=False, STORE_LSE=True, ALIGNED=True)
    preload = "PRELOAD" in D._split_kernel.arg_names  # block-table entries in registers (newer packages)
    if preload:
        dec_base["PRELOAD"] = 0
    if "PAGE_BLOCKS" in D._split_kernel.arg_names:  # a table entry a block of keys (newer packages): off
        dec_base["PAGE_BLOCKS"] = False
    # the last slice merging the others in the same launch (newer packages): off here, as in a
    # one-split call; the merging build is its own configuration
    merge = "MERGE" in D._split_kernel.arg_names
    no_merge = {"COUNTERS", "O_FINAL", "LSE_FINAL"} if merge else set()
    if merge:
        dec_base.update(MERGE=False, MERGE_LSE=False, MERGE_CHUNK=1)
    cases.update({
        "split_paged": (D._split_kernel, dec_base, {"BATCH_IDX", "LEFTPAD", "ALIBI"} | no_merge, 4, 4),
        "split_paged_preload": (D._split_kernel, {**dec_base, **({"PRELOAD": 16} if preload else {})},
                                {"BATCH_IDX", "LEFTPAD", "ALIBI"} | no_merge, 4, 4),
        "split_dense_all": (D._split_kernel, {**dec_base, "PAGE_SIZE": 0, "HAS_BATCH_IDX": True, "HAS_LEFTPAD": True, "HAS_ALIBI": True, "HAS_SOFTCAP": True, "HAS_WINDOW_LEFT": True, "HAS_WINDOW_RIGHT": True, "FINAL": True}, {"BLOCK_TABLE"} | no_merge, 4, 4),
    })
    if merge:
        cases["split_paged_merge"] = (D._split_kernel, {**dec_base, "MERGE": True, "MERGE_LSE": True, "MERGE_CHUNK": 4},
                                      {"BATCH_IDX", "LEFTPAD", "ALIBI"}, 4, 4)
    return cases


def histogram(lines) -> Counter:
    return Counter(line.split()[0] for line in lines if not line.startswith("@"))


def main() -> None:
    old_dir, new_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    only = set(sys.argv[4:])
    out_dir.mkdir(parents=True, exist_ok=True)
    old, new = configurations(*load(old_dir, "fa_old")), configurations(*load(new_dir, "fa_new"))
    old_g, new_g = gluon_configurations("fa_old"), gluon_configurations("fa_new")
    for name in [*old, *(n for n in old_g if n in new_g)]:
        if only and name not in only:
            continue
        texts = []
        for label, cases, gluon in (("old", old, old_g), ("new", new, new_g)):
            if name in gluon:
                lines = compile_gluon(*gluon[name])
            else:
                fn, consts, nones, w, st = cases[name]
                o_f32 = fn.__name__ == "_split_kernel" and not consts.get("FINAL")
                lines = compile_one(fn, consts, nones, w, st, o_f32)[0]
            (out_dir / f"{name}.{label}.ptx").write_text("\n".join(lines) + "\n")
            texts.append(lines)
        if texts[0] == texts[1]:
            print(f"{name}: identical", flush=True)
        elif histogram(texts[0]) == histogram(texts[1]):
            print(f"{name}: same instruction multiset", flush=True)
        else:
            h0, h1 = histogram(texts[0]), histogram(texts[1])
            print(f"{name}: DIFFERENT", {k: (h0[k], h1[k]) for k in set(h0) | set(h1) if h0[k] != h1[k]}, flush=True)


if __name__ == "__main__":
    main()
