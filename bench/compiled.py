"""A training step's attention under torch.compile: the shipped kernel beside SDPA cuDNN, each
eager and compiled with CUDA graphs, forward+backward, bf16, 16k tokens per batch.

Why: an eager call pays its host time on every call. At 16 × 1k tokens (head_dim 128, causal) the
kernel's host time per forward+backward is close to its GPU time, so that eager row is host-bound
on a slow host (``bench/results/attention.md``, ``host_overhead.md``). Compiled with
``mode="reduce-overhead"`` (CUDA graphs), a step replays the captured kernels and pays no per-call
host time; under compilation the kernel is a torch custom operator, so ``fullgraph=True`` holds.

Each row also checks that the compiled step gives the eager step's numbers: the output bit for
bit, and the gradients bit for bit with ``deterministic=True`` (the default sm90 backward adds
dQ's shares in an order that varies between runs).

TFLOP/s count 4·B·H·S²·D for the forward (halved when causal), 3.5x that for forward+backward;
the median over interleaved rounds of ``do_bench`` medians. Writes ``bench/results/compiled.md``
and ``.json``::

    python bench/compiled.py [--out DIR]

``--tiny`` runs the same steps at a small shape on the CPU (the kernels under
``TRITON_INTERPRET=1``, fp16, torch.compile's ``aot_eager`` backend instead of CUDA graphs,
SDPA's default backend), to check the script itself without a GPU; its figures mean nothing.
"""

from __future__ import annotations

from typing import Any, Callable

import harness

# (head_dim, heads_q, heads_k, seq, causal): the host-bound 1k rows first
ROWS = [(128, 16, 16, 1024, True), (128, 16, 16, 1024, False), (128, 16, 16, 4096, True), (64, 32, 8, 2048, True)]
TOKENS = 16384


def training_call(attend: Callable[..., Any], leaves: tuple, grad: Any, *, graphs: bool = False) -> Callable[[], None]:
    """One forward+backward of ``attend(*leaves)`` against ``grad``; ``graphs``: a compiled step
    with CUDA graphs, whose iterations are marked for torch's graph trees."""
    import torch

    def run():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        torch.autograd.grad(attend(*leaves), leaves, grad)
    return run


