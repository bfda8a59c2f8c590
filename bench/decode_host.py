"""Where the host time of one sliced decode call goes: the shipped call beside variants that each
take one part away, and SDPA, at the end-to-end decode shape (batch 4, GQA 32/8, head_dim 128,
4100 keys: 13 slices merged in the launch).

Why: in a transformers decode step the shipped call spends 20-30 µs more host time than sdpa's
(``bench/results/e2e_decode_split.md``), and reading each row in one slice removes that gap but
costs GPU time. This splits the gap into its parts. Rows:

* ``shipped``;
* ``capture query asked``: the CUDA-graph capture check asked of the driver on the default stream
  too (the shipped call answers it there without asking: no capture can run on that stream);
* ``kept launches`` / ``launcher key each call``: each call of a shape after the first repeats the
  launch the first kept (``KEEP_LAUNCHES = True``), or works the launcher's key out every time
  (``False``); one of the two is the shipped call;
* ``fresh partials``: the slices' partial results allocated per call (``REUSE_PARTIALS = False``);
* ``two kernels``: merged by a second kernel (``MERGE_IN_KERNEL = False``);
* ``one slice``: each row read whole (``choose_num_splits`` -> 1);
* ``Python only``: the shipped call with both kernel launches replaced by no-ops;
* ``shipped, timed by part``: the shipped call with a clock on each of its parts
  (``harness.decode_parts``), the same clocks ``bench/e2e_decode_split.py`` reads in the model;
* ``sdpa``: ``scaled_dot_product_attention(enable_gqa=True)`` on the same tensors.

Host µs: the fastest of 7 samples of 300 calls issued while the GPU is kept busy (no sync
inside: the host's issue time alone). GPU µs: ``do_bench`` median (Python-only row: none).

    python bench/decode_host.py [--out DIR]       # on a GPU
    python bench/decode_host.py --smoke           # a tiny shape through the interpreter, any machine
"""

from __future__ import annotations

import importlib
import time
from typing import Callable

import harness

SHAPE = dict(batch=4, heads=32, kv_heads=8, head_dim=128, keys=4100)
SMOKE = dict(batch=1, heads=4, kv_heads=2, head_dim=32, keys=48)


def host_us(fn: Callable[[], object], device: str, calls: int, samples: int = 7) -> float:
    """Fastest per-call host time over ``samples`` loops of ``calls`` calls, the GPU kept busy."""
    import torch

    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(samples):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)  # longer than the loop: the host never waits for the GPU
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        if device == "cuda":
            torch.cuda.synchronize()
    return best


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape through the interpreter")
    args = parser.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    s = SMOKE if device == "cpu" else SHAPE
    fa = harness.kernels()["ours"]
    dec = importlib.import_module(fa.__name__ + "._triton_decode")
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(s["batch"], s["heads"], 1, s["head_dim"], device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(s["batch"], s["kv_heads"], s["keys"], s["head_dim"], device=device, dtype=dtype,
                        generator=gen) for _ in range(2))

    def ours():
        return fa.flash_attn_decode_heads_first(q, k, v, None, True, (-1, -1), 0.0)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    want = sdpa().transpose(1, 2)
    variants = {
        "shipped": {},
        "capture query asked": {(dec, "_capturing"): lambda stream: torch.cuda.is_current_stream_capturing()},
        "kept launches": {(dec, "KEEP_LAUNCHES"): True},
        "launcher key each call": {(dec, "KEEP_LAUNCHES"): False},
        "fresh partials": {(dec, "REUSE_PARTIALS"): False},
        "two kernels": {(dec, "MERGE_IN_KERNEL"): False},
        "one slice": {(dec, "choose_num_splits"): lambda *a, **kw: 1},
        "Python only": {(dec, "_SPLIT"): lambda *a: None, (dec, "_COMBINE"): lambda *a: None},
    }
    calls = 300 if device == "cuda" else 2
    rows = []
    for name, changes in variants.items():
        with harness.settings(changes):
            row = dict(variant=name, host_us=host_us(ours, device, calls))
            if name != "Python only":
                got = ours()
                row["max_error"] = float((got.float() - want.float()).abs().max())
                row["gpu_us"] = harness.time_us(ours, device=device) if device == "cuda" else None
        rows.append(row)
        print(row, flush=True)
    with harness.decode_parts(dec) as clocks:
        row = dict(variant="shipped, timed by part", host_us=host_us(ours, device, calls))
        row["parts"] = " / ".join(f"{part} {us:.1f}" for part, us in
                                  harness.parts_us(clocks, clocks["decode_attention"].calls).items())
    rows.append(row)
    print(row, flush=True)
    rows.append(dict(variant="sdpa", host_us=host_us(sdpa, device, calls),
                     gpu_us=harness.time_us(sdpa, device=device) if device == "cuda" else None))
    print(rows[-1], flush=True)
    harness.write_results(
        "decode_host", rows,
        title="Host time of one sliced decode call, by part (batch 4, GQA 32/8, head_dim 128, 4100 keys)",
        columns={"variant": "call", "host_us": "host µs/call (fastest sample)", "gpu_us": "GPU µs/call",
                 "max_error": "max |ours - sdpa|", "parts": "host µs per call, by part (mean over every call)"},
        out_dir=args.out, commit=args.commit,
        notes=[f"Shape {s}, {str(dtype).split('.')[-1]}; host: the fastest of 7 samples of {calls} calls issued "
               "while the GPU sleeps (no sync inside); GPU: do_bench median. Each variant takes one part "
               "of the shipped call away (see the script's docstring)."])


if __name__ == "__main__":
    main()
