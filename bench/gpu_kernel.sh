#!/usr/bin/env bash
# The kernel's whole GPU check in one run: correctness (against float64 and a baseline copy of the
# package), flash-attention's own tests, the attention, packed-sequence and decode tables, and the first call with
# and without a prepared compile cache (and where its seconds go), a training step's attention under torch.compile
# with CUDA graphs, the host time per call, and a Llama-3-8B-shaped model end to end in transformers. Each script writes its <bench>.md and .json into OUT.
# STEPS picks a subset (default: all; the limits in seconds keep a run inside a time budget).
#
#   COMMIT=<sha> [STEPS="warm check launchcheck attention compiled varlen decode tests compile host e2e"] [TRITON_OVERLAY=DIR] [PACK=FILE] bench/gpu_kernel.sh OUT [BASELINE_REPO_DIR]
#
# launchcheck: the same check with every cached launch cross-checked against Triton's own choice of kernel
# and, for direct launches, Triton's own argument list (FLASH_ATTN2_LAUNCH_CHECK=1), the decode's kept
# launches (on by default; FLASH_ATTN2_KEEP_LAUNCHES=1 keeps them on here) and their keys compared, into OUT/launch_check.
# TRITON_OVERLAY=DIR: run every step under the Triton release unpacked in DIR (a folder holding `triton/`
# and its dist-info, put ahead of the installed one on PYTHONPATH), with the Gluon kernels allowed under
# it (FLASH_ATTN2_GLUON_TRITON): for checking and timing a release before it joins MEASURED_TRITON.
# variants / variants128 (not in the default list; each needs a call of its own: with 9 kernels at head_dim 64 the
# timing outlasted 4 min): bench/gluon_fwd.py timing the Gluon forward's off-by-default
# choices (deferred store, exp2 emulation, two key blocks a trip, three consumers, 64-key tiles, P converted in
# pairs) beside the shipped kernel, variants at head_dim 64 (OUT/variants_d64), variants128 at 128 and 256
# (OUT/variants_d128, OUT/variants_d256).
# decodesplit (not in the default list): bench/e2e_decode_split.py, a transformers decode step at the
# Llama-3-8B shape: the attention call's host time inside generate, ours beside sdpa, and the decode's
# slice choices (the capture query asked, one slice, kept launches).
# decodehost (not in the default list): bench/decode_host.py, the host time of that decode call taken apart
# (the capture query asked, the partials, the merge, one slice, Python alone) beside sdpa.
# decodepages (not in the default list, about 20 s): bench/decode_pages.py, the paged decode with its pages
# in random order, by runs of pages, and in memory order, beside the contiguous cache and cuDNN, back to back.
# decodetma (not in the default list, about 60 s): bench/decode_tma.py, a probe decode kernel copying K/V by TMA or by
# pointer loads, paged and contiguous, beside the shipped calls and cuDNN, back to back.
# decodetmancu (not in the default list; needs Nsight Compute, about 150 s): the same script's --ncu mode, the shipped
# call and the probe under the profiler at 32k keys. decodetmagraphs (not in the default list, about 40 s): its --graphs
# mode, each call a replayed CUDA graph of back-to-back calls.
# headpairs (not in the default list, about 120 s): bench/fwd_head_pairs.py, the Triton forward with two or four
# query heads of a GQA group in one program beside the one-head program and cuDNN (causal, head_dim 64 and 128).
# schedule (not in the default list, about 150 s): bench/fwd_schedule.py, the persistent Gluon forward with its tiles
# dealt by the host's table (_schedule) beside the formula's pairs in turn and cuDNN, checked bit for bit.
# bwdorder (not in the default list, about 150 s): bench/bwd_order.py, the Gluon backward's causal programs in three
# dispatch orders (head order; every head's lighter half last; the last heads key block by key block) beside cuDNN.
# power (not in the default list, about 150 s): bench/power_probe.py, the SM clock, power draw and TFLOP/s while
# our forward and cuDNN's run back to back in one-second turns, on every row of the attention table.
# ncu (not in the default list; needs Nsight Compute, about 150 s): bench/ncu_limits.py, the rows below target
# beside cuDNN's kernels under the profiler. ncusource (not in the default list either): bench/ncu_source.py,
# the head_dim 64 forward's stall samples per instruction beside cuDNN's.
# testswide (not in the default list, about 4 min): flash-attention's tests in 16 pairwise samples (--samples 16,
# 640 cases) instead of the tests step's one (45), into the same flash_attn_tests.md.
set -uo pipefail
OUT=$1
BASE=${2:-}
RES=$OUT
STEPS=${STEPS:-warm check launchcheck attention compiled varlen decode tests compile host e2e}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$(mktemp -d)
if [[ -n "${TRITON_OVERLAY:-}" ]]; then
    export PYTHONPATH=$TRITON_OVERLAY:$PWD
    FLASH_ATTN2_GLUON_TRITON=$(python3 -c 'import triton, re; print(re.match(r"\d+\.\d+", triton.__version__).group(0))') || exit 1
    export FLASH_ATTN2_GLUON_TRITON
    echo "=== Triton $(python3 -c 'import triton; print(triton.__version__, triton.__file__)'), Gluon allowed under $FLASH_ATTN2_GLUON_TRITON"
