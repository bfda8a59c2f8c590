"""Every command and snippet in README.md and docs/*.md runs, the way a user would run it.

The convention: shell commands sit in ```console blocks, one command per line starting with
``$ ``; Python snippets sit in ```python blocks. A block right after the comment
``<!-- run-by: tests/test_x.py::test_name -->`` is run by that test, which must contain the
block's text or read it from the document (the tests here call ``_annotated``). Every other
block runs here, each page's blocks in order in one sandbox as a reader would follow the page: a
fresh temp folder as the working directory (holding a copy of ``examples/``), a fresh HOME,
cache and state folder, and the loopback Hub serving the shipped ``kernels-community/flash-attn2``
(``hub_env``). Blocks in other languages (toml, text tables) are not commands and are not run.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from test_packaging import wheel  # noqa: F401  (the fixture: builds the wheel without network)

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, REPO_ROOT / "bench" / "README.md", REPO_ROOT / "bench" / "NOTES.md"]
BLOCK = re.compile(r"(?:<!-- run-by: (?P<by>\S+) -->\n)?(?P<indent>[ \t]*)```(?P<lang>[a-z]*)\n(?P<body>.*?)^(?P=indent)```",
                   re.S | re.M)
RUN_TIMEOUT = 600


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    body: str
    run_by: str | None

    def commands(self) -> list[str]:
        """The ``$ `` lines of a console block, without the prompt."""
        return [line[2:] for line in self.body.splitlines() if line.startswith("$ ")]

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO_ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in BLOCK.finditer(text):
        indent = m.group("indent")
        body = "".join(line[len(indent):] if line.startswith(indent) else line
                       for line in m.group("body").splitlines(keepends=True))
        found.append(Block(page, text.count("\n", 0, m.start("lang")) + 1, m.group("lang"), body, m.group("by")))
    return found


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
RUNNABLE = [b for b in ALL_BLOCKS if b.lang in ("console", "python")]


def _annotated(test_name: str) -> Block:
    """The one block whose run-by comment names ``tests/test_docs.py::<test_name>``."""
    found = [b for b in RUNNABLE if b.run_by == f"tests/test_docs.py::{test_name}"]
    assert len(found) == 1, f"expected one block run by {test_name}, found {[str(b) for b in found]}"
    return found[0]


def _sandbox_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    # What a user has: no Triton interpreter (the suite sets it for its own tests), this
    # checkout's code first, and this venv's scripts (kernel-loader) on PATH.
    env.pop("TRITON_INTERPRET", None)
    env.update(HOME=str(home), PYTHONPATH=str(REPO_ROOT),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    return env


@pytest.fixture
def sandbox(hub_env, hub_server, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A working folder (with a copy of examples/) and the environment a documented block runs in."""
    hub_server.add_shipped_repo("kernels-community/flash-attn2", versions=(1,))
    cwd = tmp_path / "work"
    shutil.copytree(REPO_ROOT / "examples", cwd / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "home").mkdir()
    return cwd, _sandbox_env(tmp_path / "home")


def _run(block: Block, cwd: Path, env: dict[str, str], commands: list[str] | None = None) -> str:
    if block.lang == "python":
        script = cwd / f"snippet_{block.line}.py"
        script.write_text(block.body)
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", "\n".join(commands or block.commands())]
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert result.returncode == 0, (
        f"{block} failed (exit {result.returncode}):\n{block.body}\n--- stdout\n{result.stdout[-3000:]}"
        f"\n--- stderr\n{result.stderr[-3000:]}")
    return result.stdout + result.stderr


