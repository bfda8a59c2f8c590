"""docs/cli.md is true: its exit-code table is errors.EXIT_CODES, and every console block marked
``run-by`` this file runs as written against the loopback Hub with a fresh cache."""

import os
import re
import subprocess
import sys
from pathlib import Path

from kernel_loader import errors

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
BIN = Path(sys.executable).parent


def blocks(test_name: str) -> list[list[tuple[str, list[str]]]]:
    """The console blocks marked ``run-by: tests/test_cli_docs.py::<test_name>``: (command, shown output) pairs."""
    marker = f"<!-- run-by: tests/test_cli_docs.py::{test_name} -->"
    found = []
    for match in re.finditer(re.escape(marker) + r"\n```console\n(.*?)```", DOC.read_text(), re.S):
        steps: list[tuple[str, list[str]]] = []
        for line in match[1].splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            elif line.strip():
                steps[-1][1].append(line)
        found.append(steps)
    assert found, f"no block is marked {marker}"
    return found


def shows(output: str, line: str) -> bool:
    flat = " ".join(output.split())
    line = " ".join(line.split())
    return line[:-3].rstrip() in flat if line.endswith("...") else line in flat


def run_block_commands(test_name: str, cwd: Path) -> list[tuple[str, subprocess.CompletedProcess]]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    ran = []
    for block in blocks(test_name):
        for command, shown in block:
            proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
            assert "Traceback" not in proc.stdout + proc.stderr, (command, proc.stderr)
            for line in shown:
                assert shows(proc.stdout + proc.stderr, line), (command, line, proc.stdout + proc.stderr)
            ran.append((command, proc))
    return ran


def test_exit_code_table_is_the_one_in_errors():
    text = DOC.read_text()
    table = text.split("<!-- exit-codes:")[1].split("\n\n")[0]
    rows = re.findall(r"^\| (\d+) \| (.*?) \| (.*?) \|$", table, re.M)
    documented = {int(code): (tuple(re.findall(r"`(\w+)`", names)), meaning) for code, names, meaning in rows}
    assert documented == errors.EXIT_CODES
    for code, (names, _) in errors.EXIT_CODES.items():
        for name in names:
            assert getattr(errors, name).exit_code == code


def test_every_verb_is_documented():
    from kernel_loader.cli import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if a.dest == "command").choices
    text = DOC.read_text()
    for verb in verbs:
        assert f"| `{verb}" in text or f"| `cache {verb}" in text, verb
    for sub in ("ls", "prune", "rm"):
        assert f"| `cache {sub}" in text


def test_cli_examples(hub_env, hub_server, tmp_path):
    hub_server.add_shipped_repo("kernels-community/flash-attn2", versions=(1,))
    (tmp_path / "pyproject.toml").write_text('[tool.kernels.dependencies]\n"kernels-community/flash-attn2" = 1\n')
    for command, proc in run_block_commands("test_cli_examples", tmp_path):
        assert proc.returncode == 0, (command, proc.stdout, proc.stderr)
    assert not list(hub_env.cache_dir.glob("*flash-attn2*/snapshots/*"))  # the last command removed it


def test_cli_error_examples(hub_env, tmp_path):
    for command, proc in run_block_commands("test_cli_error_examples", tmp_path):
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
