"""Shared helpers for the flash-attn2 kernel tests: load the package by path, an fp64 reference,
and NaN-poisoned allocations so every output element must be written by the kernels.

The reference is written independently of the package's own PyTorch path (per-head loops and
explicit index masks) so the two cannot share a mistake.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional, Tuple

import torch

PACKAGE_DIR = (
    Path(__file__).resolve().parents[2]
    / "kernel_repos" / "kernels-community" / "flash-attn2" / "build" / "torch-universal" / "flash_attn2"
)
_counter = itertools.count()


def load_flash_attn2():
    """Import the shipped package from its folder under a unique module name (as the loader does)."""
    name = f"_flash_attn2_under_test_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(
        name, PACKAGE_DIR / "__init__.py", submodule_search_locations=[str(PACKAGE_DIR)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# What a child process runs first: the shipped package importable as ``_fa2_sm90`` (argv[1])
_SM90_CHILD_PREAMBLE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_fa2_sm90", sys.argv[1] + "/__init__.py",
                                              submodule_search_locations=[sys.argv[1]])
pkg = importlib.util.module_from_spec(spec)
sys.modules["_fa2_sm90"] = pkg
spec.loader.exec_module(pkg)
"""


def run_compiling_child(script: str, args, cache_dir) -> subprocess.CompletedProcess:
    """Run ``script`` in a child Python where Triton compiles for real into ``cache_dir`` (the
    tests run under TRITON_INTERPRET=1, where jit functions are interpreted and cannot be
    compiled for a GPU), with the package importable as ``_fa2_sm90`` and ``sys.argv[2:]`` =
    ``args``. Returns the finished process (its stdout, stderr and return code)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-c", _SM90_CHILD_PREAMBLE + script, str(PACKAGE_DIR), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Make torch.empty / torch.empty_like return NaN-filled floating tensors for the duration."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    def empty(*args, **kwargs):
        return fill(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return fill(real_empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = empty, empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    keep_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention on ``[B, S, H, D]`` computed in ``dtype`` (fp64 unless asked otherwise); returns
    (out ``[B, Sq, Hq, D]``, lse ``[B, Hq, Sq]``).

    Differentiable w.r.t. q/k/v. ``keep_mask`` ``[B, Hq, >=Sq, >=Sk]`` replays a dropout mask.
    Rows that see no key: out 0, lse +inf (flash-attn 2's convention). A low-precision ``dtype``
    gives the baseline error that flash-attention's tests scale their tolerances by.
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    batch, sq, hq, dim = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dim)
    left, right = window_size
    if causal:
        right = 0
    dev = q.device
    pos = torch.arange(sq, device=dev).view(-1, 1) + (sk - sq)  # each query's aligned key position
    key = torch.arange(sk, device=dev).view(1, -1)
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=dev)
    if right >= 0:
        allowed &= key <= pos + right
    if left >= 0:
        allowed &= key >= pos - left
    outs, lses = [], []
    for b in range(batch):
        out_h, lse_h = [], []
        for h in range(hq):
            kh = h // (hq // hk)
            s = (q[b, :, h] @ k[b, :, kh].T) * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            if alibi_slopes is not None:
                slope = alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h]
                s = s - float(slope) * (pos - key).abs().to(dtype)
            s = s.masked_fill(~allowed, float("-inf"))
            lse = torch.logsumexp(s, dim=-1)
            has_key = allowed.any(dim=-1)
            lse_safe = torch.where(has_key, lse, torch.zeros_like(lse))
            p = torch.where(allowed, torch.exp(s - lse_safe[:, None]), torch.zeros_like(s))
            if keep_mask is not None:
                p = p * keep_mask[b, h, :sq, :sk].to(dtype) / (1.0 - dropout_p)
            out_h.append(p @ v[b, :, kh])
            lse_h.append(torch.where(has_key, lse, torch.full_like(lse, float("inf"))))
        outs.append(torch.stack(out_h, dim=1))
        lses.append(torch.stack(lse_h, dim=0))
    return torch.stack(outs), torch.stack(lses).detach()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in fp64; NaN anywhere in ``got`` gives inf."""
    got = got.detach().double()
    want = want.detach().double()
    if torch.isnan(got).any():
        return float("inf")
    denom = want.norm().item()
    return (got - want).norm().item() / (denom if denom > 0 else 1.0)


def assert_out_and_grads_close(
    out: torch.Tensor,
    ref_out: torch.Tensor,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ref_qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    tol: float,
) -> None:
    """``out`` and the gradients of q, k, v each within ``tol`` (:func:`rel_err`) of the reference;
    the failure names every error."""
    errors = {"out": rel_err(out, ref_out)}
    for name, got, want in zip(("dq", "dk", "dv"), qkv, ref_qkv):
        errors[name] = rel_err(got.grad, want.grad)
    assert all(e < tol for e in errors.values()), errors


