"""Random ``flash_attn_with_kvcache`` calls, bounds-checked, against the float64 reference.

Each example draws a batch of cache rows (contiguous, or paged with a shuffled block table
whose unused entries may be -1), lengths that fill a row up to its capacity, rows of padding
(``cache_seqlens`` -1, as CUDA-graph batches carry), new keys to append, several query tokens,
GQA, a head dim, causal or windowed masks, softcap, ALiBi, a split count and how a paged split
finds its pages (the shipped choice, one block-table entry a block, or one a key). Every load and
store must stay inside the launch's tensors (``interpreter_bounds``) and every row must match
attention over the keys it holds after the append; a padding row gives 0 and leaves the cache
as it was. ``pytest -m fuzz`` runs the long budget.
"""

from __future__ import annotations


import torch
from hypothesis import strategies as st

import importlib

from flash_ref import load_flash_attn2, reference
from kernel_fuzz import fuzz_tests

fa = load_flash_attn2()
decode = importlib.import_module(fa.__name__ + "._triton_decode")
PAGE = 16
# how a paged split finds its pages: (PRELOAD_MAX, PAGE_BLOCKS, PRELOADED_BLOCKS); the
# interpreter's short rows would always preload their few entries
LOOKUPS = {"shipped": (decode.PRELOAD_MAX, decode.PAGE_BLOCKS, decode.PRELOADED_BLOCKS),
           "blocks": (0, True, False), "preloaded blocks": (decode.PRELOAD_MAX, True, True),
           "per-key": (0, False, False)}

calls = st.fixed_dictionaries(dict(
    rows=st.lists(st.tuples(st.one_of(st.just(-1), st.integers(0, 64)), st.booleans()), min_size=1, max_size=3),
    # (length or -1 for a padding row, whether the table tail past the used pages is -1)
    pages_per_row=st.integers(1, 5),
    paged=st.booleans(),
    new=st.integers(0, 3),
    sq=st.integers(1, 4),
    heads=st.sampled_from([(2, 1), (4, 2), (2, 2)]),
    d=st.sampled_from([8, 32, 80, 128]),
    mask=st.sampled_from(["none", "causal", "window"]),
    window=st.tuples(st.integers(0, 30), st.integers(0, 5)),
    softcap=st.sampled_from([0.0, 25.0]),
    alibi=st.booleans(),
    splits=st.sampled_from([0, 1, 3]),
    lookup=st.sampled_from(sorted(LOOKUPS)),
))


def _run(call: dict) -> None:
    saved = decode.PRELOAD_MAX, decode.PAGE_BLOCKS, decode.PRELOADED_BLOCKS
    decode.PRELOAD_MAX, decode.PAGE_BLOCKS, decode.PRELOADED_BLOCKS = LOOKUPS[call["lookup"]]
    try:
        _check(call)
    finally:
        decode.PRELOAD_MAX, decode.PAGE_BLOCKS, decode.PRELOADED_BLOCKS = saved


def _check(call: dict) -> None:
    hq, hk = call["heads"]
    d, batch, sq, new = call["d"], len(call["rows"]), call["sq"], call["new"]
    capacity = call["pages_per_row"] * PAGE
    g = torch.Generator().manual_seed(capacity * 31 + d + batch)
    lens = [min(n, capacity - new) if n >= 0 else -1 for n, _ in call["rows"]]
    # a row must hold its queries' keys: at least sq after the append
    lens = [n if n < 0 or n + new >= sq else max(0, sq - new) for n in lens]
    if any(n >= 0 and n + new > capacity for n in lens) or (new == 0 and sq > capacity):
        return
    dt = torch.float16
    if call["paged"]:
        pool = batch * call["pages_per_row"] + 2
        k_cache = torch.randn(pool, PAGE, hk, d, generator=g).to(dt)
        v_cache = torch.randn(pool, PAGE, hk, d, generator=g).to(dt)
        table = torch.randperm(pool, generator=g)[: batch * call["pages_per_row"]].view(batch, -1).to(torch.int32)
        for b, (n, free_tail) in enumerate(call["rows"]):
            used = 0 if lens[b] < 0 else -(-(lens[b] + new) // PAGE)
            if lens[b] < 0 or free_tail:
                table[b, used:] = -1  # pages not allocated: never read or written
    else:
        table = None
        k_cache = torch.randn(batch, capacity, hk, d, generator=g).to(dt)
        v_cache = torch.randn(batch, capacity, hk, d, generator=g).to(dt)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q = torch.randn(batch, sq, hq, d, generator=g).to(dt)
    k_new = torch.randn(batch, new, hk, d, generator=g).to(dt) if new else None
    v_new = torch.randn(batch, new, hk, d, generator=g).to(dt) if new else None
    window = call["window"] if call["mask"] == "window" else (-1, -1)
    slopes = torch.rand(batch, hq, generator=g) * 0.3 if call["alibi"] else None
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                     cache_seqlens=torch.tensor(lens, dtype=torch.int32), block_table=table,
                                     causal=call["mask"] == "causal", window_size=window, softcap=call["softcap"],
                                     alibi_slopes=slopes, num_splits=call["splits"])

    def rows_of(cache: torch.Tensor, b: int, n: int) -> torch.Tensor:
        if table is None:
            return cache[b, :n]
        return torch.cat([cache[p] for p in table[b].tolist() if p >= 0])[:n] if n else cache[0, :0]

    for b, n in enumerate(lens):
        if n < 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        total = n + new
        keys, vals = rows_of(k_cache, b, total), rows_of(v_cache, b, total)
        if new:
            assert torch.equal(keys[n:], k_new[b]) and torch.equal(vals[n:], v_new[b])
        assert torch.equal(keys[:n], rows_of(k_before, b, n))
        want, _ = reference(q[b:b + 1], keys[None], vals[None], causal=call["mask"] == "causal",
                            window_size=window, softcap=call["softcap"],
                            alibi_slopes=None if slopes is None else slopes[b:b + 1])
        err = (out[b:b + 1].double() - want).abs().max().item()
        assert err <= 2e-2 * max(1.0, want.abs().max().item()), (b, n, err)
    if table is not None:  # pages no row names were not written
        named = {p for p in table.flatten().tolist() if p >= 0}
        for p in set(range(k_cache.shape[0])) - named:
            assert torch.equal(k_cache[p], k_before[p]) and torch.equal(v_cache[p], v_before[p])


# the suite's few examples, and the long budget under -m fuzz
(test_kvcache_calls_stay_in_bounds_and_match_the_reference,
 test_kvcache_calls_stay_in_bounds_and_match_the_reference_long) = fuzz_tests(_run, calls, "flash_attn_with_kvcache calls")
