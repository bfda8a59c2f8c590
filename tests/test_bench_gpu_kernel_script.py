"""bench/gpu_kernel.sh's step runner: with PACK set, every step leaves the whole output folder
packed into one archive, failed or timed-out steps included (the GPU machine hands back only so
many files, and a run stopped mid-way returns what is under its output folder then)."""

from __future__ import annotations

import re
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_kernel.sh"


def _run_steps(tmp_path: Path, steps: str, pack: str) -> subprocess.CompletedProcess:
    # the script's own pack() and step() functions, run on steps that need no GPU
    functions = "\n".join(re.findall(r"^(?:pack|step)\(\) \{.*\}$", SCRIPT.read_text(), re.M))
    assert functions.count("() {") == 2, "gpu_kernel.sh lost its pack() or step()"
    return subprocess.run(["bash", "-c", functions + "\n" + steps], capture_output=True, text=True,
                          env={"RES": str(tmp_path / "out"), "PACK": pack, "PATH": "/usr/bin:/bin"})


def test_every_step_packs_the_output_folder_failed_and_timed_out_ones_too(tmp_path):
    (tmp_path / "out").mkdir()
    archive = tmp_path / "all.tgz"
    done = _run_steps(tmp_path, 'step 5 sh -c "echo one > $RES/one.md"\n'
                                'step 5 sh -c "echo two > $RES/two.md; exit 3"\n'
                                'step 1 sh -c "echo three > $RES/three.md; sleep 5"\n', str(archive))
    assert done.returncode == 0, done.stderr
    assert "=== FAILED (3)" in done.stdout and "=== FAILED (124)" in done.stdout
    with tarfile.open(archive) as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"one.md", "two.md", "three.md"} <= names


def test_without_pack_no_archive_is_written(tmp_path):
    (tmp_path / "out").mkdir()
    done = _run_steps(tmp_path, 'step 5 sh -c "echo one > $RES/one.md"\n', "")
    assert done.returncode == 0 and "=== FAILED" not in done.stdout, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