fi
want() { [[ " $STEPS " == *" $1 "* ]]; }
# PACK=FILE: after every step, the whole of OUT packed into FILE (a .tar.gz outside OUT), so that a
# run whose output is more files than come back, or one stopped mid-way, still returns every result
pack() { if [[ -n "${PACK:-}" ]]; then tar czf "$PACK" -C "$RES" . || echo "=== packing into $PACK failed"; fi; }
step() { local limit=$1; shift; echo "=== $* ($(date -u +%T))"; timeout "$limit" "$@" || echo "=== FAILED ($?): $*"; pack; }
# Compile every kernel the attention table needs in parallel first (both packages): the timing
# scripts then load them from the cache instead of compiling one at a time.
want warm && step 80 python3 bench/warm_cache.py ${BASE:+--baseline "$BASE"}
want check && step 240 python3 bench/check_gpu.py --out "$RES" --commit "${COMMIT:-unknown}" ${BASE:+--baseline "$BASE"}
want launchcheck && step 180 env FLASH_ATTN2_LAUNCH_CHECK=1 FLASH_ATTN2_KEEP_LAUNCHES=1 python3 bench/check_gpu.py --out "$RES/launch_check" --commit "${COMMIT:-unknown}"
want attention && step 280 python3 bench/attention.py --out "$RES" --commit "${COMMIT:-unknown}" ${BASE:+--baseline "$BASE"}
want compiled && step 300 python3 bench/compiled.py --out "$RES" --commit "${COMMIT:-unknown}"
want varlen && step 150 python3 bench/varlen.py --out "$RES" --commit "${COMMIT:-unknown}"
want decode && step 60 python3 bench/decode.py --out "$RES" --commit "${COMMIT:-unknown}" ${BASE:+--baseline "$BASE"}
want decode && step 90 python3 bench/decode_merge.py --out "$RES" --commit "${COMMIT:-unknown}"
want tests && step 100 python3 bench/flash_attn_tests.py --out "$RES" --commit "${COMMIT:-unknown}" --workers 12 --deadline 85
want testswide && step 300 python3 bench/flash_attn_tests.py --samples 16 --out "$RES" --commit "${COMMIT:-unknown}" --workers 14 --deadline 270
want compile && step 100 python3 bench/compile_report.py --out "$RES" --commit "${COMMIT:-unknown}" --phases
want host && step 90 python3 bench/host_overhead.py --out "$RES" --commit "${COMMIT:-unknown}" --profile --phases
want variants && step 540 python3 bench/gluon_fwd.py --kernels gluon,gluon_c2,gluon_poly1,gluon_ds,gluon_unpin_pk_p1 \
    --head-dims 64 --seqs 1024,4096,16384 --out "$RES/variants_d64" --commit "${COMMIT:-unknown}"
want variants128 && step 360 python3 bench/gluon_fwd.py --kernels gluon,gluon_ds,gluon_poly1,gluon_u2,gluon_pk \
    --head-dims 128 --seqs 1024,4096,16384 --out "$RES/variants_d128" --commit "${COMMIT:-unknown}"
want variants128 && step 180 python3 bench/gluon_fwd.py --kernels gluon,gluon_pk \
    --head-dims 256 --seqs 4096,16384 --out "$RES/variants_d256" --commit "${COMMIT:-unknown}"
want ncu && step 200 python3 bench/ncu_limits.py --out "$RES" --commit "${COMMIT:-unknown}"
want ncusource && step 200 python3 bench/ncu_source.py --out "$RES" --commit "${COMMIT:-unknown}"
want power && step 260 python3 bench/power_probe.py --out "$RES" --commit "${COMMIT:-unknown}"
want decodesplit && step 200 python3 bench/e2e_decode_split.py --out "$RES" --commit "${COMMIT:-unknown}"
want decodehost && step 60 python3 bench/decode_host.py --out "$RES" --commit "${COMMIT:-unknown}"
want decodepages && step 60 python3 bench/decode_pages.py --out "$RES" --commit "${COMMIT:-unknown}"
want decodetma && step 150 python3 bench/decode_tma.py --out "$RES" --commit "${COMMIT:-unknown}"
want decodetmagraphs && step 150 python3 bench/decode_tma.py --graphs --out "$RES" --commit "${COMMIT:-unknown}" ${BASE:+--baseline "$BASE"}
want decodetmancu && step 300 python3 bench/decode_tma.py --ncu --out "$RES" --commit "${COMMIT:-unknown}"
want bwdorder && step 300 python3 bench/bwd_order.py --out "$RES" --commit "${COMMIT:-unknown}"
want schedule && step 240 python3 bench/fwd_schedule.py --out "$RES" --commit "${COMMIT:-unknown}"
want headpairs && step 200 python3 bench/fwd_head_pairs.py --out "$RES" --commit "${COMMIT:-unknown}"
want e2e && step 200 python3 bench/e2e_transformers.py --shape llama-3-8b --out "$RES" --commit "${COMMIT:-unknown}"
echo "=== done $(date -u +%T)"
