"""How the persistent dense forward deals its tiles to programs (``_schedule``): every tile once,
each program's run read back by the kernel's own arithmetic, a modelled makespan no longer than the
formula's, and the causal shortest tiles dealt last. The GPU check (``bench/check_gpu.py``) runs
the table on the GPU against the formula's deal, bit for bit; ``bench/fwd_schedule.py`` times it.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch

from flash_ref import GLUON_FWD_SM90_CHILD, load_flash_attn2, run_compiling_child

fa = load_flash_attn2()
sched = importlib.import_module(fa.__name__ + "._schedule")

# (heads x batch, row blocks, tile rows, key block, seqlen_q, seqlen_k, causal): the attention
# table's shapes at 16k tokens a batch, and ragged ones
SHAPES = [
    (256, 8, 128, 64, 1024, 1024, True),
    (64, 32, 128, 128, 4096, 4096, True),
    (16, 128, 128, 128, 16384, 16384, True),
    (64, 22, 192, 128, 4096, 4096, False),
    (16, 86, 192, 128, 16384, 16384, False),
    (6, 5, 128, 128, 600, 900, True),    # sq < sk: every row sees the 300 extra keys
    (6, 8, 128, 128, 1000, 400, True),   # sq > sk: the first row blocks see no key at all
    (3, 7, 128, 64, 800, 800, False),
]


def _table(shape, nprog):
    kind, span, runs = sched.deal(*shape, nprog)
    return sched.table(runs, shape[1]), len(runs)


def _walks(table: list, nprog: int, n_m: int) -> list:
    """Each program's (bh, m) tiles, read as the kernel reads them (_gluon_fwd's my_n and _tile)."""
    walks = []
    for pid in range(nprog):
        my_n = table[pid + 1] - table[pid]
        entries = [table[nprog + 1 + table[pid] + i] for i in range(my_n)]
        walks.append([(e // n_m, e % n_m) for e in entries])
    return walks


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("nprog", [1, 7, 132])
def test_every_tile_is_walked_once(shape, nprog):
    n_bh, n_m = shape[:2]
    table, nprog = _table(shape, nprog)
    assert len(table) == nprog + 1 + n_bh * n_m + 1  # one padding entry: the last program reads a tile ahead
    assert table[0] == 0 and table[:nprog + 1] == sorted(table[:nprog + 1])
    walks = _walks(table, nprog, n_m)
    assert sorted(t for w in walks for t in w) == [(bh, m) for bh in range(n_bh) for m in range(n_m)]
    assert all(walks), "every program launched has a tile"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_deal_is_never_modelled_longer_than_the_formula(shape):
    n_bh, n_m, tile_m, block_n, sq, sk, causal = shape
    kind, span, runs = sched.deal(*shape, 132)
    cost = lambda m: sched.tile_cost(m, tile_m, block_n, sq, sk, causal)  # noqa: E731
    makespan = lambda runs: max(sum(cost(m) for _, m in run) for run in runs)  # noqa: E731
    # the makespan is what the runs add up to, never above the formula's
    assert span == makespan(runs)
    assert span <= makespan(sched.formula_runs(n_bh, n_m, causal, min((n_bh * n_m + 1) // 2, 132)))
    # and within one tile of perfect balance
    work = n_bh * sum(cost(m) for m in range(n_m))
    assert span <= work / 132 + max(cost(m) for m in range(n_m))


def test_causal_table_shapes_gain_what_the_formula_loses_to_its_ragged_last_round():
    # 2048 tiles: 1024 pairs over 132 programs leave 100 with 8 pairs and 32 with 7, 3 % of the
    # call; the table deals the shortest tiles last and ends within 0.5 % of balance
    for shape in SHAPES[1:3]:
        n_bh, n_m, tile_m, block_n, sq, sk, causal = shape
        work = n_bh * sum(sched.tile_cost(m, tile_m, block_n, sq, sk, causal) for m in range(n_m))
        formula = max(sum(sched.tile_cost(m, tile_m, block_n, sq, sk, causal) for _, m in run)
                      for run in sched.formula_runs(n_bh, n_m, causal, 132))
        kind, span, _ = sched.deal(*shape, 132)
        assert kind == "list" and formula / (work / 132) > 1.03
        assert span / (work / 132) < 1.005
    # 1k causal tokens at head_dim 128: the model's deal is under LIST_MIN_GAIN shorter (and measured
    # slower), so the formula's deal stays
    kind, span, _ = sched.deal(*SHAPES[0], 132)
    assert kind == "formula"


def test_non_causal_tiles_go_round_robin_one_at_a_time():
    # equal tiles: program p walks p, p + P, ... of the heads' row blocks in order; 1408 tiles
    # take 11 rounds of single tiles against 6 pairs (12 tiles) by the formula
    shape = (64, 22, 192, 128, 4096, 4096, False)
    walks = _walks(*_table(shape, 132), 22)
    assert max(map(len, walks)) == 11 and min(map(len, walks)) == 10
    assert walks[5][:3] == [divmod(5, 22), divmod(137, 22), divmod(269, 22)]


def test_causal_calls_hold_the_shortest_tiles_back_to_the_end():
    shape = (64, 32, 128, 128, 4096, 4096, True)
    walks = _walks(*_table(shape, 132), 32)
    last = [w[-1][1] for w in walks]
    firsts = [w[0][1] for w in walks]
    # nearly every program ends on one of the shortest few row blocks (the few that do not were
    # busy with a long one until the end); the first are the first heads' tiles, zig-zag as the
    # formula has them
    assert sum(m < 32 // 8 for m in last) >= 0.95 * len(last)
    assert {bh for w in walks for bh, _ in w[:1]} <= set(range(8))
    assert 31 in firsts and 0 not in firsts


def test_a_table_is_built_once_per_shape_and_only_where_the_model_deals_better(monkeypatch):
    monkeypatch.setattr(sched, "_TABLES", {})
    cpu = torch.device("cpu")
    shape = (64, 32, 128, 128, 4096, 4096, True)
    first, programs = sched.device_table(cpu, *shape, 132)
    assert first.dtype == torch.int32 and programs == 132 and first.tolist() == _table(shape, 132)[0]
    assert sched.device_table(cpu, *shape, 132)[0] is first  # built once
    # 2048 equal tiles: 1024 pairs fill the rounds as well as single tiles: the formula in the
    # kernel, no table (remembered too)
    equal = (256, 8, 128, 128, 1024, 1024, False)
    assert sched.deal(*equal, 132)[0] == "formula"
    assert sched.device_table(cpu, *equal, 132) is None and len(sched._TABLES) == 2
    # three tiles: two programs by the formula (a pair and one), three single tiles by the list
    assert sched.deal(1, 3, 128, 128, 384, 384, False, 132)[0] == "list"
    assert sched.device_table(cpu, 1, 3, 128, 128, 384, 384, False, 132)[1] == 3
    # beyond MAX_ROUNDS tiles a program the formula, not modelled
    many = (sched.MAX_ROUNDS * 132 // 32 + 1, 32, 128, 128, 4096, 4096, True)
    assert sched.deal(*many, 132)[:2] == ("formula", 0)
    assert sched.device_table(cpu, *many, 132) is None
    with pytest.raises(ValueError, match="no tiles"):
        sched.assignment(0, 32, 128, 128, 4096, 4096, True, 132)


def test_a_table_copied_without_blocking_is_waited_for_once_by_the_next_call(monkeypatch):
    # the call that built it launches on the copy's stream; the next may launch on another, so it
    # waits for the copy's event once on the host; a capture (where the host may not wait) takes
    # the table without waiting: torch.cuda.graph synchronises the device before capturing
    monkeypatch.setattr(sched, "_TABLES", {})
    cuda = torch.device("cuda", 0)
    shape = (64, 32, 128, 128, 4096, 4096, True)
    waits = []

    class Copied:
        def synchronize(self):
            waits.append(1)

    entry = sched._TABLES[(cuda, *shape, 132)] = sched._Table((torch.zeros(3, dtype=torch.int32), 2), Copied())
    monkeypatch.setattr(sched, "_current_stream", lambda device: 1234)  # not the default stream: asked
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert sched.device_table(cuda, *shape, 132) is entry.pair and waits == [1]
    assert sched.device_table(cuda, *shape, 132) is entry.pair and waits == [1]  # once
    assert not entry.captured
    entry.copied = Copied()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert sched.device_table(cuda, *shape, 132) is entry.pair and waits == [1] and entry.copied is None
    assert entry.captured  # a graph reads it from now on
    # a shape with no table yet keeps the formula under capture (its copy could not be captured)
    assert sched.device_table(cuda, 63, *shape[1:], 132) is None and len(sched._TABLES) == 1


def test_a_table_a_capture_took_outlives_the_cache_of_shapes(monkeypatch):
    # a CUDA graph reads the table at every replay: clearing the shapes cache must not free it
    monkeypatch.setattr(sched, "_TABLES", {})
    monkeypatch.setattr(sched, "_CAPTURED", [])
    monkeypatch.setattr(sched, "_TABLES_MAX", 2)
    cpu = torch.device("cpu")
    shapes = [(62 + i, 32, 128, 128, 4096, 4096, True) for i in range(3)]  # each dealt by the model
    for shape in shapes[:2]:
        assert sched.device_table(cpu, *shape, 132) is not None
    taken = sched._TABLES[(cpu, *shapes[0], 132)]
    taken.captured = True
    sched.device_table(cpu, *shapes[2], 132)  # the cache is full: cleared first
    assert list(sched._TABLES) == [(cpu, *shapes[2], 132)]
    assert sched._CAPTURED == [taken]


def test_a_gpu_table_is_built_on_a_thread_of_its_own(monkeypatch):
    # torch.compile's CUDA graphs take the calling thread's allocations into the graph's pool
    # while they warm a graph up, and refuse a kept tensor there; the table's thread allocates
    # from the ordinary pool. What the build raises reaches the caller, and nothing is kept.
    import threading

    monkeypatch.setattr(sched, "_TABLES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "the caller's stream")
    monkeypatch.setattr(sched, "_current_stream", lambda device: 0)
    seen = []

    def to_gpu(host, device, stream, programs):
        seen.append((threading.current_thread(), stream, programs))
        return sched._Table((host, programs), None)

    monkeypatch.setattr(sched, "_to_gpu", to_gpu)
    cuda = torch.device("cuda", 0)
    shape = (64, 32, 128, 128, 4096, 4096, True)
    tensor, programs = sched.device_table(cuda, *shape, 132)
    assert tensor.tolist() == _table(shape, 132)[0] and programs == 132
    assert seen[0][0] is not threading.current_thread() and seen[0][1:] == ("the caller's stream", 132)

    def fails(*args):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(sched, "_to_gpu", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        sched.device_table(cuda, 63, *shape[1:], 132)  # a shape the model deals too
    assert len(sched._TABLES) == 1


def test_the_formula_runs_are_the_kernels_formula():
    # _gluon_fwd's my_n and _tile without a table: pairs u = pid + j P, tiles 2u and 2u + 1
    n_bh, n_m, nprog = 5, 7, 4
    order = [0, 6, 1, 5, 2, 4, 3]
    runs = sched.formula_runs(n_bh, n_m, True, nprog)
    n_tiles = n_bh * n_m
    for pid in range(nprog):
        my_pairs = ((n_tiles + 1) // 2 - pid + nprog - 1) // nprog
        my_n = 2 * my_pairs - int(2 * (pid + (my_pairs - 1) * nprog) + 1 >= n_tiles)
        ts = [2 * (pid + (i // 2) * nprog) + i % 2 for i in range(my_n)]
        assert runs[pid] == [(t // n_m, order[t % n_m]) for t in ts]


def test_the_forward_passes_the_table_and_its_program_count(monkeypatch):
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    gf = importlib.import_module(fa.__name__ + "._gluon_fwd")
    launched = []
    monkeypatch.setattr(gf, "_LAUNCHERS", {key: (lambda grid, args, constexprs, warps, stages, key=key:
                                                 launched.append((key, grid, args)))
                                           for key in gf._LAUNCHERS})
    monkeypatch.setattr(gf, "_sm_count", lambda device: 132)
    monkeypatch.setattr(sched, "_TABLES", {})
    names = list(gf._gluon_attn_fwd.arg_names)
    # (batch, tokens, heads, head_dim, causal), the dealt shape (tile rows: 192 for head_dim 64
    # non-causal's three consumers; 64-key blocks for head_dim 128 causal up to 1k) and the programs
    for b, s, h, d, causal, shape, programs in (
            (4, 4096, 16, 64, True, (64, 32, 128, 128, 4096, 4096, True), 132),
            (4, 4096, 16, 64, False, (64, 22, 192, 128, 4096, 4096, False), 132),
            (1, 300, 1, 128, True, (1, 3, 128, 64, 300, 300, True), 3)):
        q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16) for _ in range(3))
        launched.clear()
        gf.gluon_attention_forward(q, k, v, softmax_scale=0.125, causal=causal)
        (key, grid, args), = launched
        assert key[2] is True and grid == (programs, 1, 1)
        assert args[names.index("tiles")].tolist() == _table(shape, 132)[0]
    # 16 x 1024 tokens, head_dim 128 non-causal: 2048 equal tiles, the formula in the kernel
    q, k, v = (torch.randn(16, 1024, 16, 128, dtype=torch.bfloat16) for _ in range(3))
    launched.clear()
    gf.gluon_attention_forward(q, k, v, softmax_scale=0.125, causal=False)
    (key, grid, args), = launched
    assert key[2] is False and grid == (132, 1, 1) and args[names.index("tiles")] is None
    q, k, v = (torch.randn(1, 300, 1, 128, dtype=torch.bfloat16) for _ in range(3))
    launched.clear()
    gf.gluon_attention_forward(q, k, v, softmax_scale=0.125, causal=True, schedule=False)
    (key, grid, args), = launched
    assert key[2] is False and grid == (2, 1, 1) and args[names.index("tiles")] is None


def test_under_warmup_a_dense_call_also_compiles_the_build_it_did_not_take(monkeypatch):
    # which build (with or without the table) a call takes depends on its batch: `kernel-loader
    # warmup` sets FLASH_ATTN2_WARMUP=1 so that a cache warmed with one batch holds both
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    gf = importlib.import_module(fa.__name__ + "._gluon_fwd")
    warmed, launched = [], []

    class Recorder:
        def __init__(self, key):
            self.key = key

        def __call__(self, grid, args, constexprs, warps, stages):
            launched.append(self.key)

        def warmup(self, args, constexprs, warps, stages):
            warmed.append((self.key, args[gf._TILES_ARG]))

    monkeypatch.setattr(gf, "_LAUNCHERS", {key: Recorder(key) for key in gf._LAUNCHERS})
    monkeypatch.setattr(gf, "_sm_count", lambda device: 132)
    monkeypatch.setattr(gf, "_WARMED_DEALS", set())
    monkeypatch.setattr(sched, "_TABLES", {})
    q = torch.randn(4, 4096, 16, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(gf, "WARM_BOTH_DEALS", False)
    gf.gluon_attention_forward(q, q, q, softmax_scale=0.125, causal=True)
    assert warmed == [] and launched == [(False, 2, True)]  # not outside warmup
    monkeypatch.setattr(gf, "WARM_BOTH_DEALS", True)
    gf.gluon_attention_forward(q, q, q, softmax_scale=0.125, causal=True)
    assert warmed == [((False, 2, False), None)]  # the table was taken: the formula's build compiled
    gf.gluon_attention_forward(q, q, q, softmax_scale=0.125, causal=True)
    assert len(warmed) == 1  # once per configuration
    # 16 x 1024 tokens, head_dim 128, non-causal: the formula taken, the table's build compiled
    q = torch.randn(16, 1024, 16, 128, dtype=torch.bfloat16)
    gf.gluon_attention_forward(q, q, q, softmax_scale=0.1, causal=False)
    (key, tiles), = warmed[1:]
    assert key == (False, 2, True) and tiles.dtype == torch.int32 and tiles.device.type == "meta"
    # a build that fails to compile is named in a warning; the call itself goes on
    def broken(args, constexprs, warps, stages):
        raise RuntimeError("ptxas died")
    gf._LAUNCHERS[False, 2, True].warmup = broken
    with pytest.warns(RuntimeWarning, match="with the tile table did not compile.*ptxas died"):
        gf.gluon_attention_forward(q, q, q, softmax_scale=0.1, causal=False, store_lse=False)
    assert launched[-1] == (False, 2, False)


def test_the_scheduled_walk_compiles_for_sm90(tmp_path):
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    done = run_compiling_child(GLUON_FWD_SM90_CHILD, (128, 1, 0, 2, *["shipped"] * 9, "scheduled"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = done.stdout
    assert "%nctaid.x" in ptx  # the table's runs start after the programs' offsets
    assert re.search(r"ld\.global(\.\w+)*\.b32", ptx)  # the run's offsets and entries read from the table
    assert ".local" not in ptx
