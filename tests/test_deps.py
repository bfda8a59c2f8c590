import pytest

from kernel_loader import deps
from kernel_loader.errors import MissingDependencyError


def test_missing_dependencies_use_import_names():
    meta = {"python-depends": ["packaging>=23", "surely-absent-pkg; python_version>'3'", "tvm-ffi", "onednn-devel"]}
    missing = deps.missing_dependencies(meta)
    assert "packaging" not in missing and "surely-absent-pkg" in missing
    assert "onednn-devel" not in missing  # nothing importable to check
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        assert "apache-tvm-ffi" in missing  # the pip name, not the metadata name
    assert deps.missing_dependencies(None) == [] and deps.missing_dependencies({}) == []


def test_check_dependencies_names_pip_command():
    with pytest.raises(MissingDependencyError, match="pip install surely-absent-pkg"):
        deps.check_dependencies({"python-depends": ["surely-absent-pkg"]}, "org/k variant torch-universal")
    deps.check_dependencies({"python-depends": ["packaging"]}, "org/k")
