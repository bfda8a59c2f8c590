"""The one shared harness of every benchmark in bench/: timing, paired ratios, result files.

A benchmark script is ``bench/<bench>.py``; it imports this module (``import harness``: the
script's own folder is on ``sys.path`` when run as ``python bench/<bench>.py``) and nothing else
from bench/ or tests/. It loads the shipped kernel through the public loader
(:func:`shipped_kernel`), never by path or through private functions.

API (everything else here is private):

``arguments(doc, *, baseline=False) -> argparse.ArgumentParser``
    A parser with the flags every benchmark takes: ``--out DIR`` (default ``bench/results``)
    and ``--commit SHA`` (default: ``git rev-parse HEAD`` of this checkout, ``+dirty`` when it
    has uncommitted changes; pass it where the tree was copied without ``.git``); with
    ``baseline=True`` also ``--baseline DIR`` (see :func:`kernels`).
``time_us(fn, *, device=None, calls=None, repeat=15) -> float``
    Median microseconds per call of ``fn()``. On CUDA: ``triton.testing.do_bench`` (median). On
    the CPU: ``time.perf_counter_ns`` over ``repeat`` samples of ``calls`` calls each (``calls``
    chosen so that a sample lasts about 2 ms when not given). ``device`` defaults to ``"cuda"``
    when torch sees a GPU, else ``"cpu"``.
``paired(contenders, *, rounds=11, calls=10, device=None, before=None) -> dict[str, list[float]]``
    Microseconds per call of each ``name -> fn`` contender, timed in ``rounds`` interleaved
    rounds (each round times every contender once, in :func:`round_order`'s balanced order, so
    clock drift and heat spread over all of them; CUDA events on the GPU, ``perf_counter_ns`` on the
    CPU). Each contender is called once untimed first. ``before(name)``, when given, runs
    untimed before each of a contender's samples (switch a model's attention, synchronise).
    Returns the samples, ``rounds`` per name, round ``i`` of every name taken together.
``ratio(a, b) -> Ratio``
    ``a / b`` of two paired sample lists: the median of the per-round ratios, a 95 % bootstrap
    interval of that median (seeded, so reruns on the same samples agree; ``.interval`` writes it
    as ``[low, high]``) and the min/max.
``bandwidth_vs(samples, name, nbytes, base="cudnn") -> dict``
    A contender's row fields from :func:`paired` samples: ``tbps``, ``vs_<base>`` (the time ratio,
    so the bandwidth ratio), its ``interval`` and the rounds in µs; ``BANDWIDTH_COLUMNS`` names
    their table columns (base cuDNN).
``attention_row(row, contenders, flop, *, rounds=ROUNDS) -> dict``
    Fills ``row`` with each ``name -> (forward, forward_and_backward)`` contender's TFLOP/s
    (``<name>_fwd`` for ``flop`` FLOPs, ``<name>_fwdbwd`` for 3.5x that; a forward of None is
    not timed), or ``<name>_error`` when it cannot run, then ``ratio_<part>`` (ours ÷ sdpa_cudnn) and ``vs_baseline_<part>``
    (ours ÷ baseline) where both sides ran, and ``rounds_us`` (each round's µs per timing);
    returns ``row``. Every timing runs in ``rounds``
    interleaved rounds (each round times each contender's forward and forward+backward once,
    in :func:`round_order`'s balanced order) and the median over rounds is kept: a GPU's clock ramp or
    heat then falls on every contender alike, not on whichever is timed first.
``interleaved_us(timings, *, rounds=ROUNDS) -> (dict, dict, dict)``
    ``key -> fn`` timings run through :func:`time_us` in ``rounds`` interleaved rounds (balanced
    order, as ``attention_row``'s); returns ``({key: median µs}, {key: "Error: message"},
    {key: [µs of each round]})``: a timing that raises is reported and not retried.
``warm_gpu(seconds=2.0)``
    Keeps the GPU busy with matrix products for ``seconds`` (no-op without one), so that the
    first timing of a run does not meet an idle GPU's low clocks.
``BASELINE_COLUMNS``
    The column headings ``attention_row`` fills for a ``baseline`` contender (add them to a
    table's ``columns`` when ``--baseline`` is given).
``environment(commit=None) -> dict``
    date (UTC), command line, git commit, device name and the versions of python, torch,
    triton, transformers, huggingface_hub and kernels (``None`` for what is not installed).
``write_results(bench, rows, *, title, columns, out_dir, commit=None, notes=(), extra=None)``
    Writes ``<out_dir>/<bench>.md`` (title, notes, the table, then date, command, versions,
    commit) and ``<out_dir>/<bench>.json`` (the same plus ``extra``), overwriting both; returns
    the Markdown path. ``columns`` maps a row key to its column heading; floats are printed with
    4 significant digits (whole numbers from 10,000), ``None`` as a dash.
``child_env(**extra) -> dict``
    The environment for a child Python: the repository root ahead of the ``PYTHONPATH`` already
    set (a Triton unpacked there stays in force), plus ``extra``.
``shipped_kernel(repo_id="kernels-community/flash-attn2")``
    The kernel shipped in ``kernel_repos/``, imported with ``kernel_loader.get_local_kernel``
    (no network, no cache).
``kernels(baseline=None) -> dict[str, ModuleType]``
    ``{"ours": shipped_kernel()}``, plus ``"baseline"``: the kernel repo folder ``baseline``
    (``--baseline``) imported with ``kernel_loader.get_local_kernel``, when given.
``sdpa(backend, q, k, v, causal) -> Callable``
    PyTorch SDPA held to ``backend`` on ``[B, H, S, D]`` tensors, the competitor beside us; GQA
    through ``enable_gqa`` where the backend takes it, else K/V expanded to the query heads
    (the callable's ``expanded_kv`` says which).
``DECODE_SHAPE``, ``DECODE_CONTEXTS``, ``decode_inputs(ctx) -> (q, k, v, lens, kp, vp, table)``
    (``scattered_pages(k, v, group=1) -> (kp, vp, table)``: the paging alone, by runs of pages)
    The decode benchmarks' step: shape (batch, query heads, KV heads, head_dim, keys a page),
    contexts, and one step's tensors (a dense cache and the same keys over pages in random order).
``settings({(owner, name): value, ...})``
    A context manager: each attribute set for the ``with`` block and put back after.
``with_setting(module, name, value, call)``
    ``call()`` with ``module.name`` set to ``value`` for its duration (a kernel module's setting
    read per call).
``StepClock(device)``
    A ``generate`` stopping criterion that never stops and notes the time of every step (after a
    sync on a GPU): ``median_step_ms()``, ``fast_step_ms()`` (the 10th percentile).
``compile_gluon_forward(gf, head_dim, causal, *, tile=None, consumers=None, **choices)``
    The dense Gluon forward of a ``_gluon_fwd`` module compiled for sm90 without a GPU (Triton's
    compiled kernel: ``.asm["ptx"]``, ``.asm["cubin"]``), with the consumers and per-head-dim
    choices a dense call of the package takes, each overridable by name. Raises ValueError for a
    choice the kernel lacks.
``compile_gluon_backward(gb, head_dim, causal)``
    The dense Gluon dK/dV/dQ kernel of a ``_gluon_bwd`` module compiled for sm90 without a GPU.
``compile_launch(launcher, args, constexprs, num_warps) -> (source, compiled)``
    The kernel of one recorded launch of a ``_launch.Launcher`` compiled for sm90 without a GPU,
    specialised as that launch would be.
``sass(cubin, *flags) -> str``, ``key_step(sass, head_dim, block_n) -> dict``
    A cubin's ``cuobjdump`` listing (``-sass``, ``-res-usage``); the Gluon forward's unmasked key
    loop read from a SASS listing, per key block: instructions, MUFU.EX2, emulated exponentials,
    register moves, PRMT, blocks a loop trip ({} when there is no such loop).
``ncu_source_page(regex, child, report) -> (duration_ms, header, rows)``
    Runs the command line ``child`` under Nsight Compute (``--clock-control none``, warp-state
    sampling) and reads the second launch of the kernel whose name matches ``regex``: its
    duration and its source page in SASS, one row per instruction (``NCU_SAMPLES`` names the
    samples column). Raises RuntimeError when ncu fails.
``ncu_stall_shares(header, rows) -> dict[str, float]``
    Each stall reason's share of a source page's warp samples.
``ncu_raw_table(raw_csv) -> (names, units, rows)``
    A raw page's text (``ncu --page raw --csv``) as metric names, units and a row per launch.
``ncu_raw(report) -> dict[str, tuple[float, str]]``
    The numeric metrics of a report's one profiled launch (its raw page), by metric name, each
    with its unit.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import importlib.metadata
import io
import json
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"
_VERSIONED = ("torch", "triton", "transformers", "huggingface_hub", "kernels")


class Ratio(NamedTuple):
    """``a / b`` of paired samples: median per-round ratio, its 95 % bootstrap interval, extremes."""

    median: float
    low: float
    high: float
    min: float
    max: float

    @property
    def interval(self) -> str:
        """The 95 % interval as ``[low, high]``, three decimals."""
        return f"[{self.low:.3f}, {self.high:.3f}]"

    def __str__(self) -> str:
        return f"{self.median:.3f} {self.interval}"


def arguments(doc: Optional[str], *, baseline: bool = False) -> argparse.ArgumentParser:
    """The argument parser every benchmark starts from (``--out``, ``--commit``; ``--baseline``)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR,
                        help="folder for <bench>.md and <bench>.json (default: bench/results)")
    parser.add_argument("--commit", default=None,
                        help="git commit to record (default: this checkout's HEAD)")
    if baseline:
        parser.add_argument("--baseline", help="another kernel repo folder (e.g. the previous commit's "
                            "flash-attn2), run beside ours as 'baseline'")
    return parser


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def time_us(fn: Callable[[], object], *, device: Optional[str] = None,
            calls: Optional[int] = None, repeat: int = 15, rep_ms: int = 100) -> float:
    """Median microseconds per call of ``fn()`` (see the module docstring; ``rep_ms``: how long
    ``do_bench`` times on a GPU)."""
    device = device or _default_device()
    if device.startswith("cuda"):
        import triton.testing

        return 1000.0 * float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms,
                                                      return_mode="median"))
    fn()  # warm-up: first-call costs (imports, memo fills) are not what is measured here
    if calls is None:
        t0 = time.perf_counter_ns()
        fn()
        once = max(time.perf_counter_ns() - t0, 1)
        calls = max(1, min(100_000, 2_000_000 // once))
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - t0) / 1000.0 / calls)
    return statistics.median(samples)


