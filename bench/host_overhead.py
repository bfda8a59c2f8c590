"""Host time per attention call: kernel_loader's FlashAttention wrapper beside sdpa.

In eager decoding (one query token per layer) the host's cost per call, not the GPU's, sets the
pace, so this times what the host spends to issue one attention call of a model layer, with the
GPU left to catch up between samples (a sample is ``--calls`` calls with no sync inside; the
contenders interleave over rounds). On a GPU the GPU time per call (``do_bench``) stands beside
it: where host time exceeds GPU time, the call is host-bound. Contenders, each called as a
transformers layer calls its attention function (``fn(module, q, k, v, mask, scaling=...)``,
q/k/v ``[B, H, S, D]``):

* ours: ``make_flash_attention`` bound to the shipped kernel (what
  ``attn_implementation="kernels-community/flash-attn2"`` runs),
* sdpa: kernel_loader's ``sdpa`` backend and, when transformers is installed, transformers' own
  ``sdpa_attention_forward``.

Shapes: a decode step of the 1B Llama in ``bench/e2e_transformers.py`` (batch 8, 2304 keys, GQA
32/8, head_dim 64) and a short prefill (batch 1, 512 tokens, causal).

    PYTHONPATH=. python bench/host_overhead.py                                        # on a GPU
    PYTHONPATH=. python bench/host_overhead.py --calls 2 --rounds 3 --out /tmp/host   # a quick check
"""

from __future__ import annotations

import statistics

import harness

SHAPES = {  # name -> (batch, query tokens, keys, query heads, kv heads, head_dim)
    "decode 8 × 1 over 2304 keys": (8, 1, 2304, 32, 8, 64),
    "prefill 1 × 512, causal": (1, 512, 512, 32, 8, 64),
}


class _Layer:
    """The attributes an attention function reads from transformers' attention module."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True
        self.training = False


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--calls", type=int, default=100, help="calls per sample (no sync inside)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    import torch

    from kernel_loader.attention import ALL_ATTENTION_FUNCTIONS, make_flash_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    contenders = {"ours (flash wrapper, shipped kernel)": make_flash_attention(harness.shipped_kernel()),
                  "sdpa (kernel_loader)": ALL_ATTENTION_FUNCTIONS["sdpa"]}
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        contenders["sdpa (transformers)"] = sdpa_attention_forward
    except ImportError:
        pass
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    rows, samples = [], {}
    for shape, (batch, sq, skv, hq, hkv, dim) in SHAPES.items():
        torch.manual_seed(0)
        q = torch.randn(batch, hq, sq, dim, device=device, dtype=dtype)
        k, v = (torch.randn(batch, hkv, skv, dim, device=device, dtype=dtype) for _ in range(2))
        layer = _Layer(hq, hkv)
        calls = {name: (lambda fn=fn: fn(layer, q, k, v, None, scaling=dim ** -0.5))
                 for name, fn in contenders.items()}
        host = harness.paired(calls, rounds=args.rounds, calls=args.calls, device="cpu",
                              before=lambda name: sync())
        sync()
        samples[shape] = host
        base = host["sdpa (kernel_loader)"]
        for name, fn in calls.items():
            rows.append({
                "shape": shape, "attention": name,
                "host_us": statistics.median(host[name]),
                "host_min_us": min(host[name]),
                "vs_sdpa": str(harness.ratio(host[name], base)) if name != "sdpa (kernel_loader)" else None,
                "gpu_us": harness.time_us(fn, device="cuda") if device == "cuda" else None,
            })
    path = harness.write_results(
        "host_overhead", rows, title="Host time per attention call: our FlashAttention wrapper beside sdpa",
        columns={"shape": "shape", "attention": "attention", "host_us": "host µs/call (median)",
                 "host_min_us": "min", "vs_sdpa": "÷ kernel_loader sdpa, paired", "gpu_us": "GPU µs/call"},
        out_dir=args.out, commit=args.commit,
        notes=[f"{str(dtype).removeprefix('torch.')}; a sample is {args.calls} calls with no sync inside "
               f"(host issue time), {args.rounds} interleaved rounds; paired: row ÷ kernel_loader's sdpa per "
               "round, median [95 % interval] (below 1: less host time than sdpa). GPU µs: `do_bench` median."],
        extra={"samples_us": samples})
    print(path.read_text())


if __name__ == "__main__":
    main()
