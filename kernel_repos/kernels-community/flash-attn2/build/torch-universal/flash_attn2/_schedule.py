"""Which tiles each program of the persistent dense forward walks, worked out on the host.

Why: the persistent forward launches one program per SM, and each walks a fixed list of
(batch·head, row block) tiles. Dealt by a formula (pairs of tiles in turn, ``_gluon_fwd._tile``)
the last round is partial: at 16k tokens per batch the table shapes have 2048 tiles of 128 rows,
1024 pairs over 132 SMs, so 100 programs walk 8 pairs and 32 walk 7 (a makespan of 8 pairs
against 7.76 of work, 3 % lost); 192-row tiles at 4k tokens (head_dim 64, non-causal) leave 44
programs with a sixth pair while 88 stop after five (11 % lost). The GPU's own block dispatch
(one program a tile) hands the next tile to whichever SM frees first, which the persistent walk
gave up for its carried-over loads.

What this does instead: list scheduling in a model of that dispatch. Tiles go in an order that
keeps the programs running at one time on a few neighbouring heads (their K/V stays in L2: a
head's row blocks one after another, causal ones zig-zag short/long as the formula has them),
each to the program whose modelled work ends first; a tile costs its key blocks plus about one
128-key block's worth for its prologue and epilogue (:func:`tile_cost`). Causal tiles differ in
length, and a list that ends on long tiles leaves a ragged end, so the shortest tiles of every head (a few key blocks each, little to keep in L2)
are held back and dealt last, longest first; how many is chosen by running the model on a few
cut-offs. Non-causal tiles all cost the same, and the deal is round-robin over single tiles.

The result is one int32 table per shape, ``[P + 1 + tiles + 1]``: entries 0..P the offsets of
each program's run (CSR), then the tiles as ``bh * n_m + m``, then one padding entry; the kernel
reads its own run (``_gluon_fwd._tile``), each tile's entry while the tile before it runs (the last
program reads the padding). Each tile is computed exactly as before, so the output is the same bits.
Where the model finds no deal :data:`LIST_MIN_GAIN` (2 %) shorter than the formula's (equal
tiles that fill the last round; 1k causal tokens) the call keeps the formula in the kernel,
compiled without the table: reading a table costs a little (two dependent loads as a program
starts), which a deal no shorter does not pay back.
"""

from __future__ import annotations

import heapq
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from ._launch import capturing as _capturing
from ._launch import current_stream as _current_stream

# Beyond this many tiles a program (rounds), the formula's ragged last round costs at most ~1/64
# of the call and the model's run on the host (a few ms per thousand tiles, once per shape) is
# not worth it: such calls keep the formula
MAX_ROUNDS = 32
# cut-offs tried for the held-back tiles, as fractions of the longest tile's cost
_HOLD_BACK = (0.0, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 5 / 16)
# the model's deal is taken where it is modelled at least this much shorter than the formula's:
# at 1k causal tokens (head_dim 128, 64-key blocks) it was modelled 1.01-1.02x and measured
# 0.98-0.99x (bench/results/fwd_schedule.md), where the modelled 1.03x at 4k-16k measured 1.01-1.05x
LIST_MIN_GAIN = 1.02
_TABLES: dict = {}
# tables a CUDA graph capture took, kept for the life of the process once the shapes cache is cleared
_CAPTURED: list = []
_TABLES_MAX = 256  # shapes kept per process (a table is a few KB on the GPU)


