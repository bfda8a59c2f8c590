"""bench/generate_batch.py's call trace: after a fault, the traced call with no "ok" line after it
is the one that faulted (the trace synchronizes before and after every call)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is not a package

import generate_batch  # noqa: E402


def _trace(tmp_path: Path, entries: list) -> Path:
    path = tmp_path / "calls.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def test_the_call_left_without_ok_is_the_faulting_one(tmp_path):
    path = _trace(tmp_path, [{"call": 1, "kind": "flash_attn_varlen_func", "arguments": {}}, {"ok": 1},
                             {"call": 2, "kind": "flash_attn_with_kvcache", "arguments": {"x": 1}}])
    assert generate_batch._faulting_call(path) == {"call": 2, "kind": "flash_attn_with_kvcache",
                                                   "arguments": {"x": 1}}


def test_no_faulting_call_when_every_call_finished(tmp_path):
    path = _trace(tmp_path, [{"call": 1, "kind": "k", "arguments": {}}, {"ok": 1}])
    assert generate_batch._faulting_call(path) is None
    assert generate_batch._faulting_call(tmp_path / "missing.jsonl") is None


def test_captured_calls_have_no_ok_line_but_a_later_call_clears_them(tmp_path):
    # a call inside a graph capture is not synchronized, so it gets no "ok"; the next eager call
    # that finishes shows the device got past it
    path = _trace(tmp_path, [{"call": 1, "kind": "k", "capturing": True, "arguments": {}},
                             {"call": 2, "kind": "k", "arguments": {}}, {"ok": 2}])
    assert generate_batch._faulting_call(path) is None