def round_order(keys: Sequence, r: int) -> list:
    """The order of round ``r`` of interleaved timings: rounds come in pairs, the second the first
    reversed, and each pair starts one place further on, so over every pair of rounds each key's
    mean position is the same. Why: these kernels run the GPU at its power limit, where its clock
    moves with the load (``bench/results/power_probe.md``: about 700 W, 1.44-1.64 GHz), and within one row of
    ``attention.json`` the same timing differed by up to 29 % between rounds (``rounds_us``:
    cuDNN's d=128 4k forward; ours up to 17 %), while a plain rotation of 7 timings over 3 rounds
    put our forward at places 0, 6, 5 and cuDNN's at 2, 1, 0."""
    keys = list(keys)
    if not keys:
        return keys
    shift = (r // 2) % len(keys)
    order = keys[shift:] + keys[:shift]
    return order[::-1] if r % 2 else order


def paired(contenders: Mapping[str, Callable[[], object]], *, rounds: int = 11, calls: int = 10,
           device: Optional[str] = None,
           before: Optional[Callable[[str], object]] = None) -> dict[str, list[float]]:
    """Interleaved per-round samples (µs per call) of each contender (see the module docstring)."""
    device = device or _default_device()
    names = list(contenders)
    samples: dict[str, list[float]] = {n: [] for n in names}
    before = before or (lambda name: None)
    for name, fn in contenders.items():
        before(name)
        fn()  # warm-up outside the timed rounds
    if device.startswith("cuda"):
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
    for r in range(rounds):
        for name in round_order(names, r):
            fn = contenders[name]
            before(name)
            if device.startswith("cuda"):
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) * 1000.0 / calls)
            else:
                t0 = time.perf_counter_ns()
                for _ in range(calls):
                    fn()
                samples[name].append((time.perf_counter_ns() - t0) / 1000.0 / calls)
    return samples