def lse_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |Δlse| over finite rows; inf if the +inf rows differ or anything is NaN."""
    got = got.detach().double()
    want = want.detach().double()
    if torch.isnan(got).any() or not torch.equal(torch.isinf(got), torch.isinf(want)):
        return float("inf")
    fin = torch.isfinite(want)
    return (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0


def sass_loops(sass: str) -> list:
    """The loops of a ``cuobjdump -sass`` listing, each its instruction texts from a branch back's
    target to the branch (nested loops each appear whole): ``bench/harness.py``'s reading."""
    return _bench_harness().sass_loops(sass)


def _bench_harness():
    """bench/harness.py, imported from its file (bench/ is not a package, and putting it on the
    path would let its scripts' names shadow other modules)."""
    name = "_bench_harness_for_tests"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "bench" / "harness.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# A child script for run_compiling_child: the Gluon forward compiled for sm90 with the installed
# Triton. argv[2:]: head_dim, causal, varlen, consumers (0/1 flags), then the per-head-dim choices
# thread_arrive, pin_wait, tree_max ("1", "0" or "shipped"), "sass" for the machine code instead
# of the PTX, lazy_rescale, exp2_poly (a count or "shipped"), unroll2, deferred_store, pack_p, and
# the walk: "persistent" (packed: the tile list) or "scheduled" (dense: the host's table).
GLUON_FWD_SM90_CHILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
import _fa2_sm90._gluon_fwd as gf

head_dim, causal, varlen, consumers = int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1", int(sys.argv[5])
together = head_dim in gf.KV_TOGETHER  # the shipped choices, unless the case asks for thread arrivals
pingpong = head_dim in gf.PINGPONG and consumers == 2


def choice(i, shipped):  # argument i: "1", "0" or "shipped" (also when absent)
    arg = sys.argv[i] if len(sys.argv) > i else "shipped"
    return head_dim in shipped if arg == "shipped" else arg == "1"


thread_arrive, pin_wait, tree_max = choice(6, gf.THREAD_ARRIVE), choice(7, gf.PIN_WAIT), choice(8, gf.TREE_MAX)
want_sass = len(sys.argv) > 9 and sys.argv[9] == "sass"  # the machine code instead of the PTX
lazy_rescale = choice(10, gf.LAZY_RESCALE)
exp2_poly = (gf.EXP2_POLY.get(head_dim, 0) if len(sys.argv) <= 11 or sys.argv[11] == "shipped"
             else int(sys.argv[11]))  # of every 8 exponentials, how many on the FMA units
unroll2 = choice(12, gf.UNROLL2)
deferred_store = choice(13, gf.DEFERRED_STORE)
pack_p = choice(14, gf.PACK_P)
walk = sys.argv[15] if len(sys.argv) > 15 else ""
persistent = not varlen or walk == "persistent"  # packed: the tile-list walk
listed = (varlen and persistent) or (not varlen and walk == "scheduled")  # dense: the host's table (_schedule)

block_n, stages = gf.TILES[head_dim]
regs = gf.REGS if consumers == 2 else gf.REGS_3


def desc(rows):
    block = [1, rows, 1, head_dim]
    return f"tensordesc<bf16{block},{gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)!r}>"


fn = gf._gluon_attn_fwd
names = list(fn.arg_names)
types = dict(q_desc=desc(gf.ROWS), k_desc=desc(block_n), v_desc=desc(block_n), o_desc=desc(gf.ROWS),
             o_ptr="*bf16", lse_ptr="*fp32", qk_scale="fp32", cu_seqlens_q="*i32", cu_seqlens_k="*i32", tiles="*i32")
constants = dict(CAUSAL=causal, STORE_LSE=True, STAGES=stages, QBUF=gf.q_buffers(head_dim, block_n, stages, consumers),
                 CONSUMER_REGS=regs[0], PRODUCER_REGS=regs[1], VARLEN=varlen, PERSISTENT=persistent,
                 CONSUMERS=consumers, KV_TOGETHER=together, PINGPONG=pingpong, THREAD_ARRIVE=thread_arrive,
                 PIN_WAIT=pin_wait, TREE_MAX=tree_max, LAZY_RESCALE=lazy_rescale,
                 EXP2_POLY=exp2_poly, UNROLL2=unroll2, DEFERRED_STORE=deferred_store, PACK_P=pack_p)
if not varlen:  # what only packed calls use is compile-time None in a dense call
    constants.update(cu_seqlens_q=None, cu_seqlens_k=None, o_ptr=None, stride_on=None, stride_oh=None)
if not listed and "tiles" in names:  # the tile list: persistent packed calls and scheduled dense ones
    constants.update(tiles=None)
signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
source = GluonASTSource(fn, signature, {(names.index(n),): v for n, v in constants.items()})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=regs[2]))
sys.stderr.write("shared %d " % compiled.metadata.shared)
if want_sass:
    import os, subprocess, tempfile
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sys.stdout.write(subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout)
else:
    sys.stdout.write(compiled.asm["ptx"])
"""
