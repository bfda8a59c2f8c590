"""The kernel-loader command line, run in-process (main(argv)) against the loopback Hub."""

import json
import os
import subprocess
import sys

import pytest

from kernel_loader import cache, cli, loader
from test_loader import OTHER, fresh_memo, kernel_files, two_variant_files  # noqa: F401 (fixture)

@pytest.fixture(scope="module")
def cli_repo(hub_server):
    repo_id = hub_server.new_repo_id("clitoy", org="kernels-community")
    sha = hub_server.add_repo(repo_id, two_variant_files(21, "clitoy", other_value=22))
    hub_server.create_branch(repo_id, "v1", sha)
    return repo_id, sha


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_download_one_variant_then_all(hub_env, cli_repo, capsys, tmp_path):
    repo_id, sha = cli_repo
    code, out, _ = run(capsys, "download", repo_id, "--json")
    assert code == 0
    [row] = json.loads(out)
    assert row["sha"] == sha and row["variants"] == ["torch-universal"]
    assert cache.find_snapshot(repo_id, sha, hub_env.cache_dir).variants() == ["torch-universal"]
    other = tmp_path / "elsewhere"
    code, out, _ = run(capsys, "download", f"{repo_id}@v1", "--all-variants", "--cache-dir", str(other))
    assert code == 0 and "torch-universal" in out and OTHER in out
    assert cache.find_snapshot(repo_id, "v1", other).variants() == sorted(["torch-universal", OTHER])


def test_explain_variants_and_exit_codes(hub_env, cli_repo, capsys):
    repo_id, sha = cli_repo
    code, out, _ = run(capsys, "explain", repo_id)
    assert code == 0
    assert "source:   hub" in out and sha in out and "torch-universal" in out and "torch 2.7" in out
    code, out, _ = run(capsys, "explain", repo_id, "--json")
    data = json.loads(out)
    assert data["variant"] == "torch-universal" and data["sha"] == sha and len(data["decisions"]) == 2
    gpu = json.dumps({"torch_version": "2.7", "cxx11_abi": True, "backend": "cuda", "backend_version": "11.8",
                      "cpu_arch": "x86_64", "os": "linux", "gpu_capability": [8, 0]})
    code, out, _ = run(capsys, "variants", repo_id, "--machine", gpu)
    assert code == 0 and out.splitlines()[0].strip().startswith("ok  [0] " + OTHER)
    mac = json.dumps({"torch_version": "2.7", "cxx11_abi": None, "backend": "cpu", "backend_version": None,
                      "cpu_arch": "aarch64", "os": "darwin"})
    code, out, _ = run(capsys, "variants", repo_id, "--machine", mac, "--json")
    assert code == 0 and [d["accepted"] for d in json.loads(out)] == [True, False]
    assert run(capsys, "explain", "not a/valid id")[0] == cli.EXIT_USAGE
    code, _, err = run(capsys, "explain", "kernels-community/nope-nothing-here")
    assert code == cli.EXIT_NOT_FOUND and "not found" in err
    code, _, err = run(capsys, "download", "stranger/thing")
    assert code == cli.EXIT_UNTRUSTED and "trust" in err
    assert run(capsys, "download")[0] == cli.EXIT_USAGE


def test_explain_no_compatible_variant(hub_env, hub_server, capsys):
    repo_id = hub_server.new_repo_id("gpuonly", org="kernels-community")
    hub_server.add_repo(repo_id, {f"build/{OTHER}/{k}": v for k, v in kernel_files(1, "gpuonly").items()})
    code, out, _ = run(capsys, "explain", repo_id)
    assert code == cli.EXIT_NO_VARIANT and OTHER in out and "torch 2.7" in out


@pytest.mark.filterwarnings("ignore::kernel_loader.sources.bundled.BundledKernelWarning")
def test_explain_attention_backend_name(hub_env, capsys):
    code, out, _ = run(capsys, "explain", "flash_attention_2")
    assert code == 0 and "flash" in out.lower()


