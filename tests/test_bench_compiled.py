"""bench/compiled.py's check that a compiled step computes what the eager step computes, run on
the CPU (the kernels under TRITON_INTERPRET=1, torch.compile with its ``aot_eager`` backend)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package

import compiled  # noqa: E402
import harness  # noqa: E402


@pytest.fixture
def fa(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch._dynamo.reset()
    yield harness.kernels()["ours"]
    torch._dynamo.reset()


def _inputs():
    q, k, v = (torch.randn(2, 24, h, 32, dtype=torch.float16, requires_grad=True) for h in (4, 2, 2))
    return q, k, v, torch.randn_like(q)


def test_the_script_runs_its_rows_and_finds_the_compiled_numbers_equal(tmp_path):
    # --tiny: the GPU run's steps at a small shape on the CPU (figures meaningless)
    import json
    import subprocess

    done = subprocess.run([sys.executable, str(Path(compiled.__file__)), "--tiny", "--out", str(tmp_path)],
                          env=harness.child_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads((tmp_path / "compiled.json").read_text())["rows"]
    assert row["same"] is True
    for name in ("ours", "sdpa_cudnn", "ours_compiled", "sdpa_cudnn_compiled"):
        assert row[f"{name}_fwdbwd"] > 0, row


def test_the_check_sees_a_step_that_computes_something_else(fa):
    class Scaled:  # the kernel's function with its output scaled: not the eager numbers
        def flash_attn_func(self, *args, **kwargs):
            scale = 1.5 if torch.compiler.is_compiling() else 1.0
            return fa.flash_attn_func(*args, **kwargs) * scale

    assert compiled.same_numbers(Scaled(), *_inputs(), True, backend="aot_eager") is False
