"""A cluster's path: many ranks, one shared cache, processes killed, servers dying or stalling.

Everything talks real HTTP to the loopback Hub (olah), through tests/fault_proxy.py, which counts
completed file transfers and breaks them on purpose. The stress version (``-m stress``) writes
bench/results/cluster.md and cluster.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import platform
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

import kernel_loader
from cluster_run import drill, expected_answer, kernel_repo_files, tree_state
from fault_proxy import FaultProxy
from kernel_loader import cache, loader
from kernel_loader.errors import KernelDownloadError, OfflineKernelMissingError

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def proxy(hub_server):
    p = FaultProxy(int(hub_server.endpoint.rsplit(":", 1)[1])).start()
    yield p
    p.stop()


@pytest.fixture
def fast_timeouts(monkeypatch):
    for name, value in (("KERNEL_LOADER_READ_TIMEOUT", "1"), ("KERNEL_LOADER_CONNECT_TIMEOUT", "1"), ("KERNEL_LOADER_RETRIES", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KERNEL_LOADER_NO_BUNDLED", "1")


def _drill_repo(hub_server, value=7):
    repo_id = hub_server.new_repo_id("drill", org="test-org")
    sha = hub_server.add_repo(repo_id, kernel_repo_files(value))
    hub_server.create_branch(repo_id, "v1", sha)
    return repo_id, sha


def test_a_mirror_that_never_answers_fails_within_the_bound_naming_it(hub_env, fast_timeouts, monkeypatch):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held = []

    def hold() -> None:  # accept, never answer
        try:
            while True:
                held.append(listener.accept())
        except OSError:
            return

    threading.Thread(target=hold, daemon=True).start()
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    start = time.monotonic()
    try:
        with pytest.raises(OfflineKernelMissingError, match=endpoint.replace(".", r"\.")):
            kernel_loader.get_kernel("test-org/never-answers", trust_remote_code=True)
    finally:
        listener.close()
    # 2 tries of (connect 1 s + read 1 s + backoff) on the refs call of each repo type
    assert time.monotonic() - start < 12


@pytest.mark.parametrize("fault, spare", [("stall_file", 0), ("cut_file", 0), ("cut_file", 4)])
def test_a_download_broken_mid_file_is_our_error_and_the_next_call_heals(
    hub_env, hub_server, proxy, fast_timeouts, monkeypatch, fault, spare
):
    repo_id, sha = _drill_repo(hub_server)
    monkeypatch.setenv("HF_ENDPOINT", proxy.endpoint)
    proxy.mode, proxy.spare = fault, spare
    start = time.monotonic()
    # spare 0: the file broken is metadata.json, read to pick the variant (the Hub "stopped
    # answering" and nothing is cached); spare 4: the server dies in the middle of the package
    expected = KernelDownloadError if spare else OfflineKernelMissingError
    with pytest.raises(expected, match=proxy.endpoint.replace(".", r"\.")) as info:
        kernel_loader.get_kernel(repo_id, version=1, trust_remote_code=True)
    if spare:
        assert "run the same call again" in str(info.value) and "files already fetched are kept" in str(info.value)
    # huggingface_hub resumes a broken transfer 5 times (1 s apart), each bounded by the read timeout
    assert time.monotonic() - start < 2 * 6 * (1 + 1) + 10
    snapshot = cache.find_snapshot(repo_id, sha, hub_env.cache_dir)
    assert snapshot is None or snapshot.variants() == []  # nothing half-done is visible
    proxy.reset_counts()
    proxy.mode = "pass"
    loader.clear_memo()
    assert kernel_loader.get_kernel(repo_id, version=1, trust_remote_code=True).answer() == expected_answer(7)
    assert proxy.duplicates() == 0
    folder = cache.repo_folder(repo_id, "model", hub_env.cache_dir)
    assert not list((folder / "blobs").glob("*.incomplete"))  # the dead transfer's partial blob was cleaned


def test_a_truncated_cached_file_is_fetched_again_not_imported(hub_env, hub_server):
    repo_id, sha = _drill_repo(hub_server, 3)
    kernel_loader.get_kernel(repo_id, version=1, trust_remote_code=True)
    folder = cache.repo_folder(repo_id, "model", hub_env.cache_dir)
    blob = (folder / "snapshots" / sha / "build/torch-universal/drill/m3.py").resolve()
    blob.write_bytes(blob.read_bytes()[:10])  # a process died mid-copy, and the record is gone
    cache.record_path(folder, sha, "torch-universal").unlink()
    loader.clear_memo()
    assert kernel_loader.get_kernel(repo_id, version=1, trust_remote_code=True).answer() == expected_answer(3)


def test_eight_ranks_two_rounds_one_kill(hub_server, proxy, tmp_path):
    figures = drill(hub_server, proxy, tmp_path, processes=8, rounds=2, plan=lambda r: (1 if r == 0 else 0, None), seed=1)
    assert figures.kills == 1
    assert (figures.failures, figures.duplicates_without_kill, figures.partial_snapshots, figures.leftovers) == (0, 0, 0, 0), figures
    assert figures.duplicate_downloads <= figures.kills and figures.cache_writes_offline == 0


@pytest.mark.stress
def test_stress_32_ranks_20_rounds_with_kills_server_death_and_stalls(hub_server, proxy, tmp_path):
    def plan(r):
        fault = {3: "cut_file", 7: "stall_file", 11: "cut_file", 15: "stall_file", 18: "cut_file"}.get(r)
        return (0 if fault else [0, 2, 4, 1][r % 4]), fault

    figures = drill(hub_server, proxy, tmp_path, processes=32, rounds=20, plan=plan, seed=12)
    _write_bench(figures)
    assert (figures.failures, figures.duplicates_without_kill, figures.partial_snapshots, figures.leftovers) == (0, 0, 0, 0), figures
    assert figures.duplicate_downloads <= figures.kills  # at most the one file a killed rank had just received
    assert figures.cache_writes_offline == 0


def _write_bench(figures) -> None:
    import huggingface_hub

    out = REPO_ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    command = "KERNEL_LOADER_OLAH=<olah-cli> python -m pytest -q -m stress tests/test_cluster.py"
    data = {
        "bench": "cluster", "date": time.strftime("%Y-%m-%d"), "command": command, "commit": commit,
        "versions": {"python": platform.python_version(), "huggingface_hub": huggingface_hub.__version__, "cpus": os.cpu_count()},
        **figures.to_json(),
    }
    (out / "cluster.json").write_text(json.dumps(data, indent=2) + "\n")
    f = figures
    (out / "cluster.md").write_text(
        "# Cluster drill: concurrent cold starts into one shared cache\n\n"
        f"Date {data['date']}, commit {commit}, huggingface_hub {huggingface_hub.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, loopback Hub (olah 0.5.4) behind a fault-injecting proxy.\n\n"
        f"Command: `{command}`\n\n"
        "Each round: a fresh 11-file kernel, an empty cache, every rank loads it at once (some rounds kill -9\n"
        "random ranks at random moments, or the server dies / stalls mid-file), then a clean run and an\n"
        "offline load (HF_HUB_OFFLINE=1) by every rank. Timeouts: connect 2 s, read 5 s, 1 retry.\n\n"
        "| processes × rounds | kills | server deaths | stalls | cold-start fault errors (expected) | failures | duplicate downloads (rounds without a kill) | duplicate downloads (all) | partial snapshots | leftovers | offline cache writes | seconds |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        f"| {f.processes} × {f.rounds} | {f.kills} | {f.faults['server_death']} | {f.faults['stall']} | {f.cold_fault_errors} | "
        f"{f.failures} | {f.duplicates_without_kill} | {f.duplicate_downloads} | {f.partial_snapshots} | {f.leftovers} | "
        f"{f.cache_writes_offline} | {f.seconds} |\n\n"
        "A duplicate in a round with a kill is the file a killed rank had fully received but not yet moved\n"
        "from its `.incomplete` name into `blobs/`: the next rank fetches it again. Server deaths and stalls\n"
        "last 3 s each; a rank that gives up during one must get the documented download error (counted in\n"
        "the fault-errors column), every other rank rides it out through huggingface_hub's resumes and our retry.\n\n"
        "Per round (kills, fault, duplicates): "
        + ", ".join(f"{x['round']}: {x['kills']}/{x['fault'] or '-'}/{x['duplicates']}" for x in f.per_round) + "\n\n"
        "No competitor is measured: the `kernels` package asks the Hub only for repo type `kernel`, which a model-type mirror (olah) does not serve.\n"
    )


RECIPE_MARK = "<!-- run-by: tests/test_cluster.py::test_the_cluster_recipe_as_written -->"


def _recipe_blocks() -> list[list[str]]:
    """The console commands of docs/cluster.md marked for this test, block by block."""
    text = (REPO_ROOT / "docs" / "cluster.md").read_text()
    blocks = []
    for part in text.split(RECIPE_MARK)[1:]:
        body = part.split("```console\n", 1)[1].split("```", 1)[0]
        blocks.append([line[2:] for line in body.splitlines() if line.startswith("$ ")])
    return blocks


def test_the_cluster_recipe_as_written(hub_env, hub_server, tmp_path):
    sha = hub_server.add_shipped_repo("kernels-community/flash-attn2", versions=(1,))
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text('[tool.kernels.dependencies]\n"kernels-community/flash-attn2" = 1\n')
    shared = tmp_path / "shared"
    env = {k: v for k, v in os.environ.items() if k not in ("KERNEL_LOADER_CACHE", "HF_HUB_OFFLINE")}
    env.update(SHARED=str(shared), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    prefetch, node = _recipe_blocks()

    def run(line: str) -> str:
        done = subprocess.run(["bash", "-c", line], cwd=project, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    for line in prefetch:
        run(line)
    folder = cache.repo_folder("kernels-community/flash-attn2", "model", shared)
    assert {p.name: p.read_text() for p in (folder / "refs").iterdir()} == {"v1": sha, "main": sha}
    # the nodes: no server, a read-only cache; root ignores modes, so the tree is compared too
    subprocess.run(["chmod", "-R", "a-w", str(shared)], check=True)
    before = tree_state(shared)
    try:
        with hub_server.offline():
            outputs = [run(line).strip() for line in node]
        after = tree_state(shared)
        with pytest.raises(OSError) if os.geteuid() != 0 else contextlib.nullcontext():
            (shared / "probe").mkdir()
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(shared)], check=True)
    assert after == before
    assert outputs[1:] == ["cache", "cache", sha]


def test_torchrun_ranks_use_a_hub_kernel_from_the_shared_cache(hub_env, hub_server, tmp_path):
    """8 torchrun ranks on the CPU, attn_implementation="org/repo", the kernel from an offline shared cache."""
    sha = hub_server.add_shipped_repo("kernels-community/flash-attn2", versions=(1,))
    shared = tmp_path / "shared"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE",)}
    env.update(KERNEL_LOADER_CACHE=str(shared), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    subprocess.run(["kernel-loader", "download", "kernels-community/flash-attn2", "--version", "1"], env=env, check=True,
                   capture_output=True, timeout=120)
    env.update(HF_HUB_OFFLINE="1", KERNEL_LOADER_NO_BUNDLED="1", TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), *sys.path]))
    out = tmp_path / "ranks"
    out.mkdir()
    with hub_server.offline():
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
             str(Path(__file__).with_name("torchrun_job.py")), str(out)],
            env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
        )
    assert done.returncode == 0, done.stderr[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(8)]
    assert {(r["world"], r["source"], r["sha"]) for r in ranks} == {(8, "cache", sha)}
    assert all("flash-attn2" in r["attn"] for r in ranks)
    assert len({r["sum"] for r in ranks}) == 1  # every rank computed the same logits


def test_a_variant_locked_too_long_by_another_process_is_a_lock_error(hub_env, hub_server, monkeypatch):
    from filelock import FileLock

    from kernel_loader.errors import CacheLockError

    repo_id, sha = _drill_repo(hub_server, 5)
    monkeypatch.setenv("KERNEL_LOADER_LOCK_TIMEOUT", "0.5")
    folder = cache.repo_folder(repo_id, "model", hub_env.cache_dir)
    lock_path = folder / cache.RECORDS / ".locks" / f"{sha}.torch-universal.lock"
    lock_path.parent.mkdir(parents=True)
    holder = subprocess.Popen(  # another process downloading it, for longer than we wait
        [sys.executable, "-c", f"import filelock,time; l=filelock.FileLock({str(lock_path)!r}); l.acquire(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CacheLockError, match="KERNEL_LOADER_LOCK_TIMEOUT") as info:
            kernel_loader.get_kernel(repo_id, version=1, trust_remote_code=True)
        assert str(lock_path) in str(info.value)
    finally:
        os.kill(holder.pid, 9)  # its lock dies with it
        holder.wait()
    loader.clear_memo()
    assert kernel_loader.get_kernel(repo_id, version=1, trust_remote_code=True).answer() == expected_answer(5)
    assert FileLock(str(lock_path), timeout=0).acquire()  # nobody holds it afterwards


def test_a_full_disk_names_the_cache_and_the_bytes_needed(hub_env, hub_server, tmp_path, monkeypatch):
    from kernel_loader.errors import CacheFullError

    small = tmp_path / "small-disk"
    small.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(small)]).returncode:
        pytest.skip("needs root and tmpfs mounts to make a small disk")
    try:
        monkeypatch.setenv("KERNEL_LOADER_CACHE", str(small))
        repo_id, _ = _drill_repo(hub_server, 2)
        with pytest.raises(CacheFullError, match=rf"{small}.*bytes needed") as info:
            kernel_loader.get_kernel(repo_id, version=1, trust_remote_code=True)
        assert "KERNEL_LOADER_CACHE" in str(info.value)
    finally:
        subprocess.run(["umount", str(small)])
