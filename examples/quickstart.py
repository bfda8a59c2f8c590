"""The main job on the embedded default: load a FlashAttention kernel by id and run it.

No network and no GPU needed. kernel_loader asks the Hub (HF_ENDPOINT, default huggingface.co)
first. With no Hub in reach, or with HF_HUB_OFFLINE=1, it serves the copy of
`kernels-community/flash-attn2` it ships (and says so). With the Hub in reach it uses the Hub's
build for this machine: on a CUDA machine that is the build for this torch/CUDA; the Hub's repo
has CUDA builds only, so elsewhere it serves the shipped copy and names the Hub builds it rejected.

    python examples/quickstart.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernel_loader


def main() -> None:
    flash = kernel_loader.get_kernel("kernels-community/flash-attn2", version=1)
    print(flash.__kernel_resolution__.explain())

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    # [batch, seqlen, heads, head_dim], grouped-query attention: 8 query heads share 2 kv heads
    q = torch.randn(2, 128, 8, 64, device=device, dtype=dtype)
    k = torch.randn(2, 128, 2, 64, device=device, dtype=dtype)
    v = torch.randn(2, 128, 2, 64, device=device, dtype=dtype)

    out = flash.flash_attn_func(q, k, v, causal=True)

    # the same attention through PyTorch's SDPA ([batch, heads, seqlen, head_dim] layout)
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2).float(),
        k.transpose(1, 2).repeat_interleave(4, dim=1).float(),
        v.transpose(1, 2).repeat_interleave(4, dim=1).float(),
        is_causal=True,
    ).transpose(1, 2)
    err = (out.float() - expected).norm() / expected.norm()
    print(f"\nflash_attn_func on {device} ({dtype}): output {tuple(out.shape)}, "
          f"relative difference to SDPA {err:.2e}")
    if not err < 1e-2:
        raise SystemExit("mismatch against SDPA: please report this with the explanation above")


if __name__ == "__main__":
    main()
