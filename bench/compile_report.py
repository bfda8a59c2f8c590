"""Compile the flash-attn2 Triton kernels for a GPU target without a GPU, and report resources.

Uses Triton's bundled ptxas, so on a CPU-only machine it tells (at no device time) whether each
shipped config compiles for sm90/sm80, and how many registers, how much shared memory and how
many spill bytes it needs. Run: ``python bench/compile_report.py [90|80] [--all]``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel_repos" / "kernels-community"
                       / "flash-attn2" / "build" / "torch-universal"))
import flash_attn2._configs as C  # noqa: E402
import flash_attn2._triton_bwd as B  # noqa: E402
import flash_attn2._triton_fwd as F  # noqa: E402

PTR = {"Q", "K", "V", "Out", "Lse", "CuQ", "CuK", "SeqUsedK", "Alibi", "DO", "Delta", "DK", "DV", "DQ", "Mask"}
I32_PTR = {"CuQ", "CuK", "SeqUsedK"}
F32_PTR = {"Lse", "Alibi", "Delta"}
FLOATS = {"qk_scale", "softcap_scale", "softcap", "sm_scale", "dropout_p"}


def compile_one(fn, constexprs, cap, warps, stages, dtype="bf16"):
    sig = {}
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in PTR:
            sig[name] = "*i32" if name in I32_PTR else "*fp32" if name in F32_PTR else f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride_") and not name.endswith(("ab", "ah")):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs, attrs)
    t = time.time()
    k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=dict(num_warps=warps, num_stages=stages))
    dt = time.time() - t
    ptx = k.asm["ptx"]
    n_regs, spills = _resource_usage(k.asm["cubin"])
    wgmma = len(re.findall(r"wgmma\.mma_async", ptx))
    mma = len(re.findall(r"\bmma\.sync", ptx))
    return dict(shared=k.metadata.shared, regs=n_regs, stack=spills, wgmma=wgmma, mma=mma, compile_s=round(dt, 1))


def _resource_usage(cubin: bytes):
    """(registers, spill-store bytes) read off the cubin with the cuobjdump Triton ships."""
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else None), (int(stack.group(1)) if stack else None)


def _mode_flags(mode: str) -> dict:
    """The dK/dV kernel's constexprs for a config mode ("keys", "queries", "...-2pass")."""
    return dict(KEYS_AS_ROWS=mode.startswith("keys"), TWO_PASS=mode.endswith("2pass"))


FLAGS = dict(IS_VARLEN=False, HAS_SEQUSED=False, HAS_LEFT=False, HAS_SOFTCAP=False, HAS_ALIBI=False,
             HAS_DROPOUT=False, EVEN_D=True)


def main():
    cap = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    capt = (cap // 10, cap % 10)
    for d in (64, 128, 256):
        for causal in (False, True):
            bm, bn, w, s = C.pick("fwd", capt, d)
            ce = dict(FLAGS, HAS_RIGHT=causal, REVERSE=causal, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d)
            try:
                r = compile_one(F._fwd_kernel, ce, cap, w, s)
            except Exception as e:  # report and go on: the point is to see every config
                r = f"FAILED {type(e).__name__}: {str(e)[:200]}"
            print(f"fwd d={d} causal={causal} cfg={(bm, bn, w, s)}: {r}", flush=True)
            (bm, bn, w, s, mode), (bm2, bn2, w2, s2) = C.pick("bwd", capt, d)
            ce = dict(FLAGS, HAS_RIGHT=causal, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d, **_mode_flags(mode))
            try:
                r = compile_one(B._bwd_dkdv_kernel, ce, cap, w, s)
            except Exception as e:
                r = f"FAILED {type(e).__name__}: {str(e)[:200]}"
            print(f"dkdv d={d} causal={causal} cfg={(bm, bn, w, s, mode)}: {r}", flush=True)
            ce = dict(FLAGS, HAS_RIGHT=causal, REVERSE=causal, BLOCK_M=bm2, BLOCK_N=bn2, BLOCK_D=d)
            try:
                r = compile_one(B._bwd_dq_kernel, ce, cap, w2, s2)
            except Exception as e:
                r = f"FAILED {type(e).__name__}: {str(e)[:200]}"
            print(f"dq   d={d} causal={causal} cfg={(bm2, bn2, w2, s2)}: {r}", flush=True)
            if "--all" not in sys.argv:
                break


if __name__ == "__main__":
    main()


def sweep(kind: str, d: int, configs, cap: int = 90, causal: bool = False):
    """Resources of each candidate config for one kernel ("fwd", "dkdv", "dq") and head dim."""
    fn = {"fwd": F._fwd_kernel, "dkdv": B._bwd_dkdv_kernel, "dq": B._bwd_dq_kernel}[kind]
    rows = []
    for cfg in configs:
        bm, bn, w, s = cfg[:4]
        ce = dict(FLAGS, HAS_RIGHT=causal, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d)
        if kind == "dkdv":
            ce.update(_mode_flags(cfg[4]))
        else:
            ce["REVERSE"] = causal
        try:
            r = compile_one(fn, ce, cap, w, s)
        except Exception as e:
            r = f"FAILED {type(e).__name__}: {str(e)[:120]}"
        print(f"{kind} d={d} cfg={tuple(cfg)}: {r}", flush=True)
        rows.append((tuple(cfg), r))
    return rows
