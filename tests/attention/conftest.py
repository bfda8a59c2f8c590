"""Shared inputs for the attention tests: random q/k/v, padding masks and an fp64 reference.

The reference is written here from the definitions (explicit index comparisons, a plain softmax
in float64); it does not use kernel_loader's masks, so a wrong predicate there shows up as a
mismatch rather than being compared with itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch


@dataclass
class Case:
    q: torch.Tensor  # [B, Hq, Sq, D]
    k: torch.Tensor  # [B, Hkv, Skv, D]
    v: torch.Tensor
    padding: torch.Tensor | None  # [B, Skv] bool, True = real token


def make_case(b=2, hq=4, hkv=2, sq=12, skv=None, d=16, dtype=torch.float32, seed=0, padding=None) -> Case:
    g = torch.Generator().manual_seed(seed)
    skv = sq if skv is None else skv
    q = torch.randn(b, hq, sq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, skv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, skv, d, generator=g, dtype=torch.float64).to(dtype)
    pad = None
    if padding is not None:
        pad = torch.ones(b, skv, dtype=torch.bool)
        for row, (left, right) in enumerate(padding):
            if left:
                pad[row, :left] = False
            if right:
                pad[row, skv - right :] = False
    return Case(q, k, v, pad)


def reference_attention(
    q, k, v, *, causal=True, padding=None, window=None, chunk=None, softcap=None, seq_ids=None, positions=None,
    q_offset=None,
):
    """Attention in float64 from first principles; returns [B, Sq, Hq, D] float64.

    Query i sits at key position ``q_offset + i`` (default: bottom-right, ``Skv - Sq``). Chunks
    and windows count from each row's first real token / from ``positions`` when given.
    """
    q, k, v = (t.double() for t in (q, k, v))
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    off = skv - sq if q_offset is None else q_offset
    allowed = torch.ones(b, sq, skv, dtype=torch.bool)
    for bi in range(b):
        first_real = 0
        if padding is not None:
            first_real = int(padding[bi].to(torch.int64).argmax())
        for i in range(sq):
            qi = i + off
            for j in range(skv):
                ok = True
                qp, kp = qi, j
                if positions is not None:
                    qp, kp = int(positions[bi, qi]), int(positions[bi, j])
                if causal and kp > qp:
                    ok = False
                if window is not None:
                    if causal and not (qp - kp < window):
                        ok = False
                    if not causal and abs(qp - kp) > window:
                        ok = False
                if chunk is not None and (qi - first_real) // chunk != (j - first_real) // chunk:
                    ok = False
                if padding is not None and not bool(padding[bi, j]):
                    ok = False
                if seq_ids is not None and int(seq_ids[bi, qi]) != int(seq_ids[bi, j]):
                    ok = False
                allowed[bi, i, j] = ok
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs @ v).transpose(1, 2)


def grid(rows: list[str]) -> torch.Tensor:
    """A bool mask from strings: '1' = attends; one string per query row."""
    return torch.tensor([[c == "1" for c in r] for r in rows])


def module(is_causal=True, training=False, layer_idx=0):
    return SimpleNamespace(is_causal=is_causal, training=training, layer_idx=layer_idx)


def config(name, **kw):
    return SimpleNamespace(_attn_implementation=name, **kw)


@pytest.fixture
def attn():
    """Helpers as a namespace: make_case, reference_attention, module, config."""
    return SimpleNamespace(make_case=make_case, reference=reference_attention, module=module, config=config, Case=Case)


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """No Hub at all: HF_HUB_OFFLINE=1 (huggingface_hub's constant patched too), an empty cache,
    a fresh loader memo and fallback cache."""
    import huggingface_hub.constants as hc

    from kernel_loader import loader
    from kernel_loader.attention import reset_fallback_cache

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.delenv("KERNEL_LOADER_NO_BUNDLED", raising=False)
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    monkeypatch.setenv("KERNEL_LOADER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KERNEL_LOADER_STATE_DIR", str(tmp_path / "state"))
    loader.clear_memo()
    reset_fallback_cache()
    yield
    loader.clear_memo()
    reset_fallback_cache()
