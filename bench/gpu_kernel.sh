#!/usr/bin/env bash
# The kernel's whole GPU check in one run: correctness (against float64 and a baseline copy of the
# package), flash-attention's own tests, the attention and decode tables, and the first call with
# and without a prepared compile cache. Each script writes its <bench>.md and .json into OUT.
# STEPS picks a subset (default: all; the limits in seconds keep a run inside a time budget).
#
#   COMMIT=<sha> [STEPS="warm check attention decode tests compile"] bench/gpu_kernel.sh OUT [BASELINE_REPO_DIR]
set -uo pipefail
OUT=$1
BASE=${2:-}
RES=$OUT
STEPS=${STEPS:-warm check attention decode tests compile}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$(mktemp -d)
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() { local limit=$1; shift; echo "=== $* ($(date -u +%T))"; timeout "$limit" "$@" || echo "=== FAILED ($?): $*"; }
# Compile every kernel the attention table needs in parallel first (both packages): the timing
# scripts then load them from the cache instead of compiling one at a time.
want warm && step 80 python3 - "$BASE" <<'PY'
import sys
from kernel_loader import warmup as w
shapes = [s for d, hq, hk, seq in ((128, 16, 16, 1024), (128, 16, 16, 4096), (128, 16, 16, 16384),
          (256, 16, 16, 4096), (64, 32, 8, 2048), (64, 16, 16, 4096))
          for s in w.plan([d], ["bfloat16"], [seq], [(hq, hk)], causal=(False, True))]
for load in [w.shipped_flash_attn2] + ([w.LocalKernel(sys.argv[1])] if sys.argv[1] else []):
    bad = [r for r in w.warmup(load, w.Path(__import__("os").environ["TRITON_CACHE_DIR"]), shapes, workers=12) if r["error"]]
    print(load, len(shapes), "shapes,", len(bad), "failed", bad[:3])
PY
want check && step 50 python3 bench/check_gpu.py --out "$RES" --commit "${COMMIT:-unknown}" ${BASE:+--baseline "$BASE"}
want attention && step 130 python3 bench/attention.py --out "$RES" --commit "${COMMIT:-unknown}" ${BASE:+--baseline "$BASE"}
want decode && step 30 python3 bench/decode.py --out "$RES" --commit "${COMMIT:-unknown}" ${BASE:+--baseline "$BASE"}
want tests && step 100 python3 bench/flash_attn_tests.py --out "$RES" --commit "${COMMIT:-unknown}" --workers 12
want compile && step 90 python3 bench/compile_report.py --out "$RES" --commit "${COMMIT:-unknown}"
echo "=== done $(date -u +%T)"
