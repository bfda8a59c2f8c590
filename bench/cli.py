"""CLI response times: each `kernel-loader` verb beside the `kernels` CLI, in one run.

Every timing is a fresh process started from the console script (interpreter start included),
median of --repeat runs, on a warm cache: the shipped flash-attn2 repo is served by the test
suite's loopback olah Hub, downloaded and locked first. ``explain`` and ``variants`` are timed
online (against the loopback Hub) and offline (HF_HUB_OFFLINE=1, from the cache).

`kernels` (0.17 and 0.19) asks the Hub for repo type ``kernel`` (``/api/kernels/...``), which
olah does not serve, so its Hub verbs (``versions``, ``variants``, ``lock``, ``download``) cannot
run here; it is timed on what it can do offline: ``--help`` and ``info <local folder>``.

Both CLIs run as installed packages do: with their bytecode cached (``PYTHONPYCACHEPREFIX`` in
the temp folder, one untimed run per command first), so neither recompiles its modules in every
process. huggingface_hub 2.x asks ``/api/agent-harnesses`` once a day and keeps the answer in
``HF_HOME``; olah answers it with an empty body, which huggingface_hub does not keep, so the
bench writes the empty registry huggingface_hub itself falls back to, as a machine that used
the Hub today has it. One extra row times ``explain`` without it.

Run: ``.venv/bin/python bench/cli.py [--repeat 7] [--kernels /path/to/kernels]``; writes
bench/results/cli.md and cli.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO_ID = "kernels-community/flash-attn2-clibench"
SHIPPED = ROOT / "kernel_repos" / "kernels-community" / "flash-attn2"
BUDGET_S = 0.5


def _ours() -> str:
    return str(Path(sys.executable).with_name("kernel-loader"))


def _time(cmd: list[str], env: dict, repeat: int, cwd: Path) -> tuple[float, int, float]:
    """(median wall seconds, exit code, median CPU seconds of the process: user + system)."""
    subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, timeout=300)  # writes the bytecode cache
    times, cpu, code = [], [], 0
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
        times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        code = proc.returncode
    return statistics.median(times), code, statistics.median(cpu)


def _prepare(tmp: Path) -> tuple[object, dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    from hub_server import HubServer, find_olah  # the test suite's olah wrapper

    server = HubServer(tmp / "hub", find_olah())
    server.start()
    files = {str(p.relative_to(SHIPPED)): p.read_bytes() for p in SHIPPED.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    # a second, GPU-only build so explain/variants have a rejection to explain
    for name, data in list(files.items()):
        if name.startswith("build/torch-universal/"):
            files[name.replace("torch-universal", "torch28-cxx11-cu128-x86_64-linux")] = data
    sha = server.add_repo(REPO_ID, files)
    server.create_branch(REPO_ID, "v1", sha)
    env = {
        **os.environ,
        "HF_ENDPOINT": server.endpoint,
        "HF_HOME": str(tmp / "hf"),
        "KERNEL_LOADER_CACHE": str(tmp / "cache"),
        "KERNEL_LOADER_STATE_DIR": str(tmp / "state"),
        "PYTHONPYCACHEPREFIX": str(tmp / "pycache"),
    }
    for name in ("HF_HUB_OFFLINE", "PYTHONDONTWRITEBYTECODE"):
        env.pop(name, None)
    registry = tmp / "hf" / ".agent_harnesses.json"  # huggingface_hub.constants.AGENT_HARNESSES_PATH
    registry.parent.mkdir(parents=True)
    registry.write_text(json.dumps({"standardEnvVars": [], "harnesses": {}}))
    (tmp / "project").mkdir()
    (tmp / "project" / "pyproject.toml").write_text(f'[tool.kernels.dependencies]\n"{REPO_ID}" = 1\n')
    for cmd in ([_ours(), "download", REPO_ID], [_ours(), "lock", str(tmp / "project")]):
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
    return server, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--kernels", default="/work/main/.venv/bin/kernels", help="the `kernels` console script")
    opts = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kernel-loader-clibench-"))
    server, env = _prepare(tmp)
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    lock = str(tmp / "project" / "kernels.lock")
    ours, theirs = _ours(), opts.kernels
    cases = [
        ("--help", [ours, "--help"], env, [theirs, "--help"]),
        ("cache ls", [ours, "cache", "ls"], env, None),
        ("verify", [ours, "verify", "--lock", lock], env, None),
        ("doctor", [ours, "doctor"], env, None),
        ("explain (online)", [ours, "explain", REPO_ID], env, None),
        ("explain (online, agent registry not kept)", [ours, "explain", REPO_ID], {**env, "HF_HOME": str(tmp / "hf-bare")}, None),
        ("explain (offline)", [ours, "explain", REPO_ID], offline, None),
        ("variants (online)", [ours, "variants", REPO_ID], env, None),
        ("variants (offline)", [ours, "variants", REPO_ID], offline, None),
        ("info (local folder)", [ours, "info", str(SHIPPED)], env, [theirs, "info", str(SHIPPED)]),
        ("info (online)", [ours, "info", REPO_ID], env, None),
        ("versions (online)", [ours, "versions", REPO_ID], env, None),
    ]
    python = sys.executable
    # What an online verb pays before its first request, whoever asks the Hub through huggingface_hub.
    floors = [
        ("interpreter start", [python, "-c", "pass"]),
        ("huggingface_hub's HTTP client ready (import, TLS context, headers)",
         [python, "-c", "from huggingface_hub.utils import build_hf_headers, get_session; get_session(); build_hf_headers()"]),
        ("import huggingface_hub.hf_api (not imported by these verbs)", [python, "-c", "import huggingface_hub.hf_api"]),
    ]
    rows, floor_rows = [], []
    try:
        for label, cmd in floors:
            floor_s, _, _ = _time(cmd, env, opts.repeat, tmp)
            floor_rows.append({"what": label, "s": round(floor_s, 4), "cmd": " ".join(cmd)})
            print(f"{label:42} {floor_s:6.3f} s")
        for label, cmd, case_env, other in cases:
            ours_s, ours_rc, ours_cpu = _time(cmd, case_env, opts.repeat, tmp)
            row = {"verb": label, "kernel_loader_s": round(ours_s, 4), "kernel_loader_cpu_s": round(ours_cpu, 4), "kernel_loader_rc": ours_rc,
                   "kernel_loader_cmd": " ".join(c.replace(str(tmp), "$TMP") for c in cmd)}
            if other is not None and Path(theirs).exists():
                their_s, their_rc, _ = _time(other, case_env, opts.repeat, tmp)
                row.update({"kernels_s": round(their_s, 4), "kernels_rc": their_rc, "kernels_cmd": " ".join(other)})
            rows.append(row)
            print(f"{label:42} {ours_s:6.3f} s (rc {ours_rc})" + (f"   kernels {row['kernels_s']:.3f} s" if "kernels_s" in row else ""))
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    info = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": f".venv/bin/python bench/cli.py --repeat {opts.repeat}",
        "commit": commit,
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_average": [round(x, 1) for x in os.getloadavg()],  # the box is shared: say how busy it was
        "versions": {d: version(d) for d in ("torch", "huggingface_hub", "kernels")},
        "repeat": opts.repeat,
        "budget_s": BUDGET_S,
    }
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "cli.json").write_text(json.dumps({**info, "rows": rows, "floors": floor_rows}, indent=2) + "\n")
    lines = [
        "# CLI response times",
        "",
        f"{info['date']}, commit {commit}, `{info['command']}`; {info['machine']} "
        f"(load average {', '.join(map(str, info['load_average']))} at the end); "
        + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v) + ".",
        "",
        f"Fresh process per run (interpreter start included), median of {opts.repeat}, warm cache; "
        f"online = the loopback olah Hub. `kernels` {info['versions']['kernels']} asks the Hub for repo type `kernel`, which olah "
        "does not serve, so it is timed on the verbs it can run here. Bytecode is cached for both CLIs, as in an installed "
        "package. huggingface_hub's agent registry (`/api/agent-harnesses`, kept a day in HF_HOME) is written "
        "beforehand, as a machine that used the Hub today has it, because olah answers it with an empty body that "
        "huggingface_hub does not keep; the row marked \"agent registry not kept\" shows the round trip it then "
        "adds to every process. CPU time is the process's user + system time: on this shared 2-CPU box the wall "
        "time also holds the wait for a CPU and for olah's answers.",
        "",
        f"| verb | kernel-loader (s) | its CPU time (s) | kernels {info['versions']['kernels']} (s) | within 0.5 s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        theirs_text = f"{r['kernels_s']:.3f}" if "kernels_s" in r else "—"
        lines.append(f"| {r['verb']} | {r['kernel_loader_s']:.3f} | {r['kernel_loader_cpu_s']:.3f} | {theirs_text} | "
                     f"{'yes' if r['kernel_loader_s'] <= BUDGET_S else 'no'} |")
    lines += ["", f"What every online verb pays before its first request (same run, median of {opts.repeat}):", "",
              "| step | s |", "|---|---|"]
    lines += [f"| {r['what']} | {r['s']:.3f} |" for r in floor_rows]
    lines += ["", "An online `explain`, `variants` or `info` is that floor (huggingface_hub's HTTP client: importing httpx "
              "and huggingface_hub's auth helpers, loading the TLS certificates) plus kernel_loader's own modules (about "
              "0.03 s) and four or five round trips: the refs as repo type `kernel`, then `model` (olah serves only "
              "`model`), the `build/` tree at the chosen sha, and metadata.json of each candidate variant (`info`: of every "
              "variant). `huggingface_hub.hf_api` and `file_download` are not imported by these verbs."]
    (out / "cli.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
