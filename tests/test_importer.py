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


# -- containment: crafted caches ---------------------------------------------------------------------

import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import kernel_loader  # noqa: E402
from kernel_loader import loader  # noqa: E402
from kernel_loader.errors import KernelIntegrityError, KernelMetadataError  # noqa: E402

SHA = "5" * 40
LFS_SUFFIXES = (".so",)


def toy_files(value: int, name: str = "toy") -> dict[str, str]:
    """One nested variant whose ``answer()`` returns ``value``."""
    return {
        f"{name}/__init__.py": "from ._impl import answer\n",
        f"{name}/_impl.py": f"def answer():\n    return {value}\n",
        f"{name}/late.py": "LATE = True\n",
        "metadata.json": json.dumps({"name": name, "version": 1}),
    }


def make_linked_cache(cache, repo_id, sha, variants, repo_type="model", record=True):
    """A cache entry as huggingface_hub leaves it: files in ``blobs/`` named by their git blob id
    (LFS sha256 for ``.so``), linked from ``snapshots/<sha>/`` by relative links, and (``record``)
    the completion record a finished download writes. Returns the repo folder."""
    org, name = repo_id.split("/")
    folder = cache / f"{repo_type}s--{org}--{name}"
    for variant, files in variants.items():
        if record:
            digests = {f"build/{variant}/{rel}": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                       for rel, data in ((r, t.encode() if isinstance(t, str) else t) for r, t in files.items())}
            path = folder / "kernel-loader" / sha / f"{variant}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"format": 1, "repo_id": repo_id, "sha": sha, "variant": variant,
                                        "files": digests, "variants": sorted(variants), "refs": {}}))
        for rel, text in files.items():
            data = text.encode() if isinstance(text, str) else text
            if rel.endswith(LFS_SUFFIXES):
                oid = hashlib.sha256(data).hexdigest()
            else:
                oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            blob = folder / "blobs" / oid
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = folder / "snapshots" / sha / "build" / variant / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    return folder


