"""The loading API in one page: ids, versions, explanations, errors. ``python examples/get_kernel.py``

Runs anywhere (no GPU, no network needed): when the Hub cannot be reached, the copy of
kernels-community/flash-attn2 shipped with kernel_loader is used, with a warning saying how to
prefetch the Hub version (``kernel-loader download kernels-community/flash-attn2``).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU only: set before triton is imported

import kernel_loader
from kernel_loader.refs import KernelRef

REPO = "kernels-community/flash-attn2"


def main() -> None:
    # 1. Ids: org/name[@revision][:function], optionally "wrapper|..." (used by the attention layer).
    ref = KernelRef.parse(f"{REPO}@v1:flash_attn_func")
    print(f"parsed {ref}: repo={ref.repo_id} revision={ref.revision} function={ref.function}")
    try:
        KernelRef.parse("../etc/passwd")
    except kernel_loader.InvalidKernelRefError as err:
        print(f"refused: {err}")

    # 2. Is there a build for this machine? (downloads at most metadata.json, imports nothing)
    print(f"has_kernel({REPO!r}, version=1) -> {kernel_loader.has_kernel(REPO, version=1)}")

    # 3. The whole story without importing: source, sha, chosen variant, rejected ones and why.
    print(kernel_loader.resolve_kernel(REPO, version=1, download=False).explain())

    # 4. Load: version=N means branch vN; a sha revision never touches the network once cached.
    fa = kernel_loader.get_kernel(REPO, version=1)
    res = fa.__kernel_resolution__
    print(f"loaded {fa.__name__} from {res.source} (sha {res.sha[:12]}, variant {res.variant})")
    fn = getattr(fa, ref.function)
    print(f"entry point {ref.function}: {fn.__module__}.{fn.__qualname__}")

    # 5. Errors say what was asked, what was found and what to run next.
    try:
        kernel_loader.get_kernel("some-org/some-kernel")
    except kernel_loader.KernelLoaderError as err:
        print(f"{type(err).__name__}: {err}")


if __name__ == "__main__":
    main()
