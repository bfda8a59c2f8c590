"""Resolution against a real Hub-compatible server (olah on 127.0.0.1, see hub_server.py)."""

import pytest

import kernel_loader
from kernel_loader import cache, loader
from kernel_loader.errors import (
    KernelNotFoundError,
    NoCompatibleVariantError,
    OfflineKernelMissingError,
    UntrustedKernelError,
)
from kernel_loader.machine import Machine
from kernel_loader.sources import bundled
from test_loader import OTHER, fresh_memo, kernel_files, make_repo, two_variant_files  # noqa: F401 (fixture)

def repo_files(value: int, name: str = "toy") -> dict[str, str]:
    return {**two_variant_files(value, name), "README.md": "test kernel\n"}


@pytest.fixture(scope="module")
def versioned(hub_server):
    """kernels-community/<fresh>: main (value 3), v1 (1), v2 (2), tag t1 -> v1."""
    repo_id = hub_server.new_repo_id("toy", org="kernels-community")
    v1 = hub_server.add_repo(repo_id, repo_files(1))
    hub_server.create_branch(repo_id, "v1", v1)
    hub_server.tag(repo_id, "t1", v1)
    v2 = hub_server.commit(repo_id, repo_files(2))
    hub_server.create_branch(repo_id, "v2", v2)
    main = hub_server.commit(repo_id, repo_files(3))
    return {"repo_id": repo_id, "v1": v1, "v2": v2, "main": main}


def test_versions_revisions_and_only_chosen_variant_downloaded(hub_env, versioned):
    repo_id = versioned["repo_id"]
    latest = kernel_loader.get_kernel(repo_id)
    assert latest.answer() == 2  # highest vN, not main
    res = latest.__kernel_resolution__
    assert (res.source, res.resolved_revision, res.sha, res.variant) == ("hub", "v2", versioned["v2"], "torch-universal")
    assert kernel_loader.get_kernel(repo_id, version=1).answer() == 1
    assert kernel_loader.get_kernel(repo_id, "main").answer() == 3
    assert kernel_loader.get_kernel(f"{repo_id}@t1").answer() == 1
    assert kernel_loader.get_kernel(repo_id, versioned["v2"]).answer() == 2
    # two revisions side by side, distinct modules
    one, two = kernel_loader.get_kernel(repo_id, version=1), kernel_loader.get_kernel(repo_id, version=2)
    assert one.__name__ != two.__name__ and (one.answer(), two.answer()) == (1, 2)
    # only build/torch-universal was fetched, into KERNEL_LOADER_CACHE, with refs for offline use
    snapshot = cache.find_snapshot(repo_id, "v2", hub_env.cache_dir)
    assert snapshot is not None and snapshot.sha == versioned["v2"]
    assert snapshot.variants() == ["torch-universal"]
    assert not (snapshot.path / "README.md").exists()
    assert cache.cached_versions(repo_id, hub_env.cache_dir) == {1: versioned["v1"], 2: versioned["v2"]}
    assert not any(hub_env.hf_cache.glob("*--*")) if hub_env.hf_cache.exists() else True


def test_warm_cache_and_server_stopped(hub_env, hub_server, versioned):
    repo_id = versioned["repo_id"]
    kernel_loader.get_kernel(repo_id, version=1)
    loader.clear_memo()
    with hub_server.offline():
        pinned = kernel_loader.get_kernel(repo_id, versioned["v1"])  # sha: no network call at all
        assert pinned.answer() == 1 and pinned.__kernel_resolution__.source == "cache"
        assert "sha pinned" in " ".join(pinned.__kernel_resolution__.notes)
        by_version = kernel_loader.get_kernel(repo_id, version=1)  # Hub unreachable: cache refs
        assert by_version.answer() == 1
        assert "unreachable" in " ".join(by_version.__kernel_resolution__.notes)
        with pytest.raises(OfflineKernelMissingError, match=f"kernel-loader download {repo_id}"):
            kernel_loader.get_kernel(repo_id, version=2)
    hub_env.set_offline()
    loader.clear_memo()
    assert kernel_loader.get_kernel(repo_id, version=1).answer() == 1
    assert kernel_loader.get_kernel(repo_id).answer() == 1  # offline "latest" = highest cached vN
    assert "HF_HUB_OFFLINE" in " ".join(kernel_loader.get_kernel(repo_id).__kernel_resolution__.notes)


def test_not_found_errors_name_what_exists(hub_env, versioned):
    repo_id = versioned["repo_id"]
    with pytest.raises(KernelNotFoundError, match="v1, v2") as info:
        kernel_loader.get_kernel(repo_id, version=7)
    assert "kernel-loader explain" in str(info.value)
    with pytest.raises(KernelNotFoundError, match="not found"):
        kernel_loader.get_kernel(repo_id, "no-such-branch")
    with pytest.raises(KernelNotFoundError, match="not found"):
        kernel_loader.get_kernel("kernels-community/does-not-exist-anywhere")
    with pytest.raises(KernelNotFoundError, match="not found"):
        kernel_loader.get_kernel(repo_id, "f" * 40)
    assert not kernel_loader.has_kernel(repo_id, version=7)
    assert kernel_loader.has_kernel(repo_id, version=1)


