"""What the first call of the shipped kernel compiles, measured without a GPU: the kernels a
call launches are recorded through the real entry points (``attention_forward`` /
``attention_backward`` on CPU tensors shaped like the GPU call, launches intercepted), then
compiled for sm90 with ``triton.compile``, each stage timed (Python front end, TTIR, TTGIR, LLVM
IR, PTX, ptxas). Run it beside ``bench/compile_report.py`` (the GPU's own first call): this CPU
is not the GPU host's, so compare ratios.

    python bench/compile_offline.py [--threads N]

Not counted: the C launcher Triton builds per kernel with the system compiler on the first
launch (0.2-0.3 s each here), loading the binary, and the forward's Gluon kernel where it runs.

Also ``--audit NAME``: the vector width of every global load/store/async copy in a recorded
case's PTX, beside the alignment facts Triton specialised each argument on (``python
bench/compile_offline.py --audit varlen-kvpacked-d80``).
Writes ``bench/results/compile_offline.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Iterator, List

import harness

TARGET_ARCH = (90, 64)  # sm90, warp size; what the H100/H200 compile for


def kernel_modules():
    """The shipped package's fwd / bwd / decode / launch modules."""
    fa = harness.shipped_kernel()
    return fa, {m: importlib.import_module(f"{fa.__name__}.{m}") for m in ("_triton_fwd", "_triton_bwd", "_launch")}


@contextlib.contextmanager
def recorded(mods: dict, capability=(9, 0)) -> Iterator[list]:
    """Launches of the kernels inside the block, as ``(jit_fn, grid, args, constexprs, warps,
    stages)``, not run; the launch path believes it is on a GPU of ``capability``."""
    launch, fwd, bwd = mods["_launch"], mods["_triton_fwd"], mods["_triton_bwd"]
    out: list = []
    saved = launch.Launcher.__call__, fwd.device_capability, bwd.device_capability, launch.compile_all

    def record(self, grid, args, constexprs, num_warps, num_stages):
        out.append((self._fn, grid, args, constexprs, num_warps, num_stages))

    launch.Launcher.__call__ = record
    launch.compile_all = lambda jobs, device=None: []  # the compiles the kernel starts ahead: none here
    fwd.device_capability = bwd.device_capability = lambda t: capability
    try:
        yield out
    finally:
        launch.Launcher.__call__, fwd.device_capability, bwd.device_capability = saved[:3]
        launch.compile_all = saved[3]


def source_of(launch_record, target):
    """Triton's (ASTSource, options) for a recorded launch, specialised exactly as Triton's own
    launcher specialises those arguments (its binder, run on the CPU tensors)."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn, _grid, args, constexprs, warps, stages = launch_record
    kwargs = dict(zip([fn.arg_names[i] for i in fn.constexprs], constexprs), num_warps=warps, num_stages=stages)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, consts, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(fn, signature, consts, attrs), options


@contextlib.contextmanager
def stage_timer() -> Iterator[Dict[str, float]]:
    """Seconds per compile stage of every ``triton.compile`` inside the block (summed)."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import compiler as tc

    times: Dict[str, float] = {}
    real_add, real_make_ir = CUDABackend.add_stages, tc.ASTSource.make_ir

    def add_stages(self, stages, options, language):
        real_add(self, stages, options, language)
        for name, fn in list(stages.items()):
            def timed(src, metadata, fn=fn, name=name):
                t = time.perf_counter()
                try:
                    return fn(src, metadata)
                finally:
                    times[name] = times.get(name, 0.0) + time.perf_counter() - t
            stages[name] = timed

    def make_ir(self, *a, **kw):
        t = time.perf_counter()
        try:
            return real_make_ir(self, *a, **kw)
        finally:
            times["python front end"] = times.get("python front end", 0.0) + time.perf_counter() - t

    CUDABackend.add_stages, tc.ASTSource.make_ir = add_stages, make_ir
    try:
        yield times
    finally:
        CUDABackend.add_stages, tc.ASTSource.make_ir = real_add, real_make_ir


PER_KERNEL: Dict[str, float] = {}  # seconds of the last serial compile of each kernel


