"""Fixtures shared by the transformers integration tests."""

from __future__ import annotations

import pytest


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
