"""docs/attention.md: every python snippet runs, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "attention.md"
MARK = "<!-- run-by: tests/attention/test_attention_docs.py::test_python_snippets_run -->"


def _snippets() -> list[str]:
    text = DOC.read_text()
    return re.findall(re.escape(MARK) + r"\n```python\n(.*?)```", text, flags=re.S)


def test_every_python_block_is_marked_to_run_here():
    assert len(_snippets()) == DOC.read_text().count("```python") >= 3


def test_python_snippets_run():
    namespace: dict = {}
    for snippet in _snippets():
        exec(compile(snippet, str(DOC), "exec"), namespace)
