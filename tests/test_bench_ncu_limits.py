"""bench/ncu_limits.py's reading of Nsight Compute's raw page: one row per kernel, units turned
into µs and KB, the occupancy limit as the smallest of its four, and the stalls ranked.

The fixture is a real raw page cut down to the columns the script reads: cuDNN's head_dim 64
forward kernel and our paged decode's two kernels (split-K and combine), as `ncu --page raw
--csv` printed them on an H200."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package

import ncu_limits  # noqa: E402

PAGE = (Path(__file__).resolve().parent / "data" / "ncu_raw_page.csv").read_text()


def test_each_kernel_becomes_a_row_in_microseconds_and_kilobytes():
    cudnn, split, combine = ncu_limits._kernel_rows(PAGE)
    assert cudnn["kernel_name"].startswith("cudnn_generated_fort_native_sdpa_sm90_flash_fprop")
    assert [split["kernel_name"], combine["kernel_name"]] == ["_split_kernel", "_combine_kernel"]
    assert cudnn["duration"] == 577.408  # the page gives "us"
    assert (cudnn["grid"], cudnn["threads"], cudnn["registers"]) == (132, 384, 168)
    assert cudnn["shared_kb"] == 134.144  # "Kbyte/block", kept as KB
    assert split["grid"] == 512  # "512" and "1,024" alike are numbers
    assert combine["grid"] == 1024
    assert 0 < cudnn["tensor_pct"] < 100 and 0 < split["dram_pct"] < 100


def test_blocks_per_sm_is_the_tightest_of_the_four_limits():
    cudnn, split, combine = ncu_limits._kernel_rows(PAGE)
    assert (cudnn["blocks_per_sm"], split["blocks_per_sm"], combine["blocks_per_sm"]) == (1, 4, 16)


def test_stalls_are_ranked_per_issued_instruction_without_the_issue_itself():
    cudnn, split, _ = ncu_limits._kernel_rows(PAGE)
    names = [part.split()[0] for part in split["top_stalls"].split(", ")]
    values = [float(part.split()[1]) for part in split["top_stalls"].split(", ")]
    assert names[0] == "long_scoreboard" and len(names) == 4  # a memory-bound decode waits on loads
    assert values == sorted(values, reverse=True)
    cudnn_names = [part.split()[0] for part in cudnn["top_stalls"].split(", ")]
    assert "selected" not in names and "selected" not in cudnn_names
    # every stall figure the page had stays in the JSON, under its ncu name
    assert any(k.startswith("smsp__average_warps_issue_stalled_barrier") for k in split["raw"])


def test_the_short_name_drops_template_arguments_and_parameters():
    assert ncu_limits._short("void flash<(int)4, 128>(float*, int)") == "void flash"
    assert ncu_limits._short("_split_kernel") == "_split_kernel"
