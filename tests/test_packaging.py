"""The wheel carries the library, the ``kernel-loader`` console script and the shipped kernel repos."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_PREFIX = "kernel_loader/_kernel_repos/"
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")


def _source_files(folder: Path) -> set[str]:
    return {
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Build from a copy: an in-tree build leaves build/ behind, whose stale files would leak
    # into later wheels, and other work in the tree must not be disturbed.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, src / name)
    for name in ("kernel_loader", "kernel_repos"):
        # kernel_repos/**/build/ is content, so only top-level build/ folders may be skipped.
        ignore = _SKIP if name == "kernel_loader" else shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(REPO_ROOT / name, src / name, ignore=ignore)
    for extra in REPO_ROOT.glob("LICENSE*"):
        shutil.copy2(extra, src / extra.name)
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation and no index: the test must not reach PyPI; setuptools comes from the
    # test extra.
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(out), "-q"],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_NO_INDEX": "1"},
        timeout=120,
    )
    assert result.returncode == 0, f"pip wheel failed:\n{result.stdout}\n{result.stderr}"
    wheels = list(out.glob("kernel_loader-*.whl"))
    assert len(wheels) == 1, f"expected one wheel, found {wheels}"
    return wheels[0]


@pytest.fixture(scope="module")
def names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_console_script_entry_point(wheel: Path, names: set[str]) -> None:
    with zipfile.ZipFile(wheel) as zf:
        ep_file = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        parser = configparser.ConfigParser()
        parser.read_string(zf.read(ep_file).decode())
    target = parser["console_scripts"]["kernel-loader"]
    assert target == "kernel_loader.cli:main"
    module = target.split(":")[0].replace(".", "/")
    assert f"{module}.py" in names or f"{module}/__init__.py" in names, (
        f"the console script points at {target} but the wheel has no {module}.py"
    )


def test_shipped_kernel_repos_are_inside(names: set[str]) -> None:
    expected = {SHIPPED_PREFIX + rel for rel in _source_files(REPO_ROOT / "kernel_repos")}
    assert any(n.startswith(SHIPPED_PREFIX + "kernels-community/flash-attn2/build/") for n in expected), (
        "kernel_repos/kernels-community/flash-attn2/build/ is empty in the source tree"
    )
    missing = sorted(expected - names)
    assert not missing, f"shipped kernel files missing from the wheel: {missing[:10]}"


def test_every_library_module_is_inside(names: set[str]) -> None:
    # The package list in pyproject.toml is explicit; a new subpackage must be added there.
    expected = {
        "kernel_loader/" + rel for rel in _source_files(REPO_ROOT / "kernel_loader") if rel.endswith(".py")
    }
    missing = sorted(expected - names)
    assert not missing, (
        f"modules missing from the wheel: {missing}; add their package to "
        "[tool.setuptools] packages in pyproject.toml"
    )
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_installed_layout_finds_the_shipped_repos(wheel: Path, tmp_path: Path) -> None:
    """Unpacked as pip installs it, the library finds its shipped repos inside itself."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    probe = (
        "import importlib.util, kernel_loader, pathlib\n"
        "from kernel_loader.sources.bundled import bundled_root\n"
        "spec = importlib.util.find_spec('kernel_loader._kernel_repos')\n"
        "print(pathlib.Path(kernel_loader.__file__).parent)\n"
        "print(list(spec.submodule_search_locations)[0])\n"
        "print(bundled_root())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    # cwd outside the source tree, so the checkout's kernel_loader cannot be imported instead.
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    package, data_package, found_root = result.stdout.split()
    shipped = site / "kernel_loader" / "_kernel_repos"
    assert Path(package) == site / "kernel_loader"
    assert Path(data_package) == shipped
    assert (shipped / "kernels-community" / "flash-attn2" / "build").is_dir()
    assert found_root == str(shipped), (
        f"kernel_loader.sources.bundled.bundled_root() gave {found_root} in an installed wheel; "
        f"the shipped repos are at {shipped}"
    )
