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
