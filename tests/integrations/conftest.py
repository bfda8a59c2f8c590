"""Fixtures the integration tests share: the shipped kernel as the only source, with
kernel_loader's process-wide memory of flash-attn2 backends forgotten before and after."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


def _forget_kernel_backends() -> None:
    # other test modules register the same ids from other sources: drop the flash-attn2
    # backends, memoized loads and walked fallback chains so a test sees the source its own
    # environment selects
    from kernel_loader.attention import AttentionInterface, AttentionMaskInterface, kernel_backends, reset_fallback_cache
    from kernel_loader.loader import clear_memo

    for name in list(kernel_backends.registered_kernel_backends()):
        if "flash-attn2" in name:
            AttentionInterface.unregister(name)
            AttentionMaskInterface.unregister(name)
            kernel_backends._registered.pop(name, None)  # the registry's own tests reset it the same way
    clear_memo()
    reset_fallback_cache()


def _shipped_kernel_only(mp: pytest.MonkeyPatch, cache_dir: Path) -> Iterator[None]:
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("KERNEL_LOADER_CACHE", str(cache_dir))
    mp.delenv("KERNEL_LOADER_NO_BUNDLED", raising=False)
    mp.delenv("LOCAL_KERNELS", raising=False)
    _forget_kernel_backends()
    yield
    _forget_kernel_backends()


@pytest.fixture
def fresh_kernel_backends() -> Iterator[None]:
    """No flash-attn2 backend, memoized load or walked chain left from another test, before or after."""
    _forget_kernel_backends()
    yield
    _forget_kernel_backends()


@pytest.fixture
def offline_shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The shipped kernel as the only source: offline, empty cache, backends forgotten."""
    yield from _shipped_kernel_only(monkeypatch, tmp_path / "kl-cache")


@pytest.fixture(scope="module")
def offline_shipped_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``offline_shipped`` for a whole module (models loaded once per module)."""
    with pytest.MonkeyPatch.context() as mp:
        yield from _shipped_kernel_only(mp, tmp_path_factory.mktemp("kl-cache"))


@pytest.fixture
def cuda_answered_yes(monkeypatch):
    """transformers uses flash-attn only on CUDA; here the CPU stands in for such a machine.

    5.x asks ``is_torch_cuda_available``; 4.57 asks ``torch.cuda.is_available()`` and reads
    ``torch.version.cuda`` itself, so both are answered. Kernels still run on CPU tensors.
    """
    import torch
    from transformers import modeling_flash_attention_utils as fa_utils
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_torch_cuda_available", lambda: True, raising=False)
    if not hasattr(fa_utils, "FLASH_ATTENTION_COMPATIBILITY_MATRIX"):  # before 5.x
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "12.8")