def compile_all(records: list, threads: int = 1, cache_dir: str = None) -> tuple:
    """Compile ``records`` for sm90 into ``cache_dir`` (default: a new, empty Triton cache
    folder); returns (compiled kernels, wall seconds)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", *TARGET_ARCH)
    knobs.cache.dir = cache_dir or tempfile.mkdtemp(prefix="compile_offline_")

    def one(rec):
        src, options = source_of(rec, target)
        return triton.compile(src, target=target, options=options.__dict__)

    start = time.perf_counter()
    if threads <= 1:
        compiled = []
        for r in records:
            t = time.perf_counter()
            compiled.append(one(r))
            PER_KERNEL[r[0].__name__] = time.perf_counter() - t
    else:
        with ThreadPoolExecutor(threads) as pool:
            compiled = list(pool.map(one, records))
    return compiled, time.perf_counter() - start


def first_call_records(fa, mods, head_dim=128, heads=16, seq=4096, causal=True) -> Dict[str, list]:
    """The launches of compile_report's first call (bf16, batch 1), forward and backward apart."""
    import torch

    fwd, bwd = mods["_triton_fwd"], mods["_triton_bwd"]
    q, k, v = (torch.empty(1, seq, heads, head_dim, dtype=torch.bfloat16) for _ in range(3))
    opts = dict(softmax_scale=head_dim ** -0.5, causal=causal)
    with recorded(mods) as f:
        out, lse = fwd.attention_forward(q, k, v, **opts)
    with recorded(mods) as b:
        bwd.attention_backward(torch.empty_like(out), q, k, v, out, lse, **opts)
    return {"forward": f, "backward": b}


def audit_cases(mods) -> Dict[str, Callable[[], list]]:
    """Calls whose kernels ``--audit`` can show (the GPU failures under investigation)."""
    import torch

    fwd, bwd = mods["_triton_fwd"], mods["_triton_bwd"]

    def varlen_kvpacked_d80() -> list:
        # flash_attn_tests' test_flash_attn_varlen_output {kvpacked, bf16, mha, alibi, causal,
        # dropout 0.17, softcap 50, d=80, (512, 256)}: its lengths, its views
        d, batch, hq = 80, 4, 6
        lq = torch.randint(256, 513, (batch,), generator=torch.Generator().manual_seed(d)).tolist()
        lk = torch.randint(128, 257, (batch,), generator=torch.Generator().manual_seed(d + 1)).tolist()
        lq[0], lk[0] = 512, 256
        cu = lambda ls: torch.tensor([0] + list(itertools.accumulate(ls)), dtype=torch.int32)  # noqa: E731
        q = torch.empty(sum(lq), hq, d, dtype=torch.bfloat16)
        k, v = torch.empty(sum(lk), 2, hq, d, dtype=torch.bfloat16).unbind(1)
        opts = dict(cu_seqlens_q=cu(lq), cu_seqlens_k=cu(lk), max_seqlen_q=512, max_seqlen_k=256,
                    softmax_scale=d ** -0.5, causal=True, softcap=50.0, dropout_p=0.17, seed=7,
                    alibi_slopes=torch.rand(batch, hq))
        with recorded(mods) as rec:
            out, lse = fwd.attention_forward(q, k, v, **opts)
            bwd.attention_backward(torch.empty_like(out), q, k, v, out, lse, **opts)
        return rec

    return {"varlen-kvpacked-d80": varlen_kvpacked_d80}


_VECTOR = re.compile(r"\b(ld\.global|st\.global|cp\.async\.c[ag]\.shared\.global)[.\w]*")


def vector_ops(ptx: str) -> Dict[str, int]:
    """Count of each global access form in ``ptx`` (width suffix or cp.async byte count kept)."""
    counts: Dict[str, int] = {}
    for line in ptx.splitlines():
        m = _VECTOR.search(line)
        if not m:
            continue
        op = m.group(0)
        if op.startswith("cp.async"):
            size = re.search(r",\s*(0x[0-9a-f]+)", line)
            op = f"cp.async {int(size.group(1), 16) if size else '?'} B"
        counts[op] = counts.get(op, 0) + 1
    return counts


