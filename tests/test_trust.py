import pytest

from kernel_loader import trust
from kernel_loader.errors import UntrustedKernelError


def test_default_and_extra_orgs(monkeypatch):
    monkeypatch.delenv("KERNEL_LOADER_TRUSTED_ORGS", raising=False)
    trust.check_trust("kernels-community/x")
    with pytest.raises(UntrustedKernelError) as info:
        trust.check_trust("acme/x")
    assert "acme/x" in str(info.value) and "KERNEL_LOADER_TRUSTED_ORGS=acme" in str(info.value)
    trust.check_trust("acme/x", trust_remote_code=True)
    monkeypatch.setenv("KERNEL_LOADER_TRUSTED_ORGS", "acme")
    trust.check_trust("acme/x")
    assert not trust.is_trusted("kernels-communityX/x")


# -- every way in ------------------------------------------------------------------------------------

import json  # noqa: E402

import kernel_loader  # noqa: E402
from kernel_loader import cli, hashing  # noqa: E402
from test_importer import SHA, kcache, make_linked_cache, toy_files  # noqa: E402,F401 (fixture)
from test_integrity import _listing, kernels_git_lfs_concat  # noqa: E402

STRANGER = "stranger/toy"


def _locks(variant_dir, files):
    """The same untrusted pin in each lock format kernel_loader reads."""
    digests = hashing.hash_folder(variant_dir)
    return {
        "kernel_loader": [{"repo_id": STRANGER, "sha": SHA, "variants": {"torch-universal": {
            "hash": digests[0], "hash_type": hashing.HASH_TYPE, "files": digests[1]}}}],
        "kernels git_lfs_concat": [{"repo_id": STRANGER, "sha": SHA, "variants": {"torch-universal": {
            "hash": kernels_git_lfs_concat(_listing(files)), "hash_type": "git_lfs_concat"}}}],
        "kernels 0.17": [{"dependency": {"repo-id": STRANGER, "version": 1}, "lock": {"commit": SHA}}],
    }


@pytest.mark.parametrize("fmt", ["kernel_loader", "kernels git_lfs_concat", "kernels 0.17"])
def test_a_lock_entry_is_not_consent(kcache, tmp_path, fmt):
    files = toy_files(8)
    folder = make_linked_cache(kcache, STRANGER, SHA, {"torch-universal": files})
    lock = tmp_path / "kernels.lock"
    lock.write_text(json.dumps(_locks(folder / "snapshots" / SHA / "build/torch-universal", files)[fmt]))
    with pytest.raises(UntrustedKernelError, match="KERNEL_LOADER_TRUSTED_ORGS=stranger"):
        kernel_loader.load_kernel(STRANGER, lockfile=lock)
    assert kernel_loader.load_kernel(STRANGER, lockfile=lock, trust_remote_code=True).answer() == 8


@pytest.mark.parametrize("fmt", ["kernel_loader", "kernels 0.17"])
def test_download_lock_refuses_an_untrusted_org_before_any_network_call(kcache, tmp_path, fmt, capsys):
    files = toy_files(8)
    folder = make_linked_cache(kcache, STRANGER, SHA, {"torch-universal": files})
    lock = tmp_path / "kernels.lock"
    lock.write_text(json.dumps(_locks(folder / "snapshots" / SHA / "build/torch-universal", files)[fmt]))
    # HF_ENDPOINT is a closed port: reaching the network would be exit 3 (not found), not "untrusted"
    assert cli.main(["download", "--lock", str(lock)]) == cli.EXIT_UNTRUSTED
    assert "stranger" in capsys.readouterr().err


def test_offline_and_online_ids_need_consent(kcache, monkeypatch):
    make_linked_cache(kcache, STRANGER, SHA, {"torch-universal": toy_files(8)})
    with pytest.raises(UntrustedKernelError):
        kernel_loader.get_kernel(STRANGER, SHA)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UntrustedKernelError):
        kernel_loader.get_kernel(STRANGER, local_files_only=True)


def test_the_fallback_chain_asks_for_consent_like_any_id(kcache):
    from kernel_loader.attention import fallback

    module, reason = fallback._try_hub(fallback._Option("hub", (STRANGER,)))
    assert module is None and "not trusted" in reason
