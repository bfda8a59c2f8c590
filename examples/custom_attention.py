"""Register your own attention function, with a mask formatter, and run it by name.

    python examples/custom_attention.py

1. ``AttentionInterface.register(name, fn)`` makes ``fn`` available to every model by name.
2. ``AttentionMaskInterface.register(name, formatter)`` says which mask format ``fn`` wants; without
   it the builders hand ``fn`` ``attention_mask=None`` (and warn once), so padding is lost.
3. ``interface[name] = fn`` on an instance overrides a name for that instance only.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import torch

from kernel_loader.attention import (
    ALL_ATTENTION_FUNCTIONS,
    AttentionInterface,
    AttentionMaskInterface,
    create_causal_mask,
    eager_attention_forward,
    sdpa_mask,
)


def alibi_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """ALiBi: a per-head linear distance penalty added to the scores (the attention-function contract).

    ``attention_mask`` is the 4D bool mask of ``sdpa_mask`` (True attends); extra kwargs are ignored.
    """
    b, hq, sq, d = query.shape
    key = key.repeat_interleave(hq // key.shape[1], dim=1)
    value = value.repeat_interleave(hq // value.shape[1], dim=1)
    slopes = torch.tensor([2 ** (-8 * (h + 1) / hq) for h in range(hq)], dtype=query.dtype)
    qpos = torch.arange(sq)[:, None] + key.shape[2] - sq
    distance = (qpos - torch.arange(key.shape[2])[None]).abs().to(query.dtype)
    scores = query @ key.transpose(-1, -2) * (scaling or 1 / math.sqrt(d))
    scores = scores - slopes[:, None, None] * distance
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    weights = scores.softmax(-1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def main() -> None:
    torch.manual_seed(0)
    AttentionInterface.register("alibi", alibi_attention)
    AttentionMaskInterface.register("alibi", sdpa_mask)  # 4D bool, True = attend

    config = SimpleNamespace(_attn_implementation="alibi")
    module = SimpleNamespace(is_causal=True, training=False)
    hidden = torch.zeros(2, 6, 32)
    padding = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # row 0 is left-padded
    q = torch.randn(2, 4, 6, 8)
    k = torch.randn(2, 2, 6, 8)
    v = torch.randn(2, 2, 6, 8)

    mask = create_causal_mask(config, hidden, padding)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation)
    out, weights = attention(module, q, k, v, mask)
    # row 0's real queries (positions 2..5) give no weight to its two padding keys
    print("alibi output", tuple(out.shape), "- weight on padded keys:", float(weights[0, :, 2:, :2].sum()))

    # Without a formatter the mask would silently be None; kernel_loader warns once instead.
    AttentionInterface.register("alibi_unmasked", alibi_attention)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        none_mask = create_causal_mask(SimpleNamespace(_attn_implementation="alibi_unmasked"), hidden, padding)
    print("no formatter -> mask", none_mask, "| warning:", str(seen[0].message)[:90], "...")

    # A local override: this instance logs its sdpa calls, every other model keeps the built-in.
    calls = []
    local = AttentionInterface()

    def traced_eager(*args, **kwargs):
        calls.append(args[1].shape)
        return eager_attention_forward(*args, **kwargs)

    local["sdpa"] = traced_eager
    local.get_interface("sdpa")(module, q, k, v, None)
    print("local override called", len(calls), "time(s); global sdpa is still",
          ALL_ATTENTION_FUNCTIONS["sdpa"].__name__)


if __name__ == "__main__":
    main()
