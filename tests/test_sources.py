"""The sources: LOCAL_KERNELS parsing, the shipped repos, and the Hub client against olah."""

from pathlib import Path

import pytest

from kernel_loader import cache, hashing, publish
from kernel_loader.sources import bundled, hub, local
from test_loader import kernel_files


def test_local_kernels_forms():
    assert local.parse_local_kernels("a/b=/x,c/d=/y") == {"a/b": Path("/x"), "c/d": Path("/y")}
    assert local.parse_local_kernels("a/b=/x:c/d=/y") == {"a/b": Path("/x"), "c/d": Path("/y")}
    assert local.parse_local_kernels(r"a/b=C:\x\y") == {"a/b": Path(r"C:\x\y")}
    with pytest.raises(ValueError, match="empty path"):
        local.parse_local_kernels("a/b=,c/d=/y")


def test_shipped_repos_are_found_in_the_checkout(monkeypatch):
    monkeypatch.delenv("KERNEL_LOADER_NO_BUNDLED", raising=False)
    assert "kernels-community/flash-attn2" in bundled.bundled_repo_ids()
    root = bundled.bundled_repo("kernels-community/flash-attn2")
    assert root is not None and (root / "build" / "torch-universal" / "metadata.json").is_file()
    assert bundled.bundled_version(root / "build" / "torch-universal") == 1
    assert bundled.bundled_repo("kernels-community/not-shipped") is None
    monkeypatch.setenv("KERNEL_LOADER_NO_BUNDLED", "1")
    assert bundled.bundled_repo("kernels-community/flash-attn2") is None


def test_hub_client_against_olah(hub_env, hub_server, tmp_path):
    repo_id = hub_server.new_repo_id("client", org="kernels-community")
    files = {f"build/torch-universal/{k}": v for k, v in kernel_files(1, "client").items()}
    sha = hub_server.add_repo(repo_id, files)
    hub_server.create_branch(repo_id, "v3", sha)
    settings = hub.HubSettings.from_env()
    remote = hub.remote_repo(repo_id, settings)
    assert remote.repo_type == "model"  # olah answers 401/404 for repo type kernel
    assert remote.branches["main"] == sha and remote.versions() == {3: sha}
    assert hub.list_variants(repo_id, "model", sha, settings) == ["torch-universal"]
    assert hub.commit_exists(repo_id, "model", sha, settings) and not hub.commit_exists(repo_id, "model", "0" * 40, settings)
    assert hub.read_metadata(repo_id, "model", sha, "torch-universal", hub_env.cache_dir, settings)["name"] == "client"
    assert hub.read_metadata(repo_id, "model", sha, "no-such-variant", hub_env.cache_dir, settings) is None
    # the lock's digests from the listing equal those computed from downloaded files
    digests = hub.variant_file_digests(repo_id, "model", sha, "torch-universal", settings)
    listing = hub.list_files(repo_id, "model", sha, settings)
    job = publish.VariantFetch(repo_id, "model", sha, "torch-universal", listing, ["torch-universal"], {"v3": sha})
    snapshot = publish.publish_variant(job, hub_env.cache_dir, settings, lock_timeout=5)
    assert snapshot.name == sha
    assert hashing.hash_folder(snapshot / "build" / "torch-universal", digests) == (hashing.combine(digests), digests)
    assert cache.cached_versions(repo_id, hub_env.cache_dir) == {3: sha}
    with pytest.raises(hub.HubRepoMissing):
        hub.remote_repo("kernels-community/never-created", settings)
    with hub_server.offline():
        with pytest.raises(hub.HubUnreachable):
            hub.remote_repo(repo_id, settings)
    hub_env.set_offline()
    with pytest.raises(hub.HubUnreachable, match="HF_HUB_OFFLINE"):
        hub.remote_repo(repo_id, hub.HubSettings.from_env())
