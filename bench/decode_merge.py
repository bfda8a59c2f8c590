"""Split-K decode: the slices merged by the last of them in the same launch, beside the merge by
a second kernel, one slice, and SDPA cuDNN, at the small batches of eager generation (one query
token, GQA 32/8, head_dim 128, transformers' heads-first dense cache). Two figures a row: GPU µs
(CUDA-graph replays of 24 calls over 6 caches in turn, as a captured decode step runs them; a
stream-timed figure would add the host's launch time at these sizes) and host µs a call (100
eager calls without a sync, the median of 7 samples), since eager decoding is paced by the host.

First a correctness pass: the merged result against the two-kernel one over many slices and
empty rows, repeated launches (the arrival counters go back to zero) and CUDA-graph replays.
Writes ``bench/results/decode_merge.md`` and ``.json``::

    python bench/decode_merge.py
"""

from __future__ import annotations

import importlib
import statistics
import time

import harness

SHAPES = ((8, 2304), (4, 4100), (8, 4100), (1, 8192), (32, 4096), (32, 32768))  # (batch, keys)
CHECKS = ((3, 5000, 64), (8, 2304, 7), (1, 777, 13), (32, 4096, 2))  # (batch, keys, slices)
HQ, HK, D = 32, 8, 128
CHUNKS = (1, 4)
COPIES = 6  # caches read in turn
ROUNDS = 3


