"""Attention table on a GPU: the shipped kernel beside SDPA cuDNN, SDPA flash (FlashAttention 2)
and FlexAttention, forward and forward+backward, bf16, 16k tokens per batch.

TFLOP/s count 4·B·H·S²·D for the forward (halved when causal) and 3.5x that for forward+backward.
``--baseline DIR`` adds another copy of the kernel package (e.g. the previous commit's) as a
column. Writes ``bench/results/attention.md`` and ``.json``::

    python bench/attention.py [--baseline /path/to/old/flash-attn2] [--rows quick]
"""

from __future__ import annotations

import importlib

import harness

# (head_dim, heads_q, heads_k, seq): the rows of the table, both masks each
ROWS = [(128, 16, 16, 1024), (128, 16, 16, 4096), (128, 16, 16, 16384), (256, 16, 16, 4096),
        (64, 32, 8, 2048), (64, 16, 16, 4096)]
TOKENS = 16384
FLEX_ROWS = {(128, 4096)}  # FlexAttention compiles per shape and mask: timed on the (d, seq) rows here


def contenders(kernels: dict, d: int, hq: int, hk: int, seq: int, causal: bool, flex: bool) -> dict:
    import torch
    from torch.nn.attention import SDPBackend

    b = TOKENS // seq
    mk = lambda h: torch.randn(b, seq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = mk(hq), mk(hk), mk(hk)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))  # SDPA's [B, H, S, D]
    do, dot = torch.randn_like(q), torch.randn_like(qt)
    out: dict = {}
    for name, fa in kernels.items():
        out[name] = (lambda fa=fa: fa.flash_attn_func(q, k, v, causal=causal))
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        out[name] = harness.sdpa(backend, qt, kt, vt, causal)
    if flex and (d, seq) in FLEX_ROWS:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention)
        mask = create_block_mask(lambda b_, h_, i, j: i >= j, None, None, seq, seq) if causal else None
        out["flex"] = lambda: compiled(qt, kt, vt, block_mask=mask, enable_gqa=hq != hk)
    timed = {}
    for name, fwd in out.items():
        grad = do if name in kernels else dot
        leaves = (q, k, v) if name in kernels else (qt, kt, vt)

        def both(fwd=fwd, grad=grad, leaves=leaves):
            torch.autograd.grad(fwd(), leaves, grad)
        timed[name] = (fwd, both)
    if "ours" in kernels:
        # the same kernel asked for a bitwise-repeatable backward (dQ in its own kernel, which
        # recomputes the scores) beside its default (on sm90: dQ reduced inside dK/dV)
        def deterministic(fa=kernels["ours"]):
            torch.autograd.grad(fa.flash_attn_func(q, k, v, causal=causal, deterministic=True), (q, k, v), do)
        timed["ours_det"] = (None, deterministic)
    return timed


def count_calls(fa, module: str, function: str) -> list:
    """Wrap one of the kernel's Gluon entry points so that a one-element counter says how often it
    ran (the table then names the kernels each row ran: the dispatch rules decide per call)."""
    mod = importlib.import_module(f"{fa.__name__}.{module}")
    calls = [0]
    real = getattr(mod, function)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    setattr(mod, function, counted)
    return calls


def main() -> None:
    parser = harness.arguments(__doc__, baseline=True)
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--head-dims", help="comma-separated head dims: only their rows (default: every row)")
    args = parser.parse_args()
    dims = {int(d) for d in args.head_dims.split(",")} if args.head_dims else None
    import torch

    kernels = harness.kernels(args.baseline)
    gluon_calls = count_calls(kernels["ours"], "_gluon_fwd", "gluon_attention_forward")
    gluon_bwd_calls = count_calls(kernels["ours"], "_gluon_bwd", "gluon_dkdv_dq")
    rows = []

    def write():
        columns = dict(head_dim="d", heads="heads", seq="seq", causal="causal", ours_fwd_kernel="ours fwd kernel",
                       ours_bwd_kernel="ours bwd kernel",
                       ours_fwd="ours fwd", sdpa_cudnn_fwd="cuDNN fwd", sdpa_flash_fwd="FA2 fwd", flex_fwd="Flex fwd",
                       ours_fwdbwd="ours f+b", sdpa_cudnn_fwdbwd="cuDNN f+b", sdpa_flash_fwdbwd="FA2 f+b",
                       flex_fwdbwd="Flex f+b", ours_det_fwdbwd="ours f+b deterministic",
                       ratio_fwd="ours/cuDNN fwd", ratio_fwdbwd="ours/cuDNN f+b",
                       vs_det_fwdbwd="ours/deterministic f+b")
        if args.baseline:
            columns.update(harness.BASELINE_COLUMNS)
        path = harness.write_results(
            "attention", rows, title="Attention forward and forward+backward, TFLOP/s (bf16, 16k tokens per batch)",
            columns=columns, out_dir=args.out, commit=args.commit,
            notes=[f"The median over {harness.ROUNDS} interleaved rounds (each times every contender once, in a "
                   "balanced order: each pair of rounds runs one order and its reverse, after the GPU was kept busy for 2 s) of triton.testing.do_bench medians; "
                   "FLOPs 4·B·H·S²·D forward (halved when causal), 3.5x for "
                   "forward+backward. SDPA and Flex get [B, H, S, D] views, the kernel [B, S, H, D].",
                   "'ours bwd kernel': the backward the default call ran (Gluon: dQ reduced inside the dK/dV/dQ "
                   "kernel, _gluon_dispatch.MEASURED_FASTER_BWD; Triton: the Triton kernels). 'deterministic': the "
                   "kernel called with deterministic=True, which always runs the Triton backward with dQ in its own "
                   "kernel."])
        return path

    harness.warm_gpu()  # the first row's timings do not meet an idle GPU's clocks
    for d, hq, hk, seq in ROWS:
        if dims is not None and d not in dims:
            continue
        for causal in (False, True):
            flop = 4 * (TOKENS // seq) * hq * seq * seq * d / (2 if causal else 1)
            row = dict(head_dim=d, heads=f"{hq}/{hk}", seq=seq, causal=causal)
            before, before_bwd = gluon_calls[0], gluon_bwd_calls[0]
            rows.append(harness.attention_row(row, contenders(kernels, d, hq, hk, seq, causal, not args.no_flex),
                                              flop))
            row["ours_fwd_kernel"] = "Gluon" if gluon_calls[0] > before else "Triton"
            row["ours_bwd_kernel"] = "Gluon" if gluon_bwd_calls[0] > before_bwd else "Triton"
            if row.get("ours_fwdbwd") and row.get("ours_det_fwdbwd"):
                row["vs_det_fwdbwd"] = row["ours_fwdbwd"] / row["ours_det_fwdbwd"]
            print(row, flush=True)
            path = write()  # after every row: a run stopped by a time limit keeps its rows
            torch.cuda.empty_cache()
    print(path.read_text())


if __name__ == "__main__":
    main()
