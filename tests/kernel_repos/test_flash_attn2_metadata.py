"""The shipped repo is a well-formed kernel repo: our loader and the `kernels` package both read it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2] / "kernel_repos" / "kernels-community" / "flash-attn2"
VARIANT = REPO / "build" / "torch-universal"


def test_metadata_declares_name_version_license_backend_and_archs():
    meta = json.loads((VARIANT / "metadata.json").read_text())
    assert meta["name"] == "flash-attn2"
    assert meta["version"] == 1
    assert meta["license"]
    assert meta["python-depends"] == []
    # the Triton path needs Ampere or newer; "+PTX" = this capability and every newer one
    assert meta["backend"]["archs"] == ["8.0+PTX"]


def test_the_kernels_package_loads_the_shipped_repo_unchanged():
    import kernels

    module = kernels.get_local_kernel(REPO, trust_remote_code=True)
    q = torch.randn(1, 9, 2, 32)
    k = torch.randn(1, 9, 2, 32)
    out = module.flash_attn_func(q, k, k, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-3, rtol=1e-3)