def _host_us(fn, calls: int = 100, samples: int = 7) -> float:
    import torch

    fn()
    got = []
    for _ in range(samples):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        got.append((time.perf_counter_ns() - start) / calls / 1e3)
    torch.cuda.synchronize()
    return sorted(got)[samples // 2]


def _graph_us(fns, calls: int = 24, samples: int = 9) -> float:
    """GPU µs a call of ``fns`` (one per cache copy, taken in turn), ``calls`` of them captured in
    one CUDA graph and replayed: no host time between the kernels, which a small decode step's
    launch would otherwise add to a stream-timed figure."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    got = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        got.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(got)


def _checks(fa, dec) -> list:
    import torch

    rows = []
    for batch, keys, splits in CHECKS:
        q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, keys, HK, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.randint(0, keys + 1, (batch,), device="cuda", dtype=torch.int32)
        lens[0] = 0  # a row without keys: out 0, lse +inf

        def call(merge, **kw):
            saved, dec.MERGE_IN_KERNEL = dec.MERGE_IN_KERNEL, merge
            try:
                return fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=splits, **kw)
            finally:
                dec.MERGE_IN_KERNEL = saved

        merged = [call(True, return_softmax_lse=True) for _ in range(3)]
        out, lse = call(False, return_softmax_lse=True)
        finite = torch.isfinite(lse)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call(True)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            captured = call(True)
        graph_err = 0.0
        for _ in range(5):
            q.copy_(torch.randn_like(q))
            graph.replay()
            graph_err = max(graph_err, (captured.float() - call(False).float()).abs().max().item())
        rows.append(dict(
            batch=batch, keys=keys, splits=splits,
            repeats_identical=all(torch.equal(m[0], merged[0][0]) for m in merged),
            out_err=(merged[0][0].float() - out.float()).abs().max().item(),
            lse_err=(merged[0][1][finite] - lse[finite]).abs().max().item() if finite.any() else 0.0,
            same_empty_rows=bool(torch.equal(torch.isfinite(merged[0][1]), finite)),
            graph_err=graph_err))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    args = harness.arguments(__doc__).parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fa = harness.shipped_kernel()
    dec = importlib.import_module(fa.__name__ + "._triton_decode")
    checks = _checks(fa, dec)
    harness.warm_gpu()
    setup = dec._device_setup(D, torch.device("cuda", torch.cuda.current_device()))
    block_n, sms = setup[0], setup[4]
    rows = []
    for batch, keys in SHAPES:
        # COPIES caches in turn, so back-to-back calls do not find the last one's keys in L2
        caches = [(torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16),
                   torch.randn(batch, HK, keys, D, device="cuda", dtype=torch.bfloat16),
                   torch.randn(batch, HK, keys, D, device="cuda", dtype=torch.bfloat16)) for _ in range(COPIES)]
        # the slices that fill the GPU (choose_num_splits without its one-slice rule for short contexts)
        fill = max(1, min(-(-3 * sms // (batch * HK)), keys // (2 * block_n), 64))

        def ours(splits, merge=None, chunk=None):
            def make(q, k, v):
                def run():
                    saved = dec.MERGE_CHUNK
                    dec.MERGE_CHUNK = chunk or saved
                    try:
                        return dec.decode_attention(
                            q, k, v, total_lens=None, total_len_uniform=keys, capacity=keys, block_table=None,
                            batch_idx=None, leftpad=None, alibi_slopes=None, softmax_scale=D ** -0.5, window_left=-1,
                            window_right=-1, softcap=0.0, num_splits=splits, need_lse=False, heads_first=True,
                            merge_in_kernel=merge)
                    finally:
                        dec.MERGE_CHUNK = saved
                return run
            return make

        def cudnn(q, k, v):
            def run():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            return run

        makers = {"shipped": ours(0), "one_slice": ours(1), "two_kernels": ours(fill, False),
                  **{f"merged_c{c}": ours(fill, True, c) for c in CHUNKS}, "cudnn": cudnn}
        row = dict(batch=batch, keys=keys, splits=fill, shipped_splits=dec.choose_num_splits(
            batch * HK, keys, sms, True, block_n, whole_rows=setup[6] is not None))  # a dense cache
        samples = {name: [] for name in makers}
        for r in range(ROUNDS):
            names = list(makers)[r % len(makers):] + list(makers)[:r % len(makers)]
            for name in names:
                try:
                    samples[name].append(_graph_us([makers[name](*c) for c in caches]))
                except Exception as e:  # reported in the table, not retried
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row.update({f"{name}_gpu": statistics.median(t) for name, t in samples.items() if t})
        row.update({f"{name}_host": _host_us(make(*caches[0])) for name, make in makers.items()})
        rows.append(row)
        print(row, flush=True)
    columns = {"batch": "batch", "keys": "keys", "splits": "slices", "shipped_splits": "shipped slices"}
    for name, label in (("shipped", "shipped"), ("one_slice", "1 slice"), ("two_kernels", "2 kernels"),
                        *((f"merged_c{c}", f"merged, {c} at once") for c in CHUNKS), ("cudnn", "cuDNN")):
        columns[f"{name}_gpu"] = f"{label} GPU µs"
    for name, label in (("shipped", "shipped"), ("two_kernels", "2 kernels"), ("merged_c4", "merged"),
                        ("cudnn", "cuDNN")):
        columns[f"{name}_host"] = f"{label} host µs"
    path = harness.write_results(
        "decode_merge", rows,
        title=f"Split-K decode: slices merged in the same launch beside a second kernel (bf16, GQA {HQ}/{HK}, "
              f"head_dim {D})",
        columns=columns, out_dir=args.out, commit=args.commit,
        notes=["One query token a row over a dense heads-first cache ([B, H, S, D], transformers' layout). "
               "'slices': the count that fills the GPU, used by the 2-kernel and merged rows; 'shipped': "
               "the call's own choice. 'merged, N at once': the last slice of a tile merges all of them, "
               "loading N slices' partial results at a time. GPU µs: "
               "the median per call of 9 replays of a CUDA graph of 24 calls over 6 caches in turn (no host time between kernels, the keys of one call not left in L2 for the next), over 3 interleaved rounds; host µs: 100 eager calls without a sync, median of 7 samples.",
               "Correctness (merged against the two-kernel merge, empty rows included, 3 repeated launches, "
               "5 CUDA-graph replays with new queries): " + "; ".join(
                   f"batch {c['batch']} x {c['keys']} keys, {c['splits']} slices: out err {c['out_err']:.2g}, "
                   f"lse err {c['lse_err']:.2g}, graph err {c['graph_err']:.2g}, repeats identical "
                   f"{c['repeats_identical']}, empty rows alike {c['same_empty_rows']}" for c in checks)],
        extra={"checks": checks})
    print(path.read_text())


if __name__ == "__main__":
    main()
