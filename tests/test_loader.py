"""get_kernel & co. against local folders and hand-built caches (no server needed here;
Hub behaviour is in test_resolver.py)."""

import json
import sys
import time
import warnings
from pathlib import Path

import pytest

import kernel_loader
from kernel_loader import loader
from kernel_loader.errors import (
    KernelImportError,
    KernelNotFoundError,
    NoCompatibleVariantError,
    OfflineKernelMissingError,
    UntrustedKernelError,
    MissingDependencyError,
)
from kernel_loader.sources import bundled

SHA1 = "1" * 40
SHA2 = "2" * 40


def kernel_files(value: int = 1, name: str = "toy", archs=None, body: str = "", depends=None) -> dict[str, str]:
    """Files of one variant (nested layout) whose module returns ``value`` from ``answer()``."""
    meta = {"name": name, "version": 1, "license": "mit", "backend": {"type": "universal"}}
    if archs:
        meta["backend"]["archs"] = archs
    if depends:
        meta["python-depends"] = depends
    return {
        f"{name}/__init__.py": f"from ._impl import answer\nVALUE = {value}\n{body}",
        f"{name}/_impl.py": f"def answer():\n    return {value}\n",
        "metadata.json": json.dumps(meta),
    }


# a variant this machine never takes (old torch, CUDA 11.8): every two-variant repo has one
OTHER = "torch27-cxx11-cu118-x86_64-linux"


def two_variant_files(value: int, name: str = "toy", other_value: int | None = None) -> dict[str, str]:
    """Repo files with a torch-universal build answering ``value`` and an OTHER build."""
    files = {f"build/torch-universal/{k}": v for k, v in kernel_files(value, name).items()}
    other = 100 + value if other_value is None else other_value
    files.update({f"build/{OTHER}/{k}": v for k, v in kernel_files(other, name).items()})
    return files


@pytest.fixture(autouse=True)
def fresh_memo():
    """Every test starts and ends with an empty get_kernel memo (import it to share it)."""
    loader.clear_memo()
    yield
    loader.clear_memo()


def make_repo(root: Path, variants: dict[str, dict[str, str]]) -> Path:
    """A repo folder with build/<variant>/<files>."""
    for variant, files in variants.items():
        for rel, text in files.items():
            path = root / "build" / variant / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return root