def test_variant_choice_with_a_fake_machine(hub_env, versioned):
    gpu = Machine("2.7", True, "cuda", "11.8", "x86_64", "linux", (8, 0))
    res = kernel_loader.resolve_kernel(versioned["repo_id"], version=1, machine=gpu)
    assert res.variant == OTHER and res.path.is_dir()
    assert [d.variant for d in res.decisions if d.accepted] == [OTHER, "torch-universal"]
    mac = Machine("2.7", None, "metal", None, "aarch64", "darwin")
    assert kernel_loader.resolve_kernel(versioned["repo_id"], version=1, machine=mac).variant == "torch-universal"


def test_arch_mismatch_from_hub_metadata(hub_env, hub_server):
    repo_id = hub_server.new_repo_id("archy", org="kernels-community")
    files = {f"build/torch-universal/{k}": v for k, v in kernel_files(1, archs=["9.0a"]).items()}
    hub_server.add_repo(repo_id, files)
    t4 = Machine("2.8", True, "cuda", "12.8", "x86_64", "linux", (7, 5))
    with pytest.raises(NoCompatibleVariantError, match="capability 7.5") as info:
        kernel_loader.resolve_kernel(repo_id, machine=t4)
    assert info.value.decisions[0].variant == "torch-universal"
    h100 = Machine("2.8", True, "cuda", "12.8", "x86_64", "linux", (9, 0))
    assert kernel_loader.resolve_kernel(repo_id, machine=h100, download=False).variant == "torch-universal"


def test_untrusted_org_refused_before_download(hub_env, hub_server):
    repo_id = hub_server.new_repo_id("evil", org="stranger")
    hub_server.add_repo(repo_id, repo_files(1))
    with pytest.raises(UntrustedKernelError):
        kernel_loader.get_kernel(repo_id)
    assert not any(hub_env.cache_dir.iterdir())
    assert kernel_loader.get_kernel(repo_id, trust_remote_code=True).answer() == 1


def test_shipped_copy_when_hub_lacks_repo(hub_env, tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    make_repo(shipped / "kernels-community" / "only-shipped", {"torch-universal": kernel_files(8)})
    monkeypatch.setattr(bundled, "bundled_root", lambda: shipped)
    monkeypatch.setattr(bundled, "_warned", set())
    with pytest.warns(bundled.BundledKernelWarning, match="has no kernels-community/only-shipped"):
        module = kernel_loader.get_kernel("kernels-community/only-shipped")
    assert module.answer() == 8 and module.__kernel_resolution__.source == "bundled"


def test_explain_then_load_with_metadata_only_in_cache(hub_env, versioned):
    repo_id = versioned["repo_id"]
    res = kernel_loader.resolve_kernel(repo_id, version=1, download=False)  # reads metadata.json only
    assert res.path is None and res.variant == "torch-universal"
    assert cache.find_snapshot(repo_id, versioned["v1"], hub_env.cache_dir) is None  # nothing written
    assert kernel_loader.get_kernel(repo_id, version=1).answer() == 1


def test_shipped_repo_served_by_the_hub_is_fetched_not_bundled(hub_env, hub_server, recwarn):
    sha = hub_server.add_shipped_repo("kernels-community/flash-attn2", versions=(1,))
    res = kernel_loader.resolve_kernel("kernels-community/flash-attn2", version=1)
    assert (res.source, res.sha, res.variant) == ("hub", sha, "torch-universal")
    assert (res.path / "metadata.json").is_file()
    assert not [w for w in recwarn if issubclass(w.category, bundled.BundledKernelWarning)]


def test_backend_environment_override(hub_env, versioned, monkeypatch):
    monkeypatch.setenv("KERNEL_LOADER_BACKEND", "cpu")
    gpu = Machine("2.7", True, "cuda", "11.8", "x86_64", "linux", (8, 0))
    res = kernel_loader.resolve_kernel(versioned["repo_id"], version=1, machine=gpu, download=False)
    assert res.variant == "torch-universal"  # the CUDA build is skipped: backend forced to cpu
    monkeypatch.setenv("KERNEL_LOADER_BACKEND", "rocm")
    with pytest.raises(kernel_loader.InvalidKernelRefError, match="not available"):
        kernel_loader.resolve_kernel(versioned["repo_id"], version=1, machine=gpu, download=False)


def test_a_hub_repo_with_no_build_for_this_machine_falls_back_to_the_shipped_copy(hub_env, hub_server, tmp_path, monkeypatch):
    # The real Hub's kernels-community/flash-attn2 has only CUDA builds: a CPU host that reaches
    # the Hub gets the shipped copy, with a warning naming the rejected Hub builds.
    repo_id = hub_server.new_repo_id("cudaonly", org="kernels-community")
    sha = hub_server.add_repo(repo_id, {f"build/{OTHER}/{k}": v for k, v in kernel_files(4).items()})
    hub_server.create_branch(repo_id, "v1", sha)
    shipped = tmp_path / "shipped"
    make_repo(shipped / repo_id, {"torch-universal": kernel_files(9)})
    monkeypatch.setattr(bundled, "bundled_root", lambda: shipped)
    monkeypatch.setattr(bundled, "_warned", set())
    with pytest.warns(bundled.BundledKernelWarning, match="fits this machine"):
        module = kernel_loader.get_kernel(repo_id, version=1)
    res = module.__kernel_resolution__
    assert module.answer() == 9 and res.source == "bundled"
    assert any(OTHER in note for note in res.notes)  # the rejected Hub build is in the record
    loader.clear_memo()
    monkeypatch.setenv("KERNEL_LOADER_NO_BUNDLED", "1")
    with pytest.raises(NoCompatibleVariantError, match=OTHER):
        kernel_loader.get_kernel(repo_id, version=1)
