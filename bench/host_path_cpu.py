"""The sm90 host path's Python cost on the CPU, this package beside another copy of it (no GPU).

The forward and backward host code of a Gluon call (d=128, causal, ``[1, 64, 2, 128]`` bf16) run
on CPU tensors as an sm90 GPU with Triton 3.6 would run them, every kernel launch replaced by a
no-op: what is timed is the package's own Python, its allocations and argument building, not
Triton's launcher or the GPU. The two copies are timed in interleaved rounds (harness.paired);
the ratio is per round. The CPU is not the GPU host's: compare ratios, not microseconds.

    python bench/host_path_cpu.py OLD_PACKAGE_DIR [--out DIR] [--commit SHA]

A package dir is the folder holding ``__init__.py`` (``.../build/torch-universal/flash_attn2``),
e.g. one extracted with ``git archive <rev> kernel_repos/... | tar -x -C /tmp/old``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import harness

NEW_PACKAGE = harness.REPO_ROOT / "kernel_repos/kernels-community/flash-attn2/build/torch-universal/flash_attn2"


def _load(pkg_dir: Path, name: str) -> dict:
    """The package at ``pkg_dir`` imported as ``name``, set up as an sm90 GPU with Gluon would see
    it, launches doing nothing: its modules by name."""
    spec = importlib.util.spec_from_file_location(name, pkg_dir / "__init__.py",
                                                  submodule_search_locations=[str(pkg_dir)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    mods = {m: importlib.import_module(f"{name}.{m}")
            for m in ("_launch", "_triton_fwd", "_triton_bwd", "_gluon_fwd", "_gluon_dispatch", "_autograd")}
    mods["_launch"].Launcher.__call__ = lambda self, grid, args, constexprs, num_warps, num_stages: None
    mods["_launch"].compile_all = lambda jobs, device=None: []
    for m in ("_triton_fwd", "_triton_bwd"):
        mods[m].device_capability = lambda t: (9, 0)
    mods["_triton_fwd"].capability_of = lambda device: (9, 0)
    mods["_gluon_fwd"]._sm_count = lambda device: 132
    # the descriptors Triton 3.6 takes (built without the dataclass's checks), whatever Triton this is
    mods["_gluon_fwd"]._UNCHECKED_DESCRIPTORS = True
    mods["_gluon_dispatch"]._GLUON_AVAILABLE = True
    mods["_triton_bwd"].GLUON_BWD = None
    return mods


def _calls(mods: dict) -> dict:
    import torch

    torch.manual_seed(0)
    q, k, v, do, out = (torch.randn(1, 64, 2, 128, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(1, 2, 64)
    opts = dict(max_seqlen_q=None, max_seqlen_k=None, softmax_scale=0.1, causal=True, window_size=(-1, -1),
                softcap=0.0, dropout_p=0.0, seed=0)
    gf, tb, ag = mods["_gluon_fwd"], mods["_triton_bwd"], mods["_autograd"]
    return {
        "forward dispatch (_autograd._gluon_wanted)": lambda: ag._gluon_wanted(q, k, v, None, None, None, opts),
        "Gluon forward (gluon_attention_forward)": lambda: gf.gluon_attention_forward(q, k, v, softmax_scale=0.1,
                                                                                      causal=True),
        "backward (attention_backward, Gluon path)": lambda: tb.attention_backward(do, q, k, v, out, lse, causal=True,
                                                                                   softmax_scale=0.1),
    }


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("old", type=Path, help="the other copy's package dir (the one holding __init__.py)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=2000, help="calls per sample")
    args = parser.parse_args()
    new, old = _calls(_load(NEW_PACKAGE, "_fa2_new")), _calls(_load(args.old, "_fa2_old"))
    rows, samples = [], {}
    for part in new:
        timed = harness.paired({"this package": new[part], "other copy": old[part]}, rounds=args.rounds,
                               calls=args.calls, device="cpu")
        samples[part] = timed
        ratio = harness.ratio(timed["this package"], timed["other copy"])
        rows.append(dict(part=part, new_us=min(timed["this package"]), old_us=min(timed["other copy"]),
                         ratio=str(ratio)))
    path = harness.write_results(
        "host_path_cpu", rows, title="The sm90 host path's own Python on the CPU: this package beside another copy",
        columns={"part": "part of a d128 causal training call", "new_us": "this package, µs (fastest round)",
                 "old_us": "other copy, µs (fastest round)", "ratio": "this ÷ other, per round: median [95 %]"},
        out_dir=args.out, commit=args.commit,
        notes=[f"Launches replaced by no-ops (no GPU, no Triton launcher); {args.rounds} interleaved rounds of "
               f"{args.calls} calls; other copy: `{args.old}`. This CPU is not the GPU host's: compare the ratios, "
               "not the microseconds."],
        extra={"samples_us": samples})
    print(path.read_text())


if __name__ == "__main__":
    main()