def audit(records: list) -> List[dict]:
    """For each recorded launch: the alignment facts Triton specialised on (pointer aligned to
    16 bytes, integer a multiple of 16) checked against the argument values, and the PTX's global
    access widths."""
    import torch
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", *TARGET_ARCH)
    compiled, _ = compile_all(records)
    rows = []
    for rec, c in zip(records, compiled):
        fn, _grid, args = rec[0], rec[1], rec[2]
        src, _ = source_of(rec, target)
        claims, wrong = [], []
        for (i,), attr in src.attrs.items():
            if ["tt.divisibility", 16] not in attr:
                continue
            a = args[i]
            true = a.data_ptr() % 16 == 0 if isinstance(a, torch.Tensor) else a % 16 == 0
            claims.append(fn.arg_names[i])
            if not true:
                wrong.append(fn.arg_names[i])
        rows.append(dict(kernel=fn.__name__, divisible_by_16=len(claims), false_claims=", ".join(wrong) or "none",
                         global_accesses=", ".join(f"{k}: {v}" for k, v in sorted(vector_ops(c.asm["ptx"]).items()))))
    return rows


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--threads", type=int, default=4, help="threads for the forward + backward row "
                        "(the shipped kernel's compile pool has 4)")
    parser.add_argument("--audit", default=None, help="show the kernels of one case instead (see audit_cases)")
    parser.add_argument("--hits", default=None, help=argparse.SUPPRESS)  # the prepared-cache row's own process
    args = parser.parse_args()
    fa, mods = kernel_modules()
    if args.hits:
        recs = first_call_records(fa, mods)
        print(json.dumps(dict(wall_s=compile_all(recs["forward"] + recs["backward"], cache_dir=args.hits)[1])))
        return
    if args.audit:
        for row in audit(audit_cases(mods)[args.audit]()):
            print(row)
        return
    recs = first_call_records(fa, mods)
    rows = []
    for part in ("forward", "backward"):
        with stage_timer() as times:
            compiled, wall = compile_all(recs[part])
        rows.append(dict(part=part, kernels=", ".join(f"{r[0].__name__} {PER_KERNEL[r[0].__name__]:.2f} s"
                                                      for r in recs[part]), threads=1,
                         wall_s=round(wall, 2), **{k: round(v, 2) for k, v in times.items()}))
    # as the shipped kernel now compiles them: the backward's three at once, and all four when
    # a training forward sets its backward compiling before it runs (_autograd._backward_ahead)
    _, wall = compile_all(recs["backward"], threads=3)
    rows.append(dict(part="backward", kernels="same, concurrently", threads=3, wall_s=round(wall, 2)))
    _, wall = compile_all(recs["forward"] + recs["backward"], threads=args.threads)
    rows.append(dict(part="forward + backward", kernels="all four, concurrently", threads=args.threads,
                     wall_s=round(wall, 2)))
    # a prepared cache (what `kernel-loader warmup` leaves): the same four read back in a fresh process
    prepared = tempfile.mkdtemp(prefix="compile_offline_prepared_")
    compile_all(recs["forward"] + recs["backward"], cache_dir=prepared)
    hit = subprocess.run([sys.executable, __file__, "--hits", prepared], capture_output=True, text=True, check=True)
    rows.append(dict(part="forward + backward", kernels="all four, from a prepared cache (a fresh process)",
                     threads=1, wall_s=round(json.loads(hit.stdout.strip().splitlines()[-1])["wall_s"], 2)))
    columns = dict(part="part", kernels="kernels", threads="threads", wall_s="wall s")
    columns.update({k: f"{k} s" for r in rows for k in r if k not in columns})
    path = harness.write_results("compile_offline", rows, title="First call's compile for sm90 on this CPU (d=128, 16 heads, 4k, causal, bf16)",
                                 columns=columns, out_dir=args.out, commit=args.commit,
                                 notes=["Compiled with triton.compile for GPUTarget('cuda', 90, 64) without a GPU, each "
                                        "row into an empty Triton cache folder; stages summed over the kernels (the "
                                        "rest of the wall time is Triton's cache key and bookkeeping).",
                                        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start "
                                        "(other work on the machine slows the concurrent rows first)."])
    print(path.read_text())


if __name__ == "__main__":
    sys.exit(main())
