"""Pin kernels with a lock file, fetch them once, load them with no network. 

    python examples/locking.py [PROJECT_DIR]

Reads ``[tool.kernels.dependencies]`` from PROJECT_DIR/pyproject.toml (a temporary project asking
for ``"kernels-community/flash-attn2" = 1`` when none is given), then does what you would do
from the shell:

    kernel-loader lock PROJECT_DIR              # resolve v1 -> sha, hash every variant (no download)
    kernel-loader download --lock kernels.lock  # fetch this machine's variant, checked against the lock
    kernel-loader verify --lock kernels.lock    # re-hash the cache at any time

and finally ``kernel_loader.load_kernel(repo, lockfile=...)``, which never touches the network and
refuses files that differ from the lock. Needs the Hub (or a mirror via HF_ENDPOINT) for the first
two steps.
"""

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import kernel_loader
from kernel_loader import cli, lockfile


def main() -> int:
    project = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="kl-project-"))
    pyproject = project / "pyproject.toml"
    if not pyproject.exists():
        pyproject.write_text('[project]\nname = "demo"\n\n[tool.kernels.dependencies]\n"kernels-community/flash-attn2" = 1\n')
    print(f"project: {project}")

    for argv in (["lock", str(project)], ["download", "--lock", str(project / "kernels.lock")]):
        print(f"$ kernel-loader {' '.join(argv)}")
        code = cli.main(argv)
        if code != 0:
            print(f"(exit {code}: this step needs the Hub; set HF_ENDPOINT to a mirror, or run it where the Hub is reachable)")
            return code

    lock_path = project / "kernels.lock"
    for entry in lockfile.read_lock(lock_path):
        module = kernel_loader.load_kernel(entry.repo_id, lockfile=lock_path)
        res = module.__kernel_resolution__
        print(f"{entry.repo_id}: sha {res.sha[:12]}, variant {res.variant}, {'; '.join(res.notes)}")
    print(f"$ kernel-loader verify --lock {lock_path}")
    return cli.main(["verify", "--lock", str(lock_path)])


if __name__ == "__main__":
    sys.exit(main())
