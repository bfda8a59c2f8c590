"""Causal forward: the cost of the masked diagonal blocks, before and after making them cheaper.

    git show REV:kernel_repos/kernels-community/flash-attn2/build/torch-universal/flash_attn2/_triton_fwd.py > bench/_baseline_fwd.py
    PYTHONPATH=. python3 bench/prefill_mask.py OUT_DIR --baseline=bench/_baseline_fwd.py

Why: bench/prefill_persist.py (2026-11-30) timed a copy of our causal loop with the diagonal
blocks computed unmasked: 4 % faster at 8 x 2048 and 8 % at 16 x 1024 (d=64, GQA 32/8). The
masked step paid for a separate scale multiply, a subtraction instead of a fused multiply-add,
and a second compare per score for the end of the sequence, which is redundant when the key
length is a multiple of the key block. The kernel now masks the raw scores with one compare and
one select (EVEN_N drops the end test); ``MERGE_DIAG`` additionally runs the bulk and the
diagonal blocks in one loop so the software pipeline does not drain at the diagonal.

Contenders, interleaved (11 rounds, rotating order, medians of 10 launches): the baseline module
(the kernel before the change, loaded from ``--baseline``), the current kernel with split and
with merged loops, and SDPA (cuDNN) where it has the same mask. Every contender's output is
compared with an fp64 reference at the shorter shapes. Writes OUT_DIR/prefill-mask.json.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import median_high

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attention as A  # noqa: E402

# (batch, seq, heads_q, heads_k, head_dim, causal, window_left)
SHAPES = [
    (8, 2048, 32, 8, 64, True, -1),     # the 1.24B Llama's prefill (bench/e2e_transformers.py)
    (16, 1024, 32, 8, 64, True, -1),
    (2, 8192, 32, 8, 64, True, -1),
    (1, 16384, 32, 8, 64, True, -1),
    (8, 2000, 32, 8, 64, True, -1),     # keys not a multiple of the block: EVEN_N off
    (8, 2048, 32, 8, 128, True, -1),
    (2, 8192, 32, 8, 64, True, 1024),   # sliding window: masked blocks at both edges
    (8, 2048, 32, 8, 64, False, -1),    # control: no diagonal
]
# --shapes=short: d=64 causal GQA rows from 1k to 8k tokens per sequence, for --configs sweeps
SHORT_SHAPES = [(16, 1024, 32, 8, 64, True, -1), (11, 1536, 32, 8, 64, True, -1),
                (8, 2048, 32, 8, 64, True, -1), (4, 4096, 32, 8, 64, True, -1),
                (2, 8192, 32, 8, 64, True, -1)]


def _option(name: str, default: str) -> str:
    for a in sys.argv[2:]:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return default


# --shapes=decide: what the shipped choice of tile and loop form rests on (d=64 and d=128)
DECIDE_SHAPES = [(16, 1024, 32, 8, 64, True, -1), (8, 2048, 32, 8, 64, True, -1),
                 (4, 4096, 32, 8, 64, True, -1), (2, 8192, 32, 8, 64, True, -1),
                 (1, 16384, 32, 8, 64, True, -1), (8, 2048, 32, 8, 64, False, -1),
                 (2, 8192, 32, 8, 64, False, -1), (2, 8192, 32, 8, 64, True, 1024),
                 (8, 2000, 32, 8, 64, True, -1),
                 (8, 2048, 32, 8, 128, True, -1), (4, 4096, 32, 8, 128, True, -1),
                 (1, 16384, 32, 8, 128, True, -1), (8, 2048, 32, 8, 128, False, -1)]
# --shapes=final: the shipped rule against the kernel before it, MHA (16 heads, as in
# bench/attention.py's table) and GQA rows, causal and not; only shipped / baseline / sdpa
FINAL_SHAPES = [(16, 1024, 16, 16, 64, True, -1), (4, 4096, 16, 16, 64, False, -1),
                (1, 16384, 16, 16, 64, False, -1), (16, 1024, 16, 16, 128, True, -1),
                (4, 4096, 16, 16, 128, True, -1), (1, 16384, 16, 16, 128, True, -1),
                (1, 16384, 16, 16, 128, False, -1), (8, 2048, 32, 8, 64, True, -1),
                (4, 4096, 32, 8, 128, True, -1)]
SHAPE_SET = _option("shapes", "all")
# --configs=BMxBNxWxS,...: tile configs timed with split and merged loops beside the shipped one
CONFIGS = [tuple(int(v) for v in c.split("x")) for c in _option("configs", "").split(",") if c]


# the tile shipped before 64 x 64 (the "split loops" / "merged loop" contenders use it)
BASE_CONFIG = {64: (128, 64, 8, 3), 128: (128, 64, 8, 3)}


def load_baseline(path: Path):
    """The package with its forward module replaced by ``path``, imported under a private name."""
    tmp = Path(tempfile.mkdtemp(prefix="fa2_baseline_"))
    pkg_dir = tmp / "flash_attn2"
    shutil.copytree(A.PACKAGE_DIR, pkg_dir, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(path, pkg_dir / "_triton_fwd.py")
    pkg = A.load_package(pkg_dir, "_bench_baseline_flash_attn2")
    return importlib.import_module(pkg.__name__ + "._triton_fwd")


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    fwd = A.forward_module()
    base_path = _option("baseline", "")
    base = load_baseline(Path(base_path)) if base_path else None
    import triton

    result = {
        "date": datetime.date.today().isoformat(),
        "command": "PYTHONPATH=. python3 bench/prefill_mask.py $OUT " + " ".join(sys.argv[2:]),
        "commit": os.environ.get("BENCH_COMMIT", "unknown"),
        "baseline": os.environ.get("BENCH_BASELINE", base_path),
        "environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "triton": triton.__version__, "cuda": torch.version.cuda},
        "rows": [],
    }
    t0 = time.time()
    for b, s, hq, hk, d, causal, left in {"short": SHORT_SHAPES, "decide": DECIDE_SHAPES, "final": FINAL_SHAPES}.get(SHAPE_SET, SHAPES):
        torch.manual_seed(0)
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
        window = (left, 0 if causal else -1)
        scale = d ** -0.5

        def ours(module, merge=None, cfg=None):
            extra = {} if module is base else {"merge_diag": merge}
            return lambda: module.attention_forward(q, k, v, softmax_scale=scale, causal=causal,
                                                    window_size=window, store_lse=False, config=cfg,
                                                    **extra)[0]

        contenders = {}
        if base is not None:
            contenders["baseline"] = ours(base)
        contenders["shipped"] = ours(fwd)
        if SHAPE_SET != "final":
            contenders["split loops"] = ours(fwd, False, BASE_CONFIG[d])
            contenders["merged loop"] = ours(fwd, True, BASE_CONFIG[d])
        for cfg in CONFIGS:
            tag = "x".join(map(str, cfg))
            contenders[f"split {tag}"] = ours(fwd, False, cfg)
            contenders[f"merged {tag}"] = ours(fwd, True, cfg)
        if left < 0:
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            contenders["sdpa"] = lambda: F.scaled_dot_product_attention(
                qt, kt, vt, is_causal=causal, scale=scale, enable_gqa=True).transpose(1, 2)
        ref = A.reference_bshd(q, k, v, causal, left).float() if b * s <= 16384 and s <= 2048 else None
        maxabs = {}
        for name, fn in contenders.items():
            o = fn()
            torch.cuda.synchronize()
            if ref is not None:
                maxabs[name] = float((o.float() - ref).abs().max())
        for fn in contenders.values():  # warm-up
            fn()
        torch.cuda.synchronize()
        names = list(contenders)
        samples = A.interleaved_us(contenders)
        us = {n: median_high(v) for n, v in samples.items()}
        ref_name = "sdpa" if "sdpa" in us else names[0]
        row = {"shape": {"batch": b, "seq": s, "heads": f"{hq}/{hk}", "head_dim": d, "causal": causal,
                         "window_left": left},
               "us": {n: round(t, 1) for n, t in us.items()},
               f"vs_{ref_name}": {n: round(us[ref_name] / t, 3) for n, t in us.items()},
               "maxabs_vs_fp64": maxabs,
               "samples_us": {n: [round(x, 1) for x in v] for n, v in samples.items()}}
        result["rows"].append(row)
        print(f"[{time.time() - t0:5.1f}s] {b}x{s} {hq}/{hk} d={d} causal={causal} left={left}: "
              + "  ".join(f"{n} {t:.1f}us ({us[ref_name] / t:.3f}x {ref_name})"
                          + (f" err {maxabs[n]:.1e}" if n in maxabs else "")
                          for n, t in us.items()), flush=True)
        (out_dir / "prefill-mask.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
