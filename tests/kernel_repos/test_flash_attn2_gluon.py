"""When the flash-attn2 forward runs the Gluon sm90 kernel, and that everything else keeps the
Triton kernel.

The Gluon kernel itself runs only on an sm90 GPU (``bench/gluon_fwd.py`` checks it there against
an fp64 reference and times it); here the CPU walks the dispatch rule, the layout checks and the
interpreter path, which must never reach the Gluon kernel, and compiles the kernel for sm90 with
the installed Triton to see the Hopper instructions it is built on.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import itertools
import re
import warnings

import pytest
import torch

from flash_ref import GLUON_FWD_SM90_CHILD, load_flash_attn2, reference, rel_err, run_compiling_child, sass_loops

fa = load_flash_attn2()
dispatch = importlib.import_module(fa.__name__ + "._gluon_dispatch")

PLAIN = dict(capability=(9, 0), gluon_ok=True, head_dim=128, causal=False, seqlen_q=4096, plain=True, bf16=True,
             layout_ok=True)


def test_measured_pairs_run_gluon_on_sm90():
    assert dispatch.wants_gluon(**PLAIN)
    assert dispatch.wants_gluon(**{**PLAIN, "head_dim": 256, "causal": True, "seqlen_q": 1024})


@pytest.mark.parametrize("change", [
    dict(capability=(8, 0)), dict(capability=(8, 9)), dict(capability=(10, 0)), dict(capability=None),
    dict(gluon_ok=False), dict(plain=False), dict(bf16=False), dict(layout_ok=False),
    dict(head_dim=96), dict(head_dim=64, causal=True, seqlen_q=4095),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_anything_else_keeps_the_triton_kernel(change):
    assert not dispatch.wants_gluon(**{**PLAIN, **change})


def test_head_dim_64_runs_gluon_dense_non_causal_and_causal_from_4k_queries():
    # the Gluon forward with its P·V wait kept after the softmax measured 1.00-1.07x the Triton
    # forward on non-causal rows, on causal ones 0.80x at 1k, 0.93x at 2k and 1.01-1.07x from 4k
    # (bench/results/gluon_fwd_pin_wait.md, gluon_fwd_d64_2k.md, gluon_fwd_d64_variants.md);
    # shorter causal and all packed calls at head_dim 64 keep the Triton kernel
    d64 = {**PLAIN, "head_dim": 64}
    assert dispatch.wants_gluon(**{**d64, "seqlen_q": 1})
    assert not dispatch.wants_gluon(**{**d64, "causal": True, "seqlen_q": 2048})
    assert not dispatch.wants_gluon(**{**d64, "causal": True, "seqlen_q": 4095})
    assert dispatch.wants_gluon(**{**d64, "causal": True, "seqlen_q": 4096})
    assert not dispatch.wants_gluon(**d64, varlen=True)
    assert 64 in _gluon_fwd().PIN_WAIT


def test_a_pair_can_require_a_minimum_of_query_tokens():
    table = {(128, True): 4096}
    causal = {**PLAIN, "causal": True}
    assert not dispatch.wants_gluon(**{**causal, "seqlen_q": 4095}, faster=table)
    assert dispatch.wants_gluon(**{**causal, "seqlen_q": 4096}, faster=table)
    assert not dispatch.wants_gluon(**PLAIN, faster=table)  # (128, non-causal) absent from that table


def test_head_dims_128_and_256_run_gluon_at_every_length():
    # measured faster than the Triton forward on every row, 1k to 16k (bench/results/gluon_fwd.md)
    for head_dim in (128, 256):
        for causal in (False, True):
            assert dispatch.wants_gluon(**{**PLAIN, "head_dim": head_dim, "causal": causal, "seqlen_q": 1})


def test_packed_sequences_follow_their_own_table(monkeypatch):
    # varlen calls are timed apart (bench/results/varlen.md): their table decides for them alone
    assert dispatch.wants_gluon(**PLAIN, varlen=True)
    monkeypatch.setattr(dispatch, "MEASURED_FASTER_VARLEN", {})
    assert not dispatch.wants_gluon(**PLAIN, varlen=True)
    assert dispatch.wants_gluon(**PLAIN)
    monkeypatch.setattr(dispatch, "MEASURED_FASTER_VARLEN", {(128, False): 0})
    monkeypatch.setattr(dispatch, "MEASURED_FASTER", {})
    assert dispatch.wants_gluon(**PLAIN, varlen=True) and not dispatch.wants_gluon(**PLAIN)


def test_an_empty_table_turns_gluon_off():
    assert not dispatch.wants_gluon(**PLAIN, faster={})
    assert dispatch.wants_gluon(**{**PLAIN, "head_dim": 64}, faster={(64, False): 0})


@pytest.mark.parametrize("version, expected", [
    ("3.6.0", (3, 6)), ("3.5.1", (3, 5)), ("3.10.0+git1a2b", (3, 10)), ("4.0", (4, 0)), ("3.7rc1", (3, 7)),
    ("nonsense", (0, 0)), ("", (0, 0)),
])
def test_triton_versions_are_read_as_major_minor(version, expected):
    assert dispatch.triton_version_tuple(version) == expected


def test_gluon_is_used_only_under_the_triton_release_it_was_measured_on(monkeypatch):
    import triton

    monkeypatch.setattr(dispatch, "_GLUON_AVAILABLE", None)
    measured = dispatch.triton_version_tuple(triton.__version__) in dispatch.MEASURED_TRITON
    assert dispatch.gluon_available() == measured
    monkeypatch.setattr(dispatch, "_GLUON_AVAILABLE", None)
    monkeypatch.setattr(dispatch, "MEASURED_TRITON", frozenset())
    assert not dispatch.gluon_available()


@pytest.mark.parametrize("value, extra", [
    ("", set()), ("3.7", {(3, 7)}), (" 3.7 , 3.8 ", {(3, 7), (3, 8)}), ("3.6", set()), ("3.7,", {(3, 7)}),
])
def test_further_triton_releases_are_accepted_by_name(value, extra):
    # for checking a release on a GPU before it is measured: FLASH_ATTN2_GLUON_TRITON=3.7
    accepted = dispatch.accepted_triton({dispatch.GLUON_TRITON_ENV: value})
    assert accepted == dispatch.MEASURED_TRITON | extra


@pytest.mark.parametrize("value", ["3", "latest", "3.7.1", "3.x"])
def test_a_malformed_release_name_is_refused_with_the_variable_named(value):
    with pytest.raises(ValueError, match=r"FLASH_ATTN2_GLUON_TRITON=.*major\.minor"):
        dispatch.accepted_triton({dispatch.GLUON_TRITON_ENV: value})


def test_a_release_named_in_the_environment_runs_gluon_where_the_measured_list_lacks_it(monkeypatch):
    import triton

    this = "%d.%d" % dispatch.triton_version_tuple(triton.__version__)
    has_hopper = importlib.util.find_spec("triton.experimental.gluon.language.nvidia.hopper") is not None
    monkeypatch.setattr(dispatch, "MEASURED_TRITON", frozenset())
    monkeypatch.setattr(dispatch, "_GLUON_AVAILABLE", None)
    monkeypatch.delenv(dispatch.GLUON_TRITON_ENV, raising=False)
    assert not dispatch.gluon_available()
    monkeypatch.setattr(dispatch, "_GLUON_AVAILABLE", None)
    monkeypatch.setenv(dispatch.GLUON_TRITON_ENV, this)
    assert dispatch.gluon_available() == has_hopper
    monkeypatch.setattr(dispatch, "_GLUON_AVAILABLE", None)
    monkeypatch.setenv(dispatch.GLUON_TRITON_ENV, "next")
    with pytest.raises(ValueError, match="FLASH_ATTN2_GLUON_TRITON"):
        dispatch.gluon_available()


def _gluon_fwd():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    return importlib.import_module(fa.__name__ + "._gluon_fwd")


def test_layout_checks_accept_flash_attn_and_transformers_layouts():
    gf = _gluon_fwd()
    q, k, v = (torch.randn(2, 300, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    assert gf.supports(q, k, v)
    heads_first = torch.randn(2, 4, 300, 128, dtype=torch.bfloat16).transpose(1, 2)
    assert gf.supports(heads_first, k, v)


def test_layout_checks_refuse_what_the_copy_engine_cannot_read():
    gf = _gluon_fwd()
    q, k, v = (torch.randn(2, 300, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    assert not gf.supports(q.half(), k.half(), v.half())  # checked and timed in bf16 only
    assert not gf.supports(q, k.half(), v)
    odd = torch.randn(2, 300, 4, 136, dtype=torch.bfloat16)[..., :128]  # row stride 136*2 % 16 == 0
    assert gf.supports(odd, k, v)
    odd = torch.randn(2, 300, 4, 129, dtype=torch.bfloat16)[..., :128]  # 129*2 bytes: not 16-aligned
    assert not gf.supports(odd, k, v)
    assert not gf.supports(q[..., :96].contiguous(), k[..., :96].contiguous(), v[..., :96].contiguous())
    assert not gf.supports(q, k[:, :0], v[:, :0])  # no keys: the descriptor needs a non-empty tensor
    strided = torch.randn(2, 300, 4, 256, dtype=torch.bfloat16)[..., ::2]
    assert not gf.supports(strided, k, v)
    broadcast = torch.randn(2, 1, 4, 128, dtype=torch.bfloat16).expand(2, 300, 4, 128)  # stride 0 along tokens
    assert not gf.supports(broadcast, k, v)
    assert gf.supports(torch.randn(1, 300, 4, 128, dtype=torch.bfloat16), k[:1], v[:1])  # a batch of one
    packed = torch.randn(600, 4, 128, dtype=torch.bfloat16)  # varlen [total, heads, dim]
    assert gf.supports(packed, packed, packed)
    kv = torch.randn(600, 2, 4, 128, dtype=torch.bfloat16)  # kv-packed: k and v are views of one tensor
    assert gf.supports(packed, kv[:, 0], kv[:, 1])


def test_the_layout_answer_is_remembered_per_layout_but_the_base_address_is_checked_each_call():
    gf = _gluon_fwd()
    t = torch.randn(3, 301, 4, 128, dtype=torch.bfloat16)
    assert gf.copy_engine_reads(t) and gf.copy_engine_reads(t.clone())
    assert not gf.copy_engine_reads(torch.randn(3, 301, 4, 129, dtype=torch.bfloat16)[..., :128])  # rows 258 bytes
    flat = torch.randn(3 * 301 * 4 * 128 + 8, dtype=torch.bfloat16)
    aligned = flat[:-8].view(3, 301, 4, 128)
    shifted = flat[1:-7].view(3, 301, 4, 128)  # same shape and strides, base 2 bytes off
    assert gf.copy_engine_reads(aligned)
    assert not gf.copy_engine_reads(shifted)


def test_the_memo_of_layouts_stays_bounded(monkeypatch):
    gf = _gluon_fwd()
    monkeypatch.setattr(gf, "_READS", {})
    monkeypatch.setattr(gf, "_READS_MAX", 4)
    for n in range(1, 11):  # packed calls: a new total length each step
        assert gf.copy_engine_reads(torch.randn(n, 2, 128, dtype=torch.bfloat16))
    assert 0 < len(gf._READS) <= 4


def test_descriptors_are_what_the_constructor_builds():
    gf = _gluon_fwd()
    t = torch.randn(2, 300, 4, 128, dtype=torch.bfloat16)
    made = gf._descriptor(t, gf.ROWS, 128)
    built = gf.TensorDescriptor(t, list(t.shape), list(t.stride()), [1, gf.ROWS, 1, 128], gf._shared_layout(gf.ROWS, 128))
    assert type(made) is type(built) and vars(made) == vars(built)
    # the check-free construction only where the descriptor has exactly the fields it fills
    fields = tuple(getattr(gf.TensorDescriptor, "__dataclass_fields__", ()))
    assert gf._UNCHECKED_DESCRIPTORS == (fields in (gf._DESCRIPTOR_FIELDS, gf._DESCRIPTOR_FIELDS_TF32))
    # the releases the package runs under have one of the two layouts (3.6's; 3.7's and later's)
    assert gf._UNCHECKED_DESCRIPTORS
    # an fp32 descriptor (the backward's dQ buffer) alike, rounding to tf32 left off
    acc = torch.zeros(256, 128, dtype=torch.float32)
    layout = gf.gl.NVMMASharedLayout.get_default_for([64, 128], gf.gl.float32)
    made = gf.make_descriptor(acc, list(acc.shape), list(acc.stride()), [64, 128], layout)
    assert vars(made) == vars(gf.TensorDescriptor(acc, list(acc.shape), list(acc.stride()), [64, 128], layout))

def _as_sm90_with_gluon(monkeypatch):
    """The autograd glue's view of a call as if on an H200 with the measured Triton (CPU tensors
    stand in: the glue reads only shapes, dtypes, strides and options)."""
    _gluon_fwd()
    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    monkeypatch.setattr(dispatch, "_GLUON_AVAILABLE", True)
    monkeypatch.setattr(fwd, "capability_of", lambda device: (9, 0))
    return importlib.import_module(fa.__name__ + "._autograd")


def _opts(**change):
    opts = dict(max_seqlen_q=700, max_seqlen_k=700, softmax_scale=0.1, causal=True, window_size=(-1, -1),
                softcap=0.0, dropout_p=0.0, seed=0)
    return {**opts, **change}


def test_packed_calls_reach_gluon_only_when_plain(monkeypatch):
    ag = _as_sm90_with_gluon(monkeypatch)
    q, k, v = (torch.randn(1000, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 300, 1000], dtype=torch.int32)
    assert ag._gluon_wanted(q, k, v, None, cu, None, _opts())
    slopes = torch.rand(2, 4)
    assert not ag._gluon_wanted(q, k, v, slopes, cu, None, _opts())
    assert not ag._gluon_wanted(q, k, v, None, cu, torch.tensor([5, 6], dtype=torch.int32), _opts())
    for change in (dict(dropout_p=0.1), dict(softcap=30.0), dict(window_size=(64, 0))):
        assert not ag._gluon_wanted(q, k, v, None, cu, None, _opts(**change)), change
    assert not ag._gluon_wanted(q[..., :96].contiguous(), k[..., :96].contiguous(), v[..., :96].contiguous(),
                                None, cu, None, _opts())
    # packed and dense calls follow their own tables
    monkeypatch.setattr(dispatch, "MEASURED_FASTER_VARLEN", {})
    assert not ag._gluon_wanted(q, k, v, None, cu, None, _opts())
    assert ag._gluon_wanted(q.view(1, 1000, 4, 128), k.view(1, 1000, 4, 128), v.view(1, 1000, 4, 128), None, None,
                            None, _opts(max_seqlen_q=None, max_seqlen_k=None))


def test_a_packed_table_minimum_counts_the_longest_sequence(monkeypatch):
    ag = _as_sm90_with_gluon(monkeypatch)
    q, k, v = (torch.randn(1000, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 300, 1000], dtype=torch.int32)
    monkeypatch.setattr(dispatch, "MEASURED_FASTER_VARLEN", {(128, True): 701})
    assert not ag._gluon_wanted(q, k, v, None, cu, None, _opts(max_seqlen_q=700))
    assert ag._gluon_wanted(q, k, v, None, cu, None, _opts(max_seqlen_q=701))


def test_interpreter_path_never_reaches_gluon(monkeypatch):
    gf = _gluon_fwd()
    calls = []
    monkeypatch.setattr(gf, "gluon_attention_forward", lambda *a, **kw: calls.append(1))
    # even with every pair "measured faster", CPU tensors (the interpreter) keep the Triton kernel
    monkeypatch.setattr(dispatch, "MEASURED_FASTER", {(d, c): 0 for d in (32, 64, 128, 256) for c in (False, True)})
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 20, 2, 32, dtype=torch.float16) for _ in range(3))
    out = fa.flash_attn_func(q, k, v, causal=True)
    assert calls == []
    ref_out, _ = reference(q, k, v, causal=True)
    assert rel_err(out, ref_out) < 3e-3


# Compiles in a child process (flash_ref.run_compiling_child)


@pytest.mark.parametrize("head_dim, causal, varlen, consumers",
                         [(128, False, False, 2), (256, True, False, 2), (128, True, True, 2), (64, True, False, 3),
                          (64, False, True, 3)])
def test_kernel_compiles_for_sm90_to_wgmma_and_bulk_copies(head_dim, causal, varlen, consumers, tmp_path):
    _gluon_fwd()
    done = run_compiling_child(GLUON_FWD_SM90_CHILD, (head_dim, int(causal), int(varlen), consumers, "shipped"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = done.stdout
    # Q·K^T and P·V on the tensor cores' warpgroup path, every tile through the copy engine
    assert len(re.findall(r"wgmma\.mma_async", ptx)) >= 3 * (head_dim // 16)
    assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::\w+\.global", ptx)  # loads
    # the output tile: through the copy engine, or, packed, a store masked at the sequence's end
    # (a bulk copy would overwrite the next sequence's first rows)
    bulk_store = re.search(r"cp\.async\.bulk\.tensor\.4d\.global\.shared::cta", ptx)
    assert (bulk_store is None) == varlen
    if varlen:
        assert re.search(r"@%p\d+ st\.global", ptx)
    assert ".local" not in ptx  # nothing spilled to local memory at the PTX level
    # warp-specialised: the producer warp gives registers back, the consumers take them
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    # two consumers: 240 each; three: 168 for the first, 160 for the other two
    for regs in ((240,) if consumers == 2 else (168, 160)):
        assert re.search(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+%d;" % regs, ptx), regs
    assert re.search(r"mbarrier\.arrive", ptx)  # slots handed back through mbarriers
    shared = int(re.search(r"shared (\d+)", done.stderr).group(1))
    assert shared <= 227 * 1024
    # dense calls: one program per SM walks its tiles (the grid's size read in the kernel);
    # packed ones take their tile from the program's coordinates
    assert ("%nctaid.x" in ptx) == (not varlen)


def test_packed_calls_can_walk_a_tile_list_persistently(tmp_path):
    # PERSISTENT_VARLEN: one program per SM takes its tiles from the list packed_tiles builds
    _gluon_fwd()
    done = run_compiling_child(GLUON_FWD_SM90_CHILD, (128, 1, 1, 2, *["shipped"] * 9, "persistent"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = done.stdout
    assert "%nctaid.x" in ptx  # the programs' count, for the snake deal
    assert re.search(r"@%p\d+ st\.global", ptx)  # the output still leaves through the masked store
    assert not re.search(r"cp\.async\.bulk\.tensor\.4d\.global\.shared::cta", ptx)
    assert ".local" not in ptx


def _snake_walk(table: torch.Tensor, heads: int, programs: int) -> list:
    """The (pair, head) tiles each program takes, by the kernel's own arithmetic (its my_n and _tile)."""
    n_live = int(table[0]) * heads
    rounds = n_live // programs
    walks = []
    for pid in range(programs):
        my_n = rounds + int(pid + (rounds % 2) * (programs - 1 - 2 * pid) < n_live % programs)
        ts = [i * programs + pid + (i % 2) * (programs - 1 - 2 * pid) for i in range(my_n)]
        walks.append([(int(table[1 + t // heads]), t % heads) for t in ts])
    return walks


@pytest.mark.parametrize("causal", [False, True])
def test_the_tile_list_holds_each_live_tile_once_longest_first(causal):
    gf = _gluon_fwd()
    lens_q, lens_k = [300, 0, 129, 1000, 64], [300, 5, 700, 1000, 64]
    cu = lambda lens: torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)  # noqa: E731
    tile_m, block_n, heads = 128, 128, 3
    n_m = -(-max(lens_q) // tile_m)
    table = gf.packed_tiles(cu(lens_q), cu(lens_k), n_m, tile_m, block_n, causal)
    assert table.dtype == torch.int32 and table.shape == (1 + len(lens_q) * n_m,)
    live = [(b, m) for b, n in enumerate(lens_q) for m in range(n_m) if m * tile_m < n]
    assert int(table[0]) == len(live)
    pairs = [divmod(int(p), n_m) for p in table[1:1 + len(live)]]
    assert sorted(pairs) == live

    def blocks(b, m):  # key blocks the row block reads (causal: up to its last row's diagonal)
        hi = min(lens_k[b], (m + 1) * tile_m + lens_k[b] - lens_q[b]) if causal else lens_k[b]
        return max(-(-hi // block_n), 1)
    costs = [blocks(b, m) for b, m in pairs]
    assert costs == sorted(costs, reverse=True)
    for programs in (1, 4, 7, 132):
        walks = _snake_walk(table, heads, programs)
        taken = sorted(t for walk in walks for t in walk)
        assert taken == sorted((b * n_m + m, h) for b, m in live for h in range(heads))
        # the snake: no program takes more than one tile more than another
        assert max(map(len, walks)) - min(map(len, walks)) <= 1


def _bar_syncs_per_key_block(ptx: str) -> list:
    """Warpgroup barriers (bar.sync) in each of the consumers' key loops: the PTX loops (a label
    to the branch back to it) whose body issues wgmma and waits on two barriers (K_j, V_{j-1})."""
    counts = []
    for label in re.findall(r"^(\$L__BB\d+_\d+):", ptx, re.M):
        m = re.search(r"^%s:(.*?)\n\s*(?:@%%p\d+ )?bra(?:\.uni)?\s+%s;" % (re.escape(label), re.escape(label)),
                      ptx, re.S | re.M)
        if m and "wgmma.mma_async" in m.group(1) and m.group(1).count("mbarrier.try_wait") == 2:
            counts.append(m.group(1).count("bar.sync"))
    assert len(counts) >= 2, "expected the consumers' key loops"
    return counts


@pytest.mark.parametrize("head_dim", [64, 128])
def test_thread_arrivals_drop_the_warpgroup_barriers_before_slot_releases(head_dim, tmp_path):
    _gluon_fwd()
    one = run_compiling_child(GLUON_FWD_SM90_CHILD, (head_dim, 0, 0, 2, "0"), tmp_path)
    every = run_compiling_child(GLUON_FWD_SM90_CHILD, (head_dim, 0, 0, 2, "1"), tmp_path)
    assert one.returncode == 0 and every.returncode == 0, (one.stderr[-3000:], every.stderr[-3000:])
    # one elected thread arrives after a bar.sync; with thread arrivals every thread arrives
    # on its own, and the barriers count 128 arrivals a consumer
    assert "cp.async.mbarrier.arrive.noinc" not in one.stdout
    assert len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc\.shared\.b64", every.stdout)) >= 8
    assert re.search(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], 256;", every.stdout)
    # per key block: a warpgroup barrier before each of the two releases (and, under Triton 3.6,
    # a third before the next wait) against the one before that wait
    assert min(_bar_syncs_per_key_block(one.stdout)) >= 2
    assert set(_bar_syncs_per_key_block(every.stdout)) == {1}
    assert ".local" not in every.stdout


def test_q_buffers_fit_beside_the_ring_and_double_where_they_can():
    gf = _gluon_fwd()
    for head_dim, (block_n, stages) in gf.TILES.items():
        n = gf.q_buffers(head_dim, block_n, stages)
        ring = stages * 2 * block_n * head_dim * 2
        assert ring + n * 2 * gf.ROWS * head_dim * 2 <= gf.SHARED_BYTES, head_dim
    assert [gf.q_buffers(d, *gf.TILES[d]) for d in (64, 128, 256)] == [2, 2, 1]


def test_short_causal_dense_calls_at_head_dim_128_take_the_64_key_tile():
    gf = _gluon_fwd()
    assert gf.call_tile(128, True, 1024, False) == (64, 4)  # measured faster at 1k causal
    assert gf.call_tile(128, True, 1025, False) == gf.TILES[128]  # 4k measured slower: beyond 1k the shipped tile
    assert gf.call_tile(128, False, 1024, False) == gf.TILES[128]  # not causal
    assert gf.call_tile(128, True, 1024, True) == gf.TILES[128]  # packed calls were not measured with it
    assert gf.call_tile(256, True, 512, False) == gf.TILES[256]
    # the short tile's ring and Q buffers fit in shared memory, double-buffered
    block_n, stages = gf.SHORT_CAUSAL_TILES[128][1]
    assert gf.q_buffers(128, block_n, stages) == 2


def _exponentials_around_pv_waits(sass: str) -> list:
    """For each P·V product of the consumers (a wgmma group whose A operand is in registers): the
    exponentials (MUFU.EX2) issued after it and before the next wgmma, as (before, after) the
    first wait for every wgmma group (WARPGROUP.DEPBAR.LE gsb0, 0x0) among them."""
    lines = sass.splitlines()
    found = []
    i = 0
    while i < len(lines):
        if re.search(r"HGMMA\.\S+ R\d+, R\d+, .*gsb0", lines[i]):
            before = after = 0
            waited = False
            i += 1
            while i < len(lines) and "HGMMA" not in lines[i]:
                waited = waited or "WARPGROUP.DEPBAR.LE gsb0, 0x0" in lines[i]
                if "MUFU.EX2" in lines[i]:
                    after += waited
                    before += not waited
                i += 1
        else:
            i += 1
            continue
        found.append((before, after))
    return found


@pytest.mark.parametrize("head_dim, causal", [(64, False), (128, True)])
def test_pinned_wait_keeps_the_softmax_under_the_pv_product(head_dim, causal, tmp_path):
    # with PIN_WAIT, every exponential of a key block's softmax issues before the wait for the
    # previous block's P·V, so the softmax runs while that product is on the tensor cores
    # (without it, ptxas moved the wait above nearly all of them: bench/NOTES.md)
    _gluon_fwd()
    done = run_compiling_child(GLUON_FWD_SM90_CHILD, (head_dim, int(causal), 0, 2, "shipped", "1", "0", "sass"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = _exponentials_around_pv_waits(done.stdout)
    with_softmax = [s for s in steps if sum(s)]
    assert len(with_softmax) >= 2, steps  # the key loops of both consumers' code paths
    # 128 keys a block: 64 exponentials a thread for the probabilities, plus the rescale factors
    assert all(before >= 64 and after == 0 for before, after in with_softmax), steps


def test_lazy_rescale_skips_the_multiplies_of_o_in_warps_whose_rows_kept_their_max(tmp_path):
    # LAZY_RESCALE (head_dim 64, off: measured 0.96-1.00x, bench/NOTES.md): after each P·V wait a
    # warp votes on its rows' rescale factors and branches around the 32 multiplies of its part
    # of O when every factor is exactly 1
    gf = _gluon_fwd()
    assert 64 not in gf.LAZY_RESCALE
    done = run_compiling_child(GLUON_FWD_SM90_CHILD, (64, 0, 0, 2, "shipped", "shipped", "0", "sass", "1"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    votes = [i for i, line in enumerate(lines) if "VOTE.ANY P" in line]
    assert len(votes) >= 4, len(votes)  # three copies of a step in each of the two consumers
    for i in votes:
        branch = next(j for j in range(i, len(lines)) if re.search(r"@!P\d+ BRA", lines[j]))
        assert branch - i < 40
        multiplies = [line for line in lines[branch + 1:branch + 33] if "FMUL" in line]
        assert len(multiplies) == 32, lines[branch:branch + 34]


def _key_loop_moves(sass: str) -> list:
    """Per SASS loop that issues wgmma and at most two steps' exponentials (the key loops): the
    number of wgmma (HGMMA), of exponentials (MUFU.EX2) and of register moves (MOV, IMAD.MOV)."""
    loops = []
    for body in sass_loops(sass):
        wgmma, exps = sum("HGMMA" in t for t in body), sum("MUFU.EX2" in t for t in body)
        if wgmma and 0 < exps <= 2 * 66:
            loops.append((wgmma, exps, sum(bool(re.search(r"\b(IMAD\.MOV\S*|MOV)\s+R", t)) for t in body)))
    return loops


def test_two_steps_a_trip_drop_the_moves_of_p_between_its_register_sets(tmp_path):
    # UNROLL2 (off until timed): at head_dim 64 a one-step loop moves P_j back into P_{j-1}'s
    # registers every trip (32 moves of the 34 a step); two steps a trip alternate between the sets
    gf = _gluon_fwd()
    assert 64 not in gf.UNROLL2
    base = (64, 0, 0, 2, "shipped", "shipped", "shipped", "sass", "shipped", "shipped")
    one = run_compiling_child(GLUON_FWD_SM90_CHILD, (*base, "0"), tmp_path / "one")
    two = run_compiling_child(GLUON_FWD_SM90_CHILD, (*base, "1"), tmp_path / "two")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-3000:], two.stderr[-3000:])
    # the unmasked loop: 4 + 8 wgmma a step (S = Q K^T in 4 k-steps of 16, P V in 8), 66 exponentials
    one_step = [moves for wgmma, exps, moves in _key_loop_moves(one.stdout) if (wgmma, exps) == (12, 66)]
    two_steps = [moves for wgmma, exps, moves in _key_loop_moves(two.stdout) if (wgmma, exps) == (24, 132)]
    assert one_step and two_steps, (_key_loop_moves(one.stdout), _key_loop_moves(two.stdout))
    assert min(one_step) >= 32
    assert max(two_steps) <= min(one_step), (one_step, two_steps)  # two steps, no more moves than one had


def _bulk_stores_and_waits(ptx: str) -> tuple:
    """(output copies followed within 10 lines by a wait for them, waits for output copies)."""
    lines = ptx.splitlines()
    stores = [i for i, line in enumerate(lines) if re.search(r"cp\.async\.bulk\.tensor\.4d\.global\.shared", line)]
    waits = [i for i, line in enumerate(lines) if "cp.async.bulk.wait_group.read" in line]
    return sum(any(0 < w - s <= 10 for w in waits) for s in stores), len(waits)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_a_deferred_output_copy_is_waited_for_inside_the_next_tile(head_dim, tmp_path):
    # DEFERRED_STORE (off until timed): a dense tile's output leaves through the copy engine and
    # the consumer goes on to its next tile, waiting for the copy (and handing the buffer back)
    # after that tile's first key block, and once more after its last tile. head_dim 256 has one
    # set of Q buffers (the next Q loads into the same one), so it keeps waiting at once.
    gf = _gluon_fwd()
    assert head_dim not in gf.DEFERRED_STORE
    base = (head_dim, 1, 0, 2, "shipped", "shipped", "shipped", "ptx", "shipped", "shipped", "shipped")
    now = run_compiling_child(GLUON_FWD_SM90_CHILD, (*base, "0"), tmp_path / "now")
    later = run_compiling_child(GLUON_FWD_SM90_CHILD, (*base, "1"), tmp_path / "later")
    assert now.returncode == 0 and later.returncode == 0, (now.stderr[-3000:], later.stderr[-3000:])
    assert _bulk_stores_and_waits(now.stdout) == (2, 2)  # each consumer's copy, waited for at once
    if gf.q_buffers(head_dim, *gf.TILES[head_dim]) == 2:
        # no copy waited for at once; each consumer waits in its next tile and after its last
        assert _bulk_stores_and_waits(later.stdout) == (0, 4)
    else:
        assert later.stdout == now.stdout


def _untimed_release(monkeypatch):
    """This process's Triton (which has Gluon's Hopper API) as a release the kernels were not timed
    under: the measured list emptied, no opt-in set."""
    _gluon_fwd()
    monkeypatch.setattr(dispatch, "MEASURED_TRITON", frozenset())
    monkeypatch.setattr(dispatch, "_GLUON_AVAILABLE", None)
    monkeypatch.setattr(dispatch, "_UNTIMED_RELEASE", None)
    monkeypatch.delenv(dispatch.GLUON_TRITON_ENV, raising=False)


def test_an_untimed_release_is_named_with_the_opt_in_that_would_run_gluon(monkeypatch):
    import triton

    _untimed_release(monkeypatch)
    assert not dispatch.gluon_available()
    note = dispatch.untimed_release_note()
    release = "%d.%d" % dispatch.triton_version_tuple(triton.__version__)
    assert f"this is Triton {triton.__version__}" in note and f"FLASH_ATTN2_GLUON_TRITON={release}" in note
    # opted in: Gluon runs, nothing to say
    monkeypatch.setattr(dispatch, "_GLUON_AVAILABLE", None)
    monkeypatch.setattr(dispatch, "_UNTIMED_RELEASE", None)
    monkeypatch.setenv(dispatch.GLUON_TRITON_ENV, release)
    assert dispatch.gluon_available() and dispatch.untimed_release_note() is None


def test_an_sm90_bf16_call_under_an_untimed_release_warns_once_that_the_triton_kernels_run(monkeypatch):
    _untimed_release(monkeypatch)
    fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    ag = importlib.import_module(fa.__name__ + "._autograd")
    monkeypatch.setattr(ag, "_WARNED", set())
    q = torch.randn(1, 300, 4, 128, dtype=torch.bfloat16)
    dense = _opts(max_seqlen_q=None, max_seqlen_k=None)
    monkeypatch.setattr(fwd, "capability_of", lambda device: (8, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an A100 has no Gluon kernels: nothing to say
        assert not ag._gluon_wanted(q, q, q, None, None, None, dense)
        assert not ag._gluon_wanted(q.half(), q.half(), q.half(), None, None, None, dense)
    monkeypatch.setattr(fwd, "capability_of", lambda device: (9, 0))
    with pytest.warns(RuntimeWarning, match="Triton kernels run.*FLASH_ATTN2_GLUON_TRITON"):
        assert not ag._gluon_wanted(q, q, q, None, None, None, dense)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert not ag._gluon_wanted(q, q, q, None, None, None, dense)


def _unmasked_steps(sass: str, head_dim: int) -> list:
    """(PRMT, F2FP) of each SASS loop that is an unmasked key step: one key block's wgmma (S in
    head_dim/16 k-steps, P·V in BLOCK_N/16), its exponentials, and no masking select."""
    gf = _gluon_fwd()
    per_block = head_dim // 16 + gf.TILES[head_dim][0] // 16
    steps = []
    for body in sass_loops(sass):
        wgmma = sum("HGMMA" in t for t in body)
        if wgmma == per_block and any("MUFU.EX2" in t for t in body) and not any(t.split()[0].startswith("FSEL")
                                                                                 for t in body):
            steps.append((sum(t.split()[0].startswith("PRMT") for t in body), sum("F2FP" in t for t in body)))
    return steps


@pytest.mark.parametrize("head_dim", [128, 256])
def test_p_converted_two_values_an_instruction_needs_no_half_swaps(head_dim, tmp_path):
    # PACK_P (off until timed): converted one value at a time, P's pairs came out of ptxas with
    # their halves swapped and were swapped back, one PRMT per register (Triton 3.6; later
    # releases pair them themselves). In pairs: no swap, and as many conversions as before.
    gf = _gluon_fwd()
    assert head_dim not in gf.PACK_P
    base = (head_dim, 0, 0, 2, "shipped", "shipped", "shipped")
    rest = ("shipped", "shipped", "shipped", "shipped")
    shipped = run_compiling_child(GLUON_FWD_SM90_CHILD, (*base, "sass", *rest, "0"), tmp_path / "shipped")
    paired = run_compiling_child(GLUON_FWD_SM90_CHILD, (*base, "sass", *rest, "1"), tmp_path / "paired")
    ptx = run_compiling_child(GLUON_FWD_SM90_CHILD, (*base, "ptx", *rest, "1"), tmp_path / "ptx")
    assert shipped.returncode == paired.returncode == ptx.returncode == 0, (paired.stderr[-3000:], ptx.stderr[-3000:])
    before, after = _unmasked_steps(shipped.stdout, head_dim), _unmasked_steps(paired.stdout, head_dim)
    assert before and after, (before, after)
    assert all(prmt == 0 for prmt, _ in after)
    assert sorted(f2fp for _, f2fp in after) == sorted(f2fp for _, f2fp in before)
    # in the PTX every bf16 conversion is a paired one, P's through the kernel's own inline asm
    assert "cvt.rn.bf16.f32" not in ptx.stdout
    assert len(re.findall(r"begin inline asm\s*\n(?:\s*\.loc[^\n]*\n)?\s*cvt\.rn\.bf16x2\.f32", ptx.stdout)) >= 8


def _launched_choices(monkeypatch, gf, head_dim: int, causal: bool, **kwargs) -> dict:
    """The constexpr choices the Gluon forward hands its launcher for a dense bf16 call of this
    head dim (the launch itself needs an sm90 GPU; here the launcher only records)."""
    launched = []
    names = tuple(p.name for p in gf._gluon_attn_fwd.params if p.is_constexpr)
    monkeypatch.setattr(gf, "_LAUNCHERS", {key: (lambda grid, args, constexprs, warps, stages:
                                                 launched.append(dict(zip(names, constexprs))))
                                           for key in gf._LAUNCHERS})
    monkeypatch.setattr(gf, "_sm_count", lambda device: 132)
    q, k, v = (torch.randn(2, 512, 4, head_dim, dtype=torch.bfloat16) for _ in range(3))
    gf.gluon_attention_forward(q, k, v, softmax_scale=head_dim ** -0.5, causal=causal, **kwargs)
    assert len(launched) == 1
    return launched[0]


def test_non_causal_head_dim_64_runs_three_consumers_unpinned_with_p_in_pairs(monkeypatch):
    # measured 1.00 / 1.05 / 1.06x the two pinned consumers at 1k / 4k / 16k non-causal, and
    # 0.70 / 0.91 / 1.04x causal (bench/results/gluon_fwd_d64_c3pk.md): only non-causal takes it
    gf = _gluon_fwd()
    assert gf.NON_CAUSAL[64] == dict(consumers=3, pin_wait=False, pack_p=True)
    non_causal = _launched_choices(monkeypatch, gf, 64, False)
    assert (non_causal["CONSUMERS"], non_causal["PIN_WAIT"], non_causal["PACK_P"]) == (3, False, True)
    assert (non_causal["CONSUMER_REGS"], non_causal["PRODUCER_REGS"]) == gf.REGS_3[:2]
    causal = _launched_choices(monkeypatch, gf, 64, True)
    assert (causal["CONSUMERS"], causal["PIN_WAIT"], causal["PACK_P"]) == (2, True, False)
    # a keyword given to the call wins over the preset (benchmarks time the other choices so)
    two = _launched_choices(monkeypatch, gf, 64, False, consumers=2, pin_wait=True, pack_p=False)
    assert (two["CONSUMERS"], two["PIN_WAIT"], two["PACK_P"]) == (2, True, False)
    # the other head dims keep their defaults either way
    d128 = _launched_choices(monkeypatch, gf, 128, False)
    assert (d128["CONSUMERS"], d128["PIN_WAIT"]) == (2, 128 in gf.PIN_WAIT)


def test_every_non_causal_preset_names_only_choices_the_forward_takes():
    gf = _gluon_fwd()
    for head_dim, preset in gf.NON_CAUSAL.items():
        assert head_dim in gf.TILES
        assert set(preset) <= {"consumers", "pin_wait", "pack_p"}, preset
        assert preset.get("consumers", 2) in (2, 3)
        # three consumers spill with the pinned wait (bench/results/gluon_sass.md)
        assert not (preset.get("consumers") == 3 and preset.get("pin_wait", head_dim in gf.PIN_WAIT))


def test_three_unpinned_consumers_with_p_in_pairs_compile_without_half_swaps(tmp_path):
    # the non-causal head_dim 64 kernel as shipped: no PRMT half swaps in its key steps. Under the
    # releases it runs under (3.6, 3.7) nothing spills either (bench/results/triton_releases.md);
    # Triton 3.9's ptxas spills it (~70 stack stores), one reason 3.9 keeps the Triton kernels
    _gluon_fwd()
    done = run_compiling_child(GLUON_FWD_SM90_CHILD, (64, 0, 0, 3, "shipped", "0", "shipped", "sass",
                                                      "shipped", "shipped", "shipped", "shipped", "1"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = _unmasked_steps(done.stdout, 64)
    assert steps and all(prmt == 0 for prmt, _ in steps), steps
    if dispatch.triton_version_tuple(importlib.metadata.version("triton")) in dispatch.MEASURED_TRITON:
        assert "STL " not in done.stdout  # nothing spilled to local memory