def ratio(a: Sequence[float], b: Sequence[float], *, resamples: int = 2000) -> Ratio:
    """``a / b`` of paired samples (round i of ``a`` against round i of ``b``)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples must have the same non-zero length, got {len(a)} and {len(b)}")
    per_round = [x / y for x, y in zip(a, b)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(per_round, k=len(per_round)))
                     for _ in range(resamples))
    return Ratio(statistics.median(per_round), medians[int(0.025 * resamples)],
                 medians[int(0.975 * resamples) - 1], min(per_round), max(per_round))


def bandwidth_vs(samples: Mapping[str, Sequence[float]], name: str, nbytes: float, base: str = "cudnn") -> dict:
    """One contender's row fields from :func:`paired` samples (µs a call): ``tbps`` (``nbytes`` over
    its median time, TB/s), ``vs_<base>`` and ``interval`` (``base``'s time over its, per round:
    the bandwidth ratio) and its ``rounds_us``. Raises ValueError as :func:`ratio` does."""
    t = samples[name]
    r = ratio(samples[base], t)
    return {"tbps": nbytes / statistics.median(t) / 1e6, f"vs_{base}": r.median, "interval": r.interval,
            "rounds_us": [round(x, 2) for x in t]}


# the table columns of bandwidth_vs's fields (base cuDNN), for write_results
BANDWIDTH_COLUMNS = dict(tbps="TB/s", vs_cudnn="÷ cuDNN", interval="95 % interval")

BASELINE_COLUMNS = dict(baseline_fwd="baseline fwd", baseline_fwdbwd="baseline f+b",
                        vs_baseline_fwd="ours/baseline fwd", vs_baseline_fwdbwd="ours/baseline f+b")


ROUNDS = 4  # interleaved rounds (an even count: see round_order) of attention_row's and interleaved_us's timings


def interleaved_us(timings: Mapping[Any, Callable[[], object]], *, rounds: int = ROUNDS) -> tuple[dict, dict, dict]:
    """Median µs per call of each ``key -> fn`` over interleaved rounds (see the module docstring)."""
    keys = list(timings)
    samples: dict = {key: [] for key in keys}
    errors: dict = {}
    for r in range(rounds):
        for key in round_order(keys, r):
            if key in errors:
                continue
            try:
                samples[key].append(time_us(timings[key], rep_ms=max(20, 100 // rounds)))
            except Exception as e:  # a competitor that cannot run this shape: reported, not retried
                errors[key] = f"{type(e).__name__}: {str(e)[:200]}"
    medians = {key: statistics.median(t) for key, t in samples.items() if t and key not in errors}
    return medians, errors, samples


def attention_row(row: dict, contenders: Mapping[str, tuple], flop: float, *, rounds: int = ROUNDS) -> dict:
    """TFLOP/s of each contender's forward and forward+backward into ``row``, and the ratios."""
    timings = {(name, part): fn for name, (fwd, both) in contenders.items()
               for part, fn in (("fwd", fwd), ("fwdbwd", both)) if fn is not None}
    medians, errors, samples = interleaved_us(timings, rounds=rounds)
    # each round's µs beside the medians (the JSON keeps them; the table shows the medians)
    row["rounds_us"] = {f"{name}_{part}": [round(x, 2) for x in t] for (name, part), t in
                        samples.items() if t}
    for (name, part), message in errors.items():
        row[f"{name}_error"] = message  # a dash in the table
    for (name, part), us in medians.items():
        if (name, "fwd") not in errors:  # a forward that fails takes its forward+backward with it
            row[f"{name}_{part}"] = (1.0 if part == "fwd" else 3.5) * flop / us / 1e6
    for part in ("fwd", "fwdbwd"):
        for key, other in (("ratio", "sdpa_cudnn"), ("vs_baseline", "baseline")):
            if row.get(f"ours_{part}") and row.get(f"{other}_{part}"):
                row[f"{key}_{part}"] = row[f"ours_{part}"] / row[f"{other}_{part}"]
    return row


