"""bench/harness.py, the one harness every benchmark uses: paired rounds, ratios, result files."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parent.parent / "bench" / "harness.py"


@pytest.fixture(scope="module")
def harness():
    # bench/ is not a package: benchmarks import the harness from their own folder.
    spec = importlib.util.spec_from_file_location("bench_harness", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paired_rounds_run_in_balanced_order_and_give_every_contender_one_sample_per_round(harness):
    order = []
    contenders = {name: (lambda name=name: order.append(name)) for name in "abc"}
    samples = harness.paired(contenders, rounds=4, calls=2, device="cpu", before=lambda n: order.append("before " + n))
    assert {n: len(s) for n, s in samples.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(x > 0 for s in samples.values() for x in s)
    timed = [n for n in order[6:] if not n.startswith("before")][::2]  # after the warm-up, 2 calls per sample
    assert timed == list("abc" "cba" "bca" "acb")
    assert order[6:9] == ["before a", "a", "a"]


def test_over_each_pair_of_rounds_every_key_has_the_same_mean_place(harness):
    keys = ["ours fwd", "ours f+b", "cuDNN fwd", "cuDNN f+b", "FA2 fwd", "FA2 f+b", "ours deterministic"]
    for pairs in (1, 2, 5):
        orders = [harness.round_order(keys, r) for r in range(2 * pairs)]
        assert all(sorted(order) == sorted(keys) for order in orders)  # each key once a round
        places = {key: sum(order.index(key) for order in orders) / len(orders) for key in keys}
        assert set(places.values()) == {(len(keys) - 1) / 2}
    # successive pairs start elsewhere, so no key is always the first after an idle gap
    assert [harness.round_order(keys, r)[0] for r in (0, 2, 4)] == keys[:3]
    assert harness.round_order([], 3) == [] and harness.ROUNDS % 2 == 0


def test_ratio_is_the_median_of_per_round_ratios_with_an_interval_around_it(harness):
    r = harness.ratio([2.0, 4.0, 6.0, 8.0, 30.0], [1.0, 2.0, 3.0, 4.0, 5.0])
    assert r.median == 2.0 and (r.min, r.max) == (2.0, 6.0)
    assert r.low <= r.median <= r.high <= r.max
    assert harness.ratio([1.0] * 5, [2.0] * 5) == (0.5, 0.5, 0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="same non-zero length"):
        harness.ratio([1.0], [1.0, 2.0])


def test_bandwidth_vs_gives_rate_and_time_ratio_against_the_base(harness):
    samples = {"cudnn": [10.0, 10.0, 10.0], "ours": [20.0, 20.0, 5.0]}
    row = harness.bandwidth_vs(samples, "ours", 2e6)
    assert row["tbps"] == 2e6 / 20.0 / 1e6  # bytes over the median µs
    assert row["vs_cudnn"] == 0.5  # the median of the per-round time ratios 0.5, 0.5, 2
    assert row["interval"] == harness.ratio(samples["cudnn"], samples["ours"]).interval
    assert row["rounds_us"] == [20.0, 20.0, 5.0]
    assert harness.bandwidth_vs(samples, "cudnn", 2e6)["vs_cudnn"] == 1.0


def test_write_results_overwrites_one_md_and_one_json(harness, tmp_path):
    columns = {"name": "contender", "us": "µs", "missing": "n/a"}
    for value in (1.0, 123456.0):
        md = harness.write_results("toy", [{"name": "a|b", "us": value}], title="Toy", columns=columns,
                                   out_dir=tmp_path, commit="abc123", notes=["a note"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy.json", "toy.md"]
    text = md.read_text()
    assert text.startswith("# Toy\n\na note\n")
    assert "| a\\|b | 123,456 | — |" in text and "Commit: `abc123`" in text
    data = json.loads((tmp_path / "toy.json").read_text())
    assert data["rows"] == [{"name": "a|b", "us": 123456.0}] and data["environment"]["commit"] == "abc123"
    assert {"date", "command", "device", "python", "torch", "triton", "transformers", "huggingface_hub"} <= set(data["environment"])


def test_the_recorded_command_carries_the_kernels_switches(harness, tmp_path, monkeypatch):
    """A figure measured with a FLASH_ATTN2_* switch set is reproduced with it: the command says so."""
    monkeypatch.setenv("FLASH_ATTN2_DIRECT_LAUNCH", "1")
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    harness.write_results("toy", [], title="Toy", columns={"a": "a"}, out_dir=tmp_path, commit="abc")
    command = json.loads((tmp_path / "toy.json").read_text())["environment"]["command"]
    assert command.startswith("FLASH_ATTN2_DIRECT_LAUNCH=1 ") and "UNRELATED_SETTING" not in command
    assert "Command: `FLASH_ATTN2_DIRECT_LAUNCH=1 " in (tmp_path / "toy.md").read_text()
    monkeypatch.delenv("FLASH_ATTN2_DIRECT_LAUNCH")
    harness.write_results("toy", [], title="Toy", columns={"a": "a"}, out_dir=tmp_path, commit="abc")
    assert "FLASH_ATTN2" not in json.loads((tmp_path / "toy.json").read_text())["environment"]["command"]


def test_host_path_cpu_times_the_package_beside_another_copy(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(HARNESS.parent.parent)
    package = HARNESS.parent.parent / "kernel_repos/kernels-community/flash-attn2/build/torch-universal/flash_attn2"
    result = subprocess.run([sys.executable, str(HARNESS.parent / "host_path_cpu.py"), str(package), "--rounds", "2",
                             "--calls", "5", "--out", str(tmp_path), "--commit", "test"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "host_path_cpu.json").read_text())["rows"]
    assert [r["part"].split()[0] for r in rows] == ["forward", "Gluon", "backward"]
    assert all(r["new_us"] > 0 and r["old_us"] > 0 for r in rows)


def test_shipped_kernel_comes_through_the_public_loader(harness):
    kernel = harness.shipped_kernel()
    assert kernel.__kernel_resolution__.source == "local"
    assert callable(kernel.flash_attn_func)


def test_host_overhead_runs_and_writes_its_results(tmp_path):
    # The benchmark scripts are not part of the library, but they must keep working against it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(HARNESS.parent.parent)
    result = subprocess.run([sys.executable, str(HARNESS.parent / "host_overhead.py"), "--calls", "1",
                             "--rounds", "1", "--out", str(tmp_path), "--commit", "test", "--profile"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "host_overhead.json").read_text())["rows"]
    assert {r["attention"] for r in rows} >= {"ours (flash wrapper, shipped kernel)", "sdpa (kernel_loader)"}
    assert all(r["host_us"] > 0 for r in rows)
    # the forward+backward rows, paired against SDPA, and where our call spends its host time
    training = [r for r in rows if r["shape"].startswith("forward+backward")]
    assert {r["attention"] for r in training} == {"ours (flash_attn_func)", "ours (flash_attn_func, Triton's launcher)",
                                                  "sdpa (math)"}
    assert "flash_attn_func" in (tmp_path / "host_overhead_profile.txt").read_text()


def test_attention_row_records_each_contender_and_ratios_only_where_both_ran(harness):
    def fails():
        raise RuntimeError("no kernel for this shape")

    row = harness.attention_row({"seq": 1}, {"ours": (lambda: None, lambda: None),
                                             "sdpa_cudnn": (lambda: None, fails)}, flop=1e6)
    assert row["ours_fwd"] > 0 and row["ours_fwdbwd"] > 0 and row["sdpa_cudnn_fwd"] > 0
    assert row["sdpa_cudnn_error"] == "RuntimeError: no kernel for this shape"
    assert row["ratio_fwd"] == row["ours_fwd"] / row["sdpa_cudnn_fwd"]
    assert "ratio_fwdbwd" not in row and "vs_baseline_fwd" not in row


def test_attention_row_runs_each_round_in_the_reverse_order_of_the_one_before(harness):
    calls = []
    contenders = {name: (lambda name=name: calls.append(name + " fwd"), lambda name=name: calls.append(name + " f+b"))
                  for name in ("ours", "sdpa_cudnn")}
    row = harness.attention_row({}, contenders, flop=1e6, rounds=2)
    blocks = [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]  # one block per timing
    # a block repeats where one round ends with the timing the next begins with
    assert blocks == ["ours fwd", "ours f+b", "sdpa_cudnn fwd", "sdpa_cudnn f+b",
                      "sdpa_cudnn fwd", "ours f+b", "ours fwd"]
    assert row["ratio_fwd"] == row["ours_fwd"] / row["sdpa_cudnn_fwd"] and row["ratio_fwdbwd"] > 0


def test_a_failing_forward_leaves_a_dash_for_both_parts_and_is_not_timed_again(harness):
    tried = []

    def fails():
        tried.append(1)
        raise RuntimeError("no kernel for this shape")

    row = harness.attention_row({}, {"ours": (lambda: None, lambda: None), "flex": (fails, lambda: None)},
                                flop=1e6, rounds=3)
    assert len(tried) == 1 and row["flex_error"].startswith("RuntimeError")
    assert "flex_fwd" not in row and "flex_fwdbwd" not in row and row["ours_fwdbwd"] > 0


def test_host_phases_split_our_training_call_and_put_everything_back(harness, monkeypatch):
    """--phases: inclusive host time per function of one forward+backward, on the interpreter here."""
    import torch

    monkeypatch.syspath_prepend(str(HARNESS.parent))
    spec = importlib.util.spec_from_file_location("bench_host_overhead", HARNESS.parent / "host_overhead.py")
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    kernel = harness.shipped_kernel()
    autograd = importlib.import_module(f"{kernel.__name__}._autograd")
    launch = importlib.import_module(f"{kernel.__name__}._launch")
    before = (autograd._TritonAttention.__dict__["forward"], launch.Launcher.__call__, torch.empty, torch.empty_like)

    split = host._phase_breakdown(kernel, (1, 32, 2, 32), 1, 1, "cpu", torch.float32)

    us, calls = split["phases_us"], split["calls_per_fwdbwd"]
    # nesting: each function's time holds the time of the ones it calls
    assert us["flash_attn_func"] >= us["_TritonAttention.forward"] >= us["_triton_forward"] > 0
    assert us["autograd.grad"] >= us["_TritonAttention.backward (autograd's thread)"] >= us["attention_backward"] > 0
    assert calls["attention_backward"] == 1 and calls["_TritonAttention.forward"] == 1
    assert any(label.startswith("Launcher: ") for label in us)  # the kernels' launches, by kernel name
    assert calls.get("torch.empty", 0) + calls.get("torch.empty_like", 0) >= 3  # dq, dk, dv at least
    assert split["total_us"] > 0 and split["sdpa_total_us"] > 0
    # the timers are gone afterwards
    assert (autograd._TritonAttention.__dict__["forward"], launch.Launcher.__call__, torch.empty,
            torch.empty_like) == before


def test_a_child_python_gets_the_repository_ahead_of_a_triton_already_on_the_path(harness, monkeypatch):
    # gpu_kernel.sh's TRITON_OVERLAY puts another Triton release on PYTHONPATH: a benchmark's child
    # processes (compile_report's probes) must keep it, or they would time the installed release
    monkeypatch.setenv("PYTHONPATH", "/unpacked/triton-3.7")
    env = harness.child_env(TRITON_CACHE_DIR="/tmp/cache")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(harness.REPO_ROOT), "/unpacked/triton-3.7"]
    assert env["TRITON_CACHE_DIR"] == "/tmp/cache" and env["HOME"] == os.environ["HOME"]
    monkeypatch.delenv("PYTHONPATH")
    assert harness.child_env()["PYTHONPATH"] == str(harness.REPO_ROOT)


def test_decode_parts_clock_each_part_of_a_decode_call_and_put_everything_back(harness, monkeypatch):
    """The clocks bench/decode_host.py and bench/e2e_decode_split.py read: one call counted in the
    call, its allocations and its launcher; the C launch functions of the launcher's cached
    kernels wrapped while the block runs; every original back afterwards."""
    import torch

    kernel = harness.shipped_kernel()
    dec = importlib.import_module(f"{kernel.__name__}._triton_decode")

    class FakeDirect:  # a cached launch's C function (none compile under the interpreter)
        def _launch(self, *args):
            return sum(args)

    direct = FakeDirect()
    c_launch = direct._launch
    monkeypatch.setattr(dec._SPLIT, "_cache", {"key": (None, None, None, None, direct)})
    before = (dec.decode_attention, dec._alloc, dec._SPLIT)
    q = torch.randn(1, 4, 1, 32)
    k, v = torch.randn(1, 2, 48, 32), torch.randn(1, 2, 48, 32)
    with harness.decode_parts(dec) as clocks:
        assert set(clocks) == set(harness.DECODE_PARTS)
        out = kernel.flash_attn_decode_heads_first(q, k, v, None, True, (-1, -1), 0.0)
        assert direct._launch(1, 2) == 3  # the wrapped C function still returns what it returns
        assert clocks["decode_attention"].calls == 1 and clocks["_SPLIT"].calls == 1
        assert clocks["_alloc"].calls >= 1 and clocks["C launch"].calls == 1
        us = harness.parts_us(clocks, 1)
        assert us["decode_attention"] >= us["_SPLIT"] > 0 and us["decode_attention"] >= us["_alloc"] > 0
    assert out is not None and out.shape == (1, 1, 4, 32)
    assert (dec.decode_attention, dec._alloc, dec._SPLIT) == before
    assert direct._launch == c_launch


def test_ncu_raw_page_reads_the_first_launch_with_units(harness):
    """harness.ncu_raw_page on a real raw page (tests/data/ncu_raw_page.csv, cuDNN's kernel first):
    numbers with thousands separators parsed, each with the unit row's unit, text left out."""
    page = (Path(__file__).resolve().parent / "data" / "ncu_raw_page.csv").read_text()
    raw = harness.ncu_raw_page(page)
    assert raw["gpu__time_duration.sum"] == (577.408, "us")
    assert raw["launch__registers_per_thread"][0] == 168
    assert raw["launch__grid_size"][0] == 132
    assert "Kernel Name" not in raw  # text columns are not metrics
