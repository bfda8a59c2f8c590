"""A small decoder in plain PyTorch whose attention backend is picked by name, at run time.

    python examples/standalone_model.py                      # every backend, compared with eager
    python examples/standalone_model.py --attn sdpa
    python examples/standalone_model.py --attn kernels-community/flash-attn2
    python examples/standalone_model.py --attn "paged|sdpa"  # paged KV cache, token by token

The model never imports a backend: each attention layer looks its function up in
``ALL_ATTENTION_FUNCTIONS`` by ``config._attn_implementation`` on every forward, and the mask is
built by ``create_causal_mask`` / ``create_sliding_window_causal_mask`` in the format that backend
wants. ``model.set_attn_implementation(name)`` switches backends between two calls.

On a CPU, FlashAttention names run the kernel kernel_loader ships (set TRITON_INTERPRET=1 before
starting Python to run its Triton code through the interpreter, or leave it unset for its PyTorch path).
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from kernel_loader.attention import (
    ALL_ATTENTION_FUNCTIONS,
    PagedKVCache,
    create_causal_mask,
    create_sliding_window_causal_mask,
)


@dataclass
class DecoderConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2  # GQA: two query heads per key/value head
    sliding_window: int | None = 6  # odd layers use a sliding window (Mistral/Gemma style)
    softcap: float | None = None
    is_causal: bool = True
    _attn_implementation: str = "sdpa"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def rotary(x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x [B, H, S, D]`` at ``position_ids [B, S]``."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = position_ids[:, None, :, None].float() * freq
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = config.is_causal
        self.num_key_value_groups = config.num_heads // config.num_kv_heads
        self.sliding_window = config.sliding_window if layer_idx % 2 == 1 else None
        d = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, mask, position_ids: torch.Tensor, **attn_kwargs) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.config.head_dim
        q = rotary(self.q_proj(x).view(b, s, -1, d).transpose(1, 2), position_ids)
        k = rotary(self.k_proj(x).view(b, s, -1, d).transpose(1, 2), position_ids)
        v = self.v_proj(x).view(b, s, -1, d).transpose(1, 2)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation)
        out, _ = attention(
            self, q, k, v, mask,
            scaling=1 / math.sqrt(d),
            sliding_window=self.sliding_window,
            softcap=self.config.softcap,
            position_ids=position_ids,
            layer_idx=self.layer_idx,
            **attn_kwargs,
        )
        return self.o_proj(out.reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(config.hidden_size)
        self.attn = Attention(config, layer_idx)
        self.norm2 = nn.RMSNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 4 * config.hidden_size), nn.GELU(),
                                 nn.Linear(4 * config.hidden_size, config.hidden_size))

    def forward(self, x, mask, position_ids, **attn_kwargs):
        x = x + self.attn(self.norm1(x), mask, position_ids, **attn_kwargs)
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def set_attn_implementation(self, name: str) -> None:
        """Switch backend; a kernel id is loaded (and registered) right away so errors show here."""
        ALL_ATTENTION_FUNCTIONS.get_interface(name)
        self.config._attn_implementation = name

    def forward(self, input_ids, attention_mask=None, position_ids=None, paged_cache=None, past_length=0):
        x = self.embed(input_ids)
        b, s = input_ids.shape
        if position_ids is None:
            start = 0 if attention_mask is None else None
            if start is None:  # left padding: positions count real tokens only
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -s:]
            else:
                position_ids = torch.arange(past_length, past_length + s)[None].expand(b, -1)
        attn_kwargs = {}
        if paged_cache is not None:
            attn_kwargs["paged_cache"] = paged_cache
            full = sliding = None  # paged backends mask from the cache's lengths
        else:
            full = create_causal_mask(self.config, x, attention_mask, position_ids=position_ids)
            sliding = (create_sliding_window_causal_mask(self.config, x, attention_mask, position_ids=position_ids)
                       if self.config.sliding_window else full)
        for i, layer in enumerate(self.layers):
            x = layer(x, sliding if i % 2 == 1 else full, position_ids, **attn_kwargs)
        return self.lm_head(self.norm(x))


def compare_backends(model: TinyDecoder, names: list[str]) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0  # left padding in row 0
    model.set_attn_implementation("eager")
    ref = model(ids, mask)
    real = mask.bool()
    print(f"{'backend':40s} {'max |logits - eager|':>22s} {'seconds':>8s}")
    for name in names:
        try:
            model.set_attn_implementation(name)
            t = time.perf_counter()
            out = model(ids, mask)
            dt = time.perf_counter() - t
        except Exception as exc:  # show why a backend cannot run here, and go on
            print(f"{name:40s} {'unavailable':>22s}   {type(exc).__name__}: {str(exc).splitlines()[0]}")
            continue
        print(f"{name:40s} {float((out - ref)[real].abs().max()):22.2e} {dt:8.2f}")


def paged_generate(model: TinyDecoder, name: str, new_tokens: int = 5) -> torch.Tensor:
    """Greedy decoding through a paged KV cache, one token per step after the prompt."""
    cfg = model.config
    model.set_attn_implementation(name)
    torch.manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    cache = PagedKVCache(num_layers=cfg.num_layers, batch_size=2, num_kv_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, num_blocks=32, block_size=4)
    tokens, step_ids, past = ids, ids, 0
    for _ in range(new_tokens):
        cache.begin_step(step_ids.shape[1])
        logits = model(step_ids, paged_cache=cache, past_length=past)
        cache.end_step()
        past += step_ids.shape[1]
        step_ids = logits[:, -1:].argmax(-1)
        tokens = torch.cat([tokens, step_ids], dim=1)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attn", help="one backend name or kernel id (default: try them all)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the fallback's notes; `kernel-loader explain flash_attention_2` shows them
    model = TinyDecoder(DecoderConfig()).eval()
    with torch.no_grad():
        if args.attn and args.attn.startswith("paged|"):
            print(paged_generate(model, args.attn))
            return
        names = [args.attn] if args.attn else [
            "sdpa", "flex_attention", "flash_attention_2", "kernels-community/flash-attn2"]
        compare_backends(model, names)
        if not args.attn:
            full = paged_generate(model, "paged|eager")
            for name in ("paged|sdpa", "paged|flash_attention_2"):
                same = torch.equal(paged_generate(model, name), full)
                print(f"{name:40s} greedy tokens {'match' if same else 'DIFFER from'} paged|eager")


if __name__ == "__main__":
    main()