def warm_gpu(seconds: float = 2.0) -> None:
    """Matrix products on the GPU for ``seconds`` (see the module docstring); no-op without one."""
    import torch

    if not torch.cuda.is_available():
        return
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def child_env(**extra: str) -> dict:
    """This process's environment for a child Python that imports the repository: the repository
    root put on ``PYTHONPATH`` ahead of what is there (a Triton unpacked on ``PYTHONPATH``, as
    ``gpu_kernel.sh``'s ``TRITON_OVERLAY`` puts it, stays in force), plus ``extra``."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


def _git_commit() -> Optional[str]:
    try:
        sha = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], check=True,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain",
                                "--untracked-files=no"], check=True, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None  # a copied tree without .git: pass --commit
    return sha + ("+dirty" if dirty else "")


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    return f"CPU ({platform.processor() or platform.machine()})"


def _command() -> str:
    """This process's command line as typed: ``python -m pkg ...`` for a package run with -m
    (whose argv[0] is its ``__main__.py``), after the kernel's own switches that are set
    (``FLASH_ATTN2_*`` variables change what the kernel runs, so a figure is reproduced with them)."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name == "__main__.py":
        argv[0:1] = ["-m", Path(argv[0]).parent.name]
    switches = [f"{name}={shlex.quote(value)}" for name, value in sorted(os.environ.items())
                if name.startswith("FLASH_ATTN2_")]
    return " ".join(switches + [shlex.join([Path(sys.executable).name] + argv)])


def environment(commit: Optional[str] = None) -> dict[str, Any]:
    """Date, command, commit, device and versions of the run (see the module docstring)."""
    env = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": _command(),
        "commit": commit or _git_commit(),
        "device": _device_name(),
        "python": platform.python_version(),
    }
    for dist in _VERSIONED:
        env[dist] = _version(dist)
    return env


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return str(value).replace("|", "\\|")


def table(rows: Iterable[Mapping[str, Any]], columns: Mapping[str, str]) -> str:
    """A Markdown table of ``rows`` with one column per ``columns`` key (heading = value)."""
    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(key)) for key in columns) + " |")
    return "\n".join(lines)


