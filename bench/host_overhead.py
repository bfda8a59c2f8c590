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

Training rows: one forward+backward (``torch.autograd.grad`` of ``flash_attn_func`` against SDPA's
cuDNN backend on ``[B, H, S, D]`` views) at the attention table's 1k shape (16 × 1024, 16 heads,
head_dim 128, causal; on the CPU a small stand-in), with the GPU kept busy (``torch.cuda._sleep``)
before each sample, so the host never waits for it and a sample is the host's issue time alone.
``--profile`` also writes ``host_overhead_profile.txt`` into ``--out``: the functions our
training call spends host time in (cProfile, cumulative), to find where it goes.

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


# name -> (batch, tokens, heads, head_dim) of the forward+backward rows, on a GPU / on the CPU
TRAIN_SHAPES = {"forward+backward 16 × 1024, d128, causal": ((16, 1024, 16, 128), (1, 64, 2, 32))}
TRAIN_CALLS = 20  # per sample: the GPU runs behind, and the launch queue must not fill


def _training_calls(kernel, shape: tuple, device: str, dtype) -> dict:
    """name -> one forward+backward call of ours and of SDPA (cuDNN on a GPU) on the same data."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, s, h, d = shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    dot = do.transpose(1, 2)
    backends = [SDPBackend.CUDNN_ATTENTION] if device == "cuda" else [SDPBackend.MATH]

    def ours():
        return torch.autograd.grad(kernel.flash_attn_func(q, k, v, causal=True), (q, k, v), do)

    def sdpa():
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return torch.autograd.grad(out, (qt, kt, vt), dot)

    return {"ours (flash_attn_func)": ours, "sdpa (cuDNN)" if device == "cuda" else "sdpa (math)": sdpa}


def _profile(fn, calls: int, path) -> None:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    path.write_text(f"cProfile of {calls} calls (cumulative)\n" + text.getvalue())


def _rows(shape: str, calls: dict, host: dict, base: str, device: str) -> list:
    """One table row per contender: host µs (median, min), paired against ``base``, GPU µs."""
    return [{
        "shape": shape, "attention": name,
        "host_us": statistics.median(host[name]),
        "host_min_us": min(host[name]),
        "vs_sdpa": str(harness.ratio(host[name], host[base])) if name != base else None,
        "gpu_us": harness.time_us(fn, device="cuda") if device == "cuda" else None,
    } for name, fn in calls.items()]


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
    parser.add_argument("--profile", action="store_true",
                        help="also write host_overhead_profile.txt (cProfile of our training call) into --out")
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
        rows += _rows(shape, calls, host, "sdpa (kernel_loader)", device)
    kernel = harness.shipped_kernel()
    for shape, (gpu_shape, cpu_shape) in TRAIN_SHAPES.items():
        calls = _training_calls(kernel, gpu_shape if device == "cuda" else cpu_shape, device, dtype)

        def busy(name):
            # the GPU stays busy while the sample issues its calls: host time alone is measured
            sync()
            if device == "cuda":
                torch.cuda._sleep(20_000_000)
        host = harness.paired(calls, rounds=args.rounds, calls=min(args.calls, TRAIN_CALLS), device="cpu",
                              before=busy)
        sync()
        samples[shape] = host
        rows += _rows(shape, calls, host, next(n for n in calls if n.startswith("sdpa")), device)
        if args.profile:
            from pathlib import Path

            out_dir = Path(args.out)
            out_dir.mkdir(parents=True, exist_ok=True)
            _profile(calls["ours (flash_attn_func)"], min(args.calls, TRAIN_CALLS) * args.rounds,
                     out_dir / "host_overhead_profile.txt")
            sync()
    path = harness.write_results(
        "host_overhead", rows, title="Host time per attention call: our FlashAttention wrapper beside sdpa",
        columns={"shape": "shape", "attention": "attention", "host_us": "host µs/call (median)",
                 "host_min_us": "min", "vs_sdpa": "÷ kernel_loader sdpa, paired", "gpu_us": "GPU µs/call"},
        out_dir=args.out, commit=args.commit,
        notes=[f"{str(dtype).removeprefix('torch.')}; a sample is {args.calls} calls with no sync inside "
               f"(host issue time), {args.rounds} interleaved rounds; paired: row ÷ kernel_loader's sdpa per "
               "round, median [95 % interval] (below 1: less host time than sdpa). GPU µs: `do_bench` median.",
               f"Training rows: samples of {min(args.calls, TRAIN_CALLS)} forward+backward calls, the GPU kept busy "
               "before each; paired against SDPA on the same data. Where host µs exceeds GPU µs the call is "
               "host-bound in eager mode."],
        extra={"samples_us": samples})
    print(path.read_text())


if __name__ == "__main__":
    main()
