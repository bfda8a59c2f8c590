"""Every benchmark script in bench/ imports on a machine without a GPU: its GPU work starts in
``main()``, and what it takes from another script (``harness``, a shared workload) still exists
under the name it uses (a rename in one script once broke another's import, unnoticed until a
GPU run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py"))


@pytest.fixture(autouse=True)
def _bench_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # bench/ is not a package


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_script_imports_and_has_an_entry_point(name):
    # loaded from its file under a name of its own: a plain ``import attention`` could find another
    # module of that name first (tests/attention/ is a folder of tests)
    spec = importlib.util.spec_from_file_location(f"_bench_script_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.__doc__, f"bench/{name}.py says what it measures in its docstring"
    if name != "harness":
        assert callable(getattr(module, "main", None)), f"bench/{name}.py has a main()"


def test_scripts_share_code_only_through_the_harness():
    # harness.py is the one shared module (its docstring's rule); a script's own child process
    # may import the script itself (compile_report.py's probe does)
    import re

    for name in SCRIPTS:
        text = (BENCH / f"{name}.py").read_text()
        others = set(re.findall(r"^\s*(?:from|import) (\w+)", text, re.M)) & set(SCRIPTS)
        assert others <= {"harness", name}, (name, others)


def test_the_list_is_not_empty():
    assert {"harness", "attention", "decode", "decode_tiles", "gluon_fwd", "compile_report"} <= set(SCRIPTS)