def make_cache(cache: Path, repo_id: str, sha: str, variants, refs=(), repo_type="model") -> Path:
    """A Hugging Face cache entry as a complete download leaves it: files, refs, completion records."""
    import hashlib

    org, name = repo_id.split("/")
    folder = cache / f"{repo_type}s--{org}--{name}"
    snapshot = make_repo(folder / "snapshots" / sha, variants)
    for variant in variants:
        files = {
            p.relative_to(snapshot).as_posix(): {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in (snapshot / "build" / variant).rglob("*") if p.is_file()
        }
        record = {"format": 1, "repo_id": repo_id, "sha": sha, "variant": variant, "files": files,
                  "variants": sorted(variants), "refs": {r: sha for r in refs}}
        (folder / "kernel-loader" / sha).mkdir(parents=True, exist_ok=True)
        (folder / "kernel-loader" / sha / f"{variant}.json").write_text(json.dumps(record))
    for ref in refs:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(sha)
    return folder


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for var in ("LOCAL_KERNELS", "KERNEL_LOADER_TRUSTED_ORGS", "KERNEL_LOADER_NO_BUNDLED", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KERNEL_LOADER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KERNEL_LOADER_STATE_DIR", str(tmp_path / "state"))
    # Nothing here may reach a Hub: a closed port answers "connection refused" at once.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    loader.clear_memo()
    yield
    loader.clear_memo()


def test_local_override_and_resolution_record(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo", {"torch-universal": kernel_files(7), "torch27-cxx11-cu118-x86_64-linux": kernel_files(0)})
    monkeypatch.setenv("LOCAL_KERNELS", f"other/x=/nowhere,myorg/toy={repo}")
    module = kernel_loader.get_kernel("myorg/toy")  # untrusted org is fine: the user pointed at it
    assert module.answer() == 7
    res = module.__kernel_resolution__
    assert res.source == "local" and res.variant == "torch-universal"
    assert res.path == repo / "build" / "torch-universal"
    rejected = [d for d in res.decisions if not d.accepted]
    assert rejected and "torch 2.7" in rejected[0].reason
    text = res.explain()
    assert "LOCAL_KERNELS" in text and "torch-universal" in text and "torch 2.7" in text
    assert json.loads(json.dumps(res.to_json()))["source"] == "local"


def test_local_kernels_colon_and_windows_forms():
    from kernel_loader.sources.local import parse_local_kernels

    assert parse_local_kernels("a/b=/x/y:c/d=/z") == {"a/b": Path("/x/y"), "c/d": Path("/z")}
    parsed = parse_local_kernels(r"a/b=C:\k\b,c/d=D:\k\d")
    assert parsed == {"a/b": Path(r"C:\k\b"), "c/d": Path(r"D:\k\d")}
    assert parse_local_kernels(r"a/b=C:\k\b:c/d=D:\k\d")["a/b"] == Path(r"C:\k\b")
    with pytest.raises(ValueError, match="LOCAL_KERNELS"):
        parse_local_kernels("/just/a/path")


def test_get_local_kernel_accepts_repo_build_or_variant(tmp_path):
    repo = make_repo(tmp_path / "repo", {"torch-universal": kernel_files(3)})
    for path in (repo, repo / "build", repo / "build" / "torch-universal"):
        loader.clear_memo()
        assert kernel_loader.get_local_kernel(path).answer() == 3
    with pytest.raises(KernelNotFoundError, match="no kernel build"):
        kernel_loader.get_local_kernel(tmp_path)


def test_memoized_call_is_fast(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo", {"torch-universal": kernel_files(1)})
    monkeypatch.setenv("LOCAL_KERNELS", f"myorg/toy={repo}")
    first = kernel_loader.get_kernel("myorg/toy")
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        assert kernel_loader.get_kernel("myorg/toy") is first
    per_call = (time.perf_counter() - start) / n
    assert per_call < 10e-6, f"memoized get_kernel took {per_call * 1e6:.2f} µs"


def test_failed_import_leaves_no_module(tmp_path):
    files = kernel_files(1, body="raise RuntimeError('boom')\n")
    repo = make_repo(tmp_path / "bad", {"torch-universal": files})
    before = set(sys.modules)
    with pytest.raises(KernelImportError, match="boom") as info:
        kernel_loader.get_local_kernel(repo)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "kernel-loader explain" in str(info.value)
    assert not [m for m in set(sys.modules) - before if m.startswith("_kernel_loader__")]


def test_sha_pinned_cache_load_two_revisions_side_by_side(tmp_path):
    cache = tmp_path / "cache"
    make_cache(cache, "kernels-community/toy", SHA1, {"torch-universal": kernel_files(1)}, refs=["v1"])
    make_cache(cache, "kernels-community/toy", SHA2, {"torch-universal": kernel_files(2)}, refs=["v2"])
    one = kernel_loader.get_kernel("kernels-community/toy", SHA1)
    two = kernel_loader.get_kernel(f"kernels-community/toy@{SHA2}")
    assert (one.answer(), two.answer()) == (1, 2)
    assert one.__name__ != two.__name__ and one.__name__ in sys.modules and two.__name__ in sys.modules
    assert one.__kernel_resolution__.source == "cache"
    assert one.__kernel_resolution__.sha == SHA1
    assert "no network" in " ".join(one.__kernel_resolution__.notes)


def test_offline_versions_from_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    make_cache(cache, "kernels-community/toy", SHA1, {"torch-universal": kernel_files(1)}, refs=["v1"])
    make_cache(cache, "kernels-community/toy", SHA2, {"torch-universal": kernel_files(2)}, refs=["v2", "main"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert kernel_loader.get_kernel("kernels-community/toy").answer() == 2  # highest vN
    assert kernel_loader.get_kernel("kernels-community/toy", version=1).answer() == 1
    assert kernel_loader.get_kernel("kernels-community/toy", "main").answer() == 2
    with pytest.raises(OfflineKernelMissingError, match="kernel-loader download kernels-community/toy") as info:
        kernel_loader.get_kernel("kernels-community/toy", version=3)
    assert "v1, v2" in str(info.value)
    with pytest.raises(OfflineKernelMissingError):
        kernel_loader.get_kernel("kernels-community/absent", local_files_only=True)
    assert kernel_loader.has_kernel("kernels-community/toy", version=1)
    assert not kernel_loader.has_kernel("kernels-community/toy", version=9)


def test_hub_unreachable_falls_back_to_cache(tmp_path):
    cache = tmp_path / "cache"
    make_cache(cache, "kernels-community/toy5", SHA1, {"torch-universal": kernel_files(5)}, refs=["v1"])
    module = kernel_loader.get_kernel("kernels-community/toy5", version=1)  # HF_ENDPOINT is a closed port
    assert module.answer() == 5
    assert "unreachable" in " ".join(module.__kernel_resolution__.notes)


def test_trust(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    make_cache(cache, "stranger/toy", SHA1, {"torch-universal": kernel_files(4)}, refs=["v1"])
    with pytest.raises(UntrustedKernelError, match="trust_remote_code=True") as info:
        kernel_loader.get_kernel("stranger/toy", SHA1)
    assert "KERNEL_LOADER_TRUSTED_ORGS=stranger" in str(info.value)
    assert kernel_loader.get_kernel("stranger/toy", SHA1, trust_remote_code=True).answer() == 4
    loader.clear_memo()
    monkeypatch.setenv("KERNEL_LOADER_TRUSTED_ORGS", "friends, stranger")
    assert kernel_loader.get_kernel("stranger/toy", SHA1).answer() == 4


def test_no_compatible_variant_lists_every_reason(tmp_path):
    cache = tmp_path / "cache"
    make_cache(
        cache,
        "kernels-community/gpuonly",
        SHA1,
        {"torch27-cxx11-cu118-x86_64-linux": kernel_files(1), "torch-cuda": kernel_files(1)},
    )
    from kernel_loader.machine import Machine

    cpu = Machine("2.8", True, "cpu", None, "x86_64", "linux")
    with pytest.raises(OfflineKernelMissingError) as info:
        kernel_loader.resolve_kernel("kernels-community/gpuonly", SHA1, machine=cpu, local_files_only=True)
    text = str(info.value)
    assert "do not fit" in text and "kernel-loader download kernels-community/gpuonly@" in text
    assert "torch-cuda" in text and "torch27-cxx11-cu118-x86_64-linux" in text and "explain" in text


def test_arch_mismatch_rejected_before_import(tmp_path, monkeypatch):
    from dataclasses import replace

    from kernel_loader.machine import detect_machine

    repo = make_repo(
        tmp_path / "repo",
        {"torch-universal": kernel_files(1, archs=["9.0a"], body="raise SystemExit('imported!')\n")},
    )
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/archy={repo}")
    t4 = replace(detect_machine(), backend="cuda", backend_version="12.8", gpu_capability=(7, 5))
    with pytest.raises(NoCompatibleVariantError, match="capability 7.5"):
        kernel_loader.resolve_kernel("kernels-community/archy", machine=t4)


def test_missing_python_dependency(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo", {"torch-universal": kernel_files(1, depends=["surely-not-installed-pkg"])})
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/deps={repo}")
    with pytest.raises(MissingDependencyError, match="pip install surely-not-installed-pkg"):
        kernel_loader.get_kernel("kernels-community/deps")


def test_bundled_fallback_warns_once_and_can_be_disabled(tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    make_repo(shipped / "kernels-community" / "shippy", {"torch-universal": kernel_files(9)})
    monkeypatch.setattr(bundled, "bundled_root", lambda: shipped)
    monkeypatch.setattr(bundled, "_warned", set())
    with pytest.warns(bundled.BundledKernelWarning, match="kernel-loader download kernels-community/shippy"):
        module = kernel_loader.get_kernel("kernels-community/shippy")  # Hub unreachable, cache empty
    assert module.answer() == 9
    res = module.__kernel_resolution__
    assert res.source == "bundled" and res.resolved_revision == "v1" and len(res.sha) == 64
    loader.clear_memo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second use does not warn again
        kernel_loader.get_kernel("kernels-community/shippy", version=1)
        assert loader.get_bundled_kernel("kernels-community/shippy").answer() == 9
    loader.clear_memo()
    with pytest.raises(OfflineKernelMissingError):
        kernel_loader.get_kernel("kernels-community/shippy", version=2)  # shipped copy is v1
    monkeypatch.setenv("KERNEL_LOADER_NO_BUNDLED", "1")
    loader.clear_memo()
    with pytest.raises(OfflineKernelMissingError):
        kernel_loader.get_kernel("kernels-community/shippy")
    with pytest.raises(KernelNotFoundError, match="KERNEL_LOADER_NO_BUNDLED"):
        loader.get_bundled_kernel("kernels-community/shippy")


def test_revision_and_version_together_is_an_error():
    with pytest.raises(kernel_loader.InvalidKernelRefError, match="not both"):
        kernel_loader.get_kernel("kernels-community/toy", "main", version=1)


def test_fallback_results_are_not_reused_after_the_environment_changes(tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    make_repo(shipped / "kernels-community" / "envy", {"torch-universal": kernel_files(1, "envy")})
    monkeypatch.setattr(bundled, "bundled_root", lambda: shipped)
    monkeypatch.setattr(bundled, "_warned", {"kernels-community/envy"})
    first = kernel_loader.get_kernel("kernels-community/envy")  # Hub unreachable: shipped copy
    assert first.__kernel_resolution__.fallback and kernel_loader.get_kernel("kernels-community/envy") is first
    n = 5000
    start = time.perf_counter()
    for _ in range(n):
        kernel_loader.get_kernel("kernels-community/envy")
    assert (time.perf_counter() - start) / n < 10e-6  # still a memo hit while nothing changed
    cache = tmp_path / "cache"
    make_cache(cache, "kernels-community/envy", "e" * 40, {"torch-universal": kernel_files(2, "envy")}, refs=["v1"])
    assert kernel_loader.get_kernel("kernels-community/envy") is first  # same environment, same answer
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the environment changed: resolve again
    again = kernel_loader.get_kernel("kernels-community/envy")
    assert again.answer() == 2 and again.__kernel_resolution__.source == "cache"
