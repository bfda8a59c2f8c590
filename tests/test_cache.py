"""The cache: layout helpers, and loading from a cache writes nothing into it."""

import os
import subprocess

import pytest

import kernel_loader
from kernel_loader import cache, loader
from kernel_loader.errors import CacheNotWritableError
from cluster_run import tree_state as _tree_state
from test_loader import SHA1, kernel_files, make_cache


def test_snapshot_lookup_refs_and_versions(tmp_path):
    make_cache(tmp_path, "org/k", SHA1, {"torch-universal": kernel_files(1)}, refs=["v1", "main"], repo_type="kernel")
    make_cache(tmp_path, "org/k", "2" * 40, {"torch-universal": kernel_files(2)}, refs=["v2"], repo_type="model")
    assert cache.find_snapshot("org/k", "v1", tmp_path).repo_type == "kernel"
    assert cache.find_snapshot("org/k", "v2", tmp_path).sha == "2" * 40
    assert cache.find_snapshot("org/k", "3" * 40, tmp_path) is None
    assert cache.find_snapshot("org/k", "../../etc", tmp_path) is None
    assert cache.cached_versions("org/k", tmp_path) == {1: SHA1, 2: "2" * 40}
    assert [r.repo_id for r in cache.list_cached(tmp_path)] == ["org/k", "org/k"]
    assert cache.is_sha(SHA1) and not cache.is_sha("v1") and not cache.is_sha(None)


def test_loading_from_a_read_only_cache_writes_nothing(tmp_path, monkeypatch):
    root = tmp_path / "shared-cache"
    make_cache(root, "kernels-community/ro", SHA1, {"torch-universal": kernel_files(31, "ro")}, refs=["v1"])
    monkeypatch.setenv("KERNEL_LOADER_CACHE", str(root))
    monkeypatch.setenv("KERNEL_LOADER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("sys.dont_write_bytecode", False)  # Python would write __pycache__ if it could
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            os.chmod(os.path.join(folder, name), 0o555 if name in dirs else 0o444)
    os.chmod(root, 0o555)
    before = _tree_state(root)
    loader.clear_memo()
    try:
        assert kernel_loader.get_kernel("kernels-community/ro", version=1).answer() == 31
        assert kernel_loader.get_kernel("kernels-community/ro", SHA1).answer() == 31
    finally:
        loader.clear_memo()
        after = _tree_state(root)
        for folder, dirs, files in os.walk(root):
            os.chmod(folder, 0o755)
    assert after == before
    assert not list(root.rglob("__pycache__"))
    assert list((tmp_path / "state" / "bytecode").rglob("*.bin"))  # compiled code went to the state folder



def _set_read_only(root, read_only: bool) -> None:
    """chmod the folders; as root (which ignores modes) also set/clear the immutable flag."""
    folders = [f for f, _, _ in os.walk(root)]
    if os.geteuid() == 0 and not read_only:
        subprocess.run(["chattr", "-i", *folders], capture_output=True)
    for folder in folders:
        os.chmod(folder, 0o555 if read_only else 0o755)
    if os.geteuid() == 0 and read_only:
        try:
            done = subprocess.run(["chattr", "+i", *folders], capture_output=True).returncode == 0
        except FileNotFoundError:
            done = False
        if not done:
            for folder in folders:
                os.chmod(folder, 0o755)
            # Root ignores file modes; without CAP_LINUX_IMMUTABLE (e.g. a default container) there
            # is no way to make a folder read-only for this process.
            pytest.skip("running as root without chattr +i: cannot create a read-only folder here")


def test_read_only_cache_against_the_hub(hub_env, hub_server):
    """A cache this process cannot write: explain works, cached loads work, a needed download
    fails with CacheNotWritableError naming the fix."""
    repo_id = hub_server.new_repo_id("rocache", org="kernels-community")
    sha1 = hub_server.add_repo(repo_id, {f"build/torch-universal/{k}": v for k, v in kernel_files(1, "rocache").items()})
    hub_server.create_branch(repo_id, "v1", sha1)
    sha2 = hub_server.commit(repo_id, {f"build/torch-universal/{k}": v for k, v in kernel_files(2, "rocache").items()})
    hub_server.create_branch(repo_id, "v2", sha2)
    loader.clear_memo()
    kernel_loader.get_kernel(repo_id, version=1)  # warm the cache while it is writable
    loader.clear_memo()
    _set_read_only(hub_env.cache_dir, True)
    try:
        with pytest.raises(OSError):
            (hub_env.cache_dir / "probe").mkdir()  # the cache really is read-only
        before = _tree_state(hub_env.cache_dir)
        res = kernel_loader.resolve_kernel(repo_id, version=2, download=False)  # metadata.json via a temp folder
        assert res.variant == "torch-universal" and res.sha == sha2
        assert kernel_loader.get_kernel(repo_id, version=1).answer() == 1  # cached: read only
        with pytest.raises(CacheNotWritableError, match="KERNEL_LOADER_CACHE") as info:
            kernel_loader.get_kernel(repo_id, version=2)
        assert f"kernel-loader download {repo_id}@v2" in str(info.value)
        assert _tree_state(hub_env.cache_dir) == before
    finally:
        _set_read_only(hub_env.cache_dir, False)
        loader.clear_memo()
