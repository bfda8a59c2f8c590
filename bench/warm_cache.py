"""Compile every kernel the attention table needs into ``TRITON_CACHE_DIR`` before the timing
scripts run (in parallel processes, for the shipped package and an optional baseline copy), so
they load kernels instead of compiling them one at a time. Used by ``bench/gpu_kernel.sh``::

    TRITON_CACHE_DIR=/tmp/triton python bench/warm_cache.py [--baseline KERNEL_REPO_DIR] [--workers 12]

A script file, not a heredoc on stdin: the workers are spawned processes, which re-import the
main module from its file.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kernel_loader import warmup as w

# (head_dim, query heads, key/value heads, tokens): the rows of bench/attention.py
ATTENTION_ROWS = ((128, 16, 16, 1024), (128, 16, 16, 4096), (128, 16, 16, 16384),
                  (256, 16, 16, 4096), (64, 32, 8, 2048), (64, 16, 16, 4096))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=None, help="a kernel repo folder to warm as well")
    parser.add_argument("--workers", type=int, default=12)
    args = parser.parse_args()
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    shapes = [s for d, hq, hk, seq in ATTENTION_ROWS
              for s in w.plan([d], ["bfloat16"], [seq], [(hq, hk)], causal=(False, True))]
    failed = 0
    for load in [w.shipped_flash_attn2] + ([w.LocalKernel(args.baseline)] if args.baseline else []):
        bad = [r for r in w.warmup(load, cache, shapes, workers=args.workers) if r["error"]]
        failed += len(bad)
        print(load, len(shapes), "shapes,", len(bad), "failed", bad[:3], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