@pytest.mark.parametrize("page", [p for p in PAGES if any(b.page == p and not b.run_by for b in RUNNABLE)],
                         ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_block_of_the_page_runs(page: Path, sandbox) -> None:
    cwd, env = sandbox
    for block in [b for b in RUNNABLE if b.page == page and not b.run_by]:
        assert block.lang == "python" or block.commands(), f"{block}: a console block without `$ ` lines"
        _run(block, cwd, env)


def test_run_by_comments_name_tests_that_run_the_block() -> None:
    annotated = [b for b in RUNNABLE if b.run_by]
    assert annotated, "README.md has no run-by blocks: the set-up commands lost their tests"
    for block in annotated:
        file, _, name = block.run_by.partition("::")
        path = REPO_ROOT / file
        assert path.is_file() and name, f"{block}: run-by {block.run_by!r} names no test file"
        source = path.read_text()
        tests = {n.name: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
        assert name in tests, f"{block}: {file} has no test {name}"
        body = ast.get_source_segment(source, tests[name]) or ""
        reads_the_page = block.page.name in source or f'_annotated("{name}")' in body
        assert block.body in source or reads_the_page, (
            f"{block}: {block.run_by} neither contains the block's text nor reads {block.page.name}")


def test_only_console_and_python_blocks_hold_commands() -> None:
    # A ```bash block, or a plain one with `$ ` lines, would show commands that no test runs.
    shells = [str(b) for b in ALL_BLOCKS
              if b.lang in ("bash", "sh", "shell", "zsh") or (b.lang == "" and b.commands())]
    assert not shells, f"shell commands outside ```console blocks: {shells}"


def test_links_and_paths_name_files_that_exist() -> None:
    missing = []
    for page in LINKED:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)\)", text):
            if not target.startswith("http") and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(REPO_ROOT)}: link {target}")
        for path in re.findall(r"`((?:bench|docs|examples|tests|kernel_repos|\.ci)/[\w./-]+)`", text):
            if not (REPO_ROOT / path).exists():
                missing.append(f"{page.relative_to(REPO_ROOT)}: `{path}`")
    assert not missing, "\n".join(missing)


def test_quick_start(wheel, sandbox) -> None:  # noqa: F811  (wheel is the fixture imported above)
    (command,) = _annotated("test_quick_start").commands()
    install, run = command.split(" && ")
    pip, verb, pin, project = shlex.split(install)
    assert (pip, verb, project) == ("pip", "install", ".")
    # The pinned torch satisfies the package's own requirement, and "." builds into a wheel
    # (the fixture builds it from this checkout without network).
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    torch_req = next(Requirement(r) for r in pyproject["project"]["dependencies"] if Requirement(r).name == "torch")
    assert Version(next(iter(Requirement(pin).specifier)).version) in torch_req.specifier
    assert wheel.name.startswith("kernel_loader-")
    # Without network: the shipped copy, said so, and the SDPA comparison passes.
    cwd, env = sandbox
    env["HF_HUB_OFFLINE"] = "1"
    out = _run(_annotated("test_quick_start"), cwd, env, [run])
    assert "source:   bundled" in out and "BundledKernelWarning" in out
    assert "relative difference to SDPA" in out


def test_ci_runs_the_test_command() -> None:
    (command,) = _annotated("test_ci_runs_the_test_command").commands()
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^exec {re.escape(command)} \"\$@\"$", ci, re.M), f".ci/run does not run `{command}`"
    assert "-m pytest" in (REPO_ROOT / "tests" / "run.sh").read_text()


def test_transformers_example_needs_the_extra(sandbox) -> None:
    install, run = _annotated("test_transformers_example_needs_the_extra").commands()
    pip, verb, target = shlex.split(install)
    extra = re.fullmatch(r"\.\[(\w+)\]", target).group(1)
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert {Requirement(r).name for r in pyproject["project"]["optional-dependencies"][extra]} == {"transformers"}
    cwd, env = sandbox
    env["HF_HUB_OFFLINE"] = "1"
    out = _run(_annotated("test_transformers_example_needs_the_extra"), cwd, env, [run])
    assert "greedy tokens identical to sdpa" in out


def test_the_sources_parse_as_the_oldest_declared_python() -> None:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    oldest = Version(re.fullmatch(r">=\s*([\d.]+)", pyproject["project"]["requires-python"]).group(1))
    for root in ("kernel_loader", "kernel_repos", "examples"):
        for path in (REPO_ROOT / root).rglob("*.py"):
            ast.parse(path.read_text(), str(path), feature_version=(oldest.major, oldest.minor))
