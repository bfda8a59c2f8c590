"""The loopback Hub fixture works with huggingface_hub's public API, the way the loader uses it."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import huggingface_hub.file_download  # noqa: F401  imported before hub_env, as in the real suite
import pytest

import hub_server as hub_module


def _port_refuses(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def api(hub_env):
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub_env.endpoint)


def test_refs_branches_and_tags(hub_server, api):
    repo = hub_server.new_repo_id("refs")
    first = hub_server.add_repo(repo, {"a.txt": "one"})
    second = hub_server.commit(repo, {"a.txt": "two"}, message="second")
    hub_server.create_branch(repo, "v1", first)
    hub_server.create_branch(repo, "v2", second)
    assert hub_server.tag(repo, "release", first) == first

    refs = api.list_repo_refs(repo)
    branches = {b.name: b.target_commit for b in refs.branches}
    assert branches == {"main": second, "v1": first, "v2": second}
    assert {t.name: t.target_commit for t in refs.tags} == {"release": first}

    hub_server.delete_branch(repo, "v2")
    assert {b.name for b in api.list_repo_refs(repo).branches} == {"main", "v1"}


def test_model_info_by_branch_tag_and_sha(hub_server, api):
    repo = hub_server.new_repo_id("info")
    first = hub_server.add_repo(repo, {"build/torch-universal/__init__.py": "X = 1\n"})
    second = hub_server.commit(repo, {"extra.txt": b"\x00\x01"}, message="add extra")
    hub_server.tag(repo, "old", first)

    assert api.model_info(repo, revision="main").sha == second
    assert api.model_info(repo, revision="old").sha == first
    info = api.model_info(repo, revision=first)
    assert info.sha == first
    assert {s.rfilename for s in info.siblings} == {"build/torch-universal/__init__.py"}


def test_missing_repo_file_and_revision_answer_401(hub_server, hub_env, api):
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RepositoryNotFoundError

    repo = hub_server.new_repo_id("missing")
    hub_server.add_repo(repo, {"a.txt": "a"})
    with pytest.raises(RepositoryNotFoundError):
        api.model_info(hub_server.new_repo_id("never-created"), revision="main")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info(repo, revision="no-such-branch")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download(repo, "no-such-file.txt", revision="main")


def test_tree_listing(hub_server, api):
    repo = hub_server.new_repo_id("tree")
    hub_server.add_repo(
        repo,
        {
            "build/torch-cuda/pkg/__init__.py": "",
            "build/torch-cuda/metadata.json": "{}",
            "build/torch-cpu/pkg/__init__.py": "",
            "README.md": "readme",
        },
    )
    files = {e.path for e in api.list_repo_tree(repo, revision="main", recursive=True) if hasattr(e, "size")}
    assert files == {
        "build/torch-cuda/pkg/__init__.py",
        "build/torch-cuda/metadata.json",
        "build/torch-cpu/pkg/__init__.py",
        "README.md",
    }
    top = {e.path for e in api.list_repo_tree(repo, path_in_repo="build", revision="main")}
    assert top == {"build/torch-cuda", "build/torch-cpu"}


def test_download_and_snapshot_with_patterns(hub_server, hub_env):
    from huggingface_hub import hf_hub_download, snapshot_download

    repo = hub_server.new_repo_id("download")
    payload = bytes(range(256)) * 7
    sha = hub_server.add_repo(
        repo,
        {
            "build/torch-cuda/k/__init__.py": "CUDA = True\n",
            "build/torch-cpu/k/__init__.py": "CPU = True\n",
            "build/torch-cpu/k/blob.bin": payload,
        },
    )
    # Only the chosen variant's files may land in the cache (what the loader relies on).
    snap = Path(snapshot_download(repo, revision="main", allow_patterns=["build/torch-cuda/*"]))
    got = {p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file()}
    assert got == {"build/torch-cuda/k/__init__.py"}
    assert snap.name == sha and hub_env.hf_cache in snap.parents

    path = Path(hf_hub_download(repo, "build/torch-cpu/k/blob.bin", revision="main"))
    assert path.read_bytes() == payload
    assert path.parent.parent.parent.parent == snap


def test_new_commit_visible_without_restart(hub_server, hub_env, api):
    from huggingface_hub import hf_hub_download

    repo = hub_server.new_repo_id("live")
    hub_server.add_repo(repo, {"k/__init__.py": "V = 1\n", "old.txt": "old"})
    assert Path(hf_hub_download(repo, "k/__init__.py", revision="main")).read_text() == "V = 1\n"
    new_sha = hub_server.commit(repo, {"k/__init__.py": "V = 2\n", "old.txt": None})

    info = api.model_info(repo, revision="main")
    assert info.sha == new_sha
    assert {s.rfilename for s in info.siblings} == {"k/__init__.py"}
    assert Path(hf_hub_download(repo, "k/__init__.py", revision="main")).read_text() == "V = 2\n"


def test_stopped_server_refuses_and_offline_cache_answers(hub_server, hub_env):
    from huggingface_hub import hf_hub_download, snapshot_download

    repo = hub_server.new_repo_id("offline")
    sha = hub_server.add_repo(repo, {"build/torch-cpu/k/__init__.py": "OK = 1\n"})
    online = hf_hub_download(repo, "build/torch-cpu/k/__init__.py", revision="main")

    with hub_server.offline():
        assert not hub_server.running
        assert _port_refuses(hub_server.port)
        hub_env.set_offline()
        assert hf_hub_download(repo, "build/torch-cpu/k/__init__.py", revision="main") == online
        assert Path(snapshot_download(repo, revision=sha)).joinpath(
            "build/torch-cpu/k/__init__.py"
        ).read_text() == "OK = 1\n"
        hub_env.set_offline(False)

    assert hub_server.running
    from huggingface_hub import HfApi

    # Pooled connections from before the restart must not break the next request.
    assert HfApi(endpoint=hub_env.endpoint).model_info(repo, revision="main").sha == sha


def test_hub_env_points_huggingface_hub_at_the_server(hub_server, hub_env):
    import os

    import huggingface_hub
    from huggingface_hub import constants

    assert os.environ["HF_ENDPOINT"] == hub_server.endpoint == constants.ENDPOINT
    assert os.environ["KERNEL_LOADER_CACHE"] == str(hub_env.cache_dir) and hub_env.cache_dir.is_dir()
    assert constants.HF_HUB_CACHE == str(hub_env.hf_cache)
    assert "HF_HUB_OFFLINE" not in os.environ and not constants.HF_HUB_OFFLINE
    repo = hub_server.new_repo_id("env")
    sha = hub_server.add_repo(repo, {"a.txt": "a"})
    # The module-level helpers use an HfApi built at import time.
    assert huggingface_hub.model_info(repo, revision="main").sha == sha


def test_shipped_repo_has_main_and_version_branches(hub_server, api):
    shipped = sorted(p for p in hub_module.KERNEL_REPOS.glob("*/*") if p.is_dir())
    if not shipped:
        pytest.fail("kernel_repos/ holds no repo to serve; the shipped kernel is missing")
    source = shipped[0]
    repo_id = f"{source.parent.name}/{source.name}"
    sha = hub_server.add_shipped_repo(repo_id, versions=(1, 2))
    assert hub_server.add_shipped_repo(repo_id, versions=(1,)) == sha

    branches = {b.name: b.target_commit for b in api.list_repo_refs(repo_id).branches}
    assert branches == {"main": sha, "v1": sha, "v2": sha}
    expected = {
        p.relative_to(source).as_posix()
        for p in source.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }
    served = {s.rfilename for s in api.model_info(repo_id, revision="v1").siblings}
    assert served == expected

    copy_id = hub_server.new_repo_id("shipped-copy")
    hub_server.add_shipped_repo(repo_id, serve_as=copy_id)
    changed = hub_server.commit(copy_id, {"NOTE.txt": "only in the copy"})
    assert api.model_info(copy_id, revision="main").sha == changed
    assert api.model_info(repo_id, revision="main").sha == sha


def test_bad_names_are_refused(hub_server):
    repo = hub_server.new_repo_id("names")
    hub_server.add_repo(repo, {"a.txt": "a"})
    with pytest.raises(ValueError, match="'/'"):
        hub_server.create_branch(repo, "feature/x")
    with pytest.raises(ValueError, match="already exists"):
        hub_server.add_repo(repo, {"a.txt": "b"})
    with pytest.raises(ValueError, match="inside"):
        hub_server.commit(repo, {"../escape.txt": "x"})
    with pytest.raises(ValueError, match="org/name"):
        hub_server.repo_path("no-slash")
    with pytest.raises(ValueError, match="no branch"):
        hub_server.commit(repo, {"a.txt": "c"}, branch="v9")


def test_missing_olah_fails_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv(hub_module.OLAH_ENV_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="olah-cli"):
        hub_module.find_olah()


def test_git_repos_are_plain_clones_olah_can_read(hub_server):
    repo = hub_server.new_repo_id("plain")
    sha = hub_server.add_repo(repo, {"a.txt": "a"})
    path = hub_server.repo_path(repo)
    assert path == hub_server.repos_dir / "models" / repo
    out = subprocess.run(["git", "-C", str(path), "log", "--format=%H"], capture_output=True, text=True)
    assert out.stdout.split() == [sha]


def test_olah_error_answers_the_loader_must_tolerate(hub_server):
    """Pins the olah 0.5.4 behaviour documented in hub_server's docstring."""
    import urllib.error
    import urllib.request

    repo = hub_server.new_repo_id("quirks")
    sha = hub_server.add_repo(repo, {"a.txt": "a"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def status(method: str, path: str) -> int:
        try:
            with opener.open(urllib.request.Request(hub_server.endpoint + path, method=method), timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as err:
            return err.code

    assert status("HEAD", f"/{repo}/resolve/main/missing.json") == 401
    assert status("HEAD", f"/{repo}/resolve/{sha}/missing.json") == 404
    assert status("GET", f"/{repo}/resolve/main/missing.json") == 500
    assert status("GET", f"/api/models/{repo}/revision/no-such-branch") == 401
    assert status("GET", f"/api/kernels/{repo}/revision/main") == 401
    assert status("GET", f"/api/kernels/{repo}/revision/{sha}") == 404
    # a fresh connection after an error answer is served normally
    assert status("GET", f"/{repo}/resolve/main/a.txt") == 200
