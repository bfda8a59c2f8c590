"""Prepare a Triton compile cache for a cluster (`kernel-loader warmup`).

A Triton kernel compiles on its first call in each process (seconds per kernel variant) and
stores the result in Triton's cache folder. ``warmup`` runs the FlashAttention functions of a
kernel once for every shape class a job will use, with Triton's cache pointed at a folder; nodes
of the same GPU type (same software image) that point ``TRITON_CACHE_DIR`` at that folder then
load the compiled kernels instead of compiling. Triton reads a cached kernel without writing
anything, so the folder may be shared read-only, as long as it holds every kernel the job calls
(a miss compiles, and compiling into a read-only folder fails).

What a compiled kernel is specialised on: dtype, head dim, the features (causal, window,
softcap, ALiBi, dropout), and for each integer argument (lengths, strides) whether it is 1 and
whether it is a multiple of 16. So warm with the head dims, dtypes and masks the job uses and with
lengths of the same kind (multiples of 16 cover multiples of 16). The shipped kernel's Hopper forward
also picks per shape (batch x heads x length) whether its programs read a tile table, a build of its
own; under warmup (``FLASH_ATTN2_WARMUP=1``, set here) it compiles both.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterable, Optional, Sequence

from kernel_loader.errors import KernelLoaderError

DTYPES = ("float16", "bfloat16")


class WarmupError(KernelLoaderError):
    """A warmup request that cannot run (no GPU, no Triton, an unknown dtype, a bad shape)."""


@dataclass(frozen=True)
class Shape:
    """One call to compile for: ``flash_attn_func`` on ``[batch, seqlen, heads, head_dim]``, or
    with ``decode=True`` one query token per row through ``flash_attn_with_kvcache`` over a
    ``seqlen``-key cache (``paged``: 256-key pages through a block table)."""

    head_dim: int
    dtype: str
    seqlen: int
    heads_q: int
    heads_k: int
    batch: int = 1
    causal: bool = True
    backward: bool = True
    decode: bool = False
    paged: bool = False


def plan(head_dims: Sequence[int], dtypes: Sequence[str], seqlens: Sequence[int], heads: Sequence[tuple],
         *, batch: int = 1, causal: Sequence[bool] = (True,), backward: bool = True,
         decode_contexts: Sequence[int] = (), decode_batch: int = 32) -> list[Shape]:
    """Every combination of the given settings, prefill shapes first, then decode shapes.

    Raises WarmupError for an unknown dtype, a head dim outside 1..256 or a head count that does
    not divide.
    """
    for d in dtypes:
        if d not in DTYPES:
            raise WarmupError(f"warmup: dtype {d!r} is not one the GPU kernels run; use one of {', '.join(DTYPES)}")
    for d in head_dims:
        if not 1 <= d <= 256:
            raise WarmupError(f"warmup: head dim {d} is outside 1..256")
    for hq, hk in heads:
        if hk < 1 or hq % hk:
            raise WarmupError(f"warmup: query heads {hq} must be a multiple of key/value heads {hk} (give HQ/HK)")
    shapes = [Shape(d, dt, s, hq, hk, batch, c, backward)
              for d, dt, s, (hq, hk), c in itertools.product(head_dims, dtypes, seqlens, heads, causal)]
    shapes += [Shape(d, dt, ctx, hq, hk, decode_batch, True, False, True, paged)
               for d, dt, ctx, (hq, hk), paged in itertools.product(head_dims, dtypes, decode_contexts, heads, (False, True))]
    return shapes


def run_shape(kernel: ModuleType, shape: Shape) -> float:
    """Call the kernel once for ``shape`` on the current GPU; returns the seconds it took (mostly
    compiling when the cache is cold)."""
    import torch

    dtype = getattr(torch, shape.dtype)
    start = time.perf_counter()
    if shape.decode:
        b, s, hk, d = shape.batch, shape.seqlen, shape.heads_k, shape.head_dim
        q = torch.randn(b, 1, shape.heads_q, d, device="cuda", dtype=dtype)
        lens = torch.full((b,), s - 1, dtype=torch.int32, device="cuda")
        new = torch.randn(b, 1, hk, d, device="cuda", dtype=dtype)
        if shape.paged:
            pages = -(-s // 256)
            k_cache = torch.randn(b * pages, 256, hk, d, device="cuda", dtype=dtype)
            table = torch.arange(b * pages, dtype=torch.int32, device="cuda").view(b, pages)
        else:
            k_cache, table = torch.randn(b, s, hk, d, device="cuda", dtype=dtype), None
        kernel.flash_attn_with_kvcache(q, k_cache, torch.randn_like(k_cache), new, new.clone(),
                                       cache_seqlens=lens, block_table=table, causal=True)
    else:
        mk = lambda h: torch.randn(shape.batch, shape.seqlen, h, shape.head_dim, device="cuda", dtype=dtype,  # noqa: E731
                                   requires_grad=shape.backward)
        q, k, v = mk(shape.heads_q), mk(shape.heads_k), mk(shape.heads_k)
        out = kernel.flash_attn_func(q, k, v, causal=shape.causal)
        if shape.backward:
            out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _point_triton_at(cache_dir: Path) -> None:
    # the shipped kernel then also compiles the builds a shape class may take at other batch sizes
    # (its Hopper forward with and without a tile table); set before the kernel is imported
    os.environ["FLASH_ATTN2_WARMUP"] = "1"
    try:
        from triton import knobs
    except ImportError as e:  # Triton < 3.4 has no knobs; the variable still works there
        raise WarmupError("warmup needs Triton >= 3.4 (triton.knobs); set TRITON_CACHE_DIR and call the "
                          "kernel instead") from e
    knobs.cache.dir = str(cache_dir)


def _worker(load: Callable[[], ModuleType], cache_dir: str, shapes: list, queue) -> None:
    _point_triton_at(Path(cache_dir))
    kernel = load()
    for shape in shapes:
        try:
            queue.put((asdict(shape), run_shape(kernel, shape), None))
        except Exception as e:  # reported per shape: one shape the kernel refuses must not hide the rest
            queue.put((asdict(shape), None, f"{type(e).__name__}: {e}"))


def warmup(load: Callable[[], ModuleType], cache_dir: Path, shapes: Iterable[Shape], *, workers: int = 1,
           on_shape: Optional[Callable[[dict, Optional[float], Optional[str]], None]] = None) -> list[dict]:
    """Compile the kernel that ``load()`` returns for ``shapes`` into ``cache_dir``.

    ``load`` must be picklable (a module-level function) when ``workers > 1``: each worker process
    loads the kernel itself and compiles its share of the shapes (Triton compiles one kernel at a
    time per process; the folder is shared safely, Triton writes each entry atomically).
    Returns one record per shape: the shape, seconds, and an error message or None.

    Raises WarmupError when no CUDA GPU is visible.
    """
    import torch

    if not torch.cuda.is_available():
        raise WarmupError("warmup compiles for this node's GPU, and torch sees no CUDA GPU here; run it on a "
                          "GPU node of the type the jobs use")
    cache_dir = Path(cache_dir).expanduser().resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    shapes = list(shapes)
    records: list[dict] = []

    def record(shape: dict, seconds: Optional[float], error: Optional[str]) -> None:
        records.append(dict(shape=shape, seconds=seconds, error=error))
        if on_shape is not None:
            on_shape(shape, seconds, error)

    if workers <= 1:
        _point_triton_at(cache_dir)
        kernel = load()
        for shape in shapes:
            try:
                record(asdict(shape), run_shape(kernel, shape), None)
            except Exception as e:  # as in _worker
                record(asdict(shape), None, f"{type(e).__name__}: {e}")
        return records
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(load, str(cache_dir), shapes[w::workers], queue))
             for w in range(min(workers, len(shapes)))]
    for p in procs:
        p.start()
    for _ in shapes:
        record(*queue.get())
    for p in procs:
        p.join()
    return records


def parse_heads(text: str) -> tuple:
    """``"32/8"`` -> (32, 8); ``"16"`` -> (16, 16). Raises WarmupError otherwise."""
    try:
        hq, _, hk = text.partition("/")
        return int(hq), int(hk or hq)
    except ValueError:
        raise WarmupError(f"warmup: heads {text!r} must be HQ or HQ/HK, e.g. 32/8") from None


def shipped_flash_attn2() -> ModuleType:
    """The FlashAttention kernel shipped in ``kernel_repos/`` (picklable loader for workers)."""
    from kernel_loader.loader import get_local_kernel

    return get_local_kernel(Path(__file__).resolve().parents[1] / "kernel_repos" / "kernels-community" / "flash-attn2")


@dataclass(frozen=True)
class LockedKernel:
    """A picklable loader for a kernel pinned in a lock file."""

    repo_id: str
    lockfile: str

    def __call__(self) -> ModuleType:
        from kernel_loader.loader import load_kernel

        return load_kernel(self.repo_id, lockfile=self.lockfile)


@dataclass(frozen=True)
class HubKernel:
    """A picklable loader for a kernel id (fetched or found as ``get_kernel`` does)."""

    ref: str

    def __call__(self) -> ModuleType:
        from kernel_loader.loader import get_kernel

        return get_kernel(self.ref)


# The CLI settings a project may keep in the pyproject.toml beside its lock file, under
# [tool.kernel-loader.warmup]; a flag given on the command line wins.
_PROJECT_KEYS = {"head-dims": "128", "dtypes": "bfloat16", "seqlens": "4096", "heads": "32/8", "batch": 1,
                 "causal": "yes", "decode-contexts": "", "decode-batch": 32}


def project_settings(lock_path: Path) -> dict:
    """``[tool.kernel-loader.warmup]`` of the pyproject.toml next to ``lock_path`` ({} without one).

    Values are written as on the command line (``head-dims = "64,128"``) or as TOML lists and
    numbers (``head-dims = [64, 128]``). Raises WarmupError for an unknown key.
    """
    from kernel_loader.lockfile import toml_module

    tomllib = toml_module()

    pyproject = Path(lock_path).resolve().parent / "pyproject.toml"
    if not pyproject.is_file():
        return {}
    table = tomllib.loads(pyproject.read_text()).get("tool", {}).get("kernel-loader", {}).get("warmup", {})
    unknown = sorted(set(table) - set(_PROJECT_KEYS))
    if unknown:
        raise WarmupError(f"{pyproject}: [tool.kernel-loader.warmup] has unknown keys {unknown}; known: "
                          f"{', '.join(_PROJECT_KEYS)}")
    return {k: ",".join(str(x) for x in v) if isinstance(v, list) else v for k, v in table.items()}


def _numbers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise WarmupError(f"warmup: {text!r} must be comma-separated integers, e.g. 64,128") from None


def add_cli(sub, flags) -> None:
    """Add the ``warmup`` verb to the ``kernel-loader`` parser (``sub``: its subparsers; ``flags``: the global flags)."""
    p = sub.add_parser("warmup", parents=[flags],
                       help="compile FlashAttention kernels into a folder that nodes of this GPU type read (TRITON_CACHE_DIR)")
    p.add_argument("ids", nargs="*", help="kernel ids (default: the shipped kernels-community/flash-attn2)")
    p.add_argument("--into", required=True, help="the folder to fill; jobs set TRITON_CACHE_DIR to it")
    p.add_argument("--lock", help="warm every kernel pinned in this lock file (loaded as load_kernel does); "
                   "shapes not given as flags come from [tool.kernel-loader.warmup] in the pyproject.toml beside it")
    p.add_argument("--head-dims", help="comma-separated head dims (default: 128)")
    p.add_argument("--dtypes", help="comma-separated: bfloat16, float16 (default: bfloat16)")
    p.add_argument("--seqlens", help="comma-separated prefill lengths (default: 4096)")
    p.add_argument("--heads", help="comma-separated HQ/HK head counts (default: 32/8)")
    p.add_argument("--batch", type=int, help="prefill batch (default: 1)")
    p.add_argument("--causal", choices=("yes", "no", "both"), help="masks to warm (default: yes)")
    p.add_argument("--no-backward", action="store_true", help="forward only (inference)")
    p.add_argument("--decode-contexts", help="comma-separated KV-cache lengths for decode steps")
    p.add_argument("--decode-batch", type=int, help="rows per decode step (default: 32)")
    p.add_argument("--workers", type=int, default=1, help="processes compiling in parallel (default: 1)")
    p.set_defaults(func=cmd_warmup)


def cmd_warmup(args) -> int:
    """The ``warmup`` verb: exit 0 when every shape compiled, 1 otherwise."""
    import json

    from kernel_loader import lockfile

    loaders: list = [HubKernel(ref) for ref in args.ids]
    if args.lock:
        loaders += [LockedKernel(e.repo_id, args.lock) for e in lockfile.read_lock(Path(args.lock))]
    if not loaders:
        loaders = [shipped_flash_attn2]
    settings = dict(_PROJECT_KEYS, **(project_settings(Path(args.lock)) if args.lock else {}))
    for key in _PROJECT_KEYS:
        given = getattr(args, key.replace("-", "_"))
        if given is not None:
            settings[key] = given
    if settings["causal"] not in ("yes", "no", "both"):
        raise WarmupError(f"warmup: causal must be yes, no or both; got {settings['causal']!r}")
    causal = {"yes": (True,), "no": (False,), "both": (False, True)}[settings["causal"]]
    shapes = plan(_numbers(str(settings["head-dims"])), [d.strip() for d in str(settings["dtypes"]).split(",") if d.strip()],
                  _numbers(str(settings["seqlens"])), [parse_heads(h) for h in str(settings["heads"]).split(",") if h.strip()],
                  batch=int(settings["batch"]), causal=causal, backward=not args.no_backward,
                  decode_contexts=_numbers(str(settings["decode-contexts"])), decode_batch=int(settings["decode-batch"]))
    show = None if args.json else (lambda s, sec, err: print(
        f"{'FAILED' if err else 'ok':6} d={s['head_dim']} {s['dtype']} "
        f"{'decode ctx' if s['decode'] else 'seq'}={s['seqlen']} heads={s['heads_q']}/{s['heads_k']} "
        f"{'paged ' if s['paged'] else ''}{'causal ' if s['causal'] else ''}"
        + (err if err else f"{sec:.1f} s"), flush=True))
    start = time.perf_counter()
    records = []
    for load in loaders:
        records += warmup(load, Path(args.into), shapes, workers=args.workers, on_shape=show)
    failed = [r for r in records if r["error"]]
    if args.json:
        print(json.dumps({"into": str(Path(args.into).resolve()), "seconds": time.perf_counter() - start,
                          "shapes": records, "failed": len(failed)}, indent=1))
    else:
        print(f"{len(records) - len(failed)} of {len(records)} shapes compiled into {Path(args.into).resolve()} in "
              f"{time.perf_counter() - start:.1f} s; on the nodes: export TRITON_CACHE_DIR={Path(args.into).resolve()}")
    return 1 if failed else 0


@dataclass(frozen=True)
class LocalKernel:
    """A picklable loader for a kernel folder (as ``get_local_kernel`` takes)."""

    path: str

    def __call__(self) -> ModuleType:
        from kernel_loader.loader import get_local_kernel

        return get_local_kernel(self.path)
