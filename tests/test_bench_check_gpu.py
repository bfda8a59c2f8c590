"""bench/check_gpu.py's comparison of compiled calls with eager ones, run on the CPU (the kernels
under TRITON_INTERPRET=1, fp16): every row is produced and passes, so the GPU run's rows mean
what they say."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package

import check_gpu  # noqa: E402
import harness  # noqa: E402


def test_compiled_calls_equal_the_eager_ones(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = check_gpu.check_compiled(harness.kernels()["ours"], device="cpu", dtype=torch.float16, small=True)
    assert [r["case"] for r in rows] == ["compiled-varlen-causal-train", "compiled-prefill-gqa",
                                         "compiled-decode-paged-append"]
    assert all(r["passed"] and r["max_abs_diff_vs_eager"] == 0.0 for r in rows), rows


def test_the_heads_first_decode_check_runs_every_step_and_layer_and_passes(monkeypatch):
    """transformers' decode layout, a cache growing a token a step, a misaligned q among the
    layers: every output within the tolerance of float64 (no launch is kept off a GPU)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    row = check_gpu.check_decode_heads_first(harness.kernels()["ours"], device="cpu", dtype=torch.float16,
                                             small=True)
    assert row["case"] == "decode-heads-first-gqa" and row["passed"], row
    assert 0 < row["worst_rel_err"] < check_gpu.TOL and row["kept_launches"] == 0