def test_cache_ls_and_prune(hub_env, hub_server, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no kernels.lock around
    repo_id = hub_server.new_repo_id("prunable", org="kernels-community")
    first = hub_server.add_repo(repo_id, {f"build/torch-universal/{k}": v for k, v in kernel_files(1, "prunable").items()})
    assert run(capsys, "download", f"{repo_id}@main")[0] == 0
    second = hub_server.commit(repo_id, {f"build/torch-universal/{k}": v for k, v in kernel_files(2, "prunable").items()})
    assert run(capsys, "download", f"{repo_id}@main")[0] == 0
    code, out, _ = run(capsys, "cache", "ls", "--json")
    [repo] = [r for r in json.loads(out)["repos"] if r["repo_id"] == repo_id]
    assert set(repo["snapshots"]) == {first, second} and repo["refs"]["main"] == second
    code, out, _ = run(capsys, "cache", "prune", "--dry-run")
    assert code == 0 and first in out
    assert (hub_env.cache_dir / f"models--{repo_id.replace('/', '--')}" / "snapshots" / first).is_dir()
    code, out, _ = run(capsys, "cache", "prune")
    assert code == 0
    snaps = hub_env.cache_dir / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    assert sorted(p.name for p in snaps.iterdir()) == [second]
    code, out, _ = run(capsys, "cache", "ls")
    assert repo_id in out and second[:12] in out and "[main]" in out
    # a snapshot fetched by sha only (as `download --lock` does) has no ref: prune keeps it
    pinned = hub_server.new_repo_id("pinned", org="kernels-community")
    pinned_sha = hub_server.add_repo(pinned, {f"build/torch-universal/{k}": v for k, v in kernel_files(1, "pinned").items()})
    assert run(capsys, "download", f"{pinned}@{pinned_sha}")[0] == 0
    run(capsys, "cache", "prune")
    assert cache.find_snapshot(pinned, pinned_sha, hub_env.cache_dir) is not None


def test_doctor_json(hub_env, capsys):
    code, out, _ = run(capsys, "doctor", "--json")
    data = json.loads(out)
    assert code == 0 and data["endpoint"] == hub_env.endpoint and data["endpoint_status"].startswith("reachable")
    assert data["machine"]["backend"] in ("cpu", "cuda", "rocm", "xpu", "metal")
    assert data["cache"]["path"] == str(hub_env.cache_dir)


def test_python_dash_m_entry_point(tmp_path):
    env = {**os.environ, "KERNEL_LOADER_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "kernel_loader", "cache", "ls"], capture_output=True, text=True,
                          env=env, cwd=os.path.dirname(os.path.dirname(__file__)), timeout=120)
    assert proc.returncode == 0 and str(tmp_path) in proc.stdout


def test_download_refuses_to_call_the_shipped_copy_a_download(hub_env, hub_server, capsys, monkeypatch, tmp_path):
    from kernel_loader.sources import bundled
    from test_loader import make_repo

    shipped = tmp_path / "shipped"
    make_repo(shipped / "kernels-community" / "shipped-only", {"torch-universal": kernel_files(1, "shipped_only")})
    monkeypatch.setattr(bundled, "bundled_root", lambda: shipped)
    monkeypatch.setattr(bundled, "_warned", {"kernels-community/shipped-only"})
    code, _, err = run(capsys, "download", "kernels-community/shipped-only")
    assert code == cli.EXIT_NOT_FOUND and "Could not download" in err


# -- global flags anywhere, several ids ----------------------------------------------------------


def _two_snapshots(hub_server, name):
    """A repo downloaded at two commits of main: prune removes the first."""
    repo_id = hub_server.new_repo_id(name, org="kernels-community")
    first = hub_server.add_repo(repo_id, {f"build/torch-universal/{k}": v for k, v in kernel_files(1, name).items()})
    return repo_id, first


def test_global_flags_before_or_after_each_verb_and_sub_verb(hub_env, hub_server, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    repo_id, first = _two_snapshots(hub_server, "flagsprune")
    other = tmp_path / "other-cache"
    assert run(capsys, "--cache-dir", str(other), "download", f"{repo_id}@main")[0] == 0
    hub_server.commit(repo_id, {f"build/torch-universal/{k}": v for k, v in kernel_files(2, "flagsprune").items()})
    assert run(capsys, "download", f"{repo_id}@main", "--cache-dir", str(other))[0] == 0
    assert run(capsys, "download", f"{repo_id}@main")[0] == 0  # the default cache has one snapshot
    code, out, _ = run(capsys, "cache", "--cache-dir", str(other), "prune", "--json")
    assert code == 0 and any(first in p for p in json.loads(out)["removed"])
    assert all(str(other) in p for p in json.loads(out)["removed"])  # never the default cache
    for argv in (["--json", "cache", "ls"], ["cache", "--json", "ls"], ["cache", "ls", "--json"]):
        code, out, _ = run(capsys, *argv, "--cache-dir", str(other))
        assert code == 0 and json.loads(out)["cache"] == str(other), argv


def test_explain_and_variants_take_several_ids(hub_env, cli_repo, capsys):
    repo_id, sha = cli_repo
    code, out, _ = run(capsys, "explain", repo_id, "kernels-community/flash-attn2", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["repo_id"] for r in rows] == [repo_id, "kernels-community/flash-attn2"]
    code, out, err = run(capsys, "variants", repo_id, "kernels-community/missing-one")
    assert code == cli.EXIT_NOT_FOUND and f"{repo_id}@{sha[:12]} (hub):" in out and "missing-one" in err


def test_prune_dry_run_lists_exactly_what_prune_removes(hub_env, hub_server, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    repo_id, first = _two_snapshots(hub_server, "dryrun")
    assert run(capsys, "download", f"{repo_id}@main")[0] == 0
    hub_server.commit(repo_id, {f"build/torch-universal/{k}": v for k, v in kernel_files(2, "dryrun").items()})
    assert run(capsys, "download", f"{repo_id}@main")[0] == 0
    dry = json.loads(run(capsys, "cache", "prune", "--dry-run", "--json")[1])["removed"]
    real = json.loads(run(capsys, "cache", "prune", "--json")[1])["removed"]
    assert dry == real and len(real) >= 2  # the snapshot and the blobs only it used


# -- cache rm, info, versions -------------------------------------------------------------------


def test_cache_rm_a_revision_or_a_whole_repo(hub_env, hub_server, capsys):
    repo_id = hub_server.new_repo_id("removable", org="kernels-community")
    sha = hub_server.add_repo(repo_id, two_variant_files(9, "removable"))
    assert run(capsys, "download", f"{repo_id}@main")[0] == 0
    code, out, _ = run(capsys, "cache", "rm", f"{repo_id}@main")
    assert code == 0 and sha in out and "refs/main" in out
    assert cache.find_snapshot(repo_id, sha, hub_env.cache_dir) is None
    folder = next(hub_env.cache_dir.glob("models--*removable*"))
    assert not any((folder / "blobs").iterdir())
    code, _, err = run(capsys, "cache", "rm", f"{repo_id}@main")
    assert code == cli.EXIT_NOT_FOUND and "`kernel-loader cache ls`" in err
    assert run(capsys, "download", f"{repo_id}@main")[0] == 0
    code, out, _ = run(capsys, "cache", "rm", repo_id, "--json")
    assert code == 0 and not folder.exists() and json.loads(out)[0]["removed"] == [str(folder)]


def test_info_of_a_hub_repo_a_cached_one_and_a_local_folder(hub_env, cli_repo, capsys, tmp_path):
    repo_id, sha = cli_repo
    code, out, _ = run(capsys, "info", repo_id, "--json")
    data = json.loads(out)
    assert code == 0 and data["revision"] == "v1" and data["sha"] == sha and data["origin"] == "hub"
    assert (data["name"], data["version"], data["license"]) == ("clitoy", 1, "mit")
    assert data["builds"] == sorted(["torch-universal", OTHER]) and data["backends"] == ["any", "cuda"]
    code, out, _ = run(capsys, "info", repo_id)
    assert code == 0 and "license:    mit" in out and "builds:     torch-universal, " + OTHER in out
    assert run(capsys, "download", f"{repo_id}@v1")[0] == 0
    hub_env.set_offline(True)
    data = json.loads(run(capsys, "info", repo_id, "--json")[1])
    assert data["origin"] == "cache" and data["builds"] == ["torch-universal"]
    from test_loader import make_repo

    make_repo(tmp_path / "localk", {"torch-universal": kernel_files(1, "localk", depends=["einops"])})
    data = json.loads(run(capsys, "info", str(tmp_path / "localk"), "--json")[1])
    assert data["name"] == "localk" and data["python_depends"] == ["einops"] and data["path"] == str(tmp_path / "localk")


def test_versions_lists_vn_branches_and_what_fits_here(hub_env, hub_server, capsys):
    repo_id = hub_server.new_repo_id("versioned", org="kernels-community")
    v1 = hub_server.add_repo(repo_id, {f"build/{OTHER}/{k}": v for k, v in kernel_files(1, "versioned").items()})
    hub_server.create_branch(repo_id, "v1", v1)
    v2 = hub_server.commit(repo_id, two_variant_files(2, "versioned"))
    hub_server.create_branch(repo_id, "v2", v2)
    code, out, _ = run(capsys, "versions", repo_id, "--json")
    data = json.loads(out)
    assert code == 0 and [v["branch"] for v in data["versions"]] == ["v1", "v2"]
    assert data["versions"][0]["usable_here"] == [] and data["versions"][1]["usable_here"] == ["torch-universal"]
    code, out, _ = run(capsys, "versions", repo_id)
    assert "v1" in out and "no build for this machine" in out and "usable here: torch-universal" in out
    assert run(capsys, "versions", f"{repo_id}@v1")[0] == cli.EXIT_USAGE


def test_verify_says_why_a_kernels_format_lock_verifies_nothing(hub_env, cli_repo, capsys, tmp_path):
    repo_id, sha = cli_repo
    assert run(capsys, "download", f"{repo_id}@{sha}")[0] == 0
    lock = tmp_path / "kernels.lock"
    lock.write_text(json.dumps([{"dependency": {"repo-id": repo_id, "version": 1}, "lock": {"commit": sha}}]))
    code, out, _ = run(capsys, "verify", "--lock", str(lock))
    assert code == cli.EXIT_INTEGRITY and "unlocked" in out and "no content hash" in out and "`kernel-loader lock`" in out


# -- explain tells the whole story and writes nothing --------------------------------------------


def _tree(root):
    return sorted((str(p.relative_to(root)), p.lstat().st_mtime_ns) for p in root.rglob("*"))


def test_explain_and_variants_write_nothing_into_the_cache(hub_env, hub_server, capsys):
    repo_id = hub_server.new_repo_id("readonly", org="kernels-community")
    hub_server.add_repo(repo_id, two_variant_files(1, "readonly"))
    before = _tree(hub_env.cache_dir)
    for verb in ("explain", "variants", "info"):
        assert run(capsys, verb, repo_id)[0] == 0
    assert _tree(hub_env.cache_dir) == before == []
    assert run(capsys, "download", repo_id)[0] == 0
    before = _tree(hub_env.cache_dir)
    for offline in (False, True):
        hub_env.set_offline(offline)
        for verb in ("explain", "variants", "info", "versions"):
            assert run(capsys, verb, repo_id)[0] == 0
    assert _tree(hub_env.cache_dir) == before


def test_offline_explain_lists_every_variant_from_the_completion_record(hub_env, cli_repo, capsys):
    repo_id, sha = cli_repo
    assert run(capsys, "download", f"{repo_id}@v1")[0] == 0  # fetches torch-universal only
    online = json.loads(run(capsys, "explain", repo_id, "--json")[1])  # the Hub's listing, not the cache's
    assert online["source"] == "hub" and [d["variant"] for d in online["decisions"]] == ["torch-universal", OTHER]
    hub_env.set_offline(True)
    data = json.loads(run(capsys, "explain", repo_id, "--json")[1])
    assert [d["variant"] for d in data["decisions"]] == ["torch-universal", OTHER]
    code, out, _ = run(capsys, "explain", repo_id)
    assert code == 0 and "ok  [0] torch-universal" in out and f"no      {OTHER}: built for torch 2.7" in out
    assert "from the record written at download (2 variants)" in out
    folder = next(hub_env.cache_dir.glob(f"models--{repo_id.replace('/', '--')}"))
    record = folder / "kernel-loader" / sha / "torch-universal.json"
    record.write_text("{not json")  # a damaged record: that variant is no longer complete; no traceback
    code, out, err = run(capsys, "explain", repo_id)
    assert "Traceback" not in out + err and (code != 0 or "listing of this revision is unknown" in out), (code, out, err)


def test_the_fast_verbs_never_import_torch_nor_huggingface_hubs_api_module(hub_env, cli_repo, tmp_path):
    repo_id, sha = cli_repo
    assert cli.main(["download", f"{repo_id}@v1"]) == 0
    lock = tmp_path / "kernels.lock"
    lock.write_text(json.dumps([{"repo_id": repo_id, "sha": sha, "variants": {}}]))
    verbs = [["--help"], ["cache", "ls"], ["verify", "--lock", str(lock)], ["doctor"], ["explain", repo_id],
             ["variants", repo_id], ["info", repo_id], ["versions", repo_id]]
    code = (
        "import contextlib, io, json, sys\n"
        "from kernel_loader import cli\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        cli.main(argv)\n"
        "    assert 'torch' not in sys.modules, argv\n"
        # the Hub is asked through huggingface_hub's HTTP helpers; HfApi and hf_hub_download
        # (a tenth of a second to import) are for downloads only
        "    assert not {'huggingface_hub.hf_api', 'huggingface_hub.file_download'} & set(sys.modules), argv\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(verbs)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "NumPy" not in proc.stderr


def test_cache_dir_travels_as_an_argument_not_through_the_environment(hub_env, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KERNEL_LOADER_CACHE", raising=False)
    hub_env.set_offline(True)
    elsewhere = tmp_path / "elsewhere-cache"
    from kernel_loader import constants

    def no_default(*_):
        raise AssertionError("the default cache was asked for although --cache-dir was given")

    monkeypatch.setattr(constants, "cache_dir", no_default)
    code, out, _ = run(capsys, "--cache-dir", str(elsewhere), "explain", "flash_attention_2")
    assert code == 0 and str(elsewhere) in out  # the chain's Hub step looked in that cache
    assert "KERNEL_LOADER_CACHE" not in os.environ  # and nothing was handed over through the environment
