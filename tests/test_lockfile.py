"""Lock files: write from pyproject against the loopback Hub, load pinned with the server stopped,
tamper detection, and both lock formats."""

import json

import pytest

import kernel_loader
from kernel_loader import cli, hashing, loader, locking, lockfile
from kernel_loader.resolver import resolve
from kernel_loader.errors import KernelIntegrityError, LockfileError, OfflineKernelMissingError
from test_loader import OTHER, fresh_memo, kernel_files, two_variant_files  # noqa: F401 (fixture)

@pytest.fixture(scope="module")
def locked_repo(hub_server):
    repo_id = hub_server.new_repo_id("locky", org="kernels-community")
    sha = hub_server.add_repo(repo_id, two_variant_files(11, "locky", other_value=12))
    hub_server.create_branch(repo_id, "v1", sha)
    return repo_id, sha


def _project(tmp_path, repo_id):
    (tmp_path / "pyproject.toml").write_text(f'[project]\nname = "x"\n\n[tool.kernels.dependencies]\n"{repo_id}" = 1\n')
    return tmp_path


def test_lock_download_load_offline_and_tamper(hub_env, hub_server, locked_repo, tmp_path, monkeypatch, capsys):
    repo_id, sha = locked_repo
    (tmp_path / "proj").mkdir()
    project = _project(tmp_path / "proj", repo_id)
    assert cli.main(["lock", str(project)]) == 0
    lock_path = project / "kernels.lock"
    [entry] = json.loads(lock_path.read_text())
    assert entry["repo_id"] == repo_id and entry["sha"] == sha and entry["version"] == 1
    assert set(entry["variants"]) == {"torch-universal", OTHER}
    universal = entry["variants"]["torch-universal"]
    assert universal["hash_type"] == hashing.HASH_TYPE and universal["hash"].startswith("sha256-")
    assert universal["files"]["locky/__init__.py"].startswith("git-sha1:")
    assert not any(hub_env.cache_dir.iterdir())  # locking downloads nothing

    with pytest.raises(OfflineKernelMissingError, match="kernel-loader download --lock"):
        kernel_loader.load_kernel(repo_id, lockfile=lock_path)
    assert cli.main(["download", "--lock", str(lock_path)]) == 0

    monkeypatch.chdir(project)  # default lockfile: ./kernels.lock
    with hub_server.offline():
        module = kernel_loader.load_kernel(repo_id)
        assert module.answer() == 11
        res = module.__kernel_resolution__
        assert res.sha == sha and res.lockfile == str(lock_path)
        assert "files match the lock (remembered)" in res.notes  # `download --lock` verified it already
        loader.clear_memo()
        again = kernel_loader.load_kernel(repo_id, lockfile=lock_path)
        assert "files match the lock (remembered)" in again.__kernel_resolution__.notes
        assert cli.main(["verify", "--lock", str(lock_path)]) == 0

        # tamper with the cached file: refused before import, and `verify` says so
        target = res.path / "locky" / "_impl.py"
        target.write_text(target.read_text().replace("11", "666"))
        loader.clear_memo()
        with pytest.raises(KernelIntegrityError, match=r"changed: locky/_impl.py"):
            kernel_loader.load_kernel(repo_id, lockfile=lock_path)
        capsys.readouterr()
        assert cli.main(["verify", "--lock", str(lock_path), "--json"]) == cli.EXIT_INTEGRITY
        rows = json.loads(capsys.readouterr().out)["results"]
        assert [r["status"] for r in rows] == ["MISMATCH"]


def test_kernels_package_format_round_trip(tmp_path):
    kernels_rust = pytest.importorskip("kernels._rust")
    entries = [lockfile.LockEntry("kernels-community/a", "a" * 40, {}, 1, None),
               lockfile.LockEntry("kernels-community/b", "b" * 40, {}, None, "main")]
    path = lockfile.write_lock(entries, tmp_path / "kernels.lock", fmt="kernels")
    parsed = kernels_rust.KernelLocks.from_json(path.read_text())  # the `kernels` package accepts it
    # commits come back as str (kernels 0.17) or as an Oid whose str() is the hex (0.19)
    assert sorted(str(lock.commit) for lock in parsed.values()) == ["a" * 40, "b" * 40]
    back = lockfile.read_lock(path)
    assert [(e.repo_id, e.sha, e.version, e.revision) for e in back] == [
        ("kernels-community/a", "a" * 40, 1, None), ("kernels-community/b", "b" * 40, None, "main")]


def test_bad_locks_and_pyprojects(tmp_path):
    bad = tmp_path / "kernels.lock"
    for text, match in (("{", "not valid JSON"), ("{}", "JSON list"), ('[{"repo_id": "a/b", "sha": "xyz"}]', "40 hex"),
                        ('[{"repo_id": "../x", "sha": "' + "a" * 40 + '"}]', "invalid repo id")):
        bad.write_text(text)
        with pytest.raises(LockfileError, match=match):
            lockfile.read_lock(bad)
    bad.write_text("[]")
    with pytest.raises(LockfileError, match="not locked"):
        kernel_loader.load_kernel("kernels-community/x", lockfile=bad)
    py = tmp_path / "pyproject.toml"
    py.write_text("[project]\nname='x'\n")
    with pytest.raises(LockfileError, match=r"\[tool.kernels.dependencies\]"):
        lockfile.read_dependencies(py)
    py.write_text('[tool.kernels.dependencies]\n"a/b" = 1\n"c/d" = "v2"\n"e/f" = {revision = "main"}\n')
    assert lockfile.read_dependencies(py) == {"a/b": 1, "c/d": "v2", "e/f": "main"}
    py.write_text('[tool.kernels.dependencies]\n"a/b" = 1.5\n')
    with pytest.raises(LockfileError, match="version number or a revision"):
        lockfile.read_dependencies(py)


