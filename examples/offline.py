"""Offline and air-gapped use: prefetch once, then load with no network call at all.

    python examples/offline.py

1. While online (or against a mirror: ``HF_ENDPOINT=http://mirror``), prefetch into a cache that
   the cluster can read, e.g. a shared filesystem:
       KERNEL_LOADER_CACHE=/shared/kernels kernel-loader download kernels-community/flash-attn2 --all-variants
2. On the nodes: ``HF_HUB_OFFLINE=1 KERNEL_LOADER_CACHE=/shared/kernels`` (the cache may be
   read-only; nothing is written into it). Versions (``version=1``) resolve from the cache's
   ``refs/``; a sha revision is used directly.
3. With nothing cached, the copy shipped with kernel_loader is used (with a warning), unless
   ``KERNEL_LOADER_NO_BUNDLED=1``, in which case the error says what to prefetch.

This script shows steps 2 and 3 on this machine, without network access.
"""

import os
import tempfile
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["HF_HUB_OFFLINE"] = "1"  # read at call time: no network call from here on

import kernel_loader
from kernel_loader import loader
from kernel_loader.sources.bundled import BundledKernelWarning

REPO = "kernels-community/flash-attn2"


def main() -> None:
    os.environ["KERNEL_LOADER_CACHE"] = tempfile.mkdtemp(prefix="kl-empty-cache-")

    # Nothing cached: the shipped copy, and a warning saying so.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fa = kernel_loader.get_kernel(REPO, version=1)
    print(f"source={fa.__kernel_resolution__.source}; warned: {any(issubclass(w.category, BundledKernelWarning) for w in caught)}")

    # Shipped copies forbidden: the error names the command that fixes it.
    os.environ["KERNEL_LOADER_NO_BUNDLED"] = "1"
    loader.clear_memo()
    try:
        kernel_loader.get_kernel(REPO, version=1)
    except kernel_loader.OfflineKernelMissingError as err:
        print(f"OfflineKernelMissingError: {err}")


if __name__ == "__main__":
    main()
