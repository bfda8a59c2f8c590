"""The cluster drill shared by tests/test_cluster.py (small) and its stress version.

Each round serves a fresh kernel repo (11 files) and starts from an empty shared cache:

1. **cold start**: every rank loads it at once, through :class:`~fault_proxy.FaultProxy`; some
   rounds kill -9 random ranks at random moments, or make the server die or stall mid-file;
2. **clean run**: every rank loads again with no fault; each must succeed;
3. **offline load**: every rank loads with ``HF_HUB_OFFLINE=1``; each must succeed, and the
   cache must not change (a listing with mtimes compared before and after).

Counted: failures (a rank's error in a clean or offline run, or, in a fault-free cold start, any
error; in a faulty cold start, an error that is not the project's documented download error),
duplicate downloads (a file transferred completely more than once, from the proxy), partial
snapshots (a published variant whose files do not match its record, or files in a snapshot
without a record after the clean run), and leftovers (``.incomplete`` blobs, temp files).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kernel_loader import cache
from kernel_loader.integrity import sha256_file

WORKER = Path(__file__).with_name("cluster_worker.py")
# documented outcomes of an injected fault (server death / stall) during the cold start
FAULT_ERRORS = ("KernelDownloadError", "OfflineKernelMissingError")


def kernel_repo_files(value: int) -> dict[str, str]:
    """A kernel whose package has 10 modules and metadata (11 files); answer() sums them."""
    base = "build/torch-universal/drill"
    files = {f"{base}/m{i}.py": f"X = {i}\n" + "# padding\n" * 2000 for i in range(9)}
    files[f"{base}/__init__.py"] = "".join(f"from .m{i} import X as X{i}\n" for i in range(9)) + (
        f"from ._value import VALUE\n\ndef answer():\n    return VALUE + {' + '.join(f'X{i}' for i in range(9))}\n"
    )
    files[f"{base}/_value.py"] = f"VALUE = {value}\n"
    files["build/torch-universal/metadata.json"] = json.dumps({"name": "drill", "version": 1, "backend": {"type": "universal"}})
    return files


def expected_answer(value: int) -> int:
    return value + sum(range(9))


class Ranks:
    """N long-lived worker processes (see cluster_worker.py)."""

    def __init__(self, n: int, env: dict[str, str]) -> None:
        self.env = env
        self.procs: list[subprocess.Popen] = [self._spawn() for _ in range(n)]
        for p in self.procs:
            self._ready(p)

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=self.env, cwd=str(WORKER.parent),
        )

    @staticmethod
    def _ready(p: subprocess.Popen) -> None:
        line = p.stdout.readline()  # type: ignore[union-attr]
        assert "ready" in line, f"worker failed to start: {line!r}"

    def run(self, cmd: dict, kill: int = 0, rng: random.Random | None = None, kill_window_s: float = 0.6) -> tuple[list[dict], int]:
        """Send ``cmd`` to every rank; kill -9 ``kill`` random ranks at random moments; return (answers, kills)."""
        for p in self.procs:
            p.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        victims = rng.sample(range(len(self.procs)), kill) if kill and rng else []
        for i in victims:
            time.sleep(rng.uniform(0, kill_window_s / max(kill, 1)))  # type: ignore[union-attr]
            os.kill(self.procs[i].pid, signal.SIGKILL)
        answers = []
        for i, p in enumerate(self.procs):
            line = p.stdout.readline()  # type: ignore[union-attr]
            if i in victims and not line:
                p.wait()
                self.procs[i] = self._spawn()
                self._ready(self.procs[i])
                continue
            if i in victims:  # it finished before the signal landed
                p.wait()
                self.procs[i] = self._spawn()
                self._ready(self.procs[i])
            answers.append(json.loads(line) if line else {"ok": False, "error": "worker died"})
        return answers, len(victims)

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.close()  # type: ignore[union-attr]
                p.wait(timeout=10)
            except Exception:
                p.kill()


def tree_state(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` with its mtime, size and mode (links not followed)."""
    state = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            state[path] = (st.st_mtime_ns, st.st_size, st.st_mode)
    return state


def audit(root: Path, repo_id: str) -> tuple[int, int]:
    """(partial snapshots, leftovers) in a cache after a clean run."""
    partial = leftovers = 0
    for folder in root.glob("*--*--*"):
        leftovers += len(list((folder / "blobs").glob("*.incomplete"))) + len(list(folder.rglob(".tmp-*")))
        for snap in (folder / "snapshots").glob("*"):
            snapshot = cache.CachedSnapshot(repo_id, folder.name.split("s--")[0], snap.name, snap)
            variants = snapshot.variants()
            for build in (snap / "build").glob("*"):
                if build.name not in variants and any(p.name != "metadata.json" for p in build.rglob("*") if p.is_file()):
                    partial += 1  # files of a variant that was never published
            for v in variants:
                rec = snapshot.record(v)
                for rel, want in rec.files.items():  # type: ignore[union-attr]
                    p = snap / rel
                    if not p.is_file() or p.stat().st_size != want.size or sha256_file(p) != want.sha256:
                        partial += 1
                        break
    return partial, leftovers


