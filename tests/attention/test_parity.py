"""Every backend against an fp64 reference on the same random inputs.

eager, sdpa and flex_attention run in float32; FlashAttention runs the kernel we ship (Triton under
TRITON_INTERPRET=1 on this CPU) in float32 and float16. Each case builds its mask with the
create_* builder for that backend, exactly as a model would, and compares the outputs at the real
(non-padded) query positions. Options a backend cannot honour must raise.
"""

from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass, field

import pytest
import torch

from kernel_loader.attention import (
    ALL_ATTENTION_FUNCTIONS,
    create_bidirectional_mask,
    create_bidirectional_sliding_window_mask,
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
    flash_attention_forward,
)
from kernel_loader.errors import UnsupportedAttentionOptionError

from .conftest import make_case, module, reference_attention


@dataclass
class Scenario:
    name: str
    b: int = 2
    hq: int = 4
    hkv: int = 2
    sq: int = 12
    past: int = 0
    padding: list | None = None
    causal: bool = True
    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    positions: list | None = None
    refuse: set = field(default_factory=set)  # backends that must raise


SCENARIOS = [
    Scenario("causal"),
    Scenario("causal_left_pad", padding=[(3, 0), (0, 0)]),
    Scenario("causal_right_pad", padding=[(0, 4), (0, 1)]),
    Scenario("bidirectional_pad", causal=False, padding=[(2, 0), (0, 3)]),
    Scenario("sliding_window_left_pad", window=4, padding=[(3, 0), (0, 0)]),
    Scenario("bidirectional_window", causal=False, window=2),
    Scenario("chunked_left_pad", chunk=4, padding=[(2, 0), (0, 0)], refuse={"flash"}),
    Scenario("mqa", hq=4, hkv=1, padding=[(1, 0), (0, 2)]),
    Scenario("softcap", softcap=2.0, padding=[(2, 0), (0, 0)], refuse={"sdpa"}),
    Scenario("packed", b=1, positions=[[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]),
    Scenario("packed_two_rows", b=2, window=3,
             positions=[[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]),
    Scenario("decode_left_pad", sq=1, past=9, padding=[(4, 0), (0, 0)]),
    Scenario("chunked_prefill", sq=3, past=7, padding=[(2, 0), (0, 0)]),
]

BACKENDS = [("eager", torch.float32), ("sdpa", torch.float32), ("flex_attention", torch.float32),
            ("flash", torch.float32), ("flash", torch.float16)]


def _build_mask(sc: Scenario, impl: str, x: torch.Tensor, pad, pos):
    cfg_kw = {"is_causal": sc.causal}
    if sc.window is not None:
        cfg_kw["sliding_window"] = sc.window
    if sc.chunk is not None:
        cfg_kw["attention_chunk_size"] = sc.chunk
    from types import SimpleNamespace

    cfg = SimpleNamespace(_attn_implementation=impl, **cfg_kw)
    kw = {"past_key_values_length": sc.past}
    if not sc.causal:
        builder = create_bidirectional_sliding_window_mask if sc.window else create_bidirectional_mask
        return builder(cfg, x, pad)
    if sc.chunk is not None:
        return create_chunked_causal_mask(cfg, x, pad, position_ids=pos, **kw)
    if sc.window is not None:
        return create_sliding_window_causal_mask(cfg, x, pad, position_ids=pos, **kw)
    return create_causal_mask(cfg, x, pad, position_ids=pos, **kw)


@pytest.mark.parametrize("backend,dtype", BACKENDS, ids=[f"{b}-{str(d)[6:]}" for b, d in BACKENDS])
@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_backend_matches_fp64_reference(sc: Scenario, backend: str, dtype: torch.dtype, shipped_flash):
    skv = sc.sq + sc.past
    case = make_case(b=sc.b, hq=sc.hq, hkv=sc.hkv, sq=sc.sq, skv=skv, d=16, dtype=dtype, seed=zlib.crc32(sc.name.encode()) % 1000,
                     padding=sc.padding)
    pos = torch.tensor(sc.positions) if sc.positions else None
    seq_ids = None
    if pos is not None:
        seq_ids = (torch.diff(pos, prepend=pos[:, :1] - 1) != 1).cumsum(-1)
    ref = reference_attention(case.q, case.k, case.v, causal=sc.causal, padding=case.padding, window=sc.window,
                              chunk=sc.chunk, softcap=sc.softcap, seq_ids=seq_ids, positions=pos)

    impl = "flash_attention_2" if backend == "flash" else backend
    x = torch.zeros(sc.b, sc.sq, 8, dtype=dtype)
    kwargs = dict(sliding_window=sc.window, softcap=sc.softcap, is_causal=sc.causal, position_ids=pos)

    def run():
        mask = _build_mask(sc, impl, x, case.padding, pos)
        if backend == "flash":
            return flash_attention_forward(module(sc.causal), case.q, case.k, case.v, mask, kernel=shipped_flash,
                                           **kwargs)
        return ALL_ATTENTION_FUNCTIONS[impl](module(sc.causal), case.q, case.k, case.v, mask, **kwargs)

    if backend in sc.refuse:
        with pytest.raises(UnsupportedAttentionOptionError):
            run()
        return
    out, _ = run()
    assert out.shape == (sc.b, sc.sq, sc.hq, 16) and out.is_contiguous() and out.dtype == dtype

    real_q = torch.ones(sc.b, sc.sq, dtype=torch.bool) if case.padding is None else case.padding[:, sc.past:]
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(out.double()[real_q], ref[real_q], atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def shipped_flash():
    """The shipped FlashAttention kernel, imported through the loader (Triton under TRITON_INTERPRET)."""
    from kernel_loader.loader import get_bundled_kernel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_bundled_kernel("kernels-community/flash-attn2")


def test_all_backends_agree_pairwise(shipped_flash):
    """eager/sdpa/flex/flash outputs agree with each other, not only with the reference."""
    case = make_case(b=2, hq=4, hkv=2, sq=10, padding=[(2, 0), (0, 3)], seed=7)
    outs = {}
    for impl in ("eager", "sdpa", "flex_attention", "flash_attention_2"):
        mask = create_sliding_window_causal_mask(
            __import__("types").SimpleNamespace(_attn_implementation=impl, sliding_window=3),
            torch.zeros(2, 10, 8), case.padding)
        fn = (lambda *a, **k: flash_attention_forward(*a, kernel=shipped_flash, **k)) if impl.startswith("flash") \
            else ALL_ATTENTION_FUNCTIONS[impl]
        outs[impl], _ = fn(module(), case.q, case.k, case.v, mask, sliding_window=3)
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            torch.testing.assert_close(outs[a][case.padding], outs[b][case.padding], atol=2e-5, rtol=2e-5,
                                       msg=lambda m, a=a, b=b: f"{a} vs {b}: {m}")
