"""metadata.json as untrusted input: size cap, depth guard, typed fields, nothing imported."""

import json
import sys
import time
import tracemalloc

import pytest

import kernel_loader
from kernel_loader import loader, metadata
from kernel_loader.errors import KernelMetadataError, MissingDependencyError
from test_loader import make_repo  # noqa: F401


def parse(obj) -> metadata.KernelMetadata:
    return metadata.parse_metadata(json.dumps(obj).encode(), "build/v/metadata.json")


def test_a_real_record_parses_and_drops_unknown_fields():
    meta = parse({"name": "flash-attn2", "id": "_fa2", "version": 1, "license": "Apache-2.0",
                  "python-depends": ["einops>=0.7", "nvidia-cutlass-dsl; platform_system=='Linux'"],
                  "backend": {"type": "cuda", "archs": ["8.0+PTX"]}, "future-field": {"a": [1, 2]}})
    assert meta.package_name == "flash_attn2" and meta.version == 1 and meta.archs == ("8.0+PTX",)
    assert metadata.requirement_name(meta.python_depends[1]) == "nvidia-cutlass-dsl"
    assert "future-field" not in meta.to_json()


@pytest.mark.parametrize(
    "obj, field",
    [
        ({"python-depends": "torch"}, "python-depends"),  # a string, not a list
        ({"python-depends": [["torch"]]}, "python-depends"),
        ({"python-depends": ["this is not a requirement!"]}, "python-depends"),
        ({"version": "1"}, "version"),
        ({"version": True}, "version"),
        ({"name": 5}, "name"),
        ({"name": "/abs/path"}, "name"),
        ({"id": "a.b"}, "id"),
        ({"backend": ["cuda"]}, "backend"),
        ({"backend": {"type": 1}}, "type"),
        ({"backend": {"archs": "8.0"}}, "backend.archs"),
        ({"license": ["mit"]}, "license"),
    ],
)
def test_each_bad_field_is_a_typed_error_naming_it(obj, field):
    with pytest.raises(KernelMetadataError, match=f"field '{field}'"):
        parse(obj)


@pytest.mark.parametrize("raw", [b"[1, 2]", b"not json", b"\xff\xfe", b'"just a string"'])
def test_not_an_object_is_refused(raw):
    with pytest.raises(KernelMetadataError):
        metadata.parse_metadata(raw, "m.json")


def test_deep_nesting_is_refused_without_recursion():
    raw = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(KernelMetadataError, match="deeper than 32"):
        metadata.parse_metadata(raw, "m.json")
    ok = b'{"x": "' + b"[" * 1000 + b'"}'  # brackets inside a string are text
    assert metadata.parse_metadata(ok, "m.json").name is None


def test_a_huge_file_is_refused_unread(tmp_path):
    path = tmp_path / "metadata.json"
    with open(path, "wb") as fh:
        fh.write(b'{"name": "x", "pad": "')
        fh.seek(100 * 1024 * 1024)
        fh.write(b'"}')
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(KernelMetadataError, match="larger than 1048576 bytes"):
        metadata.read_metadata(path)
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 1 and peak < 4 * metadata.MAX_METADATA_BYTES


def test_has_kernel_imports_nothing_named_in_python_depends(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_LOADER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    sys.modules.pop("this", None)
    meta = {"name": "toy", "python-depends": ["this.x", "antigravity"]}
    repo = make_repo(tmp_path / "repo", {"torch-universal": {"toy/__init__.py": "", "metadata.json": json.dumps(meta)}})
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/deps={repo}")
    loader.clear_memo()
    assert kernel_loader.has_kernel("kernels-community/deps") is True
    assert "this" not in sys.modules and "antigravity" not in sys.modules


def test_a_string_python_depends_is_a_field_error_not_letters(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    repo = make_repo(tmp_path / "repo", {"torch-universal": {
        "toy/__init__.py": "", "metadata.json": json.dumps({"python-depends": "torch"})}})
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/strdeps={repo}")
    loader.clear_memo()
    with pytest.raises(KernelMetadataError, match="python-depends") as info:
        kernel_loader.get_kernel("kernels-community/strdeps")
    assert not isinstance(info.value, MissingDependencyError)
