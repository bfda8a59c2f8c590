"""Offline check of ``_launch.DirectLaunch`` against Triton's own launcher (no GPU needed), under
the Triton release this process has: 3.6 or 3.7, the releases DirectLaunch reproduces.

The shipped package's host code builds the launches of a training step (the Gluon forward, the
delta kernel, the Gluon dK/dV/dQ kernel and the dQ cast; dense, transformers' layout, packed,
head dims 64/128/256) on CPU tensors; each kernel is compiled for sm90, and its launch is made
twice with the C launch function and the TMA encode recorded instead of run: once through
Triton's ``CudaLauncher.__call__`` and its descriptor wrapper, once through DirectLaunch
(twice, the second time from its cached maps). Writes, per launch, whether the C function got
the same argument list (``bench/results/direct_launch_equivalence.md``/``.json`` under Triton 3.6,
``direct_launch_equivalence_triton37.md``/``.json`` under 3.7); exits 1 if any differs. Needs a
CPU build of torch::

    PYTHONPATH=. python bench/direct_launch_equivalence.py [--out DIR]
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from pathlib import Path

import pytest
import torch
import triton
from triton.backends.nvidia import driver as nvd
from triton.runtime.jit import mangle_type

ROOT = Path(__file__).resolve().parents[1]  # the repository
sys.path[:0] = [str(ROOT / "tests" / "kernel_repos"), str(ROOT / "tests")]
import harness  # noqa: E402
from flash_ref import load_flash_attn2  # noqa: E402
from launch_record import recording  # noqa: E402


class _RecordedEncode:
    """The driver's utilities, the TMA encode recorded: a map is the tuple of its inputs."""

    @staticmethod
    def fill_tma_descriptor(*inputs):  # Triton 3.6's name
        return ("CUtensorMap", inputs)

    fill_tma_descriptor_tiled = fill_tma_descriptor  # Triton 3.7's


def _tritons_launcher(src, compiled, c_launch):
    """A ``CudaLauncher`` as this Triton (3.6 or 3.7) builds it, its C launch function replaced by
    ``c_launch``; under 3.7 its argument annotations and signature handle (C objects, which the C
    function reads and DirectLaunch passes on untouched) are stand-in values."""
    runner = object.__new__(nvd.CudaLauncher)
    runner.arg_annotations, runner.kernel_signature = ("annotations",), "signature handle"
    meta = compiled.metadata
    runner.num_ctas = getattr(meta, "num_ctas", 1)
    runner.launch = nvd.wrap_handle_tensordesc(c_launch, dict(src.signature), getattr(meta, "tensordesc_meta", None))
    runner.global_scratch_size, runner.global_scratch_align = meta.global_scratch_size, meta.global_scratch_align
    runner.profile_scratch_size, runner.profile_scratch_align = meta.profile_scratch_size, meta.profile_scratch_align
    runner.launch_cooperative_grid, runner.launch_pdl = meta.launch_cooperative_grid, meta.launch_pdl
    return runner


