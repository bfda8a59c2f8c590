"""Every test of the shipped kernels runs with its interpreted launches bounds-checked.

Under ``TRITON_INTERPRET=1`` each load and store of a Triton kernel must stay inside the buffers
of that launch's tensor arguments (``interpreter_bounds``): a test that passes on its numbers
would still fail on a read past a tensor's end, which a GPU run can turn into a fault or a
silent read of a neighbouring tensor.
"""

from __future__ import annotations

import os

import pytest

from interpreter_bounds import within_arguments


@pytest.fixture(autouse=True)
def _bounds_checked():
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield None
        return
    with within_arguments() as seen:
        yield seen


def pytest_sessionfinish(session, exitstatus):
    """After a passing session that ran a long fuzz target: its report (``kernel_fuzz``)."""
    import kernel_fuzz

    if kernel_fuzz.RUNS and exitstatus == 0:
        kernel_fuzz.write_report()
