"""bench/varlen.py's workload: seeded lengths that fill the token budget exactly, and FLOPs that
count real tokens only (the padded batch's extra work is not credited to SDPA)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package

import varlen  # noqa: E402


def test_lengths_fill_the_budget_within_their_range_and_repeat():
    lens = varlen.lengths()
    assert sum(lens) == varlen.TOKENS
    assert all(1 <= n <= 4096 for n in lens) and all(n >= 128 for n in lens[:-1])
    assert len(set(lens)) > 1  # ragged, or the padded batch would cost SDPA nothing
    assert varlen.lengths() == lens and varlen.lengths(seed=1) != lens


def test_flops_count_each_sequence_alone_and_halve_when_causal():
    assert varlen.real_flops([2, 3], heads=1, dim=1, causal=False) == 4 * (4 + 9)
    assert varlen.real_flops([2, 3], heads=2, dim=8, causal=True) == 4 * 2 * 8 * 13 / 2


def test_the_gluon_column_covers_the_head_dims_the_dispatch_keeps_on_triton():
    # the packed forward goes to the Gluon kernel at the head dims of MEASURED_FASTER_VARLEN; the
    # bench times the Gluon forward beside the dispatched one at every other head dim it runs
    import importlib.util

    path = (Path(__file__).resolve().parent.parent / "kernel_repos/kernels-community/flash-attn2/build/torch-universal"
            / "flash_attn2/_gluon_dispatch.py")
    spec = importlib.util.spec_from_file_location("_dispatch_for_varlen_bench", path)
    dispatch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dispatch)  # plain Python: imports neither Triton nor the package
    assert set(varlen.GLUON_VARLEN_DIMS) == {d for d, _ in dispatch.MEASURED_FASTER_VARLEN}
    assert set(varlen.GLUON_VARLEN_DIMS) < set(varlen.HEAD_DIMS)