@dataclass
class DrillFigures:
    processes: int
    rounds: int
    kills: int = 0
    faults: dict = field(default_factory=lambda: {"server_death": 0, "stall": 0})
    cold_fault_errors: int = 0
    failures: int = 0
    duplicate_downloads: int = 0
    #: duplicates in rounds where no rank was killed (a rank killed after a file arrived but
    #: before huggingface_hub moved it into blobs/ makes the next rank fetch that file again)
    duplicates_without_kill: int = 0
    per_round: list = field(default_factory=list)
    partial_snapshots: int = 0
    leftovers: int = 0
    cache_writes_offline: int = 0
    seconds: float = 0.0
    failure_samples: list = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def drill(hub_server, proxy, tmp: Path, processes: int, rounds: int, plan, seed: int = 0, fault_window_s: float = 3.0) -> DrillFigures:
    """Run the rounds; ``plan(round) -> (kills, fault)`` with fault in (None, "cut_file", "stall_file")."""
    rng = random.Random(seed)
    env = {
        **os.environ, "HF_ENDPOINT": proxy.endpoint, "KERNEL_LOADER_STATE_DIR": str(tmp / "state"),
        # 5 s: on two loaded cores a healthy answer can take over a second; a shorter read timeout
        # makes huggingface_hub resume healthy transfers, which the proxy then counts twice
        "KERNEL_LOADER_READ_TIMEOUT": "5", "KERNEL_LOADER_CONNECT_TIMEOUT": "2", "KERNEL_LOADER_RETRIES": "1",
        "KERNEL_LOADER_NO_BUNDLED": "1", "PYTHONPATH": os.pathsep.join(sys.path),
    }
    env.pop("HF_HUB_OFFLINE", None)
    figures = DrillFigures(processes, rounds)
    start = time.monotonic()
    ranks = Ranks(processes, env)
    try:
        for r in range(rounds):
            kills, fault = plan(r)
            repo_id = hub_server.new_repo_id("drill", org="test-org")
            sha = hub_server.add_repo(repo_id, kernel_repo_files(r))
            hub_server.create_branch(repo_id, "v1", sha)
            root = tmp / f"cache-{r}"
            cmd = {"cache": str(root), "repo": repo_id, "version": 1}
            want = expected_answer(r)
            proxy.reset_counts()
            proxy.mode = fault or "pass"
            if fault:
                figures.faults["server_death" if fault == "cut_file" else "stall"] += 1
                # the server is broken for a while, then back: ranks still waiting then succeed
                threading.Timer(fault_window_s, lambda: setattr(proxy, "mode", "pass")).start()
            answers, killed = ranks.run(cmd, kill=kills, rng=rng)
            proxy.mode = "pass"
            figures.kills += killed
            for a in answers:
                if a["ok"] and a["value"] == want:
                    continue
                if fault and not a["ok"] and a["error"].split(":")[0] in FAULT_ERRORS:
                    figures.cold_fault_errors += 1
                    continue
                figures.failures += 1
                figures.failure_samples.append(("cold", r, a))
            for phase, offline in (("clean", False), ("offline", True)):
                before = tree_state(root) if offline else None
                answers, _ = ranks.run({**cmd, "offline": offline})
                for a in answers:
                    if not (a["ok"] and a["value"] == want):
                        figures.failures += 1
                        figures.failure_samples.append((phase, r, a))
                if offline and tree_state(root) != before:
                    figures.cache_writes_offline += 1
            dups = proxy.duplicates()
            twice = sorted(p.rsplit("/", 1)[-1] for p, n in proxy.completed.items() if n > 1)
            figures.duplicate_downloads += dups
            if not killed:
                figures.duplicates_without_kill += dups
            partial, leftovers = audit(root, repo_id)
            figures.per_round.append({"round": r, "kills": killed, "fault": fault, "duplicates": dups, "fetched_twice": twice,
                                      "partial": partial, "leftovers": leftovers})
            figures.partial_snapshots += partial
            figures.leftovers += leftovers
    finally:
        ranks.close()
    figures.seconds = round(time.monotonic() - start, 1)
    figures.failure_samples = figures.failure_samples[:5]
    return figures