def _training_step_launches(fa, mods, monkeypatch) -> list:
    """(case, launch) of the forward and backward host code on CPU tensors, recorded as an sm90 GPU
    with Gluon would make them (``tests/kernel_repos/launch_record.py``)."""
    monkeypatch.setattr(mods["_gluon_fwd"], "_sm_count", lambda device: 132)
    monkeypatch.setattr(mods["_gluon_dispatch"], "_GLUON_AVAILABLE", True)
    monkeypatch.setattr(mods["_triton_bwd"], "GLUON_BWD", None)
    gf, tb = mods["_gluon_fwd"], mods["_triton_bwd"]
    torch.manual_seed(0)
    cases = []
    for d, causal, layout in ((128, True, "flash"), (128, False, "transformers"), (256, True, "flash"),
                              (64, False, "flash")):
        if layout == "flash":
            q, k, v, do, out = (torch.randn(2, 300, 4, d, dtype=torch.bfloat16) for _ in range(5))
        else:
            q, k, v, do, out = (torch.randn(2, 4, 300, d, dtype=torch.bfloat16).transpose(1, 2) for _ in range(5))
        with recording(fa, monkeypatch) as recorded:
            gf.gluon_attention_forward(q, k, v, softmax_scale=0.1, causal=causal)
            if d != 256:  # the Gluon backward's head dims
                tb.attention_backward(do, q, k, v, out, torch.randn(2, 4, 300), causal=causal, softmax_scale=0.1)
        cases += [(f"d{d} causal={causal} {layout}", r) for r in recorded if r.grid is not None]
    cu = torch.tensor([0, 70, 200, 233], dtype=torch.int32)
    q, do, out = (torch.randn(233, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.randn(233, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=130)
    with recording(fa, monkeypatch) as recorded:
        gf.gluon_attention_forward(q, k, v, softmax_scale=0.1, causal=True, **packed)
        tb.attention_backward(do, q, k, v, out, torch.randn(4, 233), causal=True, softmax_scale=0.1, max_seqlen_k=130,
                              **packed)
    return cases + [("packed d128 causal", r) for r in recorded if r.grid is not None]


def main() -> int:
    parser = harness.arguments(__doc__)
    args = parser.parse_args()
    release = triton.__version__[:4]
    if release not in ("3.6.", "3.7."):
        print(f"needs Triton 3.6 or 3.7 (the releases DirectLaunch reproduces); this is {triton.__version__}")
        return 2

    def flat(call: list) -> list:  # Triton 3.7 hands the kernel's arguments over as one list, last
        return call[:-1] + list(call[-1]) if release == "3.7." else call
    triton.runtime.driver.set_active(types.SimpleNamespace(utils=_RecordedEncode()))
    fa = load_flash_attn2()
    mods = {m: importlib.import_module(f"{fa.__name__}.{m}")
            for m in ("_launch", "_triton_bwd", "_gluon_fwd", "_gluon_dispatch")}
    with pytest.MonkeyPatch.context() as monkeypatch:
        cases = _training_step_launches(fa, mods, monkeypatch)
    compiled, rows = {}, []
    for case, launch in cases:
        key = (id(launch.launcher), tuple(None if a is None else mangle_type(a) for a in launch.args), launch.constexprs)
        if key not in compiled:
            compiled[key] = harness.compile_launch(launch.launcher, launch.args, launch.constexprs, launch.num_warps)
        src, kernel = compiled[key]
        grid, call_args = launch.grid, launch.args + launch.constexprs
        got = {}
        # functools.partial: like the C function it stands for, it has no __code__
        runner = _tritons_launcher(src, kernel, functools.partial(lambda *a: got.__setitem__("triton", list(a))))
        runner(grid[0], grid[1], grid[2], 7, 11, "packed-metadata", None, None, None, *call_args)
        runner.launch = nvd.wrap_handle_tensordesc(functools.partial(lambda *a: got.__setitem__("ours", list(a))),
                                                   dict(src.signature), getattr(kernel.metadata, "tensordesc_meta", None))
        direct = mods["_launch"].DirectLaunch.of(types.SimpleNamespace(run=runner))
        row = dict(case=case, kernel=launch.name)
        if direct is None:
            rows.append(dict(row, identical="refused"))
            continue
        direct(grid, 7, 11, "packed-metadata", call_args)
        direct(grid, 7, 11, "packed-metadata", call_args)  # the second launch: cached maps
        direct.verify(call_args)
        ours, theirs = flat(got["ours"]), flat(got["triton"])
        same = len(ours) == len(theirs) and all(
            a is b or (not isinstance(a, torch.Tensor) and a == b) for a, b in zip(theirs, ours))
        rows.append(dict(row, arguments=len(ours),
                         maps=sum(1 for a in ours if isinstance(a, tuple) and a[:1] == ("CUtensorMap",)),
                         identical="yes" if same else "NO"))
    same_count = sum(r["identical"] == "yes" for r in rows)
    path = harness.write_results(
        "direct_launch_equivalence" + ("_triton37" if release == "3.7." else ""), rows,
        title=f"DirectLaunch against Triton {triton.__version__}'s own launcher: the C launch function's argument list",
        columns={"case": "call", "kernel": "kernel", "arguments": "arguments", "maps": "TMA maps",
                 "identical": "identical to Triton's"},
        out_dir=args.out, commit=args.commit,
        notes=[f"{same_count} of {len(rows)} launches of a training step identical (no GPU: the C function and "
               "the TMA encode recorded instead of run; the second of two direct launches compared, so its maps "
               "come from the cache)."])
    print(path.read_text())
    return 0 if same_count == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