def key_blocks(m: int, tile_m: int, block_n: int, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Key blocks row block ``m`` reads (``_gluon_fwd._key_blocks``; at least one). Raises nothing."""
    hi = min(seqlen_k, (m + 1) * tile_m + seqlen_k - seqlen_q) if causal else seqlen_k
    return max(-(-hi // block_n), 1)


def tile_cost(m: int, tile_m: int, block_n: int, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """The model's cost of row block ``m``: its key blocks plus its prologue and epilogue (the Q
    load, the first key block's wait, the output's store), about one 128-key block's work,
    whatever the block size. Raises nothing."""
    return key_blocks(m, tile_m, block_n, seqlen_q, seqlen_k, causal) + max(1, 128 // block_n)


def _base_order(n_m: int, causal: bool) -> List[int]:
    # a head's row blocks in the formula's order: zig-zag (0, n-1, 1, n-2, ...) when causal
    if not causal:
        return list(range(n_m))
    return [r // 2 if r % 2 == 0 else n_m - 1 - r // 2 for r in range(n_m)]


def _list_schedule(tiles: Sequence[Tuple[int, int]], costs: Sequence[int], nprog: int) -> Tuple[int, List[List[int]]]:
    """List scheduling of ``tiles`` (``(bh, m)`` in order) over ``nprog`` programs: each to the one
    whose modelled work ends first (ties: the lower program). Returns (makespan, runs)."""
    ends = [(0, p) for p in range(nprog)]
    runs: List[List[int]] = [[] for _ in range(nprog)]
    for bh, m in tiles:
        end, p = ends[0]
        heapq.heapreplace(ends, (end + costs[m], p))
        runs[p].append((bh, m))
    return max(end for end, _ in ends), runs


def _assign(costs: Sequence[int], n_bh: int, causal: bool, nprog: int) -> Tuple[int, List[List[Tuple[int, int]]]]:
    """:func:`assignment` given each row block's :func:`tile_cost`."""
    if n_bh <= 0 or not costs or nprog <= 0:
        raise ValueError(f"no tiles to deal: {n_bh} heads x {len(costs)} row blocks over {nprog} programs")
    order = _base_order(len(costs), causal)
    best = None
    for share in (_HOLD_BACK if causal else (0.0,)):
        cut = int(share * max(costs))
        main = [(bh, m) for bh in range(n_bh) for m in order if costs[m] > cut]
        # the held-back short tiles, longest first, the heads in order within one length
        held = sorted(((bh, m) for bh in range(n_bh) for m in order if costs[m] <= cut),
                      key=lambda t: -costs[t[1]])
        span, runs = _list_schedule(main + held, costs, nprog)
        if best is None or span < best[0]:
            best = (span, runs)
    return best


def _costs(n_m: int, tile_m: int, block_n: int, seqlen_q: int, seqlen_k: int, causal: bool) -> List[int]:
    return [tile_cost(m, tile_m, block_n, seqlen_q, seqlen_k, causal) for m in range(n_m)]


def assignment(n_bh: int, n_m: int, tile_m: int, block_n: int, seqlen_q: int, seqlen_k: int, causal: bool,
               nprog: int) -> Tuple[int, List[List[Tuple[int, int]]]]:
    """Each program's tiles, ``(bh, m)`` in walking order, and the modelled makespan (the sum of
    :func:`tile_cost`). Raises ValueError for an empty shape or no programs."""
    return _assign(_costs(n_m, tile_m, block_n, seqlen_q, seqlen_k, causal), n_bh, causal, nprog)