def _resolve_locked(repo_id, lock_path):
    """What load_kernel resolves for a lock-pinned kernel (no network call)."""
    path, entry = lockfile.lock_for(repo_id, lock_path)
    return resolve(locking.locked_request(entry, path, download=False))


def test_shipped_copy_serves_a_lock_when_its_files_match(hub_env, hub_server, tmp_path, monkeypatch):
    from kernel_loader.sources import bundled

    sha = hub_server.add_shipped_repo("kernels-community/flash-attn2", versions=(1,))
    entry = locking.lock_entry("kernels-community/flash-attn2", 1)
    assert entry.sha == sha
    lock_path = lockfile.write_lock([entry], tmp_path / "kernels.lock")
    monkeypatch.setattr(bundled, "_warned", set())
    with pytest.warns(bundled.BundledKernelWarning, match="matches the hash locked"):
        res = _resolve_locked("kernels-community/flash-attn2", lock_path)  # empty cache
    assert res.source == "bundled" and res.sha == sha and res.variant == "torch-universal"
    # a lock whose hash differs from the shipped files is not served by the shipped copy
    entry.variants["torch-universal"]["hash"] = "sha256-" + "0" * 64
    lockfile.write_lock([entry], lock_path)
    with pytest.raises(OfflineKernelMissingError, match="kernel-loader download --lock"):
        _resolve_locked("kernels-community/flash-attn2", lock_path)
    monkeypatch.setenv("KERNEL_LOADER_NO_BUNDLED", "1")
    entry = locking.lock_entry("kernels-community/flash-attn2", 1)
    lockfile.write_lock([entry], lock_path)
    with pytest.raises(OfflineKernelMissingError):
        _resolve_locked("kernels-community/flash-attn2", lock_path)


def _kernels_package_lock(hub_server, repo_id, sha):
    """A lock exactly as the `kernels` package's ``get_kernel_locks`` wrote it (format and hash
    algorithm from its lockfile.py): one ``git_lfs_concat`` hash per variant, sha256 over the
    byte-sorted (path in variant, LFS sha256 or git blob id). `kernels` read the ids from
    ``repo_info(files_metadata=True)``; olah leaves ``blob_id`` out there, so the same ids come
    from the recursive tree listing."""
    import hashlib
    from pathlib import Path

    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    tree = HfApi(endpoint=hub_server.endpoint).list_repo_tree(repo_id, path_in_repo="build", revision=sha, recursive=True)
    per_variant = {}
    for item in tree:
        if isinstance(item, RepoFile) and item.path.startswith("build/torch"):
            path = Path(item.path)
            oid = item.lfs.sha256 if item.lfs is not None else item.blob_id
            per_variant.setdefault(path.parts[1], []).append((Path(*path.parts[2:]).as_posix().encode("utf-8"), oid))
    variants = {}
    for variant, files in per_variant.items():
        m = hashlib.sha256()
        for name, oid in sorted(files):
            m.update(name)
            m.update(bytes.fromhex(oid))
        variants[variant] = {"hash": f"sha256-{m.hexdigest()}", "hash_type": "git_lfs_concat"}
    return [{"repo_id": repo_id, "sha": sha, "variants": variants}]


def test_a_lock_written_by_the_kernels_package_loads_and_catches_a_flipped_byte(
    hub_env, hub_server, locked_repo, tmp_path, monkeypatch
):
    from test_integrity import flip_one_byte_keep_mtime

    repo_id, sha = locked_repo
    lock_path = tmp_path / "kernels.lock"
    lock_path.write_text(json.dumps(_kernels_package_lock(hub_server, repo_id, sha), indent=2))
    assert cli.main(["download", "--lock", str(lock_path)]) == 0
    with hub_server.offline():
        module = kernel_loader.load_kernel(repo_id, lockfile=lock_path)
        assert module.answer() == 11 and "files match the lock (remembered)" in module.__kernel_resolution__.notes
        flip_one_byte_keep_mtime(module.__kernel_resolution__.path / "locky" / "_impl.py")
        loader.clear_memo()
        from kernel_loader import importer

        importer._loaded.clear()  # a fresh process would import again
        with pytest.raises(KernelIntegrityError, match="git_lfs_concat: expected sha256-"):
            kernel_loader.load_kernel(repo_id, lockfile=lock_path)


@pytest.mark.parametrize("text", ["tool = 1", "[tool]\nkernels = 'x'", "[tool.kernels]\ndependencies = [1]"])
def test_a_pyproject_whose_tool_tables_are_not_tables_is_a_lockfile_error(tmp_path, text):
    (tmp_path / "pyproject.toml").write_text(text)
    with pytest.raises(LockfileError, match=r"no \[tool.kernels.dependencies\] table"):
        lockfile.read_dependencies(tmp_path / "pyproject.toml")


def test_lock_entries_of_the_wrong_shape_are_lockfile_errors(tmp_path):
    bad = tmp_path / "kernels.lock"
    sha = "a" * 40
    for entry, match in (
        ({"dependency": 5, "lock": {"commit": sha}}, "'dependency' and 'lock' objects"),
        ({"repo_id": "a/b@main", "sha": sha}, "invalid repo id"),
        ({"repo_id": "a/b", "sha": sha, "variants": {"v": "sha256-x"}}, "must map variant names"),
        ({"repo_id": "a/b", "sha": sha, "version": "1"}, "integer version"),
    ):
        bad.write_text(json.dumps([entry]))
        with pytest.raises(LockfileError, match=match):
            lockfile.read_lock(bad)
    bad.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(LockfileError, match="not valid JSON"):
        lockfile.read_lock(bad)
