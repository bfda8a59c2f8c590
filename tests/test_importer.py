"""Importing variant folders: layouts, unique names, failure cleanup, bytecode placement."""

import sys

import pytest

from kernel_loader import importer
from kernel_loader.errors import KernelImportError


def _write(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_flat_and_nested_layouts_with_relative_imports(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_LOADER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    flat = _write(tmp_path / "flat", {"__init__.py": "from .ops import f\n", "ops.py": "def f():\n    return 'flat'\n"})
    nested = _write(
        tmp_path / "nested",
        {"metadata.json": '{"name": "my-kern"}', "my_kern/__init__.py": "from .sub.deep import g\n",
         "my_kern/sub/__init__.py": "", "my_kern/sub/deep.py": "def g():\n    return 'nested'\n"},
    )
    a = importer.import_variant(flat, importer.module_name_for("o/flat", "a" * 40, "torch-universal"), "o/flat")
    b = importer.import_variant(nested, importer.module_name_for("o/nested", "b" * 40, "torch-universal"), "o/nested")
    assert a.f() == "flat" and b.g() == "nested"
    assert f"{b.__name__}.sub.deep" in sys.modules
    assert isinstance(sys.modules[f"{b.__name__}.sub.deep"].__loader__, importer._KernelSourceLoader)
    assert not list(tmp_path.glob("flat/**/__pycache__")) and not list(tmp_path.glob("nested/**/__pycache__"))
    assert len(list((tmp_path / "state" / "bytecode").rglob("*.bin"))) == 5
    # memoized per module name
    assert importer.import_variant(flat, a.__name__, "o/flat") is a


def test_module_names_are_unique_and_valid():
    names = {
        importer.module_name_for("org/name", "a" * 40, "torch28-cxx11-cu128-x86_64-linux"),
        importer.module_name_for("org/name", "b" * 40, "torch28-cxx11-cu128-x86_64-linux"),
        importer.module_name_for("org/name", "a" * 40, "torch-universal"),
        importer.module_name_for("org/name-2", "a" * 40, "torch-universal"),
    }
    assert len(names) == 4 and all(n.isidentifier() for n in names)


def test_failed_import_is_cleaned_up_and_retryable(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_LOADER_STATE_DIR", str(tmp_path / "state"))
    folder = _write(tmp_path / "bad", {"__init__.py": "from . import helper\nraise ImportError('needs libfoo')\n",
                                       "helper.py": "X = 1\n"})
    name = importer.module_name_for("o/bad", "c" * 40, "torch-universal")
    with pytest.raises(KernelImportError, match="needs libfoo") as info:
        importer.import_variant(folder, name, "o/bad@cccccccccccc variant torch-universal")
    assert "kernel-loader explain o/bad" in str(info.value)
    assert not [n for n in sys.modules if n.startswith(name)]
    (folder / "__init__.py").write_text("from . import helper\nOK = helper.X\n")
    assert importer.import_variant(folder, name, "o/bad").OK == 1


def test_no_package_found(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(KernelImportError, match="kernel-loader download o/empty"):
        importer.import_variant(tmp_path / "empty", "_kl_test_empty", "o/empty@x variant v")
