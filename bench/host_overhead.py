"""Host time per attention call: kernel_loader's FlashAttention wrapper beside sdpa.

In eager decoding (one query token per layer) the host's cost per call, not the GPU's, sets the
pace, so this times what the host spends to issue one attention call of a model layer, with the
GPU left to catch up between samples (a sample is ``--calls`` calls with no sync inside; the
contenders interleave over rounds). On a GPU the GPU time per call (``do_bench``) stands beside
it: where host time exceeds GPU time, the call is host-bound. Contenders, each called as a
transformers layer calls its attention function (``fn(module, q, k, v, mask, scaling=...)``,
q/k/v ``[B, H, S, D]``):

* ours: ``make_flash_attention`` bound to the shipped kernel (what
  ``attn_implementation="kernels-community/flash-attn2"`` runs; under Triton 3.6 its cached
  launches call Triton's C launch function themselves, ``_launch.DirectLaunch``), and the same
  through Triton's own launcher (``FLASH_ATTN2_DIRECT_LAUNCH=0``; elsewhere the same path twice),
* sdpa: kernel_loader's ``sdpa`` backend and, when transformers is installed, transformers' own
  ``sdpa_attention_forward``.

Shapes: a decode step of the 1B Llama in ``bench/e2e_transformers.py`` (batch 8, 2304 keys, GQA
32/8, head_dim 64) and a short prefill (batch 1, 512 tokens, causal).

Training rows: one forward+backward (``torch.autograd.grad`` of ``flash_attn_func`` against SDPA's
cuDNN backend on ``[B, H, S, D]`` views) at the attention table's 1k shape (16 × 1024, 16 heads,
head_dim 128, causal; on the CPU a small stand-in), with the GPU kept busy (``torch.cuda._sleep``)
before each sample, so the host never waits for it and a sample is the host's issue time alone.
``--profile`` also writes ``host_overhead_profile.txt`` into ``--out``: the functions our
training call spends host time in (cProfile; before Python 3.12 it does not see autograd's device
thread, where the backward runs). ``--phases`` splits that call's host time over
the package's functions, Triton's launcher, its TMA descriptor encoding and torch's allocations
(each wrapped in a timer; ``host_overhead_phases.md``/``.json``).

    PYTHONPATH=. python bench/host_overhead.py --profile --phases                     # on a GPU
    PYTHONPATH=. python bench/host_overhead.py --calls 2 --rounds 3 --out /tmp/host   # a quick check
"""

from __future__ import annotations

import importlib
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

    return {OURS: launches(kernel, ours, direct=True), TRITON_LAUNCHER: launches(kernel, ours, direct=False),
            "sdpa (cuDNN)" if device == "cuda" else "sdpa (math)": sdpa, "inputs": (q, k, v, do)}


OURS = "ours (flash_attn_func)"
TRITON_LAUNCHER = "ours (flash_attn_func, Triton's launcher)"


def launches(kernel, fn, *, direct: bool):
    """``fn`` with the kernel's cached launches calling Triton's C launch function themselves
    (``direct``: the default, ``_launch.DirectLaunch``; Triton 3.6 only, elsewhere both ways are
    the same path) or going through Triton's launcher. Both set the switch on every call, so
    the two pay the same for it."""
    launch = importlib.import_module(f"{kernel.__name__}._launch")

    def call(*args, **kwargs):
        launch.DIRECT_LAUNCH = direct
        return fn(*args, **kwargs)
    return call


# Where one training call's host time goes: the package's own functions, Triton's launcher and
# torch's allocations, each wrapped with a timer (inclusive µs per forward+backward call).
# Why beside cProfile: its per-call cost inflates small functions several-fold, and on Pythons
# before 3.12 it does not see autograd's device thread, where the backward runs.
PHASES = (  # (label, module of the kernel package or None for Triton/torch, attribute path)
    ("flash_attn_func", None, None),
    ("  _TritonAttention.forward", "_autograd", "_TritonAttention.forward"),
    ("    _backward_ahead", "_autograd", "_backward_ahead"),
    ("    _triton_forward", "_autograd", "_triton_forward"),
    ("      gluon_attention_forward", "_gluon_fwd", "gluon_attention_forward"),
    ("autograd.grad", None, None),
    ("  _TritonAttention.backward (autograd's thread)", "_autograd", "_TritonAttention.backward"),
    ("    attention_backward", "_triton_bwd", "attention_backward"),
    ("      gluon_dkdv_dq", "_gluon_bwd", "gluon_dkdv_dq"),
    ("      _launch_args (gluon bwd)", "_gluon_bwd", "_launch_args"),
)


