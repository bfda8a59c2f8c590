"""bench/power_probe.py's reading of nvidia-smi: each sample line becomes numbers (an [N/A] value
becomes None), the reasons bitmask is named, and a turn's summary takes only the samples taken
during that turn; --rows parses the rows to probe."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package

import power_probe  # noqa: E402


def test_a_sample_line_becomes_clock_power_temperature_and_the_reasons_mask():
    sample = power_probe.parse_sample("1755, 612.48, 61, 0x0000000000000004\n")
    assert sample == {"clock_mhz": 1755.0, "power_w": 612.48, "temp_c": 61.0, "reasons": 4}


def test_values_the_driver_cannot_report_are_none_and_other_lines_are_not_samples():
    sample = power_probe.parse_sample("1980, [N/A], 40, 0x0000000000000000")
    assert sample == {"clock_mhz": 1980.0, "power_w": None, "temp_c": 40.0, "reasons": 0}
    assert power_probe.parse_sample("Failed to initialize NVML: Driver/library version mismatch") is None
    assert power_probe.parse_sample("[N/A], [N/A], [N/A], [N/A]") is None


def test_reasons_are_named_as_nvidia_smi_names_them():
    assert power_probe.reason_names(0) == "none"
    assert power_probe.reason_names(0x4) == "sw_power_cap"
    assert power_probe.reason_names(0x4 | 0x20 | 0x1) == "gpu_idle+sw_power_cap+sw_thermal"


def test_a_turn_summary_takes_only_the_samples_inside_its_window():
    parse = power_probe.parse_sample
    samples = [(0.9, parse("1980, 300, 50, 0x1")),  # before the turn: idle, not counted
               (1.0, parse("1755, 690, 60, 0x4")),
               (1.1, parse("1700, 700, 62, 0x4")),
               (1.2, parse("1800, 650, 61, 0x0")),
               (2.5, parse("1980, 200, 55, 0x1"))]  # after it
    summary = power_probe.summarise(samples, 1.0, 1.2)
    assert summary == {"samples": 3, "clock_mhz": 1755.0, "power_w": 690.0, "temp_max_c": 62.0,
                       "reasons": "sw_power_cap"}
    assert power_probe.summarise(samples, 3.0, 4.0) == {"samples": 0, "clock_mhz": None, "power_w": None,
                                                      "temp_max_c": None, "reasons": "none"}


def test_rows_from_the_command_line():
    """--rows names head_dim, query heads, kv heads, keys and the mask of each row; anything else
    is refused with the expected shape."""
    assert power_probe.parse_rows("64/32/8/2048/causal, 128/16/16/4096/full") == [
        (64, 32, 8, 2048, True), (128, 16, 16, 4096, False)]
    for bad in ("64/32/8/2048", "64/32/8/2048/yes", "64/x/8/2048/causal"):
        with pytest.raises(ValueError):
            power_probe.parse_rows(bad)


def test_summary_takes_medians_per_row_and_divides_by_cudnn():
    """Each probed row gets one line per contender: medians over its turns, and its TFLOP/s over
    cuDNN's median on the same row."""
    def turn(contender, tflops, mhz, seq=4096):
        return dict(head_dim=64, heads="16/16", seq=seq, causal=True, contender=contender, tflops=tflops,
                    clock_mhz=mhz, power_w=690.0)
    rows = [turn("ours", 380, 1800), turn("cuDNN", 400, 1700), turn("ours", 390, 1820), turn("cuDNN", 390, 1710),
            turn("ours", 385, 1810), turn("cuDNN", 395, 1720), turn("ours", 100, None, seq=1024)]
    out = power_probe.summary(rows)
    assert [(r["seq"], r["contender"]) for r in out] == [(4096, "ours"), (4096, "cuDNN"), (1024, "ours")]
    ours, cudnn, alone = out
    assert ours["tflops"] == 385 and cudnn["tflops"] == 395
    assert ours["vs_baseline"] == pytest.approx(385 / 395) and cudnn["vs_baseline"] == 1.0
    assert ours["clock_mhz"] == 1810 and ours["power_w"] == 690.0
    assert alone["vs_baseline"] is None and alone["clock_mhz"] is None