def write_results(bench: str, rows: Sequence[Mapping[str, Any]], *, title: str,
                  columns: Mapping[str, str], out_dir: Path, commit: Optional[str] = None,
                  notes: Sequence[str] = (), extra: Optional[Mapping[str, Any]] = None) -> Path:
    """Write (overwrite) ``<out_dir>/<bench>.md`` and ``.json``; return the Markdown path."""
    env = environment(commit)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    versions = ", ".join(f"{k} {env[k]}" for k in ("python",) + _VERSIONED if env.get(k))
    md = [f"# {title}", ""]
    md += [*notes, ""] if notes else []
    md += [table(rows, columns), "",
           f"Measured {env['date']} on {env['device']}.  ",
           f"Command: `{env['command']}`  ",
           f"Commit: `{env['commit'] or 'unknown'}`; {versions}.", ""]
    path = out_dir / f"{bench}.md"
    path.write_text("\n".join(md))
    data = {"bench": bench, "title": title, "environment": env, "notes": list(notes),
            "columns": dict(columns), "rows": list(rows), **(extra or {})}
    (out_dir / f"{bench}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def shipped_kernel(repo_id: str = "kernels-community/flash-attn2") -> ModuleType:
    """The copy of ``repo_id`` shipped in ``kernel_repos/``, through the public loader."""
    import kernel_loader

    return kernel_loader.get_local_kernel(REPO_ROOT / "kernel_repos" / repo_id)


def kernels(baseline: Optional[str] = None) -> dict[str, ModuleType]:
    """``{"ours": the shipped kernel}``, plus ``"baseline"`` (the kernel repo folder ``baseline``)."""
    import kernel_loader

    loaded = {"ours": shipped_kernel()}
    if baseline:
        loaded["baseline"] = kernel_loader.get_local_kernel(baseline)
    return loaded


# ------------------------------------------------------------------------------------------
# shared workloads and the competitor
# ------------------------------------------------------------------------------------------


def sdpa(backend, q, k, v, causal: bool):
    """SDPA forced onto ``backend``; GQA through ``enable_gqa`` where the backend takes it, else
    through K/V expanded to the query heads (what transformers' sdpa path does)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    gqa = q.shape[1] != k.shape[1]

    def run(k=k, v=v, gqa=gqa):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    try:
        run()
        run.expanded_kv = False
        return run
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        expanded = lambda: run(ke, ve, False)  # noqa: E731
        expanded.expanded_kv = True
        return expanded


# the packed-sequence benchmarks' workload (bench/varlen.py times it, bench/varlen_schedule.py models it)
PACKED_TOKENS = 16384


def packed_lengths(tokens: int = PACKED_TOKENS, low: int = 128, high: int = 4096, seed: int = 0) -> list[int]:
    """Sequence lengths drawn uniformly from [low, high], the last one cut so they sum to ``tokens``."""
    rng = random.Random(seed)
    out: list[int] = []
    while sum(out) < tokens:
        out.append(rng.randint(low, high))
    out[-1] -= sum(out) - tokens
    return out


# the decode benchmarks' step: batch, query heads, KV heads, head_dim, keys a page
DECODE_SHAPE = (32, 32, 8, 128, 256)
DECODE_CONTEXTS = (4096, 32768)


def decode_inputs(ctx: int) -> tuple:
    """One decode step's tensors at ``ctx`` keys: q, the dense k / v cache, the lengths, and the
    same keys scattered over pages in random order with their block table (kp, vp, table)."""
    import torch

    batch, hq, hk, d, page = DECODE_SHAPE

    q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, ctx, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return (q, k, v, lens, *scattered_pages(k, v))


def scattered_pages(k, v, group: int = 1) -> tuple:
    """The dense cache ``k``/``v`` ``[B, S, HK, D]`` copied into ``DECODE_SHAPE``'s pages in random
    order, by runs of ``group`` consecutive pages: ``(kp, vp, table)``."""
    import torch

    page = DECODE_SHAPE[4]
    batch, ctx, hk, d = k.shape
    pages = batch * ctx // page
    runs = torch.randperm(pages // group, device=k.device)
    perm = (runs[:, None] * group + torch.arange(group, device=k.device)).flatten()
    kp = torch.empty(pages, page, hk, d, device=k.device, dtype=k.dtype)
    vp = torch.empty_like(kp)
    kp[perm] = k.reshape(pages, page, hk, d)
    vp[perm] = v.reshape(pages, page, hk, d)
    return kp, vp, perm.view(batch, -1).to(torch.int32)


@contextlib.contextmanager
def settings(changes: Mapping[tuple, Any]) -> Iterator[None]:
    """For the ``with`` block, each ``(owner, name)`` of ``changes`` set to its value (a kernel
    module's setting read per call); every one put back after, whatever happens."""
    saved = {}
    try:
        for (owner, name), value in changes.items():
            saved[owner, name] = getattr(owner, name)
            setattr(owner, name, value)
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def with_setting(decode, name, value, call):
    """``call()`` with the decode kernel module ``decode``'s global ``name`` set to ``value``
    (``PAGE_BLOCKS``, ``PRELOAD_MAX``: read per call)."""
    with settings({(decode, name): value}):
        return call()


class PartClock:
    """A callable standing in for ``fn``: host seconds spent inside it and the calls, summed into
    ``total`` (a clock shared by several stand-ins; default: this one); with ``when``, only the
    calls whose arguments it accepts are counted."""

    def __init__(self, fn: Callable[..., Any], total: Optional["PartClock"] = None,
                 when: Optional[Callable[..., bool]] = None) -> None:
        self.fn, self.seconds, self.calls, self.when = fn, 0.0, 0, when
        self.total = total if total is not None else self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            if self.when is None or self.when(*args, **kwargs):
                self.total.seconds += time.perf_counter() - t0
                self.total.calls += 1


class LaunchClock(PartClock):
    """A :class:`PartClock` standing in for a kernel's ``Launcher``: its calls and its kept
    launches (``launch_kept``) timed on one clock, ``keep`` passed through."""

    def __init__(self, launcher: Any) -> None:
        super().__init__(launcher)
        self.launch_kept = PartClock(getattr(launcher, "launch_kept", None), total=self)

    def keep(self, *args: Any) -> Any:
        return self.fn.keep(*args)


# The parts of a sliced decode call :func:`decode_parts` times, outermost first
DECODE_PARTS = ("decode_attention", "_alloc", "_SPLIT", "C launch")


@contextlib.contextmanager
def decode_parts(decode: ModuleType) -> Iterator[dict]:
    """For the ``with`` block, clocks (:class:`PartClock`) on the parts of the decode module
    ``decode``'s calls, by :data:`DECODE_PARTS` name: ``decode_attention`` (the whole call after
    the package's entry checks), ``_alloc`` (its output and buffer allocations), ``_SPLIT`` (the
    launcher: key, cache lookup and launch, or a kept launch, :class:`LaunchClock`) and ``C
    launch`` (Triton's C launch function, found in the launcher's cache: launches compiled before
    the block). Each clock adds ~0.1-0.2 us to what it wraps. Everything is put back after (the
    decode keeps its launches again for the launcher put back on its next call)."""
    clocks = {name: PartClock(getattr(decode, name)) for name in DECODE_PARTS[:2]}
    clocks["_SPLIT"] = LaunchClock(decode._SPLIT)
    launches = [entry[4] for entry in decode._SPLIT._cache.values() if entry[4] is not None]
    shared = PartClock(None)  # one clock over every cached launch function
    saved = [(d, d._launch) for d in launches]
    try:
        for d, fn in saved:
            d._launch = PartClock(fn, total=shared)
        with settings({(decode, name): clock for name, clock in clocks.items()}):
            yield {**clocks, "C launch": shared}
    finally:
        for d, fn in saved:
            d._launch = fn


def parts_us(clocks: Mapping[str, PartClock], calls: int) -> dict:
    """Host µs per call of ``calls`` decode calls in each part of :func:`decode_parts`."""
    return {name: clocks[name].seconds / max(calls, 1) * 1e6 for name in DECODE_PARTS}


def compile_gluon_forward(gf: ModuleType, head_dim: int, causal: bool, *, tile: Optional[tuple] = None,
                          consumers: Optional[int] = None, **choices: Any) -> Any:
    """The dense persistent Gluon forward of the kernel module ``gf`` (``_gluon_fwd``) compiled for
    sm90 with this process's Triton, no GPU needed: Triton's compiled kernel (``.asm["ptx"]``,
    ``["cubin"]``). ``tile`` (BLOCK_N, STAGES) defaults to the shipped one; ``consumers`` and the
    per-head-dim choices (``PIN_WAIT=True``, ``EXP2_POLY=1``, ...) default to what the package's
    dense call takes (its ``NON_CAUSAL`` choices included) and may be set by name; a choice an
    older package's kernel lacks is left out, so two versions compile alike.
    Raises what Triton raises."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    fn = gf._gluon_attn_fwd
    preset = gf.call_choices(head_dim, causal, False) if hasattr(gf, "call_choices") else {}
    consumers = consumers or preset.get("consumers") or getattr(gf, "CONSUMERS", {}).get(head_dim, 2)
    for name in ("pin_wait", "pack_p"):
        if name in preset:
            choices.setdefault(name.upper(), preset[name])
    block_n, stages = tile or gf.TILES[head_dim]
    regs = gf.REGS if consumers == 2 else gf.REGS_3
    t = torch.empty(2, 256, 4, head_dim, dtype=torch.bfloat16)  # descriptors read only its shape and strides
    values = dict(q_desc=gf._descriptor(t, gf.ROWS, head_dim), k_desc=gf._descriptor(t, block_n, head_dim),
                  v_desc=gf._descriptor(t, block_n, head_dim), o_desc=gf._descriptor(t, gf.ROWS, head_dim),
                  lse_ptr=torch.empty(4, dtype=torch.float32), qk_scale=0.1)
    consts = dict(CAUSAL=causal, STORE_LSE=True, STAGES=stages, CONSUMER_REGS=regs[0], PRODUCER_REGS=regs[1],
                  VARLEN=False, cu_seqlens_q=None, cu_seqlens_k=None, o_ptr=None, stride_on=None, stride_oh=None)
    if "tiles" in fn.arg_names:  # packages whose packed calls may walk a tile list
        consts.update(tiles=None)
    if "PERSISTENT" in fn.arg_names:  # packages whose dense forward walks its tiles persistently
        consts.update(QBUF=gf.q_buffers(head_dim, block_n, stages, *([consumers] if consumers != 2 else [])),
                      PERSISTENT=True)
    if "CONSUMERS" in fn.arg_names:  # packages whose forward takes 2 or 3 consumer warpgroups
        consts.update(CONSUMERS=consumers)
    # the kernel's per-head-dim choices (a set of head dims each; EXP2_POLY maps a head dim to a
    # count), as the package sets them unless given; packages older than a choice lack it
    for name in ("KV_TOGETHER", "PINGPONG", "THREAD_ARRIVE", "PIN_WAIT", "TREE_MAX", "LAZY_RESCALE", "EXP2_POLY",
                 "UNROLL2", "DEFERRED_STORE", "PACK_P"):
        if name in fn.arg_names:
            chosen = getattr(gf, name)
            consts[name] = choices.get(name, chosen.get(head_dim, 0) if isinstance(chosen, dict) else head_dim in chosen)
    unknown = set(choices) - set(consts)
    if unknown:
        raise ValueError(f"{sorted(unknown)}: not choices of this package's Gluon forward")
    sig, cx = {}, {}
    for n in fn.arg_names:
        if n in consts:
            sig[n], cx[n] = "constexpr", consts[n]
        else:
            sig[n] = mangle_type(values[n]) if n in values else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    return triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=regs[2]))


def compile_gluon_backward(gb: ModuleType, head_dim: int, causal: bool) -> Any:
    """The dense Gluon dK/dV/dQ kernel of the kernel module ``gb`` (``_gluon_bwd``) compiled for
    sm90 with this process's Triton, no GPU needed, with the arguments the package's own launch
    code builds (``_launch_args``). Raises what Triton raises."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    q = torch.empty(2, 256, 4, head_dim, dtype=torch.bfloat16)  # descriptors read only its shape and strides
    lse = torch.empty(2, 4, 256, dtype=torch.float32)
    acc = torch.empty(256 * 4 * 2, head_dim, dtype=torch.float32)
    _, args, kwargs = gb._launch_args(q, q, q, q, lse, lse, acc, q, q, 0.1, causal)
    fn = gb._gluon_attn_bwd
    names = list(fn.arg_names)
    constants = {n: kwargs[n] for n in names if n in kwargs}
    values = dict(zip([n for n in names if n not in constants], args))
    constants.update({n: None for n, a in values.items() if a is None})  # the packed-only arguments
    signature = {n: "constexpr" if n in constants else mangle_type(values[n]) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    return triton.compile(GluonASTSource(fn, signature, {(names.index(n),): v for n, v in constants.items()}, attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=gb.REGS[2]))


def compile_launch(launcher: Any, args: tuple, constexprs: tuple, num_warps: int) -> tuple:
    """The kernel of one launch of a ``_launch.Launcher`` (its runtime arguments and constexpr
    values, as the package's host code builds them, on CPU tensors) compiled for sm90 with this
    process's Triton, specialised as that launch would be (pointers 16-byte aligned, a None
    pointer a constant): ``(source, compiled kernel)``. Raises what Triton raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    fn = launcher._fn
    names = list(fn.arg_names)
    constants = dict(zip(launcher._constexpr_names, constexprs))
    values = dict(zip([n for n in names if n not in constants], args))
    constants.update({n: None for n, a in values.items() if a is None})
    signature = {n: "constexpr" if n in constants else mangle_type(values[n]) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    source_type = GluonASTSource if type(fn).__name__ == "GluonJITFunction" else ASTSource
    src = source_type(fn, signature, {(names.index(n),): v for n, v in constants.items()}, attrs)
    return src, triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=num_warps, **launcher._options))


def sass(cubin: bytes, *flags: str) -> str:
    """``cuobjdump`` (the one Triton ships) run on ``cubin`` with ``flags`` (``-sass``,
    ``-res-usage``); its output. Raises CalledProcessError when it fails."""
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True, check=True).stdout


# argument names of the Triton kernels, by type, for compile_triton_sm90's signatures
_FLOAT_SCALARS = {"qk_scale", "softcap_scale", "softcap", "sm_scale", "dropout_p", "scale_log2"}
_I32_POINTERS = {"CuQ", "CuK", "SeqUsedK", "BLOCK_TABLE", "TOTAL_LENS", "BATCH_IDX", "LEFTPAD", "COUNTERS"}
_F32_POINTERS = {"Lse", "Delta", "Alibi", "ALIBI", "LSE", "O_PART", "LSE_PART", "LSE_FINAL"}


def compile_triton_sm90(fn: Any, consts: Mapping[str, Any], none_ptrs: Any, num_warps: int, num_stages: int,
                        o_f32: bool = False) -> Any:
    """The Triton kernel ``fn`` compiled for sm90 (no GPU needed): ``consts`` its constexprs,
    ``none_ptrs`` the pointers passed as None; every other pointer bf16 unless its name says an
    int32 or float32 tensor (``_I32_POINTERS``, ``_F32_POINTERS``; ``O`` too with ``o_f32``), every
    other scalar int32 or, by name, float32 (``_FLOAT_SCALARS``). Raises what Triton raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts or name in none_ptrs:
            signature[name], constexprs[name] = "constexpr", consts.get(name)
        elif name in _FLOAT_SCALARS:
            signature[name] = "fp32"
        elif name[0].isupper():  # a pointer
            f32 = name in _F32_POINTERS or (o_f32 and name == "O")
            signature[name] = "*i32" if name in _I32_POINTERS else "*fp32" if f32 else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 64), options=dict(num_warps=num_warps, num_stages=num_stages))


def sass_loops(sass: str) -> list[list[str]]:
    """The loops of a ``cuobjdump -sass`` listing, in the order of their branches back: each the
    instruction texts from the branch's target to the branch. Raises nothing."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for at, text in ins:
        m = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < at:
            loops.append([t.strip() for a, t in ins if int(m.group(1), 16) <= a <= at])
    return loops


def key_step(sass: str, head_dim: int, block_n: int) -> dict:
    """Per key block of the first unmasked key loop in ``sass`` (the innermost loop that issues
    wgmma and exponentials and no compares of key positions): its instructions, exponentials on
    the exp2 unit (MUFU.EX2), emulated exponentials (one FADD.FTZ.RM each), register moves (MOV,
    IMAD.MOV) and byte permutes (PRMT), divided by the blocks one trip handles (its wgmma over a
    block's head_dim/16 + block_n/16)."""
    per_block = head_dim // 16 + block_n // 16
    for body in sass_loops(sass):
        wgmma = sum("HGMMA" in t for t in body)
        if not wgmma or wgmma % per_block or not any("MUFU.EX2" in t for t in body) or \
                any(t.split()[0].startswith("FSEL") for t in body) or wgmma > 2 * per_block:
            continue
        blocks = wgmma // per_block
        return dict(instructions=len(body) / blocks,
                    exp2_unit=sum("MUFU.EX2" in t for t in body) / blocks,
                    emulated=sum("FADD.FTZ.RM" in t for t in body) / blocks,
                    moves=sum(bool(re.search(r"\b(IMAD\.MOV\S*|MOV)\s+R", t)) for t in body) / blocks,
                    permutes=sum(t.split()[0].startswith("PRMT") for t in body) / blocks,
                    blocks_a_trip=blocks)
    return {}


# ------------------------------------------------------------------------------------------
# Nsight Compute
# ------------------------------------------------------------------------------------------


def _ncu(*args: str) -> str:
    done = subprocess.run(["ncu", *args], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"ncu {' '.join(args)} failed: {done.stderr[-2000:]}")
    return done.stdout


def ncu_source_page(regex: str, child: list, report: Path, extra_sections: Sequence[str] = ()) -> tuple:
    """Run ``child`` (a command line) under Nsight Compute and read one launch of the kernel whose
    name matches ``regex``, the second one (the first compiles and warms): ``(duration in ms,
    header, rows)`` of its source page, one row per SASS instruction. ``extra_sections``: more
    ncu sections to collect into ``report`` (read them with :func:`ncu_raw`). Raises RuntimeError
    when ncu fails."""
    sections = [a for name in ("SpeedOfLight", "WarpStateStats", "SourceCounters", *extra_sections)
                for a in ("--section", name)]
    _ncu("--clock-control", "none", "-k", f"regex:{regex}", "-s", "1", "-c", "1", *sections,
         "-f", "-o", str(report.with_suffix("")), *child)
    details = _ncu("-i", str(report), "--page", "details")
    duration = re.search(r"Duration\s+(\w+)\s+([\d.,]+)", details)
    scale = {"ms": 1.0, "us": 1e-3, "usecond": 1e-3, "msecond": 1.0}.get(duration.group(1), float("nan"))
    rows = list(csv.reader(io.StringIO(_ncu("-i", str(report), "--page", "source", "--csv", "--print-source", "sass"))))
    return float(duration.group(2).replace(",", "")) * scale, rows[1], rows[2:]


def ncu_raw(report: Path) -> dict[str, tuple[float, str]]:
    """The numeric metrics of the one launch in the Nsight Compute ``report`` (its raw page), by
    metric name: ``(value, unit)`` as the page gives them. Raises RuntimeError when ncu fails."""
    return ncu_raw_page(_ncu("-i", str(report), "--page", "raw", "--csv"))


def ncu_raw_table(raw_csv: str) -> tuple[list[str], list[str], list[list[str]]]:
    """The raw page's text (``ncu --page raw --csv``) as ``(metric names, their units, one row of
    values per profiled launch)``. Raises StopIteration when the text holds no table."""
    table = list(csv.reader(io.StringIO(raw_csv)))
    start = next(i for i, r in enumerate(table) if "Kernel Name" in r)
    return table[start], table[start + 1], table[start + 2:]


def ncu_raw_page(raw_csv: str) -> dict[str, tuple[float, str]]:
    """:func:`ncu_raw` of the raw page's text (``ncu --page raw --csv``): its first launch. Raises
    StopIteration when the text holds no table."""
    header, units, launches = ncu_raw_table(raw_csv)
    out = {}
    for name, unit, value in zip(header, units, launches[0]):
        try:
            out[name] = (float(value.replace(",", "")), unit)
        except ValueError:
            pass
    return out


NCU_SAMPLES = "Warp Stall Sampling (All Samples)"


def ncu_stall_shares(header: list, data: list) -> dict:
    """Each stall reason's share of all the kernel's warp samples (the source page's ``stall_``
    columns, the 'Not Issued' duplicates left out)."""
    samples = header.index(NCU_SAMPLES)
    reasons = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(int(r[samples] or 0) for r in data) or 1
    return {header[i][len("stall_"):]: sum(int(r[i] or 0) for r in data) / total for i in reasons}


class StepClock:
    """A stopping criterion that never stops: it notes the time of every call (one per generated
    token, after a sync on a GPU), so a ``generate`` yields its per-step durations."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def median_step_ms(self) -> float:
        """The median of the gaps between calls, in ms (the first call ends the prefill)."""
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return statistics.median(gaps) * 1000 if gaps else float("nan")

    def fast_step_ms(self) -> float:
        """The 10th percentile of the gaps, in ms: the step's own cost with less of the host's
        noise, which adds time to a step and never takes any away."""
        gaps = sorted(b - a for a, b in zip(self.times, self.times[1:]))
        return gaps[len(gaps) // 10] * 1000 if gaps else float("nan")