def formula_runs(n_bh: int, n_m: int, causal: bool, nprog: int) -> List[List[Tuple[int, int]]]:
    """Each program's tiles as the formula deals them (``_gluon_fwd._tile`` without a table):
    pairs of tiles of the zig-zag order, pair u to program u mod P. Raises nothing."""
    order = _base_order(n_m, causal)
    runs: List[List[Tuple[int, int]]] = [[] for _ in range(nprog)]
    for t in range(n_bh * n_m):
        runs[(t // 2) % nprog].append((t // n_m, order[t % n_m]))
    return runs


def deal(n_bh: int, n_m: int, tile_m: int, block_n: int, seqlen_q: int, seqlen_k: int, causal: bool,
         nprog: int) -> Tuple[str, int, List[List[Tuple[int, int]]]]:
    """The deal a call takes: ``("list", makespan, runs)`` where :func:`assignment` models a
    makespan at least :data:`LIST_MIN_GAIN` times shorter than the formula's, else
    ``("formula", makespan, runs)``; beyond :data:`MAX_ROUNDS` tiles a program the formula's
    without modelling (makespan 0). Every run holds a tile: the formula's
    deal is over min(pairs, ``nprog``) programs, as its launch is. Raises ValueError as
    :func:`assignment`."""
    pairs = min((n_bh * n_m + 1) // 2, nprog)
    if n_bh * n_m > MAX_ROUNDS * nprog:
        return "formula", 0, formula_runs(n_bh, n_m, causal, pairs)
    costs = _costs(n_m, tile_m, block_n, seqlen_q, seqlen_k, causal)
    span, runs = _assign(costs, n_bh, causal, min(n_bh * n_m, nprog))
    formula = formula_runs(n_bh, n_m, causal, pairs)
    formula_span = max(sum(costs[m] for _, m in run) for run in formula)
    return ("list", span, runs) if span * LIST_MIN_GAIN < formula_span else ("formula", formula_span, formula)


def table(runs: Sequence[Sequence[Tuple[int, int]]], n_m: int) -> List[int]:
    """The int32 table of ``runs`` (see the module docstring). Raises nothing."""
    offsets, entries = [0], []
    for run in runs:
        entries.extend(bh * n_m + m for bh, m in run)
        offsets.append(len(entries))
    return offsets + entries + [0]


class _Table:
    """One shape's table on its device: ``pair`` is (tensor, programs); ``copied`` the event
    recorded after the copy to the GPU, until some call has waited for it (None after);
    ``captured``: a CUDA graph capture took it (the graph reads it at every replay)."""

    __slots__ = ("pair", "copied", "captured")

    def __init__(self, pair: Tuple[torch.Tensor, int], copied: Any) -> None:
        self.pair, self.copied, self.captured = pair, copied, False


def device_table(device: torch.device, n_bh: int, n_m: int, tile_m: int, block_n: int, seqlen_q: int,
                 seqlen_k: int, causal: bool, nprog: int) -> Optional[Tuple[torch.Tensor, int]]:
    """The table of :func:`deal` on ``device`` and the programs to launch (its runs, at most
    ``nprog``: one per SM), built once per shape and kept; None where the call keeps the formula
    in the kernel: where the deal is the formula's, and while a CUDA graph is being captured for
    a shape whose table is not built (its copy could not be captured). Why not the formula's
    deal from a table too: reading it measured 0.97-1.00x the formula in the kernel
    (``bench/results/repeats/fwd_schedule_ef908b9.md``).

    The copy to the GPU does not block: a blocking one would wait for every kernel queued before
    it. The call that built the table launches on the stream the copy went to, so it reads the
    table after the copy; the next call waits for the copy once, on the host (by then it has
    long run), since it may launch on another stream; a capture takes the table without waiting
    (the capture began after a device synchronisation, see below). A table a capture took is
    never freed (the graph reads it at every replay), also when the cache of shapes is cleared.
    Raises what building the table on the device raises (out of memory)."""
    key = (device, n_bh, n_m, tile_m, block_n, seqlen_q, seqlen_k, causal, nprog)
    found = _TABLES.get(key, _MISSING)
    if found is None:
        return None
    # asked on every call (a capture may take a kept table at any time), but not of the driver on
    # the default stream, where no capture runs (_launch.capturing)
    capturing = device.type == "cuda" and _capturing(_current_stream(device))
    if found is not _MISSING:
        if capturing:
            found.captured = True
        if found.copied is not None:
            # a capture may not wait on the host, and need not: torch.cuda.graph (and torch.compile's
            # CUDA graphs, built on it) synchronises the device before it starts capturing
            if not capturing:
                found.copied.synchronize()
            found.copied = None
        return found.pair
    if capturing:
        return None
    if len(_TABLES) >= _TABLES_MAX:
        _CAPTURED.extend(t for t in _TABLES.values() if t is not None and t.captured)
        _TABLES.clear()
    if n_bh * n_m > MAX_ROUNDS * nprog:  # the formula, without building its runs (a list per tile)
        _TABLES[key] = None
        return None
    kind, _, runs = deal(n_bh, n_m, tile_m, block_n, seqlen_q, seqlen_k, causal, nprog)
    if kind != "list":
        _TABLES[key] = None
        return None
    host = torch.tensor(table(runs, n_m), dtype=torch.int32)
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        entry = _on_another_thread(lambda: _to_gpu(host, device, stream, len(runs)))
    else:
        entry = _Table((host.to(device), len(runs)), None)
    _TABLES[key] = entry
    return entry.pair


def _to_gpu(host: torch.Tensor, device: torch.device, stream: Any, programs: int) -> _Table:
    # the copy goes on the caller's stream, ahead of the launch that reads it
    with torch.cuda.device(device), torch.cuda.stream(stream):
        try:
            host = host.pin_memory()
        except RuntimeError:  # no page-locked memory to be had: the copy blocks instead
            pass
        tensor = host.to(device, non_blocking=host.is_pinned())
        copied = None
        if host.is_pinned():
            # the caching host allocator keeps the pinned buffer until the copy has run
            copied = torch.cuda.Event()
            copied.record(stream)
    return _Table((tensor, programs), copied)


def _on_another_thread(build: Callable[[], _Table]) -> _Table:
    """``build()`` run on a thread of its own, the caller waiting for it.

    Why a thread: torch.compile's CUDA graphs (cudagraph trees) run a graph's first calls eagerly
    with every allocation of the calling thread taken from the graph's private memory pool, and
    refuse to record the graph while a tensor in that pool is not one of its outputs ("tensor(s)
    in the cudagraph pool not tracked as outputs"). The kept table is such a tensor where the
    calling thread allocates it; allocated on another thread it comes from the ordinary pool.
    Once per shape, so the thread's start (tens of µs) is paid once; not on the compile pool
    (``_launch``), whose threads may be busy compiling for seconds. Raises what ``build`` raises."""
    done: list = []

    def run() -> None:
        try:
            done.append((build(), None))
        except BaseException as e:  # noqa: BLE001 - handed to the caller as it is
            done.append((None, e))

    worker = threading.Thread(target=run, name="flash_attn2-tile-table")
    worker.start()
    worker.join()
    entry, error = done[0]
    if error is not None:
        raise error
    return entry


_MISSING = object()