@pytest.fixture
def kcache(tmp_path, monkeypatch):
    for var in ("LOCAL_KERNELS", "KERNEL_LOADER_TRUSTED_ORGS", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KERNEL_LOADER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KERNEL_LOADER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    loader.clear_memo()
    yield tmp_path / "cache"
    loader.clear_memo()


def _outside(tmp_path, marker):
    """A folder outside the cache whose package, if ever run, leaves ``marker`` behind."""
    code = f"open({str(marker)!r}, 'w').close()\ndef answer():\n    return 666\n"
    out = tmp_path / "outside"
    (out / "toy").mkdir(parents=True, exist_ok=True)
    (out / "toy" / "__init__.py").write_text(code)
    (out / "toy" / "_impl.py").write_text(code)
    (out / "metadata.json").write_text('{"name": "toy"}')
    return out


def test_links_into_the_same_repos_blobs_load(kcache):
    make_linked_cache(kcache, "kernels-community/linked", SHA, {"torch-universal": toy_files(3)})
    assert kernel_loader.get_kernel("kernels-community/linked", SHA).answer() == 3


@pytest.mark.parametrize("what", ["file", "package folder", "variant folder", "snapshot"])
def test_a_link_out_of_the_snapshot_is_refused_before_import(kcache, tmp_path, what):
    folder = make_linked_cache(kcache, "kernels-community/escape", SHA, {"torch-universal": toy_files(3)})
    marker = tmp_path / "ran-outside"
    outside = _outside(tmp_path, marker)
    snapshot = folder / "snapshots" / SHA
    link, target = {
        "file": (snapshot / "build/torch-universal/toy/_impl.py", outside / "toy" / "_impl.py"),
        "package folder": (snapshot / "build/torch-universal/toy", outside / "toy"),
        "variant folder": (snapshot / "build/torch-universal", outside),
        "snapshot": (snapshot, tmp_path / "outside-snapshot"),
    }[what]
    if what == "snapshot":
        (target / "build").mkdir(parents=True)
        (target / "build" / "torch-universal").symlink_to(outside)
    os.replace(link, link.with_name(".gone")) if not link.is_dir() or link.is_symlink() else os.rename(link, link.with_name(".gone"))
    link.symlink_to(target)
    with pytest.raises(KernelIntegrityError) as info:
        kernel_loader.get_kernel("kernels-community/escape", SHA)
    assert f"{link} is a link to {os.path.realpath(target)}" in str(info.value)
    assert not marker.exists()


def test_a_link_into_another_repos_blobs_is_refused(kcache, tmp_path):
    mine = make_linked_cache(kcache, "kernels-community/mine", SHA, {"torch-universal": toy_files(1)})
    theirs = make_linked_cache(kcache, "kernels-community/theirs", SHA, {"torch-universal": toy_files(2)})
    impl = mine / "snapshots" / SHA / "build/torch-universal/toy/_impl.py"
    impl.unlink()
    impl.symlink_to(os.path.realpath(theirs / "snapshots" / SHA / "build/torch-universal/toy/_impl.py"))
    with pytest.raises(KernelIntegrityError, match=f"outside {os.path.realpath(mine)}/snapshots/{SHA} or .*mine/blobs"):
        kernel_loader.get_kernel("kernels-community/mine", SHA)


@pytest.mark.parametrize("name", ["/abs/outside/toy", "../../outside/toy", "toy/../../x", "import", "a b"])
def test_a_metadata_package_name_must_be_a_plain_identifier(kcache, tmp_path, name):
    marker = tmp_path / "ran-outside"
    _outside(tmp_path, marker)
    files = {k: v for k, v in toy_files(1).items() if k != "metadata.json"}
    files["metadata.json"] = json.dumps({"name": name})
    make_linked_cache(kcache, "kernels-community/named", SHA, {"torch-universal": files})
    with pytest.raises(KernelMetadataError, match="plain package name"):
        kernel_loader.get_kernel("kernels-community/named", SHA)
    assert not marker.exists()


def test_a_variant_folder_that_is_a_file_is_refused(tmp_path):
    fake = tmp_path / "build" / "torch-universal"
    fake.parent.mkdir(parents=True)
    fake.write_text("not a folder")
    with pytest.raises(KernelIntegrityError, match="is not a folder"):
        importer.import_variant(fake, "_kl_test_file_variant", "o/file variant torch-universal")


def test_two_repos_with_the_same_package_name_stay_apart(kcache):
    make_linked_cache(kcache, "kernels-community/first", SHA, {"torch-universal": toy_files(1, "samepkg")})
    make_linked_cache(kcache, "kernels-community/second", SHA, {"torch-universal": toy_files(2, "samepkg")})
    a = kernel_loader.get_kernel("kernels-community/first", SHA)
    b = kernel_loader.get_kernel("kernels-community/second", SHA)
    assert (a.answer(), b.answer()) == (1, 2) and a.__name__ != b.__name__
    assert "samepkg" not in sys.modules


def test_a_submodule_swapped_for_a_link_after_loading_is_refused(kcache, tmp_path):
    folder = make_linked_cache(kcache, "kernels-community/late", SHA, {"torch-universal": toy_files(1)})
    module = kernel_loader.get_kernel("kernels-community/late", SHA)
    late = folder / "snapshots" / SHA / "build/torch-universal/toy/late.py"
    late.unlink()
    outside = tmp_path / "evil.py"
    outside.write_text("raise SystemExit('ran outside')\n")
    late.symlink_to(outside)
    with pytest.raises(KernelIntegrityError, match=f"{late} is a link to {outside}"):
        __import__(f"{module.__name__}.late")


def test_bytecode_without_source_is_not_imported(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_LOADER_STATE_DIR", str(tmp_path / "state"))
    folder = _write(tmp_path / "pyc", {"__init__.py": "X = 1\n"})
    import py_compile

    src = _write(tmp_path / "src", {"hidden.py": "Y = 2\n"}) / "hidden.py"
    py_compile.compile(str(src), cfile=str(folder / "hidden.pyc"))
    module = importer.import_variant(folder, "_kl_test_pyc", "o/pyc")
    with pytest.raises(KernelIntegrityError, match="bytecode without source"):
        __import__("_kl_test_pyc.hidden")
    assert module.X == 1


# -- safe import ------------------------------------------------------------------------------------


def test_system_exit_in_a_kernel_becomes_kernel_import_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_LOADER_STATE_DIR", str(tmp_path / "state"))
    folder = _write(tmp_path / "exits", {"__init__.py": "import sys\nsys.exit(7)\n"})
    with pytest.raises(KernelImportError, match=r"SystemExit\(7\)") as info:
        importer.import_variant(folder, "_kl_test_exit", "o/exits@x variant torch-universal")
    assert isinstance(info.value.__cause__, SystemExit) and "_kl_test_exit" not in sys.modules


def test_keyboard_interrupt_in_a_kernel_propagates(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_LOADER_STATE_DIR", str(tmp_path / "state"))
    folder = _write(tmp_path / "intr", {"__init__.py": "raise KeyboardInterrupt\n"})
    with pytest.raises(KeyboardInterrupt):
        importer.import_variant(folder, "_kl_test_intr", "o/intr")
    assert "_kl_test_intr" not in sys.modules


def test_a_hung_kernel_warns_and_does_not_block_other_kernels(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KERNEL_LOADER_STATE_DIR", str(tmp_path / "state"))
    release = tmp_path / "release"
    hung = _write(tmp_path / "hung", {"__init__.py": (
        "import os, time\n"
        f"while not os.path.exists({str(release)!r}):\n    time.sleep(0.01)\nDONE = True\n")})
    quick = _write(tmp_path / "quick", {"__init__.py": "OK = 1\n"})
    results = {}
    caplog.set_level(logging.WARNING, logger="kernel_loader")
    worker = threading.Thread(target=lambda: results.setdefault(
        "hung", importer.import_variant(hung, "_kl_test_hung", "o/hung@x variant torch-universal", warn_after=0.2)))
    worker.start()
    try:
        time.sleep(0.1)
        start = time.perf_counter()
        assert importer.import_variant(quick, "_kl_test_quick", "o/quick").OK == 1
        assert time.perf_counter() - start < 2 and worker.is_alive()  # the other kernel did not wait
        deadline = time.time() + 10
        while "o/hung@x variant torch-universal" not in caplog.text and time.time() < deadline:
            time.sleep(0.05)
        assert "has not finished after" in caplog.text and "o/hung@x variant torch-universal" in caplog.text
    finally:
        release.touch()
        worker.join(10)
    assert results["hung"].DONE