def same_numbers(fa: Any, q: Any, k: Any, v: Any, do: Any, causal: bool, **compile_options: Any) -> bool:
    """Whether ``flash_attn_func`` compiled (``fullgraph=True`` and ``compile_options``) returns the
    eager call's output and gradients bit for bit (``deterministic=True``). Raises what
    torch.compile raises."""
    import torch

    def attend(q, k, v):
        return fa.flash_attn_func(q, k, v, causal=causal, deterministic=True)

    def step(fn):
        if compile_options.get("mode") == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        out = fn(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), do)
        return [t.detach().clone() for t in (out, *grads)]  # graph-owned buffers are reused by the next step

    compiled = torch.compile(attend, fullgraph=True, **compile_options)
    step(compiled)  # the first steps record; the third replays
    step(compiled)
    got, want = step(compiled), step(attend)
    return all(torch.equal(a, b) for a, b in zip(got, want))


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--tiny", action="store_true", help="a small shape on the CPU (see above)")
    args = parser.parse_args()
    import torch
    from torch.nn.attention import SDPBackend

    if args.tiny:  # (head_dim, heads, seq, causal) rows, device, dtype, compile options, SDPA backend
        rows_, device, dtype, options, backend, tokens = [(32, 4, 2, 32, True)], "cpu", torch.float16, \
            dict(backend="aot_eager"), SDPBackend.MATH, 64
    else:
        rows_, device, dtype, options, backend, tokens = ROWS, "cuda", torch.bfloat16, \
            dict(mode="reduce-overhead"), SDPBackend.CUDNN_ATTENTION, TOKENS
    graphs = options.get("mode") == "reduce-overhead"
    fa = harness.kernels()["ours"]
    rows = []
    columns = dict(head_dim="d", heads="heads", seq="seq", causal="causal", same="compiled = eager",
                   ours_fwdbwd="ours eager", sdpa_cudnn_fwdbwd="cuDNN eager",
                   ours_compiled_fwdbwd="ours compiled", sdpa_cudnn_compiled_fwdbwd="cuDNN compiled",
                   ratio_fwdbwd="ours/cuDNN eager", ratio_compiled="ours compiled/cuDNN compiled",
                   ratio_ours_compiled_eager="ours compiled/cuDNN eager")
    harness.warm_gpu()
    for d, hq, hk, seq, causal in rows_:
        b = tokens // seq
        mk = lambda h: torch.randn(b, seq, h, d, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
        q, k, v = mk(hq), mk(hk), mk(hk)
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))  # SDPA's [B, H, S, D]
        do, dot = torch.randn_like(q), torch.randn_like(qt)
        if graphs:
            # inside a compiled model attention's inputs are made in the graph; handed in from outside
            # they would be copied into the graph's own buffers at every replay (~256 MB a step here)
            # unless marked as staying at their address
            for t in (q, k, v, qt, kt, vt, do, dot):
                torch._dynamo.mark_static_address(t)
        row: dict = dict(head_dim=d, heads=f"{hq}/{hk}", seq=seq, causal=causal)
        try:
            row["same"] = same_numbers(fa, q, k, v, do, causal, **options)
        except Exception as e:  # recorded in the table; the timings still run
            row["same"] = f"{type(e).__name__}: {str(e)[:160]}"
        torch._dynamo.reset()

        def ours(q, k, v):
            return fa.flash_attn_func(q, k, v, causal=causal)

        cudnn_eager = harness.sdpa(backend, qt, kt, vt, causal)
        # where the backend takes no GQA, K/V expanded to the query heads once, outside the
        # timed call, as harness.sdpa does for the eager column
        expanded = getattr(cudnn_eager, "expanded_kv", False)
        ke, ve = (t.repeat_interleave(hq // hk, 1) for t in (kt, vt)) if expanded else (kt, vt)
        if graphs and expanded:
            for t in (ke, ve):
                torch._dynamo.mark_static_address(t)
        gqa = hq != hk and not expanded

        def cudnn(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        ours_c = torch.compile(ours, fullgraph=True, **options)
        cudnn_c = torch.compile(cudnn, fullgraph=True, **options)

        def cudnn_compiled_call():
            with torch.nn.attention.sdpa_kernel(backend):
                training_call(lambda q, *_: cudnn_c(q, ke, ve), (qt, kt, vt), dot, graphs=graphs)()

        contenders = {
            "ours": (None, training_call(ours, (q, k, v), do)),
            "sdpa_cudnn": (None, training_call(lambda *_: cudnn_eager(), (qt, kt, vt), dot)),
            "ours_compiled": (None, training_call(ours_c, (q, k, v), do, graphs=graphs)),
            "sdpa_cudnn_compiled": (None, cudnn_compiled_call),
        }
        flop = 4 * b * hq * seq * seq * d / (2 if causal else 1)
        if args.tiny:  # each contender once: the script's path is what is checked, not figures
            for name, (_, both) in contenders.items():
                row[f"{name}_fwdbwd"] = 3.5 * flop / harness.time_us(both, device="cpu", calls=1, repeat=1) / 1e6
            row["ratio_fwdbwd"] = row["ours_fwdbwd"] / row["sdpa_cudnn_fwdbwd"]
        else:
            harness.attention_row(row, contenders, flop)
        if row.get("ours_compiled_fwdbwd") and row.get("sdpa_cudnn_compiled_fwdbwd"):
            row["ratio_compiled"] = row["ours_compiled_fwdbwd"] / row["sdpa_cudnn_compiled_fwdbwd"]
        if row.get("ours_compiled_fwdbwd") and row.get("sdpa_cudnn_fwdbwd"):
            row["ratio_ours_compiled_eager"] = row["ours_compiled_fwdbwd"] / row["sdpa_cudnn_fwdbwd"]
        rows.append(row)
        print(row, flush=True)
        path = harness.write_results(
            "compiled", rows, columns=columns, out_dir=args.out, commit=args.commit,
            title="A training step's attention, eager and under torch.compile with CUDA graphs, "
                  "forward+backward TFLOP/s (bf16, 16k tokens per batch)",
            notes=[f"The median over {harness.ROUNDS} interleaved rounds of triton.testing.do_bench medians of "
                   "one forward+backward (torch.autograd.grad); 'compiled': torch.compile(fullgraph=True, "
                   "mode='reduce-overhead'). FLOPs 4·B·H·S²·D forward (halved when causal), 3.5x for "
                   "forward+backward. SDPA gets [B, H, S, D] views, forced onto cuDNN. Inputs and the "
                   "output gradient marked static (torch._dynamo.mark_static_address): not copied into the "
                   "graph's buffers at each replay, as activations made inside a compiled model are not.",
                   "'compiled = eager': the compiled step's output and gradients equal the eager call's bit for "
                   "bit (deterministic=True)."])
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()
    print(path.read_text())


if __name__ == "__main__":
    main()