def _phase_breakdown(kernel, shape: tuple, calls: int, rounds: int, device: str, dtype, direct: bool = True) -> dict:
    """label -> mean host µs per forward+backward call of ours (on a GPU, kept busy), plus the
    same call's total without the timers and SDPA's (cuDNN on a GPU) total beside it; ``direct``:
    with the kernel's direct launches (the default, :func:`launches`), or through Triton's launcher."""
    import time
    from collections import defaultdict

    import torch

    training = _training_calls(kernel, shape, device, dtype)
    launch = importlib.import_module(f"{kernel.__name__}._launch")
    ours, sdpa = training[OURS if direct else TRITON_LAUNCHER], training[
        next(name for name in training if name.startswith("sdpa"))]
    spent: dict = defaultdict(int)
    count: dict = defaultdict(int)
    clock = time.perf_counter_ns

    def timed(label, fn):
        """``fn`` charging its calls to ``label`` (a string, or a function of the call's first
        argument that names it)."""
        def wrapper(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                name = label if isinstance(label, str) else label(args[0])
                spent[name] += clock() - t
                count[name] += 1
        return wrapper

    undo = []

    def patch(owner, name, label, static=False):
        old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        fn = old.__func__ if static else old  # a staticmethod's function; a method's is itself
        new = timed(label, fn)
        setattr(owner, name, staticmethod(new) if static else new)
        undo.append((owner, name, old))

    pkg = kernel.__name__
    for label, module, path in PHASES:
        if module is None:
            continue
        owner = importlib.import_module(f"{pkg}.{module}")
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        patch(owner, name, label.strip(), static=isinstance(owner, type))

    def kernel_name(launcher):
        fn = getattr(launcher._fn, "fn", launcher._fn)
        return f"Launcher: {getattr(fn, '__name__', repr(fn))}"

    patch(launch.Launcher, "__call__", kernel_name)
    try:
        from triton.backends.nvidia import driver as nv_driver

        patch(nv_driver, "make_tensordesc_arg", "Triton: make_tensordesc_arg (one TMA descriptor)")
        patch(nv_driver.CudaLauncher, "__call__", "Triton: CudaLauncher.__call__")
    except (ImportError, AttributeError, KeyError):
        pass
    for name in ("empty", "empty_like", "zeros", "empty_strided"):
        patch(torch, name, f"torch.{name}")

    def outer_ours():
        fa = timed("flash_attn_func", kernel.flash_attn_func)
        q, k, v, do = training["inputs"]
        launch.DIRECT_LAUNCH = direct
        return timed("autograd.grad", torch.autograd.grad)(fa(q, k, v, causal=True), (q, k, v), do)

    gpu = device == "cuda"

    def sample(fn) -> float:
        if gpu:
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)  # the GPU stays busy: the host never waits for it
        t = clock()
        for _ in range(calls):
            fn()
        per_call = (clock() - t) / 1000.0 / calls
        if gpu:
            torch.cuda.synchronize()
        return per_call

    try:
        outer_ours()
        spent.clear()
        count.clear()
        timed_totals = [sample(outer_ours) for _ in range(rounds)]
        n = calls * rounds
        phases = {label: round(spent[label] / 1000.0 / n, 2) for label in spent}
        counts = {label: count[label] / n for label in count}
    finally:
        for owner, name, old in reversed(undo):
            setattr(owner, name, old)
    plain = [sample(ours) for _ in range(rounds)]
    cudnn = [sample(sdpa) for _ in range(rounds)]

    return {"phases_us": phases, "calls_per_fwdbwd": counts,
            "total_with_timers_us": statistics.median(timed_totals),
            "total_us": statistics.median(plain), "sdpa_total_us": statistics.median(cudnn)}


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
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    path.write_text(f"cProfile of {calls} calls (cumulative, then own time; the backward runs on autograd's device "
                    "thread, which cProfile sees from Python 3.12 on)\n" + text.getvalue())


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
    parser.add_argument("--phases", action="store_true",
                        help="also write host_overhead_phases.md/.json: our training call's host time "
                             "split over the package's functions, Triton's launcher and torch's allocations")
    args = parser.parse_args()

    import torch

    from kernel_loader.attention import ALL_ATTENTION_FUNCTIONS, make_flash_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shipped = harness.shipped_kernel()
    ours = make_flash_attention(shipped)

    contenders = {"ours (flash wrapper, shipped kernel)": launches(shipped, ours, direct=True),
                  "ours (flash wrapper, Triton's launcher)": launches(shipped, ours, direct=False),
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
    kernel = shipped
    for shape, (gpu_shape, cpu_shape) in TRAIN_SHAPES.items():
        calls = _training_calls(kernel, gpu_shape if device == "cuda" else cpu_shape, device, dtype)
        calls.pop("inputs")

        def busy(name):
            # the GPU stays busy while the sample issues its calls: host time alone is measured
            sync()
            if device == "cuda":
                torch.cuda._sleep(100_000_000)  # longer than a sample takes the host to issue
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
    if args.phases:
        (gpu_shape, cpu_shape), = TRAIN_SHAPES.values()
        shape = gpu_shape if device == "cuda" else cpu_shape
        split, triton_launcher = (_phase_breakdown(kernel, shape, min(args.calls, TRAIN_CALLS), args.rounds, device,
                                                   dtype, d) for d in (True, False))
        named = [label for label, _m, _p in PHASES]
        named += sorted({*split["phases_us"], *triton_launcher["phases_us"]} - {x.strip() for x in named})
        phase_rows = [{"phase": label, "host_us": split["phases_us"].get(label.strip()),
                       "calls": split["calls_per_fwdbwd"].get(label.strip()),
                       "triton_us": triton_launcher["phases_us"].get(label.strip())} for label in named]
        phase_rows += [{"phase": "whole call, timers on", "host_us": split["total_with_timers_us"],
                        "triton_us": triton_launcher["total_with_timers_us"]},
                       {"phase": "whole call, timers off", "host_us": split["total_us"],
                        "triton_us": triton_launcher["total_us"]},
                       {"phase": f"SDPA's whole call ({'cuDNN' if device == 'cuda' else 'math'}, same data)",
                        "host_us": split["sdpa_total_us"], "triton_us": triton_launcher["sdpa_total_us"]}]
        harness.write_results(
            "host_overhead_phases", phase_rows,
            title="Host time of one forward+backward call of ours, by function (the training row's shape)",
            columns={"phase": "function (indented: called inside the one above)", "host_us": "µs per call",
                     "calls": "calls per forward+backward", "triton_us": "µs per call, Triton's launcher"},
            out_dir=args.out, commit=args.commit,
            notes=[f"{str(dtype).removeprefix('torch.')}, {'x'.join(map(str, gpu_shape if device == 'cuda' else cpu_shape))} "
                   f"[B, S, H, D], causal; each function wrapped in a timer (inclusive time, which holds the "
                   "cost of the timers inside it: the two whole-call totals below, divided by the timed calls per "
                   f"call, give one timer's cost), {args.rounds} samples of {min(args.calls, TRAIN_CALLS)} calls "
                   "with the GPU kept busy (host issue time alone), mean per call. The backward runs on autograd's "
                   "device thread; autograd.grad minus _TritonAttention.backward is the engine's own share.",
                   "µs per call: as shipped, the kernel's cached launches calling Triton's C launch function "
                   "themselves (`_launch.DirectLaunch`); Triton's launcher: the same call with "
                   "`FLASH_ATTN2_DIRECT_LAUNCH=0` (Triton 3.6 only; elsewhere the two columns time the same path)."],
            extra={"split": split, "split_triton_launcher": triton_launcher})
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
