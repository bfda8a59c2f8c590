"""`kernel-loader warmup`: the shapes it plans, its argument errors, and what it says without a GPU.

Compiling itself needs a GPU (bench/compile_report.py measures it there: first call with and
without a prepared folder)."""

from __future__ import annotations

import os

import pytest

from kernel_loader import warmup
from kernel_loader.cli import main


def test_plan_crosses_every_setting_and_adds_paged_and_contiguous_decode():
    shapes = warmup.plan([64, 128], ["bfloat16"], [1024, 4096], [(32, 8)], causal=(False, True),
                         decode_contexts=[4096], decode_batch=8)
    prefill = [s for s in shapes if not s.decode]
    decode = [s for s in shapes if s.decode]
    assert len(prefill) == 2 * 2 * 2 and all(s.backward for s in prefill)
    assert {(s.head_dim, s.seqlen, s.causal) for s in prefill} == {
        (d, n, c) for d in (64, 128) for n in (1024, 4096) for c in (False, True)}
    assert sorted((s.head_dim, s.paged) for s in decode) == [(64, False), (64, True), (128, False), (128, True)]
    assert all(s.batch == 8 and not s.backward for s in decode)


@pytest.mark.parametrize("kwargs, words", [
    (dict(dtypes=["float32"]), "float32"),
    (dict(head_dims=[320]), "head dim 320"),
    (dict(heads=[(32, 6)]), "multiple of key/value heads 6"),
])
def test_plan_refuses_what_the_kernels_do_not_run(kwargs, words):
    args = dict(head_dims=[128], dtypes=["bfloat16"], seqlens=[4096], heads=[(32, 8)])
    args.update(kwargs)
    with pytest.raises(warmup.WarmupError, match=words):
        warmup.plan(**args)


def test_heads_are_written_hq_over_hk():
    assert warmup.parse_heads("32/8") == (32, 8)
    assert warmup.parse_heads("16") == (16, 16)
    with pytest.raises(warmup.WarmupError, match="HQ/HK"):
        warmup.parse_heads("many")


def test_the_verb_without_a_gpu_says_where_to_run_it(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the verb would compile")
    code = main(["warmup", "--into", str(tmp_path / "triton-cache"), "--head-dims", "64", "--seqlens", "256"])
    assert code != 0
    assert "sees no CUDA GPU" in capsys.readouterr().err


def test_the_documented_warmup_commands_run(tmp_path, monkeypatch, capsys):
    """The console block of docs/performance.md, run as written (in a temp folder for the cache):
    with a GPU it compiles, without one it stops at the GPU check (so every flag in it parsed)."""
    import shlex
    from pathlib import Path

    torch = pytest.importorskip("torch")
    page = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    block = page.split("<!-- run-by: tests/test_warmup.py::test_the_documented_warmup_commands_run -->")[1]
    lines = [ln[2:] for ln in block.split("```")[1].splitlines() if ln.startswith("$ ")]
    assert lines and all(ln.startswith("kernel-loader warmup ") for ln in lines)
    for line in lines:
        argv = shlex.split(line.replace("/shared/triton-cache", str(tmp_path / "triton-cache")))[1:]
        code = main(argv)
        if torch.cuda.is_available():
            assert code == 0
        else:
            assert code != 0 and "sees no CUDA GPU" in capsys.readouterr().err


def test_shapes_come_from_the_project_beside_the_lock_and_flags_win(tmp_path, monkeypatch):
    (tmp_path / "kernels.lock").write_text("[]")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.kernel-loader.warmup]\nhead-dims = [64, 128]\nseqlens = "2048"\nheads = "16/4"\ncausal = "both"\n')
    assert warmup.project_settings(tmp_path / "kernels.lock") == {
        "head-dims": "64,128", "seqlens": "2048", "heads": "16/4", "causal": "both"}
    planned = []
    monkeypatch.setattr(warmup, "warmup", lambda load, into, shapes, **kw: planned.extend(shapes) or [])
    assert main(["warmup", "--into", str(tmp_path / "c"), "--lock", str(tmp_path / "kernels.lock"),
                 "--seqlens", "1024"]) == 0
    assert {(s.head_dim, s.seqlen, s.heads_q, s.heads_k, s.causal) for s in planned} == {
        (d, 1024, 16, 4, c) for d in (64, 128) for c in (False, True)}


def test_an_unknown_project_key_is_named(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.kernel-loader.warmup]\nhead_dim = 64\n")
    with pytest.raises(warmup.WarmupError, match="unknown keys \\['head_dim'\\]"):
        warmup.project_settings(tmp_path / "kernels.lock")


def test_a_warmup_process_asks_the_shipped_kernel_for_every_build_of_a_shape_class(tmp_path, monkeypatch):
    # the shipped kernel's Hopper forward takes a build with or without a tile table by batch,
    # heads and length; FLASH_ATTN2_WARMUP=1 makes it compile both, so a job's batch need not be
    # the warmed one
    monkeypatch.delenv("FLASH_ATTN2_WARMUP", raising=False)
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.setattr(knobs.cache, "dir", knobs.cache.dir)  # put back after the test
    warmup._point_triton_at(tmp_path / "cache")
    assert knobs.cache.dir == str(tmp_path / "cache")
    assert os.environ["FLASH_ATTN2_WARMUP"] == "1"
